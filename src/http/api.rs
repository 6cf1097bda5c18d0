//! The JSON API: handlers, their request and response shapes, and the
//! OpenAPI document generated from them (utoipa), so the description cannot
//! drift from the code that answers.

use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::{Extension, Json};
use serde::{Deserialize, Serialize};
use utoipa::{OpenApi, ToSchema};

use super::AppState;
use super::auth::Principal;
use super::error::{ApiError, ApiJson, ApiQuery, TreePath};
use crate::ledger::{
    AuthorizationRow, EventFilter, EventRow, ExitRecord, IdentityRecord, KillTarget, MemberRow,
    ObservationRow, OwnerRow, SignalRow, TreeDetail, TreeId, TreeRow, TreeState,
};
use crate::service::SpawnParams;

/// Default of the longest grace the API accepts (`serve --max-grace`; a
/// kill request waits for its teardown, so the request timeout follows it).
pub const DEFAULT_MAX_GRACE: Duration = Duration::from_secs(600);
/// Longest a `GET /api/trees/{id}/wait` holds its request.
pub const MAX_WAIT: Duration = Duration::from_secs(60);
/// Longest label accepted.
const MAX_LABEL: usize = 256;

/// `{"error": "...", "code": "..."}`, on every failure.
#[derive(Serialize, ToSchema)]
pub struct ErrorBody {
    /// What went wrong, for a person.
    pub error: String,
    /// What went wrong, for a program: branch on this, not on the status.
    pub code: super::error::ErrorCode,
    /// The tree the error is about, when one is named (503 dispatch closed).
    pub tree: Option<i64>,
}

/// An optional integer as JSON Schema has it: `7439` and `7439.0` alike
/// (an integral number is an integer, whatever its spelling); a fraction,
/// or a value out of the type's range, is refused.
fn integral<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: TryFrom<i64> + TryFrom<u64>,
{
    use serde::de::Error;
    let v: Option<serde_json::Number> = Option::deserialize(d)?;
    let Some(n) = v else { return Ok(None) };
    let out_of_range = || D::Error::custom(format!("{n} is out of range"));
    if let Some(u) = n.as_u64() {
        return T::try_from(u).map(Some).map_err(|_| out_of_range());
    }
    if let Some(i) = n.as_i64() {
        return T::try_from(i).map(Some).map_err(|_| out_of_range());
    }
    match n.as_f64() {
        Some(f) if f.fract() == 0.0 && f.abs() < 9.0e15 => {
            T::try_from(f as i64).map(Some).map_err(|_| out_of_range())
        }
        _ => Err(D::Error::custom(format!("{n} is not an integer"))),
    }
}

/// A spawn request.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SpawnBody {
    /// The command and its arguments; `argv[0]` is searched in `PATH`.
    #[schema(min_items = 1, example = json!(["sleep", "30"]))]
    pub argv: Vec<String>,
    #[schema(max_length = 256, pattern = "^[^\\u0000]*$")]
    pub label: Option<String>,
    /// Absolute path of an existing directory.
    pub cwd: Option<String>,
    /// Variables added to the service's environment.
    pub env: Option<std::collections::BTreeMap<String, String>>,
    /// Time between the first signal and the forced kill (seconds, or
    /// `500ms`, `5s`); at most the service's `--max-grace` (default 10m;
    /// over it: 422, code `BadRequest`).
    #[schema(
        example = "2s",
        pattern = "^([0-9]{1,5}ms|[0-5]?[0-9]{1,2}(\\.[0-9]{1,3})?s?|600s?|([1-9]|10)m)$"
    )]
    pub grace: Option<String>,
    /// Tear the tree down after this long (seconds, or `500ms`, `5m`, `2h`);
    /// under ten years.
    #[schema(example = "10m", pattern = "^[1-9][0-9]{0,3}(ms|s|m|h)?$")]
    pub timeout: Option<String>,
    /// The client process on whose behalf the tree runs: the tree is torn
    /// down within a second of its exit. Must be a live process (else 422).
    #[schema(minimum = 2)]
    #[serde(default, deserialize_with = "integral")]
    pub owner_pid: Option<i32>,
    /// The owner's start time in clock ticks (field 22 of /proc/PID/stat),
    /// checked when given.
    #[serde(default, deserialize_with = "integral")]
    pub owner_start_ticks: Option<u64>,
    /// Limits for the tree's cgroup, set before its command runs; 422 where
    /// the host cannot enforce one (no cgroup boundary, or its controller
    /// not offered), never started unlimited.
    pub limits: Option<LimitsBody>,
    /// Run the tree as this user: a name from the user database, or a
    /// numeric uid (as `systemd-run --uid` takes it; one the database does
    /// not know runs with its uid as its gid and no supplementary groups).
    /// Only root on the socket and `admin` tokens may name another user
    /// (else 403); a non-root socket principal's trees always run as itself.
    #[schema(
        min_length = 1,
        max_length = 64,
        pattern = "^[A-Za-z0-9_][A-Za-z0-9_.-]*[$]?$"
    )]
    pub user: Option<String>,
    /// `root` (default): the tree ends when its root exits. `owner`: the
    /// root's exit is recorded, and what it left running stays in custody
    /// until the owner (`owner_pid`; without it the service) exits, the
    /// tree is killed, or its timeout fires.
    #[schema(pattern = "^(root|owner)$", example = "owner")]
    pub lifetime: Option<String>,
    /// The teardown's first signal (as `run -s` takes it): `TERM`
    /// (default), `INT`, `HUP`, `QUIT`, `USR1`, `USR2`, with or without the
    /// `SIG` prefix. `KILL` is refused: a SIGKILL comes only after its
    /// committed authorization.
    #[schema(pattern = "^(SIG)?(TERM|INT|HUP|QUIT|USR1|USR2)$", example = "INT")]
    pub first_signal: Option<String>,
}

/// `"limits": {"memory_max": "64M", "pids_max": 50, "cpu_max": "50%"}`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LimitsBody {
    /// `memory.max`: bytes, or with K, M, G, T (powers of 1024).
    #[schema(pattern = "^[1-9][0-9]{0,5}[KMGT]?$", example = "64M")]
    pub memory_max: Option<String>,
    /// `pids.max`.
    #[schema(minimum = 1, maximum = 1000000)]
    #[serde(default, deserialize_with = "integral")]
    pub pids_max: Option<u64>,
    /// `cpu.max` as a percentage of one CPU (`50%`, `200%`).
    #[schema(pattern = "^[1-9][0-9]{0,4}%?$", example = "50%")]
    pub cpu_max: Option<String>,
}

#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResolveBody {
    /// The operator's decision, for the audit trail: not empty, not only
    /// spaces, tabs and line breaks.
    #[schema(min_length = 1, pattern = "[^ \\t\\n\\r]")]
    pub note: String,
    /// Resolve even though survivors still live (they are named in
    /// `tree.resolved`); without it such a resolution is 409.
    #[serde(default)]
    pub force: bool,
}

/// Query parameters are checked like bodies: an unknown one is 400, never
/// ignored.
#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// `1`/`true` to include ended trees (`0`/`false`/empty: live only).
    #[param(pattern = "^(|0|1|true|false)$")]
    pub all: Option<String>,
    /// Keyset paging: only trees with an id below this (the `next` link's).
    #[param(minimum = 1)]
    pub before: Option<i64>,
    /// At most this many trees, newest first (default and most: 1000).
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<u32>,
    /// Only trees with exactly this label ("what from tool call X").
    #[param(max_length = 256)]
    pub label: Option<String>,
    /// Only trees in these states (comma-separated: `running,ambiguous`).
    #[param(
        pattern = "^(spawning|running|terminating|killing|ambiguous|ended|vanished|spawn_failed|resolved)(,(spawning|running|terminating|killing|ambiguous|ended|vanished|spawn_failed|resolved))*$"
    )]
    pub state: Option<String>,
    /// `1`: only trees not yet in a final state (the default without
    /// `all` or `state`); `0`: only trees in one (ended, vanished,
    /// spawn_failed, resolved).
    #[param(pattern = "^(|0|1|true|false)$")]
    pub alive: Option<String>,
}

/// The most trees one `GET /api/trees` answers with: a page, however big
/// the ledger; the `Link: <…>; rel="next"` header names the next one.
const LIST_MAX: u32 = 1000;

#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct KillQuery {
    /// Grace before the forced kill (seconds, or `500ms`, `5s`; at most
    /// the service's `--max-grace`, default 10m); default: the tree's.
    #[param(pattern = "^([0-9]{1,5}ms|[0-5]?[0-9]{1,2}(\\.[0-9]{1,3})?s?|600s?|([1-9]|10)m)$")]
    pub grace: Option<String>,
}

#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct EventsQuery {
    /// Events at or after this RFC 3339 time (with an offset), or within an
    /// age such as `2h`.
    #[param(format = DateTime)]
    pub since: Option<String>,
    /// Only events of this tree.
    pub tree: Option<i64>,
    /// Only events with a larger seq.
    #[param(minimum = 0)]
    pub after: Option<i64>,
    /// At most this many (default 1000, at most 10000).
    #[param(minimum = 1, maximum = 10000)]
    pub limit: Option<usize>,
}

/// One phase of a teardown and its duration.
#[derive(Serialize, ToSchema)]
pub struct PhaseJson {
    pub phase: String,
    pub ms: u64,
}

/// What a kill did.
#[derive(Serialize, ToSchema)]
pub struct KillResponse {
    pub tree: i64,
    pub state: TreeState,
    pub members_at_start: usize,
    pub force_killed: usize,
    pub authorizations: u32,
    pub elapsed_ms: u64,
    pub phases: Vec<PhaseJson>,
}

#[derive(Serialize, ToSchema)]
pub struct Health {
    pub status: String,
    /// `open`, or `closed` while a tree is unsettled.
    pub dispatch: String,
    pub owned_trees: usize,
    pub uptime_seconds: u64,
    /// The start-up recovery sweep (orphans of a previous instance).
    pub recovery: Recovery,
}

/// The start-up recovery as `/healthz` and `/readyz` report it.
#[derive(Serialize, ToSchema)]
pub struct Recovery {
    /// The start-up sweep still runs: orphans are being torn down.
    pub running: bool,
    /// Orphans found by this service's sweeps (start-up and periodic).
    pub orphans_found: usize,
    /// Of those, teardowns queued or running now.
    pub orphans_pending: usize,
    /// Of those, teardowns running now.
    pub orphans_in_flight: usize,
    /// Of those, torn down to a terminal state.
    pub orphans_settled: usize,
    /// Of those, left unsettled (the next sweep tries again).
    pub orphans_unsettled: usize,
    /// How long the start-up sweep took, once done.
    pub took_ms: Option<u64>,
    /// Why the start-up sweep failed, if it did.
    pub error: Option<String>,
}

impl Recovery {
    fn of(r: &crate::service::RecoveryStatus) -> Self {
        Recovery {
            running: r.running,
            orphans_found: r.counts.found,
            orphans_pending: r.counts.pending(),
            orphans_in_flight: r.counts.in_flight,
            orphans_settled: r.counts.settled,
            orphans_unsettled: r.counts.unsettled + r.counts.not_started,
            took_ms: r
                .took
                .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            error: r.error.clone(),
        }
    }
}

/// What `POST /api/shutdown` answers.
#[derive(Serialize, ToSchema)]
pub struct ShutdownAnswer {
    /// Always true: the drain has begun (the owned trees are being torn
    /// down; the process exits once it is over).
    pub draining: bool,
    /// Trees this service owned when the drain began.
    pub owned_trees: usize,
}

/// What `/readyz` answers.
#[derive(Serialize, ToSchema)]
pub struct Readiness {
    /// False while the start-up recovery sweep runs.
    pub ready: bool,
    pub recovery: Recovery,
}

fn parse_duration(what: &str, s: &str) -> Result<Duration, String> {
    crate::config::parse_duration(s).map_err(|e| format!("{what}: {e}"))
}

/// A grace as the API accepts it: humantime, at most `max`
/// (`serve --max-grace`). The error is the message; each caller picks its
/// status.
fn parse_grace(g: Option<&str>, max: Duration) -> Result<Option<Duration>, String> {
    let grace = g.map(|g| parse_duration("grace", g)).transpose()?;
    if let Some(g) = grace
        && g > max
    {
        return Err(format!(
            "grace {} is over this service's cap of {} (serve --max-grace)",
            humantime::format_duration(g),
            humantime::format_duration(max)
        ));
    }
    Ok(grace)
}

/// `v` percent-encoded for a query string (all but RFC 3986's unreserved
/// characters).
fn query_escape(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for b in v.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A `since=` query value (RFC 3339 or an age); malformed is 400.
pub(super) fn parse_since_query(v: Option<&str>) -> Result<Option<SystemTime>, ApiError> {
    v.map(crate::ledger::parse_since)
        .transpose()
        .map_err(ApiError::BadRequest)
}

/// A `1`/`0` query flag (absent, empty, `0`, `false`: off; `1`, `true`: on);
/// anything else is 400. For the API and the dashboard alike.
pub(super) fn parse_flag(what: &str, v: Option<&str>) -> Result<bool, ApiError> {
    match v {
        None | Some("0") | Some("false") | Some("") => Ok(false),
        Some("1") | Some("true") => Ok(true),
        Some(other) => Err(ApiError::BadRequest(format!(
            "malformed {what} {other:?}: expected 1 or 0"
        ))),
    }
}

/// The user a spawn runs as, and who asked, from the principal and the
/// body's `user`. Non-root socket principals run as themselves; root (and
/// admin tokens) as the named user, or as the service; anyone else naming
/// another user is refused (403).
#[cfg(unix)]
fn run_as(
    principal: &Principal,
    user: Option<&str>,
) -> Result<Option<crate::service::RunAs>, ApiError> {
    let named = match user {
        None => None,
        // A numeric user is a uid, as `systemd-run --uid` takes it.
        Some(n) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => {
            let uid: u32 = n
                .parse()
                .map_err(|_| ApiError::Unprocessable(format!("uid {n} is out of range")))?;
            Some(
                crate::proc::user_by_uid(uid)
                    .map_err(|e| ApiError::Internal(format!("user database: {e}")))?
                    .unwrap_or_else(|| crate::proc::UserInfo::unnamed(uid)),
            )
        }
        Some(name) => Some(
            crate::proc::user_by_name(name)
                .map_err(|e| ApiError::Internal(format!("user database: {e}")))?
                .ok_or_else(|| ApiError::Unprocessable(format!("no such user {name:?}")))?,
        ),
    };
    let of_user = |u: crate::proc::UserInfo| -> Result<crate::service::RunAs, ApiError> {
        if u.name.is_empty() {
            // A uid the database does not know: no supplementary groups.
            return Ok(crate::service::RunAs {
                credentials: crate::proc::Credentials {
                    uid: u.uid,
                    gid: u.gid,
                    groups: Vec::new(),
                    rlimits: Vec::new(),
                    cgroups_v1: Vec::new(),
                },
                user: None,
            });
        }
        let groups = crate::proc::groups_of(&u, u.gid)
            .map_err(|e| ApiError::Internal(format!("groups of {}: {e}", u.name)))?;
        Ok(crate::service::RunAs {
            credentials: crate::proc::Credentials {
                uid: u.uid,
                gid: u.gid,
                groups,
                rlimits: Vec::new(),
                cgroups_v1: Vec::new(),
            },
            user: Some(u),
        })
    };
    let me = crate::proc::effective_uid();
    match principal {
        Principal::Local { cred, .. } if cred.uid == 0 => named.map(of_user).transpose(),
        // The service's own user: its trees run as the service, as before.
        Principal::Local { cred, .. }
            if cred.uid == me && named.as_ref().is_none_or(|u| u.uid == me) =>
        {
            Ok(None)
        }
        Principal::Local { cred, .. } if me != 0 => Err(ApiError::Forbidden(format!(
            "this service runs as uid {me}, not root: it cannot start trees as uid {}",
            cred.uid
        ))),
        Principal::Local { cred, .. } => {
            if let Some(u) = &named
                && u.uid != cred.uid
            {
                return Err(ApiError::Forbidden(format!(
                    "uid {} may not run a tree as {} (only root may)",
                    cred.uid, u.name
                )));
            }
            let credentials = crate::proc::credentials_of_peer(cred.pid, cred.uid, cred.gid)
                .map_err(ApiError::Forbidden)?;
            let user = crate::proc::user_by_uid(cred.uid).ok().flatten();
            Ok(Some(crate::service::RunAs { credentials, user }))
        }
        Principal::Token { scope, name, .. } => match named {
            None => Ok(None),
            Some(u) if *scope == crate::ledger::TokenScope::Admin => of_user(u).map(Some),
            Some(u) => Err(ApiError::Forbidden(format!(
                "token {name:?} has scope {}: only admin tokens may run a tree as {}",
                scope.as_str(),
                u.name
            ))),
        },
        Principal::Anonymous => Err(ApiError::Unauthorized(
            "missing bearer token (Authorization: Bearer <token>)",
        )),
    }
}

/// Windows: every tree runs as the service's own user. There is no other
/// user to start one as yet (no `CreateProcessAsUser`, no logon tokens),
/// so a `user` is refused (422) rather than ignored.
#[cfg(windows)]
fn run_as(
    _principal: &Principal,
    user: Option<&str>,
) -> Result<Option<crate::service::RunAs>, ApiError> {
    match user {
        None => Ok(None),
        Some(u) => Err(ApiError::Unprocessable(format!(
            "user {u:?}: on Windows every tree runs as the service's own user (running as another user is not built there)"
        ))),
    }
}

impl SpawnBody {
    fn validate(self, max_grace: Duration) -> Result<SpawnParams, ApiError> {
        let bad = ApiError::Unprocessable;
        if self.argv.is_empty() {
            return Err(bad("empty argv: nothing to run".into()));
        }
        if self.argv[0].is_empty() {
            return Err(bad("argv[0] is empty".into()));
        }
        if self.argv.iter().any(|a| a.contains('\0')) {
            return Err(bad("argv contains a NUL byte".into()));
        }
        if let Some(label) = &self.label
            && (label.chars().count() > MAX_LABEL || label.contains('\0'))
        {
            return Err(bad(format!(
                "label longer than {MAX_LABEL} characters or with a NUL byte"
            )));
        }
        let cwd = match &self.cwd {
            None => None,
            Some(c) => {
                // Whether it exists is the tree's user's to find out (in
                // the child, as that user): looked up here as root, the
                // answer would tell a user what lies in directories closed
                // to it (issue 24). Trees that run as the service are
                // checked in `spawn_tree`.
                let p = PathBuf::from(c);
                if c.contains('\0') || !p.is_absolute() {
                    return Err(bad(format!("cwd {c:?} is not an absolute path")));
                }
                Some(p)
            }
        };
        let mut env = Vec::new();
        for (k, v) in self.env.unwrap_or_default() {
            if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
                return Err(bad(format!(
                    "env name {k:?} is empty or holds '=' or NUL, or its value holds NUL"
                )));
            }
            env.push((k, v));
        }
        let grace = parse_grace(self.grace.as_deref(), max_grace).map_err(bad)?;
        let first_signal = parse_first_signal(self.first_signal.as_deref()).map_err(bad)?;
        let timeout = self
            .timeout
            .as_deref()
            .map(|t| parse_duration("timeout", t))
            .transpose()
            .map_err(bad)?;
        if timeout.is_some_and(|t| t.is_zero() || t > Duration::from_secs(10 * 365 * 86400)) {
            return Err(bad("timeout must be above zero and under ten years".into()));
        }
        if let Some(pid) = self.owner_pid
            && pid <= 1
        {
            return Err(bad(format!("owner_pid {pid} is not a client process")));
        }
        let limits = parse_limits(self.limits).map_err(bad)?;
        let lifetime = match self.lifetime.as_deref() {
            None => crate::custody::Lifetime::Root,
            Some(l) => l.parse().map_err(bad)?,
        };
        Ok(SpawnParams {
            lifetime,
            limits,
            argv: self.argv,
            label: self.label,
            cwd,
            env,
            grace,
            timeout,
            owner_pid: self.owner_pid,
            owner_start_ticks: self.owner_start_ticks,
            requester: None,
            run_as: None,
            first_signal,
            stdio: crate::proc::GivenStdio::default(),
        })
    }
}

/// A spawn's `first_signal`: names only, as the document says (`INT`,
/// `SIGINT`): the CLI's numbers and lower case are not part of this
/// contract.
fn parse_first_signal(name: Option<&str>) -> Result<Option<crate::proc::Sig>, String> {
    match name {
        None => Ok(None),
        Some(n)
            if matches!(
                n.strip_prefix("SIG").unwrap_or(n),
                "TERM" | "INT" | "HUP" | "QUIT" | "USR1" | "USR2"
            ) =>
        {
            crate::proc::Sig::parse_first(n)
                .map(Some)
                .map_err(|e| format!("first_signal: {e}"))
        }
        Some(n) => Err(format!(
            "first_signal {n:?}: expected TERM, INT, HUP, QUIT, USR1 or USR2 (KILL comes only with its authorization)"
        )),
    }
}

/// A spawn's `limits` (none given: no limits).
fn parse_limits(limits: Option<LimitsBody>) -> Result<crate::ledger::Limits, String> {
    let Some(l) = limits else {
        return Ok(crate::ledger::Limits::default());
    };
    Ok(crate::ledger::Limits {
        memory_max: l
            .memory_max
            .as_deref()
            .map(crate::ledger::parse_size)
            .transpose()?,
        pids_max: match l.pids_max {
            Some(0) => return Err("pids_max must be 1 or more".into()),
            n => n,
        },
        cpu_max_pct: l
            .cpu_max
            .as_deref()
            .map(crate::ledger::parse_cpu_pct)
            .transpose()?,
    })
}

/// `?state=a,b`: the tree states named, each by its name.
fn parse_states(list: &str) -> Result<Vec<TreeState>, ApiError> {
    list.split(',')
        .map(|name| {
            TreeState::ALL
                .into_iter()
                .find(|st| st.as_str() == name)
                .ok_or_else(|| {
                    ApiError::BadRequest(format!("malformed state {name:?}: not a tree state"))
                })
        })
        .collect()
}

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
        .read(move |e| Ok(e.ledger().tree_page(filter, at, limit as usize + 1)?))
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
    let mut detail = s
        .service
        .read(move |e| Ok(e.ledger().tree_detail(TreeId(id))?))
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("unknown tree {id}")))?;
    principal.may_see(&detail.tree)?;
    if detail.resources.is_none() {
        detail.resources = crate::custody::live_resources(&detail.tree);
    }
    Ok(Json(detail))
}

/// The header naming which of the tree's descriptors 0, 1, 2 the
/// descriptors sent with the request become, in the order they were sent.
pub const STDIO_HEADER: &str = "treewarden-stdio";

/// The descriptors a spawn passes to its tree: `Treewarden-Stdio` names the
/// slots (`stdin,stdout`), the connection holds what `SCM_RIGHTS` brought;
/// both must agree. No header and nothing sent: the captured log.
fn given_stdio(
    headers: &axum::http::HeaderMap,
    received: Option<&super::conn::ReceivedFds>,
) -> Result<crate::proc::GivenStdio, ApiError> {
    let fds = received.map(|r| r.take_all()).unwrap_or_default();
    let Some(value) = headers.get(STDIO_HEADER) else {
        if !fds.is_empty() {
            return Err(ApiError::BadRequest(format!(
                "{} descriptors came with the request, but no Treewarden-Stdio header names them",
                fds.len()
            )));
        }
        return Ok(crate::proc::GivenStdio::default());
    };
    if received.is_none() {
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
    if slots.len() != fds.len() {
        return Err(ApiError::BadRequest(format!(
            "Treewarden-Stdio names {} descriptors, but {} came with the request (send them with its first bytes)",
            slots.len(),
            fds.len()
        )));
    }
    let mut given = crate::proc::GivenStdio::default();
    for (slot, fd) in slots.into_iter().zip(fds) {
        given.0[slot] = Some(std::sync::Arc::new(fd));
    }
    Ok(given)
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
#[utoipa::path(post, path = "/api/trees", request_body = SpawnBody, security(("bearer" = [])),
    responses((status = 201, body = TreeRow), (status = 400, body = ErrorBody),
    (status = 401, body = ErrorBody), (status = 403, body = ErrorBody), (status = 409, body = ErrorBody), (status = 413, body = ErrorBody),
    (status = 415, body = ErrorBody), (status = 422, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn spawn_tree(
    State(s): State<AppState>,
    Extension(principal): Extension<Principal>,
    received: Option<Extension<super::conn::ReceivedFds>>,
    headers: axum::http::HeaderMap,
    ApiJson(body): ApiJson<SpawnBody>,
) -> Result<impl IntoResponse, ApiError> {
    // Taken first: whatever else is wrong, descriptors sent with this
    // request are not left for the next one.
    let stdio = given_stdio(&headers, received.as_ref().map(|Extension(r)| r))?;
    let user = body.user.clone();
    let mut params = body.validate(s.service.config().max_grace)?;
    params.stdio = stdio;
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
    // client may bind the tree to its own life (`owner_pid` = itself), not
    // to another process's.
    if let Principal::Local { cred, .. } = &principal
        && let Some(pid) = params.owner_pid
        && Some(pid) != cred.pid
    {
        return Err(ApiError::Forbidden(format!(
            "owner_pid {pid} is not the requesting process: on the socket a tree may be bound only to its requester's life (owner_pid = your own pid, or none)"
        )));
    }
    // One principal may not hold every tree the host can run: a cap on
    // its live trees (admins are not capped). Counted in the ledger, as the
    // principal's own page is read.
    if !principal.acts_on_all() {
        let cap = s.service.config().max_trees_per_principal;
        let filter = crate::ledger::TreeFilter {
            states: Some(
                crate::ledger::TreeState::ALL
                    .into_iter()
                    .filter(|st| !st.is_terminal())
                    .collect(),
            ),
            owner: Some(principal.own_trees()),
            ..Default::default()
        };
        let live = s
            .service
            .read(move |e| {
                Ok(e.ledger()
                    .tree_page(filter, crate::ledger::PageAt::Newest, cap + 1)?
                    .len())
            })
            .await?;
        if live >= cap {
            return Err(ApiError::Unavailable(format!(
                "you hold {live} live trees, the most one principal may (serve --max-trees-per-user {cap}); end one first"
            )));
        }
    }
    let row = s.service.spawn(params).await?;
    let location = format!("/api/trees/{}", row.id);
    Ok((
        StatusCode::CREATED,
        [(axum::http::header::LOCATION, location)],
        Json(row),
    ))
}

#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct WaitQuery {
    /// How long to hold the request at most (seconds, or `500ms`, `30s`);
    /// default 30s, at most 60s.
    #[param(
        pattern = "^([0-9]{1,4}ms|[1-5][0-9]{4}ms|60000ms|[1-5]?[0-9](\\.[0-9]{1,3})?s?|60s?|1m)$",
        example = "30s"
    )]
    pub timeout: Option<String>,
}

/// Whether a waiter is answered: the tree reached a final state, or its
/// teardown is ambiguous (survivors left as evidence: only an operator or
/// a later teardown moves it on).
fn wait_over(state: TreeState) -> bool {
    state.is_terminal() || state == TreeState::Ambiguous
}

/// Wait for a tree to end: answers the tree as soon as it is in a final
/// state (or ambiguous), or as it stands when `timeout` passes (then its
/// `state` is still a live one; ask again). A long poll, woken by the
/// service's own notice of the tree's end, not a loop of reads.
#[utoipa::path(get, path = "/api/trees/{id}/wait", params(("id" = i64, Path, description = "tree id"), WaitQuery),
    security(("bearer" = [])),
    responses((status = 200, description = "the tree, ended (or ambiguous), or as it stands at the timeout", body = TreeRow),
    (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
    (status = 404, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn wait_tree(
    State(s): State<AppState>,
    Extension(principal): Extension<Principal>,
    TreePath(id): TreePath,
    ApiQuery(q): ApiQuery<WaitQuery>,
) -> Result<Json<TreeRow>, ApiError> {
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
        let row = s
            .service
            .read(move |e| Ok(e.ledger().tree(TreeId(id))?))
            .await?
            .ok_or_else(|| ApiError::NotFound(format!("unknown tree {id}")))?;
        principal.may_see(&row)?;
        if wait_over(row.state) || tokio::time::Instant::now() >= deadline {
            return Ok(Json(row));
        }
        tokio::select! {
            changed = ends.changed() => if changed.is_err() { return Ok(Json(row)) },
            () = tokio::time::sleep_until(deadline) => {}
            () = stop.cancelled() => return Ok(Json(row)),
        }
    }
}

/// Tear a tree down (TERM, grace, authorize, KILL, verify). Needs the token.
#[utoipa::path(post, path = "/api/trees/{id}/kill", params(("id" = i64, Path, description = "tree id"), KillQuery),
    security(("bearer" = [])),
    responses((status = 200, body = KillResponse), (status = 400, body = ErrorBody),
    (status = 401, body = ErrorBody), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody),
    (status = 413, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn kill_tree(
    State(s): State<AppState>,
    ApiQuery(q): ApiQuery<KillQuery>,
    super::auth::ActOnTree { row, principal }: super::auth::ActOnTree,
) -> Result<Json<KillResponse>, ApiError> {
    let grace = parse_grace(q.grace.as_deref(), s.service.config().max_grace)
        .map_err(ApiError::BadRequest)?;
    let id = row.id;
    // Who asked, as a structured event, before anything is signalled. The
    // kill does not wait on it: a ledger that refuses it still gets the
    // principal in the teardown's reason.
    let by = principal.requester();
    let asked = crate::ledger::Event::KillRequested(crate::ledger::event::KillRequested {
        by: by.clone(),
        grace_ms: grace.map(|g| g.as_millis() as u64),
    });
    if let Err(e) = s.service.record(Some(TreeId(id)), asked).await {
        tracing::warn!(tree = id, error = %e, "kill.requested not recorded; the teardown's reason names the principal");
    }
    let r = s
        .service
        .teardown(
            id,
            grace,
            None,
            // Who asked is in the reason the teardown records (tree.state,
            // kill.authorized).
            crate::custody::policy::EndCause::Kill,
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
    let row = s
        .service
        .read(move |e| Ok(e.ledger().tree(TreeId(id))?))
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("unknown tree {id}")))?;
    Ok(Json(row))
}

#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct LogQuery {
    /// Only the last N lines (default: all that is kept, at most the
    /// service's `--log-max`).
    #[param(minimum = 0, maximum = 1000000)]
    pub tail: Option<usize>,
}

/// A tree's captured stdout and stderr (API trees only; `run` passes its
/// output through), as text.
#[utoipa::path(get, path = "/api/trees/{id}/log", params(("id" = i64, Path, description = "tree id"), LogQuery), security(("bearer" = [])),
    responses((status = 200, description = "the captured output", content_type = "text/plain", body = String),
    (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody),
    (status = 503, body = ErrorBody)))]
pub async fn tree_log(
    State(s): State<AppState>,
    ApiQuery(q): ApiQuery<LogQuery>,
    super::auth::SeeTree { row, .. }: super::auth::SeeTree,
) -> Result<impl IntoResponse, ApiError> {
    if q.tail.is_some_and(|t| t > 1_000_000) {
        return Err(ApiError::BadRequest("tail: at most 1000000 lines".into()));
    }
    let id = row.id;
    let bytes = s
        .service
        .read(move |e| {
            if e.ledger().tree(TreeId(id))?.is_none() {
                return Ok(None);
            }
            let log =
                crate::custody::read_log(e.data_dir(), TreeId(id), q.tail).map_err(|err| {
                    crate::service::ServiceError::Task(format!("reading the log: {err}"))
                })?;
            Ok(Some(log.unwrap_or_default()))
        })
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("unknown tree {id}")))?;
    Ok((
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; charset=utf-8",
        )],
        bytes,
    ))
}

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
        let row = s
            .service
            .read(move |e| Ok(e.ledger().tree(TreeId(id))?))
            .await?
            .ok_or_else(|| ApiError::NotFound(format!("unknown tree {id}")))?;
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
    let rows = s
        .service
        .read(move |e| Ok(e.ledger().events(&filter)?))
        .await?;
    Ok(Json(rows))
}

/// Liveness, and whether dispatch is open.
#[utoipa::path(get, path = "/healthz", responses((status = 200, body = Health),
    (status = 401, body = ErrorBody), (status = 403, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn healthz(State(s): State<AppState>) -> Result<Json<Health>, ApiError> {
    let unsettled = s.service.read(|e| Ok(e.unsettled()?)).await?;
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
    s.service.shutdown_token().cancel();
    Ok((
        axum::http::StatusCode::ACCEPTED,
        Json(ShutdownAnswer {
            draining: true,
            owned_trees,
        }),
    ))
}

pub async fn not_found() -> ApiError {
    ApiError::NotFound("no such endpoint".into())
}

struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// The OpenAPI document of this API.
#[derive(OpenApi)]
#[openapi(
    info(title = "treewarden", description = "Custody of process trees: spawn, inspect, kill, audit."),
    components(schemas(ErrorBody, super::error::ErrorCode, super::stream::StreamEvent, SpawnBody, crate::ledger::Requester, LimitsBody, ResolveBody, KillResponse, PhaseJson, Health, Recovery, Readiness, ShutdownAnswer,
        TreeRow, TreeDetail, TreeState, OwnerRow, ExitRecord, MemberRow, ObservationRow,
        SignalRow, AuthorizationRow, KillTarget, IdentityRecord, EventRow)),
    modifiers(&BearerAuth)
)]
pub struct ApiDoc;
