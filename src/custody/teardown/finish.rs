//! The end of a teardown: the journal and the deferred exits flushed, the
//! final exits, the tree closed (ended or vanished), its cgroup removed.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::super::watch::{TreeWatch, exit_record};
use super::super::{CustodyError, Engine};
use super::{Phase, TeardownOptions, TeardownReport, now};
use crate::ledger::{Deferred, TreeId, TreeState};

impl Engine {
    /// Writes the exits the verifying scans found since the kill
    /// authorization ([`TreeWatch::defer_exits`]), each with the status the
    /// reaper collected for its pid if the scan did not have it yet.
    /// Returns what it took from the reaper, for the exits recorded after it.
    pub(super) fn flush_deferred_exits(
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
    pub(super) fn fail_closed_trail(&self, watch: &mut TreeWatch, why: &str, flag: &str) {
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
    pub(super) fn flush_journal(&self, tree: TreeId, watch: &mut TreeWatch) {
        let journal = watch.take_journal();
        if journal.is_empty() {
            return;
        }
        if let Err(e) =
            self.ledger
                .replay_deferred(tree, &journal, &crate::custody::markers::new_batch())
        {
            tracing::error!(tree = tree.0, writes = journal.len(), error = %e, "deferred evidence of this teardown not written");
        }
    }

    pub(super) fn collect_exits(&self, exits: &mut HashMap<i32, crate::proc::ExitStatus>) {
        exits.extend(self.host.unclaimed_exits());
    }

    pub(super) fn finish(
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
            Some(dir) => Some(resources_of(self.host(), dir)),
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
    pub(super) fn close(
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
    pub(super) fn root_status(
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
    pub(super) fn record_final_exits(
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

    pub(super) fn refuse(
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
