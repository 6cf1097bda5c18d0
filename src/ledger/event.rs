//! The audit events, typed: one payload per [`EventKind`], the one shape the
//! writer writes and every reader (verify, the dashboard, metrics, export,
//! the shipper) reads back. The payloads serialize to exactly the JSON the
//! writer wrote before they existed (an optional field the old writer left
//! out is `skip_serializing_if`, one it wrote as `null` is a plain
//! `Option`), so every stored hash stays what it was; `event_tests` checks
//! it against a chain written by the old code.
//!
//! Reading is total: an event whose kind this build does not know (a newer
//! writer's), or whose data does not decode as its kind's payload, reads as
//! [`Event::Other`] carrying its kind's name, its raw data and why; a read
//! never fails on one. The chain check does not depend on the payload, so
//! `verify` still proves such an event's hash; the two payloads it reasons
//! about (`kill.authorized`, a SIGKILL's `signal.sent`) it requires to
//! decode. Extra keys (`deferred_from`, `deferred_batch`, a newer writer's
//! field) are ignored by the payloads and kept in the raw data.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::EventKind;
use super::types::{
    AuthorizationId, ExitRecord, IdentityRecord, KillTarget, Limits, OwnerId, OwnerKind, Requester,
    Resources, SealData, SignalName, SignalResult, SurvivorRecord, TargetKind, TokenScope, TreeId,
    TreeState,
};
use crate::proc::BoundaryKind;

/// An event's kind as a row carries it: one this build knows, or the name
/// of one it does not (an older or newer writer's). Serialized as the name.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum RowKind {
    Known(EventKind),
    Unknown(String),
}

impl RowKind {
    /// The kind as the ledger stores it (the name the hash covers).
    pub fn parse(name: &str) -> RowKind {
        match name.parse::<EventKind>() {
            Ok(k) => RowKind::Known(k),
            Err(_) => RowKind::Unknown(name.to_string()),
        }
    }

    pub fn as_str(&self) -> &str {
        match self {
            RowKind::Known(k) => k.as_str(),
            RowKind::Unknown(s) => s,
        }
    }

    pub fn known(&self) -> Option<EventKind> {
        match self {
            RowKind::Known(k) => Some(*k),
            RowKind::Unknown(_) => None,
        }
    }
}

impl PartialEq<EventKind> for RowKind {
    fn eq(&self, other: &EventKind) -> bool {
        self.known() == Some(*other)
    }
}

impl From<EventKind> for RowKind {
    fn from(k: EventKind) -> Self {
        RowKind::Known(k)
    }
}

impl std::fmt::Display for RowKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for RowKind {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for RowKind {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        Ok(RowKind::parse(&name))
    }
}

/// The owner as `tree.created` names it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreatedOwner {
    pub id: OwnerId,
    pub pid: i32,
    pub start: i64,
    pub kind: OwnerKind,
}

/// `tree.created`: the tree row, committed before its child is released.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TreeCreated {
    pub label: Option<String>,
    pub boundary: BoundaryKind,
    pub owner: CreatedOwner,
    pub argv: Vec<String>,
    pub cwd: Option<String>,
    pub grace_ms: Option<u64>,
    pub timeout_ms: Option<u64>,
    #[serde(default)]
    pub limits: Limits,
    pub first_signal: Option<SignalName>,
    pub by: Option<Requester>,
    pub run_uid: Option<u32>,
    pub run_gid: Option<u32>,
    /// Only where the argv was cut (`bound.rs`): its length and digest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub argv_truncated: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label_truncated: Option<Value>,
}

/// `tree.spawned`: what the spawn formed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TreeSpawned {
    pub root: IdentityRecord,
    pub pgid: i32,
    pub sid: i32,
    pub cgroup: Option<String>,
}

/// `tree.spawn_failed`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TreeSpawnFailed {
    pub from: TreeState,
    pub reason: String,
    pub exit_code: i32,
}

/// A member as `member.observed` and `escape.observed` record it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberSeen {
    pub identity: IdentityRecord,
    pub ppid: i32,
    pub pgid: i32,
    pub sid: i32,
    pub cgroup: Option<String>,
    pub uid: Option<u32>,
    pub exe: Option<String>,
    #[serde(default)]
    pub cmdline: Vec<String>,
    pub cwd: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cmdline_truncated: Option<Value>,
}

/// Where an escaped member was before (its row as first recorded).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EscapedFrom {
    pub pgid: Option<i32>,
    pub sid: Option<i32>,
}

/// `escape.observed`: where the member went (`member`) and was (`before`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EscapeObserved {
    pub member: MemberSeen,
    pub reason: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub before: Option<EscapedFrom>,
}

/// `member.exited`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberExited {
    pub identity: IdentityRecord,
    pub exit: Option<ExitRecord>,
    /// `treewarden` when this process reaped it, else who did (or `unknown`).
    pub reaped_by: String,
}

/// A program as `member.exec` names it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Program {
    pub exe: Option<String>,
    #[serde(default)]
    pub argv: Vec<String>,
}

/// `member.exec`: the old and the new program.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberExec {
    pub identity: IdentityRecord,
    pub from: Program,
    pub to: Program,
}

/// `survivors.recorded`: the snapshot before a forced kill.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SurvivorsRecorded {
    pub survivors: Vec<SurvivorRecord>,
    /// When they were read (frozen); the event is written a moment later.
    pub taken_at: String,
}

/// `signal.sent`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SignalSent {
    /// The `signals` row's id.
    pub id: i64,
    pub signal: SignalName,
    pub target_kind: TargetKind,
    pub target: String,
    pub result: SignalResult,
    pub authorization: Option<AuthorizationId>,
}

/// `kill.authorized`: committed (FULL) before the SIGKILL it names.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KillAuthorized {
    pub authorization: AuthorizationId,
    pub targets: Vec<KillTarget>,
    pub reason: String,
}

/// `kill.skipped`, `sweep.refused`: a reason.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reason {
    pub reason: String,
}

/// `tree.state`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateChanged {
    pub from: TreeState,
    pub to: TreeState,
    pub reason: Option<String>,
}

/// `tree.ended`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TreeEnded {
    pub from: TreeState,
    pub to: TreeState,
    pub exit: Option<ExitRecord>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<Resources>,
}

/// `tree.resolved`: the operator's note; with `forced`, the survivors left alive.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TreeResolved {
    pub note: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forced: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub survivors_left: Option<Vec<IdentityRecord>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<Requester>,
}

/// `tree.oom_kill`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OomKill {
    /// New since the last one recorded.
    pub oom_kills: u64,
    pub total: u64,
}

/// `member.unkillable`: a member that outlived every SIGKILL its teardown
/// sent it under a committed authorization. The evidence is the kernel's:
/// the member's state letter from `/proc/<pid>/stat` and its wait channel
/// (`/proc/<pid>/wchan`, where readable) as the last verify read them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberUnkillable {
    pub identity: IdentityRecord,
    /// The state letter (`S`, `D`, ...).
    pub state: String,
    /// The kernel function it sleeps in; absent where the kernel hides it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wchan: Option<String>,
    /// The SIGKILLs it outlived, each sent under a committed authorization.
    pub kills: u32,
    /// The last authorization that named it.
    pub authorization: AuthorizationId,
}

/// `tree.holds_capped`: the first hold of a loose member the budget of
/// held handles refused (`custody/holds.rs`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HoldsCapped {
    /// Which cap: `tree`, `principal` or `host`.
    pub cap: String,
    /// The cap's value then.
    pub limit: u64,
    /// Handles the tree held then.
    pub held: u64,
}

/// `token.created` (never the secret).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenCreated {
    pub token: i64,
    pub name: String,
    pub scope: TokenScope,
    pub by: Requester,
}

/// `token.revoked`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenRevoked {
    pub token: i64,
    pub by: Requester,
}

/// `kill.requested`: who asked through the API, before the teardown starts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KillRequested {
    pub by: Requester,
    pub grace_ms: Option<u64>,
}

/// `service.shutdown_requested`: who asked for the shutdown through the
/// API, and how many trees the service owned then, before the drain starts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShutdownRequested {
    pub by: Requester,
    pub owned_trees: u64,
}

/// `sweep.started`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SweepStarted {
    /// Trees examined.
    pub candidates: u64,
    /// The sweeping process.
    pub pid: u32,
}

/// An owner as `sweep.orphan_found` names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GoneOwner {
    pub pid: i32,
    pub start: u64,
}

/// `sweep.orphan_found`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrphanFound {
    pub owner: GoneOwner,
    pub state: TreeState,
    pub grace_ms: u64,
}

/// `dispatch.refused`: the first unsettled tree in scope, how many, and
/// who was refused.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DispatchRefused {
    pub tree: TreeId,
    pub reason: String,
    pub unsettled: u64,
    /// The principal refused (absent from refusals recorded before it was
    /// named, and from the host-wide check that has no requester).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<Requester>,
}

/// A range of events as `ledger.checkpoint` names it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrunedEvents {
    pub events: u64,
    pub trees: u64,
    pub first: i64,
    pub last: i64,
    pub digest: String,
}

/// The events a prune kept below its boundary.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeptEvents {
    pub events: u64,
    pub digest: String,
}

/// `ledger.checkpoint`: what a prune removed; the chain is proven from here.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checkpointed {
    pub before: String,
    pub pruned_through: i64,
    pub hash: String,
    pub pruned: PrunedEvents,
    pub kept_below: KeptEvents,
    pub archive: Option<String>,
    pub previous: Option<i64>,
}

/// An event this build does not read typed: an unknown kind, or data that
/// does not decode as its kind's payload. Kept whole.
#[derive(Clone, Debug, PartialEq)]
pub struct OtherEvent {
    pub kind: RowKind,
    pub data: Value,
    /// Why it is not typed (the decode error; `unknown kind` for a name
    /// this build does not know).
    pub why: String,
}

/// One audit event's data, typed: a variant per [`EventKind`].
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    TreeCreated(Box<TreeCreated>),
    TreeSpawned(TreeSpawned),
    TreeSpawnFailed(TreeSpawnFailed),
    MemberObserved(Box<MemberSeen>),
    EscapeObserved(Box<EscapeObserved>),
    MemberExited(MemberExited),
    MemberExec(Box<MemberExec>),
    SurvivorsRecorded(SurvivorsRecorded),
    SignalSent(SignalSent),
    KillAuthorized(KillAuthorized),
    KillSkipped(Reason),
    TreeState(StateChanged),
    TreeEnded(TreeEnded),
    SweepStarted(SweepStarted),
    SweepOrphanFound(OrphanFound),
    SweepRefused(Reason),
    DispatchRefused(DispatchRefused),
    TreeResolved(TreeResolved),
    TreeOomKill(OomKill),
    MemberUnkillable(MemberUnkillable),
    TreeHoldsCapped(HoldsCapped),
    TokenCreated(TokenCreated),
    TokenRevoked(TokenRevoked),
    KillRequested(KillRequested),
    ShutdownRequested(ShutdownRequested),
    LedgerCheckpoint(Box<Checkpointed>),
    LedgerSeal(SealData),
    Other(Box<OtherEvent>),
}

impl Event {
    /// The kind this payload is written as (`None` for [`Event::Other`]).
    pub fn kind(&self) -> Option<EventKind> {
        Some(match self {
            Event::TreeCreated(_) => EventKind::TreeCreated,
            Event::TreeSpawned(_) => EventKind::TreeSpawned,
            Event::TreeSpawnFailed(_) => EventKind::TreeSpawnFailed,
            Event::MemberObserved(_) => EventKind::MemberObserved,
            Event::EscapeObserved(_) => EventKind::EscapeObserved,
            Event::MemberExited(_) => EventKind::MemberExited,
            Event::MemberExec(_) => EventKind::MemberExec,
            Event::SurvivorsRecorded(_) => EventKind::SurvivorsRecorded,
            Event::SignalSent(_) => EventKind::SignalSent,
            Event::KillAuthorized(_) => EventKind::KillAuthorized,
            Event::KillSkipped(_) => EventKind::KillSkipped,
            Event::TreeState(_) => EventKind::TreeState,
            Event::TreeEnded(_) => EventKind::TreeEnded,
            Event::SweepStarted(_) => EventKind::SweepStarted,
            Event::SweepOrphanFound(_) => EventKind::SweepOrphanFound,
            Event::SweepRefused(_) => EventKind::SweepRefused,
            Event::DispatchRefused(_) => EventKind::DispatchRefused,
            Event::TreeResolved(_) => EventKind::TreeResolved,
            Event::TreeOomKill(_) => EventKind::TreeOomKill,
            Event::MemberUnkillable(_) => EventKind::MemberUnkillable,
            Event::TreeHoldsCapped(_) => EventKind::TreeHoldsCapped,
            Event::TokenCreated(_) => EventKind::TokenCreated,
            Event::TokenRevoked(_) => EventKind::TokenRevoked,
            Event::KillRequested(_) => EventKind::KillRequested,
            Event::ShutdownRequested(_) => EventKind::ShutdownRequested,
            Event::LedgerCheckpoint(_) => EventKind::LedgerCheckpoint,
            Event::LedgerSeal(_) => EventKind::LedgerSeal,
            Event::Other(_) => return None,
        })
    }

    /// The data as the writer stores it (before canonicalization).
    pub fn to_data(&self) -> Result<Value, serde_json::Error> {
        use serde_json::to_value as v;
        match self {
            Event::TreeCreated(p) => v(p),
            Event::TreeSpawned(p) => v(p),
            Event::TreeSpawnFailed(p) => v(p),
            Event::MemberObserved(p) => v(p),
            Event::EscapeObserved(p) => v(p),
            Event::MemberExited(p) => v(p),
            Event::MemberExec(p) => v(p),
            Event::SurvivorsRecorded(p) => v(p),
            Event::SignalSent(p) => v(p),
            Event::KillAuthorized(p) => v(p),
            Event::KillSkipped(p) | Event::SweepRefused(p) => v(p),
            Event::TreeState(p) => v(p),
            Event::TreeEnded(p) => v(p),
            Event::SweepStarted(p) => v(p),
            Event::SweepOrphanFound(p) => v(p),
            Event::DispatchRefused(p) => v(p),
            Event::TreeResolved(p) => v(p),
            Event::TreeOomKill(p) => v(p),
            Event::MemberUnkillable(p) => v(p),
            Event::TreeHoldsCapped(p) => v(p),
            Event::TokenCreated(p) => v(p),
            Event::TokenRevoked(p) => v(p),
            Event::KillRequested(p) => v(p),
            Event::ShutdownRequested(p) => v(p),
            Event::LedgerCheckpoint(p) => v(p),
            Event::LedgerSeal(p) => v(p),
            Event::Other(o) => Ok(o.data.clone()),
        }
    }

    /// Reads one stored event back typed. Never fails: see [`Event::Other`].
    pub fn decode(kind: &RowKind, data: &Value) -> Event {
        let RowKind::Known(k) = kind else {
            return Event::Other(Box::new(OtherEvent {
                kind: kind.clone(),
                data: data.clone(),
                why: "unknown kind".into(),
            }));
        };
        fn p<T: serde::de::DeserializeOwned>(data: &Value) -> Result<T, serde_json::Error> {
            T::deserialize(data)
        }
        let typed = match k {
            EventKind::TreeCreated => p(data).map(|x| Event::TreeCreated(Box::new(x))),
            EventKind::TreeSpawned => p(data).map(Event::TreeSpawned),
            EventKind::TreeSpawnFailed => p(data).map(Event::TreeSpawnFailed),
            EventKind::MemberObserved => p(data).map(|x| Event::MemberObserved(Box::new(x))),
            EventKind::EscapeObserved => p(data).map(|x| Event::EscapeObserved(Box::new(x))),
            EventKind::MemberExited => p(data).map(Event::MemberExited),
            EventKind::MemberExec => p(data).map(|x| Event::MemberExec(Box::new(x))),
            EventKind::SurvivorsRecorded => p(data).map(Event::SurvivorsRecorded),
            EventKind::SignalSent => p(data).map(Event::SignalSent),
            EventKind::KillAuthorized => p(data).map(Event::KillAuthorized),
            EventKind::KillSkipped => p(data).map(Event::KillSkipped),
            EventKind::TreeState => p(data).map(Event::TreeState),
            EventKind::TreeEnded => p(data).map(Event::TreeEnded),
            EventKind::SweepStarted => p(data).map(Event::SweepStarted),
            EventKind::SweepOrphanFound => p(data).map(Event::SweepOrphanFound),
            EventKind::SweepRefused => p(data).map(Event::SweepRefused),
            EventKind::DispatchRefused => p(data).map(Event::DispatchRefused),
            EventKind::TreeResolved => p(data).map(Event::TreeResolved),
            EventKind::TreeOomKill => p(data).map(Event::TreeOomKill),
            EventKind::MemberUnkillable => p(data).map(Event::MemberUnkillable),
            EventKind::TreeHoldsCapped => p(data).map(Event::TreeHoldsCapped),
            EventKind::TokenCreated => p(data).map(Event::TokenCreated),
            EventKind::TokenRevoked => p(data).map(Event::TokenRevoked),
            EventKind::KillRequested => p(data).map(Event::KillRequested),
            EventKind::ShutdownRequested => p(data).map(Event::ShutdownRequested),
            EventKind::LedgerCheckpoint => p(data).map(|x| Event::LedgerCheckpoint(Box::new(x))),
            EventKind::LedgerSeal => p(data).map(Event::LedgerSeal),
        };
        typed.unwrap_or_else(|e| {
            Event::Other(Box::new(OtherEvent {
                kind: kind.clone(),
                data: data.clone(),
                why: format!("{k} data does not decode: {e}"),
            }))
        })
    }
}

/// One teardown's steps as its events recorded them: the instant (RFC 3339,
/// as the ledger wrote it) of each step the teardown reached, read typed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TeardownTimeline {
    /// It began: the tree went `terminating`, or its first SIGTERM.
    pub term: String,
    /// The survivors were frozen and read (`survivors.recorded`'s `taken_at`).
    pub freeze: Option<String>,
    /// The forced kill was authorized (`kill.authorized` committed).
    pub authorized: Option<String>,
    /// The first SIGKILL.
    pub kill: Option<String>,
    /// It was decided: verified empty (`tree.ended`) or ambiguous.
    pub end: Option<String>,
    /// The state it was decided in (`ended`, `vanished`, `ambiguous`).
    pub end_state: Option<TreeState>,
}

impl TeardownTimeline {
    /// The first teardown in one tree's events (seq order); `None` when it
    /// has none yet.
    pub fn from_events(events: &[super::EventRow]) -> Option<TeardownTimeline> {
        let typed: Vec<(&str, Event)> = events.iter().map(|e| (e.at.as_str(), e.event())).collect();
        let first = |pred: &dyn Fn(&Event) -> bool| {
            typed
                .iter()
                .find(|(_, e)| pred(e))
                .map(|(at, _)| (*at).to_string())
        };
        let term = first(&|e| {
            matches!(e, Event::TreeState(s) if s.to == TreeState::Terminating)
                || matches!(e, Event::SignalSent(s) if s.signal.is_polite())
        })?;
        let freeze = typed.iter().find_map(|(_, e)| match e {
            Event::SurvivorsRecorded(s) => Some(s.taken_at.clone()),
            _ => None,
        });
        let (end, end_state) = typed
            .iter()
            .find_map(|(at, e)| match e {
                Event::TreeEnded(t) => Some(((*at).to_string(), t.to)),
                Event::TreeState(s) if s.to == TreeState::Ambiguous => {
                    Some(((*at).to_string(), s.to))
                }
                _ => None,
            })
            .unzip();
        Some(TeardownTimeline {
            term,
            freeze,
            authorized: first(&|e| matches!(e, Event::KillAuthorized(_))),
            kill: first(&|e| matches!(e, Event::SignalSent(s) if s.signal.is_kill())),
            end,
            end_state,
        })
    }
}

#[cfg(test)]
mod tests {
    //! The oracle: each payload against the `json!` the writer built before
    //! the payloads existed (copied here as it was at d6c0c6b), compared in
    //! canonical form, the bytes every hash covers. A field renamed, dropped,
    //! added, or turned from `null` into absent fails here.
    use super::*;
    use crate::ledger::canonical_string;
    use serde_json::json;

    fn id(pid: i32) -> IdentityRecord {
        IdentityRecord {
            pid,
            start_ticks: 4242,
            boot_id: "b-1".into(),
        }
    }

    fn req() -> Requester {
        Requester {
            via: "socket".into(),
            uid: Some(1000),
            pid: Some(77),
            token_id: None,
            token_name: None,
            ..Default::default()
        }
    }

    /// Canonical text of the typed payload equals the old `json!`, and the
    /// payload reads back to itself.
    fn same(event: Event, old: Value) {
        let data = event.to_data().expect("to_data");
        assert_eq!(canonical_string(&data), canonical_string(&old), "{event:?}");
        let kind = RowKind::Known(event.kind().expect("typed"));
        assert_eq!(Event::decode(&kind, &old), event, "round trip of {kind}");
    }

    #[test]
    fn every_payload_is_the_old_writers_json_byte_for_byte() {
        let exit = Some(ExitRecord {
            code: None,
            signal: Some(9),
            cpu_usec: Some(12),
        });
        let member = MemberSeen {
            identity: id(11),
            ppid: 10,
            pgid: 10,
            sid: 10,
            cgroup: None,
            uid: Some(1000),
            exe: Some("/bin/sh".into()),
            cmdline: vec!["sh".into(), "-c".into(), "é \"q\"\n".into()],
            cwd: None,
            cmdline_truncated: None,
        };
        let old_member = json!({
            "identity": id(11), "ppid": 10, "pgid": 10, "sid": 10,
            "cgroup": null, "uid": 1000, "exe": "/bin/sh", "cmdline": ["sh", "-c", "é \"q\"\n"], "cwd": null,
        });
        let limits = Limits {
            memory_max: Some(1 << 20),
            pids_max: None,
            cpu_max_pct: None,
        };
        for (by, cut) in [
            (None, None),
            (Some(req()), Some(json!({"bytes": 9, "sha256": "ab"}))),
        ] {
            let mut old = json!({
                "label": "l", "boundary": "cgroup",
                "owner": {"id": 1, "pid": 5, "start": 6, "kind": "run"},
                "argv": ["a"], "cwd": null, "grace_ms": 5000, "timeout_ms": null,
                "limits": limits, "first_signal": null, "by": by,
                "run_uid": null, "run_gid": null,
            });
            if let Some(c) = &cut {
                old["argv_truncated"] = c.clone();
            }
            same(
                Event::TreeCreated(Box::new(TreeCreated {
                    label: Some("l".into()),
                    boundary: crate::proc::BoundaryKind::Cgroup,
                    owner: CreatedOwner {
                        id: OwnerId(1),
                        pid: 5,
                        start: 6,
                        kind: crate::ledger::OwnerKind::Run,
                    },
                    argv: vec!["a".into()],
                    cwd: None,
                    grace_ms: Some(5000),
                    timeout_ms: None,
                    limits,
                    first_signal: None,
                    by,
                    run_uid: None,
                    run_gid: None,
                    argv_truncated: cut,
                    label_truncated: None,
                })),
                old,
            );
        }
        same(
            Event::TreeSpawned(TreeSpawned {
                root: id(10),
                pgid: 10,
                sid: 10,
                cgroup: None,
            }),
            json!({"root": id(10), "pgid": 10, "sid": 10, "cgroup": null}),
        );
        same(
            Event::TreeSpawnFailed(TreeSpawnFailed {
                from: TreeState::Spawning,
                reason: "no such file".into(),
                exit_code: 127,
            }),
            json!({"from": TreeState::Spawning, "reason": "no such file", "exit_code": 127}),
        );
        same(
            Event::MemberObserved(Box::new(member.clone())),
            old_member.clone(),
        );
        for before in [None, Some((Some(10), None))] {
            let mut old = json!({"member": old_member.clone(), "reason": "left its session"});
            if let Some((pgid, sid)) = before {
                old["before"] = json!({"pgid": pgid, "sid": sid});
            }
            same(
                Event::EscapeObserved(Box::new(EscapeObserved {
                    member: member.clone(),
                    reason: "left its session".into(),
                    before: before.map(|(pgid, sid)| EscapedFrom { pgid, sid }),
                })),
                old,
            );
        }
        for exit in [None, exit] {
            same(
                Event::MemberExited(MemberExited {
                    identity: id(11),
                    exit,
                    reaped_by: "treewarden".into(),
                }),
                json!({"identity": id(11), "exit": exit, "reaped_by": "treewarden"}),
            );
        }
        same(
            Event::MemberExec(Box::new(MemberExec {
                identity: id(11),
                from: Program {
                    exe: None,
                    argv: vec![],
                },
                to: Program {
                    exe: Some("/bin/sleep".into()),
                    argv: vec!["sleep".into()],
                },
            })),
            json!({"identity": id(11), "from": {"exe": null, "argv": []},
                   "to": {"exe": "/bin/sleep", "argv": ["sleep"]}}),
        );
        let survivors = vec![SurvivorRecord {
            identity: id(12),
            state: "T".into(),
            rss_bytes: 4096,
            cmdline: vec!["x".into()],
        }];
        same(
            Event::SurvivorsRecorded(SurvivorsRecorded {
                survivors: survivors.clone(),
                taken_at: "2024-01-01T00:00:00.000Z".into(),
            }),
            json!({"survivors": survivors, "taken_at": "2024-01-01T00:00:00.000Z"}),
        );
        for auth in [None, Some(3)] {
            same(
                Event::SignalSent(SignalSent {
                    id: 8,
                    signal: "SIGKILL".into(),
                    target_kind: crate::ledger::TargetKind::Group,
                    target: "10".into(),
                    result: "sent to 2 members".into(),
                    authorization: auth.map(AuthorizationId),
                }),
                json!({"id": 8, "signal": "SIGKILL", "target_kind": "group", "target": "10",
                       "result": "sent to 2 members", "authorization": auth}),
            );
        }
        let targets = vec![KillTarget {
            kind: crate::ledger::TargetKind::Pid,
            target: "12".into(),
            identities: vec![id(12)],
        }];
        same(
            Event::KillAuthorized(KillAuthorized {
                authorization: AuthorizationId(3),
                targets: targets.clone(),
                reason: "grace expired".into(),
            }),
            json!({"authorization": 3, "targets": targets, "reason": "grace expired"}),
        );
        same(
            Event::KillSkipped(Reason { reason: "r".into() }),
            json!({"reason": "r"}),
        );
        same(
            Event::SweepRefused(Reason { reason: "r".into() }),
            json!({"reason": "r"}),
        );
        for reason in [None, Some("asked")] {
            same(
                Event::TreeState(StateChanged {
                    from: TreeState::Running,
                    to: TreeState::Terminating,
                    reason: reason.map(str::to_string),
                }),
                json!({"from": TreeState::Running, "to": TreeState::Terminating, "reason": reason}),
            );
        }
        let resources = Resources {
            cpu_usec: Some(5),
            ..Resources::default()
        };
        for r in [None, Some(resources)] {
            let mut old = json!({"from": TreeState::Killing, "to": TreeState::Ended, "exit": exit});
            if let Some(r) = r {
                old["resources"] = serde_json::to_value(r).expect("resources");
            }
            same(
                Event::TreeEnded(TreeEnded {
                    from: TreeState::Killing,
                    to: TreeState::Ended,
                    exit,
                    resources: r,
                }),
                old,
            );
        }
        for (left, by) in [(vec![], None), (vec![id(12)], Some(req()))] {
            let mut old = if left.is_empty() {
                json!({"note": "checked"})
            } else {
                json!({"note": "checked", "forced": true, "survivors_left": left})
            };
            if let (Some(by), Some(obj)) = (&by, old.as_object_mut()) {
                obj.insert("by".into(), serde_json::to_value(by).expect("by"));
            }
            let forced = !left.is_empty();
            same(
                Event::TreeResolved(TreeResolved {
                    note: "checked".into(),
                    forced: forced.then_some(true),
                    survivors_left: forced.then(|| left.clone()),
                    by,
                }),
                old,
            );
        }
        same(
            Event::TreeOomKill(OomKill {
                oom_kills: 1,
                total: 3,
            }),
            json!({ "oom_kills": 1, "total": 3 }),
        );
        for wchan in [None, Some("zap_pid_ns_processes")] {
            let mut old = json!({"identity": id(9), "state": "S", "kills": 3, "authorization": 12});
            if let Some(w) = wchan {
                old["wchan"] = json!(w);
            }
            same(
                Event::MemberUnkillable(MemberUnkillable {
                    identity: id(9),
                    state: "S".into(),
                    wchan: wchan.map(String::from),
                    kills: 3,
                    authorization: AuthorizationId(12),
                }),
                old,
            );
        }
        same(
            Event::TokenCreated(TokenCreated {
                token: 2,
                name: "ci".into(),
                scope: TokenScope::Spawn,
                by: req(),
            }),
            json!({"token": 2, "name": "ci", "scope": TokenScope::Spawn.as_str(), "by": req()}),
        );
        same(
            Event::TokenRevoked(TokenRevoked {
                token: 2,
                by: req(),
            }),
            json!({"token": 2, "by": req()}),
        );
        for grace in [None, Some(250)] {
            same(
                Event::KillRequested(KillRequested {
                    by: req(),
                    grace_ms: grace,
                }),
                json!({"by": req(), "grace_ms": grace}),
            );
        }
        same(
            Event::ShutdownRequested(ShutdownRequested {
                by: req(),
                owned_trees: 3,
            }),
            json!({"by": req(), "owned_trees": 3}),
        );
        same(
            Event::SweepStarted(SweepStarted {
                candidates: 4,
                pid: 99,
            }),
            json!({ "candidates": 4_usize, "pid": 99_u32 }),
        );
        same(
            Event::SweepOrphanFound(OrphanFound {
                owner: GoneOwner { pid: 5, start: 6 },
                state: TreeState::Running,
                grace_ms: 5000,
            }),
            json!({"owner": { "pid": 5, "start": 6 }, "state": TreeState::Running.as_str(), "grace_ms": 5000}),
        );
        same(
            Event::DispatchRefused(DispatchRefused {
                tree: TreeId(3),
                reason: "ambiguous".into(),
                unsettled: 2,
                by: None,
            }),
            json!({"tree": 3, "reason": "ambiguous", "unsettled": 2}),
        );
        same(
            Event::DispatchRefused(DispatchRefused {
                tree: TreeId(3),
                reason: "ambiguous".into(),
                unsettled: 2,
                by: Some(req()),
            }),
            json!({"tree": 3, "reason": "ambiguous", "unsettled": 2, "by": req()}),
        );
        for archive in [None, Some("a.ndjson")] {
            same(
                Event::LedgerCheckpoint(Box::new(Checkpointed {
                    before: "2024-01-01T00:00:00.000Z".into(),
                    pruned_through: 40,
                    hash: "h".into(),
                    pruned: PrunedEvents {
                        events: 30,
                        trees: 2,
                        first: 1,
                        last: 40,
                        digest: "d".into(),
                    },
                    kept_below: KeptEvents {
                        events: 10,
                        digest: "k".into(),
                    },
                    archive: archive.map(str::to_string),
                    previous: None,
                })),
                json!({
                    "before": "2024-01-01T00:00:00.000Z", "pruned_through": 40, "hash": "h",
                    "pruned": {"events": 30, "trees": 2, "first": 1, "last": 40, "digest": "d"},
                    "kept_below": {"events": 10, "digest": "k"},
                    "archive": archive, "previous": null,
                }),
            );
        }
    }

    #[test]
    fn every_kind_has_a_payload() {
        // Each kind's payload decodes from what its writer writes (the
        // oracle above); here: no kind is left reading as Other by design.
        for kind in EventKind::ALL {
            let decoded = Event::decode(&RowKind::Known(kind), &json!({}));
            if let Event::Other(o) = &decoded {
                assert!(o.why.contains("does not decode"), "{kind}: {}", o.why);
            } else {
                panic!("{kind} decoded from an empty object: {decoded:?}");
            }
        }
    }

    #[test]
    fn an_unknown_kind_or_undecodable_data_reads_as_other_and_is_never_written() {
        let unknown = RowKind::parse("lease.granted");
        assert_eq!(unknown, RowKind::Unknown("lease.granted".into()));
        assert_eq!(unknown.as_str(), "lease.granted");
        let data = json!({"holder": 7});
        match Event::decode(&unknown, &data) {
            Event::Other(o) => {
                assert_eq!(o.data, data);
                assert_eq!(o.why, "unknown kind");
            }
            other => panic!("{other:?}"),
        }
        match Event::decode(&RowKind::Known(EventKind::SignalSent), &data) {
            Event::Other(o) => assert!(o.why.starts_with("signal.sent data does not decode")),
            other => panic!("{other:?}"),
        }
        let row: crate::ledger::EventRow = serde_json::from_value(json!({
            "seq": 1, "at": "x", "tree": null, "kind": "lease.granted", "data": data,
            "prev_hash": "p", "hash": "h"
        }))
        .expect("an unknown kind deserializes");
        assert_eq!(
            serde_json::to_value(&row).expect("ser")["kind"],
            "lease.granted"
        );
        let other = Event::decode(&row.kind, &row.data);
        assert_eq!(other.kind(), None);
        // The writer writes only typed kinds.
        let dir = tempfile::tempdir().expect("tempdir");
        let ledger = crate::ledger::Ledger::open(
            &dir.path().join("ledger.db"),
            crate::ledger::LedgerOptions::default(),
        )
        .expect("open");
        let err = ledger
            .append_event(None, other)
            .expect_err("Other is refused");
        assert!(
            matches!(err, crate::ledger::LedgerError::Invariant(_)),
            "{err:?}"
        );
        assert_eq!(ledger.head().expect("head"), None);
    }
}
