//! The tree routes but the spawn: list (a page, its `Link`), get, wait
//! (a long poll), kill, resolve, and the captured log.

use std::time::Duration;

use axum::extract::State;
use axum::response::IntoResponse;
use axum::{Extension, Json};

use super::bodies::{
    ErrorBody, KillQuery, KillResponse, ListQuery, LogQuery, PhaseJson, ResolveBody, WaitAnswer,
    WaitQuery,
};
use super::parse::{parse_duration, parse_flag, parse_grace, parse_states, query_escape};
use super::{MAX_LABEL, MAX_WAIT};
use crate::http::AppState;
use crate::http::auth::Principal;
use crate::http::error::{ApiError, ApiJson, ApiQuery, TreePath, known};
use crate::ledger::{TreeDetail, TreeId, TreeRow, TreeState};

/// The most trees one `GET /api/trees` answers with: a page, however big
/// the ledger; the `Link: <…>; rel="next"` header names the next one.
const LIST_MAX: u32 = 1000;

/// List trees: live ones, or all with `?all=1`; newest first, a page of
/// at most `limit` (1000), with `Link: <…>; rel="next"` when there are more.
#[utoipa::path(get, path = "/api/trees", params(ListQuery), security(("bearer" = [])), responses(
    (status = 200, body = Vec<TreeRow>, headers(("link" = String, description = "the next page, when there is one: `</api/trees?...&before=ID>; rel=\"next\"`"))),
    (status = 400, body = ErrorBody),
    (status = 401, body = ErrorBody), (status = 403, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn list_trees(
    State(s): State<AppState>,
    Extension(principal): Extension<Principal>,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> Result<axum::response::Response, ApiError> {
    let all = parse_flag("all", q.all.as_deref())?;
    let alive = match q.alive.as_deref() {
        None => None,
        v => Some(parse_flag("alive", v)?),
    };
    let states = q.state.as_deref().map(parse_states).transpose()?;
    if let Some(l) = &q.label
        && l.chars().count() > MAX_LABEL
    {
        return Err(ApiError::BadRequest(format!(
            "label longer than {MAX_LABEL} characters"
        )));
    }
    // Which states: those named, narrowed by `alive`; else `alive`; else
    // live ones unless `all`.
    let live = |st: &TreeState| !st.is_terminal();
    let states: Option<Vec<TreeState>> = match (states, alive) {
        (Some(named), None) => Some(named),
        (Some(named), Some(a)) => Some(named.into_iter().filter(|st| live(st) == a).collect()),
        (None, Some(a)) => Some(
            TreeState::ALL
                .into_iter()
                .filter(|st| live(st) == a)
                .collect(),
        ),
        (None, None) if all => None,
        (None, None) => Some(TreeState::ALL.into_iter().filter(live).collect()),
    };
    let limit = q.limit.unwrap_or(LIST_MAX);
    if !(1..=LIST_MAX).contains(&limit) {
        return Err(ApiError::BadRequest(format!(
            "limit must be 1 to {LIST_MAX}"
        )));
    }
    let at = match q.before {
        Some(b) if b < 1 => return Err(ApiError::BadRequest("before must be 1 or more".into())),
        Some(b) => crate::ledger::PageAt::Before(b),
        None => crate::ledger::PageAt::Newest,
    };
    // The `Link` repeats the query but `before` and `limit`.
    let again = [
        ("all", q.all.as_deref()),
        ("label", q.label.as_deref()),
        ("state", q.state.as_deref()),
        ("alive", q.alive.as_deref()),
    ]
    .into_iter()
    .filter_map(|(k, v)| v.map(|v| format!("{k}={}", query_escape(v))))
    .collect::<Vec<_>>()
    .join("&");
    let filter = crate::ledger::TreeFilter {
        states,
        label: q.label,
        // The page is read as the principal may see it: its `Link` then
        // names no other principal's id.
        owner: (!principal.sees_all()).then(|| principal.own_trees()),
        ..Default::default()
    };
    let mut trees = s
        .service
        .door()
        .tree_page(filter, at, limit as usize + 1)
        .await?;
    let more = trees.len() > limit as usize;
    trees.truncate(limit as usize);
    let next = more.then(|| trees.last().map(|t| t.id)).flatten();
    if !principal.sees_all() {
        trees.retain(|t| principal.owns(t));
    }
    let mut response = Json(trees).into_response();
    if let Some(last) = next {
        let link = format!(
            "</api/trees?{again}{}before={last}&limit={limit}>; rel=\"next\"",
            if again.is_empty() { "" } else { "&" }
        );
        if let Ok(v) = axum::http::HeaderValue::from_str(&link) {
            response.headers_mut().insert(axum::http::header::LINK, v);
        }
    }
    Ok(response)
}

/// One tree with its members, observations, signals, authorizations and events.
#[utoipa::path(get, path = "/api/trees/{id}", params(("id" = i64, Path, description = "tree id")), security(("bearer" = [])),
    responses((status = 200, body = TreeDetail), (status = 400, body = ErrorBody),
    (status = 401, body = ErrorBody), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn get_tree(
    State(s): State<AppState>,
    Extension(principal): Extension<Principal>,
    TreePath(id): TreePath,
) -> Result<Json<TreeDetail>, ApiError> {
    let detail = known(s.service.door().tree_detail(id).await?, id)?;
    principal.may_see(&detail.tree)?;
    Ok(Json(detail))
}

/// Whether a waiter is answered: the tree reached a final state, or its
/// teardown is ambiguous (survivors left as evidence: only an operator or
/// a later teardown moves it on).
pub(super) fn wait_over(state: TreeState) -> bool {
    state.is_terminal() || state == TreeState::Ambiguous
}

/// Wait for a tree to end: answers the tree as soon as it is in a final
/// state (or ambiguous), or as it stands when `timeout` passes (then its
/// `state` is still a live one and `outcome` is null; ask again). A long
/// poll, woken by the service's own notice of the tree's end, not a loop of
/// reads. A settled tree's `outcome` says how it ended, typed: `kind`
/// (`exited`, `failed`, `timed_out`, `killed`, `owner_gone`, `shutdown`,
/// `ambiguous`, ...), `by`, `forced`, as the dashboard shows it.
#[utoipa::path(get, path = "/api/trees/{id}/wait", params(("id" = i64, Path, description = "tree id"), WaitQuery),
    security(("bearer" = [])),
    responses((status = 200, description = "the tree, ended (or ambiguous), or as it stands at the timeout", body = WaitAnswer),
    (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
    (status = 404, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn wait_tree(
    State(s): State<AppState>,
    Extension(principal): Extension<Principal>,
    TreePath(id): TreePath,
    ApiQuery(q): ApiQuery<WaitQuery>,
) -> Result<Json<WaitAnswer>, ApiError> {
    let timeout = match q.timeout.as_deref() {
        None => Duration::from_secs(30),
        Some(t) => parse_duration("timeout", t).map_err(ApiError::BadRequest)?,
    };
    if timeout > MAX_WAIT {
        return Err(ApiError::BadRequest(format!(
            "timeout over {}: ask again",
            humantime::format_duration(MAX_WAIT)
        )));
    }
    let deadline = tokio::time::Instant::now() + timeout;
    let mut ends = s.service.ends();
    let stop = s.service.shutdown_token();
    loop {
        // Marked seen before the read: an end after it changes `ends`.
        ends.borrow_and_update();
        let row = known(s.service.door().tree(id).await?, id)?;
        principal.may_see(&row)?;
        let over = wait_over(row.state)
            || tokio::time::Instant::now() >= deadline
            || tokio::select! {
                changed = ends.changed() => changed.is_err(),
                () = tokio::time::sleep_until(deadline) => false,
                () = stop.cancelled() => true,
            };
        if over {
            let outcome = s.service.door().settled_outcome(row.clone()).await?;
            return Ok(Json(WaitAnswer { tree: row, outcome }));
        }
    }
}

/// Tear a tree down (TERM, grace, authorize, KILL, verify). Needs the token.
#[utoipa::path(post, path = "/api/trees/{id}/kill", params(("id" = i64, Path, description = "tree id"), KillQuery),
    security(("bearer" = [])),
    responses((status = 200, body = KillResponse), (status = 400, body = ErrorBody),
    (status = 401, body = ErrorBody), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody),
    (status = 413, body = ErrorBody), (status = 422, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn kill_tree(
    State(s): State<AppState>,
    ApiQuery(q): ApiQuery<KillQuery>,
    super::auth::ActOnTree { row, principal }: super::auth::ActOnTree,
) -> Result<Json<KillResponse>, ApiError> {
    // A grace the service refuses is 422 here as in a spawn's body: the
    // query parsed, its value is what is wrong (400 is for a request that
    // does not parse: an unknown parameter, a malformed id).
    let grace = parse_grace(q.grace.as_deref(), s.service.config().max_grace)
        .map_err(ApiError::Unprocessable)?;
    let id = row.id;
    // Who asked, as a structured event, before anything is signalled. The
    // kill does not wait on it: a ledger that refuses it still gets the
    // principal in the teardown's reason.
    let by = principal.requester();
    let asked = crate::ledger::Event::KillRequested(crate::ledger::event::KillRequested {
        by: by.clone(),
        grace_ms: grace.map(|g| g.as_millis() as u64),
    });
    if let Err(e) = s.service.record(Some(id), asked).await {
        tracing::warn!(tree = id.0, error = %e, "kill.requested not recorded; the teardown's reason names the principal");
    }
    let r = s
        .service
        .teardown(
            row,
            grace,
            None,
            // Who asked is in the reason the teardown records (tree.state,
            // kill.authorized).
            crate::service::vocab::EndCause::Kill,
            format!("killed through the API by {}", principal.requester()),
        )
        .await?;
    Ok(Json(KillResponse {
        tree: r.tree,
        state: r.state,
        members_at_start: r.members_at_start,
        force_killed: r.force_killed,
        authorizations: r.authorizations,
        elapsed_ms: r.elapsed.as_millis() as u64,
        phases: r
            .phases
            .iter()
            .map(|(p, d)| PhaseJson {
                phase: p.as_str().to_string(),
                ms: d.as_millis() as u64,
            })
            .collect(),
    }))
}

/// Record an operator's resolution of an ambiguous tree. Needs the token.
#[utoipa::path(post, path = "/api/trees/{id}/resolve", params(("id" = i64, Path, description = "tree id")),
    request_body = ResolveBody, security(("bearer" = [])),
    responses((status = 200, body = TreeRow), (status = 400, body = ErrorBody),
    (status = 401, body = ErrorBody), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody),
    (status = 413, body = ErrorBody), (status = 415, body = ErrorBody), (status = 422, body = ErrorBody),
    (status = 503, body = ErrorBody)))]
pub async fn resolve_tree(
    State(s): State<AppState>,
    super::auth::ActOnTree { row, principal }: super::auth::ActOnTree,
    ApiJson(body): ApiJson<ResolveBody>,
) -> Result<Json<TreeRow>, ApiError> {
    let id = row.id;
    if body
        .note
        .chars()
        .all(|c| matches!(c, ' ' | '\t' | '\n' | '\r'))
    {
        return Err(ApiError::Unprocessable(
            "a resolution needs a non-empty note".into(),
        ));
    }
    s.service
        .resolve(id, body.note, body.force, Some(principal.requester()))
        .await?;
    let row = known(s.service.door().tree(id).await?, id)?;
    Ok(Json(row))
}

/// A tree's captured stdout and stderr (API trees only; `run` passes its
/// output through), as text; with `follow=1`, streamed as it is written
/// until the tree has ended.
#[utoipa::path(get, path = "/api/trees/{id}/log", params(("id" = i64, Path, description = "tree id"), LogQuery), security(("bearer" = [])),
    responses((status = 200, description = "the captured output (with `follow`: a chunked stream of it)", content_type = "text/plain", body = String),
    (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody),
    (status = 503, body = ErrorBody)))]
pub async fn tree_log(
    State(s): State<AppState>,
    ApiQuery(q): ApiQuery<LogQuery>,
    super::auth::SeeTree { row, .. }: super::auth::SeeTree,
) -> Result<axum::response::Response, ApiError> {
    if q.tail.is_some_and(|t| t > 1_000_000) {
        return Err(ApiError::BadRequest("tail: at most 1000000 lines".into()));
    }
    if parse_flag("follow", q.follow.as_deref())? {
        return follow_log(&s, row, q.tail).await;
    }
    let id = row.id;
    let bytes = known(s.service.door().tree_log(id, q.tail).await?, id)?;
    Ok((
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; charset=utf-8",
        )],
        bytes,
    )
        .into_response())
}

/// How often a followed log is looked at for what was written since.
const LOG_POLL: Duration = Duration::from_millis(50);
/// Followed logs open at once, across clients: each is a read every
/// [`LOG_POLL`] on the blocking pool (503 beyond, which clients retry).
const MAX_LOG_STREAMS: usize = 64;

static LOG_STREAMS: std::sync::LazyLock<std::sync::Arc<tokio::sync::Semaphore>> =
    std::sync::LazyLock::new(|| std::sync::Arc::new(tokio::sync::Semaphore::new(MAX_LOG_STREAMS)));

/// A followed log between two chunks of its stream.
struct Following {
    door: crate::service::Door,
    id: TreeId,
    /// What the log held when the stream began, sent first.
    first: Option<Vec<u8>>,
    follower: Option<crate::service::vocab::LogFollower>,
    /// The tree is settled: one more read, and the stream ends.
    settled: bool,
    ends: tokio::sync::watch::Receiver<u64>,
    stop: tokio_util::sync::CancellationToken,
    /// This stream's place among [`MAX_LOG_STREAMS`], given back with it.
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl Following {
    /// The next chunk: what the log held, then each write as it lands;
    /// `None` once the tree is settled and its output sent (or the service
    /// shuts down, or the log cannot be read).
    async fn advance(mut self) -> Option<(axum::body::Bytes, Self)> {
        if let Some(first) = self.first.take().filter(|b| !b.is_empty()) {
            return Some((first.into(), self));
        }
        loop {
            let follower = self.follower.take()?;
            match self.door.log_poll(follower).await {
                Ok((new, follower)) => {
                    self.follower = Some(follower);
                    if !new.is_empty() {
                        return Some((new.into(), self));
                    }
                }
                Err(e) => {
                    tracing::warn!(tree = self.id.0, error = %e, "a followed log could not be read; its stream ends");
                    return None;
                }
            }
            if self.settled {
                return None;
            }
            tokio::select! {
                changed = self.ends.changed() => {
                    self.settled = changed.is_err()
                        || matches!(self.door.tree(self.id).await, Ok(Some(r)) if wait_over(r.state));
                }
                () = tokio::time::sleep(LOG_POLL) => {}
                () = self.stop.cancelled() => return None,
            }
        }
    }
}

/// `GET /api/trees/{id}/log?follow=1`: the log as a chunked stream.
async fn follow_log(
    s: &AppState,
    row: TreeRow,
    tail: Option<usize>,
) -> Result<axum::response::Response, ApiError> {
    let permit = LOG_STREAMS.clone().try_acquire_owned().map_err(|_| {
        ApiError::Unavailable(format!(
            "{MAX_LOG_STREAMS} followed logs are open already; retry later"
        ))
    })?;
    let door = s.service.door();
    let mut ends = s.service.ends();
    // Subscribed before the state is read: an end after the read wakes it.
    ends.borrow_and_update();
    let (first, follower) = door
        .log_follower(row.id, tail)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("unknown tree {}", row.id)))?;
    let settled = door.tree(row.id).await?.is_none_or(|r| wait_over(r.state));
    let following = Following {
        door,
        id: row.id,
        first: Some(first),
        follower: Some(follower),
        settled,
        ends,
        stop: s.service.shutdown_token(),
        _permit: permit,
    };
    let chunks = futures_util::stream::unfold(following, |f| async move {
        f.advance()
            .await
            .map(|(chunk, f)| (Ok::<_, std::convert::Infallible>(chunk), f))
    });
    Ok((
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; charset=utf-8",
        )],
        axum::body::Body::from_stream(chunks),
    )
        .into_response())
}
