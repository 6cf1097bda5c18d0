//! Owning one tree from start to end: what `treewarden run` does, and the
//! custodian of a tree that outlives its root.
//!
//! The owner spawns the tree, scans it on an interval, and tears the whole
//! tree down when the root exits, on timeout, on SIGINT/SIGTERM/SIGHUP, or
//! (with `die_with_parent`) when its own parent dies. Events arrive on one
//! channel from small threads (the root's waiter, the signal iterator), so
//! the loop reacts at once, not at the next scan tick. What an event means
//! for the tree (kept, or torn down and why) is [`OwnerWatch`]'s to say
//! (`machine.rs`, no IO), the machine the service's watch tasks drive too.

use std::collections::HashMap;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde::Serialize;

mod machine;

pub use machine::{Action, OwnerWatch, Watched};

use super::observer::{Observer, ObserverStats};
use super::policy::{self, EndCause};
use super::spawn::SpawnRequest;
use super::teardown::{Origin, Progress, TeardownReport};
use super::watch::TreeWatch;
use super::{CustodyError, Engine};
use crate::config::ObserverMode;
use crate::ledger::TreeId;
use crate::proc::ExitStatus;

/// How `run` owns its tree.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// Resolved by the policy ([`super::policy::Grace::resolve`]).
    pub grace: super::policy::Grace,
    pub timeout: Option<Duration>,
    pub scan_interval: Duration,
    /// End the tree when the parent *process* of `run` exits (never when
    /// only the thread that spawned `run` does).
    pub die_with_parent: bool,
    /// End the tree when this process exits (`--owner-pid`): the process on
    /// whose behalf a hub runs the wrapper. Checked by the caller: it exists
    /// and the caller may signal it.
    pub owner: Option<crate::proc::Identity>,
    /// Whether to run the proc-connector observer beside the scans.
    pub observer: ObserverMode,
    /// Its socket's receive buffer (0: the default).
    pub observer_rcvbuf: usize,
    /// The teardown's first signal (`--signal`; SIGTERM by default).
    pub first_signal: crate::proc::Sig,
    /// Whether the tree ends with its root ([`Lifetime::Root`]) or lives on
    /// while anything of it runs, until its owner exits
    /// ([`Lifetime::Owner`]; `owner` names the owner then).
    pub lifetime: Lifetime,
    /// The pseudo-terminal slave the root gets as its controlling terminal
    /// and stdio (`run --tty`; the caller relays the master).
    pub tty: Option<std::path::PathBuf>,
}

/// How long a tree lives.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Lifetime {
    /// The tree ends when its root exits (what it left is torn down).
    #[default]
    Root,
    /// The root's exit is recorded and reported, and what it left running
    /// stays in custody until the owner exits, the tree is killed, or its
    /// timeout fires (background jobs a session keeps).
    Owner,
}

impl std::str::FromStr for Lifetime {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "root" => Ok(Self::Root),
            "owner" => Ok(Self::Owner),
            other => Err(format!(
                "unknown lifetime {other:?}: expected root or owner"
            )),
        }
    }
}

/// Why the tree was torn down.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RunEnd {
    RootExited(ExitStatus),
    Timeout,
    Signal(i32),
    ParentDied,
    /// The process `--owner-pid` named exited.
    OwnerDied,
}

/// What `run` did, and the exit code it maps to.
#[derive(Debug)]
pub struct RunOutcome {
    pub tree: TreeId,
    pub end: RunEnd,
    /// The teardown's report; `Ok(None)` when there was none because the
    /// root exited and the tree lives on (`--lifetime owner`): the caller
    /// hands it to a custodian ([`Engine::keep`]).
    pub teardown: Result<Option<TeardownReport>, CustodyError>,
    /// The observer's final health counters; `None` when it did not run.
    pub observer: Option<ObserverStats>,
}

impl RunOutcome {
    /// The exit code `treewarden run` returns: the root's status; 124 on
    /// timeout; 128+N when `run` itself got signal N; 125 when the teardown
    /// is ambiguous or could not be recorded.
    pub fn exit_code(&self) -> u8 {
        if self.teardown.is_err() {
            return 125;
        }
        match self.end {
            RunEnd::RootExited(status) => status.code_for_shell() as u8,
            RunEnd::Timeout => 124,
            RunEnd::Signal(n) => (128 + n) as u8,
            RunEnd::ParentDied | RunEnd::OwnerDied => (128 + crate::proc::Sig::Hup.number()) as u8,
        }
    }
}

impl RunEnd {
    /// Hands this end, as `run`'s loop saw it at `now`, to the owner's
    /// machine (which decides what it means for the tree).
    fn feed(self, owner: &mut OwnerWatch, now: Instant) -> Self {
        match self {
            RunEnd::RootExited(status) => owner.handle_root_exit(Some(status)),
            RunEnd::Timeout => owner.handle_timeout(now),
            RunEnd::Signal(n) => owner.handle_kill(Some(n)),
            RunEnd::ParentDied => owner.handle_owner_exit(Watched::Parent),
            RunEnd::OwnerDied => owner.handle_owner_exit(Watched::Owner),
        }
        self
    }
}

enum Event {
    Root(ExitStatus),
    Signal(i32),
    /// A watched owner process exited (the parent, or `--owner-pid`).
    Owner(RunEnd),
    /// The observer lost events: scan everything now.
    ForceScan,
}

/// The processes whose exit ends the tree, with the end each one means.
/// Parent death is the parent *process* gone: `PR_SET_PDEATHSIG` is not
/// used, because the kernel sends it when the parent *thread* exits (a
/// thread pool retiring the thread that spawned `run` would end the tree
/// while its owner lives). Each watch is an identity-checked pidfd, which
/// becomes readable only when the whole process has exited; the scan tick
/// re-checks each identity too (a kernel without pidfd, a missed wake-up).
fn owner_watches(opts: &RunOptions) -> Vec<(crate::proc::Identity, RunEnd)> {
    let mut out = Vec::new();
    if opts.die_with_parent {
        match crate::proc::identity_of(crate::proc::parent_pid()) {
            Ok(Some(parent)) => out.push((parent, RunEnd::ParentDied)),
            // Gone already: the watch below finds it dead at once.
            Ok(None) | Err(_) => out.push((
                crate::proc::Identity {
                    pid: crate::proc::parent_pid(),
                    start_ticks: u64::MAX,
                    boot_id: crate::proc::boot_id().unwrap_or_default().to_owned(),
                },
                RunEnd::ParentDied,
            )),
        }
    }
    if let Some(owner) = &opts.owner {
        out.push((owner.clone(), RunEnd::OwnerDied));
    }
    out
}

/// A thread per watched owner that sends [`Event::Owner`] when it exits.
fn start_owner_watches(watches: &[(crate::proc::Identity, RunEnd)], tx: &mpsc::Sender<Event>) {
    for (id, end) in watches {
        let (id, end, tx) = (id.clone(), *end, tx.clone());
        let spawned = std::thread::Builder::new()
            .name("tw-owner".into())
            .spawn(move || {
                loop {
                    // An hour at a time: `wait_exits` takes a deadline.
                    let until = Instant::now() + Duration::from_secs(3600);
                    match crate::proc::wait_exits(std::slice::from_ref(&id), until) {
                        Ok(true) => {
                            let _ = tx.send(Event::Owner(end));
                            return;
                        }
                        Ok(false) => {}
                        Err(e) => {
                            tracing::warn!(pid = id.pid, error = %e, "no pidfd for the owner: its exit is seen at scan ticks");
                            return;
                        }
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "no owner watch thread: the owner's exit is seen at scan ticks");
        }
    }
}

/// Starts the observer as `opts.observer` asks ([`policy::start_observer`]);
/// an overflow asks the run loop for a full scan.
fn start_observer(
    engine: &Engine,
    opts: &RunOptions,
    tx: &mpsc::Sender<Event>,
) -> Result<Option<Observer>, CustodyError> {
    let tx = std::sync::Mutex::new(tx.clone());
    let on_overflow = Box::new(move || {
        if let Ok(tx) = tx.lock() {
            let _ = tx.send(Event::ForceScan);
        }
    });
    policy::start_observer(
        engine.ledger(),
        opts.observer,
        opts.observer_rcvbuf,
        on_overflow,
    )
    .map(|started| started.observer)
    .map_err(|e| CustodyError::Proc(crate::proc::ProcError::Io(std::io::Error::other(e))))
}

impl Engine {
    /// Spawns `req` and owns it until it is torn down. Requires a reaper
    /// (this process must be the tree's subreaper).
    pub fn run(
        &self,
        req: &SpawnRequest,
        opts: &RunOptions,
        progress: &mut dyn FnMut(&Progress),
    ) -> Result<RunOutcome, CustodyError> {
        self.run_with(req, opts, progress, &mut |_| {})
    }

    /// [`Engine::run`], calling `recorded` with the tree's id after its
    /// spawn is committed and before the command runs.
    // Over 100 lines on purpose: from the spawn on no error may return without a teardown: the
    // spawn, the watches, the loop and the teardown in one frame keep every way out of it in
    // sight.
    pub fn run_with(
        &self,
        req: &SpawnRequest,
        opts: &RunOptions,
        progress: &mut dyn FnMut(&Progress),
        recorded: &mut dyn FnMut(TreeId),
    ) -> Result<RunOutcome, CustodyError> {
        let reaper = self.reaper.ok_or_else(|| {
            CustodyError::Conflict("run needs a reaper: this process must own its children".into())
        })?;
        let (tx, rx) = mpsc::channel::<Event>();
        // Signals first, so a SIGTERM during the spawn is not lost.
        let signals_handle = forward_signals(&tx)?;
        let watches = owner_watches(opts);
        start_owner_watches(&watches, &tx);

        // Subscribed before the spawn, so the root's first fork is seen.
        let observer = start_observer(self, opts, &tx)?;
        // The tree's grace and timeout are recorded with it: a sweep that
        // resumes its teardown after `run` died uses them.
        let req = SpawnRequest {
            grace: req.grace.or(Some(opts.grace.duration())),
            timeout: req.timeout.or(opts.timeout),
            first_signal: Some(opts.first_signal),
            ..req.clone()
        };
        let spawned =
            super::spawn::Spawner::new(self).spawn_on(&req, opts.tty.as_deref(), recorded)?;
        let tree = spawned.tree;
        if opts.lifetime == Lifetime::Owner {
            mark_lifetime_owner(&self.ledger, tree);
        }
        let obs = observer.as_ref().map(Observer::handle);
        if let Some(o) = &obs {
            o.watch(tree, spawned.pgid, spawned.sid, &spawned.root);
        }
        // From here on the tree runs: no error may return without a
        // teardown. Each failure below degrades (slower root detection, no
        // scans) instead of leaving the tree without its owner.
        {
            let tx = tx.clone();
            let root = spawned.root.pid;
            let waiter = std::thread::Builder::new()
                .name("tw-root".into())
                .spawn(move || {
                    if let Some(status) = reaper.wait_exit(root, None) {
                        let _ = tx.send(Event::Root(status));
                    }
                });
            if let Err(e) = waiter {
                tracing::error!(tree = tree.0, error = %e, "no root waiter thread: the root's exit is seen at scan ticks");
            }
        }
        let exclude = self.exclude.as_ref().clone();
        let mut watch = match self.ledger.tree(tree) {
            Ok(Some(row)) => TreeWatch::new(&row, &[], &exclude),
            other => {
                tracing::error!(tree = tree.0, read = ?other.err(), "tree row unreadable: run goes on without scans");
                None
            }
        };
        if let Some(w) = watch.as_mut() {
            w.adopt_children_of(std::process::id() as i32);
            w.set_observer(obs.clone());
        }
        // What ends the tree, and how, is the owner's machine's to say; this
        // loop waits and feeds it. Each end the loop sees ends the watch:
        // the machine says whether the tree is kept or torn down, and why.
        let deadline = opts.timeout.map(|t| Instant::now() + t);
        let mut owner = OwnerWatch::new(opts.lifetime, deadline, opts.timeout);
        let mut next_scan = Instant::now();
        // The first tick, right after the release, reads only the root (the
        // group and session leader) and the cgroup's members, and records
        // the root as a member: nothing has had time to leave the tree by
        // then, so a full walk of `/proc` would find only what this finds
        // (the teardown's full walk follows at once when the root is as
        // quick as `true`; the next ticks walk all of `/proc`).
        let mut first_tick = true;
        let end = loop {
            let now = Instant::now();
            if owner.poll_timeout().is_some_and(|d| now >= d) {
                // A root exit already queued at the deadline wins over it.
                if let Ok(Event::Root(status)) = rx.try_recv() {
                    break RunEnd::RootExited(status).feed(&mut owner, now);
                }
                break RunEnd::Timeout.feed(&mut owner, now);
            }
            if now >= next_scan {
                let exits: HashMap<i32, ExitStatus> = reaper.unclaimed().into_iter().collect();
                // The root may have exited before its waiter asked for it.
                if let Some(status) = exits.get(&spawned.root.pid) {
                    break RunEnd::RootExited(*status).feed(&mut owner, now);
                }
                if let Some(w) = watch.as_mut() {
                    if first_tick {
                        w.tick_targeted(self, &exits);
                    } else {
                        w.tick(self, &exits);
                    }
                }
                first_tick = false;
                if let Some((_, end)) = watches.iter().find(|(id, _)| !self.host().still_alive(id))
                {
                    break end.feed(&mut owner, now);
                }
                next_scan = now + opts.scan_interval;
            }
            let mut wait = next_scan.saturating_duration_since(Instant::now());
            if let Some(d) = owner.poll_timeout() {
                wait = wait.min(d.saturating_duration_since(Instant::now()));
            }
            let now = Instant::now();
            match rx.recv_timeout(wait) {
                Ok(Event::Root(status)) => break RunEnd::RootExited(status).feed(&mut owner, now),
                Ok(Event::Owner(end)) => break end.feed(&mut owner, now),
                Ok(Event::Signal(sig)) => break RunEnd::Signal(sig).feed(&mut owner, now),
                Ok(Event::ForceScan) => {
                    // A lost event must not become a silent gap: scan now.
                    if let Some(w) = watch.as_mut() {
                        let exits: HashMap<i32, ExitStatus> =
                            reaper.unclaimed().into_iter().collect();
                        let r = w.tick(self, &exits);
                        tracing::warn!(
                            tree = tree.0,
                            members = r.members.len(),
                            new_escapes = r.new_escapes,
                            "forced full scan after observer overflow"
                        );
                    }
                    if let Some(o) = &obs {
                        o.forced_scan_done();
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    break RunEnd::Signal(libc::SIGTERM).feed(&mut owner, now);
                }
            }
        };

        // `--lifetime owner`: the root's exit is recorded, and while
        // anything of the tree lives it is kept (handed to a custodian by
        // the caller) instead of torn down.
        if let (RunEnd::RootExited(status), true) = (end, owner.is_kept()) {
            let mut exits: HashMap<i32, ExitStatus> = reaper.unclaimed().into_iter().collect();
            exits.insert(spawned.root.pid, status);
            // No watch: unknown, kept; the custodian's scans decide.
            let empty = watch
                .as_mut()
                .map(|w| w.tick(self, &exits).members.is_empty());
            owner.handle_tick(empty);
        }
        let cause = match owner.poll() {
            Action::TearDown(cause) => cause,
            Action::Keep => {
                let status = match end {
                    RunEnd::RootExited(s) => Some(s),
                    _ => None,
                };
                self.record_root_exit_kept(tree, &spawned.root, status);
                signals_handle.close();
                let observer = observer.map(|o| o.stop());
                return Ok(RunOutcome {
                    tree,
                    end,
                    teardown: Ok(None),
                    observer,
                });
            }
        };
        let mut topts = cause.teardown_options(opts.grace, Origin::Run);
        topts.first_signal = opts.first_signal;
        topts.observer = obs;
        let teardown = self.teardown(tree, &topts, progress).map(Some);
        signals_handle.close();
        let observer = observer.map(|o| {
            let stats = o.stop();
            tracing::info!(
                tree = tree.0,
                events = stats.events,
                forks = stats.forks_attributed,
                overflows = stats.overflows,
                forced_scans = stats.forced_scans,
                escapes = stats.escapes_recorded,
                scan_found_unobserved = stats.scan_found_unobserved,
                last_latency = ?stats.last_detection_latency,
                p50_us = stats.latency_quantile(0.5).map(|d| d.as_micros() as u64).unwrap_or(0),
                p99_us = stats.latency_quantile(0.99).map(|d| d.as_micros() as u64).unwrap_or(0),
                "observer stats"
            );
            stats
        });
        Ok(RunOutcome {
            tree,
            end,
            teardown,
            observer,
        })
    }
}

/// How a custodian keeps a tree whose root exited (`--lifetime owner`).
#[derive(Clone, Debug)]
pub struct KeepOptions {
    /// The owner: the tree is torn down when it exits.
    pub owner: crate::proc::Identity,
    /// When the tree's timeout fires (`None`: no timeout).
    pub deadline: Option<Instant>,
    pub scan_interval: Duration,
    pub grace: super::policy::Grace,
    pub first_signal: crate::proc::Sig,
}

/// Why a kept tree ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum KeepEnd {
    OwnerDied,
    Timeout,
    Signal(i32),
    /// Nothing of the tree was left running.
    Empty,
}

/// Flags a tree [`TreeFlag::LifetimeOwner`] (best effort, logged): all it needs
/// is the ledger.
pub fn mark_lifetime_owner(ledger: &crate::ledger::Ledger, tree: TreeId) {
    if let Err(e) = ledger.add_flag(tree, crate::ledger::TreeFlag::LifetimeOwner) {
        tracing::warn!(tree = tree.0, error = %e, "lifetime_owner flag not recorded");
    }
}

impl Engine {
    /// Records that a kept tree's root exited (`member.exited`, with its
    /// status when this process reaped it) and flags the tree
    /// [`TreeFlag::RootExited`]. Best effort: a refused write is logged (the
    /// tree stays in custody either way).
    pub fn record_root_exit_kept(
        &self,
        tree: TreeId,
        root: &crate::proc::Identity,
        status: Option<ExitStatus>,
    ) {
        let record = super::spawn::identity_record(root);
        let exit = status.map(|s| self.reaped().exit_of(root.pid, s));
        if let Err(e) = self.ledger.record_exits(tree, &[(record, exit)], "parent") {
            tracing::warn!(tree = tree.0, error = %e, "the root's exit not recorded");
        }
        if let Err(e) = self
            .ledger
            .add_flag(tree, crate::ledger::TreeFlag::RootExited)
        {
            tracing::warn!(tree = tree.0, error = %e, "root_exited flag not recorded");
        }
    }

    /// Whether nothing of the tree runs now (one full walk): a kept tree
    /// whose members all exited ends. Unreadable counts as not empty.
    pub fn tree_empty_now(&self, tree: TreeId) -> bool {
        let Ok(Some((row, members))) = self.ledger.tree_members(tree) else {
            return false;
        };
        let exclude = self.exclude.as_ref().clone();
        TreeWatch::new(&row, &members, &exclude)
            .is_some_and(|mut w| w.tick(self, &HashMap::new()).members.is_empty())
    }

    /// Keeps a tree whose root exited until its owner exits, its timeout
    /// fires, this process gets SIGINT/SIGTERM/SIGHUP, or nothing of it is
    /// left; then tears it down with the same authority rules. What `run
    /// --lifetime owner` hands the tree to (the `custody` subcommand), so
    /// `run` can return the root's status at once. Needs no reaper: the
    /// members are not its children, and the teardown verifies by a full walk.
    pub fn keep(
        &self,
        tree: TreeId,
        opts: &KeepOptions,
        progress: &mut dyn FnMut(&Progress),
    ) -> Result<(KeepEnd, TeardownReport), CustodyError> {
        let (tx, rx) = mpsc::channel::<Event>();
        let signals_handle = forward_signals(&tx)?;
        start_owner_watches(&[(opts.owner.clone(), RunEnd::OwnerDied)], &tx);
        let (row, members) = self
            .ledger
            .tree_members(tree)?
            .ok_or(CustodyError::UnknownTree(tree))?;
        let exclude = self.exclude.as_ref().clone();
        let mut watch = TreeWatch::new(&row, &members, &exclude);
        let none = HashMap::new();
        let mut owner = OwnerWatch::kept(None, opts.deadline, None);
        let cause = loop {
            owner.handle_timeout(Instant::now());
            if owner.poll() == Action::Keep && !self.host().still_alive(&opts.owner) {
                owner.handle_owner_exit(Watched::Owner);
            }
            if owner.poll() == Action::Keep
                && let Some(w) = watch.as_mut()
            {
                owner.handle_tick(Some(w.tick(self, &none).members.is_empty()));
            }
            if let Action::TearDown(cause) = owner.poll() {
                break cause;
            }
            let mut wait = opts.scan_interval;
            if let Some(d) = owner.poll_timeout() {
                wait = wait.min(d.saturating_duration_since(Instant::now()));
            }
            match rx.recv_timeout(wait) {
                Ok(Event::Owner(_)) => owner.handle_owner_exit(Watched::Owner),
                Ok(Event::Signal(n)) => owner.handle_kill(Some(n)),
                Ok(_) | Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => owner.handle_kill(Some(libc::SIGTERM)),
            }
            if let Action::TearDown(cause) = owner.poll() {
                break cause;
            }
        };
        let end = match cause {
            // A kept tree left empty ends as its root's exit.
            EndCause::RootExited(_) => KeepEnd::Empty,
            EndCause::Timeout(_) => KeepEnd::Timeout,
            EndCause::Signal(n) => KeepEnd::Signal(n),
            // The owner's exit: the custodian feeds no other end.
            _ => KeepEnd::OwnerDied,
        };
        let reason = match end {
            KeepEnd::OwnerDied => EndCause::OwnerExited.reason(),
            KeepEnd::Timeout => EndCause::Timeout(Duration::ZERO).reason(),
            KeepEnd::Signal(n) => {
                format!("the custodian of a tree whose root exited received signal {n}")
            }
            KeepEnd::Empty => "every member exited (the root exited earlier)".to_string(),
        };
        let mut topts = super::teardown::TeardownOptions::new(opts.grace, reason, Origin::Run);
        topts.first_signal = opts.first_signal;
        let report = self.teardown(tree, &topts, progress);
        signals_handle.close();
        Ok((end, report?))
    }
}

/// SIGINT, SIGTERM and SIGHUP (Windows: the console's Ctrl+C, Ctrl+Break
/// and close) as [`Event::Signal`]s on `tx`, from a thread of their own
/// (run's loop and the custodian's both end on them) until the handle is
/// closed.
fn forward_signals(tx: &mpsc::Sender<Event>) -> Result<crate::proc::CtrlForward, CustodyError> {
    let tx = tx.clone();
    crate::proc::forward_console_ctrl(Box::new(move |sig| {
        let _ = tx.send(Event::Signal(sig));
    }))
    .map_err(CustodyError::Proc)
}

#[cfg(test)]
mod tests {
    use crate::custody::Host;
    use crate::custody::fake::{BOOT, FakeHost, FakeProc, stranger};
    use crate::proc::{ExitStatus, Identity};

    fn identity((pid, start_ticks): (i32, u64)) -> Identity {
        Identity {
            pid,
            start_ticks,
            boot_id: BOOT.into(),
        }
    }

    /// The one liveness rule of an owner: one that has exited is gone,
    /// reaped or not (a zombie), as is one whose pid names a later process;
    /// one that runs is alive.
    #[test]
    fn an_owner_that_exited_is_gone_reaped_or_not() {
        let host = FakeHost::new(true);
        let live = identity(host.world().spawn(stranger(0)));
        let zombie = identity(host.world().spawn(FakeProc {
            state: 'Z',
            ..stranger(0)
        }));
        let reaped = identity(host.world().spawn(stranger(0)));
        host.world().exit(reaped.pid, ExitStatus::Exited(0));
        let recycled = identity(host.world().spawn(stranger(0)));
        host.world().recycle(recycled.pid).expect("recycled");
        assert!(host.still_alive(&live));
        assert!(!host.still_alive(&zombie), "a zombie owner is gone");
        assert!(!host.still_alive(&reaped));
        assert!(!host.still_alive(&recycled));
    }
}
