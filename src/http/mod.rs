//! The HTTP face of the service: `router(state) -> Router`, kept apart from
//! serving so tests can drive it. JSON API under `/api`, the dashboard at
//! `/`, `/metrics`, `/healthz`, `/readyz`, and the OpenAPI document.
//!
//! Layers, outermost first: request tracing (tower-http), the JSON shape of
//! every error under `/api` (so the layers' own 408/413 are JSON too), a
//! request timeout, a body limit (1 MiB; bigger bodies are 413), then
//! authentication: every request gets its principal (peer credentials on
//! the Unix socket, a scoped token over TCP; [`auth`]), which the handlers
//! check against the tree they act on.
//!
//! This module never signals or waits for a process and never opens the
//! ledger: it parses, calls [`crate::service::Service`] (spawns,
//! teardowns, resolves, the two events it records, and reads through
//! `Service::read`, on the blocking pool), and maps the answer to a status
//! in one place ([`error::ApiError`]). Beside the service it calls `proc`
//! for the user database, a peer's credentials, random bytes and the
//! descriptor limit, and `custody`'s read-only helpers (a live tree's
//! cgroup usage, an owner's liveness, the captured log).

pub mod api;
pub mod auth;
pub mod closer;
pub mod conn;
pub mod dashboard;
pub mod error;
pub mod export;
pub mod framing;
pub mod login;
pub mod metrics;
pub mod peer;
pub mod stream;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::routing::get;

use crate::service::Service;
pub use peer::{Peer, PeerCred};

/// Largest request body accepted; anything bigger is answered 413.
pub const BODY_LIMIT: usize = 1024 * 1024;

/// Upper bound on one request beyond the longest grace it may ask for
/// (`serve --max-grace`): a kill waits for its teardown (its grace plus the
/// verify rounds); a wait holds at most [`api::MAX_WAIT`].
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);

/// What every handler gets.
#[derive(Clone)]
pub struct AppState {
    pub service: Arc<Service>,
    pub auth: Arc<auth::Auth>,
}

/// The whole application, without a listener. The API's routes and its
/// OpenAPI document come from one list (`utoipa_axum::routes!`, which takes
/// each handler's path and method from its `#[utoipa::path]`): a route cannot
/// be served undocumented, nor documented unserved.
pub fn router(state: AppState) -> Router {
    use utoipa::OpenApi;
    use utoipa_axum::{router::OpenApiRouter, routes};
    let (api, doc) = OpenApiRouter::with_openapi(api::ApiDoc::openapi())
        .routes(routes!(api::list_trees, api::spawn_tree))
        .routes(routes!(api::get_tree))
        .routes(routes!(api::tree_log))
        .routes(routes!(api::kill_tree))
        .routes(routes!(api::wait_tree))
        .routes(routes!(api::resolve_tree))
        .routes(routes!(api::events))
        .routes(routes!(stream::events_stream))
        .routes(routes!(export::export))
        .routes(routes!(api::healthz))
        .routes(routes!(api::readyz))
        .routes(routes!(api::shutdown))
        .split_for_parts();
    let doc = Arc::new(doc);
    Router::new()
        .merge(api)
        .route(
            "/api/openapi.json",
            get(move || {
                let doc = doc.clone();
                async move { axum::Json(doc.as_ref().clone()) }
            }),
        )
        .route("/api/{*rest}", axum::routing::any(api::not_found))
        .route("/", get(dashboard::index))
        .route("/trees/{id}", get(dashboard::tree))
        .route("/events", get(dashboard::events))
        .route("/metrics", get(metrics::metrics))
        .route("/login", get(login::form).post(login::submit))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::authenticate,
        ))
        .layer(axum::extract::DefaultBodyLimit::max(BODY_LIMIT))
        .layer(tower_http::limit::RequestBodyLimitLayer::new(BODY_LIMIT))
        .layer(tower_http::timeout::TimeoutLayer::with_status_code(
            axum::http::StatusCode::REQUEST_TIMEOUT,
            REQUEST_TIMEOUT + state.service.config().max_grace,
        ))
        .layer(axum::middleware::from_fn(error::json_errors))
        .layer(tower_http::trace::TraceLayer::new_for_http())
        .with_state(state)
}

/// Serves `router` on `listener` (TCP, or the Unix socket on Unix) until `shutdown` is
/// cancelled, then lets the requests in flight finish, within the default
/// [`conn::ConnLimits`]. Every request sees its connection's [`Peer`]
/// (axum's `ConnectInfo`), which the auth layer turns into the request's
/// principal.
pub async fn serve<L: conn::Accept>(
    listener: L,
    router: Router,
    shutdown: tokio_util::sync::CancellationToken,
) -> std::io::Result<()> {
    conn::serve(listener, router, shutdown, conn::ConnLimits::default()).await
}

/// Routes SIGTERM and SIGINT to `shutdown`. Called before any listener
/// opens and before any teardown can start, so a signal at any moment of
/// start-up (recovery included) starts the bounded drain instead of ending
/// the process where it stands.
#[cfg(unix)]
pub fn shutdown_on_signals(shutdown: tokio_util::sync::CancellationToken) -> std::io::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = int.recv() => tracing::info!("SIGINT: shutting down"),
            _ = shutdown.cancelled() => return,
        }
        shutdown.cancel();
    });
    Ok(())
}

/// Windows: the console's Ctrl+C, Ctrl+Break and close (the window closed,
/// or `GenerateConsoleCtrlEvent` from a supervisor) start the same bounded
/// drain. A console close gives the process only a few seconds before
/// Windows ends it (and with it the jobs it holds: their standing
/// authorization, `kill_on_job_close`).
#[cfg(windows)]
pub fn shutdown_on_signals(shutdown: tokio_util::sync::CancellationToken) -> std::io::Result<()> {
    use tokio::signal::windows::{ctrl_break, ctrl_c, ctrl_close};
    let mut c = ctrl_c()?;
    let mut brk = ctrl_break()?;
    let mut close = ctrl_close()?;
    tokio::spawn(async move {
        tokio::select! {
            _ = c.recv() => tracing::info!("Ctrl+C: shutting down"),
            _ = brk.recv() => tracing::info!("Ctrl+Break: shutting down"),
            _ = close.recv() => tracing::info!("console closed: shutting down"),
            _ = shutdown.cancelled() => return,
        }
        shutdown.cancel();
    });
    Ok(())
}

/// Binds the Unix socket at `path`: its directory made (0755) if missing, a
/// stale socket left by a killed instance removed (one that still answers
/// is in use: refused), and the socket made 0666 — any local user may
/// connect; who they are comes from `SO_PEERCRED`, not from the file mode
/// (docs/THREAT-MODEL.md). Unix only: Windows serves TCP on loopback.
#[cfg(unix)]
pub fn bind_unix(path: &std::path::Path) -> std::io::Result<tokio::net::UnixListener> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    if let Some(dir) = path.parent()
        && !dir.as_os_str().is_empty()
        && !dir.exists()
    {
        std::os::unix::fs::DirBuilderExt::mode(std::fs::DirBuilder::new().recursive(true), 0o755)
            .create(dir)?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::AddrInUse,
                    format!("{} is in use by a running service", path.display()),
                ));
            }
            std::fs::remove_file(path)?;
        }
        Ok(_) => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                format!("{} exists and is not a socket", path.display()),
            ));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let listener = tokio::net::UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))?;
    Ok(listener)
}
#[cfg(test)]
mod tests;
