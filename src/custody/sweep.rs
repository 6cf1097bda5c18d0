//! The orphan sweep: every non-terminal tree whose owner is gone is torn
//! down with the same teardown and authority rules, resuming from the state
//! the ledger holds (an owner killed half-way through its teardown leaves
//! `terminating` or `killing`).
//!
//! An owner is gone when its pid is dead or now belongs to a process that
//! started later; an owner whose start time cannot be read counts as alive.
//!
//! Orphans are torn down concurrently, at most [`SweepOptions::concurrency`]
//! at a time (one thread each: a teardown sleeps through its grace), each
//! with the grace recorded on its tree row, so recovering N orphans takes
//! about one grace, not N of them. Every ledger write of a teardown is its
//! own short transaction on the ledger's owner thread, so concurrent
//! teardowns interleave instead of waiting for each other. The per-tree
//! teardown lease still holds: a tree is never torn down by two processes
//! (or two threads) at once.
//!
//! The sweep never stops a teardown it started. A stop flag
//! ([`SweepOptions::stop`], the service's shutdown) only keeps it from
//! starting more: the trees left are orphans still, in the state the ledger
//! records, and the next sweep takes them.

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;

use super::policy::Grace;
use super::teardown::{Origin, TeardownOptions};
use super::{CustodyError, Engine};
use crate::ledger::{Event, TreeId, TreeRow, TreeState, event};

/// Teardowns a sweep runs at once unless told otherwise (`--sweep-concurrency`).
pub const DEFAULT_SWEEP_CONCURRENCY: usize = 64;

/// What happened to one orphan.
#[derive(Clone, Debug, Serialize)]
pub struct SweepOutcome {
    pub tree: TreeId,
    pub from: TreeState,
    pub to: Option<TreeState>,
    /// The grace its teardown used (the tree's recorded one, else the default).
    pub grace_ms: u64,
    pub error: Option<String>,
}

/// One sweep's findings.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SweepReport {
    /// Non-terminal trees looked at.
    pub examined: usize,
    /// Of those, trees whose owner is alive (left untouched).
    pub owned: usize,
    pub orphans: Vec<SweepOutcome>,
}

impl SweepReport {
    /// Whether every orphan reached a terminal state.
    pub fn settled(&self) -> bool {
        self.orphans.iter().all(|o| o.error.is_none())
    }
}

/// How a sweep runs.
#[derive(Clone, Debug)]
pub struct SweepOptions {
    /// The grace of an orphan whose row records none (trees recorded
    /// before migration 0002).
    pub default_grace: Duration,
    /// Teardowns in flight at once (at least one).
    pub concurrency: usize,
    /// Trees left alone: the service's own, whose owners it watches itself.
    pub skip: HashSet<TreeId>,
    /// Counters the caller reads while the sweep runs (the service's
    /// `/readyz`, dashboard and `treewarden_orphans_pending`).
    pub progress: Option<Arc<SweepProgress>>,
    /// Once set, no further teardown starts; those running finish.
    pub stop: Option<Arc<AtomicBool>>,
    /// At most this many orphans per sweep (the rest wait for the next):
    /// the bound of the sweeps `run`, `ls` and `kill` make on the way.
    pub limit: Option<usize>,
    /// Only orphans whose teardown failed closed (ambiguous in the ledger,
    /// or named by an unsettled marker): what must be finished before a
    /// dispatch decision.
    pub only_failed_closed: bool,
    /// The grace of an orphan whose teardown failed closed: that teardown
    /// already gave its members their grace before it could not authorize
    /// the kill. `None`: its recorded grace, as for any orphan.
    pub failed_closed_grace: Option<Duration>,
    /// Whether a sweep that finds no orphan records `sweep.started` (the
    /// opportunistic sweeps do not: they would write on every `run`).
    pub record_when_none: bool,
}

impl SweepOptions {
    pub fn new(default_grace: Duration) -> Self {
        Self {
            default_grace,
            concurrency: DEFAULT_SWEEP_CONCURRENCY,
            skip: HashSet::new(),
            progress: None,
            stop: None,
            limit: None,
            only_failed_closed: false,
            failed_closed_grace: None,
            record_when_none: true,
        }
    }

    /// The opportunistic sweep of a command on its way (`run`, `ls`,
    /// `kill`): at most `limit` orphans, nothing recorded when none is found.
    pub fn opportunistic(default_grace: Duration, limit: usize) -> Self {
        Self {
            limit: Some(limit),
            concurrency: limit.max(1),
            record_when_none: false,
            ..Self::new(default_grace)
        }
    }
}

/// Live counters of sweeps, cumulative over every sweep that shares them.
/// Orphans pending = found − finished.
#[derive(Debug, Default)]
pub struct SweepProgress {
    found: AtomicUsize,
    in_flight: AtomicUsize,
    settled: AtomicUsize,
    unsettled: AtomicUsize,
    not_started: AtomicUsize,
}

/// A copy of [`SweepProgress`] at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SweepCounts {
    /// Orphans found.
    pub found: usize,
    /// Teardowns running now.
    pub in_flight: usize,
    /// Orphans that reached a terminal state.
    pub settled: usize,
    /// Orphans whose teardown ended without settling them (ambiguous,
    /// lease held elsewhere, ledger refused): the next sweep tries again.
    pub unsettled: usize,
    /// Orphans left for the next sweep because the sweep was stopped.
    pub not_started: usize,
}

impl SweepCounts {
    /// Orphans found whose teardown has not finished (queued or running).
    pub fn pending(&self) -> usize {
        self.found
            .saturating_sub(self.settled + self.unsettled + self.not_started)
    }
}

impl SweepProgress {
    pub fn counts(&self) -> SweepCounts {
        SweepCounts {
            found: self.found.load(Ordering::SeqCst),
            in_flight: self.in_flight.load(Ordering::SeqCst),
            settled: self.settled.load(Ordering::SeqCst),
            unsettled: self.unsettled.load(Ordering::SeqCst),
            not_started: self.not_started.load(Ordering::SeqCst),
        }
    }
}

/// The orphan sweep over the engine: which trees are orphans or failed
/// closed, and their teardowns, a bounded number at a time.
pub struct Sweeper<'a> {
    engine: &'a Engine,
}

impl Engine {
    /// The sweep of this engine's ledger ([`Sweeper`]).
    pub fn sweeper(&self) -> Sweeper<'_> {
        Sweeper { engine: self }
    }
}

impl Sweeper<'_> {
    /// Runs one sweep now, with the default concurrency.
    pub fn sweep(&self, grace: Duration) -> Result<SweepReport, CustodyError> {
        self.sweep_with(&SweepOptions::new(grace))
    }

    /// Runs one sweep: finds the orphans, then tears them down, at most
    /// `opts.concurrency` at once, each with its recorded grace.
    pub fn sweep_with(&self, opts: &SweepOptions) -> Result<SweepReport, CustodyError> {
        let _span = tracing::info_span!("sweep").entered();
        let trees = if opts.only_failed_closed {
            self.failed_closed_candidates()?
        } else {
            self.engine.ledger.sweep_candidates()?
        };
        let mut report = SweepReport {
            examined: trees.len(),
            ..SweepReport::default()
        };
        let mut orphans = VecDeque::new();
        for row in trees {
            if opts.skip.contains(&row.id)
                || (opts.only_failed_closed && !self.failed_closed(&row))
                || self
                    .engine
                    .host()
                    .still_alive(&(&row.owner_identity()).into())
            {
                report.owned += 1;
            } else if opts.limit.is_some_and(|n| orphans.len() >= n) {
                // Left for the next sweep (counted as neither).
            } else {
                orphans.push_back(row);
            }
        }
        if orphans.is_empty() && !opts.record_when_none {
            return Ok(report);
        }
        self.engine.ledger.append_event(
            None,
            Event::SweepStarted(event::SweepStarted {
                candidates: report.examined as u64,
                pid: std::process::id(),
            }),
        )?;
        if let Some(p) = &opts.progress {
            p.found.fetch_add(orphans.len(), Ordering::SeqCst);
        }
        let workers = opts.concurrency.max(1).min(orphans.len());
        if workers > 0 {
            tracing::info!(
                orphans = orphans.len(),
                concurrency = workers,
                "sweep: tearing orphans down"
            );
        }
        let queue = Mutex::new(orphans);
        let done = Mutex::new(Vec::new());
        std::thread::scope(|scope| {
            let mut started = 0;
            for i in 0..workers {
                let spawned = std::thread::Builder::new()
                    .name(format!("tw-sweep-{i}"))
                    .spawn_scoped(scope, || self.sweep_worker(&queue, &done, opts));
                match spawned {
                    Ok(_) => started += 1,
                    Err(e) => {
                        tracing::warn!(error = %e, started, "sweep: no more worker threads");
                        break;
                    }
                }
            }
            if started == 0 {
                // Not even one thread: the sweep still runs, one at a time.
                self.sweep_worker(&queue, &done, opts);
            }
        });
        report.orphans = done.into_inner().unwrap_or_else(|e| e.into_inner());
        report.orphans.sort_by_key(|o| o.tree);
        self.engine.ambiguity().flush_ambiguous();
        if let Err(e) = self.engine.remove_leftover_cgroups() {
            tracing::warn!(error = %e, "leftover cgroups not checked");
        }
        Ok(report)
    }

    /// Takes orphans off the queue until it is empty.
    fn sweep_worker(
        &self,
        queue: &Mutex<VecDeque<TreeRow>>,
        done: &Mutex<Vec<SweepOutcome>>,
        opts: &SweepOptions,
    ) {
        loop {
            let Some(row) = queue.lock().unwrap_or_else(|e| e.into_inner()).pop_front() else {
                return;
            };
            let outcome = self.sweep_one(&row, opts);
            done.lock().unwrap_or_else(|e| e.into_inner()).push(outcome);
        }
    }

    /// The sweep candidates that can have failed closed, without reading
    /// every live tree: the ambiguous trees and the trees an unsettled
    /// marker names (one directory listing), each still a sweep candidate
    /// (not terminal, or resolved with survivors left). The service asks
    /// every 2 s; reading every live tree's row and opening a marker path
    /// for each was most of its idle ledger work at 2,000 trees.
    fn failed_closed_candidates(&self) -> Result<Vec<TreeRow>, CustodyError> {
        let mut trees = self.engine.ledger.ambiguous_trees()?;
        for (id, _) in super::markers::all(&self.engine.data_dir) {
            if trees.iter().any(|t| t.id == id) {
                continue;
            }
            if let Some(row) = self.engine.ledger.tree(id)?
                && (!row.state.is_terminal() || row.has_survivors_left())
            {
                trees.push(row);
            }
        }
        trees.sort_by_key(|t| t.id);
        Ok(trees)
    }

    /// Whether a tree's teardown failed closed: it could not authorize its
    /// kill and left its survivors alive (ambiguous in the ledger, or named
    /// by an unsettled marker when the ledger refused even that).
    pub(crate) fn failed_closed(&self, row: &TreeRow) -> bool {
        row.state == TreeState::Ambiguous
            || super::markers::read(&self.engine.data_dir, row.id).is_some()
    }

    /// Finishes, before a dispatch decision, the teardowns that failed
    /// closed and whose owner is gone: a fresh authorization naming exactly
    /// the survivors, SIGKILL, verify (the teardown's own steps, resumed).
    /// Their grace was spent by the teardown that failed closed, so none is
    /// given again. At most `limit` trees; `None` when there was none (or
    /// the ledger could not be read). It examines only the trees that can
    /// have failed closed (its report's `examined` counts those).
    pub fn settle_failed_closed(&self, limit: usize) -> Option<SweepReport> {
        let mut opts = SweepOptions::opportunistic(Duration::ZERO, limit);
        opts.only_failed_closed = true;
        opts.failed_closed_grace = Some(Duration::ZERO);
        self.settle_with(&opts)
    }

    /// Tears down at most `limit` orphans (owner gone) with their recorded
    /// grace: what dead wrappers left, settled by the next `run` on hosts
    /// without a sweep timer. `None` when there was none.
    pub fn settle_orphans(&self, limit: usize, default_grace: Duration) -> Option<SweepReport> {
        let mut opts = SweepOptions::opportunistic(default_grace, limit);
        opts.failed_closed_grace = Some(Duration::ZERO);
        self.settle_with(&opts)
    }

    fn settle_with(&self, opts: &SweepOptions) -> Option<SweepReport> {
        match self.sweep_with(opts) {
            Ok(r) if r.orphans.is_empty() => None,
            Ok(r) => {
                for o in &r.orphans {
                    tracing::info!(tree = o.tree.0, from = o.from.as_str(), to = ?o.to, error = ?o.error, "settled on the way: a teardown its owner left");
                }
                Some(r)
            }
            Err(e) => {
                tracing::warn!(error = %e, "orphans not settled on the way");
                None
            }
        }
    }

    /// Tears one orphan down with its recorded grace.
    fn sweep_one(&self, row: &TreeRow, opts: &SweepOptions) -> SweepOutcome {
        let grace = match opts.failed_closed_grace {
            Some(g) if self.failed_closed(row) => Grace::from(g),
            _ => Grace::for_tree(row, None, opts.default_grace, None),
        };
        let mut outcome = SweepOutcome {
            tree: row.id,
            from: row.state,
            to: None,
            grace_ms: grace.as_millis(),
            error: None,
        };
        let count = |counter: fn(&SweepProgress) -> &AtomicUsize| {
            if let Some(p) = &opts.progress {
                counter(p).fetch_add(1, Ordering::SeqCst);
            }
        };
        if opts.stop.as_ref().is_some_and(|s| s.load(Ordering::SeqCst)) {
            count(|p| &p.not_started);
            outcome.error =
                Some("not started: the sweep was stopped (the next sweep takes it)".into());
            return outcome;
        }
        let tree = row.id;
        let found = Event::SweepOrphanFound(event::OrphanFound {
            owner: event::GoneOwner {
                pid: row.owner.pid,
                start: row.owner.start,
            },
            state: row.state,
            grace_ms: outcome.grace_ms,
        });
        if let Err(e) = self.engine.ledger.append_event(Some(tree), found) {
            count(|p| &p.unsettled);
            outcome.error = Some(e.to_string());
            return outcome;
        }
        count(|p| &p.in_flight);
        let reason = if self.failed_closed(row) {
            "owner gone: finishing a teardown that could not be authorized"
        } else {
            "owner gone (orphan sweep)"
        };
        let mut topts = TeardownOptions::new(grace, reason, Origin::Sweep);
        // The first signal the tree was given (`run -s`), SIGTERM otherwise.
        if let Some(sig) = row
            .first_signal
            .as_ref()
            .and_then(|s| crate::proc::Sig::parse_first(s.as_str()).ok())
        {
            topts.first_signal = sig;
        }
        let result = self.engine.teardown(tree, &topts, &mut |_| {});
        if let Some(p) = &opts.progress {
            p.in_flight.fetch_sub(1, Ordering::SeqCst);
        }
        match result {
            Ok(done) => {
                count(if done.state.is_terminal() {
                    |p| &p.settled
                } else {
                    |p| &p.unsettled
                });
                outcome.to = Some(done.state);
            }
            Err(e) => {
                count(|p| &p.unsettled);
                outcome.error = Some(e.to_string());
            }
        }
        outcome
    }
}
