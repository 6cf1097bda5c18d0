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
pub mod runbook;
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
        .route("/runbook", get(runbook::runbook))
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

#[cfg(test)]
mod tests;
