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
//!
//! [`Engine`] is the core the pieces share (the ledger, the host, the
//! boundary, the reaper, the data directory); each piece is a type over it,
//! in its own file: a teardown run (`teardown::Teardown`) and its lease, the
//! dispatch [`Gate`], [`Ambiguity`], the [`Sweeper`], the spawn
//! (`spawn::Spawner`) and what this process reaped (`reaped::Reaped`).

mod ambiguity;
mod dispatch;
#[cfg(test)]
mod dispatch_tests;
#[cfg(test)]
mod fake;
mod follow;
pub mod holds;
mod host;
pub mod markers;
mod observer;
#[cfg(test)]
mod oom_tests;
mod owner;
pub mod policy;
mod reaped;
mod spawn;
mod stats;
mod sweep;
#[cfg(test)]
mod sweep_tests;
mod teardown;
#[cfg(test)]
mod tests;
mod walks;
#[cfg(test)]
mod walks_tests;
mod watch;
#[cfg(test)]
mod watch_tests;

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use crate::ledger::TreeId;

pub use ambiguity::Ambiguity;
pub use dispatch::{DispatchScope, Gate, Unsettled};
pub use follow::{LogFollower, remove_logs};
pub use holds::{HoldCap, HoldCaps, Holds};
pub use host::{Held, Host, KernelHost};
pub use observer::{Observer, ObserverHandle, ObserverStats};
pub use owner::{
    Action, KeepEnd, KeepOptions, Lifetime, OwnerWatch, RunEnd, RunOptions, RunOutcome, Watched,
    mark_lifetime_owner,
};
pub use spawn::{OnBehalf, SpawnRequest, Spawned, last_lines, log_path, read_log};
pub use stats::EngineStats;
pub use sweep::{
    DEFAULT_SWEEP_CONCURRENCY, SweepCounts, SweepOptions, SweepOutcome, SweepProgress, SweepReport,
    Sweeper,
};
pub use teardown::{Origin, Phase, Progress, TeardownOptions, TeardownReport};
pub use watch::{TickReport, TreeWatch};

use crate::config::Config;
use crate::ledger::{Ledger, LedgerError};
use crate::proc::{BoundaryKind, ExecFailure, ProcError, Reaper};

/// Errors of the engine. Each variant is one a caller branches on (mostly to
/// pick an exit code or an HTTP status).
#[derive(Debug, thiserror::Error)]
pub enum CustodyError {
    /// New work is refused while a tree is unsettled.
    #[error(
        "dispatch refused: tree {tree} is unsettled ({reason}); settle it with `treewarden sweep` or `treewarden resolve {tree} --note TEXT`"
    )]
    DispatchRefused { tree: TreeId, reason: String },
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
    UnknownTree(TreeId),
    /// The request asks for something this host or boundary cannot
    /// enforce (a limit without a cgroup or its controller); nothing was
    /// recorded or started.
    #[error("{0}")]
    Unsupported(String),
    /// The request does not fit the tree's state (e.g. resolving a tree that is not ambiguous).
    #[error("{0}")]
    Conflict(String),
    /// The teardown could not prove the tree gone, or could not record the
    /// authority for its forced kill. Survivors are left alive as evidence.
    #[error("teardown of tree {tree} is ambiguous: {reason}")]
    Ambiguous { tree: TreeId, reason: String },
    /// The teardown's evidence was incomplete: reads of `/proc` or of the
    /// cgroup failed for a reason other than the processes being gone (out
    /// of descriptors, I/O). Nothing was concluded from them: the tree is
    /// not recorded as ended, and the teardown is to be tried again.
    #[error(
        "teardown of tree {tree} undecided: evidence incomplete ({reason}); nothing was concluded, try again"
    )]
    Incomplete { tree: TreeId, reason: String },
}

/// The engine's core: what every piece of custody works over (see the
/// module's documentation). Cheap to clone; clones share the in-memory
/// ambiguity set, the held-handle budget and the counters.
#[derive(Clone)]
pub struct Engine {
    ledger: Ledger,
    /// Where per-tree cgroups are made, when the boundary is cgroup.
    cgroup_root: Option<PathBuf>,
    /// `tw-<8 hex of the ledger's instance id>`: the prefix of this
    /// ledger's per-tree cgroup names (`<prefix>-<tree>`), so two ledgers on
    /// one host never make the same one. Empty on a signal-only engine,
    /// which names no cgroup.
    cgroup_prefix: String,
    /// The boundary every new tree gets (resolved once from the config);
    /// `None` for an engine that only signals ([`Engine::signal_only`]).
    boundary: Option<BoundaryKind>,
    /// The reaper, when this process owns children (run, serve). A process
    /// that only signals (kill, sweep) has none.
    reaper: Option<&'static Reaper>,
    /// Trees found ambiguous by this process whose state the ledger may not
    /// hold yet (it refused the write). Dispatch is refused at once.
    ambiguous: Arc<Mutex<HashSet<TreeId>>>,
    /// Processes never counted as members: this process and its helpers.
    exclude: Arc<HashSet<i32>>,
    /// Trees whose root this process spawned (so its reaper has the root's
    /// status, and every orphan of the tree came to it as subreaper).
    spawned_here: Arc<Mutex<HashSet<TreeId>>>,
    /// Holds `unsettled/` markers next to the ledger.
    data_dir: PathBuf,
    /// Failures the ledger could not record, for metrics.
    stats: Arc<EngineStats>,
    /// The kernel, as the teardown and the watches see it: [`KernelHost`]
    /// (over `proc` and this engine's reaper) unless a test injected a
    /// scripted one ([`Engine::with_host`]).
    host: Arc<dyn Host>,
    /// Whom an unsettled tree refuses new work to: its owner (default), or
    /// everyone on the host (`--dispatch-scope host`).
    dispatch_scope: DispatchScope,
    /// The budget of held handles (loose members' pidfds), shared by every
    /// clone: the service's scan watches and its teardowns draw on one.
    holds: Arc<Holds>,
    /// What all of one principal's trees may use together (`serve
    /// --principal-*`): empty, each tree's cgroup sits in the root; set,
    /// in `<root>/<prefix>-p-<principal>/` with these limits (see
    /// [`Engine::set_principal_limits`]).
    principal_limits: crate::ledger::Limits,
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
        // Delegation done right: a delegated root holding only this process
        // gets it moved into its leaf, so controllers can be enabled for
        // tree cgroups next to it (proc/sys/linux/delegation.rs). Where the move
        // fails, trees still get cgroups (they need no controller) and
        // limits are refused, saying why (`check_limits_possible`).
        if boundary.contained()
            && let Some(root) = cgroup_root.as_deref()
            && let Err(e) = crate::proc::take_delegation(root)
        {
            tracing::warn!(cgroup = %root.display(), error = %e, "could not move into the delegated cgroup's leaf: limits will be refused");
        }
        let instance = ledger.instance_id()?;
        let mut engine = Self::signal_only(config, ledger, reaper);
        engine.cgroup_prefix = cgroup_prefix(&instance);
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
            cgroup_prefix: String::new(),
            boundary: None,
            reaper,
            ambiguous: Arc::new(Mutex::new(HashSet::new())),
            exclude: Arc::new(HashSet::from([me])),
            spawned_here: Arc::new(Mutex::new(HashSet::new())),
            data_dir: config.data_dir.clone(),
            stats: Arc::new(EngineStats::default()),
            host: Arc::new(KernelHost::new(reaper)),
            dispatch_scope: DispatchScope::default(),
            holds: Arc::new(Holds::default()),
            principal_limits: crate::ledger::Limits::default(),
        }
    }

    /// Sets whom an unsettled tree refuses new work to ([`DispatchScope`]).
    pub fn set_dispatch_scope(&mut self, scope: DispatchScope) {
        self.dispatch_scope = scope;
    }

    /// Sets the caps on held handles (`serve --max-held-per-tree`,
    /// `--max-held-per-user`; [`holds`]).
    pub fn set_hold_caps(&self, caps: HoldCaps) {
        self.holds.set_caps(caps);
    }

    /// The budget of held handles, and its counts (metrics).
    pub fn holds(&self) -> &Arc<Holds> {
        &self.holds
    }

    /// Bounds what all the trees of one principal use together (`serve
    /// --principal-memory-max`, `--principal-pids-max`,
    /// `--principal-cpu-max`): from now on each new tree's cgroup is made
    /// in its principal's parent, `<root>/<prefix>-p-<key>` (the key:
    /// `tok-<id>` for a token, `uid-<n>` for a socket peer, else this
    /// process's uid), which carries these limits; it is made with the
    /// principal's first tree and removed with its last. Refused
    /// ([`CustodyError::Unsupported`], one line) where they cannot be
    /// enforced: no cgroup boundary, a controller the hierarchy does not
    /// offer, a root with processes of its own, or not Linux.
    pub fn set_principal_limits(
        &mut self,
        limits: crate::ledger::Limits,
    ) -> Result<(), CustodyError> {
        if !limits.is_empty() {
            if !crate::proc::SHARED_PARENT_LIMITS {
                return Err(CustodyError::Unsupported(
                    "principal limits (serve --principal-*) need Linux's cgroup v2: refusing to serve without them".into(),
                ));
            }
            let boundary = self.boundary.ok_or_else(|| {
                CustodyError::Conflict("this engine only signals; it spawns nothing".into())
            })?;
            spawn::Spawner::new(self).check_enforceable(
                boundary,
                &limits,
                spawn::Whose::Principal,
            )?;
        }
        self.principal_limits = limits;
        Ok(())
    }

    /// The same engine over another host (a test's scripted one). The
    /// reaper the engine was built with still serves `run` and spawns; the
    /// teardown and the watches ask only `host`.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn with_host(mut self, host: Arc<dyn Host>) -> Self {
        self.host = host;
        self
    }

    /// The host the teardown and the watches go through.
    pub(crate) fn host(&self) -> &dyn Host {
        self.host.as_ref()
    }

    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// The data directory: the ledger's, the unsettled markers', the
    /// teardown leases' and captured output's.
    pub fn data_dir(&self) -> &std::path::Path {
        &self.data_dir
    }

    /// The boundary new trees get; `None` on a [`Engine::signal_only`] engine.
    pub fn boundary(&self) -> Option<BoundaryKind> {
        self.boundary
    }

    /// Counters of failed writes and survivors (see [`EngineStats`]).
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// Removes the empty cgroups of this ledger's terminal trees that a
    /// crash (or a cgroup still busy at the end of its teardown) left
    /// behind. A cgroup of a live tree, or one that holds processes, is left
    /// alone. Returns how many were removed.
    ///
    /// Principals' parents (`<prefix>-p-<key>`, [`Engine::set_principal_limits`])
    /// are looked in as well (found through the trees' recorded paths, and
    /// listed in the cgroup roots those paths and this engine name: one no
    /// tree row names is a crash's between its `mkdir` and the spawn's
    /// commit), and each left with no tree in it is removed; a populated
    /// one stays, as its trees do.
    pub fn remove_leftover_cgroups(&self) -> Result<usize, CustodyError> {
        let prefix = cgroup_prefix(&self.ledger.instance_id()?);
        let shared_prefix = format!("{prefix}{}", crate::proc::SHARED_PARENT_MARK);
        let is_ours = |p: &std::path::Path| {
            crate::proc::is_shared_parent(p)
                && p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&shared_prefix))
        };
        let mut dirs: std::collections::BTreeSet<PathBuf> = self
            .ledger
            .cgroup_dirs(&prefix)?
            .into_iter()
            .map(PathBuf::from)
            .collect();
        // The cgroup roots: where a tree's cgroup was made, or its
        // principal's parent.
        let roots: std::collections::BTreeSet<PathBuf> = dirs
            .iter()
            .filter_map(|d| {
                if is_ours(d) {
                    d.parent().map(std::path::Path::to_path_buf)
                } else {
                    Some(d.clone())
                }
            })
            .chain(self.cgroup_root.clone())
            .collect();
        for root in &roots {
            for entry in std::fs::read_dir(root).into_iter().flatten().flatten() {
                if is_ours(&entry.path()) {
                    dirs.insert(entry.path());
                }
            }
        }
        let mut found = Vec::new();
        for dir in &dirs {
            let Ok(entries) = std::fs::read_dir(dir) else {
                continue;
            };
            for entry in entries.flatten() {
                let name = entry.file_name();
                if let Some(id) = name
                    .to_str()
                    .and_then(|n| n.strip_prefix(prefix.as_str()))
                    .and_then(|n| n.strip_prefix('-'))
                    .and_then(|n| n.parse::<i64>().ok())
                {
                    found.push((id, entry.path()));
                }
            }
        }
        let mut removed = 0;
        if !found.is_empty() {
            // Read after the listing, in one query: a tree's row is written
            // before its cgroup is made, so a cgroup listed above whose tree
            // is not live here belongs to an ended tree (or to none this
            // ledger recorded), never to one still being spawned.
            let live = self.ledger.nonterminal_tree_ids()?;
            for (id, path) in found {
                if !live.contains(&id)
                    && matches!(crate::proc::container_populated(&path), Ok(false))
                    && matches!(crate::proc::remove_cgroup_if_empty(&path), Ok(true))
                {
                    tracing::info!(tree = id, cgroup = %path.display(), "leftover cgroup of an ended tree removed");
                    removed += 1;
                }
            }
        }
        // A principal's parent with no tree cgroup left in it: a plain
        // rmdir, which the kernel refuses while a tree's cgroup is there
        // (one being spawned included).
        for dir in dirs.iter().filter(|d| is_ours(d)) {
            if matches!(crate::proc::remove_shared_parent_if_empty(dir), Ok(true)) {
                tracing::info!(cgroup = %dir.display(), "a principal's cgroup left with no tree removed");
                removed += 1;
            }
        }
        Ok(removed)
    }
}

/// What a live tree has consumed so far, read from its cgroup (`None` for
/// an ended tree, whose figures are in its `tree.ended`, and without a
/// cgroup).
pub fn live_resources(row: &crate::ledger::TreeRow) -> Option<crate::ledger::Resources> {
    if row.state.is_terminal() {
        return None;
    }
    row.cgroup.as_deref().map(|dir| {
        teardown::resources_from(crate::proc::container_usage(std::path::Path::new(dir)))
    })
}

/// The prefix of a ledger's per-tree cgroup names: `tw-` and the first 8
/// hex digits of its instance id.
pub(crate) fn cgroup_prefix(instance_id: &str) -> String {
    let short: String = instance_id.chars().take(8).collect();
    format!("tw-{short}")
}
