//! `GET /api/events`: the audit trail as JSON, a page at a time; a
//! principal that sees only its own trees names one of them.

use axum::extract::State;
use axum::{Extension, Json};

use super::bodies::{ErrorBody, EventsQuery};
use super::parse::parse_since_query;
use crate::http::AppState;
use crate::http::auth::Principal;
use crate::http::error::{ApiError, ApiQuery, known};
use crate::ledger::{EventFilter, EventRow, TreeId};

/// The audit trail as JSON, oldest first.
#[utoipa::path(get, path = "/api/events", params(EventsQuery), security(("bearer" = [])),
    responses((status = 200, body = Vec<EventRow>), (status = 400, body = ErrorBody),
    (status = 401, body = ErrorBody), (status = 403, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn events(
    State(s): State<AppState>,
    Extension(principal): Extension<Principal>,
    ApiQuery(q): ApiQuery<EventsQuery>,
) -> Result<Json<Vec<EventRow>>, ApiError> {
    // A principal that sees only its own trees reads the events of one of
    // them (`?tree=`), never the whole trail.
    if !principal.sees_all() {
        let Some(id) = q.tree else {
            return Err(ApiError::Forbidden(
                "the whole trail spans every tree: name one of yours with ?tree=".into(),
            ));
        };
        let row = known(s.service.door().tree(TreeId(id)).await?, id)?;
        principal.may_see(&row)?;
    }
    let since = parse_since_query(q.since.as_deref())?;
    if q.after.is_some_and(|a| a < 0) {
        return Err(ApiError::BadRequest("after: a seq is 0 or more".into()));
    }
    let limit = q.limit.unwrap_or(1000);
    if limit == 0 || limit > 10_000 {
        return Err(ApiError::BadRequest("limit must be 1..=10000".into()));
    }
    let filter = EventFilter {
        since,
        tree: q.tree.map(TreeId),
        after_seq: q.after,
        limit: Some(limit),
        ..EventFilter::default()
    };
    let rows = s.service.door().events(filter).await?;
    Ok(Json(rows))
}
