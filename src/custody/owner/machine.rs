//! The owner's decision, without IO: whether an owned tree is kept or torn
//! down, and for which end cause.
//!
//! A sans-IO state machine: the loops that own a tree (`run`'s, the
//! custodian's, the service's watch task) keep their waits, pidfds, threads
//! and selects, hand each event in (`handle_*`) and ask what to do
//! ([`OwnerWatch::poll`]). It has no clock of its own: time comes in with
//! [`OwnerWatch::handle_timeout`], and [`OwnerWatch::poll_timeout`] says
//! when that is due. The first end wins: once it says tear down, later
//! inputs change nothing.

use std::time::{Duration, Instant};

use super::Lifetime;
use crate::custody::policy::EndCause;
use crate::proc::ExitStatus;

/// Whose exit ends the tree.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Watched {
    /// `run`'s parent process (`--die-with-parent`).
    Parent,
    /// The tree's owner: `--owner-pid`, a custodian's owner, a service's
    /// client.
    Owner,
}

/// What the owner does next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Keep watching (a kept tree: while anything of it runs).
    Keep,
    /// Tear the tree down, for this cause.
    TearDown(EndCause),
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum State {
    /// The root runs.
    Rooted,
    /// The root exited (its status, when this process reaped it) and the
    /// tree lives on while anything of it runs ([`Lifetime::Owner`]).
    Kept(Option<ExitStatus>),
    /// Decided.
    Ended(EndCause),
}

/// One owned tree's watch: what has happened to it, and what the owner
/// does about it.
#[derive(Clone, Debug)]
pub struct OwnerWatch {
    lifetime: Lifetime,
    deadline: Option<Instant>,
    /// The timeout the tree was given, as its end cause names it.
    timeout: Duration,
    state: State,
}

impl OwnerWatch {
    /// A tree whose root runs; it ends at `deadline` (its `timeout`).
    pub fn new(lifetime: Lifetime, deadline: Option<Instant>, timeout: Option<Duration>) -> Self {
        Self {
            lifetime,
            deadline,
            timeout: timeout.unwrap_or_default(),
            state: State::Rooted,
        }
    }

    /// A tree whose root exited already and that is kept (the custodian's).
    pub fn kept(
        root_exit: Option<ExitStatus>,
        deadline: Option<Instant>,
        timeout: Option<Duration>,
    ) -> Self {
        Self {
            state: State::Kept(root_exit),
            ..Self::new(Lifetime::Owner, deadline, timeout)
        }
    }

    fn end(&mut self, cause: EndCause) {
        if !matches!(self.state, State::Ended(_)) {
            self.state = State::Ended(cause);
        }
    }

    /// The root exited (with its status when this process reaped it): the
    /// tree ends with it, or, with [`Lifetime::Owner`], is kept.
    pub fn handle_root_exit(&mut self, status: Option<ExitStatus>) {
        if self.state != State::Rooted {
            return;
        }
        match self.lifetime {
            Lifetime::Root => self.end(EndCause::RootExited(status)),
            Lifetime::Owner => self.state = State::Kept(status),
        }
    }

    /// A watched owner exited: whatever the state, the tree ends.
    pub fn handle_owner_exit(&mut self, who: Watched) {
        self.end(match who {
            Watched::Parent => EndCause::ParentDied,
            Watched::Owner => EndCause::OwnerExited,
        });
    }

    /// A scan tick, with whether nothing of the tree runs (`None`: not
    /// known, which counts as something running): a kept tree left empty
    /// ends, as its root's exit.
    pub fn handle_tick(&mut self, empty: Option<bool>) {
        if let (State::Kept(status), Some(true)) = (&self.state, empty) {
            let cause = EndCause::RootExited(*status);
            self.end(cause);
        }
    }

    /// The time is `now`: at or past the deadline, the tree ends.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.deadline.is_some_and(|d| now >= d) {
            self.end(EndCause::Timeout(self.timeout));
        }
    }

    /// A kill was asked for: by the owner's own signal `n` (`run`, the
    /// custodian), or (`None`) by a requester.
    pub fn handle_kill(&mut self, signal: Option<i32>) {
        self.end(signal.map_or(EndCause::Kill, EndCause::Signal));
    }

    /// The owner is shutting down.
    pub fn handle_shutdown(&mut self) {
        self.end(EndCause::Shutdown);
    }

    /// What to do now.
    pub fn poll(&self) -> Action {
        match &self.state {
            State::Ended(cause) => Action::TearDown(cause.clone()),
            State::Rooted | State::Kept(_) => Action::Keep,
        }
    }

    /// When [`Self::handle_timeout`] is due next (`None`: never, or decided).
    pub fn poll_timeout(&self) -> Option<Instant> {
        match self.state {
            State::Ended(_) => None,
            State::Rooted | State::Kept(_) => self.deadline,
        }
    }

    /// Whether the root exited and the tree is kept (not decided yet).
    pub fn is_kept(&self) -> bool {
        matches!(self.state, State::Kept(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROOT: ExitStatus = ExitStatus::Exited(3);
    const TIMEOUT: Duration = Duration::from_secs(7);

    #[derive(Clone, Copy, Debug)]
    enum Input {
        RootExit,
        ParentExit,
        OwnerExit,
        TickEmpty,
        TickBusy,
        TickUnknown,
        TimeoutEarly,
        TimeoutReached,
        Signal,
        Kill,
        Shutdown,
    }

    const INPUTS: [Input; 11] = [
        Input::RootExit,
        Input::ParentExit,
        Input::OwnerExit,
        Input::TickEmpty,
        Input::TickBusy,
        Input::TickUnknown,
        Input::TimeoutEarly,
        Input::TimeoutReached,
        Input::Signal,
        Input::Kill,
        Input::Shutdown,
    ];

    /// The states, made the way the loops make them.
    #[derive(Clone, Copy, Debug)]
    enum Start {
        /// The root runs, the tree ends with it.
        RootLifetime,
        /// The root runs, the tree outlives it.
        OwnerLifetime,
        /// Kept after the root exited (`run`'s and the service's).
        KeptAfterRoot,
        /// Kept from the start (the custodian's).
        Custodian,
        /// Decided already (a signal).
        Ended,
    }

    const STARTS: [Start; 5] = [
        Start::RootLifetime,
        Start::OwnerLifetime,
        Start::KeptAfterRoot,
        Start::Custodian,
        Start::Ended,
    ];

    fn make(start: Start, base: Instant) -> OwnerWatch {
        let deadline = Some(base + TIMEOUT);
        match start {
            Start::RootLifetime => OwnerWatch::new(Lifetime::Root, deadline, Some(TIMEOUT)),
            Start::OwnerLifetime => OwnerWatch::new(Lifetime::Owner, deadline, Some(TIMEOUT)),
            Start::KeptAfterRoot => {
                let mut w = OwnerWatch::new(Lifetime::Owner, deadline, Some(TIMEOUT));
                w.handle_root_exit(Some(ROOT));
                w
            }
            Start::Custodian => OwnerWatch::kept(None, deadline, None),
            Start::Ended => {
                let mut w = OwnerWatch::new(Lifetime::Root, deadline, Some(TIMEOUT));
                w.handle_kill(Some(15));
                w
            }
        }
    }

    fn feed(w: &mut OwnerWatch, input: Input, base: Instant) {
        match input {
            Input::RootExit => w.handle_root_exit(Some(ROOT)),
            Input::ParentExit => w.handle_owner_exit(Watched::Parent),
            Input::OwnerExit => w.handle_owner_exit(Watched::Owner),
            Input::TickEmpty => w.handle_tick(Some(true)),
            Input::TickBusy => w.handle_tick(Some(false)),
            Input::TickUnknown => w.handle_tick(None),
            Input::TimeoutEarly => w.handle_timeout(base + TIMEOUT - Duration::from_millis(1)),
            Input::TimeoutReached => w.handle_timeout(base + TIMEOUT),
            Input::Signal => w.handle_kill(Some(2)),
            Input::Kill => w.handle_kill(None),
            Input::Shutdown => w.handle_shutdown(),
        }
    }

    /// What each input does in each state: (action, kept afterwards).
    fn expected(start: Start, input: Input) -> (Action, bool) {
        use Action::{Keep, TearDown};
        let timeout = match start {
            Start::Custodian => Duration::ZERO,
            _ => TIMEOUT,
        };
        let kept_root = match start {
            Start::Custodian => None,
            _ => Some(ROOT),
        };
        let kept = matches!(start, Start::KeptAfterRoot | Start::Custodian);
        if let Start::Ended = start {
            // The first end wins.
            return (TearDown(EndCause::Signal(15)), false);
        }
        match input {
            Input::RootExit => match start {
                Start::RootLifetime => (TearDown(EndCause::RootExited(Some(ROOT))), false),
                // Kept (again: a second exit changes nothing).
                _ => (Keep, true),
            },
            Input::ParentExit => (TearDown(EndCause::ParentDied), false),
            Input::OwnerExit => (TearDown(EndCause::OwnerExited), false),
            Input::TickEmpty if kept => (TearDown(EndCause::RootExited(kept_root)), false),
            Input::TickEmpty | Input::TickBusy | Input::TickUnknown | Input::TimeoutEarly => {
                (Keep, kept)
            }
            Input::TimeoutReached => (TearDown(EndCause::Timeout(timeout)), false),
            Input::Signal => (TearDown(EndCause::Signal(2)), false),
            Input::Kill => (TearDown(EndCause::Kill), false),
            Input::Shutdown => (TearDown(EndCause::Shutdown), false),
        }
    }

    #[test]
    fn every_input_in_every_state() {
        let base = Instant::now();
        for start in STARTS {
            for input in INPUTS {
                let mut w = make(start, base);
                feed(&mut w, input, base);
                let (action, kept) = expected(start, input);
                assert_eq!(w.poll(), action, "{start:?} then {input:?}");
                assert_eq!(w.is_kept(), kept, "{start:?} then {input:?}: kept");
                let due = match action {
                    Action::Keep => Some(base + TIMEOUT),
                    Action::TearDown(_) => None,
                };
                assert_eq!(w.poll_timeout(), due, "{start:?} then {input:?}: timer");
            }
        }
    }

    #[test]
    fn the_first_end_wins_over_every_later_input() {
        let base = Instant::now();
        for first in INPUTS {
            for start in STARTS {
                let mut w = make(start, base);
                feed(&mut w, first, base);
                let Action::TearDown(cause) = w.poll() else {
                    continue;
                };
                for later in INPUTS {
                    let mut again = w.clone();
                    feed(&mut again, later, base);
                    assert_eq!(
                        again.poll(),
                        Action::TearDown(cause.clone()),
                        "{start:?}: {first:?} then {later:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn without_a_deadline_no_time_ends_the_tree() {
        let mut w = OwnerWatch::new(Lifetime::Root, None, None);
        assert_eq!(w.poll_timeout(), None);
        w.handle_timeout(Instant::now() + Duration::from_secs(86_400));
        assert_eq!(w.poll(), Action::Keep);
    }

    #[test]
    fn a_kept_tree_ends_with_the_status_its_root_exited_with() {
        let mut w = OwnerWatch::new(Lifetime::Owner, None, None);
        w.handle_root_exit(Some(ExitStatus::Signaled(9)));
        w.handle_tick(Some(false));
        w.handle_tick(None);
        assert!(w.is_kept());
        w.handle_tick(Some(true));
        assert_eq!(
            w.poll(),
            Action::TearDown(EndCause::RootExited(Some(ExitStatus::Signaled(9))))
        );
    }
}
