//! Bearer-token auth. The token lives in `<data-dir>/api-token`, created
//! with mode 0600 at first start; a token file readable by others is
//! refused. Every mutating request needs `Authorization: Bearer <token>`,
//! and, when the service listens beyond loopback, every request does.
//!
//! Tokens are compared in constant time: both sides are hashed (so their
//! lengths do not show) and the digests compared with a branch-free fold.

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

use axum::extract::{Request, State};
use axum::http::{Method, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};

use super::AppState;
use super::error::ApiError;

/// Who may do what.
pub struct Auth {
    digest: [u8; 32],
    /// True when listening beyond loopback: reads need the token too.
    everywhere: bool,
}

impl Auth {
    pub fn new(token: &str, everywhere: bool) -> Self {
        Self {
            digest: Sha256::digest(token.as_bytes()).into(),
            everywhere,
        }
    }

    /// Constant-time comparison of a presented token with ours.
    pub fn accepts(&self, presented: &str) -> bool {
        let theirs: [u8; 32] = Sha256::digest(presented.as_bytes()).into();
        let diff = self
            .digest
            .iter()
            .zip(theirs.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        std::hint::black_box(diff) == 0
    }

    fn needed(&self, method: &Method, host: Option<&str>) -> bool {
        self.everywhere
            || !matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS)
            || !host.is_some_and(is_loopback_host)
    }
}

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
pub fn ensure_token(data_dir: &Path) -> std::io::Result<String> {
    std::os::unix::fs::DirBuilderExt::mode(std::fs::DirBuilder::new().recursive(true), 0o700)
        .create(data_dir)?;
    let path = data_dir.join("api-token");
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
    {
        Ok(mut file) => {
            let mut bytes = [0u8; 32];
            std::fs::File::open("/dev/urandom")
                .and_then(|mut r| std::io::Read::read_exact(&mut r, &mut bytes))?;
            let token = hex::encode(bytes);
            file.write_all(token.as_bytes())?;
            file.sync_all()?;
            Ok(token)
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let mode = std::fs::metadata(&path)?.permissions().mode();
            if mode & 0o077 != 0 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::PermissionDenied,
                    format!(
                        "{} is readable by others (mode {:o}); run `chmod 600` on it",
                        path.display(),
                        mode & 0o777
                    ),
                ));
            }
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

/// The middleware: 401 with `WWW-Authenticate: Bearer` when a needed token
/// is missing or wrong.
pub async fn require_token(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(str::to_ascii_lowercase);
    if !state.auth.needed(req.method(), host.as_deref()) {
        return next.run(req).await;
    }
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    match presented {
        Some(token) if state.auth.accepts(token) => next.run(req).await,
        Some(_) => ApiError::Unauthorized("wrong bearer token").into_response(),
        None => ApiError::Unauthorized("missing bearer token (Authorization: Bearer <token>)")
            .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_without_a_token_only_for_loopback_host_names() {
        let auth = Auth::new("t", false);
        for host in [
            "127.0.0.1:7878",
            "localhost:7878",
            "localhost",
            "[::1]:7878",
            "127.0.0.1",
        ] {
            assert!(!auth.needed(&Method::GET, Some(host)), "{host}");
        }
        for host in [
            "attacker.example:7878",
            "127.0.0.1.evil:80",
            "10.0.0.1:7878",
            "[::2]:1",
        ] {
            assert!(auth.needed(&Method::GET, Some(host)), "{host}");
        }
        assert!(auth.needed(&Method::GET, None), "no Host header");
        assert!(auth.needed(&Method::POST, Some("127.0.0.1:7878")));
    }

    #[test]
    fn only_the_exact_token_is_accepted() {
        let auth = Auth::new("s3cret", false);
        assert!(auth.accepts("s3cret"));
        assert!(!auth.accepts("s3cre"));
        assert!(!auth.accepts("s3cretx"));
        assert!(!auth.accepts(""));
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
