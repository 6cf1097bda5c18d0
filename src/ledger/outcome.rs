//! How a tree ended, as one typed value read from its chained events: the
//! cause its teardown recorded, who asked for a kill, whether the sweep
//! found it orphaned, what was force-killed under which authorization, and
//! the root's exit. The dashboard's outcome column and filter, its verdict
//! line and the API's tree rows all read this one value; nothing here
//! re-parses a rendered sentence.
//!
//! The cause comes from the reason of the tree's first teardown state change
//! (`tree.state` from running to terminating or killing). Those reasons are
//! spelled by the custody layer (`custody::policy::EndCause::reason`, the
//! sweep, `kill`); [`Cause::of_reason`] is their one reader, and a test in
//! `custody::policy` proves every spelling reads back as its cause.

use std::collections::BTreeSet;

use serde::Serialize;

use super::event::Event;
use super::{EventKind, ExitRecord, MemberRow, TreeRow, TreeState};

/// Why a tree's teardown began.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cause {
    /// Its root exited (and the teardown ended what it left).
    RootExited,
    /// Its timeout passed.
    Timeout,
    /// A kill was asked for (`treewarden kill`, `POST /api/trees/{id}/kill`).
    Kill,
    /// The owner (`run`, the custodian, a client) received a signal.
    Signal,
    /// Its owner exited or died; the sweep or the service ended it.
    OwnerGone,
    /// The service drained it on its way down.
    Shutdown,
}

impl Cause {
    /// The cause a recorded teardown reason names (`None`: a reason no
    /// writer of this build spells, such as a resumed teardown's).
    pub fn of_reason(reason: &str) -> Option<Cause> {
        let r = reason.trim();
        let starts = |p: &str| r.starts_with(p);
        if starts("timeout") {
            Some(Cause::Timeout)
        } else if starts("treewarden kill") || starts("killed through the API") || starts("kill ") {
            Some(Cause::Kill)
        } else if starts("owner ") || starts("run's parent died") {
            Some(Cause::OwnerGone)
        } else if starts("run received signal") || starts("the custodian") {
            Some(Cause::Signal)
        } else if starts("service shutting down") {
            Some(Cause::Shutdown)
        } else if starts("root exited") || starts("every member exited") {
            Some(Cause::RootExited)
        } else {
            None
        }
    }
}

/// An outcome in one word: the dashboard's column, colour and filter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum OutcomeKind {
    /// Not over yet.
    Running,
    /// The root exited 0 (and nothing forced it).
    Exited,
    /// The root exited non-zero, or died of a signal no teardown sent.
    Failed,
    /// Its timeout ended it.
    TimedOut,
    /// A kill ended it (by `by`), or a signal to its owner did.
    Killed,
    /// Its owner died: the sweep or the service ended it.
    OwnerGone,
    /// The service drained it on shutdown.
    Shutdown,
    /// Its teardown could not be verified: the kill was skipped or
    /// processes were left; dispatch closes until an operator settles it.
    Ambiguous,
    /// A member outlived every authorized SIGKILL.
    Unkillable,
    /// It never started.
    SpawnFailed,
    /// An operator settled it (`resolve`).
    Resolved,
    /// Its record lost track of it (the boot it ran in ended).
    Vanished,
}

impl OutcomeKind {
    pub const ALL: [OutcomeKind; 12] = [
        Self::Running,
        Self::Exited,
        Self::Failed,
        Self::TimedOut,
        Self::Killed,
        Self::OwnerGone,
        Self::Shutdown,
        Self::Ambiguous,
        Self::Unkillable,
        Self::SpawnFailed,
        Self::Resolved,
        Self::Vanished,
    ];

    /// The spelling in URLs, JSON and CSS classes.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Exited => "exited",
            Self::Failed => "failed",
            Self::TimedOut => "timed_out",
            Self::Killed => "killed",
            Self::OwnerGone => "owner_gone",
            Self::Shutdown => "shutdown",
            Self::Ambiguous => "ambiguous",
            Self::Unkillable => "unkillable",
            Self::SpawnFailed => "spawn_failed",
            Self::Resolved => "resolved",
            Self::Vanished => "vanished",
        }
    }

    /// The words a reader sees.
    pub fn words(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Exited => "exited",
            Self::Failed => "failed",
            Self::TimedOut => "timed out",
            Self::Killed => "killed",
            Self::OwnerGone => "owner gone",
            Self::Shutdown => "drained at shutdown",
            Self::Ambiguous => "ambiguous",
            Self::Unkillable => "unkillable",
            Self::SpawnFailed => "spawn failed",
            Self::Resolved => "resolved",
            Self::Vanished => "vanished",
        }
    }
}

impl std::str::FromStr for OutcomeKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| {
                let known: Vec<&str> = Self::ALL.iter().map(|k| k.as_str()).collect();
                format!(
                    "unknown outcome {s:?} (one of: {}, forced)",
                    known.join(", ")
                )
            })
    }
}

/// SIGKILLs sent under committed authorizations.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Forced {
    /// Distinct processes the authorizations named.
    pub processes: u64,
    /// The authorizations' ids, oldest first.
    #[schema(value_type = Vec<i64>)]
    pub authorizations: Vec<super::AuthorizationId>,
}

/// How a tree ended (or that it has not), read from its events.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Outcome {
    pub kind: OutcomeKind,
    /// The root's exit, where known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exit: Option<ExitRecord>,
    /// Who ended it: the principal behind a kill or a resolution, or the
    /// signal its owner received.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
    /// What was force-killed, under which authorizations.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub forced: Option<Forced>,
    /// Whether the orphan sweep found it (its owner gone).
    pub swept: bool,
    /// The teardown's recorded reason, or the ambiguity's, verbatim.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// The event kinds [`Outcome::of`] reads: a tree list reads only these.
pub const OUTCOME_KINDS: [EventKind; 7] = [
    EventKind::TreeState,
    EventKind::KillRequested,
    EventKind::KillAuthorized,
    EventKind::KillSkipped,
    EventKind::SweepOrphanFound,
    EventKind::MemberUnkillable,
    EventKind::TreeResolved,
];

impl Outcome {
    /// The outcome of `tree`, given its events of [`OUTCOME_KINDS`] (others
    /// are ignored) in seq order.
    pub fn of(tree: &TreeRow, events: &[Event]) -> Outcome {
        let mut cause_reason: Option<String> = None;
        let mut ambiguity: Option<String> = None;
        let mut requested_by: Option<String> = None;
        let mut resolved_by: Option<String> = None;
        let mut swept = false;
        let mut unkillable = false;
        let mut authorizations = Vec::new();
        let mut processes = BTreeSet::new();
        for e in events {
            match e {
                Event::TreeState(s)
                    if cause_reason.is_none()
                        && matches!(s.to, TreeState::Terminating | TreeState::Killing) =>
                {
                    cause_reason = Some(s.reason.clone().unwrap_or_default());
                }
                Event::TreeState(s) if s.to == TreeState::Ambiguous => {
                    ambiguity = s.reason.clone();
                }
                Event::KillSkipped(r) => ambiguity = Some(r.reason.clone()),
                Event::KillRequested(k) if requested_by.is_none() => {
                    requested_by = Some(k.by.to_string());
                }
                Event::KillAuthorized(a) => {
                    authorizations.push(a.authorization);
                    for t in &a.targets {
                        processes.extend(t.identities.iter().map(|i| (i.pid, i.start_ticks)));
                    }
                }
                Event::SweepOrphanFound(_) => swept = true,
                Event::MemberUnkillable(_) => unkillable = true,
                Event::TreeResolved(r) => resolved_by = r.by.as_ref().map(ToString::to_string),
                _ => {}
            }
        }
        let forced = (!authorizations.is_empty()).then_some(Forced {
            processes: processes.len() as u64,
            authorizations,
        });
        let cause = cause_reason.as_deref().and_then(Cause::of_reason);
        let exit = tree.exit;
        let exited = match exit {
            Some(ExitRecord {
                code: Some(0),
                signal: None,
                ..
            }) => OutcomeKind::Exited,
            Some(_) => OutcomeKind::Failed,
            None => OutcomeKind::Exited,
        };
        let (kind, by) = match tree.state {
            TreeState::SpawnFailed => (OutcomeKind::SpawnFailed, None),
            TreeState::Resolved => (OutcomeKind::Resolved, resolved_by),
            TreeState::Ambiguous if unkillable => (OutcomeKind::Unkillable, None),
            TreeState::Ambiguous => (OutcomeKind::Ambiguous, None),
            TreeState::Vanished => (OutcomeKind::Vanished, None),
            s if !s.is_terminal() => (OutcomeKind::Running, None),
            _ => match cause {
                Some(Cause::Timeout) => (OutcomeKind::TimedOut, None),
                Some(Cause::Kill) => (
                    OutcomeKind::Killed,
                    requested_by.or_else(|| by_in(cause_reason.as_deref())),
                ),
                Some(Cause::Signal) => (OutcomeKind::Killed, cause_reason.clone()),
                Some(Cause::OwnerGone) => (OutcomeKind::OwnerGone, None),
                Some(Cause::Shutdown) => (OutcomeKind::Shutdown, None),
                _ if swept => (OutcomeKind::OwnerGone, None),
                Some(Cause::RootExited) | None => (exited, None),
            },
        };
        let reason = match kind {
            OutcomeKind::Ambiguous | OutcomeKind::Unkillable => {
                ambiguity.or_else(|| tree.note.clone())
            }
            OutcomeKind::Resolved => tree.note.clone(),
            OutcomeKind::SpawnFailed => tree.note.clone().or(cause_reason),
            _ => cause_reason,
        }
        .filter(|r| !r.is_empty());
        Outcome {
            kind,
            exit,
            by,
            forced,
            swept,
            reason,
        }
    }

    /// The tree page's first line: what happened, by whom, when, to how many.
    pub fn verdict(&self, t: &TreeRow, members: &[MemberRow]) -> String {
        let o = self;
        let seen = members.len();
        let escaped = members.iter().filter(|m| m.escaped_at.is_some()).count();
        let alive = members.iter().filter(|m| m.exited_at.is_none()).count();
        let when = t.ended_at.as_deref().unwrap_or(&t.created_at);
        let plural = |n: usize, one: &str, many: &str| {
            if n == 1 {
                format!("{n} {one}")
            } else {
                format!("{n} {many}")
            }
        };
        let mut counts = format!(
            "{} seen, {} escaped",
            plural(seen, "process", "processes"),
            escaped
        );
        if let Some(f) = &o.forced {
            let ids: Vec<String> = f.authorizations.iter().map(|a| format!("#{a}")).collect();
            counts.push_str(&format!(
                ", {} force-killed under authorization {}",
                f.processes,
                ids.join(", ")
            ));
        }
        let why = o
            .reason
            .as_deref()
            .map(|r| format!(" ({r})"))
            .unwrap_or_default();
        let owner = format!("{} pid {}", t.owner.kind, t.owner.pid);
        match o.kind {
            OutcomeKind::Running => format!(
                "Running since {} for {owner}: {} live, {} escaped.",
                t.created_at,
                plural(alive, "process", "processes"),
                escaped
            ),
            OutcomeKind::Exited | OutcomeKind::Failed => {
                let exit = match o.exit.map(|e| (e.code, e.signal)) {
                    Some((_, Some(sig))) => format!("its root died of signal {sig}"),
                    Some((Some(c), None)) => format!("its root exited {c}"),
                    _ => "its root exited".into(),
                };
                let head = if o.kind == OutcomeKind::Exited {
                    "Exited"
                } else {
                    "Failed"
                };
                format!("{head}: {exit} at {when}; {counts}.")
            }
            OutcomeKind::TimedOut => format!("Timed out{why} at {when}; {counts}."),
            OutcomeKind::Killed => format!(
                "Killed by {} at {when}; {counts}.",
                o.by.as_deref().unwrap_or("an unrecorded principal")
            ),
            OutcomeKind::OwnerGone => format!(
                "Owner gone ({owner}); ended by {} at {when}; {counts}.",
                if o.swept {
                    "the orphan sweep"
                } else {
                    "its watcher"
                }
            ),
            OutcomeKind::Shutdown => {
                format!("Drained at the service's shutdown at {when}; {counts}.")
            }
            OutcomeKind::Ambiguous | OutcomeKind::Unkillable => format!(
                "{}{why}: {} not known to be gone; {counts}. First step: treewarden kill {}.",
                if o.kind == OutcomeKind::Unkillable {
                    "Unkillable"
                } else {
                    "Ambiguous"
                },
                plural(alive, "process", "processes"),
                t.id
            ),
            OutcomeKind::SpawnFailed => format!("Spawn failed at {when}{why}."),
            OutcomeKind::Resolved => format!(
                "Resolved by {} at {when}{why}; {counts}.",
                o.by.as_deref().unwrap_or("an operator")
            ),
            OutcomeKind::Vanished => format!("Vanished at {when}{why}; {counts}."),
        }
    }

    /// Whether the filter value `f` (an [`OutcomeKind`] spelling, or
    /// `forced`) selects this outcome.
    pub fn matches(&self, f: OutcomeFilter) -> bool {
        match f {
            OutcomeFilter::Kind(k) => self.kind == k,
            OutcomeFilter::Forced => self.forced.is_some(),
        }
    }

    /// The outcome in a few words: "exited 0", "failed: exit 3",
    /// "killed · 3 force-killed".
    pub fn summary(&self) -> String {
        let mut s = match (self.kind, self.exit) {
            (OutcomeKind::Exited, Some(e)) => format!("exited {}", e.code.unwrap_or(0)),
            (OutcomeKind::Failed, Some(e)) => match (e.code, e.signal) {
                (_, Some(sig)) => format!("failed: signal {sig}"),
                (Some(c), None) => format!("failed: exit {c}"),
                _ => "failed".into(),
            },
            (k, _) => k.words().to_string(),
        };
        if self.swept && self.kind == OutcomeKind::OwnerGone {
            s.push_str(", swept");
        }
        if let Some(f) = &self.forced {
            s.push_str(&format!(" · {} force-killed", f.processes));
        }
        s
    }
}

/// One value of the dashboard's outcome filter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutcomeFilter {
    Kind(OutcomeKind),
    /// Any tree with a SIGKILL under authorization, whatever its cause.
    Forced,
}

impl std::str::FromStr for OutcomeFilter {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "forced" => Ok(OutcomeFilter::Forced),
            k => k.parse().map(OutcomeFilter::Kind),
        }
    }
}

impl OutcomeFilter {
    pub fn as_str(self) -> &'static str {
        match self {
            OutcomeFilter::Kind(k) => k.as_str(),
            OutcomeFilter::Forced => "forced",
        }
    }
}

/// The principal a kill's reason names after its last " by " (`treewarden
/// kill by uid 0 …`), for kills recorded before `kill.requested` carried it.
fn by_in(reason: Option<&str>) -> Option<String> {
    let r = reason?;
    r.rfind(" by ")
        .map(|i| r[i + 4..].trim().to_string())
        .filter(|s| !s.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::event::{KillAuthorized, KillRequested, Reason, StateChanged};
    use crate::ledger::{AuthorizationId, IdentityRecord, KillTarget, Requester};

    fn tree(state: TreeState, exit: Option<ExitRecord>) -> TreeRow {
        TreeRow {
            state,
            exit,
            ..TreeRow::example()
        }
    }

    fn code(c: i32) -> Option<ExitRecord> {
        Some(ExitRecord {
            code: Some(c),
            signal: None,
            cpu_usec: None,
        })
    }

    fn teardown(reason: &str) -> Event {
        Event::TreeState(StateChanged {
            from: TreeState::Running,
            to: TreeState::Terminating,
            reason: Some(reason.into()),
        })
    }

    fn authorized(id: i64, pids: &[i32]) -> Event {
        Event::KillAuthorized(KillAuthorized {
            authorization: AuthorizationId(id),
            targets: vec![KillTarget {
                kind: crate::ledger::TargetKind::Pid,
                target: "x".into(),
                identities: pids
                    .iter()
                    .map(|&pid| IdentityRecord {
                        pid,
                        start_ticks: 7,
                        boot_id: "b".into(),
                    })
                    .collect(),
            }],
            reason: "r".into(),
        })
    }

    #[test]
    fn a_root_that_exited_alone_is_exited_or_failed_by_its_code() {
        let ok = Outcome::of(&tree(TreeState::Ended, code(0)), &[]);
        assert_eq!(
            (ok.kind, ok.summary().as_str()),
            (OutcomeKind::Exited, "exited 0")
        );
        let bad = Outcome::of(
            &tree(TreeState::Ended, code(3)),
            &[teardown("root exited (exit 3)")],
        );
        assert_eq!(
            (bad.kind, bad.summary().as_str()),
            (OutcomeKind::Failed, "failed: exit 3")
        );
        let sig = Outcome::of(
            &tree(
                TreeState::Ended,
                Some(ExitRecord {
                    code: None,
                    signal: Some(11),
                    cpu_usec: None,
                }),
            ),
            &[],
        );
        assert_eq!(sig.summary(), "failed: signal 11");
    }

    #[test]
    fn a_kill_names_its_requester_and_what_it_forced() {
        let by = Requester {
            via: "tcp".into(),
            token_id: Some(4),
            token_name: Some("ops".into()),
            ..Default::default()
        };
        let events = [
            Event::KillRequested(KillRequested {
                by: by.clone(),
                grace_ms: None,
            }),
            teardown(&format!("killed through the API by {by}")),
            authorized(2, &[10, 11]),
            authorized(3, &[11, 12]),
        ];
        let o = Outcome::of(&tree(TreeState::Ended, None), &events);
        assert_eq!(o.kind, OutcomeKind::Killed);
        assert_eq!(o.by.as_deref(), Some("token 4 (ops) over tcp"));
        assert_eq!(
            o.forced,
            Some(Forced {
                processes: 3,
                authorizations: vec![AuthorizationId(2), AuthorizationId(3)]
            })
        );
        assert!(o.matches(OutcomeFilter::Forced));
        assert!(o.matches(OutcomeFilter::Kind(OutcomeKind::Killed)));
        assert!(!o.matches(OutcomeFilter::Kind(OutcomeKind::TimedOut)));
        assert_eq!(o.summary(), "killed · 3 force-killed");
        // A kill recorded before `kill.requested` carried the principal:
        // the reason's " by " names it.
        let old = Outcome::of(
            &tree(TreeState::Ended, None),
            &[teardown(
                "treewarden kill by uid 0 (pid 9) on the command line",
            )],
        );
        assert_eq!(old.by.as_deref(), Some("uid 0 (pid 9) on the command line"));
    }

    #[test]
    fn the_first_teardown_names_the_cause_and_states_override_it() {
        let timed = Outcome::of(
            &tree(TreeState::Ended, None),
            &[
                teardown("timeout after 1s"),
                teardown("resuming a teardown interrupted by a service restart"),
            ],
        );
        assert_eq!(timed.kind, OutcomeKind::TimedOut);
        assert_eq!(timed.reason.as_deref(), Some("timeout after 1s"));
        let gone = Outcome::of(
            &tree(TreeState::Ended, None),
            &[teardown("owner gone (orphan sweep)")],
        );
        assert_eq!(gone.kind, OutcomeKind::OwnerGone);
        let ambiguous = Outcome::of(
            &tree(TreeState::Ambiguous, None),
            &[
                teardown("timeout after 1s"),
                Event::KillSkipped(Reason {
                    reason: "the authorization could not be written".into(),
                }),
            ],
        );
        assert_eq!(ambiguous.kind, OutcomeKind::Ambiguous);
        assert_eq!(
            ambiguous.reason.as_deref(),
            Some("the authorization could not be written")
        );
        let live = Outcome::of(&tree(TreeState::Terminating, None), &[teardown("kill x")]);
        assert_eq!(live.kind, OutcomeKind::Running);
        let failed = Outcome::of(&tree(TreeState::SpawnFailed, None), &[]);
        assert_eq!(failed.kind, OutcomeKind::SpawnFailed);
    }

    #[test]
    fn every_filter_spelling_reads_back() {
        for k in OutcomeKind::ALL {
            assert_eq!(
                k.as_str().parse::<OutcomeFilter>(),
                Ok(OutcomeFilter::Kind(k))
            );
        }
        assert_eq!("forced".parse::<OutcomeFilter>(), Ok(OutcomeFilter::Forced));
        assert!("nope".parse::<OutcomeFilter>().is_err());
    }
}
