//! Why a tree ended, typed, as `GET /api/trees/{id}/wait` answers it: a
//! client that must tell a timeout from a kill (both end the root with the
//! first signal) branches on [`EndKind`], never on the reason's text.
//!
//! Read from what the ledger holds: a `kill.requested` committed before the
//! teardown began names a kill and its requester; otherwise the reason the
//! teardown's first state change recorded, which the service wrote from an
//! [`EndCause`] (`EndCause::reason`), is matched back to the cause that made
//! it here, in one place, against the same function's output (the unit tests
//! below go round every cause). Forced: the teardown committed a
//! `kill.authorized` naming processes, which it writes before any SIGKILL.

use std::time::Duration;

use serde::Serialize;
use utoipa::ToSchema;

use crate::custody::policy::EndCause;
use crate::ledger::event::Event;
use crate::ledger::{EventRow, TreeRow, TreeState};

/// The start of the reason an API kill records (`POST /api/trees/{id}/kill`).
pub const API_KILL_REASON: &str = "killed through the API by";
/// The start of the reason `treewarden kill` records (commands/kill.rs).
const CLI_KILL_REASON: &str = "treewarden kill by";

/// Why a tree ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum EndKind {
    /// Its root exited (under `lifetime: owner`, what it left did too); no
    /// teardown was asked for before.
    Exit,
    /// Its `timeout` passed.
    Timeout,
    /// A kill was asked for (the API, `treewarden kill`, `run`'s signal).
    Kill,
    /// Its owner process exited (or `run`'s parent died).
    OwnerExit,
    /// The service's drain ended it.
    Shutdown,
    /// Anything else: a sweep of an orphan, a teardown resumed after a
    /// restart.
    Other,
}

/// A settled tree's end, typed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, ToSchema)]
pub struct TreeEnd {
    pub cause: EndKind,
    /// Whether the teardown force-killed: it committed a `kill.authorized`
    /// naming processes (always before any SIGKILL).
    pub forced: bool,
    /// Who asked for the kill (`cause` = `kill`, through the API), as the
    /// ledger names the principal (`uid 1000 (pid 4242)`, `token 3 (ci)`).
    pub by: Option<String>,
}

impl EndKind {
    /// The cause whose [`EndCause::reason`] (or a kill's reason) `reason` is.
    pub fn of_reason(reason: &str) -> Self {
        if reason.starts_with(API_KILL_REASON) || reason.starts_with(CLI_KILL_REASON) {
            return EndKind::Kill;
        }
        if reason.starts_with(&EndCause::RootExited(None).reason()) {
            return EndKind::Exit;
        }
        let fixed = [
            (EndCause::OwnerExited, EndKind::OwnerExit),
            (EndCause::ParentDied, EndKind::OwnerExit),
            (EndCause::Kill, EndKind::Kill),
            (EndCause::Shutdown, EndKind::Shutdown),
            (EndCause::Resume, EndKind::Other),
        ];
        if let Some((_, kind)) = fixed.iter().find(|(c, _)| c.reason() == reason) {
            return *kind;
        }
        // A timeout's and a signal's reasons carry a value: read it, and
        // count the reason only if writing it again gives the same text.
        let timeout = EndCause::Timeout(Duration::ZERO).reason();
        let timeout_head = timeout.trim_end_matches("0s");
        if let Some(d) = reason
            .strip_prefix(timeout_head)
            .and_then(|d| humantime::parse_duration(d).ok())
            && EndCause::Timeout(d).reason() == reason
        {
            return EndKind::Timeout;
        }
        let signal = EndCause::Signal(0).reason();
        let signal_head = signal.trim_end_matches('0');
        if let Some(n) = reason
            .strip_prefix(signal_head)
            .and_then(|n| n.parse::<i32>().ok())
            && EndCause::Signal(n).reason() == reason
        {
            return EndKind::Kill;
        }
        EndKind::Other
    }
}

/// The end of `row`, from its `tree.state` and `kill.*` events (`events`,
/// oldest first); `None` while the tree is neither final nor ambiguous.
pub fn tree_end(row: &TreeRow, events: &[EventRow]) -> Option<TreeEnd> {
    if !(row.state.is_terminal() || row.state == TreeState::Ambiguous) {
        return None;
    }
    let mut began: Option<(i64, Option<String>)> = None;
    let mut requested: Option<(i64, String)> = None;
    let mut forced = false;
    for e in events {
        match e.event() {
            Event::TreeState(s)
                if began.is_none()
                    && matches!(s.to, TreeState::Terminating | TreeState::Killing) =>
            {
                began = Some((e.seq, s.reason));
            }
            Event::KillRequested(k) if requested.is_none() => {
                requested = Some((e.seq, k.by.to_string()));
            }
            Event::KillAuthorized(a) if !a.targets.is_empty() => forced = true,
            _ => {}
        }
    }
    let (cause, by) = match (began, requested) {
        (Some((at, _)), Some((asked, by))) if asked < at => (EndKind::Kill, Some(by)),
        (Some((_, reason)), _) => (
            reason.as_deref().map_or(EndKind::Other, EndKind::of_reason),
            None,
        ),
        // No teardown began: the tree ended by itself (its root exited and
        // nothing was left), or a kill found it ended already.
        (None, Some((_, by))) if row.exit.is_none() => (EndKind::Kill, Some(by)),
        (None, _) => (EndKind::Exit, None),
    };
    Some(TreeEnd { cause, forced, by })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proc::ExitStatus;

    #[test]
    fn every_cause_the_service_writes_reads_back_as_its_kind() {
        let cases = [
            (EndCause::RootExited(None), EndKind::Exit),
            (
                EndCause::RootExited(Some(ExitStatus::Exited(3))),
                EndKind::Exit,
            ),
            (
                EndCause::RootExited(Some(ExitStatus::Signaled(9))),
                EndKind::Exit,
            ),
            (EndCause::OwnerExited, EndKind::OwnerExit),
            (EndCause::ParentDied, EndKind::OwnerExit),
            (
                EndCause::Timeout(Duration::from_millis(1500)),
                EndKind::Timeout,
            ),
            (
                EndCause::Timeout(Duration::from_secs(7200)),
                EndKind::Timeout,
            ),
            (EndCause::Timeout(Duration::ZERO), EndKind::Timeout),
            (EndCause::Signal(15), EndKind::Kill),
            (EndCause::Kill, EndKind::Kill),
            (EndCause::Shutdown, EndKind::Shutdown),
            (EndCause::Resume, EndKind::Other),
        ];
        for (cause, kind) in cases {
            assert_eq!(EndKind::of_reason(&cause.reason()), kind, "{cause:?}");
        }
        assert_eq!(
            EndKind::of_reason(&format!("{API_KILL_REASON} uid 0 (pid 1)")),
            EndKind::Kill
        );
        assert_eq!(
            EndKind::of_reason("treewarden kill by uid 1000"),
            EndKind::Kill
        );
        // A text no cause writes is no cause: not a timeout by its look.
        assert_eq!(EndKind::of_reason("timeout after lunch"), EndKind::Other);
        assert_eq!(EndKind::of_reason("orphan of owner 7"), EndKind::Other);
    }
}
