//! The end of a teardown: the journal and the deferred exits flushed, the
//! final exits, the tree closed (ended or vanished), its cgroup removed.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::super::CustodyError;
use super::super::watch::{TreeWatch, exit_record};
use super::Teardown;
use super::signal::refusal_event;
use super::{Phase, TeardownOptions, TeardownReport, now};
use crate::custody::Engine;
use crate::ledger::{Deferred, TreeId, TreeState};

impl Teardown<'_> {
    /// Writes the exits the verifying scans found since the kill
    /// authorization ([`TreeWatch::defer_exits`]), each with the status the
    /// reaper collected for its pid if the scan did not have it yet.
    /// Returns what it took from the reaper, for the exits recorded after it.
    pub(super) fn flush_deferred_exits(&mut self) -> HashMap<i32, crate::proc::ExitStatus> {
        let mut fresh: HashMap<i32, crate::proc::ExitStatus> = HashMap::new();
        collect_exits(self.engine.host(), &mut fresh);
        let mut gone = self.watch.take_deferred_exits();
        if gone.is_empty() {
            return fresh;
        }
        let orphans_until = self.engine.reaped().orphans_deadline(self.tree);
        for (id, exit) in &mut gone {
            if exit.is_none() {
                *exit = fresh
                    .get(&id.pid)
                    .or_else(|| self.exits.get(&id.pid))
                    .copied()
                    .or_else(|| {
                        self.engine.reaped().reaped_exit(
                            id.pid,
                            id.start_ticks,
                            self.watch.is_root(id.pid, id.start_ticks)
                                && self.engine.reaped().was_spawned_here(self.tree),
                            orphans_until,
                        )
                    })
                    .map(|s| self.engine.reaped().exit_of(id.pid, s));
            }
        }
        if let Some(Err(e)) = self.watch.evidence("member exits", || {
            self.engine.ledger.record_exits(
                self.tree,
                &gone,
                self.engine.reaped().unknown_reaper(self.tree),
            )
        }) {
            tracing::warn!(tree = self.tree.0, error = %e, "member exits not recorded");
        }
        fresh
    }

    /// The trail of a teardown that failed closed: `kill.skipped` with its
    /// reason, the flag, and the state `ambiguous` (each kept in the
    /// journal when the ledger does not take it).
    pub(super) fn fail_closed_trail(&mut self, why: &str, flag: crate::ledger::TreeFlag) {
        let at = now();
        let _ = self.watch.record(
            &self.engine.ledger,
            "kill skipped",
            Deferred::KillSkipped {
                reason: why.to_string(),
                at: at.clone(),
            },
        );
        let _ = self.watch.record(
            &self.engine.ledger,
            "flag",
            Deferred::Flag {
                flag,
                at: at.clone(),
            },
        );
        let _ = self.watch.record(
            &self.engine.ledger,
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
    pub(super) fn flush_journal(&mut self) {
        let journal = self.watch.take_journal();
        if journal.is_empty() {
            return;
        }
        if let Err(e) = self.engine.ledger.replay_deferred(
            self.tree,
            &journal,
            &crate::custody::markers::new_batch(),
        ) {
            tracing::error!(tree = self.tree.0, writes = journal.len(), error = %e, "deferred evidence of this teardown not written");
        }
    }

    pub(super) fn finish(mut self) -> Result<TeardownReport, CustodyError> {
        self.report.verified = Some(self.started.elapsed());
        let t0 = Instant::now();
        self.flush_journal();
        let fresh = self.flush_deferred_exits();
        self.record_final_exits(fresh);
        log_skipped(&self.watch);
        self.report.evidence_skipped = self.watch.skipped_writes();
        // The root's status also when this teardown killed it: this process
        // spawned it (run, serve), so its reaper has it.
        let exit = match (self.watch.root_pid(), self.root_status()) {
            (Some(root), Some(s)) => Some(self.engine.reaped().exit_of(root, s)),
            (None, Some(s)) => Some(exit_record(s)),
            (_, None) => None,
        };
        // What it consumed, read from its cgroup before the cgroup goes,
        // and an OOM kill no tick recorded yet (the one that ended it).
        // Without a cgroup: the CPU of the members this process reaped
        // (their rusage, each with its waited-for children's), where any.
        self.watch.note_oom_kills(self.engine);
        let resources = match self.watch.cgroup() {
            Some(dir) => Some(resources_of(self.engine.host(), dir)),
            None => self
                .engine
                .reaped()
                .reaped_cpu(self.tree, self.watch.root_pid(), exit.as_ref())
                .map(|cpu| crate::ledger::Resources {
                    cpu_usec: Some(cpu),
                    ..Default::default()
                }),
        };
        self.report.resources = resources;
        let state = close(self.engine, self.tree, TreeState::Ended, exit, resources)?;
        self.engine.ambiguity().forget_ambiguous(self.tree);
        if let Some(dir) = self.watch.cgroup() {
            remove_cgroup(self.engine.host(), dir);
        }
        self.report.phases.push((Phase::Record, t0.elapsed()));
        self.report.state = state;
        self.report.elapsed = self.started.elapsed();
        Ok(self.report)
    }

    /// The root's exit status: the caller's (it reaped it), else the
    /// reaper's when this process spawned the root.
    pub(super) fn root_status(&self) -> Option<crate::proc::ExitStatus> {
        self.opts.root_exit.or_else(|| {
            let pid = self.watch.root_pid()?;
            self.engine.reaped().reaped_exit(
                pid,
                self.watch.root_start_ticks(),
                self.engine.reaped().was_spawned_here(self.watch.tree()),
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
    pub(super) fn record_final_exits(&mut self, mut exits: HashMap<i32, crate::proc::ExitStatus>) {
        collect_exits(self.engine.host(), &mut exits);
        let root = self.watch.root_pid();
        let mut statuses: Vec<(i32, crate::ledger::ExitRecord)> = exits
            .iter()
            .filter(|(pid, _)| Some(**pid) != root)
            .map(|(pid, s)| (*pid, self.engine.reaped().exit_of(*pid, *s)))
            .collect();
        if let (Some(root), Some(status)) = (root, self.root_status()) {
            statuses.push((root, self.engine.reaped().exit_of(root, status)));
        }
        if let Some(Err(e)) = self.watch.evidence("final member exits", || {
            self.engine.ledger.record_remaining_exits(
                self.tree,
                &statuses,
                self.engine.reaped().unknown_reaper(self.tree),
            )
        }) {
            tracing::warn!(tree = self.tree.0, error = %e, "final member exits not recorded");
        }
    }
}

/// A cgroup's usage, read through the host, in the ledger's terms.
pub(crate) fn resources_of(
    host: &dyn crate::custody::Host,
    dir: &std::path::Path,
) -> crate::ledger::Resources {
    resources_from(host.container_usage(dir))
}

/// [`crate::proc::ContainerUsage`] in the ledger's terms.
pub(crate) fn resources_from(u: crate::proc::ContainerUsage) -> crate::ledger::Resources {
    crate::ledger::Resources {
        cpu_usec: u.cpu_usec,
        memory_peak_bytes: u.memory_peak_bytes,
        pids_peak: u.pids_peak,
        io_read_bytes: u.io_read_bytes,
        io_write_bytes: u.io_write_bytes,
        oom_kills: u.oom_kills,
    }
}

pub(super) fn log_skipped(watch: &TreeWatch) {
    if watch.skipped_writes() > 0 {
        tracing::warn!(
            tree = watch.tree().0,
            skipped = watch.skipped_writes(),
            reason = watch.degraded().unwrap_or(""),
            "evidence writes skipped in this teardown: the ledger refused writes (findings kept in memory; the unsettled marker and the next sweep carry them)"
        );
    }
}

/// Removes a tree's cgroup once the kernel has let go of it (rmdir fails
/// with EBUSY while dying tasks are still accounted to it).
pub(crate) fn remove_cgroup(host: &dyn crate::custody::Host, dir: &std::path::Path) {
    match host.remove_cgroup_when_empty(dir, Duration::from_secs(2)) {
        Ok(true) => {}
        Ok(false) => {
            tracing::warn!(cgroup = %dir.display(), "cgroup still populated; left in place");
        }
        Err(e) => tracing::warn!(cgroup = %dir.display(), error = %e, "cgroup not removed"),
    }
}

/// The statuses the reaper collected that nobody claimed, added to `exits`.
pub(super) fn collect_exits(
    host: &dyn crate::custody::Host,
    exits: &mut HashMap<i32, crate::proc::ExitStatus>,
) {
    exits.extend(host.unclaimed_exits());
}

/// Ends the tree as `state` and returns the state it is in now. A tree
/// someone else ended first (a concurrent `kill`) stays as it is; one an
/// operator resolved leaving survivors stays `resolved` and is flagged
/// `survivors_ended` (terminal states are final).
pub(super) fn close(
    engine: &Engine,
    tree: TreeId,
    state: TreeState,
    exit: Option<crate::ledger::ExitRecord>,
    resources: Option<crate::ledger::Resources>,
) -> Result<TreeState, CustodyError> {
    match engine.ledger.end_tree_with(tree, state, exit, resources) {
        Ok(()) => Ok(state),
        Err(e) => match engine.ledger.tree(tree) {
            Ok(Some(row)) if row.has_survivors_left() => {
                engine
                    .ledger
                    .add_flag(tree, crate::ledger::TreeFlag::SurvivorsEnded)?;
                Ok(row.state)
            }
            Ok(Some(row)) if row.state.is_terminal() => Ok(row.state),
            _ => Err(e.into()),
        },
    }
}

/// Nothing provably ours to signal: the refusal recorded, the tree closed
/// as vanished, its cgroup removed.
pub(super) fn refuse(
    engine: &Engine,
    tree: TreeId,
    cgroup: Option<&std::path::Path>,
    opts: &TeardownOptions,
    why: &str,
    mut report: TeardownReport,
    started: Instant,
) -> Result<TeardownReport, CustodyError> {
    refusal_event(engine, tree, opts, why);
    let state = close(engine, tree, TreeState::Vanished, None, None)?;
    // Every terminal path leaves no empty cgroup behind.
    if let Some(dir) = cgroup {
        remove_cgroup(engine.host(), dir);
    }
    report.state = state;
    report.elapsed = started.elapsed();
    Ok(report)
}
