//! The service behind `treewarden serve`: the owner of the trees spawned
//! through the API, their scans, the periodic sweep, owner watches, and a
//! bounded graceful shutdown.
//!
//! The engine is blocking (it sleeps through graces and waits on the ledger's
//! owner thread), so every call into it runs on tokio's blocking pool; the
//! async side only waits and selects; HTTP is put in front of it by
//! [`crate::serve`].
//!
//! What runs, and why:
//! - one **watch task per owned tree** selects over the root's exit (the
//!   reaper's notice for a root this service spawned, which holds no
//!   descriptor; a pidfd for one adopted after a restart), the client owner's exit (a pidfd: the tree is torn down within a
//!   second of it), the tree's timeout, and its end; whichever comes first
//!   starts the one teardown;
//! - the **scan loop** keeps a [`HostView`] current cheaply and ticks every
//!   watched tree against it: targeted re-reads every `scan_interval`
//!   (members, leaders, `cgroup.procs`, and only the `/proc` entries that are
//!   new), a full `/proc` re-read every `full_scan_interval`. It also tails the
//!   ledger's events into the metrics;
//! - **recovery**: the start-up sweep runs in the background, after the
//!   listener is open and the signal handlers are installed, so `/healthz`
//!   answers at once whatever the ledger holds; `/readyz` says whether it
//!   still runs, and the dashboard and `treewarden_orphans_pending` show
//!   its progress. Orphans are torn down concurrently (`sweep_concurrency`
//!   at once), each with the grace recorded on its row;
//! - the **sweep loop** runs the orphan sweep every `sweep_interval` after
//!   that, skipping the trees this service owns, whose owners it watches
//!   itself.
//!
//! Shutdown: the cancellation token stops the listener and the loops; the
//! spawn gate closes (waiting for spawns in flight, so none is missed); every
//! owned tree is torn down concurrently with its grace capped at
//! `shutdown_grace`, but a client's tree whose owner process lives, which
//! is left running (logged) for the next start to adopt; the whole drain is bounded by `drain_timeout` so the
//! service never outlives a supervisor's kill window. A sweep running at
//! SIGTERM (recovery included) starts no further teardown; those in flight
//! finish within the drain, and any the bound cuts off stay in the state
//! the ledger records (`terminating`), which the next start resumes.
//!
//! Architecture Invariant: the service never signals or waits for a process
//! itself; teardowns go through `Engine::teardown`, exits through the
//! process-wide [`Reaper`]. Two teardowns of one tree never run at once in
//! this process (a per-tree lock).
//!
//! On Windows the same code runs over the `proc` seam: the exit
//! watches are thread-pool waits on process handles (`proc::ExitWatch`,
//! `Reaper::on_exit`) where Linux has pidfds and the reaper, the scan
//! loop's `HostView` is a toolhelp snapshot, free space is
//! `GetDiskFreeSpaceExW`; no inotify log cap (the tick's cap), no systemd
//! notify, no observer. `serve` listens on TCP on loopback only there.

mod admit;
mod door;
mod drain;
mod export;
pub mod failure;
// The fleet's consumer (`fleet serve`): its own tree, built with the service
// because it reads the stream with `nats.rs`.
#[path = "../fleet/mod.rs"]
pub mod fleet;
/// The logs' cap as they are written: inotify on Linux; none on Windows
/// (`logcap_tick.rs`: the scan tick caps them).
#[cfg_attr(windows, path = "logcap_tick.rs")]
mod logcap;
mod logkeep;
pub mod metrics;
pub mod nats;
mod recovery;
pub mod retain;
mod scan;
pub mod seal;
pub mod ship;
mod spawn;
pub mod users;
pub mod vocab;
mod watch;

pub use admit::Reservation;
pub use door::{Door, ListedTree, MetricsReadings, TreeListView, TreePanelView};
pub use export::ExportChunks;
pub use logkeep::EndedLogs;
use scan::start_observer;
use watch::{RootWatch, watch_tree};

use std::collections::{HashMap, HashSet};
use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::custody::policy::{self, EndCause};
use crate::custody::{
    Action, CustodyError, Engine, OwnerWatch, SpawnRequest, SweepCounts, SweepOptions,
    SweepProgress, TeardownOptions, TeardownReport, TreeWatch, Watched,
};
use crate::ledger::{EventFilter, LedgerError, OwnerKind, TreeId, TreeRow, TreeState};
use crate::proc::{ExitStatus, Identity, Reaper, SpawnStdio, sd_notify};
use crate::scan::HostView;
pub use metrics::Metrics;

/// Waits for a service thread already told to stop; a panic in it is
/// logged as `what` panicked.
fn join(thread: std::thread::JoinHandle<()>, what: &str) {
    if thread.join().is_err() {
        tracing::error!("{what} panicked");
    }
}

/// How often the service looks for teardowns that failed closed and whose
/// owner is gone, to finish them ([`crate::custody::Sweeper::settle_failed_closed`]).
const FAILED_CLOSED_CHECK: std::time::Duration = std::time::Duration::from_secs(2);

/// How the service runs. Built by the CLI from `serve`'s flags.
#[derive(Clone, Debug)]
pub struct ServiceConfig {
    pub listen: SocketAddr,
    /// Targeted scans of watched trees.
    pub scan_interval: Duration,
    /// Full `/proc` re-reads (catches pid reuse and anything a targeted
    /// scan cannot see).
    pub full_scan_interval: Duration,
    pub sweep_interval: Duration,
    /// Orphan teardowns a sweep (recovery included) runs at once.
    pub sweep_concurrency: usize,
    /// Grace of API trees that name none, and of orphans whose row records
    /// none (trees recorded before migration 0002).
    pub default_grace: Duration,
    /// Cap on each tree's grace during shutdown.
    pub shutdown_grace: Duration,
    /// Bound on the whole shutdown drain.
    pub drain_timeout: Duration,
    /// Where the bound address is written once the service accepts requests.
    pub ready_file: Option<PathBuf>,
    /// When non-empty, `argv[0]` of an API spawn must be one of these.
    pub allow_commands: Vec<String>,
    /// With `allow_commands`: the only variables a request's `env` may set
    /// (`serve --allow-env`); see [`allowlisted_env`].
    pub allow_env: Vec<String>,
    /// Whether the proc-connector observer runs beside the scans.
    pub observer: crate::config::ObserverMode,
    /// Its socket's receive buffer (0: the default).
    pub observer_rcvbuf: usize,
    /// Cap on each API tree's captured output (`<data-dir>/logs/`): the
    /// oldest bytes are dropped past it.
    pub log_max: u64,
    /// Free space the data dir keeps for the ledger: below it, new logged
    /// spawns are refused (503) before the ledger's own writes could fail
    /// (`serve --min-free`).
    pub min_free: u64,
    /// Live trees one non-admin principal (a uid on the socket, a token)
    /// may hold at once (`serve --max-trees-per-user`).
    pub max_trees_per_principal: usize,
    /// The longest grace a request may ask for (`serve --max-grace`).
    pub max_grace: Duration,
    /// Bounds on ended trees' captured logs, per principal and by age
    /// (`serve --ended-logs-per-user`, `--ended-logs-for`; `logkeep.rs`).
    pub ended_logs: EndedLogs,
}

/// Errors of the service layer; the HTTP layer maps each to a status.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error(transparent)]
    Custody(#[from] CustodyError),
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    /// The request itself is not acceptable (bad owner, command not allowed).
    #[error("{0}")]
    Invalid(String),
    /// The service is draining: no new work.
    #[error("the service is shutting down")]
    ShuttingDown,
    /// Not now: a bound of the host or of the principal is reached (the
    /// data dir's free-space floor, the live trees one principal may hold).
    #[error("{0}")]
    Busy(String),
    /// A blocking task panicked or was cancelled.
    #[error("internal task failed: {0}")]
    Task(String),
}

/// What a client asks the service to spawn (already parsed and validated
/// for shape by the HTTP layer).
#[derive(Clone, Debug)]
pub struct SpawnParams {
    pub argv: Vec<String>,
    pub label: Option<String>,
    pub cwd: Option<PathBuf>,
    /// Added to the service's own environment.
    pub env: Vec<(String, String)>,
    pub grace: Option<Duration>,
    pub timeout: Option<Duration>,
    pub owner_pid: Option<i32>,
    /// When given, the owner's start time must match (clock ticks).
    pub owner_start_ticks: Option<u64>,
    /// Limits for the tree's cgroup (refused where not enforceable).
    pub limits: crate::ledger::Limits,
    /// Who asked (recorded with the tree); `None`: nobody named.
    pub requester: Option<crate::ledger::Requester>,
    /// The user the tree runs as (set in the child before exec); `None`:
    /// the service's own credentials.
    pub run_as: Option<RunAs>,
    /// Whether the tree ends with its root or with its owner.
    pub lifetime: crate::custody::Lifetime,
    /// The teardown's first signal (`None`: SIGTERM).
    pub first_signal: Option<crate::proc::Sig>,
    /// Descriptors the client passed for the tree's 0, 1, 2 (SCM_RIGHTS on
    /// the socket); slots not given are as for a logged tree.
    pub stdio: crate::proc::GivenStdio,
}

/// A user a tree runs as: its credentials, and its name and home for the
/// environment (`None` for a uid the user database does not know).
#[derive(Clone, Debug)]
pub struct RunAs {
    pub credentials: crate::proc::Credentials,
    pub user: Option<crate::proc::UserInfo>,
}

/// The tree a [`Service::teardown`] is for: its id, and its row when the
/// caller has read it already.
#[derive(Clone, Debug)]
pub struct Torn {
    pub id: TreeId,
    pub row: Option<TreeRow>,
}

impl From<TreeId> for Torn {
    fn from(id: TreeId) -> Torn {
        Torn { id, row: None }
    }
}

impl From<TreeRow> for Torn {
    fn from(row: TreeRow) -> Torn {
        Torn {
            id: row.id,
            row: Some(row),
        }
    }
}

/// A tree this service is responsible for.
struct Owned {
    /// The client process the tree runs for (`None`: the service's own
    /// tree). A tree whose client owner lives is left running by the drain.
    client_owner: Option<Identity>,
    /// Held by a teardown of this tree; scans skip the tree while it is held.
    lock: Arc<Mutex<()>>,
    /// Cancelled when the tree has ended, to stop its watch task.
    done: CancellationToken,
}

/// The running service. Shared by the HTTP handlers and the loops.
pub struct Service {
    engine: Engine,
    /// `None` only in in-process router tests ([`Service::without_reaper`]).
    reaper: Option<&'static Reaper>,
    config: ServiceConfig,
    me: Identity,
    metrics: Metrics,
    owned: Mutex<HashMap<TreeId, Owned>>,
    /// Moves whenever a tree is added to `owned` or removed from it (the
    /// scan loop's idle tick: the same trees as at its last look).
    owned_version: std::sync::atomic::AtomicU64,
    /// Locks of teardowns of trees this service does not own (API kills).
    foreign_locks: Mutex<HashMap<TreeId, Arc<Mutex<()>>>>,
    shutdown: CancellationToken,
    tasks: TaskTracker,
    /// Spawns hold it shared; shutdown takes it exclusively and sets `true`.
    draining: tokio::sync::RwLock<bool>,
    started: Instant,
    /// The ledger head when the service started: event-fed counters count after it.
    start_seq: std::sync::atomic::AtomicI64,
    /// The proc-connector observer, when it runs: forks and setsid of
    /// members recorded as they happen. Kept to be stopped.
    observer: Mutex<Option<crate::custody::Observer>>,
    observer_handle: Option<crate::custody::ObserverHandle>,
    /// Why the observer is off (empty when it runs).
    observer_off: String,
    /// Set by the observer when the kernel dropped events: the next scan
    /// tick is a full one, so a lost event never becomes a silent gap.
    force_full: Arc<std::sync::atomic::AtomicBool>,
    /// Counters of this service's sweeps (recovery and periodic): orphans
    /// found, in flight, settled. Read by `/readyz`, the dashboard, metrics.
    sweeps: Arc<SweepProgress>,
    /// Set when the shutdown starts: sweeps start no further teardown.
    sweep_stop: Arc<AtomicBool>,
    /// Caps captured logs as they are written (started with the scan loop,
    /// stopped when the service is dropped).
    log_cap: Mutex<Option<logcap::LogCap>>,
    /// Bounds the ended trees' logs (started with the scan loop, stopped
    /// when the service is dropped).
    log_keep: Mutex<Option<logkeep::LogKeep>>,
    /// The start-up recovery sweep: running from construction until it ends.
    recovery: Mutex<RecoveryState>,
    /// Whether [`Service::start`] ran (it runs once: `run` calls it).
    started_once: AtomicBool,
    /// Bumped whenever this service learns that a tree ended (its own
    /// teardowns, resolutions, and the `tree.*` events of other processes
    /// its scan loop tails): `GET /api/trees/{id}/wait` sleeps on it.
    ends: tokio::sync::watch::Sender<u64>,
    /// Spawns in flight per principal, for the live-trees cap
    /// (`admit.rs`: reserved before the ledger's count is read).
    in_flight: Arc<admit::InFlight>,
}

/// Where the start-up recovery is.
#[derive(Clone, Debug)]
struct RecoveryState {
    running: bool,
    took: Option<Duration>,
    error: Option<String>,
}

/// The start-up recovery sweep as `/readyz`, `/healthz` and the dashboard
/// show it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct RecoveryStatus {
    /// The start-up sweep still runs (orphans of a previous instance are
    /// being torn down); the service answers meanwhile.
    pub running: bool,
    /// Orphans found by this service's sweeps, and how far they got.
    pub counts: SweepCounts,
    /// How long the start-up sweep took, once done.
    pub took: Option<Duration>,
    /// Why the start-up sweep failed, if it did (the periodic sweep retries).
    pub error: Option<String>,
}

/// Runs a blocking closure on the blocking pool.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ServiceError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ServiceError::Task(e.to_string()))
}

/// Bytes free to an unprivileged writer on the filesystem of `dir`
/// (`None` where it cannot be read: the spawn is not refused on a guess).
fn free_bytes(dir: &std::path::Path) -> Option<u64> {
    crate::proc::free_bytes(dir)
}

/// What of the environment a tree started under `serve --allow-command`
/// inherits: only the safe set — PATH (as the service has it, else a
/// default), the locale, TZ, HOME, USER, LOGNAME, SHELL. The request adds
/// only what `--allow-env` names.
pub(crate) fn allowlisted_env(base: Vec<(OsString, OsString)>) -> Vec<(OsString, OsString)> {
    let mut env: Vec<(OsString, OsString)> = base
        .into_iter()
        .filter(|(k, _)| {
            let k = k.to_string_lossy();
            matches!(
                k.as_ref(),
                "PATH" | "LANG" | "LANGUAGE" | "TZ" | "HOME" | "USER" | "LOGNAME" | "SHELL"
            ) || k.starts_with("LC_")
        })
        .collect();
    if !env.iter().any(|(k, _)| k == "PATH") {
        env.push(("PATH".into(), "/usr/local/bin:/usr/bin:/bin".into()));
    }
    env
}

impl Service {
    /// Builds the service over an engine whose reaper is installed.
    pub fn new(
        engine: Engine,
        reaper: &'static Reaper,
        config: ServiceConfig,
    ) -> Result<Arc<Self>, ServiceError> {
        Self::build(engine, Some(reaper), config)
    }

    /// A service without the process-wide reaper, for in-process router
    /// tests (`tower::ServiceExt::oneshot`) in a test binary whose other
    /// tests wait for their own children. Give it a signal-only engine: it
    /// must spawn nothing, and [`Service::run`] is not for it.
    pub fn without_reaper(
        engine: Engine,
        config: ServiceConfig,
    ) -> Result<Arc<Self>, ServiceError> {
        Self::build(engine, None, config)
    }

    fn build(
        engine: Engine,
        reaper: Option<&'static Reaper>,
        config: ServiceConfig,
    ) -> Result<Arc<Self>, ServiceError> {
        let me = crate::proc::self_identity().map_err(CustodyError::from)?;
        let force_full = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (observer, observer_off) = start_observer(&engine, &config, force_full.clone())?;
        let observer_handle = observer.as_ref().map(crate::custody::Observer::handle);
        Ok(Arc::new(Self {
            engine,
            reaper,
            config,
            me,
            metrics: Metrics::new(),
            owned: Mutex::new(HashMap::new()),
            owned_version: std::sync::atomic::AtomicU64::new(0),
            foreign_locks: Mutex::new(HashMap::new()),
            shutdown: CancellationToken::new(),
            tasks: TaskTracker::new(),
            draining: tokio::sync::RwLock::new(false),
            started: Instant::now(),
            start_seq: std::sync::atomic::AtomicI64::new(0),
            observer: Mutex::new(observer),
            observer_handle,
            observer_off,
            force_full,
            sweeps: Arc::new(SweepProgress::default()),
            sweep_stop: Arc::new(AtomicBool::new(false)),
            log_cap: Mutex::new(None),
            log_keep: Mutex::new(None),
            recovery: Mutex::new(RecoveryState {
                running: true,
                took: None,
                error: None,
            }),
            started_once: AtomicBool::new(false),
            ends: tokio::sync::watch::Sender::new(0),
            in_flight: Arc::new(admit::InFlight::default()),
        }))
    }

    /// A receiver that changes whenever a tree may have ended (see
    /// [`Service::ends`]'s field): a waiter reads the tree, then awaits
    /// `changed()`, so no end between the two is missed.
    pub fn ends(&self) -> tokio::sync::watch::Receiver<u64> {
        self.ends.subscribe()
    }

    fn note_ended(&self) {
        self.ends.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// The start-up recovery: still running or not, orphans found and
    /// pending (cumulative over this service's sweeps).
    pub fn recovery(&self) -> RecoveryStatus {
        let r = self
            .recovery
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        RecoveryStatus {
            running: r.running,
            counts: self.sweeps.counts(),
            took: r.took,
            error: r.error,
        }
    }

    /// The options of this service's sweeps: its own trees skipped, its
    /// counters, its stop flag.
    fn sweep_options(&self) -> SweepOptions {
        SweepOptions {
            default_grace: self.config.default_grace,
            concurrency: self.config.sweep_concurrency,
            skip: self.owned_trees().into_iter().collect(),
            progress: Some(self.sweeps.clone()),
            stop: Some(self.sweep_stop.clone()),
            ..SweepOptions::new(self.config.default_grace)
        }
    }

    /// The observer's health, or why it is off.
    pub fn observer_status(&self) -> Result<crate::custody::ObserverStats, String> {
        match &self.observer_handle {
            Some(h) => Ok(h.stats()),
            None => Err(self.observer_off.clone()),
        }
    }

    /// Copies the engine's counters and held-handle budget into the
    /// metrics (read by `/metrics` before it encodes).
    pub fn sync_engine_metrics(&self) {
        self.metrics.sync_stats(self.engine.stats());
        self.metrics.sync_holds(self.engine.holds());
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    pub fn config(&self) -> &ServiceConfig {
        &self.config
    }

    pub fn uptime(&self) -> Duration {
        self.started.elapsed()
    }

    /// The token whose cancellation starts the shutdown.
    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// Appends a free-standing audit event (`kill.requested`: who asked).
    pub async fn record(
        &self,
        tree: Option<TreeId>,
        event: crate::ledger::Event,
    ) -> Result<i64, ServiceError> {
        let engine = self.engine.clone();
        Ok(blocking(move || engine.ledger().append_event(tree, event)).await??)
    }

    /// Ids of the trees this service owns now.
    pub fn owned_trees(&self) -> Vec<TreeId> {
        let mut v: Vec<TreeId> = self.lock_owned().keys().copied().collect();
        v.sort_unstable();
        v
    }

    fn lock_owned(&self) -> std::sync::MutexGuard<'_, HashMap<TreeId, Owned>> {
        // A poisoned map is still a valid map: a panicking holder changed nothing half-way.
        self.owned.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn tree_lock(&self, tree: TreeId) -> Arc<Mutex<()>> {
        if let Some(o) = self.lock_owned().get(&tree) {
            return o.lock.clone();
        }
        self.foreign_locks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(tree)
            .or_default()
            .clone()
    }

    /// Tears a tree down (any tree in the ledger, owned or not), with the
    /// grace asked for, else the one recorded with the tree (its row: the one
    /// source of truth), never above `cap` (the drain's shutdown grace).
    /// One teardown per tree at a time. `tree` is an id, or the row the
    /// caller has just read (a kill: the row its authorization read), which
    /// is then not read again here.
    pub async fn teardown(
        &self,
        tree: impl Into<Torn>,
        asked: Option<Duration>,
        cap: Option<Duration>,
        cause: EndCause,
        reason: String,
    ) -> Result<TeardownReport, ServiceError> {
        let Torn {
            id: tree,
            row: known,
        } = tree.into();
        let origin = cause.service_origin();
        let root_exit = cause.root_exit();
        let lock = self.tree_lock(tree);
        let engine = self.engine.clone();
        let origin_label = cause.label();
        let default = self.config.default_grace;
        let result = blocking(move || {
            let _held = lock.lock().unwrap_or_else(|e| e.into_inner());
            // What is taken from the row here (the recorded grace, the first
            // signal) is written once, at the spawn, so a row the caller read
            // before the lock serves as well as a fresh one. The state, the
            // members and the authority to kill are read again under the
            // teardown's lease by `Engine::teardown`: those reads stay.
            let row = match known {
                Some(row) => row,
                None => engine
                    .ledger()
                    .tree(tree)?
                    .ok_or(CustodyError::UnknownTree(tree))?,
            };
            let grace = policy::Grace::for_tree(&row, asked, default, cap);
            let mut opts = TeardownOptions::new(grace, reason, origin);
            opts.root_exit = root_exit;
            // The first signal the tree was given (`first_signal`), as the
            // sweep sends it: from the row just read.
            if let Some(sig) = row
                .first_signal
                .as_ref()
                .and_then(|s| crate::proc::Sig::parse_first(s.as_str()).ok())
            {
                opts.first_signal = sig;
            }
            engine.teardown(tree, &opts, &mut |_| {})
        })
        .await?;
        if let Ok(report) = &result {
            // A tree found already ended (its root's exit raced a kill) is
            // not a teardown worth timing.
            if report.members_at_start > 0 || !report.phases.is_empty() {
                self.metrics
                    .teardown_duration
                    .get_or_create(&metrics::OriginLabel {
                        origin: origin_label.into(),
                    })
                    .observe(report.elapsed.as_secs_f64());
            }
            if report.state.is_terminal() {
                self.forget(tree);
            }
        }
        Ok(result?)
    }

    fn forget(&self, tree: TreeId) {
        if let Some(o) = self.lock_owned().remove(&tree) {
            self.owned_version
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            o.done.cancel();
        }
        self.note_ended();
        if let Some(h) = &self.observer_handle {
            h.unwatch(tree);
        }
        self.foreign_locks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&tree);
    }

    /// Records an operator's resolution (reopens dispatch), and who made it.
    pub async fn resolve(
        &self,
        tree: TreeId,
        note: String,
        force: bool,
        by: Option<crate::ledger::Requester>,
    ) -> Result<(), ServiceError> {
        let engine = self.engine.clone();
        blocking(move || {
            engine
                .ambiguity()
                .resolve_by(tree, &note, force, by.as_ref())
        })
        .await??;
        self.forget(tree);
        Ok(())
    }

    /// Start-up: adopt the client trees a previous service left (their
    /// owners still live), start the loops, and start the recovery sweep in
    /// the background (it does not hold up the listener).
    /// Runs once; [`Service::run`] calls it, a second call does nothing.
    pub async fn start(self: &Arc<Self>) -> Result<(), ServiceError> {
        if self.started_once.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        // Event-fed counters start here, so the start-up sweep is counted.
        let engine = self.engine.clone();
        let head = blocking(move || engine.ledger().head()).await??;
        self.start_seq.store(
            head.map_or(0, |(seq, _)| seq),
            std::sync::atomic::Ordering::Relaxed,
        );
        let engine = self.engine.clone();
        let live = blocking(move || engine.ledger().nonterminal_trees()).await??;
        for row in live {
            // A client tree whose teardown the previous instance had begun
            // (an API kill, its root's exit, its timeout) while its owner
            // lives: the sweep leaves it alone (the owner is alive), so it
            // is adopted and its teardown resumed here.
            let interrupted = matches!(row.state, TreeState::Terminating | TreeState::Killing);
            if row.owner.kind == OwnerKind::Client
                && (interrupted || matches!(row.state, TreeState::Running | TreeState::Spawning))
            {
                let owner = Identity {
                    pid: row.owner.pid,
                    start_ticks: row.owner.start,
                    boot_id: row.owner.boot_id.clone(),
                };
                let fd = crate::proc::open_exit_watch(&owner).ok().flatten();
                let Some(fd) = fd else { continue };
                tracing::info!(
                    tree = row.id.0,
                    owner = row.owner.pid,
                    "adopted a client tree"
                );
                // The root's exit is watched again too, and the tree keeps
                // the grace and timeout recorded with it (the timeout counts
                // from its creation; one already past ends it now).
                let root = row.root().map(|r| Identity {
                    pid: r.pid,
                    start_ticks: r.start_ticks,
                    boot_id: r.boot_id,
                });
                let timeout = row.timeout().map(|t| {
                    let age = humantime::parse_rfc3339(&row.created_at)
                        .ok()
                        .and_then(|c| std::time::SystemTime::now().duration_since(c).ok())
                        .unwrap_or_default();
                    t.saturating_sub(age)
                });
                // A tree spawned with `"lifetime": "owner"` keeps it (its
                // root may have exited already: the tree is kept).
                let lifetime = if row.has_flag(&crate::ledger::TreeFlag::LifetimeOwner) {
                    crate::custody::Lifetime::Owner
                } else {
                    crate::custody::Lifetime::Root
                };
                self.adopt(
                    row.id,
                    Some(owner.clone()),
                    root,
                    Some(fd),
                    timeout,
                    lifetime,
                );
                if interrupted {
                    let this = self.clone();
                    let tree = row.id;
                    self.tasks.spawn(async move {
                        let reason = EndCause::Resume.reason();
                        if let Err(e) = this
                            .teardown(tree, None, None, EndCause::Resume, reason)
                            .await
                        {
                            // The watch task still tears it down when its owner exits.
                            tracing::warn!(tree = tree.0, error = %e, "resumed teardown not settled");
                        }
                    });
                }
            }
        }
        let log_cap =
            logcap::LogCap::start(&self.engine.data_dir().join("logs"), self.config.log_max);
        *self
            .log_cap
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = log_cap;
        *self
            .log_keep
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = logkeep::LogKeep::start(
            self.engine.data_dir().join("logs"),
            self.engine.ledger().clone(),
            self.config.ended_logs,
        );
        let this = self.clone();
        self.tasks.spawn(async move { this.scan_loop().await });
        // Recovery, then the periodic sweeps: one sweep at a time.
        let this = self.clone();
        self.tasks.spawn(async move {
            this.recover().await;
            this.sweep_loop().await
        });
        Ok(())
    }
}

impl Service {
    /// Starts the service ([`Self::start`]: recovery in the background) and
    /// runs until the shutdown token is cancelled (SIGTERM/SIGINT, as
    /// [`crate::serve`] wires them), then drains, and waits (within
    /// what is left of the drain bound) for `servers`, the listeners
    /// [`crate::serve`] runs on the same token. Listeners and signals
    /// are injected, so tests and the CLI drive the same code. Returns
    /// whether the drain settled every owned tree in time.
    pub async fn run(
        self: &Arc<Self>,
        servers: Vec<tokio::task::JoinHandle<std::io::Result<()>>>,
    ) -> bool {
        let token = self.shutdown.clone();
        {
            // No orphan teardown starts once the shutdown begins (the drain
            // sets it too; this is earlier by the drain's first awaits).
            let (token, stop) = (token.clone(), self.sweep_stop.clone());
            tokio::spawn(async move {
                token.cancelled().await;
                stop.store(true, Ordering::SeqCst);
            });
        }
        // Start-up runs while the listeners already answer; its recovery
        // sweep runs in the background.
        let mut start_failed = false;
        if let Err(e) = self.start().await {
            tracing::error!(error = %e, "start-up failed; shutting down");
            start_failed = true;
            token.cancel();
        } else {
            // systemd `Type=notify`: ready once the listener answers and
            // the recovery has begun (not when it ends: it may take a grace).
            sd_notify_state(&[
                sd_notify::NotifyState::Ready,
                sd_notify::NotifyState::Status("serving; recovery in the background"),
            ]);
        }
        token.cancelled().await;
        sd_notify_state(&[
            sd_notify::NotifyState::Stopping,
            sd_notify::NotifyState::Status("draining: tearing down the trees it owns"),
        ]);
        let started = Instant::now();
        let settled = self.drain().await && !start_failed;
        let left = self.config.drain_timeout.saturating_sub(started.elapsed());
        let all = futures_util::future::join_all(servers);
        match tokio::time::timeout(left.max(Duration::from_millis(100)), all).await {
            Ok(results) => {
                for r in results {
                    match r {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => tracing::error!(error = %e, "HTTP server failed"),
                        Err(e) => tracing::error!(error = %e, "HTTP server task failed"),
                    }
                }
            }
            Err(_) => tracing::warn!("HTTP connections still open at the end of the drain"),
        }
        tracing::info!(settled, "shutdown complete");
        settled
    }
}

/// Tells systemd (`NOTIFY_SOCKET`, under `Type=notify`) how the service is;
/// nothing without the variable. A failure is logged, never fatal.
fn sd_notify_state(state: &[sd_notify::NotifyState<'_>]) {
    if let Err(e) = sd_notify::notify(state) {
        tracing::warn!(error = %e, "sd_notify failed");
    }
}
