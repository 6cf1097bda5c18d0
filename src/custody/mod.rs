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

pub use dispatch::{DispatchScope, Unsettled};
pub use follow::{LogFollower, remove_logs};
pub use holds::{HoldCap, HoldCaps, Holds};
pub use host::{Held, Host, KernelHost};
pub use observer::{Observer, ObserverHandle, ObserverStats};
pub use owner::{
    Action, KeepEnd, KeepOptions, LIFETIME_OWNER_FLAG, Lifetime, OwnerWatch, ROOT_EXITED_FLAG,
    RunEnd, RunOptions, RunOutcome, Watched, mark_lifetime_owner,
};
pub use spawn::{OnBehalf, SpawnRequest, Spawned, log_path, read_log};
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
    Ambiguous { tree: i64, reason: String },
    /// The teardown's evidence was incomplete: reads of `/proc` or of the
    /// cgroup failed for a reason other than the processes being gone (out
    /// of descriptors, I/O). Nothing was concluded from them: the tree is
    /// not recorded as ended, and the teardown is to be tried again.
    #[error(
        "teardown of tree {tree} undecided: evidence incomplete ({reason}); nothing was concluded, try again"
    )]
    Incomplete { tree: i64, reason: String },
}

/// The engine. Cheap to clone; clones share the in-memory ambiguity set.
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
    ambiguous: Arc<Mutex<HashSet<i64>>>,
    /// Processes never counted as members: this process and its helpers.
    exclude: Arc<HashSet<i32>>,
    /// Trees whose root this process spawned (so its reaper has the root's
    /// status, and every orphan of the tree came to it as subreaper).
    spawned_here: Arc<Mutex<HashSet<i64>>>,
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
            self.check_enforceable(boundary, &limits, spawn::Whose::Principal)?;
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

    /// Who reaped a member whose exit status this process does not have:
    /// for a tree this process spawned (run, serve: the subreaper of its
    /// trees, so every orphan comes here) it was the member's own parent in
    /// the tree; otherwise (kill, sweep, a tree a previous service left)
    /// this process was nobody's reaper, and the orphans of a dead owner
    /// went to init.
    pub(crate) fn unknown_reaper(&self, tree: TreeId) -> &'static str {
        if self.host.has_reaper() && self.was_spawned_here(tree) {
            "parent"
        } else {
            "init"
        }
    }

    /// Counts `tree` as spawned by this process, as [`Engine::spawn`] does
    /// once the root is released (tests, whose roots are a fake host's).
    #[cfg(test)]
    pub(crate) fn note_spawned_here(&self, tree: TreeId) {
        if let Ok(mut set) = self.spawned_here.lock() {
            set.insert(tree.0);
        }
    }

    /// Whether this process spawned the tree's root.
    pub(crate) fn was_spawned_here(&self, tree: TreeId) -> bool {
        self.spawned_here
            .lock()
            .map(|s| s.contains(&tree.0))
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
            cpu_usec: self.host.reaped_cpu_usec(pid),
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
        let (members, root_in) = self.ledger.reaped_cpu_usec(tree, root).ok()?;
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
        self.host
            .reaped_exit(pid, start_ticks, is_root, orphans_until)
    }

    /// The deadline for orphans' statuses in one tick ([`Engine::reaped_exit`]):
    /// `Some` only for a tree this process spawned.
    pub(crate) fn orphans_deadline(&self, tree: TreeId) -> Option<std::time::Instant> {
        self.was_spawned_here(tree)
            .then(|| std::time::Instant::now() + std::time::Duration::from_millis(100))
    }

    /// Counters of failed writes and survivors (see [`EngineStats`]).
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// Records an operator's resolution of an ambiguous tree; reopens dispatch
    /// once no other tree is unsettled. A tree the ledger already holds as
    /// ended but whose marker stayed (a teardown raced another) is settled by
    /// removing the marker.
    ///
    /// A resolution never buries a live survivor by accident: the survivors
    /// the marker names and every member the ledger holds as not exited are
    /// re-read (identity checked), and while any lives the resolution is
    /// refused, naming them and `treewarden kill`, which ends them with
    /// authority. With `force` the tree is resolved anyway and the survivors
    /// it leaves are recorded in `tree.resolved` (and flagged
    /// `survivors_left`).
    pub fn resolve(&self, tree: TreeId, note: &str, force: bool) -> Result<(), CustodyError> {
        self.resolve_by(tree, note, force, None)
    }

    /// [`Engine::resolve`], recording who resolved (`by` in `tree.resolved`).
    pub fn resolve_by(
        &self,
        tree: TreeId,
        note: &str,
        force: bool,
        by: Option<&crate::ledger::Requester>,
    ) -> Result<(), CustodyError> {
        if note.trim().is_empty() {
            return Err(CustodyError::Conflict(
                "a resolution needs a non-empty --note".into(),
            ));
        }
        // The whole resolution under the tree's lease: no teardown of it
        // runs meanwhile, and the journal is replayed once.
        let _lease = self.teardown_lease(tree)?;
        // What the teardown could not write, first: the trail then shows
        // what happened before the operator's decision.
        self.replay_deferred_leased(tree);
        let (row, members) = self
            .ledger
            .tree_members(tree)?
            .ok_or(CustodyError::UnknownTree(tree.0))?;
        let marked = self.is_ambiguous_in_memory(tree.0);
        if row.state != crate::ledger::TreeState::Ambiguous && !marked {
            return Err(CustodyError::Conflict(format!(
                "tree {} is {}, not ambiguous: nothing to resolve",
                tree.0,
                row.state.as_str()
            )));
        }
        let mut candidates = self.marked_survivors(tree.0);
        for m in members.iter().filter(|m| m.exited_at.is_none()) {
            let id = m.identity();
            if !candidates.contains(&id) {
                candidates.push(id);
            }
        }
        let alive: Vec<crate::ledger::IdentityRecord> = candidates
            .into_iter()
            .filter(|id| self.host().still_alive(&id.into()))
            .collect();
        if !alive.is_empty() && !force {
            let pids: Vec<String> = alive.iter().map(|id| id.pid.to_string()).collect();
            return Err(CustodyError::Conflict(format!(
                "tree {} still has {} live survivor(s) (pid {}): end them with `treewarden kill {}`, or resolve with --force to leave them alive on the record",
                tree.0,
                alive.len(),
                pids.join(", "),
                tree.0
            )));
        }
        if row.state.is_terminal() {
            // Already terminal in the ledger (a teardown raced another, or
            // a force-resolved tree failed closed again): only its marker
            // is left to settle; the survivor check above still applied.
            tracing::warn!(
                tree = tree.0,
                note,
                left_alive = alive.len(),
                "resolve: tree already {}; its marker is removed",
                row.state.as_str()
            );
            self.forget_ambiguous(tree.0);
            return Ok(());
        }
        if row.state != crate::ledger::TreeState::Ambiguous {
            self.ledger.set_state(
                tree,
                crate::ledger::TreeState::Ambiguous,
                Some("recorded late"),
            )?;
        }
        self.ledger.resolve(tree, note, &alive, by)?;
        if !alive.is_empty() {
            self.ledger.add_flag(tree, "survivors_left")?;
        }
        self.forget_ambiguous(tree.0);
        if alive.is_empty()
            && let Some(dir) = row.cgroup.as_deref()
        {
            teardown::remove_cgroup(self.host(), std::path::Path::new(dir));
        }
        Ok(())
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

    /// Marks a tree unsettled at once: in memory, and as a marker file that
    /// names its survivors (see [`markers`]). It stays until the tree is
    /// settled.
    fn mark_ambiguous(
        &self,
        tree: i64,
        reason: &str,
        survivors: &[crate::ledger::IdentityRecord],
        pending: &[crate::ledger::Deferred],
    ) {
        if let Ok(mut set) = self.ambiguous.lock() {
            set.insert(tree);
        }
        // Merged with what an earlier marker of this tree still holds: its
        // survivors and its unreplayed evidence are never dropped (the same
        // teardown passes its growing journal more than once).
        let old = markers::read(&self.data_dir, tree).unwrap_or_default();
        let mut all_survivors = old.survivors;
        for s in survivors {
            if !all_survivors.contains(s) {
                all_survivors.push(s.clone());
            }
        }
        let mut all_pending = old.pending;
        for d in pending {
            if !all_pending.contains(d) {
                all_pending.push(d.clone());
            }
        }
        let batch = if old.batch.is_empty() && !all_pending.is_empty() {
            markers::new_batch()
        } else {
            old.batch
        };
        let marker = markers::Marker {
            reason: reason.to_string(),
            survivors: all_survivors,
            pending: all_pending,
            batch,
        };
        markers::write(&self.data_dir, tree, &marker);
    }

    /// The tree is settled (teardown verified, or resolved by an operator).
    /// Its marker goes only once the evidence it kept is in the ledger: the
    /// marker is that evidence's only copy. Callers hold the tree's lease
    /// (or the replay is skipped when another process holds it).
    fn forget_ambiguous(&self, tree: i64) {
        if let Ok(mut set) = self.ambiguous.lock() {
            set.remove(&tree);
        }
        if markers::read(&self.data_dir, tree).is_some_and(|m| !m.pending.is_empty()) {
            self.replay_deferred_leased(TreeId(tree));
            if markers::read(&self.data_dir, tree).is_some_and(|m| !m.pending.is_empty()) {
                tracing::warn!(
                    tree,
                    "settled, but its deferred evidence is not in the ledger yet: the marker stays"
                );
                return;
            }
        }
        markers::remove(&self.data_dir, tree);
    }

    fn is_ambiguous_in_memory(&self, tree: i64) -> bool {
        self.ambiguous_in_memory().iter().any(|(t, _)| *t == tree)
    }

    /// The pids of the survivors an unsettled marker names for this tree
    /// that still live (what `run` tells its caller when it failed closed).
    pub fn survivors_left(&self, tree: TreeId) -> Vec<i32> {
        self.marked_survivors(tree.0)
            .into_iter()
            .filter(|id| self.host().still_alive(&id.into()))
            .map(|id| id.pid)
            .collect()
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

    /// Writes the evidence an unsettled marker kept for this tree (what a
    /// teardown could not write while the ledger refused writes), in order,
    /// then drops it from the marker, which stays until the tree is settled.
    /// Holds the tree's teardown lease, so two processes never write the
    /// same journal twice; a teardown calls [`Engine::replay_deferred_leased`]
    /// under its own lease.
    pub fn replay_deferred(&self, tree: TreeId) {
        let has_pending =
            markers::read(&self.data_dir, tree.0).is_some_and(|m| !m.pending.is_empty());
        if !has_pending {
            return;
        }
        // Not waiting for a lease held elsewhere: that teardown replays it.
        match self.teardown_lease_within(tree, std::time::Duration::ZERO) {
            Ok(Some(_lease)) => self.replay_deferred_leased(tree),
            Ok(None) => tracing::warn!(
                tree = tree.0,
                "no lease: deferred evidence not replayed now"
            ),
            Err(_) => {}
        }
    }

    /// For readers (`ls`, `show`): writes the evidence every unsettled
    /// marker kept, if the ledger takes writes now, so what they show is the
    /// whole trail. A tree whose teardown is running (its lease is held) is
    /// skipped: that teardown writes it. Cheap when there is no marker.
    pub fn settle_record(&self) {
        for (tree, marker) in markers::all(&self.data_dir) {
            if !marker.pending.is_empty() {
                self.replay_deferred(TreeId(tree));
            }
        }
    }

    pub(crate) fn replay_deferred_leased(&self, tree: TreeId) {
        let Some(mut marker) = markers::read(&self.data_dir, tree.0) else {
            return;
        };
        if marker.pending.is_empty() {
            return;
        }
        if marker.batch.is_empty() {
            // Named (and the name kept) before the replay, so a replay whose
            // marker rewrite is lost is recognised the next time.
            marker.batch = markers::new_batch();
            markers::write(&self.data_dir, tree.0, &marker);
        }
        let batch = marker.batch.clone();
        match self.ledger.replay_deferred(tree, &marker.pending, &batch) {
            Ok(()) => {
                tracing::info!(
                    tree = tree.0,
                    writes = marker.pending.len(),
                    "deferred evidence written to the ledger"
                );
                marker.pending.clear();
                marker.batch.clear();
                markers::write(&self.data_dir, tree.0, &marker);
            }
            Err(e) => {
                tracing::warn!(tree = tree.0, error = %e, "deferred evidence still not written")
            }
        }
    }

    /// Retries writing pending ambiguity to the ledger (it may have refused
    /// the first time): first the evidence each marker kept, then the state.
    /// Trees the ledger now holds as ambiguous stay in memory until resolved
    /// or settled by a teardown.
    pub fn flush_ambiguous(&self) {
        for (tree, _) in self.ambiguous_in_memory() {
            let id = TreeId(tree);
            self.replay_deferred(id);
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
