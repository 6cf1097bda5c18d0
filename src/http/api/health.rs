//! The service's own state: `/healthz` (liveness, dispatch, recovery),
//! `/readyz` (the start-up recovery done), and `POST /api/shutdown` (an
//! admin starts the drain).

use axum::extract::State;
use axum::response::IntoResponse;
use axum::{Extension, Json};

use super::bodies::{ErrorBody, Health, Readiness, Recovery, ShutdownAnswer};
use crate::http::AppState;
use crate::http::auth::Principal;
use crate::http::error::ApiError;

/// Liveness, and whether dispatch is open.
#[utoipa::path(get, path = "/healthz", responses((status = 200, body = Health),
    (status = 401, body = ErrorBody), (status = 403, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn healthz(State(s): State<AppState>) -> Result<Json<Health>, ApiError> {
    let unsettled = s.service.door().unsettled().await?;
    Ok(Json(Health {
        status: "ok".into(),
        dispatch: if unsettled.is_empty() {
            "open"
        } else {
            "closed"
        }
        .into(),
        owned_trees: s.service.owned_trees().len(),
        uptime_seconds: s.service.uptime().as_secs(),
        recovery: Recovery::of(&s.service.recovery()),
    }))
}

/// Readiness: 200 once the start-up recovery sweep has finished, 503 while
/// it runs (the service answers meanwhile; `/healthz` is its liveness). No
/// ledger read: it answers even while the ledger is busy with the recovery.
#[utoipa::path(get, path = "/readyz", responses((status = 200, body = Readiness),
    (status = 401, body = ErrorBody), (status = 403, body = ErrorBody), (status = 503, body = Readiness)))]
pub async fn readyz(State(s): State<AppState>) -> impl IntoResponse {
    let recovery = Recovery::of(&s.service.recovery());
    let ready = !recovery.running;
    let status = if ready {
        axum::http::StatusCode::OK
    } else {
        axum::http::StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(Readiness { ready, recovery }))
}

/// Start the bounded shutdown drain, as SIGTERM does (on Windows, as the
/// console's Ctrl+Break does): no new work, every owned tree torn down with
/// its grace capped at `--shutdown-grace`, then the process exits. For a
/// supervisor that cannot signal the process (a Windows service host, a
/// container runtime's API). Admins only: an admin token (or an admin on
/// the Unix socket). Answered 202 before the drain closes the listener.
#[utoipa::path(post, path = "/api/shutdown", security(("bearer" = [])),
    responses((status = 202, body = ShutdownAnswer), (status = 401, body = ErrorBody),
    (status = 403, body = ErrorBody), (status = 413, body = ErrorBody)))]
pub async fn shutdown(
    State(s): State<AppState>,
    Extension(principal): Extension<Principal>,
) -> Result<impl IntoResponse, ApiError> {
    let admin = match &principal {
        Principal::Token { scope, .. } => *scope == crate::ledger::TokenScope::Admin,
        Principal::Local { admin, .. } => *admin,
        Principal::Anonymous => false,
    };
    if !admin {
        return Err(ApiError::Forbidden(
            "only an admin may shut the service down".into(),
        ));
    }
    let owned_trees = s.service.owned_trees().len();
    tracing::info!(by = %principal.requester(), owned_trees, "shutdown asked for through the API");
    // Who asked, as a structured event, before the drain starts. The
    // shutdown does not wait on it: a ledger that refuses it still has the
    // log line above.
    let asked = crate::ledger::Event::ShutdownRequested(crate::ledger::event::ShutdownRequested {
        by: principal.requester(),
        owned_trees: owned_trees as u64,
    });
    if let Err(e) = s.service.record(None, asked).await {
        tracing::warn!(error = %e, "service.shutdown_requested not recorded");
    }
    s.service.shutdown_token().cancel();
    Ok((
        axum::http::StatusCode::ACCEPTED,
        Json(ShutdownAnswer {
            draining: true,
            owned_trees,
        }),
    ))
}
