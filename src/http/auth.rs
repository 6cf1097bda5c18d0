//! Who is asking, and what they may do.
//!
//! Every request gets a [`Principal`] before any handler runs:
//! - on the **Unix socket**, the peer's credentials (`SO_PEERCRED`, read
//!   by the kernel when it connected; [`super::peer`]): no token. Root and
//!   members of `--admin-group` are admins;
//! - over **TCP**, a bearer token (`Authorization: Bearer`), looked up by
//!   its SHA-256 in the ledger on every request, so a revoked token is
//!   refused at once and a new one works at once. A token's scope bounds
//!   the request: `read` reads, `spawn` also spawns (and kills and resolves
//!   what it spawned), `admin` everything. Without a token: `/healthz`,
//!   `/readyz`, `/metrics` and `/login` on loopback, and every read on
//!   loopback under `--open-reads` (the single-tenant choice);
//! - for reads only, the dashboard's session cookie ([`super::login`]): a
//!   random secret that names a session in this process's memory, never a
//!   token. It reads as its token with scope `read`, and only while that
//!   token is live. A cookie is not looked at on a mutating request, so no
//!   page anywhere (another port of this host included) can write with it.
//!
//! What a principal may do to one tree is [`Principal::may_see`] and
//! [`Principal::may_act_on`], called by the handlers once the tree is read.
//!
//! Tokens are matched by the SHA-256 of what is presented (an index
//! lookup): a secret of 256 random bits cannot be found by timing a
//! comparison of its hash. The secret itself is never stored.

use std::io::Write;
use std::path::Path;

use axum::extract::{ConnectInfo, Request, State};
use axum::http::{HeaderMap, Method, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};

use super::AppState;
use super::error::{ApiError, known};
use super::login::Sessions;
use super::peer::{Peer, PeerCred};
use crate::ledger::fsmode::Mode as _;
use crate::ledger::{Requester, TokenScope, TreeRow};

/// The cookie older versions' login set, which held the token itself: never
/// read, and cleared by every login.
pub const LEGACY_COOKIE: &str = "treewarden_token";

/// How the service authenticates: set once from `serve`'s flags.
#[derive(Clone, Debug, Default)]
pub struct Auth {
    /// Listening beyond loopback: every TCP request needs a token.
    everywhere: bool,
    /// `--open-reads`: reads on loopback need no token (one tenant only).
    open_reads: bool,
    /// `--admin-group`: its members act on every tree over the socket.
    admin_gid: Option<u32>,
    /// The dashboard's sessions (`--session-ttl`), shared by every
    /// listener of this process.
    sessions: std::sync::Arc<Sessions>,
}

impl Auth {
    pub fn new(everywhere: bool, open_reads: bool, admin_gid: Option<u32>) -> Self {
        Self {
            everywhere,
            open_reads,
            admin_gid,
            sessions: Default::default(),
        }
    }

    /// The same, with these dashboard sessions (default: a cookie named
    /// `treewarden_session`, [`super::login::DEFAULT_TTL`]).
    pub fn with_sessions(mut self, sessions: Sessions) -> Self {
        self.sessions = std::sync::Arc::new(sessions);
        self
    }

    /// The dashboard's sessions.
    pub fn sessions(&self) -> &Sessions {
        &self.sessions
    }

    /// Whether a socket peer is an admin: root, or in the admin group (its
    /// gid, or the user database's groups of its uid).
    fn is_admin(&self, cred: &PeerCred) -> bool {
        // Root, and the service's own user (it owns the ledger file anyway:
        // a developer's `serve` under their own uid).
        if cred.uid == 0 || cred.uid == crate::service::users::own_uid() {
            return true;
        }
        let Some(admin) = self.admin_gid else {
            return false;
        };
        crate::service::users::in_group(cred.uid, cred.gid, admin)
    }
}

/// Who is asking.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Principal {
    /// A local process on the Unix socket.
    Local { cred: PeerCred, admin: bool },
    /// A bearer token over TCP.
    Token {
        id: i64,
        name: String,
        scope: TokenScope,
    },
    /// No credentials: the open endpoints, and reads under `--open-reads`.
    Anonymous,
}

impl Principal {
    /// The principal as the ledger records it.
    pub fn requester(&self) -> Requester {
        match self {
            Principal::Local { cred, .. } => Requester {
                via: "socket".into(),
                uid: Some(cred.uid),
                pid: cred.pid,
                ..Requester::default()
            },
            Principal::Token { id, name, .. } => Requester {
                via: "tcp".into(),
                token_id: Some(*id),
                token_name: Some(name.clone()),
                ..Requester::default()
            },
            Principal::Anonymous => Requester {
                via: "tcp".into(),
                ..Requester::default()
            },
        }
    }

    /// Whether it reads every tree (else only its own).
    pub fn sees_all(&self) -> bool {
        match self {
            Principal::Local { admin, .. } => *admin,
            // Any token, and loopback under --open-reads (else the request
            // never got this far).
            Principal::Token { .. } | Principal::Anonymous => true,
        }
    }

    /// Whether it kills and resolves every tree (else only its own).
    pub fn acts_on_all(&self) -> bool {
        match self {
            Principal::Local { admin, .. } => *admin,
            Principal::Token { scope, .. } => *scope == TokenScope::Admin,
            Principal::Anonymous => false,
        }
    }

    /// Whether it asked for `tree`: the same uid on the socket, the same
    /// token over TCP.
    pub fn owns(&self, tree: &TreeRow) -> bool {
        match self {
            Principal::Local { cred, .. } => tree.requester_uid == Some(cred.uid),
            Principal::Token { id, .. } => tree
                .requested_by
                .as_ref()
                .is_some_and(|r| r.token_id == Some(*id)),
            Principal::Anonymous => false,
        }
    }

    /// 404 unless it may read `tree`: to a principal that may not see it,
    /// another's tree is answered as an unknown one is, word for word, so
    /// the status does not tell which ids exist.
    pub fn may_see(&self, tree: &TreeRow) -> Result<(), ApiError> {
        if self.sees_all() || self.owns(tree) {
            return Ok(());
        }
        Err(ApiError::NotFound(format!("unknown tree {}", tree.id)))
    }

    /// 404 unless it may read `tree` (see [`Principal::may_see`]); 403
    /// unless it may also kill or resolve it.
    pub fn may_act_on(&self, tree: &TreeRow) -> Result<(), ApiError> {
        self.may_see(tree)?;
        if self.acts_on_all() || self.owns(tree) {
            return Ok(());
        }
        Err(ApiError::Forbidden(format!(
            "tree {} was not asked for by you ({}); only its requester and admins may act on it",
            tree.id,
            self.requester()
        )))
    }

    /// The trees a principal that does not see all may list: its own, as
    /// the ledger selects them (so a page, and its `Link`, holds no other id).
    pub fn own_trees(&self) -> crate::ledger::TreeOwner {
        match self {
            Principal::Local { cred, .. } => crate::ledger::TreeOwner::Uid(cred.uid),
            Principal::Token { id, .. } => crate::ledger::TreeOwner::Token(*id),
            Principal::Anonymous => crate::ledger::TreeOwner::Nobody,
        }
    }

    /// 403 unless it reads every tree (events, export, streams and the
    /// dashboard span every tree).
    pub fn must_see_all(&self, what: &str) -> Result<(), ApiError> {
        if self.sees_all() {
            return Ok(());
        }
        Err(ApiError::Forbidden(format!(
            "{what} spans every tree: admins only on the socket (use /api/trees for your own)"
        )))
    }
}

/// The SHA-256 of a token, as the ledger keys it (64 lowercase hex digits).
pub fn token_hash(token: &str) -> String {
    hex::encode(Sha256::digest(token.trim().as_bytes()))
}

pub use crate::service::users::new_secret;

/// Whether a `Host` header names this machine's loopback. Reads on loopback
/// need no token only when the request says it is for loopback: a page in a
/// local browser that rebinds its own domain to 127.0.0.1 sends its own
/// name, and then needs the token it does not have (DNS rebinding).
fn is_loopback_host(host: &str) -> bool {
    let name = if let Some(rest) = host.strip_prefix('[') {
        rest.split_once(']').map_or(rest, |(n, _)| n)
    } else {
        host.rsplit_once(':').map_or(host, |(n, port)| {
            if port.bytes().all(|b| b.is_ascii_digit()) {
                n
            } else {
                host
            }
        })
    };
    matches!(name, "localhost" | "127.0.0.1" | "::1")
}

/// Reads the token, creating it (0600, 32 random bytes as hex) on first start.
/// On Windows there are no mode bits: the file is as private as the data
/// dir's ACL (by default the user's own profile's: the user, SYSTEM and
/// Administrators), which is what keeps the ledger private there too.
pub fn ensure_token(data_dir: &Path) -> std::io::Result<String> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(data_dir)?;
    let path = data_dir.join("api-token");
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
    {
        Ok(mut file) => {
            let token = new_secret()?;
            file.write_all(token.as_bytes())?;
            file.sync_all()?;
            Ok(token)
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            crate::service::users::refuse_if_open_to_others(&path)?;
            let token = std::fs::read_to_string(&path)?.trim().to_string();
            if token.is_empty() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("{} is empty", path.display()),
                ));
            }
            Ok(token)
        }
        Err(e) => Err(e),
    }
}

/// Paths that answer without a token on loopback: no per-tree data.
fn open_path(path: &str) -> bool {
    matches!(path, "/healthz" | "/readyz" | "/metrics" | "/login")
}

fn is_read(method: &Method) -> bool {
    matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS)
}

/// What a request presents to say who it is.
enum Presented {
    /// The bearer header's token (empty when the header is malformed).
    Bearer(String),
    /// The dashboard's session cookie (reads only).
    Session(String),
}

/// The credential a request presents: the bearer header, or (reads only,
/// so no form anywhere can use it to change anything) this instance's
/// session cookie. No other cookie is read.
fn presented(method: &Method, headers: &HeaderMap, cookie: &str) -> Option<Presented> {
    if let Some(v) = headers.get(header::AUTHORIZATION) {
        return Some(Presented::Bearer(
            v.to_str()
                .ok()
                .and_then(|v| v.strip_prefix("Bearer "))
                .map(str::trim)
                .unwrap_or("")
                .to_string(),
        ));
    }
    if !is_read(method) {
        return None;
    }
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|c| c.trim().split_once('='))
        .find(|(k, _)| *k == cookie)
        .map(|(_, v)| Presented::Session(v.trim().to_string()))
}

/// The principal of a TCP request, or why it is refused.
async fn tcp_principal(
    state: &AppState,
    method: Method,
    path: String,
    headers: HeaderMap,
) -> Result<Principal, ApiError> {
    let path = path.as_str();
    let host = headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(str::to_ascii_lowercase);
    let loopback = !state.auth.everywhere && host.as_deref().is_some_and(is_loopback_host);
    let read = is_read(&method);
    // The open paths answer without a lookup, whatever is presented: a
    // probe or a scraper that sends its token anyway never waits on the
    // ledger (`/healthz` must answer while a recovery keeps it busy).
    if path == "/login" || (loopback && read && open_path(path)) {
        return Ok(Principal::Anonymous);
    }
    let sessions = state.auth.sessions();
    let token = match presented(&method, &headers, sessions.cookie_name()) {
        Some(Presented::Bearer(t)) => t,
        // A session reads (the cookie is never presented on a write).
        Some(Presented::Session(secret)) => {
            return match sessions.principal(state, &secret).await? {
                Some(p) => Ok(p),
                None if loopback && state.auth.open_reads => Ok(Principal::Anonymous),
                None => Err(ApiError::Unauthorized(
                    "the dashboard session has ended (expired, its token revoked, or the service restarted): sign in again",
                )),
            };
        }
        None if loopback && read && state.auth.open_reads => return Ok(Principal::Anonymous),
        None => {
            return Err(ApiError::Unauthorized(
                "missing bearer token (Authorization: Bearer <token>)",
            ));
        }
    };
    let principal = lookup_token(state, &token)
        .await?
        .ok_or(ApiError::Unauthorized("unknown or revoked bearer token"))?;
    if let Principal::Token { scope, name, .. } = &principal
        && !read
        && path != "/login"
        && *scope < TokenScope::Spawn
    {
        return Err(ApiError::Forbidden(format!(
            "token {name:?} has scope {}: it reads, and may not {} {}",
            scope.as_str(),
            method,
            path
        )));
    }
    Ok(principal)
}

/// The live token `token` names, read from the ledger now (no cache: a
/// revocation is effective on the next request).
pub async fn lookup_token(state: &AppState, token: &str) -> Result<Option<Principal>, ApiError> {
    if token.is_empty() {
        return Ok(None);
    }
    let hash = token_hash(token);
    let row = state.service.door().token_by_hash(hash).await?;
    Ok(row.map(|r| Principal::Token {
        id: r.id,
        name: r.name,
        scope: r.scope,
    }))
}

/// A browser's GET of a dashboard page (not the API, not the open paths).
fn wants_page(req: &Request) -> bool {
    let path = req.uri().path();
    req.method() == Method::GET
        && !path.starts_with("/api/")
        && !open_path(path)
        && req
            .headers()
            .get(header::ACCEPT)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|a| a.contains("text/html"))
}

/// The login form's address for a browser that asked for `uri`: `next` is
/// its path and query, percent-encoded (the form checks it again).
fn login_for(uri: &axum::http::Uri) -> String {
    let target = uri.path_and_query().map_or("/", |pq| pq.as_str());
    if target == "/" {
        return "/login".into();
    }
    let next: String = form_urlencoded::byte_serialize(target.as_bytes()).collect();
    format!("/login?next={next}")
}

/// The middleware: puts the request's [`Principal`] in its extensions, or
/// answers 401 (no or an unknown token; `WWW-Authenticate: Bearer`) or 403
/// (a token whose scope is too small; a socket peer whose credentials
/// could not be read).
pub async fn authenticate(State(state): State<AppState>, mut req: Request, next: Next) -> Response {
    let peer = req.extensions().get::<ConnectInfo<Peer>>().map(|c| c.0);
    let principal = match peer {
        Some(Peer::Unix(Some(cred))) => {
            // The user database is read (on the blocking pool) only when an
            // admin group is configured and the peer is not root.
            let admin = if state.auth.admin_gid.is_none() || cred.uid == 0 {
                state.auth.is_admin(&cred)
            } else {
                let auth = state.auth.clone();
                tokio::task::spawn_blocking(move || auth.is_admin(&cred))
                    .await
                    .unwrap_or(false)
            };
            Principal::Local { cred, admin }
        }
        Some(Peer::Unix(None)) => {
            return ApiError::Forbidden("the peer's credentials could not be read".into())
                .into_response();
        }
        // A request without connect info (an in-process router test) is
        // treated as TCP: the stricter face.
        Some(Peer::Tcp(_)) | None => match tcp_principal(
            &state,
            req.method().clone(),
            req.uri().path().to_string(),
            req.headers().clone(),
        )
        .await
        {
            Ok(p) => p,
            // A browser asking for a dashboard page is sent to the form,
            // which returns it here once signed in.
            Err(ApiError::Unauthorized(_)) if wants_page(&req) => {
                return axum::response::Redirect::to(&login_for(req.uri())).into_response();
            }
            Err(e) => return e.into_response(),
        },
    };
    req.extensions_mut().insert(principal);
    next.run(req).await
}

/// A tree from the path (`/api/trees/{id}/...`) and the request's principal
/// (set by [`authenticate`] before any handler), checked before the handler
/// runs: the row is read, then 404 unless the principal may see it
/// ([`Principal::may_see`]) and, with `ACT`, 403 unless it may act on it
/// ([`Principal::may_act_on`]). Written once for every handler that reads
/// or acts on a tree.
pub struct TreeFor<const ACT: bool> {
    pub row: TreeRow,
    pub principal: Principal,
}

/// A tree the request's principal may act on (kill, resolve).
pub type ActOnTree = TreeFor<true>;

/// A tree the request's principal may read.
pub type SeeTree = TreeFor<false>;

impl<const ACT: bool> axum::extract::FromRequestParts<AppState> for TreeFor<ACT> {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        let super::error::TreePath(id) =
            super::error::TreePath::from_request_parts(parts, state).await?;
        let principal = parts
            .extensions
            .get::<Principal>()
            .cloned()
            .ok_or_else(|| ApiError::Internal("no principal on the request".into()))?;
        let row = known(state.service.door().tree(id).await?, id)?;
        if ACT {
            principal.may_act_on(&row)?;
        } else {
            principal.may_see(&row)?;
        }
        Ok(TreeFor { row, principal })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn loopback_host_names_only() {
        for host in [
            "127.0.0.1:7878",
            "localhost:7878",
            "localhost",
            "[::1]:7878",
            "127.0.0.1",
        ] {
            assert!(is_loopback_host(host), "{host}");
        }
        for host in [
            "attacker.example:7878",
            "127.0.0.1.evil:80",
            "10.0.0.1:7878",
            "[::2]:1",
        ] {
            assert!(!is_loopback_host(host), "{host}");
        }
    }

    #[test]
    fn a_token_is_keyed_by_its_sha256() {
        assert_eq!(token_hash("s3cret"), token_hash(" s3cret\n"));
        assert_ne!(token_hash("s3cret"), token_hash("s3cre"));
        assert_eq!(token_hash("x").len(), 64);
        let a = new_secret().expect("secret");
        assert_eq!(a.len(), 64);
        assert_ne!(a, new_secret().expect("secret"));
    }

    fn tree(uid: Option<u32>, token: Option<i64>) -> TreeRow {
        TreeRow {
            owner: crate::ledger::OwnerRow {
                kind: crate::ledger::OwnerKind::Service,
                ..TreeRow::example().owner
            },
            requester_uid: uid,
            requested_by: Some(Requester {
                via: "test".into(),
                uid,
                token_id: token,
                ..Requester::default()
            }),
            ..TreeRow::example()
        }
    }

    #[test]
    fn who_may_act_on_which_tree() {
        let user = Principal::Local {
            cred: PeerCred {
                pid: Some(10),
                uid: 1000,
                gid: 1000,
            },
            admin: false,
        };
        let root = Principal::Local {
            cred: PeerCred {
                pid: Some(11),
                uid: 0,
                gid: 0,
            },
            admin: true,
        };
        let spawn = Principal::Token {
            id: 3,
            name: "ci".into(),
            scope: TokenScope::Spawn,
        };
        let mine = tree(Some(1000), None);
        let roots = tree(Some(0), None);
        let tokens = tree(None, Some(3));
        assert!(user.may_act_on(&mine).is_ok());
        assert!(user.may_act_on(&roots).is_err());
        assert!(user.may_see(&roots).is_err());
        assert!(user.may_act_on(&tokens).is_err());
        assert!(root.may_act_on(&mine).is_ok() && root.may_act_on(&tokens).is_ok());
        assert!(spawn.may_act_on(&tokens).is_ok());
        assert!(spawn.may_act_on(&mine).is_err());
        assert!(spawn.may_see(&mine).is_ok(), "every token reads");
        assert!(Principal::Anonymous.may_act_on(&mine).is_err());
    }

    #[test]
    fn the_token_file_is_created_0600_and_read_back() {
        let dir = tempfile::tempdir().expect("tmp");
        let a = ensure_token(dir.path()).expect("create");
        let b = ensure_token(dir.path()).expect("read");
        assert_eq!(a, b);
        assert_eq!(a.len(), 64);
        let mode = std::fs::metadata(dir.path().join("api-token"))
            .expect("meta")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        std::fs::set_permissions(
            dir.path().join("api-token"),
            std::fs::Permissions::from_mode(0o644),
        )
        .expect("chmod");
        assert!(ensure_token(dir.path()).is_err());
    }
}
