//! What readers get back: a tree's row and its owner, its members,
//! observations, signals, authorizations and events, and the whole of it
//! as `show` displays it.

use serde::{Deserialize, Serialize};

use super::limits::Resources;
use super::names::{AuthorizationId, OwnerId, TreeId, TreeState};
use super::records::{ExitRecord, IdentityRecord, KillTarget, OwnerKind, Requester};
use super::vocab::{SignalName, SignalResult, TargetKind, TreeFlag};
use crate::ledger::event::{Event, RowKind};
use crate::proc::BoundaryKind;

/// How many of a tree's members are live (no exit recorded), how many
/// were seen escaped (exited or not), and how many were seen at all: what
/// a tree list shows per tree.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MemberCounts {
    pub live: u64,
    pub escaped: u64,
    pub seen: u64,
}

/// The owner as shown with a tree.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct OwnerRow {
    /// The owner's id in this ledger.
    #[schema(value_type = i64)]
    pub id: OwnerId,
    /// The owner's pid (with `start` and `boot_id`, its identity).
    pub pid: i32,
    /// Start time in clock ticks.
    pub start: u64,
    /// The boot it ran in.
    pub boot_id: String,
    /// "run", "client" or "service" ([`OwnerRow::owner_kind`] for the type).
    #[schema(value_type = String)]
    pub kind: OwnerKind,
}

impl OwnerRow {
    /// The owner's kind (the database's CHECK allows no other).
    pub fn owner_kind(&self) -> OwnerKind {
        self.kind
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct TreeRow {
    /// The tree's id in this ledger.
    #[schema(value_type = i64)]
    pub id: TreeId,
    /// The operator's label (`--label`), if one was given.
    pub label: Option<String>,
    /// Where the tree is in its life (spawning .. ended, ambiguous, resolved).
    pub state: TreeState,
    /// "cgroup" or "session": how membership is bounded.
    #[schema(value_type = String)]
    pub boundary: BoundaryKind,
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
    #[schema(value_type = Vec<String>)]
    pub flags: Vec<TreeFlag>,
    /// Why it is ambiguous, or the operator's resolution note.
    pub note: Option<String>,
    /// The grace the tree was given, in milliseconds (`None`: recorded
    /// before migration 0002; use the configured default).
    pub grace_ms: Option<u64>,
    /// The timeout the tree was given, in milliseconds (`None`: none).
    pub timeout_ms: Option<u64>,
    /// The teardown's first signal it was given ("SIGINT"; `None`: SIGTERM).
    #[schema(value_type = Option<String>)]
    pub first_signal: Option<SignalName>,
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
    /// A running session tree of a `run` owner with nothing else set: the
    /// row unit tests start from and change what they test.
    #[cfg(test)]
    pub(crate) fn example() -> TreeRow {
        TreeRow {
            id: TreeId(1),
            label: None,
            state: TreeState::Running,
            boundary: crate::proc::BoundaryKind::Session,
            owner: OwnerRow {
                id: OwnerId(1),
                pid: 2,
                start: 3,
                boot_id: "b".into(),
                kind: crate::ledger::OwnerKind::Run,
            },
            argv: vec!["true".into()],
            cwd: None,
            root_pid: None,
            root_start_ticks: None,
            boot_id: None,
            pgid: None,
            sid: None,
            cgroup: None,
            created_at: String::new(),
            ended_at: None,
            exit: None,
            flags: Vec::new(),
            note: None,
            grace_ms: None,
            timeout_ms: None,
            first_signal: None,
            requester_uid: None,
            requested_by: None,
            run_uid: None,
            run_gid: None,
        }
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
            && self.has_flag(&TreeFlag::SurvivorsLeft)
            && !self.has_flag(&TreeFlag::SurvivorsEnded)
    }

    pub fn has_flag(&self, flag: &TreeFlag) -> bool {
        self.flags.contains(flag)
    }

    /// Whose account the tree is counted against (its requesting token,
    /// else its requester's uid; `Nobody` when neither is recorded): the
    /// principal of the per-principal bounds (ended logs, held pidfds).
    pub fn principal(&self) -> super::TreeOwner {
        if let Some(id) = self.requested_by.as_ref().and_then(|r| r.token_id) {
            return super::TreeOwner::Token(id);
        }
        match self.requester_uid {
            Some(uid) => super::TreeOwner::Uid(uid),
            None => super::TreeOwner::Nobody,
        }
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
    #[schema(value_type = String)]
    pub signal: SignalName,
    #[schema(value_type = String)]
    pub target_kind: TargetKind,
    pub target: String,
    #[schema(value_type = String)]
    pub result: SignalResult,
    #[schema(value_type = Option<i64>)]
    pub authorization: Option<AuthorizationId>,
    pub at: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct AuthorizationRow {
    #[schema(value_type = i64)]
    pub id: AuthorizationId,
    pub reason: String,
    pub targets: Vec<KillTarget>,
    pub at: String,
}

/// One audit event, exactly as exported: `data` is a JSON object.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct EventRow {
    pub seq: i64,
    pub at: String,
    #[schema(value_type = Option<i64>)]
    pub tree: Option<TreeId>,
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
    /// Its hash recomputed from its fields (`hash` is what it claims).
    pub fn recomputed_hash(&self) -> String {
        crate::ledger::event_hash(
            &self.prev_hash,
            self.seq,
            &self.at,
            self.tree.map(|t| t.0),
            self.kind.as_str(),
            &self.data,
        )
    }

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
