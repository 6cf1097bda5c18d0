//! The service behind `treewarden serve`: the owner of the trees spawned
//! through the API, their scans, the periodic sweep, owner watches, and a
//! bounded graceful shutdown.
//!
//! The engine is blocking (it sleeps through graces and waits on the ledger's
//! owner thread), so every call into it runs on tokio's blocking pool; the
//! async side only waits, selects and serves HTTP (`crate::http`).
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

mod export;
mod logcap;
pub mod metrics;
pub mod retain;
pub mod seal;
pub mod serve;
pub mod ship;

pub use export::ExportChunks;

use std::collections::{HashMap, HashSet};
use std::ffi::OsString;
use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::custody::policy::{self, EndCause};
use crate::custody::{
    CustodyError, Engine, SpawnRequest, SweepCounts, SweepOptions, SweepProgress, TeardownOptions,
    TeardownReport, TreeWatch,
};
use crate::ledger::{EventFilter, LedgerError, OwnerKind, TreeId, TreeRow, TreeState};
use crate::proc::{ExitStatus, Identity, Reaper, SpawnStdio};
use crate::scan::HostView;
pub use metrics::Metrics;

/// How often the service looks for teardowns that failed closed and whose
/// owner is gone, to finish them ([`crate::custody::Engine::settle_failed_closed`]).
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
    owned: Mutex<HashMap<i64, Owned>>,
    /// Locks of teardowns of trees this service does not own (API kills).
    foreign_locks: Mutex<HashMap<i64, Arc<Mutex<()>>>>,
    shutdown: CancellationToken,
    tasks: TaskTracker,
    /// Spawns hold it shared; shutdown takes it exclusively and sets `true`.
    draining: tokio::sync::RwLock<bool>,
    started: Instant,
    /// The ledger head when the service started: event-fed counters count after it.
    start_seq: std::sync::atomic::AtomicI64,
    /// The proc-connector observer, when it runs: forks and setsid of
    /// members recorded as they happen (issue 8). Kept to be stopped.
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
    /// The start-up recovery sweep: running from construction until it ends.
    recovery: Mutex<RecoveryState>,
    /// Whether [`Service::start`] ran (it runs once: `run` calls it).
    started_once: AtomicBool,
    /// Bumped whenever this service learns that a tree ended (its own
    /// teardowns, resolutions, and the `tree.*` events of other processes
    /// its scan loop tails): `GET /api/trees/{id}/wait` sleeps on it.
    ends: tokio::sync::watch::Sender<u64>,
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
    let st = rustix::fs::statvfs(dir).ok()?;
    Some(st.f_bavail.saturating_mul(st.f_frsize))
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
            recovery: Mutex::new(RecoveryState {
                running: true,
                took: None,
                error: None,
            }),
            started_once: AtomicBool::new(false),
            ends: tokio::sync::watch::Sender::new(0),
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

    pub fn engine(&self) -> &Engine {
        &self.engine
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

    /// Runs a blocking read against the engine (ledger reads, dispatch gate).
    pub async fn read<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Engine) -> Result<T, ServiceError> + Send + 'static,
    ) -> Result<T, ServiceError> {
        let engine = self.engine.clone();
        blocking(move || f(&engine)).await?
    }

    /// Ids of the trees this service owns now.
    pub fn owned_trees(&self) -> Vec<i64> {
        let mut v: Vec<i64> = self.lock_owned().keys().copied().collect();
        v.sort_unstable();
        v
    }

    fn lock_owned(&self) -> std::sync::MutexGuard<'_, HashMap<i64, Owned>> {
        // A poisoned map is still a valid map: a panicking holder changed nothing half-way.
        self.owned.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn tree_lock(&self, tree: i64) -> Arc<Mutex<()>> {
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

    /// Spawns a tree for a client (or for the service itself when no
    /// `owner_pid` is given) and starts watching it.
    /// Spawns a tree and takes it into custody. The work runs in its own
    /// task: a client that disconnects (or a request that times out) drops
    /// only the wait for the answer, never the step between "the tree
    /// runs" and "the tree is watched".
    pub async fn spawn(self: &Arc<Self>, p: SpawnParams) -> Result<TreeRow, ServiceError> {
        let this = self.clone();
        tokio::spawn(async move { this.spawn_and_adopt(p).await })
            .await
            .map_err(|e| ServiceError::Task(e.to_string()))?
    }

    async fn spawn_and_adopt(self: &Arc<Self>, p: SpawnParams) -> Result<TreeRow, ServiceError> {
        let gate = self.draining.read().await;
        if *gate {
            return Err(ServiceError::ShuttingDown);
        }
        // The ledger keeps its reserve: a tree that logs into the data dir
        // is refused while its free space is under the floor, so a tree
        // filling the disk through its own output cannot make the next
        // authorization fail (issue 24).
        if let Some(free) = free_bytes(self.engine.data_dir())
            && free < self.config.min_free
        {
            return Err(ServiceError::Busy(format!(
                "{} has {} MiB free, under the floor of {} MiB the ledger keeps (serve --min-free): no new logged tree",
                self.engine.data_dir().display(),
                free >> 20,
                self.config.min_free >> 20
            )));
        }
        if !self.config.allow_commands.is_empty()
            && !self.config.allow_commands.iter().any(|c| *c == p.argv[0])
        {
            return Err(ServiceError::Invalid(format!(
                "command {:?} is not allowed here (serve --allow-command)",
                p.argv[0]
            )));
        }
        // With an allowlist of commands the environment is an allowlist
        // too: a denylist of PATH and LD_* let BASH_ENV, SHELLOPTS + PS4 run
        // code before an allowed script (issue 24).
        if !self.config.allow_commands.is_empty()
            && let Some((k, _)) = p
                .env
                .iter()
                .find(|(k, _)| !self.config.allow_env.iter().any(|a| a == k))
        {
            return Err(ServiceError::Invalid(format!(
                "env {k} may not be set while serve --allow-command restricts commands (name it with --allow-env)"
            )));
        }
        // The owner's identity is read now, and its exit watch opened before
        // the tree exists: there is no moment when the tree runs unwatched.
        let (owner, kind, owner_fd) = match p.owner_pid {
            None => (self.me.clone(), OwnerKind::Service, None),
            Some(pid) => {
                let gone =
                    || ServiceError::Invalid(format!("owner_pid {pid} is not a live process"));
                // Whatever the kernel says about a pid a client chose (a
                // thread id, a kernel thread, a race with its exit) is a bad
                // request, not a server fault.
                let id = crate::proc::identity_of(pid)
                    .ok()
                    .flatten()
                    .ok_or_else(gone)?;
                let kernel_thread = pid == 2
                    || crate::proc::read_stat(pid)
                        .ok()
                        .flatten()
                        .is_some_and(|s| s.ppid == 2);
                if kernel_thread {
                    return Err(ServiceError::Invalid(format!(
                        "owner_pid {pid} is a kernel thread: it never exits"
                    )));
                }
                if let Some(start) = p.owner_start_ticks
                    && start != id.start_ticks
                {
                    return Err(ServiceError::Invalid(format!(
                        "owner_pid {pid} started at tick {}, not {start}: a different process",
                        id.start_ticks
                    )));
                }
                if pid == self.me.pid {
                    return Err(ServiceError::Invalid(
                        "owner_pid is the service itself: omit owner_pid".into(),
                    ));
                }
                // A thread id that is not a process leader cannot be
                // watched (pidfd_open refuses it): not a live process.
                let fd = crate::proc::open_exit_watch(&id)
                    .ok()
                    .flatten()
                    .ok_or_else(gone)?;
                (id, OwnerKind::Client, Some(fd))
            }
        };
        // A tree that runs as another user does not inherit the service's
        // environment (it may hold the service's secrets: OTLP headers,
        // tokens): only PATH and the locale and time zone, then that user's
        // HOME, USER, LOGNAME and SHELL; and `/` as its working directory
        // when the request names none (the service's own may be closed to
        // it). The request's own variables come last and win.
        let mut cwd = p.cwd.clone();
        let mut env: Vec<(OsString, OsString)> = match &p.run_as {
            None => std::env::vars_os().collect(),
            Some(run_as) => {
                let who = run_as.user.as_ref();
                let name: OsString = who.map_or_else(
                    || run_as.credentials.uid.to_string().into(),
                    |u| u.name.clone().into(),
                );
                let mut env: Vec<(OsString, OsString)> = std::env::vars_os()
                    .filter(|(k, _)| {
                        k == "PATH"
                            || k == "LANG"
                            || k == "TZ"
                            || k.to_string_lossy().starts_with("LC_")
                    })
                    .collect();
                if !env.iter().any(|(k, _)| k == "PATH") {
                    env.push(("PATH".into(), "/usr/local/bin:/usr/bin:/bin".into()));
                }
                env.extend([
                    (
                        "HOME".into(),
                        who.map_or_else(|| "/".into(), |u| u.home.clone().into_os_string()),
                    ),
                    ("USER".into(), name.clone()),
                    ("LOGNAME".into(), name),
                    (
                        "SHELL".into(),
                        who.map_or_else(|| "/bin/sh".into(), |u| u.shell.clone().into_os_string()),
                    ),
                ]);
                cwd.get_or_insert_with(|| PathBuf::from("/"));
                env
            }
        };
        if !self.config.allow_commands.is_empty() {
            env = allowlisted_env(env);
        }
        env.retain(|(k, _)| !p.env.iter().any(|(n, _)| OsString::from(n) == *k));
        env.extend(p.env.iter().map(|(k, v)| (k.into(), v.into())));
        let on_behalf = match (&p.requester, &p.run_as) {
            (None, None) => None,
            (requester, run_as) => Some(crate::custody::OnBehalf {
                requester: requester.clone().unwrap_or_default(),
                run_as: run_as.as_ref().map(|r| r.credentials.clone()),
            }),
        };
        let req = SpawnRequest {
            on_behalf,
            argv: p.argv.iter().map(OsString::from).collect(),
            label: p.label.clone(),
            cwd,
            env: Some(env),
            stdio: if p.stdio.0.iter().any(Option::is_some) {
                SpawnStdio::Given(p.stdio.clone())
            } else {
                SpawnStdio::Log
            },
            owner: owner.clone(),
            owner_kind: kind,
            grace: Some(p.grace.unwrap_or(self.config.default_grace)),
            timeout: p.timeout,
            limits: p.limits,
            // The unit runs the service with UMask=0077 (its own files are
            // private); the work it spawns gets the usual 022.
            umask: Some(0o022),
            first_signal: p.first_signal,
        };
        let engine = self.engine.clone();
        let lifetime = p.lifetime;
        let spawned = blocking(move || {
            let spawned = engine.spawn(&req)?;
            if lifetime == crate::custody::Lifetime::Owner {
                engine.mark_lifetime_owner(spawned.tree);
            }
            Ok::<_, CustodyError>(spawned)
        })
        .await??;
        let tree = spawned.tree;
        if let Some(h) = &self.observer_handle {
            h.watch(tree, spawned.pgid, spawned.sid, &spawned.root);
        }
        let client_owner = (kind == OwnerKind::Client).then(|| owner.clone());
        self.adopt(
            tree.0,
            client_owner,
            Some(spawned.root.clone()),
            owner_fd,
            p.timeout,
            p.lifetime,
        );
        drop(gate);
        let engine = self.engine.clone();
        let row = blocking(move || engine.ledger().tree(tree)).await??;
        row.ok_or(ServiceError::Custody(CustodyError::UnknownTree(tree.0)))
    }

    /// Registers a tree as owned and starts its watch task.
    #[allow(clippy::too_many_arguments)]
    fn adopt(
        self: &Arc<Self>,
        tree: i64,
        client_owner: Option<Identity>,
        root: Option<Identity>,
        owner_fd: Option<OwnedFd>,
        timeout: Option<Duration>,
        lifetime: crate::custody::Lifetime,
    ) {
        let done = self.shutdown.child_token();
        self.lock_owned().insert(
            tree,
            Owned {
                client_owner,
                lock: Arc::new(Mutex::new(())),
                done: done.clone(),
            },
        );
        let root_watch = root.as_ref().map(|r| RootWatch::open(self.reaper, r));
        let root_gone = matches!(root_watch, Some(RootWatch::Gone));
        let this = self.clone();
        let settled = done.clone();
        self.tasks.spawn(async move {
            let owner = owner_fd.and_then(|fd| crate::proc::ExitWatch::new(fd).ok());
            let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
            let why = watch_tree(&done, root_watch, root_gone, owner.as_ref(), deadline, timeout).await;
            let Some(mut why) = why else {
                return;
            };
            // `"lifetime": "owner"`: the root's exit is recorded and the
            // tree kept while anything of it runs, until its owner exits,
            // its timeout fires, or it is killed (`done`).
            let mut kept_root_exit = None;
            if let (EndCause::RootExited(_), crate::custody::Lifetime::Owner, Some(r)) =
                (&why, lifetime, &root)
            {
                let (engine, reaper, r) = (this.engine.clone(), this.reaper, r.clone());
                let kept = blocking(move || {
                    let status = reaper.and_then(|rp| rp.wait_exit(r.pid, Some(Duration::from_secs(1))));
                    let empty = engine.tree_empty_now(TreeId(tree));
                    if !empty {
                        engine.record_root_exit_kept(TreeId(tree), &r, status);
                    }
                    (status, empty)
                })
                .await;
                if let Ok((status, false)) = kept {
                    kept_root_exit = status;
                    let Some(end) = this.watch_kept(&done, tree, owner.as_ref(), deadline, timeout).await else {
                        return;
                    };
                    why = end;
                }
            }
            let root_exit = match (&why, &root) {
                _ if kept_root_exit.is_some() => kept_root_exit,
                (EndCause::RootExited(_), Some(r)) if this.reaper.is_some() => {
                    let reaper = this.reaper;
                    let pid = r.pid;
                    blocking(move || {
                        reaper.and_then(|r| r.wait_exit(pid, Some(Duration::from_secs(1))))
                    })
                        .await
                        .ok()
                        .flatten()
                }
                _ => None,
            };
            // The root's status, now that it is known (or still not).
            if let EndCause::RootExited(status) = &mut why {
                *status = root_exit;
            }
            let why = why;
            let reason = why.reason();
            // The sweep leaves owned trees alone, so this task is the one
            // that must see the teardown through: a ledger that refused a
            // write, a lease held elsewhere, survivors — try again, backing
            // off, until the tree is settled (or resolved, or the drain takes
            // over at shutdown).
            let mut backoff = Duration::from_secs(1);
            loop {
                match this
                    .teardown(tree, None, None, why.clone(), reason.clone())
                    .await
                {
                    Ok(r) if r.state.is_terminal() => return,
                    Ok(r) => tracing::warn!(tree, state = %r.state, "teardown left the tree unsettled; retrying"),
                    Err(e) => tracing::error!(tree, error = %e, retry_in = ?backoff, "teardown after {why:?} failed; retrying"),
                }
                tokio::select! {
                    _ = settled.cancelled() => return,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(60));
            }
        });
    }

    /// A kept tree (`"lifetime": "owner"`) after its root exited: waits
    /// for its owner's exit or its timeout, checking every scan interval
    /// whether anything of it still runs (an empty tree ends, as
    /// `RootExited`). `None` when it ended otherwise (killed, shutdown).
    async fn watch_kept(
        &self,
        done: &CancellationToken,
        tree: i64,
        owner: Option<&crate::proc::ExitWatch>,
        deadline: Option<tokio::time::Instant>,
        timeout: Option<Duration>,
    ) -> Option<EndCause> {
        let mut every = tokio::time::interval(self.config.scan_interval);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        every.tick().await;
        loop {
            tokio::select! {
                _ = done.cancelled() => return None,
                _ = exited(owner) => return Some(EndCause::OwnerExited),
                _ = until(deadline) => return Some(EndCause::Timeout(timeout.unwrap_or_default())),
                _ = every.tick() => {}
            }
            let engine = self.engine.clone();
            if let Ok(true) = blocking(move || engine.tree_empty_now(TreeId(tree))).await {
                return Some(EndCause::RootExited(None));
            }
        }
    }

    /// Tears a tree down (any tree in the ledger, owned or not), with the
    /// grace asked for, else the one recorded with the tree (its row: the one
    /// source of truth), never above `cap` (the drain's shutdown grace).
    /// One teardown per tree at a time.
    pub async fn teardown(
        &self,
        tree: i64,
        asked: Option<Duration>,
        cap: Option<Duration>,
        cause: EndCause,
        reason: String,
    ) -> Result<TeardownReport, ServiceError> {
        let origin = cause.service_origin();
        let root_exit = cause.root_exit();
        let lock = self.tree_lock(tree);
        let engine = self.engine.clone();
        let origin_label = cause.label();
        let default = self.config.default_grace;
        let result = blocking(move || {
            let _held = lock.lock().unwrap_or_else(|e| e.into_inner());
            let row = engine
                .ledger()
                .tree(TreeId(tree))?
                .ok_or(CustodyError::UnknownTree(tree))?;
            let grace = policy::Grace::for_tree(&row, asked, default, cap);
            let mut opts = TeardownOptions::new(grace, reason, origin);
            opts.root_exit = root_exit;
            // The first signal the tree was given (`first_signal`), as the
            // sweep sends it.
            if let Ok(Some(row)) = engine.ledger().tree(TreeId(tree))
                && let Some(sig) = row
                    .first_signal
                    .as_deref()
                    .and_then(|s| crate::proc::Sig::parse_first(s).ok())
            {
                opts.first_signal = sig;
            }
            engine.teardown(TreeId(tree), &opts, &mut |_| {})
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

    fn forget(&self, tree: i64) {
        if let Some(o) = self.lock_owned().remove(&tree) {
            o.done.cancel();
        }
        self.note_ended();
        if let Some(h) = &self.observer_handle {
            h.unwatch(TreeId(tree));
        }
        self.foreign_locks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&tree);
    }

    /// Records an operator's resolution (reopens dispatch), and who made it.
    pub async fn resolve(
        &self,
        tree: i64,
        note: String,
        force: bool,
        by: Option<crate::ledger::Requester>,
    ) -> Result<(), ServiceError> {
        let engine = self.engine.clone();
        blocking(move || engine.resolve_by(TreeId(tree), &note, force, by.as_ref())).await??;
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
            if row.owner.owner_kind() == Some(OwnerKind::Client)
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
                    tree = row.id,
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
                let lifetime = if row
                    .flags
                    .iter()
                    .any(|f| f == crate::custody::LIFETIME_OWNER_FLAG)
                {
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
                            tracing::warn!(tree, error = %e, "resumed teardown not settled");
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

    /// The start-up sweep: orphans of a previous instance (or of `run`
    /// processes that died) torn down concurrently, each with its recorded
    /// grace, while the service answers requests.
    async fn recover(self: &Arc<Self>) {
        let t0 = Instant::now();
        if self.shutdown.is_cancelled() {
            // A signal before the recovery began: the next start does it.
            let mut r = self.recovery.lock().unwrap_or_else(|e| e.into_inner());
            r.running = false;
            r.error = Some("not started: the service is shutting down".into());
            return;
        }
        let engine = self.engine.clone();
        let opts = self.sweep_options();
        let result = blocking(move || engine.sweep_with(&opts)).await;
        let error = match result {
            Ok(Ok(report)) => {
                let settled = report.orphans.iter().filter(|o| o.error.is_none()).count();
                tracing::info!(
                    examined = report.examined,
                    orphans = report.orphans.len(),
                    settled,
                    took_ms = t0.elapsed().as_millis() as u64,
                    "start-up recovery sweep done"
                );
                None
            }
            Ok(Err(e)) => Some(e.to_string()),
            Err(e) => Some(e.to_string()),
        };
        if let Some(e) = &error {
            tracing::error!(error = %e, "start-up recovery sweep failed; the periodic sweep retries");
        }
        let mut r = self.recovery.lock().unwrap_or_else(|e| e.into_inner());
        r.running = false;
        r.took = Some(t0.elapsed());
        r.error = error;
    }

    async fn sweep_loop(self: Arc<Self>) {
        let mut every = tokio::time::interval(self.config.sweep_interval);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        every.tick().await; // the first tick is now; start-up already swept
        // Teardowns that failed closed (their authorization could not be
        // written) are finished soon after the ledger takes writes again,
        // not a whole sweep interval later: a cheap check every few seconds.
        let mut settle = tokio::time::interval(FAILED_CLOSED_CHECK);
        settle.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = self.shutdown.cancelled() => return,
                _ = every.tick() => {}
                _ = settle.tick() => {
                    let engine = self.engine.clone();
                    if let Err(e) = blocking(move || engine.settle_failed_closed(8)).await {
                        tracing::error!(error = %e, "settle task failed");
                    }
                    continue;
                }
            }
            let engine = self.engine.clone();
            let opts = self.sweep_options();
            match blocking(move || engine.sweep_with(&opts)).await {
                Ok(Ok(report)) if !report.orphans.is_empty() => {
                    tracing::info!(orphans = report.orphans.len(), "sweep tore orphans down");
                }
                Ok(Ok(_)) => {}
                Ok(Err(e)) => tracing::warn!(error = %e, "sweep failed"),
                Err(e) => tracing::error!(error = %e, "sweep task failed"),
            }
        }
    }

    async fn scan_loop(self: Arc<Self>) {
        let mut every = tokio::time::interval(self.config.scan_interval);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let first_seq = self.start_seq.load(std::sync::atomic::Ordering::Relaxed);
        let fresh = |after_seq: i64| ScanState {
            host: None,
            relist: false,
            watches: HashMap::new(),
            exits: HashMap::new(),
            last_full: None,
            after_seq,
        };
        let mut state = fresh(first_seq);
        let mut tailed = first_seq;
        // `WatchdogSec=`: each completed scan tick says the service lives
        // (a hung blocking pool or ledger stops the pings, and systemd
        // restarts the service; its orphans are then recovered).
        let watchdog = sd_notify::watchdog_enabled().is_some();
        loop {
            tokio::select! {
                _ = self.shutdown.cancelled() => return,
                _ = every.tick() => {}
            }
            if watchdog {
                sd_notify_state(&[sd_notify::NotifyState::Watchdog]);
            }
            // Trees being torn down are skipped: the teardown scans them.
            let wanted: Vec<i64> = self
                .lock_owned()
                .iter()
                .filter(|(_, o)| o.lock.try_lock().is_ok())
                .map(|(id, _)| *id)
                .collect();
            let this = self.clone();
            match blocking(move || {
                this.scan_once(&mut state, &wanted);
                state
            })
            .await
            {
                Ok(s) => {
                    tailed = s.after_seq;
                    state = s;
                }
                Err(e) => {
                    // A panicking tick loses its state, not the loop: the
                    // next tick starts over (a full scan; event tailing
                    // resumes where the last good tick left it).
                    tracing::error!(error = %e, "scan task failed; starting the scan state over");
                    state = fresh(tailed);
                }
            }
        }
    }

    /// One scan-loop tick (blocking).
    fn scan_once(&self, st: &mut ScanState, wanted: &[i64]) {
        let ledger = self.engine.ledger();
        // Captured output stays under its cap: capped as it is written by
        // the log-cap thread; here (one stat per owned tree) only when that
        // thread does not run.
        let capping = self
            .log_cap
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .is_some_and(logcap::LogCap::running);
        for id in wanted.iter().filter(|_| !capping) {
            let path = crate::custody::log_path(self.engine.data_dir(), TreeId(*id));
            match crate::proc::cap_log(&path, self.config.log_max) {
                Ok(0) => {}
                Ok(dropped) => {
                    tracing::debug!(tree = id, dropped, "oldest captured output dropped")
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => tracing::warn!(tree = id, error = %e, "captured output not capped"),
            }
        }
        st.watches.retain(|id, _| wanted.contains(id));
        for id in wanted {
            if st.watches.contains_key(id) {
                continue;
            }
            let Ok(Some((tree, members))) = ledger.tree_members(TreeId(*id)) else {
                continue;
            };
            let exclude = HashSet::from([self.me.pid]);
            if let Some(mut w) = TreeWatch::new(&tree, &members, &exclude) {
                w.set_observer(self.observer_handle.clone());
                st.watches.insert(*id, w);
            }
        }
        // The reaper keeps the unclaimed exits (the last 4,096) until they
        // are claimed: each tick reads them as they are now.
        if let Some(reaper) = self.reaper {
            st.exits = reaper.unclaimed().into_iter().collect();
        }
        let started = Instant::now();
        let forced = self
            .force_full
            .swap(false, std::sync::atomic::Ordering::SeqCst);
        let full = forced
            || st
                .last_full
                .is_none_or(|t: Instant| t.elapsed() >= self.config.full_scan_interval);
        let mut reread = Vec::new();
        for w in st.watches.values_mut() {
            reread.extend(w.pids_to_reread());
        }
        // While the observer follows every watched tree and missed nothing
        // (no overflow: that forces a full scan; no member a scan found
        // first), a new member is a fork it attributed: re-reading the
        // members, leaders, cgroup members and the observer's members finds
        // every member a listing would, without listing `/proc`.
        let observed = self.observer_handle.as_ref().filter(|h| {
            !st.relist && h.healthy() && st.watches.keys().all(|id| h.is_watching(TreeId(*id)))
        });
        if let Some(h) = observed {
            for id in st.watches.keys() {
                reread.extend(h.members(TreeId(*id)).into_iter().map(|k| k.pid));
            }
        }
        let host = st.host.get_or_insert_with(HostView::default);
        if full {
            host.full_refresh();
            st.last_full = Some(Instant::now());
        } else if observed.is_some() {
            host.reread(reread);
        } else if !st.watches.is_empty() {
            host.refresh(reread);
        }
        // One index of the host for every tree; each keeps its own
        // exclusions (the owner of one may be a member of another).
        let mut members = 0usize;
        let mut unobserved = 0u64;
        if !st.watches.is_empty() {
            let index = crate::scan::SnapshotIndex::new(host.snapshot());
            for w in st.watches.values_mut() {
                let report = w.tick_indexed(&self.engine, &st.exits, host.snapshot(), &index, full);
                members += report.members.len();
                unobserved += report.unobserved;
            }
        }
        st.relist = unobserved > 0;
        if !st.watches.is_empty() || full {
            self.metrics
                .scan_duration
                .get_or_create(&metrics::ModeLabel {
                    mode: if full { "full" } else { "targeted" }.into(),
                })
                .observe(started.elapsed().as_secs_f64());
        }
        self.metrics.members.set(members as i64);
        // Tail the ledger into the event-fed metrics.
        loop {
            let filter = EventFilter {
                after_seq: Some(st.after_seq),
                limit: Some(1000),
                ..EventFilter::default()
            };
            match ledger.events(&filter) {
                Ok(events) => {
                    let mut ended = false;
                    for e in &events {
                        self.metrics.count_event(e);
                        st.after_seq = e.seq;
                        // A tree another process ended (a `run`, a `kill`,
                        // a sweep): its waiters are woken.
                        ended |= matches!(
                            e.kind,
                            crate::ledger::RowKind::Known(
                                crate::ledger::EventKind::TreeEnded
                                    | crate::ledger::EventKind::TreeState
                                    | crate::ledger::EventKind::TreeResolved
                                    | crate::ledger::EventKind::TreeSpawnFailed
                            )
                        );
                    }
                    if ended {
                        self.note_ended();
                    }
                    if events.len() < 1000 {
                        break;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "tailing the ledger failed");
                    break;
                }
            }
        }
        // EngineStats and the ledger head are synced at scrape time (GET /metrics).
        if forced && let Some(h) = &self.observer_handle {
            tracing::warn!("forced full scan after observer overflow");
            h.forced_scan_done();
        }
    }

    /// The shutdown drain: close the spawn gate, tear down every owned tree
    /// (graces capped), stop the loops. Returns whether every owned tree
    /// reached a terminal state within the bound.
    pub async fn drain(self: &Arc<Self>) -> bool {
        // Sweeps (recovery included) start no further teardown.
        self.sweep_stop.store(true, Ordering::SeqCst);
        let deadline = Instant::now() + self.config.drain_timeout;
        let work = async {
            *self.draining.write().await = true;
            // A client's tree whose owner process lives is not the
            // service's to end: it is left running (its owner still holds
            // it: its pipes, its work), and the next start adopts it and
            // watches its owner again. Only the trees the service owns
            // itself, and those of owners gone, are torn down, each with its
            // recorded grace, capped once by the policy inside the teardown.
            let mut left = Vec::new();
            let owned: Vec<i64> = self
                .lock_owned()
                .iter()
                .filter(|(id, o)| match &o.client_owner {
                    Some(owner) if owner_alive(owner) => {
                        left.push((**id, owner.pid));
                        false
                    }
                    _ => true,
                })
                .map(|(id, _)| *id)
                .collect();
            let cap = Some(self.config.shutdown_grace);
            left.sort_unstable();
            for (tree, owner) in &left {
                tracing::info!(
                    tree,
                    owner,
                    "shutdown: left running (its owner process lives); the next start adopts it"
                );
            }
            tracing::info!(
                trees = owned.len(),
                left_running = left.len(),
                left = ?left.iter().map(|(t, _)| *t).collect::<Vec<_>>(),
                "shutdown: tearing down owned trees"
            );
            let mut set = tokio::task::JoinSet::new();
            for tree in owned {
                let this = self.clone();
                set.spawn(async move {
                    let r = this
                        .teardown(
                            tree,
                            None,
                            cap,
                            EndCause::Shutdown,
                            EndCause::Shutdown.reason(),
                        )
                        .await;
                    (tree, r)
                });
            }
            let mut all_ok = true;
            while let Some(joined) = set.join_next().await {
                match joined {
                    Ok((_, Ok(r))) if r.state.is_terminal() => {}
                    Ok((tree, Ok(r))) => {
                        all_ok = false;
                        tracing::error!(tree, state = %r.state, "tree not settled at shutdown");
                    }
                    Ok((tree, Err(e))) => {
                        all_ok = false;
                        tracing::error!(tree, error = %e, "teardown at shutdown failed");
                    }
                    Err(e) => {
                        all_ok = false;
                        tracing::error!(error = %e, "teardown task failed");
                    }
                }
            }
            self.tasks.close();
            // The loops end at once; a sweep's teardowns in flight finish
            // within the bound, or are handed off to the next start.
            let left = deadline.saturating_duration_since(Instant::now());
            if tokio::time::timeout(left, self.tasks.wait()).await.is_err() {
                let counts = self.sweeps.counts();
                tracing::warn!(
                    in_flight = counts.in_flight,
                    pending = counts.pending(),
                    "shutdown: orphan teardowns still running at the drain bound are handed off to the next start (their trees stay terminating in the ledger)"
                );
                return all_ok;
            }
            let counts = self.sweeps.counts();
            if counts.not_started > 0 {
                tracing::info!(
                    left = counts.not_started,
                    "shutdown: orphans not yet torn down are left to the next sweep"
                );
            }
            let observer = self
                .observer
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take();
            if let Some(o) = observer
                && let Ok(stats) = blocking(move || o.stop()).await
            {
                tracing::info!(
                    events = stats.events,
                    overflows = stats.overflows,
                    escapes = stats.escapes_recorded,
                    "observer stopped"
                );
            }
            all_ok
        };
        match tokio::time::timeout(self.config.drain_timeout, work).await {
            Ok(ok) => ok,
            Err(_) => {
                tracing::error!(
                    timeout = %humantime::format_duration(self.config.drain_timeout),
                    "shutdown drain timed out"
                );
                false
            }
        }
    }
}

impl Service {
    /// Starts the service ([`Self::start`]: recovery in the background) and
    /// runs until the shutdown token is cancelled (SIGTERM/SIGINT through
    /// [`crate::http::shutdown_on_signals`]), then drains, and waits (within
    /// what is left of the drain bound) for `servers`, the listeners
    /// [`crate::http::serve`] runs on the same token. Listeners and signals
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

/// Whether a client owner is still the process it was (pid, start time,
/// boot): one that cannot be read counts as alive (its tree is left to the
/// next start, which checks again), as an owner whose start time cannot be
/// read does everywhere.
fn owner_alive(owner: &Identity) -> bool {
    match crate::proc::identity_of(owner.pid) {
        Ok(Some(now)) => now.start_ticks == owner.start_ticks && now.boot_id == owner.boot_id,
        Ok(None) => false,
        Err(_) => true,
    }
}

/// Tells systemd (`NOTIFY_SOCKET`, under `Type=notify`) how the service is;
/// nothing without the variable. A failure is logged, never fatal.
fn sd_notify_state(state: &[sd_notify::NotifyState<'_>]) {
    if let Err(e) = sd_notify::notify(state) {
        tracing::warn!(error = %e, "sd_notify failed");
    }
}

/// The scan loop's state, moved into the blocking pool for each tick.
struct ScanState {
    host: Option<HostView>,
    /// The last tick found members the observer did not know: this one
    /// lists `/proc` (their children are found by descent).
    relist: bool,
    watches: HashMap<i64, TreeWatch>,
    exits: HashMap<i32, ExitStatus>,
    last_full: Option<Instant>,
    after_seq: i64,
}

/// Resolves when the watched process exits; never without a watch.
async fn exited(w: Option<&crate::proc::ExitWatch>) {
    match w {
        Some(w) => w.exited().await,
        None => std::future::pending::<()>().await,
    }
}

/// How a tree's watch learns that its root exited.
enum RootWatch {
    /// The root is this service's announced child: the reaper says when it
    /// is reaped, and no descriptor is held for it (issue 30: one pidfd per
    /// live tree was 2,000 descriptors for 2,000 trees).
    Reaped(tokio::sync::oneshot::Receiver<()>),
    /// Any other root (a tree adopted after a restart): an identity-checked
    /// pidfd.
    Pidfd(crate::proc::ExitWatch),
    /// Not watchable (pidfd_open refused it, or no pidfd): gone already.
    Gone,
}

impl RootWatch {
    fn open(reaper: Option<&'static Reaper>, root: &Identity) -> RootWatch {
        if let Some(reaper) = reaper {
            let (tx, rx) = tokio::sync::oneshot::channel();
            let notify: crate::proc::ExitCallback = Box::new(move |_| {
                let _ = tx.send(());
            });
            // The pid the reaper announced is this root only while its
            // start time says so (the spawn recorded both): a recycled pid
            // is watched by its pidfd below, which checks the identity.
            // Checked again once registered: a root reaped and its pid given
            // to a new child of ours between the check and the registration
            // would have the stranger's exit stand for the root's.
            if root.check() != crate::proc::Liveness::Recycled
                && reaper.on_exit(root.pid, notify).is_ok()
                && root.check() != crate::proc::Liveness::Recycled
            {
                return RootWatch::Reaped(rx);
            }
        }
        match crate::proc::open_exit_watch(root)
            .ok()
            .flatten()
            .and_then(|fd| crate::proc::ExitWatch::new(fd).ok())
        {
            Some(w) => RootWatch::Pidfd(w),
            None => RootWatch::Gone,
        }
    }
}

async fn root_exited(root: Option<RootWatch>) {
    match root {
        Some(RootWatch::Reaped(rx)) => {
            // A dropped sender (the reaper never calls back) is no exit.
            if rx.await.is_err() {
                std::future::pending::<()>().await
            }
        }
        Some(RootWatch::Pidfd(w)) => w.exited().await,
        Some(RootWatch::Gone) | None => std::future::pending::<()>().await,
    }
}

/// Resolves at the deadline; never without one.
async fn until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending::<()>().await,
    }
}

/// Waits for the first reason to end a tree; `None` when the tree ended
/// otherwise (or the service is shutting down: the drain tears it down).
async fn watch_tree(
    done: &CancellationToken,
    root: Option<RootWatch>,
    root_gone: bool,
    owner: Option<&crate::proc::ExitWatch>,
    deadline: Option<tokio::time::Instant>,
    timeout: Option<Duration>,
) -> Option<EndCause> {
    // The root's status is filled in by the caller, once known.
    if root_gone {
        return Some(EndCause::RootExited(None));
    }
    tokio::select! {
        _ = done.cancelled() => None,
        _ = exited(owner) => Some(EndCause::OwnerExited),
        _ = root_exited(root) => Some(EndCause::RootExited(None)),
        _ = until(deadline) => Some(EndCause::Timeout(timeout.unwrap_or_default())),
    }
}

/// Starts the observer per the configuration
/// ([`crate::custody::policy::start_observer`]); overflows set `force_full`
/// for the scan loop. Returns it and why there is none.
fn start_observer(
    engine: &Engine,
    config: &ServiceConfig,
    force_full: Arc<std::sync::atomic::AtomicBool>,
) -> Result<(Option<crate::custody::Observer>, String), ServiceError> {
    let on_overflow = Box::new(move || {
        force_full.store(true, std::sync::atomic::Ordering::SeqCst);
    });
    let started = crate::custody::policy::start_observer(
        engine.ledger(),
        config.observer,
        config.observer_rcvbuf,
        on_overflow,
    )
    .map_err(ServiceError::Invalid)?;
    Ok((started.observer, started.off_because))
}
