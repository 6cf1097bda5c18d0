//! What writers hand the ledger: identities, owners, a tree about to be
//! spawned and who asked for it, tokens, what a spawn formed, members,
//! exits, survivors, kill targets, signals, and the writes a teardown
//! deferred.

use serde::{Deserialize, Serialize};

use super::limits::Limits;
use super::names::{AuthorizationId, OwnerId, TreeState};
use super::vocab::{SignalName, SignalResult, TargetKind, TreeFlag};
use crate::proc::BoundaryKind;

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

impl std::fmt::Display for OwnerKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
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

/// A tree about to be spawned.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NewTree {
    pub label: Option<String>,
    pub boundary: BoundaryKind,
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
    pub first_signal: Option<SignalName>,
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
    /// The CLI user's audit login uid (`/proc/self/loginuid`): who logged
    /// in, kept across `sudo` and `su`. Absent where the kernel keeps none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub login_uid: Option<u32>,
    /// `SUDO_USER` of a CLI run under sudo: the person behind uid 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sudo_user: Option<String>,
}

impl std::fmt::Display for Requester {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.token_id, self.uid) {
            (Some(id), _) => write!(
                f,
                "token {id} ({})",
                self.token_name.as_deref().unwrap_or("")
            )?,
            (None, Some(uid)) => {
                write!(f, "uid {uid}")?;
                let mut more = Vec::new();
                if let Some(pid) = self.pid {
                    more.push(format!("pid {pid}"));
                }
                if let Some(login) = self.login_uid.filter(|l| *l != uid) {
                    more.push(format!("login uid {login}"));
                }
                if let Some(sudo) = &self.sudo_user {
                    more.push(format!("sudo by {sudo}"));
                }
                if !more.is_empty() {
                    write!(f, " ({})", more.join(", "))?;
                }
            }
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
    #[schema(value_type = String)]
    pub kind: TargetKind,
    pub target: String,
    pub identities: Vec<IdentityRecord>,
}

/// A signal that was sent (or attempted).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SignalRecord {
    pub signal: SignalName,
    pub target_kind: TargetKind,
    pub target: String,
    pub result: SignalResult,
    pub authorization: Option<AuthorizationId>,
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
    Flag { flag: TreeFlag, at: String },
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
