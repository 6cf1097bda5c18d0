//! `GET /api/events/stream`: the audit trail as Server-Sent Events, one
//! event per ledger event (`id: <seq>`, `event: <kind>`, `data: <json>`),
//! as it is committed — by this service or by any `run`, `kill` or `sweep`
//! on the host, since it follows the ledger itself.
//!
//! Resumable: a client that reconnects sends `Last-Event-ID` (browsers do it
//! by themselves) and gets exactly the events after it; `?after=SEQ` does the
//! same for a first connection; without either the stream starts at the
//! head (new events only). The stream polls the ledger (one indexed read
//! every 200 ms, at most 500 events each) and ends when the service shuts
//! down, so it never holds the drain open.
//!
//! `?tree=ID` follows one tree: it starts at the tree's first event (unless
//! `after` or `Last-Event-ID` say otherwise) and ends once the tree is in a
//! final state and its events are sent; a principal that sees only its own
//! trees may follow one of them. `?label=L` keeps the events of trees with
//! that label (and, for such a principal, of its own trees only).
//!
//! A stream is a standing read, so its right is checked again as it runs:
//! a stream opened with a token ends before the next event once the token
//! is revoked (else a revoked token's stream would keep receiving argv). One
//! principal holds at most [`MAX_PER_PRINCIPAL`] of the streams, so one
//! user cannot take them all.

use std::collections::VecDeque;
use std::time::Duration;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use serde::Deserialize;

use super::AppState;
use super::error::{ApiError, ApiQuery, known};
use crate::ledger::{EventFilter, EventRow, TreeId};

/// How often a stream asks the ledger for what is new.
const POLL: Duration = Duration::from_millis(200);
/// Events read per poll (a client far behind catches up in steps).
const BATCH: usize = 500;
/// Streams open at once, across clients.
const MAX_STREAMS: usize = 16;
/// Streams one principal (a uid on the socket, a token) holds at once.
const MAX_PER_PRINCIPAL: usize = 4;
/// How often a running stream checks that its token is still live.
const RECHECK: Duration = Duration::from_secs(1);

/// Open streams by principal (`uid:N`, `token:N`).
static BY_PRINCIPAL: std::sync::LazyLock<
    std::sync::Mutex<std::collections::HashMap<String, usize>>,
> = std::sync::LazyLock::new(Default::default);

/// One principal's hold on a stream, given back when the stream ends.
struct PrincipalSlot(String);

impl PrincipalSlot {
    fn take(principal: &super::auth::Principal) -> Option<Self> {
        use super::auth::Principal;
        let key = match principal {
            Principal::Local { cred, .. } => format!("uid:{}", cred.uid),
            Principal::Token { id, .. } => format!("token:{id}"),
            Principal::Anonymous => "anonymous".to_string(),
        };
        let mut map = BY_PRINCIPAL.lock().unwrap_or_else(|e| e.into_inner());
        let n = map.entry(key.clone()).or_insert(0);
        if *n >= MAX_PER_PRINCIPAL {
            return None;
        }
        *n += 1;
        Some(Self(key))
    }
}

impl Drop for PrincipalSlot {
    fn drop(&mut self) {
        let mut map = BY_PRINCIPAL.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = map.get_mut(&self.0) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                map.remove(&self.0);
            }
        }
    }
}
static STREAMS: std::sync::LazyLock<std::sync::Arc<tokio::sync::Semaphore>> =
    std::sync::LazyLock::new(|| std::sync::Arc::new(tokio::sync::Semaphore::new(MAX_STREAMS)));

#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct StreamQuery {
    /// Start after this seq (`Last-Event-ID` wins when both are given);
    /// default: the current head (new events only).
    #[param(minimum = 0)]
    pub after: Option<i64>,
    /// Only this tree's events; the stream starts at its first event and
    /// ends once the tree is in a final state.
    #[param(minimum = 1)]
    pub tree: Option<i64>,
    /// Only events of trees with exactly this label.
    #[param(max_length = 256)]
    pub label: Option<String>,
}

/// One item of the stream as it is on the wire (the OpenAPI 3.1 reading
/// of a `text/event-stream` schema: each event, not the whole stream).
#[derive(serde::Serialize, utoipa::ToSchema)]
pub struct StreamEvent {
    /// The event's kind (`tree.spawned`, `signal.sent`, …).
    pub event: String,
    /// The event's seq, for `Last-Event-ID`.
    #[schema(pattern = "^[0-9]+$")]
    pub id: String,
    /// The event as JSON (an `EventRow`: `seq`, `at`, `tree`, `kind`,
    /// `data`, `prev_hash`, `hash`).
    #[schema(content_media_type = "application/json")]
    pub data: String,
}

/// Which events a stream carries.
enum Scope {
    All,
    Tree(i64),
    /// Trees with this label; `mine`: only the principal's own. Each
    /// tree's answer is remembered (a label never changes).
    Label {
        label: String,
        mine: Option<super::auth::Principal>,
        known: std::collections::HashMap<TreeId, bool>,
    },
}

/// The live audit trail as Server-Sent Events.
#[utoipa::path(get, path = "/api/events/stream", params(StreamQuery), security(("bearer" = [])),
    responses((status = 200, description = "text/event-stream; each event (this schema): `id` is the seq, `event` the kind, `data` the event as JSON",
        content_type = "text/event-stream", body = StreamEvent),
    (status = 400, body = super::api::ErrorBody), (status = 401, body = super::api::ErrorBody), (status = 403, body = super::api::ErrorBody),
    (status = 404, body = super::api::ErrorBody), (status = 503, body = super::api::ErrorBody)))]
// Over 100 lines on purpose: the request's checks (scope, the two stream caps, the start seq) and
// the stream built on them: the `unfold` loop holds the permit and slot taken above and carries the
// state made from them (seq, queue, recheck time, scope) from one event to the next.
pub async fn events_stream(
    State(s): State<AppState>,
    axum::Extension(principal): axum::Extension<super::auth::Principal>,
    headers: HeaderMap,
    ApiQuery(q): ApiQuery<StreamQuery>,
) -> Result<Sse<impl futures_util::Stream<Item = Result<Event, std::convert::Infallible>>>, ApiError>
{
    if q.tree.is_some_and(|t| t < 1) {
        return Err(ApiError::BadRequest("tree: an id is 1 or more".into()));
    }
    if q.label.as_ref().is_some_and(|l| l.chars().count() > 256) {
        return Err(ApiError::BadRequest(
            "label longer than 256 characters".into(),
        ));
    }
    // The whole trail needs a principal that sees every tree; one tree,
    // one of its own; a label, its own trees of that label.
    if let Some(id) = q.tree {
        let row = known(s.service.door().tree(TreeId(id)).await?, id)?;
        principal.may_see(&row)?;
    } else if q.label.is_none() {
        principal.must_see_all("the event stream")?;
    }
    let scope = match (q.tree, q.label.clone()) {
        (Some(id), _) => Scope::Tree(id),
        (None, Some(label)) => Scope::Label {
            label,
            mine: (!principal.sees_all()).then(|| principal.clone()),
            known: Default::default(),
        },
        (None, None) => Scope::All,
    };
    // Each stream polls the one ledger thread that also commits the
    // authorizations: a bounded number at once (503 beyond).
    let slot = PrincipalSlot::take(&principal).ok_or_else(|| {
        ApiError::Unavailable(format!(
            "you hold {MAX_PER_PRINCIPAL} event streams already"
        ))
    })?;
    let permit = STREAMS.clone().try_acquire_owned().map_err(|_| {
        ApiError::Unavailable(format!("{MAX_STREAMS} event streams are open already"))
    })?;
    let token = match &principal {
        super::auth::Principal::Token { id, .. } => Some(*id),
        _ => None,
    };
    let last_id = match headers.get("last-event-id") {
        None => None,
        Some(v) => Some(
            v.to_str()
                .ok()
                .and_then(|v| v.trim().parse::<i64>().ok())
                .filter(|seq| *seq >= 0)
                .ok_or_else(|| {
                    ApiError::BadRequest("malformed Last-Event-ID: expected a seq".into())
                })?,
        ),
    };
    if q.after.is_some_and(|a| a < 0) {
        return Err(ApiError::BadRequest("after: a seq is 0 or more".into()));
    }
    let start = match last_id.or(q.after) {
        Some(seq) => seq,
        // One tree's stream starts at its beginning.
        None if q.tree.is_some() => 0,
        None => s.service.door().head().await?.map_or(0, |(seq, _)| seq),
    };
    let service = s.service.clone();
    let stop = service.shutdown_token();
    let state = (
        start,
        VecDeque::<EventRow>::new(),
        tokio::time::Instant::now(),
        scope,
    );
    let stream = futures_util::stream::unfold(
        state,
        move |(mut last, mut queue, mut checked, mut scope)| {
            let service = service.clone();
            let stop = stop.clone();
            // Held as long as the stream lives.
            let _held = (&permit, &slot);
            async move {
                loop {
                    if let Some(id) = token
                        && checked.elapsed() >= RECHECK
                    {
                        checked = tokio::time::Instant::now();
                        let live = service
                            .door()
                            .tokens()
                            .await
                            .map(|ts| ts.iter().any(|t| t.id == id && t.revoked_at.is_none()));
                        // Revoked (or unreadable: a right that cannot be
                        // confirmed is not assumed): the stream ends here.
                        if !matches!(live, Ok(true)) {
                            tracing::info!(token = id, "event stream ended: its token is revoked");
                            return None;
                        }
                    }
                    while let Some(e) = queue.front() {
                        let keep = match &mut scope {
                            Scope::All | Scope::Tree(_) => true,
                            Scope::Label { label, mine, known } => match e.tree {
                                None => false,
                                Some(t) => match known.get(&t) {
                                    Some(k) => *k,
                                    None => {
                                        let row = service.door().tree(t).await.ok().flatten();
                                        let k = row.is_some_and(|r| {
                                            r.label.as_deref() == Some(label.as_str())
                                                && mine.as_ref().is_none_or(|p| p.owns(&r))
                                        });
                                        known.insert(t, k);
                                        k
                                    }
                                },
                            },
                        };
                        if keep {
                            break;
                        }
                        if let Some(e) = queue.pop_front() {
                            last = e.seq;
                        }
                    }
                    if let Some(e) = queue.pop_front() {
                        last = e.seq;
                        let data = serde_json::to_string(&e).unwrap_or_default();
                        let event = Event::default()
                            .id(e.seq.to_string())
                            .event(e.kind.to_string())
                            .data(data);
                        return Some((Ok(event), (last, queue, checked, scope)));
                    }
                    if stop.is_cancelled() {
                        return None;
                    }
                    let tree = match &scope {
                        Scope::Tree(id) => Some(*id),
                        _ => None,
                    };
                    // One tree's stream ends once the tree is final and every
                    // event up to that moment is sent (read after the state, so
                    // none committed before it is missed).
                    let over = match tree {
                        None => false,
                        Some(id) => service
                            .door()
                            .tree(TreeId(id))
                            .await
                            .ok()
                            .flatten()
                            .is_none_or(|r| r.state.is_terminal()),
                    };
                    let filter = EventFilter {
                        after_seq: Some(last),
                        tree: tree.map(crate::ledger::TreeId),
                        limit: Some(BATCH),
                        ..EventFilter::default()
                    };
                    match service.door().events(filter).await {
                        Ok(rows) if !rows.is_empty() => queue.extend(rows),
                        Ok(_) if over => return None,
                        Ok(_) => {}
                        Err(e) => tracing::warn!(error = %e, "event stream: ledger read failed"),
                    }
                    if queue.is_empty() {
                        tokio::select! {
                            _ = stop.cancelled() => return None,
                            _ = tokio::time::sleep(POLL) => {}
                        }
                    }
                }
            }
        },
    );
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()))
}
