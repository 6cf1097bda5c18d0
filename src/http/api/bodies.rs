//! The API's request and response shapes: the bodies, the query
//! parameters and the answers, as the OpenAPI document describes them.
//! What they must hold is checked in parse.rs.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::ledger::{TreeId, TreeState};

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
    /// `stream`: streamed stdio (`spawn_tree`'s description). Not a
    /// property of this document: it is valid only with the upgrade
    /// headers, which a JSON schema cannot require.
    #[schema(ignore)]
    pub stdio: Option<StdioMode>,
}

/// How a spawn's stdio is carried.
#[derive(Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum StdioMode {
    /// Over the spawn request's own connection, upgraded.
    Stream,
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
    #[schema(value_type = i64)]
    pub tree: TreeId,
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
    pub(super) fn of(r: &crate::service::RecoveryStatus) -> Self {
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

#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct LogQuery {
    /// Only the last N lines (default: all that is kept, at most the
    /// service's `--log-max`).
    #[param(minimum = 0, maximum = 1000000)]
    pub tail: Option<usize>,
    /// `1`/`true`: a streamed answer: what is kept, then each write as it
    /// lands (looked for every 50 ms, across the cap's collapses), ending
    /// once the tree is in a final state and its output is sent. With
    /// `tail`, the stream starts at the last N lines (as `tail -n N -f`).
    #[param(pattern = "^(|0|1|true|false)$")]
    pub follow: Option<String>,
}

/// What `GET /api/trees/{id}/wait` answers: the tree's row, and once it is
/// in a final state (or ambiguous) how it ended, typed.
#[derive(Serialize, ToSchema)]
pub struct WaitAnswer {
    #[serde(flatten)]
    pub tree: crate::ledger::TreeRow,
    /// How the tree ended (`null` while it runs), as the dashboard shows
    /// it: branch on `outcome.kind` (`timed_out`, `killed`, ...), never on
    /// a reason's text.
    pub outcome: Option<crate::ledger::outcome::Outcome>,
}
