//! The words rows and events are written in: a signal's name, what it was
//! sent to, what came of it, and a tree's flags. Each is a type whose
//! spelling (in the database, the chained event data, the API and the
//! exports) is exactly the string the ledger has always held, so typing a
//! field moves no hash (`tests/it/ledger.rs` re-encodes a chain written
//! before, byte for byte). A reader asks the type (`is_kill`,
//! `delivered`) instead of comparing strings.
//!
//! Open vocabularies (signal names, results, flags) keep a spelling this
//! build does not know as `Other`, unchanged: a ledger written on another
//! OS, or by a later build, still reads and re-encodes as it was. Closed
//! ones (a target's kind) are held closed by the database's CHECK.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A tree's boundary, as its row records it: the process layer's one
/// container vocabulary, which the ledger speaks too.
pub use crate::proc::BoundaryKind;

/// Serde as the type's spelling; any string reads (open vocabularies).
macro_rules! spelled_as_string {
    ($ty:ty) => {
        impl Serialize for $ty {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(&self.to_string())
            }
        }

        impl<'de> Deserialize<'de> for $ty {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                Ok(<$ty>::from(s.as_str()))
            }
        }

        impl From<&str> for $ty {
            fn from(s: &str) -> Self {
                <$ty>::read(s)
            }
        }

        impl PartialEq<str> for $ty {
            fn eq(&self, other: &str) -> bool {
                *self == <$ty>::read(other)
            }
        }

        impl PartialEq<&str> for $ty {
            fn eq(&self, other: &&str) -> bool {
                *self == <$ty>::read(other)
            }
        }
    };
}

/// A signal (or its Windows counterpart) as the teardown recorded it:
/// `SIGTERM`, `SIGKILL`, … on Unix; `CTRL_BREAK`, `TERMINATE_JOB`, … on
/// Windows.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum SignalName {
    Sigterm,
    Sigkill,
    Sigstop,
    Sigcont,
    Sigint,
    Sighup,
    Sigquit,
    Sigusr1,
    Sigusr2,
    /// Windows' polite stop (a console control event to the group).
    CtrlBreak,
    CtrlC,
    /// Windows' forced ends: one process, the tree's whole job.
    TerminateProcess,
    TerminateJob,
    Suspend,
    Resume,
    /// A name this build does not know, as recorded.
    Other(String),
}

const SIGNAL_NAMES: [(SignalName, &str); 15] = [
    (SignalName::Sigterm, "SIGTERM"),
    (SignalName::Sigkill, "SIGKILL"),
    (SignalName::Sigstop, "SIGSTOP"),
    (SignalName::Sigcont, "SIGCONT"),
    (SignalName::Sigint, "SIGINT"),
    (SignalName::Sighup, "SIGHUP"),
    (SignalName::Sigquit, "SIGQUIT"),
    (SignalName::Sigusr1, "SIGUSR1"),
    (SignalName::Sigusr2, "SIGUSR2"),
    (SignalName::CtrlBreak, "CTRL_BREAK"),
    (SignalName::CtrlC, "CTRL_C"),
    (SignalName::TerminateProcess, "TERMINATE_PROCESS"),
    (SignalName::TerminateJob, "TERMINATE_JOB"),
    (SignalName::Suspend, "SUSPEND"),
    (SignalName::Resume, "RESUME"),
];

impl SignalName {
    fn read(s: &str) -> SignalName {
        SIGNAL_NAMES
            .iter()
            .find(|(_, n)| *n == s)
            .map(|(v, _)| v.clone())
            .unwrap_or_else(|| SignalName::Other(s.to_string()))
    }

    pub fn as_str(&self) -> &str {
        match self {
            SignalName::Other(s) => s,
            known => SIGNAL_NAMES
                .iter()
                .find(|(v, _)| v == known)
                .map(|(_, n)| *n)
                .unwrap_or_default(),
        }
    }

    /// A forced end, which needs a committed kill authorization before it
    /// (SIGKILL; on Windows TerminateJobObject and TerminateProcess).
    pub fn is_kill(&self) -> bool {
        matches!(
            self,
            SignalName::Sigkill | SignalName::TerminateJob | SignalName::TerminateProcess
        )
    }

    /// A polite stop a teardown opens with: SIGTERM or a first signal a
    /// tree was given (SIGINT, SIGHUP, …), CTRL_BREAK or CTRL_C on Windows.
    /// Not a freeze, a thaw or a forced end.
    pub fn is_polite(&self) -> bool {
        !self.is_kill()
            && !matches!(
                self,
                SignalName::Sigstop
                    | SignalName::Sigcont
                    | SignalName::Suspend
                    | SignalName::Resume
                    | SignalName::Other(_)
            )
    }
}

impl std::fmt::Display for SignalName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

spelled_as_string!(SignalName);

/// What a signal was sent to: the tree's recorded process group, its
/// cgroup (`cgroup.kill`), one member through its pidfd or handle, or its
/// Windows job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TargetKind {
    Group,
    Cgroup,
    Pid,
    Job,
}

impl TargetKind {
    pub const ALL: [TargetKind; 4] = [
        TargetKind::Group,
        TargetKind::Cgroup,
        TargetKind::Pid,
        TargetKind::Job,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            TargetKind::Group => "group",
            TargetKind::Cgroup => "cgroup",
            TargetKind::Pid => "pid",
            TargetKind::Job => "job",
        }
    }
}

/// What a boundary's tree is signalled through as one: its cgroup, its
/// job, or (a session) its process group.
impl From<BoundaryKind> for TargetKind {
    fn from(b: BoundaryKind) -> Self {
        match b {
            BoundaryKind::Cgroup => TargetKind::Cgroup,
            BoundaryKind::Job => TargetKind::Job,
            BoundaryKind::Session => TargetKind::Group,
        }
    }
}

impl std::fmt::Display for TargetKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for TargetKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        TargetKind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| format!("unknown target kind {s:?}"))
    }
}

/// What came of one signal, as recorded: `sent`, `sent to N members`,
/// `group empty`, `gone`, `refused: <why>`, `failed: <error>`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum SignalResult {
    /// Delivered (a cgroup's `cgroup.kill`, a held or checked pidfd).
    Delivered,
    /// `killpg` to the recorded group, which had this many live members.
    ToMembers(usize),
    /// The group had no live member: nothing sent.
    GroupEmpty,
    /// The process was already gone: nothing sent.
    Gone,
    /// Not sent: the target is not provably the recorded one.
    Refused(String),
    /// The syscall failed.
    Failed(String),
    /// A result this build does not spell, as recorded.
    Other(String),
}

impl SignalResult {
    fn read(s: &str) -> SignalResult {
        let members = s
            .strip_prefix("sent to ")
            .and_then(|r| r.strip_suffix(" members"))
            .and_then(|n| n.parse::<usize>().ok().filter(|v| v.to_string() == n));
        match (s, members) {
            (_, Some(n)) => SignalResult::ToMembers(n),
            ("sent", _) => SignalResult::Delivered,
            ("group empty", _) => SignalResult::GroupEmpty,
            ("gone", _) => SignalResult::Gone,
            _ => {
                if let Some(why) = s.strip_prefix("refused: ") {
                    SignalResult::Refused(why.to_string())
                } else if let Some(e) = s.strip_prefix("failed: ") {
                    SignalResult::Failed(e.to_string())
                } else {
                    SignalResult::Other(s.to_string())
                }
            }
        }
    }

    /// Whether the signal went out: the syscall was made and succeeded
    /// (to a group, whatever it counted).
    pub fn was_sent(&self) -> bool {
        matches!(self, SignalResult::Delivered | SignalResult::ToMembers(_))
    }

    /// Whether the signal reached a process (to a group, only when it
    /// counted a live member).
    pub fn delivered(&self) -> bool {
        match self {
            SignalResult::Delivered => true,
            SignalResult::ToMembers(n) => *n > 0,
            _ => false,
        }
    }
}

impl std::fmt::Display for SignalResult {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SignalResult::Delivered => f.write_str("sent"),
            SignalResult::ToMembers(n) => write!(f, "sent to {n} members"),
            SignalResult::GroupEmpty => f.write_str("group empty"),
            SignalResult::Gone => f.write_str("gone"),
            SignalResult::Refused(why) => write!(f, "refused: {why}"),
            SignalResult::Failed(e) => write!(f, "failed: {e}"),
            SignalResult::Other(s) => f.write_str(s),
        }
    }
}

spelled_as_string!(SignalResult);

/// A fact about a tree that outlives its state, kept in the row's flags.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum TreeFlag {
    /// Its root exited while the tree was kept (`--lifetime owner`).
    RootExited,
    /// It lives as long as its owner (`--lifetime owner`).
    LifetimeOwner,
    /// A forced kill's authority could not be written: the kill was skipped.
    AuthorityWriteFailed,
    /// A member would not die after SIGKILL (D state).
    Unkillable,
    /// Members outlived the forced kill: the teardown failed closed.
    Survivors,
    /// A container's standing kill could not be cleared before the
    /// teardown gave up (its survivors are left as they are).
    DisarmFailed,
    /// Resolved with `--force`, members still alive.
    SurvivorsLeft,
    /// A later teardown ended what `SurvivorsLeft` left.
    SurvivorsEnded,
    /// Its members' pidfds were not all held: the budget was reached.
    HoldsCapped,
    /// Its evidence passed its budget: later member rows were summarized.
    EvidenceOverBudget,
    /// Evidence it could not write was dropped (and counted).
    EvidenceDropped,
    /// Its Windows job ends with the service's handle to it.
    KillOnJobClose,
    /// A flag this build does not know, as recorded.
    Other(String),
}

const TREE_FLAGS: [(TreeFlag, &str); 12] = [
    (TreeFlag::RootExited, "root_exited"),
    (TreeFlag::LifetimeOwner, "lifetime_owner"),
    (TreeFlag::AuthorityWriteFailed, "authority_write_failed"),
    (TreeFlag::Unkillable, "unkillable"),
    (TreeFlag::Survivors, "survivors"),
    (TreeFlag::DisarmFailed, "disarm_failed"),
    (TreeFlag::SurvivorsLeft, "survivors_left"),
    (TreeFlag::SurvivorsEnded, "survivors_ended"),
    (TreeFlag::HoldsCapped, "holds_capped"),
    (TreeFlag::EvidenceOverBudget, "evidence_over_budget"),
    (TreeFlag::EvidenceDropped, "evidence_dropped"),
    (TreeFlag::KillOnJobClose, "kill_on_job_close"),
];

impl TreeFlag {
    fn read(s: &str) -> TreeFlag {
        TREE_FLAGS
            .iter()
            .find(|(_, n)| *n == s)
            .map(|(v, _)| v.clone())
            .unwrap_or_else(|| TreeFlag::Other(s.to_string()))
    }

    pub fn as_str(&self) -> &str {
        match self {
            TreeFlag::Other(s) => s,
            known => TREE_FLAGS
                .iter()
                .find(|(v, _)| v == known)
                .map(|(_, n)| *n)
                .unwrap_or_default(),
        }
    }
}

impl std::fmt::Display for TreeFlag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

spelled_as_string!(TreeFlag);

#[cfg(test)]
mod tests {
    use super::*;

    /// Every spelling reads back as itself: the typed value is the string.
    #[test]
    fn every_spelling_round_trips_exactly() {
        for (v, s) in SIGNAL_NAMES.iter() {
            assert_eq!(SignalName::from(*s), *v);
            assert_eq!(v.to_string(), *s);
        }
        for (v, s) in TREE_FLAGS.iter() {
            assert_eq!(TreeFlag::from(*s), *v);
            assert_eq!(v.to_string(), *s);
        }
        for k in TargetKind::ALL {
            assert_eq!(k.as_str().parse::<TargetKind>(), Ok(k));
        }
        for s in [
            "sent",
            "sent to 0 members",
            "sent to 12 members",
            "group empty",
            "gone",
            "refused: pid recycled",
            "failed: ESRCH: No such process",
            "sent to 01 members",
            "sent to many members",
            "",
        ] {
            assert_eq!(SignalResult::from(s).to_string(), s);
            let json = serde_json::to_string(&SignalResult::from(s)).expect("json");
            assert_eq!(json, serde_json::to_string(s).expect("json"));
            let back: SignalResult = serde_json::from_str(&json).expect("back");
            assert_eq!(back.to_string(), s);
        }
        for s in ["SIGPWR", "sigterm", ""] {
            assert_eq!(SignalName::from(s), SignalName::Other(s.into()));
            assert_eq!(SignalName::from(s).to_string(), s);
        }
        assert_eq!(TreeFlag::from("test_flag").to_string(), "test_flag");
    }

    #[test]
    fn results_say_whether_the_signal_went_out() {
        assert!(SignalResult::from("sent").delivered());
        assert!(SignalResult::from("sent to 3 members").delivered());
        assert!(!SignalResult::from("sent to 0 members").delivered());
        assert!(SignalResult::from("sent to 0 members").was_sent());
        assert!(SignalResult::from("sent").was_sent());
        assert_eq!(
            SignalResult::from("sent to 3 members"),
            SignalResult::ToMembers(3)
        );
        for s in [
            "group empty",
            "gone",
            "refused: x",
            "failed: y",
            "sent to 01 members",
        ] {
            assert!(!SignalResult::from(s).delivered(), "{s}");
            assert!(!SignalResult::from(s).was_sent(), "{s}");
        }
    }

    #[test]
    fn forced_ends_are_the_kills_on_every_os() {
        for s in ["SIGKILL", "TERMINATE_JOB", "TERMINATE_PROCESS"] {
            assert!(SignalName::from(s).is_kill(), "{s}");
            assert!(!SignalName::from(s).is_polite(), "{s}");
        }
        for s in [
            "SIGTERM",
            "SIGINT",
            "SIGHUP",
            "SIGQUIT",
            "SIGUSR1",
            "SIGUSR2",
            "CTRL_BREAK",
            "CTRL_C",
        ] {
            assert!(SignalName::from(s).is_polite(), "{s}");
            assert!(!SignalName::from(s).is_kill(), "{s}");
        }
        for s in ["SIGSTOP", "SIGCONT", "SUSPEND", "RESUME", "SIGPWR"] {
            assert!(!SignalName::from(s).is_polite(), "{s}");
            assert!(!SignalName::from(s).is_kill(), "{s}");
        }
    }
}
