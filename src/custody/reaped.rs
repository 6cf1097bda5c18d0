//! What this process knows of its trees' exits: which roots it spawned
//! (so its reaper, the subreaper of their trees, has every orphan's status),
//! the statuses and CPU time its reaper collected, and who reaped the rest.

use crate::ledger::TreeId;

use super::{Engine, watch};

/// The engine's reaped exits ([`Engine::reaped`]).
pub(crate) struct Reaped<'a> {
    engine: &'a Engine,
}

impl Engine {
    /// What this process reaped, or is about to ([`Reaped`]).
    pub(crate) fn reaped(&self) -> Reaped<'_> {
        Reaped { engine: self }
    }
}

impl Reaped<'_> {
    /// Who reaped a member whose exit status this process does not have:
    /// for a tree this process spawned (run, serve: the subreaper of its
    /// trees, so every orphan comes here) it was the member's own parent in
    /// the tree; otherwise (kill, sweep, a tree a previous service left)
    /// this process was nobody's reaper, and the orphans of a dead owner
    /// went to init.
    pub(crate) fn unknown_reaper(&self, tree: TreeId) -> &'static str {
        if self.engine.host.has_reaper() && self.was_spawned_here(tree) {
            "parent"
        } else {
            "init"
        }
    }

    /// Counts `tree` as spawned by this process, as [`Engine::spawn`] does
    /// once the root is released (tests, whose roots are a fake host's).
    #[cfg(test)]
    pub(crate) fn note_spawned_here(&self, tree: TreeId) {
        if let Ok(mut set) = self.engine.spawned_here.lock() {
            set.insert(tree);
        }
    }

    /// Whether this process spawned the tree's root.
    pub(crate) fn was_spawned_here(&self, tree: TreeId) -> bool {
        self.engine
            .spawned_here
            .lock()
            .map(|s| s.contains(&tree))
            .unwrap_or(false)
    }

    /// An exit as the ledger records it, with the CPU time of the process
    /// (and its waited-for children) where this process reaped it.
    pub(crate) fn exit_of(
        &self,
        pid: i32,
        status: crate::proc::ExitStatus,
    ) -> crate::ledger::ExitRecord {
        crate::ledger::ExitRecord {
            cpu_usec: self.engine.host.reaped_cpu_usec(pid),
            ..watch::exit_record(status)
        }
    }

    /// What the members this process reaped used in all (the sum of their
    /// recorded `cpu_usec`, and the root's from `root_exit` when its exit
    /// was never recorded as a member's — a root that ended before any scan
    /// saw it): a tree's CPU time where it has no cgroup to say it. `None`
    /// when nothing carries one.
    pub(crate) fn reaped_cpu(
        &self,
        tree: TreeId,
        root: Option<i32>,
        root_exit: Option<&crate::ledger::ExitRecord>,
    ) -> Option<u64> {
        let (members, root_in) = self.engine.ledger.reaped_cpu_usec(tree, root).ok()?;
        let root_cpu = root_exit.and_then(|e| e.cpu_usec).filter(|_| !root_in);
        match (members, root_cpu) {
            (None, None) => None,
            (a, b) => Some(a.unwrap_or(0) + b.unwrap_or(0)),
        }
    }

    /// The exit status of a member this process reaped, or is about to.
    /// The tree's root (`is_root`), a child this process spawned: the
    /// reaper's status for it, waited for up to a second (`/proc` shows it
    /// dead, or already gone, a moment before the reaper records it). Any
    /// other member only as an adopted orphan's status (unclaimed), waited
    /// for while `/proc` shows it as a dead child of ours — never the
    /// status of an earlier child that held the same pid. `None` when this
    /// process has no reaper or was not its reaper.
    ///
    /// `orphans_until`: for a tree this process spawned (so it is the
    /// subreaper of every orphan), how long a member already gone from
    /// `/proc` may be waited for — its status may be in the reaper's hands
    /// but not yet recorded. One deadline for a whole tick, so a tick with
    /// many such members waits once, not once per member.
    pub(crate) fn reaped_exit(
        &self,
        pid: i32,
        start_ticks: u64,
        is_root: bool,
        orphans_until: Option<std::time::Instant>,
    ) -> Option<crate::proc::ExitStatus> {
        self.engine
            .host
            .reaped_exit(pid, start_ticks, is_root, orphans_until)
    }

    /// The deadline for orphans' statuses in one tick ([`Reaped::reaped_exit`]):
    /// `Some` only for a tree this process spawned.
    pub(crate) fn orphans_deadline(&self, tree: TreeId) -> Option<std::time::Instant> {
        self.was_spawned_here(tree)
            .then(|| std::time::Instant::now() + std::time::Duration::from_millis(100))
    }
}
