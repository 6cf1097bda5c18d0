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
pub use sweep::{SweepOutcome, SweepReport};
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
    /// The boundary every new tree gets (resolved once from the config).
    boundary: BoundaryKind,
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
        let me = std::process::id() as i32;
        Ok(Self {
            ledger,
            cgroup_root,
            boundary,
            reaper,
            ambiguous: Arc::new(Mutex::new(HashSet::new())),
            exclude: Arc::new(HashSet::from([me])),
            data_dir: config.data_dir.clone(),
            stats: Arc::new(EngineStats::default()),
        })
    }

    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    pub fn boundary(&self) -> BoundaryKind {
        self.boundary
    }

    /// Counters of failed writes and survivors (see [`EngineStats`]).
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// Records an operator's resolution of an ambiguous tree; reopens dispatch
    /// once no other tree is unsettled.
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
        let in_memory = self.is_ambiguous_in_memory(tree.0);
        if row.state != crate::ledger::TreeState::Ambiguous && !in_memory {
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

    /// Marks a tree unsettled at once: in memory, and as a marker file
    /// `<data-dir>/unsettled/tree-<id>` that other treewarden processes read
    /// in their dispatch gate. The marker is the channel that still works
    /// when the ledger does not (a held write lock, a full disk: an empty
    /// file needs no data blocks); it stays until the tree is settled.
    fn mark_ambiguous(&self, tree: i64, reason: &str) {
        if let Ok(mut set) = self.ambiguous.lock() {
            set.insert(tree);
        }
        let dir = self.data_dir.join("unsettled");
        let path = dir.join(format!("tree-{tree}"));
        let made = std::fs::create_dir_all(&dir).and_then(|_| std::fs::File::create(&path));
        match made {
            Ok(mut file) => {
                use std::io::Write;
                // The reason is a courtesy; the file's existence is the fact.
                let _ = file.write_all(reason.as_bytes());
            }
            Err(e) => tracing::error!(tree, error = %e, "unsettled marker not written"),
        }
    }

    /// The tree is settled (teardown verified, or resolved by an operator).
    fn forget_ambiguous(&self, tree: i64) {
        if let Ok(mut set) = self.ambiguous.lock() {
            set.remove(&tree);
        }
        let path = self.data_dir.join("unsettled").join(format!("tree-{tree}"));
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::error!(tree, error = %e, "unsettled marker not removed"),
        }
    }

    fn is_ambiguous_in_memory(&self, tree: i64) -> bool {
        self.ambiguous_in_memory().iter().any(|(t, _)| *t == tree)
    }

    /// Ambiguous trees not necessarily in the ledger yet: this process's
    /// memory and every process's marker files, with the recorded reason.
    pub fn ambiguous_in_memory(&self) -> Vec<(i64, String)> {
        let mut v: Vec<(i64, String)> = self
            .ambiguous
            .lock()
            .map(|s| s.iter().map(|t| (*t, String::new())).collect())
            .unwrap_or_default();
        if let Ok(dir) = std::fs::read_dir(self.data_dir.join("unsettled")) {
            for entry in dir.flatten() {
                let name = entry.file_name();
                let Some(tree) = name
                    .to_str()
                    .and_then(|n| n.strip_prefix("tree-"))
                    .and_then(|n| n.parse::<i64>().ok())
                else {
                    continue;
                };
                let reason = std::fs::read_to_string(entry.path()).unwrap_or_default();
                match v.iter_mut().find(|(t, _)| *t == tree) {
                    Some(slot) => slot.1 = reason,
                    None => v.push((tree, reason)),
                }
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
                Ok(Some(row)) if row.state.is_terminal() => self.forget_ambiguous(tree),
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
