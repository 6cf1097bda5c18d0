//! The dashboard's login and its sessions (no JavaScript anywhere).
//!
//! `POST /login` takes a token typed into the form and exchanges it for a
//! server-side [`Sessions`] entry; the browser gets only the session's own
//! random secret, in an HttpOnly, SameSite=Strict cookie. The token never
//! leaves the login request: it is in no `Set-Cookie`, no page, no
//! redirect. A browser sends its cookies to every port of a host (cookies
//! ignore ports), so another local user's server on another loopback port
//! receives the cookie; what it receives is a secret that only this
//! process knows, that only reads, and that dies with its expiry, with its
//! token's revocation, and with this process.
//!
//! A session:
//! - is stored by the SHA-256 of its secret (the secret itself is kept
//!   nowhere), in this process's memory: a restart signs every browser out;
//! - reads, whatever its token's scope: it authenticates as its token with
//!   scope `read`, and a cookie is never even looked at on a mutating
//!   request ([`super::auth`]);
//! - ends at a fixed time after login (`serve --session-ttl`, 12 h by
//!   default; the cookie's `Max-Age` says the same), not extended by use;
//! - ends at once when its token is revoked: every request looks the token
//!   up again by its hash, as a bearer request does.
//!
//! The cookie is named for this instance (`treewarden_session_<ledger
//! instance>_<port>`), so two services on one host each find their own.
//! It has no `__Host-` prefix: that prefix needs `Secure`, which a cookie
//! set over plain HTTP on loopback cannot carry everywhere. The name only
//! keeps services apart; the protection is that the value is worthless
//! anywhere but here, and for anything but reading.
//!
//! The form returns to the page that sent the browser to it (`next`): only
//! a path on this origin is followed ([`safe_next`]); anything else goes to
//! `/`, so the login is no open redirect.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use askama::Template;
use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::response::{AppendHeaders, Html, IntoResponse, Response};
use serde::Deserialize;

use super::AppState;
use super::auth::{LEGACY_COOKIE, Principal, lookup_token, new_secret, token_hash};
use super::error::ApiError;
use crate::ledger::TokenScope;

/// How long a session lives by default: a working day, then sign in again.
pub const DEFAULT_TTL: Duration = Duration::from_secs(12 * 3600);

/// Sessions held at once at most. Each needs a live token to make; past
/// the bound the one closest to its end is dropped, so a loop of logins
/// cannot grow the service's memory.
const MAX_SESSIONS: usize = 4096;

/// The longest `next` followed after login.
const MAX_NEXT: usize = 2048;

/// One session: which token made it (by id and by the hash the ledger keys
/// it by, to look it up again on every request), and when it ends.
#[derive(Clone, Debug)]
struct Session {
    token_id: i64,
    token_sha256: String,
    ends: Instant,
}

/// The dashboard's sessions, in memory (see the module header).
#[derive(Debug)]
pub struct Sessions {
    /// The cookie's name, naming this instance.
    cookie: String,
    ttl: Duration,
    /// Keyed by the SHA-256 (hex) of the session's secret.
    live: Mutex<HashMap<String, Session>>,
}

impl Default for Sessions {
    fn default() -> Self {
        Self::new("treewarden_session".into(), DEFAULT_TTL)
    }
}

impl Sessions {
    /// Sessions whose cookie is `cookie` (a cookie-name token: letters,
    /// digits, `_`) and which end `ttl` after login.
    pub fn new(cookie: String, ttl: Duration) -> Self {
        Self {
            cookie,
            ttl,
            live: Mutex::new(HashMap::new()),
        }
    }

    /// Sessions for the service of ledger `instance` listening on `port`:
    /// the cookie carries both (the instance's first 8 hex digits, as its
    /// cgroups do).
    pub fn for_instance(instance: &str, port: u16, ttl: Duration) -> Self {
        let short: String = instance
            .chars()
            .filter(char::is_ascii_alphanumeric)
            .take(8)
            .collect();
        Self::new(format!("treewarden_session_{short}_{port}"), ttl)
    }

    /// The cookie's name.
    pub fn cookie_name(&self) -> &str {
        &self.cookie
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Session>> {
        // A panic while holding the map cannot leave a half-made session
        // (each change is one insert or remove): the map stays usable.
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A new session for token `token_id` (whose SHA-256 is
    /// `token_sha256`): its secret, which only the cookie holds.
    fn open(&self, token_id: i64, token_sha256: String) -> std::io::Result<String> {
        let secret = new_secret()?;
        let now = Instant::now();
        let mut live = self.lock();
        live.retain(|_, s| s.ends > now);
        if live.len() >= MAX_SESSIONS
            && let Some(oldest) = live
                .iter()
                .min_by_key(|(_, s)| s.ends)
                .map(|(k, _)| k.clone())
        {
            live.remove(&oldest);
        }
        live.insert(
            token_hash(&secret),
            Session {
                token_id,
                token_sha256,
                ends: now + self.ttl,
            },
        );
        Ok(secret)
    }

    /// The principal of a request that presents session `secret`: its
    /// token with scope `read`, if the session is live and its token is
    /// still live (read from the ledger now). A session found dead is
    /// forgotten.
    pub async fn principal(
        &self,
        state: &AppState,
        secret: &str,
    ) -> Result<Option<Principal>, ApiError> {
        if secret.is_empty() {
            return Ok(None);
        }
        let key = token_hash(secret);
        let session = {
            let mut live = self.lock();
            match live.get(&key) {
                None => return Ok(None),
                Some(s) if s.ends <= Instant::now() => {
                    live.remove(&key);
                    return Ok(None);
                }
                Some(s) => s.clone(),
            }
        };
        let hash = session.token_sha256.clone();
        let row = state.service.door().token_by_hash(hash).await?;
        match row {
            Some(r) if r.id == session.token_id => Ok(Some(Principal::Token {
                id: r.id,
                name: r.name,
                scope: TokenScope::Read,
            })),
            _ => {
                self.lock().remove(&key);
                Ok(None)
            }
        }
    }

    /// The `Set-Cookie` value that hands `secret` to the browser.
    fn set_cookie(&self, secret: &str) -> String {
        let max_age = self.ttl.as_secs().max(1);
        format!(
            "{}={secret}; HttpOnly; SameSite=Strict; Path=/; Max-Age={max_age}",
            self.cookie
        )
    }
}

/// `next` if it names a path on this origin, else `/`. Followed only when
/// it starts with one `/` and holds nothing a browser could read as
/// another host or scheme: no `//` or `/\` start (a network-path
/// reference), no backslash anywhere (browsers read it as `/`), no control
/// character or space, and no more than [`MAX_NEXT`] bytes.
pub fn safe_next(next: Option<&str>) -> &str {
    let Some(n) = next else { return "/" };
    let bytes = n.as_bytes();
    let ok = n.len() <= MAX_NEXT
        && bytes.first() == Some(&b'/')
        && !matches!(bytes.get(1), Some(b'/' | b'\\'))
        && bytes.iter().all(|&b| b.is_ascii_graphic() && b != b'\\');
    if ok { n } else { "/" }
}

#[derive(Template)]
#[template(path = "login.html")]
struct LoginPage<'a> {
    /// Why the form is shown again (empty: first visit).
    message: &'a str,
    /// Where a successful login goes (already checked by [`safe_next`]).
    next: &'a str,
}

fn page(message: &str, next: Option<&str>) -> Result<Html<String>, ApiError> {
    LoginPage {
        message,
        next: safe_next(next),
    }
    .render()
    .map(Html)
    .map_err(|e| ApiError::Internal(format!("rendering the login page: {e}")))
}

#[derive(Deserialize)]
pub struct NextQuery {
    next: Option<String>,
}

#[derive(Deserialize)]
pub struct LoginForm {
    token: String,
    next: Option<String>,
}

/// `GET /login[?next=PATH]`: the form.
pub async fn form(Query(q): Query<NextQuery>) -> Result<Html<String>, ApiError> {
    page("", q.next.as_deref())
}

/// `POST /login`: a live token opens a session, sets its cookie (and
/// clears the cookie older versions set, which held the token itself), and
/// goes to `next` (or `/`); anything else is 401 with the form again.
pub async fn submit(
    State(s): State<AppState>,
    axum::Form(f): axum::Form<LoginForm>,
) -> Result<Response, ApiError> {
    let token = f.token.trim();
    let next = safe_next(f.next.as_deref());
    let Some(Principal::Token { id, .. }) = lookup_token(&s, token).await? else {
        return Ok((
            StatusCode::UNAUTHORIZED,
            page("That token is unknown or revoked.", Some(next))?,
        )
            .into_response());
    };
    let sessions = s.auth.sessions();
    let secret = sessions
        .open(id, token_hash(token))
        .map_err(|e| ApiError::Internal(format!("random bytes for a session: {e}")))?;
    Ok((
        StatusCode::SEE_OTHER,
        AppendHeaders([
            (header::SET_COOKIE, sessions.set_cookie(&secret)),
            (
                header::SET_COOKIE,
                format!("{LEGACY_COOKIE}=; HttpOnly; SameSite=Strict; Path=/; Max-Age=0"),
            ),
            (header::LOCATION, next.to_string()),
        ]),
    )
        .into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn next_is_followed_only_to_a_path_on_this_origin() {
        for ok in [
            "/",
            "/trees/12",
            "/?all=1&state=running",
            "/events?kind=kill.",
            "/http://x",
        ] {
            assert_eq!(safe_next(Some(ok)), ok, "{ok}");
        }
        for bad in [
            "//evil.example/",
            "/\\evil.example",
            "\\\\evil.example",
            "http://evil.example/",
            "https:evil.example",
            "javascript:alert(1)",
            "evil.example",
            "/trees/1\\..\\",
            "/\t/evil.example",
            "/ /evil.example",
            "/a\nb",
            "",
        ] {
            assert_eq!(safe_next(Some(bad)), "/", "{bad:?}");
        }
        assert_eq!(safe_next(None), "/");
        assert_eq!(safe_next(Some(&format!("/{}", "a".repeat(MAX_NEXT)))), "/");
    }

    #[test]
    fn a_session_cookie_names_its_instance_and_port_and_ends() {
        let s = Sessions::for_instance("0123456789abcdef0123456789abcdef", 8182, DEFAULT_TTL);
        assert_eq!(s.cookie_name(), "treewarden_session_01234567_8182");
        let c = s.set_cookie("s3cret");
        assert!(c.starts_with("treewarden_session_01234567_8182=s3cret;"));
        assert!(c.contains("HttpOnly") && c.contains("SameSite=Strict"));
        assert!(c.contains(&format!("Max-Age={}", 12 * 3600)), "{c}");
    }

    #[test]
    fn sessions_are_kept_by_hash_and_bounded() {
        let s = Sessions::new("c".into(), DEFAULT_TTL);
        let secret = s.open(1, token_hash("tok")).expect("session");
        assert_eq!(secret.len(), 64);
        let live = s.lock();
        assert!(!live.contains_key(&secret), "the secret itself is not kept");
        assert!(live.contains_key(&token_hash(&secret)));
        drop(live);
        for _ in 0..MAX_SESSIONS + 10 {
            s.open(1, token_hash("tok")).expect("session");
        }
        assert_eq!(s.lock().len(), MAX_SESSIONS);
    }
}
