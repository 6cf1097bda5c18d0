//! The owner policy `run` (threads, custody/owner/) and `serve` (tokio,
//! service/mod.rs) share: why an owner ends its tree and the reason it
//! records, which grace the teardown gets, and how the observer starts.
//!
//! Why it exists: the two owner loops differ in how they wait (a channel
//! and threads; a reactor), not in what they decide. Written once here, the
//! two cannot drift apart (the reason strings, the grace's fallbacks and
//! cap, the observer's `auto`/`on`/`off` rule were each written twice).

use std::time::Duration;

use super::observer::Observer;
use super::teardown::{Origin, TeardownOptions};
use crate::config::ObserverMode;
use crate::ledger::Ledger;
use crate::proc::ExitStatus;

/// Why an owner ends the tree it owns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EndCause {
    /// The root exited, with its status when this process reaped it.
    RootExited(Option<ExitStatus>),
    /// The client that asked the service for the tree exited.
    OwnerExited,
    /// The tree's timeout passed.
    Timeout(Duration),
    /// `run` received this signal.
    Signal(i32),
    /// `run`'s parent died (`--die-with-parent`).
    ParentDied,
    /// A kill was asked for (`treewarden kill`, `POST /api/trees/{id}/kill`).
    Kill,
    /// The service is shutting down (its drain).
    Shutdown,
    /// A teardown an earlier service instance had begun, resumed at start.
    Resume,
}

impl EndCause {
    /// The reason recorded with the teardown's state change and its
    /// authorization.
    pub fn reason(&self) -> String {
        match self {
            EndCause::RootExited(Some(s)) => format!("root exited ({s})"),
            EndCause::RootExited(None) => "root exited".to_string(),
            EndCause::OwnerExited => "owner exited".to_string(),
            EndCause::Timeout(t) => format!("timeout after {}", humantime::format_duration(*t)),
            EndCause::Signal(n) => format!("run received signal {n}"),
            EndCause::ParentDied => "run's parent died".to_string(),
            EndCause::Kill => "kill requested".to_string(),
            EndCause::Shutdown => "service shutting down".to_string(),
            EndCause::Resume => "resuming a teardown interrupted by a service restart".to_string(),
        }
    }

    /// The bounded `origin` label of `treewarden_teardown_duration_seconds`
    /// (never a tree id or a pid), so timeouts, root exits and kills are
    /// counted apart.
    pub fn label(&self) -> &'static str {
        match self {
            EndCause::RootExited(_) => "root_exit",
            EndCause::OwnerExited | EndCause::ParentDied => "owner_exit",
            EndCause::Timeout(_) => "timeout",
            EndCause::Signal(_) | EndCause::Kill => "kill",
            EndCause::Shutdown => "shutdown",
            EndCause::Resume => "resume",
        }
    }

    /// Who runs the teardown for this cause in the service: a kill is the
    /// requester's, every other end the service's own.
    pub fn service_origin(&self) -> Origin {
        match self {
            EndCause::Kill => Origin::Kill,
            _ => Origin::Service,
        }
    }

    /// The root's exit status, when the owner reaped it.
    pub fn root_exit(&self) -> Option<ExitStatus> {
        match self {
            EndCause::RootExited(s) => *s,
            _ => None,
        }
    }

    /// The options of the owner's teardown for this cause.
    pub fn teardown_options(&self, grace: Grace, origin: Origin) -> TeardownOptions {
        let mut opts = TeardownOptions::new(grace, self.reason(), origin);
        opts.root_exit = self.root_exit();
        opts
    }
}

/// The default grace, as every `--grace` (run, kill's fallback, sweep,
/// serve, the custodian) spells it: written once.
pub const DEFAULT_GRACE: &str = "5s";

/// [`DEFAULT_GRACE`] as a duration.
pub fn default_grace() -> Duration {
    humantime::parse_duration(DEFAULT_GRACE).unwrap_or_default()
}

/// A teardown's grace (the first signal to the forced kill), resolved once
/// by [`Grace::resolve`] (or [`Grace::for_tree`]) and carried as this type
/// into [`TeardownOptions`]: run, CLI kill, HTTP kill, sweep, recovery and
/// the drain all make it here, from the same inputs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Grace(Duration);

impl Grace {
    /// None: a teardown that failed closed is finished at once.
    pub const NONE: Grace = Grace(Duration::ZERO);

    /// The one asked for (a request, a flag), else the one recorded with
    /// the tree, else `default`; never more than `cap` when one is given
    /// (the service's shutdown; an operator's `--max-grace`).
    pub fn resolve(
        asked: Option<Duration>,
        recorded: Option<Duration>,
        default: Duration,
        cap: Option<Duration>,
    ) -> Grace {
        let grace = asked.or(recorded).unwrap_or(default);
        Grace(match cap {
            Some(cap) => grace.min(cap),
            None => grace,
        })
    }

    /// [`Grace::resolve`] with the tree's row as the recorded value (the
    /// ledger is the one source of truth, owned tree or not).
    pub fn for_tree(
        row: &crate::ledger::TreeRow,
        asked: Option<Duration>,
        default: Duration,
        cap: Option<Duration>,
    ) -> Grace {
        Grace::resolve(asked, row.grace_ms.map(Duration::from_millis), default, cap)
    }

    pub fn duration(self) -> Duration {
        self.0
    }

    pub fn as_millis(self) -> u64 {
        u64::try_from(self.0.as_millis()).unwrap_or(u64::MAX)
    }

    pub fn is_zero(self) -> bool {
        self.0.is_zero()
    }
}

/// A grace asked for as it is, with no tree record and no cap (what
/// [`Grace::resolve`] makes of `Some(d)` alone): a library caller's
/// teardown, a test's.
impl From<Duration> for Grace {
    fn from(d: Duration) -> Grace {
        Grace(d)
    }
}

impl std::fmt::Display for Grace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", humantime::format_duration(self.0))
    }
}

/// How the observer started.
pub struct ObserverStart {
    /// `None`: scans only.
    pub observer: Option<Observer>,
    /// Why there is none (empty when it runs).
    pub off_because: String,
}

/// Starts the proc-connector observer as `mode` asks: `off` never, `auto`
/// when the proc connector can be subscribed to (else scans only, logged),
/// `on` or fail (`Err`: one line for the operator). `on_overflow` runs when
/// the observer lost events (the owner scans everything then).
pub fn start_observer(
    ledger: &Ledger,
    mode: ObserverMode,
    rcvbuf: usize,
    on_overflow: Box<dyn Fn() + Send>,
) -> Result<ObserverStart, String> {
    if mode == ObserverMode::Off {
        return Ok(ObserverStart {
            observer: None,
            off_because: "--observer off".into(),
        });
    }
    as_the_mode_asks(mode, Observer::start(ledger.clone(), rcvbuf, on_overflow))
}

/// What `mode` makes of an observer's start: `on` fails without one,
/// `auto` goes on with scans only.
fn as_the_mode_asks(
    mode: ObserverMode,
    started: Result<Observer, impl std::fmt::Display>,
) -> Result<ObserverStart, String> {
    match started {
        Ok(o) => Ok(ObserverStart {
            observer: Some(o),
            off_because: String::new(),
        }),
        Err(e) if mode == ObserverMode::On => Err(format!(
            "--observer on, but the proc connector is unavailable: {e}"
        )),
        Err(e) => {
            tracing::info!(error = %e, "observer off: proc connector unavailable; scans only");
            Ok(ObserverStart {
                observer: None,
                off_because: format!("proc connector unavailable: {e}"),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every teardown reason a writer of this build spells reads back as
    /// its cause: the outcome the dashboard shows depends on it.
    #[test]
    fn every_recorded_teardown_reason_reads_back_as_its_cause() {
        use crate::ledger::outcome::Cause;
        let root = Some(ExitStatus::Exited(3));
        for (end, cause) in [
            (EndCause::RootExited(root), Cause::RootExited),
            (EndCause::RootExited(None), Cause::RootExited),
            (EndCause::OwnerExited, Cause::OwnerGone),
            (
                EndCause::Timeout(Duration::from_millis(1500)),
                Cause::Timeout,
            ),
            (EndCause::Signal(2), Cause::Signal),
            (EndCause::ParentDied, Cause::OwnerGone),
            (EndCause::Kill, Cause::Kill),
            (EndCause::Shutdown, Cause::Shutdown),
        ] {
            assert_eq!(Cause::of_reason(&end.reason()), Some(cause), "{end:?}");
        }
        // A resumed teardown names no cause of its own: the first one stands.
        assert_eq!(Cause::of_reason(&EndCause::Resume.reason()), None);
        // The writers outside `EndCause`: the sweep, `kill`, the API, the
        // custodian, `run` without a custodian.
        for (reason, cause) in [
            ("owner gone (orphan sweep)", Cause::OwnerGone),
            (
                "owner gone: finishing a teardown that could not be authorized",
                Cause::OwnerGone,
            ),
            ("treewarden kill by uid 0 on the command line", Cause::Kill),
            (
                "killed through the API by token 1 (ops) over tcp",
                Cause::Kill,
            ),
            (
                "the custodian of a tree whose root exited received signal 15",
                Cause::Signal,
            ),
            (
                "every member exited (the root exited earlier)",
                Cause::RootExited,
            ),
            (
                "root exited; no custodian to keep the tree (x)",
                Cause::RootExited,
            ),
        ] {
            assert_eq!(Cause::of_reason(reason), Some(cause), "{reason}");
        }
    }

    #[test]
    fn without_a_proc_connector_on_fails_and_auto_scans_only() {
        // The branch a host with the connector (this one, as root) never
        // takes through `start_observer`.
        let on = as_the_mode_asks(ObserverMode::On, Err::<Observer, _>("EPERM"));
        assert_eq!(
            on.err().as_deref(),
            Some("--observer on, but the proc connector is unavailable: EPERM")
        );
        let auto = as_the_mode_asks(ObserverMode::Auto, Err::<Observer, _>("EPERM"))
            .expect("auto goes on");
        assert!(auto.observer.is_none());
        assert_eq!(auto.off_because, "proc connector unavailable: EPERM");
    }

    #[test]
    fn the_observer_starts_as_the_mode_asks() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ledger = Ledger::open(
            &dir.path().join("ledger.db"),
            crate::ledger::LedgerOptions::default(),
        )
        .expect("ledger");
        let off = start_observer(&ledger, ObserverMode::Off, 0, Box::new(|| {})).expect("off");
        assert!(off.observer.is_none());
        assert_eq!(off.off_because, "--observer off");
        // `auto` and `on` agree on this host: both run it, or `auto` says
        // why not and `on` refuses with the same cause.
        let auto = start_observer(&ledger, ObserverMode::Auto, 0, Box::new(|| {})).expect("auto");
        let on = start_observer(&ledger, ObserverMode::On, 0, Box::new(|| {}));
        match (auto.observer, on) {
            (Some(a), Ok(on)) => {
                assert!(auto.off_because.is_empty());
                let on = on.observer.expect("on runs it too");
                a.stop();
                on.stop();
            }
            (None, Err(e)) => {
                assert!(auto.off_because.starts_with("proc connector unavailable"));
                assert!(e.starts_with("--observer on, but"), "{e}");
            }
            (a, on) => panic!(
                "auto and on disagree: auto {:?}, on {:?}",
                a.is_some(),
                on.map(|o| o.observer.is_some())
            ),
        }
    }

    #[test]
    fn origin_labels_are_their_serialized_form() {
        for o in [Origin::Run, Origin::Kill, Origin::Sweep, Origin::Service] {
            let json = serde_json::to_value(o).expect("serializes");
            assert_eq!(json, serde_json::Value::from(o.as_str()));
        }
    }

    #[test]
    fn grace_is_asked_then_recorded_then_default_and_capped() {
        let s = Duration::from_secs;
        let grace = |a, r, d, c| Grace::resolve(a, r, d, c).duration();
        assert_eq!(grace(Some(s(1)), Some(s(2)), s(3), None), s(1));
        assert_eq!(grace(None, Some(s(2)), s(3), None), s(2));
        assert_eq!(grace(None, None, s(3), None), s(3));
        assert_eq!(grace(Some(s(9)), None, s(3), Some(s(4))), s(4));
        assert_eq!(grace(None, Some(s(2)), s(3), Some(s(4))), s(2));
        // The cap bounds the recorded value and the default too.
        assert_eq!(grace(None, Some(s(8)), s(3), Some(s(4))), s(4));
        assert_eq!(grace(None, None, s(7), Some(s(4))), s(4));
        assert_eq!(default_grace(), s(5));
        assert_eq!(Grace::NONE.duration(), Duration::ZERO);
    }

    /// The tree's row is the recorded grace: what an orphan's sweep and a
    /// kill of a tree this process does not own resolve from.
    #[test]
    fn a_trees_grace_is_the_one_its_row_records() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = (super::super::fake::PID_BASE, 1);
        let (_config, ledger, tree) = super::super::fake::recorded_tree(
            dir.path(),
            root,
            None,
            "worker",
            2500,
            Duration::from_millis(40),
        );
        let row = ledger.tree(tree).expect("readable").expect("recorded");
        let ms = Duration::from_millis;
        let five = Duration::from_secs(5);
        assert_eq!(Grace::for_tree(&row, None, five, None).duration(), ms(2500));
        assert_eq!(
            Grace::for_tree(&row, Some(ms(100)), five, None).duration(),
            ms(100)
        );
        assert_eq!(
            Grace::for_tree(&row, None, five, Some(ms(900))).duration(),
            ms(900)
        );
    }

    /// What a grace reports of itself: the milliseconds the sweep and the
    /// teardown's log record, whether it is none (the teardown's grace loop
    /// runs only while it is not), and the operator's spelling.
    #[test]
    fn a_grace_reports_its_millis_its_zero_and_its_spelling() {
        let g = Grace::from(Duration::from_millis(1500));
        assert_eq!(g.as_millis(), 1500);
        assert!(!g.is_zero());
        assert!(Grace::NONE.is_zero());
        assert_eq!(Grace::NONE.as_millis(), 0);
        assert_eq!(g.to_string(), "1s 500ms");
        assert_eq!(Grace::from(Duration::MAX).as_millis(), u64::MAX);
    }

    #[test]
    fn each_cause_has_its_reason_and_only_a_root_exit_a_status() {
        let st = ExitStatus::Exited(3);
        let causes = [
            (
                EndCause::RootExited(Some(st)),
                format!("root exited ({st})"),
            ),
            (EndCause::RootExited(None), "root exited".into()),
            (EndCause::OwnerExited, "owner exited".into()),
            (
                EndCause::Timeout(Duration::from_secs(90)),
                "timeout after 1m 30s".into(),
            ),
            (EndCause::Signal(15), "run received signal 15".into()),
            (EndCause::ParentDied, "run's parent died".into()),
            (EndCause::Kill, "kill requested".into()),
            (EndCause::Shutdown, "service shutting down".into()),
            (
                EndCause::Resume,
                "resuming a teardown interrupted by a service restart".into(),
            ),
        ];
        for (cause, reason) in causes {
            assert_eq!(cause.reason(), reason);
            let opts = cause.teardown_options(Duration::from_secs(2).into(), Origin::Service);
            assert_eq!(opts.reason, reason);
            assert_eq!(opts.grace.duration(), Duration::from_secs(2));
            assert_eq!(
                opts.root_exit,
                (cause == EndCause::RootExited(Some(st))).then_some(st)
            );
        }
    }

    /// The service's causes keep the metric labels and origins they had
    /// when the service had an enum of its own (`service::Why`): the
    /// dashboards and alerts match them.
    #[test]
    fn each_cause_has_its_bounded_label_and_origin() {
        let st = ExitStatus::Exited(0);
        for (cause, label, origin) in [
            (EndCause::RootExited(Some(st)), "root_exit", Origin::Service),
            (EndCause::RootExited(None), "root_exit", Origin::Service),
            (EndCause::OwnerExited, "owner_exit", Origin::Service),
            (
                EndCause::Timeout(Duration::from_secs(1)),
                "timeout",
                Origin::Service,
            ),
            (EndCause::Kill, "kill", Origin::Kill),
            (EndCause::Signal(15), "kill", Origin::Service),
            (EndCause::ParentDied, "owner_exit", Origin::Service),
            (EndCause::Shutdown, "shutdown", Origin::Service),
            (EndCause::Resume, "resume", Origin::Service),
        ] {
            assert_eq!(cause.label(), label, "{cause:?}");
            assert_eq!(cause.service_origin(), origin, "{cause:?}");
        }
    }
}
