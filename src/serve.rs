//! `treewarden serve` as a library call, the one place the service and its
//! HTTP face are put together: [`serve`] opens the ledger, makes the
//! [`Service`], builds the [`crate::http`] router over it, binds the TCP and
//! Unix listeners (on Windows TCP on loopback only: no Unix socket), and runs until `shutdown` (or SIGTERM/SIGINT, with
//! [`ServeOptions::shutdown_on_signals`]) drains it. The binary is a thin
//! shell: it parses `serve`'s flags into [`ServeOptions`] and maps
//! [`ServeError`] to its exit code, as mini-redis and ripgrep keep their
//! `main`s.

use std::path::PathBuf;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::custody::{CustodyError, DispatchScope, Engine};
use crate::ledger::{Ledger, LedgerOptions};
use crate::proc::Reaper;

use crate::service::{Service, ServiceConfig};

/// The exit code of a serve that shut down but could not settle every
/// owned tree (or could not start): treewarden's own failure.
pub const EXIT_UNSETTLED: u8 = 125;

/// The blocking pool's bound: every call into the engine or the ledger
/// runs there, and a teardown holds one thread from its first walk through
/// its grace to its end. The shutdown drain starts every owned tree's
/// teardown at once, so this bounds how many run together; their full
/// walks are shared ([`crate::custody::KernelHost`]'s coalescer), so a
/// teardown's time is about three walks however many are in flight, and
/// the drain's rate is this bound over that time (measured: 64 threads
/// ended about 50 trees a second with 15,000 processes on the host).
/// Tokio's own default; a thread's stack is address space until touched.
const BLOCKING_THREADS: usize = 512;

/// Everything `serve` takes beyond the [`Config`].
#[derive(Clone, Debug)]
pub struct ServeOptions {
    pub service: ServiceConfig,
    /// Prune trees ended longer ago than this (`None`: nothing pruned).
    pub retain: Option<Duration>,
    pub retain_every: Duration,
    pub retain_archive: Option<PathBuf>,
    /// OTLP/HTTP endpoint for the ledger's events (else the environment's).
    pub ship_otlp: Option<String>,
    /// NATS JetStream shipping (`--ship`), its flags checked.
    pub ship_nats: Option<crate::service::nats::NatsConfig>,
    /// The Unix socket (default `<data-dir>/api.sock`). Unix only: on
    /// Windows a socket named here is refused.
    pub socket: Option<PathBuf>,
    /// Members of this group act on every tree over the socket.
    pub admin_group: Option<String>,
    /// Reads on loopback need no token.
    pub open_reads: bool,
    /// How long a dashboard login's session lasts.
    pub session_ttl: Duration,
    pub limits: crate::http::conn::ConnLimits,
    pub dispatch_scope: DispatchScope,
    /// Each tree's evidence budget in the ledger (`serve --evidence-max`;
    /// see `ledger/evidence.rs`).
    pub evidence_max: u64,
    /// The caps on held pidfds (`serve --max-held-per-tree`,
    /// `--max-held-per-user`; see `custody/holds.rs`).
    pub holds: crate::custody::HoldCaps,
    /// What all the trees of one principal may use together (`serve
    /// --principal-memory-max`, `--principal-pids-max`,
    /// `--principal-cpu-max`): a parent cgroup per principal above its
    /// trees' ([`Engine::set_principal_limits`]). Where the host cannot
    /// enforce them, `serve` refuses to start (a usage error: exit 2).
    pub principal_limits: crate::ledger::Limits,
    /// Whether SIGTERM and SIGINT start the drain (the binary: yes; an
    /// embedder with signal handling of its own cancels `shutdown`).
    pub shutdown_on_signals: bool,
}

/// Why `serve` could not start: bad input (`usage`, the CLI's exit 2) or
/// treewarden's own failure (exit 125). One line.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct ServeError {
    pub usage: bool,
    pub message: String,
}

impl ServeError {
    fn internal(message: impl Into<String>) -> Self {
        Self {
            usage: false,
            message: message.into(),
        }
    }

    fn usage(message: impl Into<String>) -> Self {
        Self {
            usage: true,
            message: message.into(),
        }
    }
}

/// Runs the service until it is shut down (`shutdown` cancelled, or a
/// signal) and drained. `Ok(0)` after a clean shutdown (every owned tree
/// torn down), `Ok(`[`EXIT_UNSETTLED`]`)` when the drain could not settle.
// Over 100 lines on purpose: start-up and shutdown in their order around one runtime: the side
// services opened before `rt.block_on` (retention, shipping, sealing) are stopped after it, sealing
// first, once the drain's last writes are made; one frame keeps both ends of each in sight.
pub fn serve(
    config: &Config,
    opts: ServeOptions,
    external: CancellationToken,
) -> Result<u8, ServeError> {
    // Windows serves TCP on loopback only: no Unix socket (its peer
    // credentials and SCM_RIGHTS are Unix's), and nothing beyond loopback
    // (refused before anything is opened).
    // Where there is no local socket (Windows: its peer credentials and
    // SCM_RIGHTS are Unix's), `serve` is loopback TCP only: what asks for
    // more is refused before anything is opened.
    if !crate::proc::LOCAL_SOCKET
        && let Some(path) = &opts.socket
    {
        return Err(ServeError::usage(format!(
            "--socket {}: the Unix socket is Unix-only; on Windows serve listens on TCP on loopback (--listen 127.0.0.1:PORT)",
            path.display()
        )));
    }
    if !crate::proc::BEYOND_LOOPBACK && !opts.service.listen.ip().is_loopback() {
        return Err(ServeError::usage(format!(
            "--listen {}: on Windows serve listens on loopback only (127.0.0.1 or ::1)",
            opts.service.listen
        )));
    }
    let reaper = Reaper::install()
        .map_err(|e| ServeError::internal(format!("cannot become a subreaper: {e}")))?;
    let ledger =
        Ledger::open(&config.ledger_path(), LedgerOptions::from_config(config)).map_err(|e| {
            ServeError::internal(format!(
                "cannot open the ledger {}: {e}",
                config.ledger_path().display()
            ))
        })?;
    ledger.set_evidence_budget(opts.evidence_max);
    // The root's own handle (tokens, the instance id): clones share one owner thread.
    let root_ledger = ledger.clone();
    let mut engine = Engine::new(config, ledger, Some(reaper)).map_err(|e| match e {
        CustodyError::UnknownTree(_) | CustodyError::Conflict(_) => {
            ServeError::usage(e.to_string())
        }
        e => ServeError::internal(e.to_string()),
    })?;
    engine.set_dispatch_scope(opts.dispatch_scope);
    engine.set_hold_caps(crate::custody::HoldCaps {
        reserve: opts.limits.reserve_fds,
        ..opts.holds
    });
    engine
        .set_principal_limits(opts.principal_limits)
        .map_err(|e| ServeError::usage(e.to_string()))?;
    let token = crate::http::auth::ensure_token(&config.data_dir)
        .map_err(|e| ServeError::internal(format!("api token: {e}")))?;
    let svc_config = opts.service.clone();
    let service = Service::new(engine, reaper, svc_config)
        .map_err(|e| ServeError::internal(e.to_string()))?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(BLOCKING_THREADS)
        .thread_name("tw-serve")
        .enable_all()
        .build()
        .map_err(|e| ServeError::internal(format!("tokio runtime: {e}")))?;
    let retention = match opts.retain {
        None => None,
        Some(retain) => {
            if let Some(dir) = &opts.retain_archive {
                use crate::ledger::fsmode::Mode as _;
                std::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(dir)
                    .map_err(|e| {
                        ServeError::internal(format!("--retain-archive {}: {e}", dir.display()))
                    })?;
            }
            let ledger = crate::ledger::Ledger::open(
                &config.ledger_path(),
                crate::ledger::LedgerOptions::from_config(config),
            )
            .map_err(|e| ServeError::internal(format!("retention: {e}")))?;
            Some(
                crate::service::retain::Retention::start(
                    ledger,
                    crate::service::retain::RetainConfig {
                        data_dir: config.data_dir.clone(),
                        retain,
                        every: opts.retain_every,
                        archive_dir: opts.retain_archive.clone(),
                    },
                )
                .map_err(|e| ServeError::internal(format!("retention: {e}")))?,
            )
        }
    };
    let shipper =
        match crate::service::ship::ShipConfig::from_flag_or_env(opts.ship_otlp.as_deref()) {
            None => None,
            Some(ship) => {
                let ledger = crate::ledger::Ledger::open(
                    &config.ledger_path(),
                    crate::ledger::LedgerOptions::from_config(config),
                )
                .map_err(|e| ServeError::internal(format!("OTLP shipping: {e}")))?;
                tracing::info!(endpoint = %ship.logs_url(), "shipping ledger events as OTLP logs");
                Some(
                    crate::service::ship::Shipper::start(ledger, ship)
                        .map_err(|e| ServeError::internal(e.to_string()))?,
                )
            }
        };
    let nats_shipper = match opts.ship_nats.clone() {
        None => None,
        Some(nats) => {
            let ledger = crate::ledger::Ledger::open_as(
                &config.ledger_path(),
                crate::ledger::LedgerOptions::from_config(config),
                "ledger-ship",
            )
            .map_err(|e| ServeError::internal(format!("JetStream shipping: {e}")))?;
            tracing::info!(
                servers = %nats.servers_text(),
                subject = %nats.subject(),
                "shipping ledger events to NATS JetStream"
            );
            Some(
                crate::service::nats::NatsShipper::start(
                    ledger,
                    nats,
                    service.metrics().ship_refused.clone(),
                )
                .map_err(ServeError::internal)?,
            )
        }
    };
    // Sealing: seals every epoch where `seal setup` was run. Its
    // own handle waits longer for the write lock than custody writes do: a
    // seal is due once an epoch, and the wait blocks only its thread.
    let sealing = crate::ledger::Ledger::open(
        &config.ledger_path(),
        crate::ledger::LedgerOptions {
            busy_timeout: config.busy_timeout.max(crate::service::seal::BUSY_TIMEOUT),
            reserve: config.ledger_reserve,
        },
    )
    .map_err(|e| e.to_string())
    .and_then(|ledger| crate::service::seal::Sealing::start(ledger, config.data_dir.clone()))
    .map_err(|e| ServeError::internal(e.to_string()))?;
    let admin_gid = match &opts.admin_group {
        None => None,
        Some(g) => Some(
            crate::proc::group_by_name(g)
                .map_err(|e| ServeError::internal(format!("group database: {e}")))?
                .ok_or_else(|| ServeError::usage(format!("--admin-group {g}: no such group")))?,
        ),
    };
    // The api-token file is the first admin token: current setups keep
    // working. A replaced file's old token is revoked.
    root_ledger
        .import_token(
            "api-token file",
            &crate::http::auth::token_hash(&token),
            &requester(),
        )
        .map_err(|e| ServeError::internal(format!("api token: {e}")))?;
    // The local socket, where the platform has one.
    let socket_path = crate::proc::LOCAL_SOCKET.then(|| {
        opts.socket
            .clone()
            .unwrap_or_else(|| config.data_dir.join("api.sock"))
    });
    let open_reads = opts.open_reads;
    // The dashboard's session cookie is named for this ledger (and port).
    let instance = root_ledger
        .instance_id()
        .map_err(|e| ServeError::internal(format!("ledger instance id: {e}")))?;
    // The service's handle is the one that lives on: the ledger closes with it.
    drop(root_ledger);
    let code = rt.block_on(async move {
        // Signals first: from here on SIGTERM drains, whatever start-up is
        // doing. Then the listeners, which answer before the recovery sweep
        // (started by `run`, in the background) has torn anything down.
        let shutdown = service.shutdown_token();
        if opts.shutdown_on_signals {
            crate::proc::shutdown_on_signals(shutdown.clone()).map_err(|e| {
                ServeError::internal(format!("start-up: cannot listen for signals: {e}"))
            })?;
        }
        // The caller's token starts the same drain.
        let own = shutdown.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = external.cancelled() => own.cancel(),
                _ = own.cancelled() => {}
            }
        });
        // Descriptors are custody's: the soft limit goes up to the hard one,
        // and the serving loop keeps a reserve of them (src/http/conn.rs).
        let nofile = crate::proc::raise_nofile_soft_limit();
        tracing::debug!(?nofile, "soft RLIMIT_NOFILE");
        let listen = service.config().listen;
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .map_err(|e| ServeError::internal(format!("cannot listen on {listen}: {e}")))?;
        let bound = listener
            .local_addr()
            .map_err(|e| ServeError::internal(e.to_string()))?;
        let local = match &socket_path {
            Some(path) => Some(crate::proc::bind_local(path).map_err(|e| {
                ServeError::internal(format!("cannot listen on {}: {e}", path.display()))
            })?),
            None => None,
        };
        // The file this service bound: removed at the end only while it is
        // still this one (a successor may have bound the path meanwhile).
        let bound_socket = socket_path.as_deref().and_then(crate::proc::file_key);
        let auth = crate::http::auth::Auth::new(!bound.ip().is_loopback(), open_reads, admin_gid)
            .with_sessions(crate::http::login::Sessions::for_instance(
                &instance,
                bound.port(),
                opts.session_ttl,
            ));
        let app = crate::http::router(crate::http::AppState {
            service: service.clone(),
            auth: std::sync::Arc::new(auth),
        });
        let limits = opts.limits;
        let mut servers = vec![tokio::spawn(crate::http::conn::serve(
            listener,
            app.clone(),
            shutdown.clone(),
            limits,
        ))];
        if let Some(local) = local {
            servers.push(tokio::spawn(crate::http::conn::serve(
                local,
                app,
                shutdown.clone(),
                limits,
            )));
        }
        if let Some(path) = &service.config().ready_file {
            let tmp = path.with_extension("tmp");
            std::fs::write(&tmp, bound.to_string())
                .and_then(|_| std::fs::rename(&tmp, path))
                .map_err(|e| ServeError::internal(format!("{}: {e}", path.display())))?;
        }
        match &socket_path {
            Some(socket_path) => {
                eprintln!(
                    "treewarden: listening on http://{bound}/ and {}",
                    socket_path.display()
                );
                tracing::info!(%bound, socket = %socket_path.display(), "listening");
            }
            None => {
                eprintln!("treewarden: listening on http://{bound}/");
                tracing::info!(%bound, "listening");
            }
        }
        let settled = service.run(servers).await;
        if let Some(socket_path) = &socket_path {
            if bound_socket.is_some() && crate::proc::file_key(socket_path) == bound_socket {
                if let Err(e) = std::fs::remove_file(socket_path) {
                    tracing::warn!(error = %e, "the socket file was not removed");
                }
            } else {
                tracing::info!(
                    socket = %socket_path.display(),
                    "the socket path is another service's now: left in place"
                );
            }
        }
        Ok(if settled { 0 } else { EXIT_UNSETTLED })
    });
    // The drain is bounded by --drain-timeout; a teardown still running on
    // the blocking pool after it (a long grace started before the SIGTERM)
    // must not hold the process past a supervisor's SIGKILL window. It is
    // abandoned; its tree is resumed by the next start's sweep (the ledger
    // holds where it stopped; a frozen cgroup is thawed by that teardown).
    rt.shutdown_timeout(Duration::from_secs(1));
    // The clean close, after the drain's last writes (shipped below).
    sealing.stop();
    if let Some(retention) = retention {
        retention.stop();
    }
    if let Some(shipper) = shipper {
        shipper.stop();
    }
    if let Some(shipper) = nats_shipper {
        shipper.stop();
    }
    code
}

/// Who imported the api-token file: this process, as the CLI records itself.
fn requester() -> crate::ledger::Requester {
    crate::ledger::Requester {
        via: "cli".into(),
        uid: Some(crate::proc::current_uid()),
        pid: Some(std::process::id() as i32),
        ..Default::default()
    }
}
