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
use std::time::{Duration, Instant, SystemTime};

use serde::Serialize;

use super::watch::{TreeWatch, exit_record};
use super::{CustodyError, Engine};
use crate::ledger::{
    AuthorizationId, Deferred, Event, IdentityRecord, KillTarget, SignalRecord, SurvivorRecord,
    TreeId, TreeState, event,
};
use crate::proc::{Delivery, GroupDelivery, GroupRecord, Identity, Sig};
use crate::scan::Member;

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
    pub tree: i64,
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

/// What every phase of one teardown shares.
struct Run<'a> {
    tree: TreeId,
    opts: &'a TeardownOptions,
    progress: &'a mut dyn FnMut(&Progress),
    watch: TreeWatch,
    group: GroupRecord,
    /// Exit statuses collected from the reaper so far, by pid.
    exits: HashMap<i32, crate::proc::ExitStatus>,
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

/// What one signal step did to one target, typed; its `Display` is the
/// `result` the ledger records (`signals.result`, `signal.sent`), spelled
/// as it always was.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Sent {
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
}

impl Sent {
    /// Whether the signal reached its target.
    pub(crate) fn was_sent(&self) -> bool {
        matches!(self, Sent::Delivered | Sent::ToMembers(_))
    }
}

impl std::fmt::Display for Sent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Sent::Delivered => f.write_str("sent"),
            Sent::ToMembers(n) => write!(f, "sent to {n} members"),
            Sent::GroupEmpty => f.write_str("group empty"),
            Sent::Gone => f.write_str("gone"),
            Sent::Refused(why) => write!(f, "refused: {why}"),
            Sent::Failed(e) => write!(f, "failed: {e}"),
        }
    }
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
        let _lease = self.teardown_lease(tree)?;
        // (the lease file is unlinked and unlocked when `_lease` drops)
        let result = self.teardown_leased(tree, opts, progress);
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

    /// Takes the tree's teardown lease: an advisory `flock` on
    /// `<data-dir>/teardown/tree-<id>.lock`, released when the file closes,
    /// also when the process dies. The file lives only as long as the
    /// teardown: the holder unlinks it before it unlocks (see
    /// [`Lease`]), and a taker whose locked file is no longer the one at the
    /// path (it was unlinked meanwhile) lets go and tries again, so two
    /// processes never hold leases on two different files of one path.
    /// `None` when the lock file cannot be made (logged): the teardown then
    /// runs without a lease rather than not at all.
    pub(super) fn teardown_lease(&self, tree: TreeId) -> Result<Option<Lease>, CustodyError> {
        self.teardown_lease_within(tree, LEASE_WAIT)
    }

    /// [`Engine::teardown_lease`], waiting at most `wait` for a holder.
    pub(super) fn teardown_lease_within(
        &self,
        tree: TreeId,
        wait: Duration,
    ) -> Result<Option<Lease>, CustodyError> {
        let dir = self.data_dir.join("teardown");
        let path = dir.join(format!("tree-{}.lock", tree.0));
        let deadline = Instant::now() + wait;
        let mut logged = false;
        loop {
            let file = super::markers::private_dir(&dir).and_then(|()| {
                let mut o = std::fs::OpenOptions::new();
                o.create(true).truncate(false).write(true);
                #[cfg(unix)]
                std::os::unix::fs::OpenOptionsExt::mode(&mut o, 0o600);
                o.open(&path)
            });
            let file = match file {
                Ok(f) => f,
                Err(e) => {
                    tracing::warn!(tree = tree.0, path = %path.display(), error = %e, "no teardown lease: running without one");
                    return Ok(None);
                }
            };
            match file.try_lock() {
                Ok(()) if Lease::still_at(&file, &path) => {
                    return Ok(Some(Lease {
                        _locked: file,
                        path,
                    }));
                }
                // Locked a file its holder had already unlinked: try again.
                Ok(()) => continue,
                Err(std::fs::TryLockError::WouldBlock) => {}
                Err(std::fs::TryLockError::Error(e)) => {
                    tracing::warn!(tree = tree.0, error = %e, "teardown lease not taken: running without one");
                    return Ok(None);
                }
            }
            if Instant::now() >= deadline {
                return Err(CustodyError::Conflict(format!(
                    "tree {} is being torn down by another process (its teardown lease {} was held for {}); try again",
                    tree.0,
                    path.display(),
                    humantime::format_duration(wait)
                )));
            }
            if !logged {
                tracing::info!(
                    tree = tree.0,
                    "another teardown of this tree is running: waiting for its lease"
                );
                logged = true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn teardown_leased(
        &self,
        tree: TreeId,
        opts: &TeardownOptions,
        progress: &mut dyn FnMut(&Progress),
    ) -> Result<TeardownReport, CustodyError> {
        let _span = tracing::info_span!(
            "teardown",
            tree = tree.0,
            origin = opts.origin.as_str(),
            grace_ms = opts.grace.as_millis()
        )
        .entered();
        let started = Instant::now();
        // Evidence an earlier teardown could not write goes first, so the
        // trail keeps the order things happened in.
        self.replay_deferred_leased(tree);
        // The row and its members in one read (the members are what the
        // watch needs to know who was seen before).
        let (row, known_members) = self
            .ledger
            .tree_members(tree)?
            .ok_or(CustodyError::UnknownTree(tree.0))?;
        let mut report = TeardownReport {
            tree: tree.0,
            state: row.state,
            members_at_start: 0,
            force_killed: 0,
            authorizations: 0,
            phases: Vec::new(),
            elapsed: Duration::ZERO,
            verified: None,
            evidence_skipped: 0,
            resources: None,
            already_settled: false,
        };
        // A terminal tree is done, unless an operator resolved it leaving
        // survivors (`resolve --force`): those are still killed with the
        // same authority rules; its state stays `resolved` (terminal states
        // are final), and the teardown ends by flagging `survivors_ended`.
        if row.state.is_terminal() && !row.has_survivors_left() {
            report.already_settled = true;
            return Ok(report);
        }
        // A tree recorded in another boot has no process left: its ids now
        // name strangers. Nothing is signalled; it is closed as vanished.
        if let (Some(recorded), Ok(now)) = (row.boot_id.as_deref(), self.host.boot_id())
            && recorded != now
        {
            let why = format!(
                "recorded in boot {recorded}, this is boot {now}: nothing of it can be running"
            );
            let cgroup = row.cgroup.as_ref().map(std::path::PathBuf::from);
            return self.refuse(tree, cgroup.as_deref(), opts, &why, report, started);
        }
        let exclude = self.exclude.as_ref().clone();
        let adopted_by = (opts.origin == Origin::Run).then_some(std::process::id() as i32);
        let Some(mut watch) = TreeWatch::new_on(self.host(), &row, &known_members, &exclude) else {
            // Never released: the held child exits when its owner's pipe closes.
            self.ledger.end_tree(tree, TreeState::Vanished, None)?;
            if let Some(dir) = row.cgroup.as_deref() {
                remove_cgroup(self.host(), std::path::Path::new(dir));
            }
            report.state = TreeState::Vanished;
            return Ok(report);
        };
        if let Some(pid) = adopted_by {
            watch.adopt_children_of(pid);
        }
        watch.degrade_on_refusal();
        watch.remember(&self.marked_survivors(tree.0));
        watch.set_observer(opts.observer.clone());
        let leader = Identity {
            pid: row.root_pid.unwrap_or(watch.pgid()),
            start_ticks: row.root_start_ticks.unwrap_or(0),
            boot_id: row.boot_id.clone().unwrap_or_default(),
        };
        let group = GroupRecord {
            pgid: watch.pgid(),
            sid: watch.sid(),
            leader,
        };
        let mut exits: HashMap<i32, crate::proc::ExitStatus> = HashMap::new();
        self.collect_exits(&mut exits);

        if matches!(
            row.state,
            TreeState::Spawning | TreeState::Running | TreeState::Ambiguous
        ) {
            // Evidence, not authority: a ledger that refuses this write does
            // not stop SIGTERM; it stops the forced kill, further down.
            if let Some(Err(e)) = watch.record(
                &self.ledger,
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

        let mut run = Run {
            tree,
            opts,
            progress,
            watch,
            group,
            exits,
            report,
            started,
        };
        // The machine: each phase is a function from the run and the host's
        // answers to the next state; the terminal states end it.
        let mut state = State::Term;
        loop {
            state = match state {
                State::Term => self
                    .term(&mut run)
                    .inspect_err(|_| self.disarm_again(&run))?,
                State::Grace(g) => self
                    .grace(&mut run, g)
                    .inspect_err(|_| self.disarm_again(&run))?,
                State::Freeze(f) => self.freeze_round(&mut run, f),
                State::Snapshot(s) => self.snapshot(&mut run, s),
                State::Authorize(a) => self.authorize(&mut run, a),
                State::Kill(k) => self
                    .kill(&mut run, k)
                    .inspect_err(|_| self.disarm_again(&run))?,
                State::Verify(v) => self
                    .verify(&mut run, v)
                    .inspect_err(|_| self.disarm_again(&run))?,
                State::Finish => {
                    let Run {
                        tree,
                        opts,
                        mut watch,
                        exits,
                        report,
                        started,
                        ..
                    } = run;
                    return self.finish(tree, &mut watch, opts, report, started, &exits);
                }
                State::Refuse(why) => {
                    self.flush_journal(tree, &mut run.watch);
                    return self.refuse(
                        tree,
                        run.watch.cgroup(),
                        opts,
                        &why,
                        run.report,
                        run.started,
                    );
                }
                State::FailClosed(f) => {
                    let e = self.fail_closed(&mut run, f);
                    self.disarm_again(&run);
                    return Err(e);
                }
                State::Survived(members) => {
                    let e = self.survived(&mut run, members, None);
                    self.disarm_again(&run);
                    return Err(e);
                }
                State::Armed(members, why) => {
                    let e = self.survived(&mut run, members, Some(why));
                    self.disarm_again(&run);
                    return Err(e);
                }
            };
        }
    }

    /// TERM: one full walk (it finds members by descent: escapees in
    /// sessions of their own; later scans re-read what it and
    /// `cgroup.procs` name, until one verifying full walk at the end), then
    /// the first signal to every live member.
    fn term(&self, run: &mut Run<'_>) -> Result<State, CustodyError> {
        let t0 = Instant::now();
        let _span = tracing::info_span!("teardown.phase", phase = "term").entered();
        // A tree proven empty without a walk (`run -- true` after its root
        // exited) is checked by a targeted tick, which still records the
        // exits of the members seen alive; anything it finds after all
        // gets the full walk.
        let proven = self.proven_empty(&run.watch);
        let mut members = if proven {
            run.watch.tick_targeted(self, &run.exits).members
        } else {
            Vec::new()
        };
        if !proven || !members.is_empty() {
            members = self.full_walk(run)?;
        }
        run.report.members_at_start = members.len();
        if members.is_empty() {
            return Ok(match run.watch.recycled_leader(self) {
                Some(why) => State::Refuse(why),
                None => State::Finish,
            });
        }
        let targets = self.targets(&run.watch, &run.group, &members, Reach::Signal);
        let group_ok = self.send(
            run.tree,
            &mut run.watch,
            &targets,
            run.opts.first_signal,
            None,
            run.opts,
        )?;
        run.report.phases.push((Phase::Term, t0.elapsed()));
        Ok(State::Grace(Grace { members, group_ok }))
    }

    /// Whether nothing of the tree can be alive, known without a walk of
    /// `/proc`: this process spawned the root and is the subreaper of the
    /// tree, it has no child at all (live or zombie), and the tree's cgroup,
    /// where it has one, reports `populated 0`. Every member is in the
    /// root's session or group (so descended from the root, which made
    /// both), in its cgroup, or descended from a member; a live descendant
    /// whose ancestors up to the root are dead has been re-parented to its
    /// nearest live subreaper ancestor, this process, so with no child here
    /// no descendant lives; and the one way into the tree that is not
    /// descent, a privileged write to `cgroup.procs`, shows in the cgroup.
    fn proven_empty(&self, watch: &TreeWatch) -> bool {
        if !self.was_spawned_here(watch.tree()) || self.host.has_no_children() != Some(true) {
            return false;
        }
        match watch.cgroup() {
            Some(dir) => matches!(self.host.cgroup_wait_empty(dir, self.host.now()), Ok(true)),
            None => true,
        }
    }

    /// The verify's [`Self::proven_empty`]: the killed members are the
    /// reaper's to reap, so their zombies are given a millisecond to go
    /// before the `/proc` walk decides instead (issue 30: the walk was a
    /// sixth of a 10-process teardown; `run`, and the service's own trees
    /// when it has no other child, end without it).
    fn reaped_empty(&self, watch: &TreeWatch) -> bool {
        if !self.was_spawned_here(watch.tree()) || !self.host.has_reaper() {
            return false;
        }
        for _ in 0..REAP_TRIES {
            if self.proven_empty(watch) {
                return true;
            }
            if self.host.has_no_children() != Some(false) {
                // No reaper answer, or none left but the cgroup says
                // populated: not provable without the walk.
                return false;
            }
            self.host.sleep(REAP_PAUSE);
        }
        false
    }

    /// GRACE: targeted re-reads until the members are gone or the grace is
    /// over (none at grace 0: the freeze's scan is the first chance
    /// anything had to exit; an extra scan cost a full walk, issue 6).
    /// One full walk whose evidence is complete, tried a bounded number of
    /// times: a walk whose reads failed (out of descriptors, I/O) proves
    /// nothing gone, so no phase decides on one. Still incomplete after
    /// the tries: the teardown stops undecided, the tree left as it stands
    /// in the ledger (not ended), to be tried again by its caller.
    fn full_walk(&self, run: &mut Run<'_>) -> Result<Vec<Member>, CustodyError> {
        let w0 = self.host.now();
        let mut tries = 0;
        loop {
            let report = run.watch.tick_full(self, &run.exits, false);
            let Some(reason) = report.incomplete else {
                return Ok(report.members);
            };
            tries += 1;
            if tries >= INCOMPLETE_TRIES {
                return Err(CustodyError::Incomplete {
                    tree: run.tree.0,
                    reason,
                });
            }
            self.host
                .sleep(poll_interval(self.host.now().saturating_duration_since(w0)));
        }
    }

    fn grace(&self, run: &mut Run<'_>, g: Grace) -> Result<State, CustodyError> {
        let t0 = Instant::now();
        let span = tracing::info_span!("teardown.phase", phase = "grace").entered();
        let Grace {
            mut members,
            group_ok,
        } = g;
        let g0 = self.host.now();
        let deadline = g0 + run.opts.grace.duration();
        while !run.opts.grace.is_zero() {
            self.collect_exits(&mut run.exits);
            members = run.watch.tick_targeted(self, &run.exits).members;
            let now = self.host.now();
            if members.is_empty() || now >= deadline {
                break;
            }
            (run.progress)(&Progress {
                phase: Phase::Grace,
                alive: members.len(),
                grace_left: Some(deadline - now),
                elapsed: run.started.elapsed(),
            });
            self.host.sleep(poll_interval(now - g0));
        }
        run.report.phases.push((Phase::Grace, t0.elapsed()));
        drop(span);
        if members.is_empty() {
            // Targeted polls found the known members gone: one full walk
            // says whether anything else of the tree is left.
            members = self.full_walk(run)?;
        }
        if members.is_empty() {
            return Ok(State::Finish);
        }
        if !group_ok
            && run.watch.cgroup().is_none()
            && members.iter().all(|m| m.entry.pgid == run.group.pgid)
        {
            // Nothing provably ours to signal: refuse, close as vanished.
            return Ok(State::Refuse(
                "process group is not provably the recorded one".into(),
            ));
        }
        Ok(State::Freeze(Freeze { round: 1, members }))
    }

    /// FREEZE (one round of the forced kill): freeze what the kill will
    /// reach and re-read the survivors. A round past the bound ends in
    /// [`State::Survived`].
    fn freeze_round(&self, run: &mut Run<'_>, f: Freeze) -> State {
        let Freeze { round, members } = f;
        if round > run.opts.rounds.max(1) {
            return State::Survived(members);
        }
        let t0 = Instant::now();
        let span = tracing::info_span!("teardown.phase", phase = "freeze").entered();
        if let Err(why) = self.freeze(run.tree, &mut run.watch, &run.group, &members, run.opts) {
            return State::Armed(members, why);
        }
        self.collect_exits(&mut run.exits);
        // A frozen cgroup forks nothing: its `cgroup.procs` and the known
        // members are all there is to re-read. Without a cgroup, a process
        // forked since the first walk and gone to a session of its own is
        // found only by descent: walk.
        let survivors = if run.watch.cgroup().is_some() {
            run.watch.tick_targeted(self, &run.exits).members
        } else {
            run.watch.tick_full(self, &run.exits, false).members
        };
        let taken_at = SystemTime::now();
        run.report.phases.push((Phase::Freeze, t0.elapsed()));
        drop(span);
        if survivors.is_empty() {
            self.thaw(run.tree, &mut run.watch, &run.group, &members, run.opts);
            // Only a full walk may end a teardown: the targeted re-read of
            // a frozen cgroup cannot see a member outside it.
            let rest = run.watch.tick_full(self, &run.exits, false).members;
            if rest.is_empty() {
                return State::Finish;
            }
            return State::Freeze(Freeze {
                round: round + 1,
                members: rest,
            });
        }
        (run.progress)(&Progress {
            phase: Phase::Authorize,
            alive: survivors.len(),
            grace_left: None,
            elapsed: run.started.elapsed(),
        });
        State::Snapshot(Snapshot {
            round,
            survivors,
            taken_at,
        })
    }

    /// SNAPSHOT: the frozen survivors as evidence (their command lines).
    fn snapshot(&self, run: &mut Run<'_>, s: Snapshot) -> State {
        let t0 = Instant::now();
        let _span = tracing::info_span!("teardown.phase", phase = "snapshot").entered();
        let pids: Vec<i32> = s.survivors.iter().map(|m| m.entry.pid).collect();
        let argvs = self.host.cmdlines(&pids);
        let forensic: Vec<SurvivorRecord> = s
            .survivors
            .iter()
            // (a host that answers for fewer pids leaves the rest empty:
            // their `comm` stands in, below; no survivor is dropped)
            .zip(argvs.into_iter().chain(std::iter::repeat_with(Vec::new)))
            .map(|(m, argv)| SurvivorRecord {
                identity: run.watch.identity(m),
                state: m.entry.state.to_string(),
                rss_bytes: m.entry.rss_bytes,
                cmdline: if argv.is_empty() {
                    vec![m.entry.comm.clone()]
                } else {
                    argv
                },
            })
            .collect();
        run.report.phases.push((Phase::Snapshot, t0.elapsed()));
        State::Authorize(Authorize {
            round: s.round,
            survivors: s.survivors,
            forensic,
            taken_at: s.taken_at,
        })
    }

    /// AUTHORIZE: the snapshot and `kill.authorized` naming every target,
    /// in one FULL transaction. Refused: [`State::FailClosed`].
    fn authorize(&self, run: &mut Run<'_>, a: Authorize) -> State {
        let since = Instant::now();
        let _span = tracing::info_span!("teardown.phase", phase = "authorize").entered();
        let Authorize {
            round,
            survivors,
            forensic,
            taken_at,
        } = a;
        let targets = self.targets(&run.watch, &run.group, &survivors, Reach::Kill);
        let named = kill_targets(&run.watch, &targets, &survivors);
        let reason = format!(
            "{} (round {round}: {} survivors after grace)",
            run.opts.reason,
            survivors.len()
        );
        // The first round's authorization also moves the tree to `killing`,
        // in its own transaction: no commit between it and the SIGKILL.
        crate::testhook::crash_point("before-authorize");
        let auth = match self.ledger.authorize_kill_after_snapshot(
            run.tree,
            run.watch.journal(),
            &forensic,
            taken_at,
            &named,
            &reason,
            (round == 1).then_some(TreeState::Killing),
        ) {
            Ok(auth) => {
                // Committed (FULL); its SIGKILL not yet sent.
                crate::testhook::crash_point("after-authorize");
                auth
            }
            Err(e) => {
                return State::FailClosed(FailClosed {
                    survivors,
                    forensic,
                    taken_at,
                    error: e.to_string(),
                });
            }
        };
        run.report.authorizations += 1;
        // The ledger took the authorization, and with it the journal:
        // evidence is written directly again, in order.
        run.watch.ledger_writable_again();
        // Exits found from here on are written once the tree is verified
        // empty, in one transaction, not per scan while it dies.
        run.watch.defer_exits();
        run.report.phases.push((Phase::Authorize, since.elapsed()));
        State::Kill(Kill {
            round,
            survivors,
            targets,
            auth,
        })
    }

    /// KILL: SIGKILL to exactly the authorized targets.
    fn kill(&self, run: &mut Run<'_>, k: Kill) -> Result<State, CustodyError> {
        let t0 = Instant::now();
        let _span = tracing::info_span!("teardown.phase", phase = "kill").entered();
        let Kill {
            round,
            survivors,
            targets,
            auth,
        } = k;
        self.send(
            run.tree,
            &mut run.watch,
            &targets,
            Sig::Kill,
            Some(auth),
            run.opts,
        )?;
        run.report.force_killed += survivors.len();
        if let Some(dir) = run.watch.cgroup() {
            // Thaw: one write, not waited for (`cgroup.kill` ends frozen
            // tasks too, and the verify waits for `populated 0`); a member
            // the kill did not reach must not stay frozen.
            if let Err(e) = self.host.cgroup_thaw(dir, Duration::ZERO) {
                tracing::warn!(tree = run.tree.0, error = %e, "cgroup thaw failed");
            }
        }
        // On the session boundary SIGKILL ends stopped processes too: the
        // SIGCONT (a group check and a signal) is sent by the verify only
        // if members outlive the kill.
        run.report.phases.push((Phase::Kill, t0.elapsed()));
        Ok(State::Verify(Verify {
            round,
            survivors,
            targets,
        }))
    }

    /// VERIFY: the kernel's notifications first (`populated 0` of the
    /// cgroup; the survivors' pidfds: scanning `/proc` before that only
    /// finds the dying), then targeted re-reads and one full walk, which
    /// decide. Members left: the next round.
    fn verify(&self, run: &mut Run<'_>, v: Verify) -> Result<State, CustodyError> {
        let t0 = Instant::now();
        let span = tracing::info_span!("teardown.phase", phase = "verify").entered();
        let Verify {
            round,
            survivors,
            targets,
        } = v;
        let v0 = self.host.now();
        let deadline = v0 + run.opts.verify_timeout;
        if targets.cgroup.is_some() {
            self.wait_cgroup_empty(&run.watch, deadline);
        }
        let outside: Vec<Identity> = survivors
            .iter()
            .filter(|m| !targets.cgroup_pids.contains(&m.entry.pid))
            .map(|m| Identity {
                pid: m.entry.pid,
                start_ticks: m.entry.start_ticks,
                boot_id: run.group.leader.boot_id.clone(),
            })
            .collect();
        if !outside.is_empty()
            && let Err(e) = self.host.wait_exits(&outside, deadline)
        {
            tracing::debug!(tree = run.tree.0, error = %e, "exit watches not opened");
        }
        let mut members;
        loop {
            self.collect_exits(&mut run.exits);
            // Re-read the known members until they are gone, then one full
            // walk verifies that nothing else of the tree lives.
            members = run.watch.tick_targeted(self, &run.exits).members;
            if members.is_empty() && !self.reaped_empty(&run.watch) {
                members = self.full_walk(run)?;
            }
            let now = self.host.now();
            if members.is_empty() || now >= deadline {
                break;
            }
            (run.progress)(&Progress {
                phase: Phase::Verify,
                alive: members.len(),
                grace_left: None,
                elapsed: run.started.elapsed(),
            });
            self.host.sleep(poll_interval(now - v0));
        }
        run.report.phases.push((Phase::Verify, t0.elapsed()));
        drop(span);
        if members.is_empty() {
            return Ok(State::Finish);
        }
        if run.watch.cgroup().is_none() {
            // Members outlived the kill: none stays stopped.
            self.thaw(run.tree, &mut run.watch, &run.group, &members, run.opts);
        }
        Ok(State::Freeze(Freeze {
            round: round + 1,
            members,
        }))
    }

    /// FAIL-CLOSED: the authorization was not committed. No SIGKILL; the
    /// survivors are thawed and left as evidence, the tree is ambiguous and
    /// dispatch closes. A kill we cannot prove we were authorized to send is
    /// worse than survivors we can still inspect.
    fn fail_closed(&self, run: &mut Run<'_>, f: FailClosed) -> CustodyError {
        let tree = run.tree;
        let FailClosed {
            survivors,
            forensic,
            taken_at,
            error,
        } = f;
        self.stats.authorization_failed();
        let why = format!(
            "forced kill skipped: its authority could not be written ({error}); {} survivors left alive as evidence",
            survivors.len()
        );
        let named: Vec<IdentityRecord> = survivors.iter().map(|m| run.watch.identity(m)).collect();
        // In memory at once; the thaw (a recorded SIGCONT on the session
        // boundary) and evidence writes after, each of which may wait out
        // the busy timeout.
        self.mark_ambiguous(tree.0, &why, &named, run.watch.journal());
        self.thaw(tree, &mut run.watch, &run.group, &survivors, run.opts);
        if let Some(Err(e)) = run.watch.record(
            &self.ledger,
            "survivor snapshot",
            Deferred::Survivors {
                survivors: forensic,
                taken_at: crate::ledger::timestamp(taken_at),
            },
        ) {
            tracing::warn!(tree = tree.0, error = %e, "survivor snapshot not recorded");
        }
        let _ = self.flush_deferred_exits(tree, &mut run.watch, &run.exits);
        // The marker holds the ambiguity for good; these are attempted
        // unless the ledger already refused evidence, and kept in the
        // marker's journal if not written (the next process that finds the
        // ledger writable replays it).
        self.fail_closed_trail(&mut run.watch, &why, "authority_write_failed");
        self.mark_ambiguous(tree.0, &why, &named, run.watch.journal());
        log_skipped(&run.watch);
        CustodyError::Ambiguous {
            tree: tree.0,
            reason: why,
        }
    }

    /// Members outlived every round: the tree is not provably gone.
    /// `armed`: why no forced kill was tried (the standing kill could not
    /// be cleared), flagged `disarm_failed` instead of `survivors`.
    fn survived(
        &self,
        run: &mut Run<'_>,
        members: Vec<Member>,
        armed: Option<String>,
    ) -> CustodyError {
        let tree = run.tree;
        let flag = if armed.is_some() {
            "disarm_failed"
        } else {
            "survivors"
        };
        let why =
            armed.unwrap_or_else(|| format!("{} members survived the forced kill", members.len()));
        self.stats.survivors(members.len());
        let named: Vec<IdentityRecord> = members.iter().map(|m| run.watch.identity(m)).collect();
        self.mark_ambiguous(tree.0, &why, &named, run.watch.journal());
        let _ = self.flush_deferred_exits(tree, &mut run.watch, &run.exits);
        let _ = run.watch.record(
            &self.ledger,
            "flag",
            Deferred::Flag {
                flag: flag.into(),
                at: now(),
            },
        );
        if let Some(Err(e)) = run.watch.record(
            &self.ledger,
            "state ambiguous",
            Deferred::State {
                to: TreeState::Ambiguous,
                reason: Some(why.clone()),
                at: now(),
            },
        ) {
            tracing::error!(tree = tree.0, error = %e, "ambiguous state not recorded");
        }
        self.mark_ambiguous(tree.0, &why, &named, run.watch.journal());
        log_skipped(&run.watch);
        CustodyError::Ambiguous {
            tree: tree.0,
            reason: why,
        }
    }

    /// Builds the targets of one signal step from the live members.
    fn targets(
        &self,
        watch: &TreeWatch,
        group: &GroupRecord,
        members: &[Member],
        reach: Reach,
    ) -> Targets {
        let kill = reach == Reach::Kill;
        let cgroup = watch.cgroup();
        // The tick that classified `members` read `cgroup.procs` (frozen,
        // for a kill): the same set decides who the cgroup kill reaches.
        let cgroup_pids = if kill && cgroup.is_some() {
            watch.cgroup_pids().clone()
        } else {
            HashSet::new()
        };
        let mut loose = Vec::new();
        let mut in_group = 0;
        for m in members {
            if m.entry.pgid == group.pgid {
                // With a cgroup kill, only group members outside the cgroup
                // need the group signal.
                if !(kill && cgroup_pids.contains(&m.entry.pid)) {
                    in_group += 1;
                }
                continue;
            }
            if kill && cgroup_pids.contains(&m.entry.pid) {
                continue; // cgroup.kill reaches it
            }
            loose.push(Identity {
                pid: m.entry.pid,
                start_ticks: m.entry.start_ticks,
                boot_id: group.leader.boot_id.clone(),
            });
        }
        Targets {
            group: group.clone(),
            cgroup: if kill {
                cgroup.map(std::path::Path::to_path_buf)
            } else {
                None
            },
            group_pids: group_pids(members, group.pgid),
            loose,
            in_group,
            cgroup_pids,
        }
    }

    /// Sends `sig` to a step's targets and records each signal. Returns
    /// whether the group was provably the recorded one (or empty).
    fn send(
        &self,
        tree: TreeId,
        watch: &mut TreeWatch,
        step: &Targets,
        sig: Sig,
        authorization: Option<AuthorizationId>,
        opts: &TeardownOptions,
    ) -> Result<bool, CustodyError> {
        let mut group_ok = true;
        // The step's signal records, written in one transaction at the end.
        let mut records: Vec<SignalRecord> = Vec::new();
        let mut record = |signal: &str, kind: &str, target: &str, result: &Sent| {
            records.push(SignalRecord {
                signal: signal.to_string(),
                target_kind: kind.to_string(),
                target: target.to_string(),
                result: result.to_string(),
                authorization,
            })
        };
        if let Some(dir) = step.cgroup.as_deref() {
            let result = match self.host.cgroup_kill(dir) {
                Ok(()) => Sent::Delivered,
                Err(e) => Sent::Failed(e.to_string()),
            };
            // SIGKILL on the cgroup; TERMINATE_JOB on a Windows job.
            let (signal, kind) = crate::proc::CONTAINER_KILL;
            record(signal, kind, &dir.display().to_string(), &result);
        }
        if step.in_group > 0 || step.cgroup.is_none() {
            let result = match self
                .host
                .signal_group_known(&step.group, sig, &step.group_pids)
            {
                Ok(GroupDelivery::Sent { members }) => Sent::ToMembers(members),
                Ok(GroupDelivery::Empty) => Sent::GroupEmpty,
                Ok(GroupDelivery::NotRecorded(why)) => {
                    group_ok = false;
                    if watch.degraded().is_none() {
                        self.refusal_event(tree, opts, &why);
                    }
                    Sent::Refused(why)
                }
                Err(e) => Sent::Failed(e.to_string()),
            };
            if result.was_sent() || sig != Sig::Kill {
                record(sig.name(), "group", &step.group.pgid.to_string(), &result);
            } else if step.cgroup.is_none() {
                // A SIGKILL that was not sent is recorded as skipped, not as a signal.
                let why = format!("group {}: {result}", step.group.pgid);
                let _ = watch.record(
                    &self.ledger,
                    "kill skipped",
                    Deferred::KillSkipped {
                        reason: why,
                        at: now(),
                    },
                );
            }
        }
        for id in &step.loose {
            // Through the handle held since the member was first found
            // loose, where there is one: it reaches that process or none,
            // whoever lists with its identity now.
            let delivery = match watch.held(&id.key()) {
                Some(held) => self.host.signal_held(held, sig),
                None => self.host.signal_process(id, sig),
            };
            let result = match delivery {
                Ok(Delivery::Sent) => Sent::Delivered,
                Ok(Delivery::Gone) => Sent::Gone,
                Ok(Delivery::Recycled) => Sent::Refused("pid recycled".into()),
                Err(e) => Sent::Failed(e.to_string()),
            };
            if result.was_sent() || sig != Sig::Kill {
                record(sig.name(), "pid", &id.pid.to_string(), &result);
            }
        }
        if !records.is_empty()
            && let Some(Err(e)) = watch.record(
                &self.ledger,
                "signals",
                Deferred::Signals {
                    signals: records,
                    at: now(),
                },
            )
        {
            tracing::error!(
                tree = tree.0,
                signal = sig.name(),
                error = %e,
                "signals not recorded"
            );
        }
        Ok(group_ok)
    }

    /// Writes the exits the verifying scans found since the kill
    /// authorization ([`TreeWatch::defer_exits`]), each with the status the
    /// reaper collected for its pid if the scan did not have it yet.
    /// Returns what it took from the reaper, for the exits recorded after it.
    fn flush_deferred_exits(
        &self,
        tree: TreeId,
        watch: &mut TreeWatch,
        exits: &HashMap<i32, crate::proc::ExitStatus>,
    ) -> HashMap<i32, crate::proc::ExitStatus> {
        let mut fresh: HashMap<i32, crate::proc::ExitStatus> = HashMap::new();
        self.collect_exits(&mut fresh);
        let mut gone = watch.take_deferred_exits();
        if gone.is_empty() {
            return fresh;
        }
        let orphans_until = self.orphans_deadline(tree);
        for (id, exit) in &mut gone {
            if exit.is_none() {
                *exit = fresh
                    .get(&id.pid)
                    .or_else(|| exits.get(&id.pid))
                    .copied()
                    .or_else(|| {
                        self.reaped_exit(
                            id.pid,
                            id.start_ticks,
                            watch.is_root(id.pid, id.start_ticks) && self.was_spawned_here(tree),
                            orphans_until,
                        )
                    })
                    .map(|s| self.exit_of(id.pid, s));
            }
        }
        if let Some(Err(e)) = watch.evidence("member exits", || {
            self.ledger
                .record_exits(tree, &gone, self.unknown_reaper(tree))
        }) {
            tracing::warn!(tree = tree.0, error = %e, "member exits not recorded");
        }
        fresh
    }

    /// The trail of a teardown that failed closed: `kill.skipped` with its
    /// reason, the flag, and the state `ambiguous` (each kept in the
    /// journal when the ledger does not take it).
    fn fail_closed_trail(&self, watch: &mut TreeWatch, why: &str, flag: &str) {
        let at = now();
        let _ = watch.record(
            &self.ledger,
            "kill skipped",
            Deferred::KillSkipped {
                reason: why.to_string(),
                at: at.clone(),
            },
        );
        let _ = watch.record(
            &self.ledger,
            "flag",
            Deferred::Flag {
                flag: flag.to_string(),
                at: at.clone(),
            },
        );
        let _ = watch.record(
            &self.ledger,
            "state ambiguous",
            Deferred::State {
                to: TreeState::Ambiguous,
                reason: Some(why.to_string()),
                at,
            },
        );
    }

    /// Writes what this teardown's watch could not write earlier (the
    /// ledger refused, then took writes again: the authorization or the end
    /// got through), before the tree's end.
    fn flush_journal(&self, tree: TreeId, watch: &mut TreeWatch) {
        let journal = watch.take_journal();
        if journal.is_empty() {
            return;
        }
        if let Err(e) = self
            .ledger
            .replay_deferred(tree, &journal, &super::markers::new_batch())
        {
            tracing::error!(tree = tree.0, writes = journal.len(), error = %e, "deferred evidence of this teardown not written");
        }
    }

    fn refusal_event(&self, tree: TreeId, opts: &TeardownOptions, why: &str) {
        let result = if opts.origin == Origin::Sweep {
            let refused = Event::SweepRefused(event::Reason {
                reason: why.to_string(),
            });
            self.ledger.append_event(Some(tree), refused)
        } else {
            self.ledger.kill_skipped(tree, why).map(|_| 0)
        };
        if let Err(e) = result {
            tracing::warn!(tree = tree.0, error = %e, "refusal not recorded");
        }
    }

    /// Freezes what the next step will kill: the cgroup, or SIGSTOP to the
    /// group and the loose members.
    fn freeze(
        &self,
        tree: TreeId,
        watch: &mut TreeWatch,
        group: &GroupRecord,
        members: &[Member],
        opts: &TeardownOptions,
    ) -> Result<(), String> {
        if let Some(dir) = watch.cgroup() {
            // From here on only the authorized kill may end the tree: a
            // standing kill still set would end it, unrecorded, when the
            // container's last handle closes (a `run` that exits 125).
            if let Err(e) = self.host.disarm_standing_kill(dir) {
                return Err(format!(
                    "forced kill skipped: the container's standing kill could not be cleared ({e}); {} members not killed",
                    members.len()
                ));
            }
            if let Err(e) = self.host.cgroup_freeze(dir, Duration::from_secs(1)) {
                tracing::warn!(tree = tree.0, error = %e, "cgroup freeze failed");
            }
            return Ok(());
        }
        self.group_step(tree, watch, group, members, Sig::Stop, opts);
        Ok(())
    }

    /// On every error exit of a teardown: the container's standing kill is
    /// cleared (again), so the survivors the record calls alive are not
    /// killed behind its back when this process's exit closes the
    /// container (Windows' `KILL_ON_JOB_CLOSE`; nothing on Linux).
    fn disarm_again(&self, run: &Run<'_>) {
        if let Some(dir) = run.watch.cgroup()
            && let Err(e) = self.host.disarm_standing_kill(dir)
        {
            tracing::error!(tree = run.tree.0, error = %e, "standing kill not cleared on the teardown's error exit: the container's close may end its members");
        }
    }

    /// Undoes [`Engine::freeze`]: thaws the cgroup, or SIGCONT to the group
    /// and the loose members.
    fn thaw(
        &self,
        tree: TreeId,
        watch: &mut TreeWatch,
        group: &GroupRecord,
        members: &[Member],
        opts: &TeardownOptions,
    ) {
        if let Some(dir) = watch.cgroup() {
            if let Err(e) = self.host.cgroup_thaw(dir, Duration::from_secs(1)) {
                tracing::warn!(tree = tree.0, error = %e, "cgroup thaw failed");
            }
            return;
        }
        self.group_step(tree, watch, group, members, Sig::Cont, opts);
    }

    /// SIGSTOP/SIGCONT are signals like the others: sent and recorded by
    /// the same step as SIGTERM (DESIGN: the ledger holds every signal).
    fn group_step(
        &self,
        tree: TreeId,
        watch: &mut TreeWatch,
        group: &GroupRecord,
        members: &[Member],
        sig: Sig,
        opts: &TeardownOptions,
    ) {
        let targets = self.targets(watch, group, members, Reach::Signal);
        if let Err(e) = self.send(tree, watch, &targets, sig, None, opts) {
            tracing::warn!(tree = tree.0, error = %e, signal = sig.name(), "freeze step failed");
        }
    }

    /// Waits for the kernel's `populated 0` of the tree's cgroup, or
    /// `deadline`. Only a hint: the caller verifies by scan whatever this
    /// says.
    fn wait_cgroup_empty(&self, watch: &TreeWatch, deadline: Instant) {
        let Some(dir) = watch.cgroup() else { return };
        if let Err(e) = self.host.cgroup_wait_empty(dir, deadline) {
            tracing::debug!(tree = watch.tree().0, error = %e, "cgroup.events not readable");
        }
    }

    fn collect_exits(&self, exits: &mut HashMap<i32, crate::proc::ExitStatus>) {
        exits.extend(self.host.unclaimed_exits());
    }

    fn finish(
        &self,
        tree: TreeId,
        watch: &mut TreeWatch,
        opts: &TeardownOptions,
        mut report: TeardownReport,
        started: Instant,
        exits: &HashMap<i32, crate::proc::ExitStatus>,
    ) -> Result<TeardownReport, CustodyError> {
        report.verified = Some(started.elapsed());
        let t0 = Instant::now();
        self.flush_journal(tree, watch);
        let fresh = self.flush_deferred_exits(tree, watch, exits);
        self.record_final_exits(tree, watch, opts, fresh);
        log_skipped(watch);
        report.evidence_skipped = watch.skipped_writes();
        // The root's status also when this teardown killed it: this process
        // spawned it (run, serve), so its reaper has it.
        let exit = match (watch.root_pid(), self.root_status(watch, opts)) {
            (Some(root), Some(s)) => Some(self.exit_of(root, s)),
            (None, Some(s)) => Some(exit_record(s)),
            (_, None) => None,
        };
        // What it consumed, read from its cgroup before the cgroup goes,
        // and an OOM kill no tick recorded yet (the one that ended it).
        // Without a cgroup: the CPU of the members this process reaped
        // (their rusage, each with its waited-for children's), where any.
        watch.note_oom_kills(self);
        let resources = match watch.cgroup() {
            Some(dir) => Some(resources_of(dir)),
            None => self
                .reaped_cpu(tree, watch.root_pid(), exit.as_ref())
                .map(|cpu| crate::ledger::Resources {
                    cpu_usec: Some(cpu),
                    ..Default::default()
                }),
        };
        report.resources = resources;
        let state = self.close(tree, TreeState::Ended, exit, resources)?;
        self.forget_ambiguous(tree.0);
        if let Some(dir) = watch.cgroup() {
            remove_cgroup(self.host(), dir);
        }
        report.phases.push((Phase::Record, t0.elapsed()));
        report.state = state;
        report.elapsed = started.elapsed();
        Ok(report)
    }

    /// Ends the tree as `state` and returns the state it is in now. A tree
    /// someone else ended first (a concurrent `kill`) stays as it is; one an
    /// operator resolved leaving survivors stays `resolved` and is flagged
    /// `survivors_ended` (terminal states are final).
    fn close(
        &self,
        tree: TreeId,
        state: TreeState,
        exit: Option<crate::ledger::ExitRecord>,
        resources: Option<crate::ledger::Resources>,
    ) -> Result<TreeState, CustodyError> {
        match self.ledger.end_tree_with(tree, state, exit, resources) {
            Ok(()) => Ok(state),
            Err(e) => match self.ledger.tree(tree) {
                Ok(Some(row)) if row.has_survivors_left() => {
                    self.ledger.add_flag(tree, "survivors_ended")?;
                    Ok(row.state)
                }
                Ok(Some(row)) if row.state.is_terminal() => Ok(row.state),
                _ => Err(e.into()),
            },
        }
    }

    /// The root's exit status: the caller's (it reaped it), else the
    /// reaper's when this process spawned the root.
    fn root_status(
        &self,
        watch: &TreeWatch,
        opts: &TeardownOptions,
    ) -> Option<crate::proc::ExitStatus> {
        opts.root_exit.or_else(|| {
            let pid = watch.root_pid()?;
            self.reaped_exit(
                pid,
                watch.root_start_ticks(),
                self.was_spawned_here(watch.tree()),
                None,
            )
        })
    }

    /// The tree is verified empty: every member seen alive and not yet
    /// recorded as exited has exited (with its status when we reaped it).
    /// One transaction; the members are not read back into memory (the
    /// exits the teardown's scans found are written just before, by
    /// [`Self::flush_deferred_exits`], or were written per scan before the
    /// kill authorization). `exits` holds the statuses that call already
    /// took from the reaper; whatever it reaped since is added.
    fn record_final_exits(
        &self,
        tree: TreeId,
        watch: &mut TreeWatch,
        opts: &TeardownOptions,
        mut exits: HashMap<i32, crate::proc::ExitStatus>,
    ) {
        self.collect_exits(&mut exits);
        let root = watch.root_pid();
        let mut statuses: Vec<(i32, crate::ledger::ExitRecord)> = exits
            .iter()
            .filter(|(pid, _)| Some(**pid) != root)
            .map(|(pid, s)| (*pid, self.exit_of(*pid, *s)))
            .collect();
        if let (Some(root), Some(status)) = (root, self.root_status(watch, opts)) {
            statuses.push((root, self.exit_of(root, status)));
        }
        if let Some(Err(e)) = watch.evidence("final member exits", || {
            self.ledger
                .record_remaining_exits(tree, &statuses, self.unknown_reaper(tree))
        }) {
            tracing::warn!(tree = tree.0, error = %e, "final member exits not recorded");
        }
    }

    fn refuse(
        &self,
        tree: TreeId,
        cgroup: Option<&std::path::Path>,
        opts: &TeardownOptions,
        why: &str,
        mut report: TeardownReport,
        started: Instant,
    ) -> Result<TeardownReport, CustodyError> {
        self.refusal_event(tree, opts, why);
        let state = self.close(tree, TreeState::Vanished, None, None)?;
        // Every terminal path leaves no empty cgroup behind.
        if let Some(dir) = cgroup {
            remove_cgroup(self.host(), dir);
        }
        report.state = state;
        report.elapsed = started.elapsed();
        Ok(report)
    }
}

/// A held teardown lease. Dropping it unlinks the lock file while the lock
/// is still held, then closes (unlocks) it: no file per tree outlives its
/// teardown, and a waiter that locks the unlinked file sees that it is no
/// longer at the path ([`Lease::still_at`]) and starts over.
pub(crate) struct Lease {
    /// Held open for its lock; closing it unlocks.
    _locked: std::fs::File,
    path: std::path::PathBuf,
}

impl Lease {
    /// Whether `file` is still the file at `path` (same device and inode).
    #[cfg(unix)]
    fn still_at(file: &std::fs::File, path: &std::path::Path) -> bool {
        use std::os::unix::fs::MetadataExt;
        match (file.metadata(), std::fs::metadata(path)) {
            (Ok(held), Ok(named)) => held.dev() == named.dev() && held.ino() == named.ino(),
            _ => false,
        }
    }
}

impl Lease {
    /// Whether `file` is still the file at `path` (same volume and file
    /// index), not only whether the path exists (NTFS with POSIX delete
    /// semantics frees the name of a file removed while open).
    #[cfg(windows)]
    fn still_at(file: &std::fs::File, path: &std::path::Path) -> bool {
        crate::proc::same_file(file, path)
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_file(&self.path)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(path = %self.path.display(), error = %e, "teardown lease file not removed");
        }
        // `_locked` closes after this body: the unlock comes after the unlink.
    }
}

/// A cgroup's usage, in the ledger's terms.
pub(crate) fn resources_of(dir: &std::path::Path) -> crate::ledger::Resources {
    let u = crate::proc::cgroup_usage(dir);
    crate::ledger::Resources {
        cpu_usec: u.cpu_usec,
        memory_peak_bytes: u.memory_peak_bytes,
        pids_peak: u.pids_peak,
        io_read_bytes: u.io_read_bytes,
        io_write_bytes: u.io_write_bytes,
        oom_kills: u.oom_kills,
    }
}

/// The time of a fact, as the ledger writes times.
fn now() -> String {
    crate::ledger::timestamp(SystemTime::now())
}

/// How long a teardown waits for another one of the same tree to finish.
pub const LEASE_WAIT: Duration = Duration::from_secs(60);

/// The members in the recorded group, by pid and start (the group check's
/// candidates).
fn group_pids(members: &[Member], pgid: i32) -> Vec<crate::proc::ProcKey> {
    members
        .iter()
        .filter(|m| m.entry.pgid == pgid)
        .map(|m| crate::proc::ProcKey::new(m.entry.pid, m.entry.start_ticks))
        .collect()
}

fn log_skipped(watch: &TreeWatch) {
    if watch.skipped_writes() > 0 {
        tracing::warn!(
            tree = watch.tree().0,
            skipped = watch.skipped_writes(),
            reason = watch.degraded().unwrap_or(""),
            "evidence writes skipped in this teardown: the ledger refused writes (findings kept in memory; the unsettled marker and the next sweep carry them)"
        );
    }
}

/// The authorization names every target with the identities it will reach.
fn kill_targets(watch: &TreeWatch, step: &Targets, survivors: &[Member]) -> Vec<KillTarget> {
    let ids = |filter: &dyn Fn(&Member) -> bool| -> Vec<IdentityRecord> {
        survivors
            .iter()
            .filter(|m| filter(m))
            .map(|m| watch.identity(m))
            .collect()
    };
    let mut targets = Vec::new();
    if let Some(dir) = step.cgroup.as_deref() {
        targets.push(KillTarget {
            // "cgroup" on Linux, "job" on Windows.
            kind: crate::proc::CONTAINER_KILL.1.into(),
            target: dir.display().to_string(),
            identities: ids(&|m| step.cgroup_pids.contains(&m.entry.pid)),
        });
    }
    if step.in_group > 0 || step.cgroup.is_none() {
        targets.push(KillTarget {
            kind: "group".into(),
            target: step.group.pgid.to_string(),
            identities: ids(&|m| m.entry.pgid == step.group.pgid),
        });
    }
    for id in &step.loose {
        targets.push(KillTarget {
            kind: "pid".into(),
            target: id.pid.to_string(),
            identities: vec![IdentityRecord {
                pid: id.pid,
                start_ticks: id.start_ticks,
                boot_id: id.boot_id.clone(),
            }],
        });
    }
    targets
}

/// Polls fast at first (most trees die within milliseconds of their
/// signal), then backs off to keep a long grace cheap.
/// How many full walks a phase tries before it stops undecided on
/// incomplete evidence ([`Engine::full_walk`]): reads that failed on
/// descriptors usually succeed once a connection or a pidfd is closed.
const INCOMPLETE_TRIES: u32 = 5;

/// How often, and how long apart, the verify asks whether the reaper has
/// reaped every child ([`Engine::reaped_empty`]): a millisecond in all.
const REAP_TRIES: usize = 5;
const REAP_PAUSE: Duration = Duration::from_micros(200);

fn poll_interval(elapsed: Duration) -> Duration {
    if elapsed < Duration::from_millis(50) {
        Duration::from_millis(2)
    } else if elapsed < Duration::from_secs(1) {
        Duration::from_millis(10)
    } else {
        Duration::from_millis(50)
    }
}

/// Removes a tree's cgroup once the kernel has let go of it (rmdir fails
/// with EBUSY while dying tasks are still accounted to it).
pub(crate) fn remove_cgroup(host: &dyn super::Host, dir: &std::path::Path) {
    match host.remove_cgroup_when_empty(dir, Duration::from_secs(2)) {
        Ok(true) => {}
        Ok(false) => {
            tracing::warn!(cgroup = %dir.display(), "cgroup still populated; left in place");
        }
        Err(e) => tracing::warn!(cgroup = %dir.display(), error = %e, "cgroup not removed"),
    }
}

#[cfg(test)]
mod tests {
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
