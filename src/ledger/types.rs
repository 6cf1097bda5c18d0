//! The typed records callers write and the rows they read back. Plain data:
//! no SQL here, and no rusqlite type ever appears in these shapes.

use serde::{Deserialize, Serialize};

use super::event::{Event, RowKind};

/// A tree's row id in the ledger.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TreeId(pub i64);

/// An owner's row id in the ledger.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct OwnerId(pub i64);

/// A committed kill authorization's row id. Holding one means the row that
/// authorizes a SIGKILL is durably in the ledger.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct AuthorizationId(pub i64);

impl std::fmt::Display for TreeId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Where a tree is in its life. Terminal states are final: the database
/// refuses to move a tree out of one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum TreeState {
    Spawning,
    Running,
    Terminating,
    Killing,
    Ambiguous,
    Ended,
    Vanished,
    SpawnFailed,
    Resolved,
}

impl TreeState {
    pub const ALL: [TreeState; 9] = [
        Self::Spawning,
        Self::Running,
        Self::Terminating,
        Self::Killing,
        Self::Ambiguous,
        Self::Ended,
        Self::Vanished,
        Self::SpawnFailed,
        Self::Resolved,
    ];

    /// The spelling stored in the ledger and used in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Spawning => "spawning",
            Self::Running => "running",
            Self::Terminating => "terminating",
            Self::Killing => "killing",
            Self::Ambiguous => "ambiguous",
            Self::Ended => "ended",
            Self::Vanished => "vanished",
            Self::SpawnFailed => "spawn_failed",
            Self::Resolved => "resolved",
        }
    }

    /// Ended, vanished, spawn_failed and resolved are final.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            Self::Ended | Self::Vanished | Self::SpawnFailed | Self::Resolved
        )
    }
}

impl std::fmt::Display for TreeState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for TreeState {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| format!("unknown tree state {s:?}"))
    }
}

/// Every audit event kind: the contract for export, the dashboard and tools.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EventKind {
    /// A tree row was committed (before its child is released). Addition to DESIGN.md.
    TreeCreated,
    TreeSpawned,
    TreeSpawnFailed,
    MemberObserved,
    EscapeObserved,
    MemberExited,
    /// A member ran a new program (exec) since it was recorded: the old and
    /// new exe and argv. The member row shows the newest.
    MemberExec,
    /// A forensic snapshot of survivors before a forced kill. Addition to DESIGN.md.
    SurvivorsRecorded,
    SignalSent,
    KillAuthorized,
    KillSkipped,
    TreeState,
    TreeEnded,
    SweepStarted,
    SweepOrphanFound,
    SweepRefused,
    DispatchRefused,
    TreeResolved,
    /// The kernel's OOM killer ended processes in the tree's cgroup:
    /// `{oom_kills: new since the last one recorded, total}`.
    TreeOomKill,
    /// An API token was made (its id, name, scope, and who made it; never
    /// the secret). Addition to DESIGN.md (issue 17).
    TokenCreated,
    /// An API token was revoked (its id, and who revoked it).
    TokenRevoked,
    /// A kill was asked for through the API, and by whom (`by`), written
    /// before its teardown starts. Addition to DESIGN.md (issue 17).
    KillRequested,
    /// A prune removed ended trees' events up to `pruned_through`; the
    /// remaining chain is proven from here (`ledger/prune.rs`). Written
    /// only by [`crate::ledger::Ledger::prune`].
    LedgerCheckpoint,
    /// Sealed evidence (issue 28, `ledger/seal.rs`): the setup, one seal
    /// per epoch, or the close; the data is a [`SealData`]. Written only by
    /// the sealer.
    LedgerSeal,
}

impl EventKind {
    pub const ALL: [EventKind; 24] = [
        Self::TreeCreated,
        Self::TreeSpawned,
        Self::TreeSpawnFailed,
        Self::MemberObserved,
        Self::EscapeObserved,
        Self::MemberExited,
        Self::MemberExec,
        Self::SurvivorsRecorded,
        Self::SignalSent,
        Self::KillAuthorized,
        Self::KillSkipped,
        Self::TreeState,
        Self::TreeEnded,
        Self::SweepStarted,
        Self::SweepOrphanFound,
        Self::SweepRefused,
        Self::DispatchRefused,
        Self::TreeResolved,
        Self::TreeOomKill,
        Self::TokenCreated,
        Self::TokenRevoked,
        Self::KillRequested,
        Self::LedgerCheckpoint,
        Self::LedgerSeal,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::TreeCreated => "tree.created",
            Self::TreeSpawned => "tree.spawned",
            Self::TreeSpawnFailed => "tree.spawn_failed",
            Self::MemberObserved => "member.observed",
            Self::EscapeObserved => "escape.observed",
            Self::MemberExited => "member.exited",
            Self::MemberExec => "member.exec",
            Self::SurvivorsRecorded => "survivors.recorded",
            Self::SignalSent => "signal.sent",
            Self::KillAuthorized => "kill.authorized",
            Self::KillSkipped => "kill.skipped",
            Self::TreeState => "tree.state",
            Self::TreeEnded => "tree.ended",
            Self::SweepStarted => "sweep.started",
            Self::SweepOrphanFound => "sweep.orphan_found",
            Self::SweepRefused => "sweep.refused",
            Self::DispatchRefused => "dispatch.refused",
            Self::TreeResolved => "tree.resolved",
            Self::TreeOomKill => "tree.oom_kill",
            Self::TokenCreated => "token.created",
            Self::TokenRevoked => "token.revoked",
            Self::KillRequested => "kill.requested",
            Self::LedgerCheckpoint => "ledger.checkpoint",
            Self::LedgerSeal => "ledger.seal",
        }
    }

    /// Kinds with no table of their own, which [`crate::ledger::Ledger::append_event`]
    /// accepts. Every other kind is written only by the typed method that also
    /// writes its rows, so the chain and the tables cannot disagree.
    pub fn is_free_standing(self) -> bool {
        matches!(
            self,
            Self::SweepStarted
                | Self::SweepOrphanFound
                | Self::SweepRefused
                | Self::DispatchRefused
                | Self::KillRequested
                | Self::TreeOomKill
        )
    }
}

impl std::fmt::Display for EventKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for EventKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| format!("unknown event kind {s:?}"))
    }
}

/// A process named by its identity, never by a bare pid.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
pub struct IdentityRecord {
    pub pid: i32,
    /// Start time in clock ticks since boot (field 22 of /proc/<pid>/stat).
    pub start_ticks: u64,
    pub boot_id: String,
}

/// Who a tree runs on behalf of.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OwnerKind {
    /// A `treewarden run` process.
    Run,
    /// A client process that asked the service for a tree.
    Client,
    /// The service itself.
    Service,
}

impl OwnerKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Run => "run",
            Self::Client => "client",
            Self::Service => "service",
        }
    }
}

impl std::str::FromStr for OwnerKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "run" => Ok(Self::Run),
            "client" => Ok(Self::Client),
            "service" => Ok(Self::Service),
            other => Err(format!("unknown owner kind {other:?}")),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OwnerRecord {
    pub identity: IdentityRecord,
    pub kind: OwnerKind,
}

/// A tree about to be spawned. `boundary` is "cgroup" or "session".
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NewTree {
    pub label: Option<String>,
    pub boundary: String,
    pub owner: OwnerId,
    pub argv: Vec<String>,
    pub cwd: Option<String>,
    /// The tree's grace (SIGTERM to forced kill), in milliseconds: every
    /// later teardown of it (a sweep, a restarted service) uses this one.
    pub grace_ms: Option<u64>,
    /// The tree's timeout in milliseconds, when it has one.
    pub timeout_ms: Option<u64>,
    /// Limits set on its cgroup (recorded in `tree.created`).
    pub limits: Limits,
    /// The teardown's first signal when not SIGTERM ("SIGINT", ...).
    pub first_signal: Option<String>,
}

/// Who asked for a mutation (a spawn, a kill, a resolution, a token), as
/// the ledger records it: by peer credentials on the Unix socket, by token
/// over TCP, or the invoking user of the CLI.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Requester {
    /// `socket`, `tcp` or `cli`.
    pub via: String,
    /// The principal's uid (socket, CLI).
    pub uid: Option<u32>,
    /// The requesting process (socket: from `SO_PEERCRED`; CLI: itself).
    pub pid: Option<i32>,
    /// The token's id (TCP).
    pub token_id: Option<i64>,
    /// The token's name (TCP).
    pub token_name: Option<String>,
}

impl std::fmt::Display for Requester {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.token_id, self.uid) {
            (Some(id), _) => write!(
                f,
                "token {id} ({})",
                self.token_name.as_deref().unwrap_or("")
            )?,
            (None, Some(uid)) => match self.pid {
                Some(pid) => write!(f, "uid {uid} (pid {pid})")?,
                None => write!(f, "uid {uid}")?,
            },
            (None, None) => f.write_str("an anonymous principal")?,
        }
        match self.via.as_str() {
            "socket" => f.write_str(" over the socket"),
            "tcp" => f.write_str(" over tcp"),
            "cli" => f.write_str(" on the command line"),
            other => write!(f, " via {other}"),
        }
    }
}

/// Who asked for a tree and as whom it runs, recorded with it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OnBehalfRecord {
    pub requester: Requester,
    /// The uid and gid its root runs as (`None`: the service's own).
    pub run_uid: Option<u32>,
    pub run_gid: Option<u32>,
}

/// What an API token may do over TCP. Ordered: each scope includes the
/// ones before it.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, utoipa::ToSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum TokenScope {
    /// Every read (trees, events, export, dashboard).
    Read,
    /// Reads, spawns, and kills and resolutions of the trees it spawned.
    Spawn,
    /// Everything, on every tree.
    Admin,
}

impl TokenScope {
    pub fn as_str(self) -> &'static str {
        match self {
            TokenScope::Read => "read",
            TokenScope::Spawn => "spawn",
            TokenScope::Admin => "admin",
        }
    }
}

impl std::str::FromStr for TokenScope {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "read" => Ok(TokenScope::Read),
            "spawn" => Ok(TokenScope::Spawn),
            "admin" => Ok(TokenScope::Admin),
            other => Err(format!("unknown scope {other:?}: read, spawn or admin")),
        }
    }
}

/// One API token as the ledger keeps it (never the secret).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct TokenRow {
    pub id: i64,
    pub name: String,
    pub scope: TokenScope,
    pub created_at: String,
    pub revoked_at: Option<String>,
}

/// What the spawn formed: recorded once, never re-resolved from the leader pid.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpawnRecord {
    pub root: IdentityRecord,
    pub pgid: i32,
    pub sid: i32,
    pub cgroup: Option<String>,
}

/// One process seen in a scan.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberRecord {
    pub identity: IdentityRecord,
    pub ppid: i32,
    pub pgid: i32,
    pub sid: i32,
    pub cgroup: Option<String>,
    /// None when it could not be read (the process exited meanwhile).
    pub uid: Option<u32>,
    pub exe: Option<String>,
    pub cmdline: Vec<String>,
    pub cwd: Option<String>,
}

/// How a process ended: an exit code, or the signal that killed it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ExitRecord {
    pub code: Option<i32>,
    pub signal: Option<i32>,
    /// The CPU time (user + system, microseconds) the process and the
    /// children it waited for used, from the rusage of the wait that reaped
    /// it: known only where this process reaped it (`reaped_by: treewarden`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_usec: Option<u64>,
}

/// A survivor snapshot taken (frozen or stopped) before a forced kill.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SurvivorRecord {
    pub identity: IdentityRecord,
    /// The state letter from /proc/<pid>/stat (R, S, D, T, Z, ...).
    pub state: String,
    pub rss_bytes: u64,
    pub cmdline: Vec<String>,
}

/// One target a kill authorization covers. `kind` is "group", "cgroup" or "pid".
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct KillTarget {
    pub kind: String,
    pub target: String,
    pub identities: Vec<IdentityRecord>,
}

/// A signal that was sent (or attempted). `signal` is spelled "SIGTERM",
/// "SIGKILL", ...; `target_kind` is "group", "cgroup" or "pid".
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SignalRecord {
    pub signal: String,
    pub target_kind: String,
    pub target: String,
    pub result: String,
    pub authorization: Option<AuthorizationId>,
}

/// Limits set on a tree's cgroup before its command runs (cgroup boundary
/// only; a spawn that asks for one where the host cannot enforce it is
/// refused, never started unlimited). Recorded in `tree.created`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Limits {
    /// `memory.max` in bytes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_max: Option<u64>,
    /// `pids.max`: processes and threads at most.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pids_max: Option<u64>,
    /// `cpu.max` as a percentage of one CPU (200 = two CPUs), like
    /// systemd's `CPUQuota=`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_max_pct: Option<u32>,
}

impl Limits {
    pub fn is_empty(&self) -> bool {
        *self == Limits::default()
    }

    /// The cgroup files and values that set these limits, with the
    /// controller each needs (`memory.max` needs `memory`, ...).
    pub fn cgroup_settings(&self) -> Vec<(&'static str, &'static str, String)> {
        let mut v = Vec::new();
        if let Some(b) = self.memory_max {
            v.push(("memory", "memory.max", b.to_string()));
        }
        if let Some(n) = self.pids_max {
            v.push(("pids", "pids.max", n.to_string()));
        }
        if let Some(p) = self.cpu_max_pct {
            // quota per 100 ms period: 50% of a CPU is 50000 of 100000 us.
            v.push(("cpu", "cpu.max", format!("{} 100000", u64::from(p) * 1000)));
        }
        v
    }
}

/// Parses a size as `--memory-max` and the API take it: bytes, or a
/// number with K, M, G or T (powers of 1024, like systemd's `MemoryMax=`).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, mult) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let mult: u64 = match c.to_ascii_uppercase() {
                'K' => 1 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                'T' => 1 << 40,
                _ => return Err(format!("malformed size {s:?}: the unit is K, M, G or T")),
            };
            (&t[..i], mult)
        }
        _ => (t, 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .filter(|n| *n > 0)
        .ok_or_else(|| {
            format!("malformed size {s:?}: expected bytes or a number with K, M, G or T (64M)")
        })
}

/// Parses a CPU share as `--cpu-max` takes it: `50%` (of one CPU) or `50`.
pub fn parse_cpu_pct(s: &str) -> Result<u32, String> {
    s.trim()
        .trim_end_matches('%')
        .parse::<u32>()
        .ok()
        .filter(|p| (1..=100_000).contains(p))
        .ok_or_else(|| {
            format!(
                "malformed cpu share {s:?}: expected a percentage of one CPU such as 50% or 200%"
            )
        })
}

/// What a tree consumed, from its cgroup (`cpu.stat`, `memory.peak`,
/// `pids.peak`, `io.stat`). A figure the host cannot give (no cgroup on the
/// session boundary, a controller not enabled in the v2 hierarchy) is
/// absent, never zero.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Resources {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_usec: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_peak_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pids_peak: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub io_read_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub io_write_bytes: Option<u64>,
    /// Processes the kernel's OOM killer ended in the tree's cgroup
    /// (`memory.events` `oom_kill`; absent without the memory controller).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oom_kills: Option<u64>,
}

impl Resources {
    /// What is known, for a person: `cpu 12.3 ms, memory peak 4.1 MiB, ...`
    /// (empty when nothing is).
    pub fn summary(&self) -> String {
        let mut parts = Vec::new();
        if let Some(us) = self.cpu_usec {
            parts.push(format!("cpu {:.1} ms", us as f64 / 1000.0));
        }
        if let Some(b) = self.memory_peak_bytes {
            parts.push(format!("memory peak {:.1} MiB", b as f64 / 1048576.0));
        }
        if let Some(p) = self.pids_peak {
            parts.push(format!("pids peak {p}"));
        }
        if let (Some(rd), Some(wr)) = (self.io_read_bytes, self.io_write_bytes) {
            parts.push(format!("io {rd} B read, {wr} B written"));
        }
        if let Some(n) = self.oom_kills.filter(|n| *n > 0) {
            parts.push(format!("{n} OOM kill(s)"));
        }
        parts.join(", ")
    }
}

/// An evidence write a teardown could not make (the ledger refused writes:
/// a held lock, a full disk) and keeps for later: in memory, then in the
/// tree's unsettled marker. [`super::Ledger::replay_deferred`] writes a list
/// of them in order, in one transaction, each event marked with
/// `deferred_from` (when it happened).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "write", rename_all = "snake_case")]
pub enum Deferred {
    /// A state change (`tree.state`).
    State {
        to: TreeState,
        reason: Option<String>,
        at: String,
    },
    /// One teardown step's signals (`signal.sent` each).
    Signals {
        signals: Vec<SignalRecord>,
        at: String,
    },
    /// A forced kill not sent (`kill.skipped`), with its reason.
    KillSkipped { reason: String, at: String },
    /// A flag on the tree row.
    Flag { flag: String, at: String },
    /// The survivor snapshot of a forced kill that was not authorized.
    Survivors {
        survivors: Vec<SurvivorRecord>,
        taken_at: String,
    },
}

impl Deferred {
    /// When the fact happened.
    pub fn at(&self) -> &str {
        match self {
            Deferred::State { at, .. }
            | Deferred::Signals { at, .. }
            | Deferred::KillSkipped { at, .. }
            | Deferred::Flag { at, .. } => at,
            Deferred::Survivors { taken_at, .. } => taken_at,
        }
    }
}

/// Parses how a reader says "events since": an RFC 3339 time, or an age
/// such as `2h` counted back from now. One grammar for the CLI's `--since`
/// and the HTTP API's `since=`; the error names the value, not the flag.
pub fn parse_since(s: &str) -> Result<std::time::SystemTime, String> {
    if let Ok(at) = s.parse::<jiff::Timestamp>() {
        // Nothing in a ledger is older than the epoch: an earlier time
        // selects everything, like the epoch itself (and a time before it
        // must never reach the formatter, which cannot write one).
        let ns = u64::try_from(at.as_nanosecond().max(0)).unwrap_or(u64::MAX);
        return std::time::UNIX_EPOCH
            .checked_add(std::time::Duration::from_nanos(ns))
            .ok_or_else(|| format!("since {s:?} is out of range"));
    }
    // A time without an offset names no moment: refused, not taken as UTC.
    if s.parse::<jiff::civil::DateTime>().is_ok() {
        return Err(format!(
            "since {s:?} has no offset: add Z (UTC) or one like +02:00 (2024-05-01T12:00:00+02:00)"
        ));
    }
    let age = humantime::parse_duration(s).map_err(|_| {
        format!(
            "malformed since {s:?}: expected RFC 3339 with an offset (2024-05-01T12:00:00Z, 2024-05-01T14:00:00+02:00) or an age (2h)"
        )
    })?;
    if age.is_zero() {
        return Err(format!(
            "since {s:?} is an empty window: give an age such as 2h, or a time"
        ));
    }
    Ok(std::time::SystemTime::now()
        .checked_sub(age)
        .unwrap_or(std::time::UNIX_EPOCH)
        .max(std::time::UNIX_EPOCH))
}

/// Where a keyset page of trees starts: the newest, the page right below a
/// tree id (older), or the page right above one (newer). Every page is
/// returned newest first.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PageAt {
    #[default]
    Newest,
    Before(i64),
    After(i64),
}

/// Selects trees for a page: all conditions combine with AND.
#[derive(Clone, Debug, Default)]
pub struct TreeFilter {
    /// Only trees in one of these states (`None`: any).
    pub states: Option<Vec<TreeState>>,
    /// Only trees with exactly this label.
    pub label: Option<String>,
    /// Only trees created at or after this moment.
    pub since: Option<std::time::SystemTime>,
    /// Only trees this principal asked for (`None`: anyone's).
    pub owner: Option<TreeOwner>,
}

/// Whose trees a [`TreeFilter`] keeps: a principal's own, as
/// `http::auth::Principal::owns` decides it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TreeOwner {
    /// Asked for by this uid (over the socket, or the CLI).
    Uid(u32),
    /// Asked for with this token.
    Token(i64),
    /// Nobody's: an anonymous principal owns no tree.
    Nobody,
}

/// Selects events for reads and export. All conditions combine with AND;
/// rows come back in seq order (newest first with `newest_first`).
#[derive(Clone, Debug, Default)]
pub struct EventFilter {
    /// Events at or after this moment.
    pub since: Option<std::time::SystemTime>,
    pub tree: Option<TreeId>,
    /// Events with seq strictly greater than this (for paging / tailing).
    pub after_seq: Option<i64>,
    /// Events with seq strictly less than this (keyset paging backwards,
    /// with `newest_first`).
    pub before_seq: Option<i64>,
    /// Events whose kind starts with this (case-sensitive), e.g. `kill.`.
    pub kind_prefix: Option<String>,
    /// Descending seq order, so `limit` keeps the newest matches rather
    /// than the oldest. Off by default (export and tailing read oldest first).
    pub newest_first: bool,
    pub limit: Option<usize>,
}

/// How many of a tree's members are live (no exit recorded) and how many
/// were seen escaped (exited or not): what a tree list shows per tree.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MemberCounts {
    pub live: u64,
    pub escaped: u64,
}

/// The owner as shown with a tree.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct OwnerRow {
    /// The owner's id in this ledger.
    pub id: i64,
    /// The owner's pid (with `start` and `boot_id`, its identity).
    pub pid: i32,
    /// Start time in clock ticks.
    pub start: u64,
    /// The boot it ran in.
    pub boot_id: String,
    /// "run", "client" or "service" ([`OwnerRow::owner_kind`] for the type).
    pub kind: String,
}

impl OwnerRow {
    /// The owner's kind, typed (`None` only for a kind this build does not
    /// know: the database's CHECK allows none).
    pub fn owner_kind(&self) -> Option<OwnerKind> {
        self.kind.parse().ok()
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct TreeRow {
    /// The tree's id in this ledger.
    pub id: i64,
    /// The operator's label (`--label`), if one was given.
    pub label: Option<String>,
    /// Where the tree is in its life (spawning .. ended, ambiguous, resolved).
    pub state: TreeState,
    /// "cgroup" or "session": how membership is bounded.
    pub boundary: String,
    /// The process that owns the tree (run, a service client, the service).
    pub owner: OwnerRow,
    /// The root's command line as asked for.
    pub argv: Vec<String>,
    /// The root's working directory, when one was given.
    pub cwd: Option<String>,
    /// The root's pid, once the spawn was recorded (`None` while spawning).
    pub root_pid: Option<i32>,
    /// The root's start time in clock ticks (with `root_pid` and `boot_id`,
    /// its identity).
    pub root_start_ticks: Option<u64>,
    /// The boot the tree was spawned in: its pids mean nothing in another.
    pub boot_id: Option<String>,
    /// The recorded process group (the root's pid): the only group a
    /// teardown signals.
    pub pgid: Option<i32>,
    /// The recorded session (the root's pid).
    pub sid: Option<i32>,
    /// The tree's cgroup directory, on the cgroup boundary.
    pub cgroup: Option<String>,
    /// When the tree was recorded (RFC 3339).
    pub created_at: String,
    /// When it reached a terminal state (RFC 3339).
    pub ended_at: Option<String>,
    /// The root's exit, when known.
    pub exit: Option<ExitRecord>,
    /// Facts about the tree that outlive its state ("survivors",
    /// "authority_write_failed", "survivors_left", "survivors_ended", ...).
    pub flags: Vec<String>,
    /// Why it is ambiguous, or the operator's resolution note.
    pub note: Option<String>,
    /// The grace the tree was given, in milliseconds (`None`: recorded
    /// before migration 0002; use the configured default).
    pub grace_ms: Option<u64>,
    /// The timeout the tree was given, in milliseconds (`None`: none).
    pub timeout_ms: Option<u64>,
    /// The teardown's first signal it was given ("SIGINT"; `None`: SIGTERM).
    pub first_signal: Option<String>,
    /// The uid of the principal that asked for the tree (`None`: asked
    /// with a token, or recorded before migration 0006). A non-admin
    /// principal acts only on its own uid's trees.
    pub requester_uid: Option<u32>,
    /// The whole principal that asked.
    pub requested_by: Option<Requester>,
    /// The uid and gid the root was given before exec (`None`: the
    /// service's own).
    pub run_uid: Option<u32>,
    pub run_gid: Option<u32>,
}

impl TreeRow {
    pub fn tree_id(&self) -> TreeId {
        TreeId(self.id)
    }

    /// The grace this tree was given, or `default` for a tree recorded
    /// before grace was (migration 0002).
    pub fn grace_or(&self, default: std::time::Duration) -> std::time::Duration {
        self.grace_ms
            .map(std::time::Duration::from_millis)
            .unwrap_or(default)
    }

    /// The timeout this tree was given, if any.
    pub fn timeout(&self) -> Option<std::time::Duration> {
        self.timeout_ms.map(std::time::Duration::from_millis)
    }

    /// The root's identity, once the spawn was recorded.
    pub fn root(&self) -> Option<IdentityRecord> {
        Some(IdentityRecord {
            pid: self.root_pid?,
            start_ticks: self.root_start_ticks?,
            boot_id: self.boot_id.clone()?,
        })
    }

    /// A tree an operator resolved with `--force`, leaving survivors named
    /// in `tree.resolved`, that no teardown has finished since: still
    /// killable (`kill`) and swept once its owner is gone.
    pub fn has_survivors_left(&self) -> bool {
        self.state == TreeState::Resolved
            && self.flags.iter().any(|f| f == "survivors_left")
            && !self.flags.iter().any(|f| f == "survivors_ended")
    }

    pub fn owner_identity(&self) -> IdentityRecord {
        IdentityRecord {
            pid: self.owner.pid,
            start_ticks: self.owner.start,
            boot_id: self.owner.boot_id.clone(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct MemberRow {
    /// The member's pid (with `start_ticks` and `boot_id`, its identity).
    pub pid: i32,
    /// Its start time in clock ticks.
    pub start_ticks: u64,
    /// The boot it ran in.
    pub boot_id: String,
    /// Its parent when first seen.
    pub ppid: Option<i32>,
    /// Its process group when first seen.
    pub pgid: Option<i32>,
    /// Its session when first seen.
    pub sid: Option<i32>,
    /// Its cgroup path when first seen (`/proc/<pid>/cgroup`).
    pub cgroup: Option<String>,
    /// Its real uid.
    pub uid: Option<u32>,
    /// Its executable (`/proc/<pid>/exe`), refreshed when it execs.
    pub exe: Option<String>,
    /// Its command line, refreshed when it execs.
    pub cmdline: Vec<String>,
    /// Its working directory when first seen.
    pub cwd: Option<String>,
    /// When a scan or the observer first saw it (RFC 3339).
    pub first_seen: String,
    /// When it was last seen alive (a liveness hint, bumped coarsely).
    pub last_seen: String,
    /// When it was found gone (RFC 3339).
    pub exited_at: Option<String>,
    /// Its exit status, when this process reaped it.
    pub exit: Option<ExitRecord>,
    /// When it was found outside the tree's group and session.
    pub escaped_at: Option<String>,
}

impl MemberRow {
    pub fn identity(&self) -> IdentityRecord {
        IdentityRecord {
            pid: self.pid,
            start_ticks: self.start_ticks,
            boot_id: self.boot_id.clone(),
        }
    }
}

/// An append-only observation: an escape, an exit or a survivor snapshot.
#[derive(Clone, Debug, PartialEq, Serialize, utoipa::ToSchema)]
pub struct ObservationRow {
    pub id: i64,
    pub kind: String,
    pub identity: IdentityRecord,
    pub at: String,
    #[schema(value_type = Object)]
    pub detail: serde_json::Value,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct SignalRow {
    pub id: i64,
    pub signal: String,
    pub target_kind: String,
    pub target: String,
    pub result: String,
    pub authorization: Option<i64>,
    pub at: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct AuthorizationRow {
    pub id: i64,
    pub reason: String,
    pub targets: Vec<KillTarget>,
    pub at: String,
}

/// One audit event, exactly as exported: `data` is a JSON object.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct EventRow {
    pub seq: i64,
    pub at: String,
    pub tree: Option<i64>,
    /// The kind's name (`tree.created`, ...); one this build does not know
    /// reads as [`RowKind::Unknown`].
    #[schema(value_type = String)]
    pub kind: RowKind,
    /// The data exactly as stored and hashed; [`EventRow::event`] reads it typed.
    #[schema(value_type = Object)]
    pub data: serde_json::Value,
    pub prev_hash: String,
    pub hash: String,
}

impl EventRow {
    /// The event's data, typed (never fails: an unknown kind or data that
    /// does not decode is [`Event::Other`]).
    pub fn event(&self) -> Event {
        Event::decode(&self.kind, &self.data)
    }
}

/// Everything `show` displays about one tree.
#[derive(Clone, Debug, PartialEq, Serialize, utoipa::ToSchema)]
pub struct TreeDetail {
    pub tree: TreeRow,
    /// What the tree consumed: recorded in `tree.ended` for an ended tree;
    /// read live from its cgroup for a running one (by the service and
    /// `show`); absent where nothing is known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resources: Option<Resources>,
    pub members: Vec<MemberRow>,
    pub observations: Vec<ObservationRow>,
    pub signals: Vec<SignalRow>,
    pub authorizations: Vec<AuthorizationRow>,
    pub events: Vec<EventRow>,
}

/// The first thing `verify` found wrong.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct VerifyBreak {
    /// The event seq where the break is, when it is about an event.
    pub seq: Option<i64>,
    pub what: String,
}

impl std::fmt::Display for VerifyBreak {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.seq {
            Some(seq) => write!(f, "seq {seq}: {}", self.what),
            None => f.write_str(&self.what),
        }
    }
}

/// What `verify` checked and the first break, if any.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct VerifyReport {
    /// Events walked.
    pub events: u64,
    /// The newest event (seq, hash), if any.
    pub head: Option<(i64, String)>,
    /// `PRAGMA integrity_check` said "ok".
    pub integrity_ok: bool,
    pub first_break: Option<VerifyBreak>,
    /// The `ledger.checkpoint` the chain was proven from (its seq), when
    /// the ledger was pruned; for an archive, the checkpoint it matched.
    pub checkpoint: Option<i64>,
}

impl VerifyReport {
    pub fn is_ok(&self) -> bool {
        self.integrity_ok && self.first_break.is_none()
    }
}

/// The data of a `ledger.seal` event, typed (`op` names the variant).
/// Its `mac` is `hex(HMAC-SHA256(epoch key, canonical JSON of the data
/// without "mac"))`, so a field added, removed or changed breaks it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum SealData {
    /// `seal setup`: when epoch 0 starts and how long an epoch is; MACed
    /// with epoch 0's key.
    Setup(SealSetup),
    /// The seal of one ended epoch.
    Seal(EpochSeal),
    /// `seal close`: the writer stopped cleanly; seals the epoch it stopped in.
    Close(EpochSeal),
}

/// The setup of sealing, as the ledger records it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SealSetup {
    /// Epoch 0 starts here (RFC 3339, UTC, milliseconds); epoch N covers
    /// `[start + N*interval, start + (N+1)*interval)`.
    pub start: String,
    pub interval_ms: u64,
    pub mac: String,
}

/// One epoch's seal: the chain's head just before the seal event (whose
/// own `prev_hash` it must equal), and when it was made.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EpochSeal {
    pub epoch: u64,
    pub head_seq: i64,
    pub head_hash: String,
    pub made_at: String,
    /// Made more than one interval after its epoch ended (no sealer ran then).
    pub late: bool,
    pub mac: String,
}

/// What `verify --seal-key` proved about the seals.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SealReport {
    /// The setup event's seq.
    pub setup_seq: i64,
    pub interval_ms: u64,
    /// Seals checked (epochs 0 to `last_epoch`, consecutive).
    pub seals: u64,
    pub last_epoch: u64,
    /// The newest seal's seq and when it was made.
    pub last_seq: i64,
    pub last_made_at: String,
    /// The newest seal is a clean `seal close`.
    pub closed: bool,
    /// Seals made late (the epochs no sealer ran in), and the first of them.
    pub late: u64,
    pub first_late: Option<u64>,
    /// Events above the newest seal's head: not sealed yet.
    pub unsealed: u64,
    /// The time freshness was judged at (the read, or the export's own
    /// time); `None` for an export without one of a cleanly closed ledger.
    pub read_at: Option<String>,
}

/// Export formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
#[value(rename_all = "lowercase")]
pub enum ExportFormat {
    Ndjson,
    Csv,
}

impl std::str::FromStr for ExportFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "ndjson" => Ok(Self::Ndjson),
            "csv" => Ok(Self::Csv),
            other => Err(format!("unknown format {other:?}: expected ndjson or csv")),
        }
    }
}

#[cfg(test)]
mod since_tests {
    use super::parse_since;
    use std::time::{Duration, UNIX_EPOCH};

    #[test]
    fn since_takes_offsets_clamps_to_the_epoch_and_refuses_naive_or_empty() {
        let utc = parse_since("2024-05-01T12:00:00Z").expect("utc");
        let plus2 = parse_since("2024-05-01T14:00:00+02:00").expect("offset");
        assert_eq!(utc, plus2);
        assert_eq!(utc, UNIX_EPOCH + Duration::from_secs(1_714_564_800));
        assert_eq!(
            parse_since("1960-01-01T00:00:00Z").expect("old"),
            UNIX_EPOCH
        );
        assert!(
            parse_since("2024-05-01T12:00:00")
                .expect_err("naive")
                .contains("no offset")
        );
        assert!(parse_since("0").is_err());
        assert!(parse_since("yesterday").is_err());
        assert!(parse_since("2h").is_ok());
    }
}
