//! The custody engine: the spawn protocol, the teardown state machine, the
//! dispatch gate, per-tree watching and the orphan sweep.
//!
//! This is the one place where the ledger (evidence and authority) and the
//! process mechanics (`proc`) meet. Its rules, from docs/ARCHITECTURE.md:
//!
//! - work that cannot be recorded never starts: the tree row commits before
//!   the child is released to exec;
//! - every SIGKILL follows a committed `kill.authorized`; when that commit
//!   fails the kill is skipped, the tree is ambiguous and dispatch closes;
//! - groups are signalled by the pgid recorded at spawn, processes through
//!   identity-checked pidfds (both enforced inside `proc`);
//! - there is one teardown, used by `run`, `kill`, the sweep and the service.
//!
//! The engine never makes a syscall itself and never writes SQL.

mod dispatch;
pub mod markers;
mod observer;
mod owner;
mod spawn;
mod stats;
mod sweep;
mod teardown;
mod watch;

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

pub use dispatch::Unsettled;
pub use observer::{Observer, ObserverHandle, ObserverStats};
pub use owner::{RunEnd, RunOptions, RunOutcome};
pub use spawn::{SpawnRequest, Spawned};
pub use stats::EngineStats;
pub use sweep::{
    DEFAULT_SWEEP_CONCURRENCY, SweepCounts, SweepOptions, SweepOutcome, SweepProgress, SweepReport,
};
pub use teardown::{Origin, Phase, Progress, TeardownOptions, TeardownReport};
pub use watch::{TickReport, TreeWatch};

use crate::config::Config;
use crate::ledger::{Ledger, LedgerError, TreeId};
use crate::proc::{BoundaryKind, ExecFailure, ProcError, Reaper};

/// Errors of the engine. Each variant is one a caller branches on (mostly to
/// pick an exit code or an HTTP status).
#[derive(Debug, thiserror::Error)]
pub enum CustodyError {
    /// New work is refused while a tree is unsettled.
    #[error(
        "dispatch refused: tree {tree} is unsettled ({reason}); settle it with `treewarden sweep` or `treewarden resolve {tree} --note TEXT`"
    )]
    DispatchRefused { tree: i64, reason: String },
    /// The ledger did not take a write this step needed; nothing unrecorded was done.
    #[error("cannot record in the ledger: {0}")]
    Ledger(#[from] LedgerError),
    /// The kernel refused something (spawn, cgroup, signal guard).
    #[error("{0}")]
    Proc(#[from] ProcError),
    /// The command could not be executed (not found: 127, not executable: 126).
    #[error("{0}")]
    Exec(ExecFailure),
    /// No tree with this id in the ledger.
    #[error("unknown tree {0}")]
    UnknownTree(i64),
    /// The request does not fit the tree's state (e.g. resolving a tree that is not ambiguous).
    #[error("{0}")]
    Conflict(String),
    /// The teardown could not prove the tree gone, or could not record the
    /// authority for its forced kill. Survivors are left alive as evidence.
    #[error("teardown of tree {tree} is ambiguous: {reason}")]
    Ambiguous { tree: i64, reason: String },
}

/// The engine. Cheap to clone; clones share the in-memory ambiguity set.
#[derive(Clone)]
pub struct Engine {
    ledger: Ledger,
    /// Where `tree-<id>` cgroups are made, when the boundary is cgroup.
    cgroup_root: Option<PathBuf>,
    /// The boundary every new tree gets (resolved once from the config);
    /// `None` for an engine that only signals ([`Engine::signal_only`]).
    boundary: Option<BoundaryKind>,
    /// The reaper, when this process owns children (run, serve). A process
    /// that only signals (kill, sweep) has none.
    reaper: Option<&'static Reaper>,
    /// Trees found ambiguous by this process whose state the ledger may not
    /// hold yet (it refused the write). Dispatch is refused at once.
    ambiguous: Arc<Mutex<HashSet<i64>>>,
    /// Processes never counted as members: this process and its helpers.
    exclude: Arc<HashSet<i32>>,
    /// Holds `unsettled/` markers next to the ledger.
    data_dir: PathBuf,
    /// Failures the ledger could not record, for metrics.
    stats: Arc<EngineStats>,
}

impl Engine {
    /// Builds an engine over an open ledger. Resolves the boundary now, so a
    /// `--boundary cgroup` on a host without writable cgroup v2 fails here.
    pub fn new(
        config: &Config,
        ledger: Ledger,
        reaper: Option<&'static Reaper>,
    ) -> Result<Self, CustodyError> {
        let cgroup_root = crate::proc::cgroup_root(config.cgroup_root.as_deref())?;
        let boundary = crate::proc::resolve_boundary(config.boundary, cgroup_root.as_deref())?;
        let mut engine = Self::signal_only(config, ledger, reaper);
        engine.cgroup_root = cgroup_root;
        engine.boundary = Some(boundary);
        Ok(engine)
    }

    /// An engine for commands that never spawn (`kill`, `sweep`,
    /// `resolve`): no boundary is resolved, so no probe cgroup is made, and a
    /// `--boundary cgroup` on a host without a writable cgroup v2 does not
    /// stop a teardown (which signals by what the tree's row recorded).
    /// [`Engine::spawn`] on it is refused.
    pub fn signal_only(config: &Config, ledger: Ledger, reaper: Option<&'static Reaper>) -> Self {
        let me = std::process::id() as i32;
        Self {
            ledger,
            cgroup_root: None,
            boundary: None,
            reaper,
            ambiguous: Arc::new(Mutex::new(HashSet::new())),
            exclude: Arc::new(HashSet::from([me])),
            data_dir: config.data_dir.clone(),
            stats: Arc::new(EngineStats::default()),
        }
    }

    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// The boundary new trees get; `None` on a [`Engine::signal_only`] engine.
    pub fn boundary(&self) -> Option<BoundaryKind> {
        self.boundary
    }

    /// Counters of failed writes and survivors (see [`EngineStats`]).
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// Records an operator's resolution of an ambiguous tree; reopens dispatch
    /// once no other tree is unsettled. A tree the ledger already holds as
    /// ended but whose marker stayed (a teardown raced another) is settled by
    /// removing the marker.
    pub fn resolve(&self, tree: TreeId, note: &str) -> Result<(), CustodyError> {
        if note.trim().is_empty() {
            return Err(CustodyError::Conflict(
                "a resolution needs a non-empty --note".into(),
            ));
        }
        let row = self
            .ledger
            .tree(tree)?
            .ok_or(CustodyError::UnknownTree(tree.0))?;
        let marked = self.is_ambiguous_in_memory(tree.0);
        if row.state.is_terminal() && marked {
            tracing::warn!(
                tree = tree.0,
                note,
                "resolve: tree already {}; its marker is removed",
                row.state.as_str()
            );
            self.forget_ambiguous(tree.0);
            return Ok(());
        }
        if row.state != crate::ledger::TreeState::Ambiguous && !marked {
            return Err(CustodyError::Conflict(format!(
                "tree {} is {}, not ambiguous: nothing to resolve",
                tree.0,
                row.state.as_str()
            )));
        }
        if row.state != crate::ledger::TreeState::Ambiguous {
            self.ledger.set_state(
                tree,
                crate::ledger::TreeState::Ambiguous,
                Some("recorded late"),
            )?;
        }
        self.ledger.resolve(tree, note)?;
        self.forget_ambiguous(tree.0);
        Ok(())
    }

    /// Marks a tree unsettled at once: in memory, and as a marker file that
    /// names its survivors (see [`markers`]). It stays until the tree is
    /// settled.
    fn mark_ambiguous(&self, tree: i64, reason: &str, survivors: &[crate::ledger::IdentityRecord]) {
        if let Ok(mut set) = self.ambiguous.lock() {
            set.insert(tree);
        }
        let marker = markers::Marker {
            reason: reason.to_string(),
            survivors: survivors.to_vec(),
        };
        markers::write(&self.data_dir, tree, &marker);
    }

    /// The tree is settled (teardown verified, or resolved by an operator).
    fn forget_ambiguous(&self, tree: i64) {
        if let Ok(mut set) = self.ambiguous.lock() {
            set.remove(&tree);
        }
        markers::remove(&self.data_dir, tree);
    }

    fn is_ambiguous_in_memory(&self, tree: i64) -> bool {
        self.ambiguous_in_memory().iter().any(|(t, _)| *t == tree)
    }

    /// Survivors a marker names for this tree: a teardown counts them as
    /// members even when the ledger never recorded them.
    pub(crate) fn marked_survivors(&self, tree: i64) -> Vec<crate::ledger::IdentityRecord> {
        markers::read(&self.data_dir, tree)
            .map(|m| m.survivors)
            .unwrap_or_default()
    }

    /// Ambiguous trees not necessarily in the ledger yet: this process's
    /// memory and every process's marker files, with the recorded reason.
    pub fn ambiguous_in_memory(&self) -> Vec<(i64, String)> {
        let mut v: Vec<(i64, String)> = self
            .ambiguous
            .lock()
            .map(|s| s.iter().map(|t| (*t, String::new())).collect())
            .unwrap_or_default();
        for (tree, marker) in markers::all(&self.data_dir) {
            match v.iter_mut().find(|(t, _)| *t == tree) {
                Some(slot) => slot.1 = marker.reason,
                None => v.push((tree, marker.reason)),
            }
        }
        v.sort_unstable();
        v
    }

    /// Retries writing pending ambiguity to the ledger (it may have refused
    /// the first time). Trees the ledger now holds as ambiguous stay in
    /// memory until resolved or settled by a teardown.
    pub fn flush_ambiguous(&self) {
        for (tree, _) in self.ambiguous_in_memory() {
            let id = TreeId(tree);
            match self.ledger.tree(id) {
                // A terminal tree's marker is judged by the dispatch gate.
                Ok(Some(row)) if row.state.is_terminal() => {}
                Ok(Some(row)) if row.state == crate::ledger::TreeState::Ambiguous => {}
                Ok(Some(_)) => {
                    if let Err(e) = self.ledger.set_state(
                        id,
                        crate::ledger::TreeState::Ambiguous,
                        Some("recorded late: the ledger refused it earlier"),
                    ) {
                        tracing::warn!(tree, error = %e, "ambiguous state still not recorded");
                    }
                }
                Ok(None) | Err(_) => {}
            }
        }
    }
}

/// Whether the process a ledger identity names still runs. An identity whose
/// start time cannot be read counts as alive: a missed reap is recoverable,
/// a wrong kill is not.
pub(crate) fn still_alive(id: &crate::ledger::IdentityRecord) -> bool {
    let id = crate::proc::Identity {
        pid: id.pid,
        start_ticks: id.start_ticks,
        boot_id: id.boot_id.clone(),
    };
    !matches!(
        id.check(),
        crate::proc::Liveness::Gone | crate::proc::Liveness::Recycled
    )
}
