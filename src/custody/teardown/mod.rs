//! The teardown state machine: one implementation for `run`, `kill`, the
//! sweep and the service.
//!
//! ```text
//! running -> terminating: SIGTERM to the recorded group and to every member
//!            outside it (identity-checked pidfds)
//!         -> grace, ending as soon as no live member remains
//!         -> freeze the cgroup (or SIGSTOP group and stragglers), snapshot
//!            the survivors as evidence
//!         -> commit kill.authorized naming the targets       (synchronous=FULL)
//!            | commit failed: no SIGKILL; thaw; ambiguous; dispatch closes
//!         -> killing: SIGKILL (cgroup.kill | killpg(recorded pgid) | pidfd)
//!         -> verify by scan that no live member remains
//!            | members remain (fork race): freeze-snapshot-authorize-kill
//!              again, a bounded number of rounds; then ambiguous
//!         -> ended
//! ```
//!
//! Every step is a ledger event. The only step whose failure to record stops
//! the teardown is the authorization: evidence writes are best effort (logged
//! and counted), authority is not.

use std::collections::{HashMap, HashSet};
use std::ops::ControlFlow;
use std::time::{Duration, Instant, SystemTime};

use serde::Serialize;

use super::watch::TreeWatch;
use super::{CustodyError, Engine};
use crate::ledger::{AuthorizationId, Deferred, SurvivorRecord, TreeId, TreeState};
use crate::proc::{GroupRecord, Identity, Sig};
use crate::scan::Member;

mod finish;
mod lease;
mod phases;
mod signal;
mod unkillable;

pub(crate) use finish::{remove_cgroup, resources_from};
pub(crate) use lease::Lease;

/// Who asked for the teardown; chooses the event that records a refusal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Origin {
    Run,
    Kill,
    Sweep,
    Service,
}

impl Origin {
    /// The origin's label, as its serialized form spells it (logs, the
    /// report): written once here.
    pub fn as_str(self) -> &'static str {
        match self {
            Origin::Run => "run",
            Origin::Kill => "kill",
            Origin::Sweep => "sweep",
            Origin::Service => "service",
        }
    }
}

/// How a teardown runs.
#[derive(Clone, Debug)]
pub struct TeardownOptions {
    /// Time between the first signal and the forced kill; ends early when
    /// the tree is empty. Resolved by the policy ([`super::policy::Grace`]).
    pub grace: super::policy::Grace,
    /// The first signal (SIGTERM unless told otherwise; one of
    /// [`Sig::FIRST`]).
    pub first_signal: Sig,
    /// Why (recorded with the state change and the authorization).
    pub reason: String,
    pub origin: Origin,
    /// How long to wait after each SIGKILL for the scan to come back empty.
    pub verify_timeout: Duration,
    /// Freeze-snapshot-authorize-kill rounds before giving up (fork races).
    pub rounds: u32,
    /// Exit status of the root, when the caller reaped it.
    pub root_exit: Option<crate::proc::ExitStatus>,
    /// This process's proc-connector observer, when it runs: the members it
    /// attributed join every scan of the teardown, even ones the ledger
    /// refused to record.
    pub observer: Option<super::observer::ObserverHandle>,
}

impl TeardownOptions {
    pub fn new(
        grace: impl Into<super::policy::Grace>,
        reason: impl Into<String>,
        origin: Origin,
    ) -> Self {
        Self {
            grace: grace.into(),
            first_signal: Sig::Term,
            reason: reason.into(),
            origin,
            verify_timeout: Duration::from_secs(3),
            rounds: 3,
            root_exit: None,
            observer: None,
        }
    }
}

/// The phases, in order; durations of each are reported.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    Term,
    Grace,
    Freeze,
    /// The survivors' command lines read as evidence.
    Snapshot,
    /// The snapshot and the authorization committed.
    Authorize,
    Kill,
    Verify,
    /// After the tree is verified empty: its members' exits and its end
    /// written to the ledger.
    Record,
}

impl Phase {
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Term => "term",
            Phase::Grace => "grace",
            Phase::Freeze => "freeze",
            Phase::Snapshot => "snapshot",
            Phase::Authorize => "authorize",
            Phase::Kill => "kill",
            Phase::Verify => "verify",
            Phase::Record => "record",
        }
    }
}

/// Where a teardown is, for a progress display.
#[derive(Clone, Debug)]
pub struct Progress {
    pub phase: Phase,
    pub alive: usize,
    pub grace_left: Option<Duration>,
    pub elapsed: Duration,
}

/// What a teardown did.
#[derive(Clone, Debug, Serialize)]
pub struct TeardownReport {
    pub tree: TreeId,
    pub state: TreeState,
    /// Live members when the teardown started.
    pub members_at_start: usize,
    /// Members that outlived the grace and were force-killed.
    pub force_killed: usize,
    pub authorizations: u32,
    pub phases: Vec<(Phase, Duration)>,
    pub elapsed: Duration,
    /// From the call to the scan that found no live member (the rest of
    /// `elapsed` is the [`Phase::Record`] of what that scan concluded).
    pub verified: Option<Duration>,
    /// Evidence writes not attempted after the ledger refused one
    /// (degraded evidence mode; the authorization is always attempted).
    pub evidence_skipped: usize,
    /// What the tree consumed (its cgroup's figures; `None` without one).
    pub resources: Option<crate::ledger::Resources>,
    /// The tree was settled already (another teardown ended it first):
    /// nothing was done.
    pub already_settled: bool,
}

impl TeardownReport {
    /// The report of a teardown that has done nothing yet.
    fn nothing_yet(tree: TreeId, state: TreeState) -> Self {
        TeardownReport {
            tree,
            state,
            members_at_start: 0,
            force_killed: 0,
            authorizations: 0,
            phases: Vec::new(),
            elapsed: Duration::ZERO,
            verified: None,
            evidence_skipped: 0,
            resources: None,
            already_settled: false,
        }
    }
}

/// The group the tree's row recorded, led by its root (the group's leader
/// when the root is not recorded).
fn recorded_group(row: &crate::ledger::TreeRow, watch: &TreeWatch) -> GroupRecord {
    let leader = Identity {
        pid: row.root_pid.unwrap_or(watch.pgid()),
        start_ticks: row.root_start_ticks.unwrap_or(0),
        boot_id: row.boot_id.clone().unwrap_or_default(),
    };
    GroupRecord {
        pgid: watch.pgid(),
        sid: watch.sid(),
        leader,
    }
}

/// Whom a signal step reaches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reach {
    /// The recorded group and, one by one through pidfds, the members
    /// outside it (SIGTERM, SIGSTOP, SIGCONT).
    Signal,
    /// As [`Reach::Signal`], but `cgroup.kill` for everything in the
    /// cgroup: the group and pidfds only for what is outside it.
    Kill,
}

/// One teardown: the value that owns its run from the first signal to the
/// end. Its phases (`phases.rs`), its signals (`signal.rs`) and its records
/// (`finish.rs`, `unkillable.rs`) are its methods, each reading and
/// updating what the run has found so far; it reaches the kernel only
/// through the engine's [`Host`](super::Host).
pub(super) struct Teardown<'a> {
    engine: &'a Engine,
    tree: TreeId,
    opts: &'a TeardownOptions,
    progress: &'a mut dyn FnMut(&Progress),
    watch: TreeWatch,
    group: GroupRecord,
    /// Exit statuses collected from the reaper so far, by pid.
    exits: HashMap<i32, crate::proc::ExitStatus>,
    /// The SIGKILLs each member was sent under a committed authorization,
    /// and the last authorization: a member that outlives them all is
    /// unkillable (`member.unkillable`), not merely a fork race.
    killed: HashMap<crate::proc::ProcKey, (u32, AuthorizationId)>,
    report: TeardownReport,
    started: Instant,
}

/// The teardown's states. Each phase is a function from one state (and the
/// host's answers) to the next; the ledger writes a phase needs are made by
/// that phase (the authorization only by [`State::Authorize`], and a
/// SIGKILL only by [`State::Kill`], which only [`State::Authorize`] reaches,
/// with the committed [`AuthorizationId`]).
enum State {
    /// The first signal to every live member.
    Term,
    Grace(Grace),
    /// One round of the forced kill begins.
    Freeze(Freeze),
    Snapshot(Snapshot),
    Authorize(Authorize),
    Kill(Kill),
    Verify(Verify),
    /// Verified empty: the exits and the end are recorded.
    Finish,
    /// Nothing provably ours to signal: refused, closed as vanished.
    Refuse(String),
    /// The authorization was not committed.
    FailClosed(FailClosed),
    /// Members outlived every round.
    Survived(Vec<Member>),
    /// The container's standing kill could not be cleared (Windows: the
    /// job's `KILL_ON_JOB_CLOSE`): no forced kill, the members left alive.
    Armed(Vec<Member>, String),
}

struct Grace {
    members: Vec<Member>,
    /// Whether the first signal found the group provably the recorded one.
    group_ok: bool,
}

struct Freeze {
    /// 1-based; past [`TeardownOptions::rounds`] the teardown gives up.
    round: u32,
    members: Vec<Member>,
}

struct Snapshot {
    round: u32,
    /// The frozen survivors.
    survivors: Vec<Member>,
    taken_at: SystemTime,
}

struct Authorize {
    round: u32,
    survivors: Vec<Member>,
    forensic: Vec<SurvivorRecord>,
    taken_at: SystemTime,
}

struct Kill {
    round: u32,
    survivors: Vec<Member>,
    targets: Targets,
    /// The committed authorization naming `targets`.
    auth: AuthorizationId,
}

struct Verify {
    round: u32,
    survivors: Vec<Member>,
    targets: Targets,
}

struct FailClosed {
    survivors: Vec<Member>,
    forensic: Vec<SurvivorRecord>,
    taken_at: SystemTime,
    /// Why the ledger refused the authorization.
    error: String,
}

/// Signal targets for one step: the recorded group, the cgroup, and members
/// that neither reaches.
struct Targets {
    group: GroupRecord,
    cgroup: Option<std::path::PathBuf>,
    /// Live members in the recorded group (pid + start), as just
    /// classified: the group check re-reads these instead of walking all of
    /// `/proc`.
    group_pids: Vec<crate::proc::ProcKey>,
    /// Live members outside the recorded group (and, for a cgroup kill,
    /// outside the cgroup): signalled one by one through pidfds.
    loose: Vec<Identity>,
    /// Live members the group signal must reach (for a cgroup kill: those
    /// outside the cgroup). Zero means the group is not signalled.
    in_group: usize,
    /// For a cgroup kill: the cgroup's members as the step's tick read them
    /// (frozen), which the authorization names as the cgroup target's.
    cgroup_pids: HashSet<i32>,
}

impl Engine {
    /// Tears a tree down (or resumes a teardown from the state the ledger
    /// holds). Terminal trees are left as they are.
    ///
    /// Holds the tree's teardown lease for the whole teardown: a second
    /// teardown of the same tree (`kill` while `run` tears down, two sweeps)
    /// waits for it, up to [`LEASE_WAIT`], and then reads the state again
    /// (usually terminal: nothing left to do). Without it one teardown's thaw
    /// could undo the other's freeze between its snapshot and its kill.
    pub fn teardown(
        &self,
        tree: TreeId,
        opts: &TeardownOptions,
        progress: &mut dyn FnMut(&Progress),
    ) -> Result<TeardownReport, CustodyError> {
        let _lease = Lease::take(&self.data_dir, tree)?;
        // (the lease file is unlinked and unlocked when `_lease` drops)
        let result = Teardown::run(self, tree, opts, progress);
        // One line per teardown for the operator's log (journalctl): how it
        // ended and what each phase cost. The ledger holds the evidence.
        match &result {
            // Another teardown ended it first (a kill, then the root's exit
            // it caused): that one logged; one teardown, one line.
            Ok(r) if r.already_settled => {
                tracing::debug!(tree = tree.0, origin = ?opts.origin, state = r.state.as_str(), "teardown: already settled");
            }
            Ok(r) => {
                let phases: Vec<String> = r
                    .phases
                    .iter()
                    .map(|(p, d)| format!("{}={}ms", p.as_str(), d.as_millis()))
                    .collect();
                tracing::info!(
                    tree = tree.0,
                    origin = opts.origin.as_str(),
                    state = r.state.as_str(),
                    members = r.members_at_start,
                    force_killed = r.force_killed,
                    authorizations = r.authorizations,
                    elapsed_ms = r.elapsed.as_millis() as u64,
                    phases = %phases.join(" "),
                    "teardown done"
                );
            }
            Err(e) => {
                tracing::warn!(tree = tree.0, origin = opts.origin.as_str(), error = %e, "teardown not settled")
            }
        }
        result
    }
}

impl<'a> Teardown<'a> {
    /// The teardown of `tree` under its lease: [`Teardown::begin`], then
    /// the machine.
    fn run(
        engine: &'a Engine,
        tree: TreeId,
        opts: &'a TeardownOptions,
        progress: &'a mut dyn FnMut(&Progress),
    ) -> Result<TeardownReport, CustodyError> {
        let _span = tracing::info_span!(
            "teardown",
            tree = tree.0,
            origin = opts.origin.as_str(),
            grace_ms = opts.grace.as_millis()
        )
        .entered();
        let started = Instant::now();
        match Self::begin(engine, tree, opts, progress, started)? {
            ControlFlow::Break(report) => Ok(report),
            ControlFlow::Continue(teardown) => teardown.drive(),
        }
    }

    /// Everything before the first signal: the deferred evidence replayed,
    /// the row and its members read, the watch made, the tree marked
    /// `terminating`. `Break` when the teardown ends before the machine
    /// starts: already settled, recorded in another boot (refused, closed
    /// as vanished), or never released (vanished).
    fn begin(
        engine: &'a Engine,
        tree: TreeId,
        opts: &'a TeardownOptions,
        progress: &'a mut dyn FnMut(&Progress),
        started: Instant,
    ) -> Result<ControlFlow<TeardownReport, Self>, CustodyError> {
        // Evidence an earlier teardown could not write goes first, so the
        // trail keeps the order things happened in.
        engine.ambiguity().replay_deferred_leased(tree);
        // The row and its members in one read (the members are what the
        // watch needs to know who was seen before).
        let (row, known_members) = engine
            .ledger
            .tree_members(tree)?
            .ok_or(CustodyError::UnknownTree(tree))?;
        let mut report = TeardownReport::nothing_yet(tree, row.state);
        // A terminal tree is done, unless an operator resolved it leaving
        // survivors (`resolve --force`): those are still killed with the
        // same authority rules; its state stays `resolved` (terminal states
        // are final), and the teardown ends by flagging `survivors_ended`.
        if row.state.is_terminal() && !row.has_survivors_left() {
            report.already_settled = true;
            return Ok(ControlFlow::Break(report));
        }
        // A tree recorded in another boot has no process left: its ids now
        // name strangers. Nothing is signalled; it is closed as vanished.
        if let (Some(recorded), Ok(now)) = (row.boot_id.as_deref(), engine.host.boot_id())
            && recorded != now
        {
            let why = format!(
                "recorded in boot {recorded}, this is boot {now}: nothing of it can be running"
            );
            let cgroup = row.cgroup.as_ref().map(std::path::PathBuf::from);
            return finish::refuse(engine, tree, cgroup.as_deref(), opts, &why, report, started)
                .map(ControlFlow::Break);
        }
        let exclude = engine.exclude.as_ref().clone();
        let adopted_by = (opts.origin == Origin::Run).then_some(std::process::id() as i32);
        let Some(mut watch) = TreeWatch::new_on(engine.host(), &row, &known_members, &exclude)
        else {
            // Never released: the held child exits when its owner's pipe closes.
            engine.ledger.end_tree(tree, TreeState::Vanished, None)?;
            if let Some(dir) = row.cgroup.as_deref() {
                remove_cgroup(engine.host(), std::path::Path::new(dir));
            }
            report.state = TreeState::Vanished;
            return Ok(ControlFlow::Break(report));
        };
        if let Some(pid) = adopted_by {
            watch.adopt_children_of(pid);
        }
        watch.degrade_on_refusal();
        watch.remember(&engine.ambiguity().marked_survivors(tree));
        watch.set_observer(opts.observer.clone());
        let group = recorded_group(&row, &watch);
        let mut exits: HashMap<i32, crate::proc::ExitStatus> = HashMap::new();
        finish::collect_exits(engine.host(), &mut exits);

        if matches!(
            row.state,
            TreeState::Spawning | TreeState::Running | TreeState::Ambiguous
        ) {
            // Evidence, not authority: a ledger that refuses this write does
            // not stop SIGTERM; it stops the forced kill, further down.
            if let Some(Err(e)) = watch.record(
                &engine.ledger,
                "state terminating",
                Deferred::State {
                    to: TreeState::Terminating,
                    reason: Some(opts.reason.clone()),
                    at: now(),
                },
            ) {
                tracing::warn!(tree = tree.0, error = %e, "state terminating not recorded");
            }
        }

        Ok(ControlFlow::Continue(Teardown {
            engine,
            tree,
            opts,
            progress,
            watch,
            group,
            exits,
            killed: HashMap::new(),
            report,
            started,
        }))
    }

    /// The machine's loop, from [`State::Term`] to a terminal state.
    fn drive(mut self) -> Result<TeardownReport, CustodyError> {
        // The machine: each phase is a function from the run and the host's
        // answers to the next state; the terminal states end it.
        let mut state = State::Term;
        loop {
            state = match state {
                State::Term => self.term().inspect_err(|_| self.disarm_again())?,
                State::Grace(g) => self.grace(g).inspect_err(|_| self.disarm_again())?,
                State::Freeze(f) => self.freeze_round(f),
                State::Snapshot(s) => self.snapshot(s),
                State::Authorize(a) => self.authorize(a),
                State::Kill(k) => self.kill(k).inspect_err(|_| self.disarm_again())?,
                State::Verify(v) => self.verify(v).inspect_err(|_| self.disarm_again())?,
                State::Finish => return self.finish(),
                State::Refuse(why) => {
                    self.flush_journal();
                    return finish::refuse(
                        self.engine,
                        self.tree,
                        self.watch.cgroup(),
                        self.opts,
                        &why,
                        self.report,
                        self.started,
                    );
                }
                State::FailClosed(f) => {
                    let e = self.fail_closed(f);
                    self.disarm_again();
                    return Err(e);
                }
                State::Survived(members) => {
                    let e = self.survived(members, None);
                    self.disarm_again();
                    return Err(e);
                }
                State::Armed(members, why) => {
                    let e = self.survived(members, Some(why));
                    self.disarm_again();
                    return Err(e);
                }
            };
        }
    }
}

/// The time of a fact, as the ledger writes times.
fn now() -> String {
    crate::ledger::timestamp(SystemTime::now())
}

#[cfg(test)]
mod tests {
    use super::phases::poll_interval;
    use super::*;

    /// `Phase::as_str` (mutant: `""`): each phase's label is the name its
    /// serialized form (the report, `--json`) gives it, and no two agree.
    #[test]
    fn each_phase_is_named_as_it_serializes() {
        let all = [
            Phase::Term,
            Phase::Grace,
            Phase::Freeze,
            Phase::Snapshot,
            Phase::Authorize,
            Phase::Kill,
            Phase::Verify,
            Phase::Record,
        ];
        let names: HashSet<&str> = all.iter().map(|p| p.as_str()).collect();
        assert_eq!(names.len(), all.len());
        for p in all {
            assert_eq!(
                serde_json::to_value(p).expect("serializes"),
                serde_json::Value::String(p.as_str().to_string())
            );
        }
    }

    /// `poll_interval`'s comparisons (mutants: `<` -> `<=`, `>`, `==`): 2 ms
    /// below 50 ms, 10 ms from 50 ms below 1 s, 50 ms from 1 s; the bounds
    /// themselves belong to the slower step.
    #[test]
    fn the_poll_interval_backs_off_at_50_ms_and_1_s() {
        let ms = Duration::from_millis;
        for (elapsed, poll) in [
            (ms(0), ms(2)),
            (ms(49), ms(2)),
            (ms(50), ms(10)),
            (ms(999), ms(10)),
            (ms(1000), ms(50)),
            (Duration::from_secs(60), ms(50)),
        ] {
            assert_eq!(poll_interval(elapsed), poll, "after {elapsed:?}");
        }
    }
}
