//! The ledger's row ids (typed, never a bare integer) and its closed
//! vocabularies: where a tree is in its life, and every audit event kind.

use serde::{Deserialize, Serialize};

#[cfg(doc)]
use super::reports::SealData;

/// A tree's row id in the ledger.
#[derive(Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TreeId(pub i64);

/// An owner's row id in the ledger.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct OwnerId(pub i64);

/// A committed kill authorization's row id. Holding one means the row that
/// authorizes a SIGKILL is durably in the ledger.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct AuthorizationId(pub i64);

/// Ids print as their integer (`tree 12`, `authorization #3`), in logs
/// (`?left`) too, as they did before they were typed.
macro_rules! id_display {
    ($($ty:ident),*) => {$(
        impl std::fmt::Display for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "{}", self.0)
            }
        }

        impl std::fmt::Debug for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "{}", self.0)
            }
        }
    )*};
}

id_display!(TreeId, OwnerId, AuthorizationId);

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
    /// A member outlived every SIGKILL its teardown sent it under a
    /// committed authorization (a pid namespace's init held by a zombie it
    /// cannot reap, a process in uninterruptible sleep): its identity, its
    /// state and wait channel as the kernel showed them, and the kills it
    /// outlived. Written once per member and tree.
    MemberUnkillable,
    /// The first loose member of the tree this process could not hold by a
    /// handle: a cap on held pidfds (per tree, per principal, or the
    /// host's under its descriptor limit) was reached. Written once per
    /// tree, with the flag `holds_capped`; the members past the cap are
    /// recorded and signalled as any, by identity and uid.
    TreeHoldsCapped,
    /// An API token was made (its id, name, scope, and who made it; never
    /// the secret). Addition to DESIGN.md.
    TokenCreated,
    /// An API token was revoked (its id, and who revoked it).
    TokenRevoked,
    /// A kill was asked for through the API, and by whom (`by`), written
    /// before its teardown starts. Addition to DESIGN.md.
    KillRequested,
    /// The service's shutdown was asked for through the API
    /// (`POST /api/shutdown`), by whom and with how many owned trees,
    /// written before the drain starts. Addition to DESIGN.md.
    ShutdownRequested,
    /// A prune removed ended trees' events up to `pruned_through`; the
    /// remaining chain is proven from here (`ledger/prune.rs`). Written
    /// only by [`crate::ledger::Ledger::prune`].
    LedgerCheckpoint,
    /// Sealed evidence (`ledger/seal.rs`): the setup, one seal
    /// per epoch, or the close; the data is a [`SealData`]. Written only by
    /// the sealer.
    LedgerSeal,
}

impl EventKind {
    pub const ALL: [EventKind; 27] = [
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
        Self::MemberUnkillable,
        Self::TreeHoldsCapped,
        Self::TokenCreated,
        Self::TokenRevoked,
        Self::KillRequested,
        Self::ShutdownRequested,
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
            Self::MemberUnkillable => "member.unkillable",
            Self::TreeHoldsCapped => "tree.holds_capped",
            Self::TokenCreated => "token.created",
            Self::TokenRevoked => "token.revoked",
            Self::KillRequested => "kill.requested",
            Self::ShutdownRequested => "service.shutdown_requested",
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
                | Self::ShutdownRequested
                | Self::TreeOomKill
                | Self::MemberUnkillable
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
