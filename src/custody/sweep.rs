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

use super::teardown::{Origin, TeardownOptions};
use super::{CustodyError, Engine};
use crate::ledger::{EventKind, TreeId, TreeRow, TreeState};

/// Teardowns a sweep runs at once unless told otherwise (`--sweep-concurrency`).
pub const DEFAULT_SWEEP_CONCURRENCY: usize = 64;

/// What happened to one orphan.
#[derive(Clone, Debug, Serialize)]
pub struct SweepOutcome {
    pub tree: i64,
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
    pub skip: HashSet<i64>,
    /// Counters the caller reads while the sweep runs (the service's
    /// `/readyz`, dashboard and `treewarden_orphans_pending`).
    pub progress: Option<Arc<SweepProgress>>,
    /// Once set, no further teardown starts; those running finish.
    pub stop: Option<Arc<AtomicBool>>,
}

impl SweepOptions {
    pub fn new(default_grace: Duration) -> Self {
        Self {
            default_grace,
            concurrency: DEFAULT_SWEEP_CONCURRENCY,
            skip: HashSet::new(),
            progress: None,
            stop: None,
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

impl Engine {
    /// Runs one sweep now, with the default concurrency.
    pub fn sweep(&self, grace: Duration) -> Result<SweepReport, CustodyError> {
        self.sweep_with(&SweepOptions::new(grace))
    }

    /// Runs one sweep: finds the orphans, then tears them down, at most
    /// `opts.concurrency` at once, each with its recorded grace.
    pub fn sweep_with(&self, opts: &SweepOptions) -> Result<SweepReport, CustodyError> {
        let _span = tracing::info_span!("sweep").entered();
        let trees = self.ledger.sweep_candidates()?;
        self.ledger.append_event(
            None,
            EventKind::SweepStarted,
            serde_json::json!({ "candidates": trees.len(), "pid": std::process::id() }),
        )?;
        let mut report = SweepReport {
            examined: trees.len(),
            ..SweepReport::default()
        };
        let mut orphans = VecDeque::new();
        for row in trees {
            if opts.skip.contains(&row.id) || self.owner_alive(&row) {
                report.owned += 1;
            } else {
                orphans.push_back(row);
            }
        }
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
        self.flush_ambiguous();
        if let Err(e) = self.remove_leftover_cgroups() {
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

    /// Tears one orphan down with its recorded grace.
    fn sweep_one(&self, row: &TreeRow, opts: &SweepOptions) -> SweepOutcome {
        let recorded = row.grace_ms.map(Duration::from_millis);
        let grace = super::policy::grace(None, recorded, opts.default_grace, None);
        let mut outcome = SweepOutcome {
            tree: row.id,
            from: row.state,
            to: None,
            grace_ms: u64::try_from(grace.as_millis()).unwrap_or(u64::MAX),
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
        let tree = TreeId(row.id);
        let found = serde_json::json!({
            "owner": { "pid": row.owner.pid, "start": row.owner.start },
            "state": row.state.as_str(),
            "grace_ms": outcome.grace_ms,
        });
        if let Err(e) = self
            .ledger
            .append_event(Some(tree), EventKind::SweepOrphanFound, found)
        {
            count(|p| &p.unsettled);
            outcome.error = Some(e.to_string());
            return outcome;
        }
        count(|p| &p.in_flight);
        let mut topts = TeardownOptions::new(grace, "owner gone (orphan sweep)", Origin::Sweep);
        // The first signal the tree was given (`run -s`), SIGTERM otherwise.
        if let Some(sig) = row
            .first_signal
            .as_deref()
            .and_then(|s| crate::proc::Sig::parse_first(s).ok())
        {
            topts.first_signal = sig;
        }
        let result = self.teardown(tree, &topts, &mut |_| {});
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
