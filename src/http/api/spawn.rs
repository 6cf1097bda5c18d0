//! `POST /api/trees`: a spawn, from its body and the descriptors the Unix
//! socket brought (`Treewarden-Stdio`), through the principal's checks and
//! caps to the service.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::{Extension, Json};

use super::bodies::{ErrorBody, SpawnBody};
use super::run_as::run_as;
use crate::http::AppState;
use crate::http::auth::Principal;
use crate::http::error::{ApiError, ApiJson};
use crate::ledger::{TreeId, TreeRow};

/// The header naming which of the tree's descriptors 0, 1, 2 the
/// descriptors sent with the request become, in the order they were sent.
pub const STDIO_HEADER: &str = "treewarden-stdio";

/// The descriptors a spawn passes to its tree: `Treewarden-Stdio` names the
/// slots (`stdin,stdout`), the connection holds what `SCM_RIGHTS` brought;
/// both must agree. No header and nothing sent: the captured log. A
/// refused request's descriptors are closed on the connection's closer,
/// never here (a peer's close may block: `crate::http::closer`).
fn given_stdio(
    headers: &axum::http::HeaderMap,
    received: Option<&super::conn::ReceivedFds>,
) -> Result<crate::service::vocab::GivenStdio, ApiError> {
    let fds = received.map(|r| r.take_all()).unwrap_or_default();
    let slots = match stdio_slots(headers, received.is_some(), fds.len()) {
        Ok(slots) => slots,
        Err(e) => {
            if let Some(r) = received {
                for fd in fds {
                    r.discard(fd);
                }
            }
            return Err(e);
        }
    };
    let mut given = crate::service::vocab::GivenStdio::default();
    for (slot, fd) in slots.into_iter().zip(fds) {
        given.0[slot] = Some(std::sync::Arc::new(fd));
    }
    Ok(given)
}

/// The slots `Treewarden-Stdio` names, checked against the `sent`
/// descriptors (`socket`: whether the request came over the Unix socket).
fn stdio_slots(
    headers: &axum::http::HeaderMap,
    socket: bool,
    sent: usize,
) -> Result<Vec<usize>, ApiError> {
    let Some(value) = headers.get(STDIO_HEADER) else {
        if sent > 0 {
            return Err(ApiError::BadRequest(format!(
                "{sent} descriptors came with the request, but no Treewarden-Stdio header names them"
            )));
        }
        return Ok(Vec::new());
    };
    if !socket {
        return Err(ApiError::BadRequest(
            "Treewarden-Stdio: descriptors pass only over the Unix socket".into(),
        ));
    }
    let value = value
        .to_str()
        .map_err(|_| ApiError::BadRequest("Treewarden-Stdio: not ASCII".into()))?;
    let mut slots = Vec::new();
    for name in value.split(',').map(str::trim) {
        let slot = match name {
            "stdin" | "0" => 0,
            "stdout" | "1" => 1,
            "stderr" | "2" => 2,
            other => {
                return Err(ApiError::BadRequest(format!(
                    "Treewarden-Stdio: {other:?} is not stdin, stdout or stderr"
                )));
            }
        };
        if slots.contains(&slot) {
            return Err(ApiError::BadRequest(format!(
                "Treewarden-Stdio: {name} named twice"
            )));
        }
        slots.push(slot);
    }
    if slots.len() != sent {
        return Err(ApiError::BadRequest(format!(
            "Treewarden-Stdio names {} descriptors, but {sent} came with the request (send them with its first bytes)",
            slots.len(),
        )));
    }
    Ok(slots)
}

/// Holds a copy of a spawn's given descriptors until the handler ends,
/// then lets go of it on the connection's closer: whichever copy is
/// dropped last closes the descriptor (the tree may have exited already),
/// and this one is dropped last, off the runtime, whatever path the
/// handler took.
struct CloseOffRuntime(Option<(super::conn::ReceivedFds, crate::service::vocab::GivenStdio)>);

impl Drop for CloseOffRuntime {
    fn drop(&mut self) {
        if let Some((received, stdio)) = self.0.take() {
            received.discard(stdio);
        }
    }
}

/// A dispatch refusal as `principal` may see it: naming the unsettled
/// tree and its reason only to a principal that may read that tree (the
/// rule of `GET /api/trees/{id}`), else neither, so a refusal is no oracle
/// for another principal's ids. Under the default scope a principal is
/// refused only by its own trees; another's reaches it under
/// `--dispatch-scope host`, or as a marker the ledger never took.
async fn refusal_seen_by(
    s: &AppState,
    principal: &Principal,
    tree: TreeId,
    reason: String,
) -> ApiError {
    let row = s.service.door().tree(tree).await.ok().flatten();
    match row {
        Some(row) if principal.may_see(&row).is_ok() => ApiError::DispatchClosed {
            tree: Some(tree.0),
            reason,
        },
        _ => ApiError::DispatchClosed { tree: None, reason },
    }
}

/// Spawn a tree. Needs the bearer token.
///
/// On the Unix socket, the tree may get the client's own descriptors as
/// its stdin, stdout and stderr instead of `/dev/null` and the captured
/// log: send them (`SCM_RIGHTS`, at most three) with the request's first
/// bytes, and name them in order with the `Treewarden-Stdio` header
/// (`stdin,stdout,stderr`, or any of them). They go to the tree, never
/// through the service: a tree keeps its pipes when the service ends. The
/// header is not a parameter of this document, which the TCP face serves
/// too: there it is always refused (400), descriptors cannot cross TCP.
///
/// Streamed stdio, over TCP and the socket alike: a body with
/// `"stdio": "stream"` on a request with `Connection: Upgrade` and
/// `Upgrade: treewarden-stdio/1` is answered `101` (the tree's id in
/// `Location` and `Treewarden-Tree`, its root's pid in
/// `Treewarden-Root-Pid`), and the connection then carries frames
/// `[stream u8][length u32 big-endian][payload]`: 0 stdin (client to
/// service, at most 1 MiB), 1 stdout, 2 stderr (a frame of length 0 ends
/// its stream), 3 exit, last, the tree's end as `GET /api/trees/{id}/wait`
/// answers it. Without the upgrade headers such a body is refused (400)
/// and no tree is made. A dropped connection closes the tree's stdin
/// only. `stdio` is not a property of this document's body schema, which
/// cannot require the headers.
#[utoipa::path(post, path = "/api/trees", request_body = SpawnBody, security(("bearer" = [])),
    responses((status = 201, body = TreeRow),
    (status = 101, description = "`\"stdio\": \"stream\"`: the connection now carries the tree's stdio as frames (see above)"),
    (status = 400, body = ErrorBody),
    (status = 401, body = ErrorBody), (status = 403, body = ErrorBody), (status = 409, body = ErrorBody), (status = 413, body = ErrorBody),
    (status = 415, body = ErrorBody), (status = 422, body = ErrorBody), (status = 503, body = ErrorBody)))]
// Over 100 lines on purpose: one request's checks in order (descriptors, user, owner, cap), then the
// spawn and its answer (201, or 101 for streamed stdio); split, each step would re-take the request.
#[allow(clippy::too_many_arguments)]
pub async fn spawn_tree(
    State(s): State<AppState>,
    Extension(principal): Extension<Principal>,
    received: Option<Extension<super::conn::ReceivedFds>>,
    upgrade: Option<Extension<hyper::upgrade::OnUpgrade>>,
    streamed: Option<Extension<super::conn::Streamed>>,
    headers: axum::http::HeaderMap,
    ApiJson(body): ApiJson<SpawnBody>,
) -> Result<axum::response::Response, ApiError> {
    // Taken first: whatever else is wrong, descriptors sent with this
    // request are not left for the next one.
    let stdio = given_stdio(&headers, received.as_ref().map(|Extension(r)| r))?;
    let stream = body.stdio.is_some();
    let upgrade = match (stream, upgrade) {
        (false, _) => None,
        _ if stdio.0.iter().any(Option::is_some) => {
            return Err(ApiError::BadRequest(
                "\"stdio\": \"stream\" and descriptors sent with the request: choose one".into(),
            ));
        }
        (true, Some(Extension(u))) if super::stdio::asks_upgrade(&headers) => Some(u),
        (true, _) => {
            return Err(ApiError::BadRequest(format!(
                "\"stdio\": \"stream\" needs the request to ask for the upgrade: Connection: Upgrade, Upgrade: {}",
                super::stdio::PROTOCOL
            )));
        }
    };
    // Declared before `params`, so dropped after it.
    let _close_off_runtime = CloseOffRuntime(
        received
            .as_ref()
            .filter(|_| stdio.0.iter().any(Option::is_some))
            .map(|Extension(r)| (r.clone(), stdio.clone())),
    );
    let user = body.user.clone();
    let mut params = body.validate(s.service.config().max_grace)?;
    params.stdio = stdio;
    // Made before the spawn, so what the tree writes before the upgrade
    // waits in the pipes; the service's copies of the tree's ends go with
    // `params` once it is spawned.
    let mut ends = None;
    if upgrade.is_some() {
        let pipes = crate::service::vocab::streamed_stdio()
            .map_err(|e| ApiError::Internal(format!("the stdio pipes: {e}")))?;
        params.stdio = pipes.child;
        ends = Some((pipes.stdin, pipes.stdout, pipes.stderr));
    }
    // The user database (NSS: files, but also LDAP or sssd) and the peer's
    // /proc files are blocking reads: they run on the blocking pool, never
    // on an async worker that serves other connections meanwhile.
    let asking = principal.clone();
    params.run_as = tokio::task::spawn_blocking(move || run_as(&asking, user.as_deref()))
        .await
        .map_err(|e| ApiError::Internal(format!("the user lookup failed: {e}")))??;
    // A tree that runs as the service: its cwd is the service's to check.
    if params.run_as.is_none()
        && let Some(c) = &params.cwd
        && !c.is_dir()
    {
        return Err(ApiError::Unprocessable(format!(
            "cwd {:?} is not an absolute path of an existing directory",
            c.display().to_string()
        )));
    }
    params.requester = Some(principal.requester());
    // On the socket the requester is known by its peer credentials: a
    // client may bind the tree to its own life (`owner_pid` = itself) or
    // to a descendant's (a harness's worker, an agent it started), and an
    // admin (root) to any process's; not another user's process otherwise.
    if let Principal::Local { cred, .. } = &principal
        && let Some(pid) = params.owner_pid
        && Some(pid) != cred.pid
        && !principal.acts_on_all()
    {
        let descends = match cred.pid {
            Some(me) => s.service.door().descends_from(pid, me).await,
            None => false,
        };
        if !descends {
            return Err(ApiError::Forbidden(format!(
                "owner_pid {pid} is neither the requesting process nor one of its descendants: on the socket a tree may be bound only to its requester's life or a descendant's (root: any process's)"
            )));
        }
    }
    // One principal may not hold every tree the host can run: a cap on
    // its live trees (admins are not capped). Its place among its spawns in
    // flight is taken before the ledger's count is read, and held until the
    // spawn committed or failed: admitted only while live + in flight (this
    // one included) stays within the cap, so concurrent spawns are never
    // over-admitted (at worst one is refused while another's tree commits;
    // see service/admit.rs).
    let mut reservation = None;
    if !principal.acts_on_all() {
        let cap = s.service.config().max_trees_per_principal;
        let owner = principal.own_trees();
        let held = s.service.reserve_spawn(owner);
        let in_flight = held.in_flight();
        let filter = crate::ledger::TreeFilter {
            states: Some(
                crate::ledger::TreeState::ALL
                    .into_iter()
                    .filter(|st| !st.is_terminal())
                    .collect(),
            ),
            owner: Some(owner),
            ..Default::default()
        };
        let live = s
            .service
            .door()
            .tree_page(filter, crate::ledger::PageAt::Newest, cap + 1)
            .await?
            .len();
        if live + in_flight > cap {
            return Err(ApiError::Unavailable(format!(
                "you hold {live} live trees and {} more are being spawned, past the most one principal may (serve --max-trees-per-user {cap}); end one first",
                in_flight - 1
            )));
        }
        reservation = Some(held);
    }
    let row = match s.service.spawn_reserved(params, reservation).await {
        Ok(row) => row,
        Err(crate::service::ServiceError::Custody(
            crate::service::failure::CustodyError::DispatchRefused { tree, reason },
        )) => return Err(refusal_seen_by(&s, &principal, tree, reason).await),
        Err(e) => return Err(e.into()),
    };
    let location = format!("/api/trees/{}", row.id);
    if let (Some(upgrade), Some((stdin, stdout, stderr))) = (upgrade, ends) {
        // The tree runs: a failure here leaves it to its lifetime rules,
        // its stdio closed.
        let pumps = super::stdio::Pumps::start(stdin, stdout, stderr)
            .map_err(|e| ApiError::Internal(format!("the stdio threads: {e}")))?;
        if let Some(Extension(streamed)) = streamed {
            streamed.lift();
        }
        tokio::spawn(super::stdio::serve(upgrade, pumps, s.clone(), row.id));
        let root = row.root_pid.map(|p| p.to_string()).unwrap_or_default();
        return Ok((
            StatusCode::SWITCHING_PROTOCOLS,
            [
                (axum::http::header::CONNECTION, "upgrade".to_string()),
                (
                    axum::http::header::UPGRADE,
                    super::stdio::PROTOCOL.to_string(),
                ),
                (axum::http::header::LOCATION, location),
                (
                    axum::http::HeaderName::from_static(super::stdio::TREE_HEADER),
                    row.id.to_string(),
                ),
                (
                    axum::http::HeaderName::from_static(super::stdio::ROOT_PID_HEADER),
                    root,
                ),
            ],
        )
            .into_response());
    }
    Ok((
        StatusCode::CREATED,
        [(axum::http::header::LOCATION, location)],
        Json(row),
    )
        .into_response())
}
