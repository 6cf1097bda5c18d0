//! `treewarden serve`: its flags, and the call into the library's
//! `serve::serve`.

use super::*;

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Address to listen on. Beyond loopback, every request needs the token.
    /// On Windows a loopback address only (nothing beyond it is served).
    #[arg(long, default_value = "127.0.0.1:7878")]
    listen: std::net::SocketAddr,
    /// Targeted scans of the trees the service watches.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    scan_interval: Duration,
    /// Full /proc re-reads (catches what targeted scans cannot).
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    full_scan_interval: Duration,
    /// Orphan sweeps.
    #[arg(long, default_value = "1m", value_parser = parse_duration)]
    sweep_interval: Duration,
    /// Orphans a sweep (the start-up recovery included) tears down at once.
    #[arg(long, default_value_t = treewarden::custody::DEFAULT_SWEEP_CONCURRENCY, value_parser = parse_concurrency)]
    sweep_concurrency: usize,
    /// Grace of trees whose request names none, and of orphans whose tree
    /// records none (trees recorded before grace was).
    #[arg(long, default_value = policy::DEFAULT_GRACE, value_parser = parse_duration)]
    grace: Duration,
    /// Cap on each tree's grace during shutdown.
    #[arg(long, default_value = "3s", value_parser = parse_duration)]
    shutdown_grace: Duration,
    /// The longest grace an API request may ask for (spawn, kill); over
    /// it, the request is refused (422 on spawn, 400 on kill, code
    /// BadRequest). A kill request waits for its teardown, so its timeout
    /// grows with it.
    #[arg(long, default_value = "10m", value_parser = parse_duration)]
    max_grace: Duration,
    /// Bound on the whole shutdown (keep it under the supervisor's kill timeout).
    #[arg(long, default_value = "20s", value_parser = parse_duration)]
    drain_timeout: Duration,
    /// text or json (logs on stderr).
    #[arg(long, default_value = "text")]
    log_format: treewarden::telemetry::LogFormat,
    /// Write the bound address (e.g. 127.0.0.1:40123) to this file once
    /// requests are accepted (useful with --listen 127.0.0.1:0).
    #[arg(long, value_name = "PATH")]
    ready_file: Option<std::path::PathBuf>,
    /// Cap on each API tree's captured output (stdout and stderr in
    /// `<data-dir>/logs/`); the oldest bytes are dropped past it.
    #[arg(long, default_value = "10M", value_name = "SIZE", value_parser = treewarden::ledger::parse_size)]
    log_max: u64,
    /// Free space the data dir keeps for the ledger: below it, new API
    /// trees (which log into the data dir) are refused with 503.
    #[arg(long, default_value = "64M", value_name = "SIZE", value_parser = treewarden::ledger::parse_size)]
    min_free: u64,
    /// Live trees one local user (or one token) may hold at once through
    /// the API; admins are not capped.
    #[arg(long = "max-trees-per-user", default_value_t = 256)]
    max_trees_per_user: usize,
    /// Loose members (escaped their tree's group, on the session
    /// boundary) one tree may hold by a pidfd at once. Past it a member is
    /// recorded and signalled as any, by identity and uid (a pidfd taken
    /// at the signal), and the tree is flagged `holds_capped` once.
    #[arg(long = "max-held-per-tree", default_value_t = treewarden::custody::holds::DEFAULT_PER_TREE)]
    max_held_per_tree: usize,
    /// Loose members the trees of one local user (or one token) may hold
    /// by a pidfd at once. Holds in all also stay under half of what the
    /// soft `nofile` leaves above the 128 descriptors accept keeps free.
    #[arg(long = "max-held-per-user", default_value_t = treewarden::custody::holds::DEFAULT_PER_PRINCIPAL)]
    max_held_per_user: usize,
    /// Bytes of members' command lines, exe and cwd the ledger stores for
    /// one tree (rows and events); past it, a member's argv is recorded by
    /// its SHA-256, length and count, and the tree is flagged
    /// `evidence_over_budget` once.
    #[arg(long, default_value = "16M", value_name = "SIZE", value_parser = treewarden::ledger::parse_size)]
    evidence_max: u64,
    /// Bytes of ended trees' captured logs one local user (or one token)
    /// keeps in `<data-dir>/logs/`; past it, its oldest ended logs are removed.
    #[arg(long, default_value = "64M", value_name = "SIZE", value_parser = treewarden::ledger::parse_size)]
    ended_logs_per_user: u64,
    /// Age (from its last write) past which an ended tree's captured log is removed.
    #[arg(long, default_value = "7d", value_name = "DURATION", value_parser = parse_duration)]
    ended_logs_for: Duration,
    /// Only these commands (exact argv[0]) may be spawned through the API.
    /// Repeatable; default: any.
    #[arg(long = "allow-command", value_name = "CMD")]
    allow_commands: Vec<String>,
    /// With --allow-command: a variable a request's `env` may set
    /// (repeatable). Nothing else is taken from the request, and the tree
    /// inherits only PATH, the locale, TZ, HOME, USER, LOGNAME and SHELL.
    #[arg(long = "allow-env", value_name = "NAME", requires = "allow_commands")]
    allow_env: Vec<String>,
    /// Prune trees that ended longer ago than this (and tree-less events
    /// as old), as `prune --before` does. Off by default: nothing is pruned.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    retain: Option<Duration>,
    /// How often --retain looks for trees to prune.
    #[arg(long, default_value = "10m", value_parser = parse_duration, requires = "retain")]
    retain_every: Duration,
    /// Archive what --retain prunes here first (one `archive-<ms>.ndjson`
    /// per prune, fsynced); without it pruned events are gone.
    #[arg(long, value_name = "DIR", requires = "retain")]
    retain_archive: Option<std::path::PathBuf>,
    /// Ship every ledger event as an OTLP log record to URL/v1/logs
    /// (OTLP/HTTP protobuf), from a durable cursor in the ledger. Default:
    /// OTEL_EXPORTER_OTLP_ENDPOINT when set; otherwise off.
    #[arg(long, value_name = "URL")]
    ship_otlp: Option<String>,
    /// Ship every ledger event to NATS JetStream: the servers, comma
    /// separated (nats://HOST:PORT[,HOST:PORT…]). Subject
    /// treewarden.<host-id>.events of the stream TREEWARDEN (made where
    /// absent), in seq order, from a durable cursor; custody never waits on it.
    #[arg(long, value_name = "URLS")]
    ship: Option<String>,
    /// A NATS credentials file (user JWT and NKey seed) for --ship.
    #[arg(long, value_name = "FILE", requires = "ship")]
    ship_creds: Option<std::path::PathBuf>,
    /// This host's id in the subject and the message ids. Default:
    /// /etc/machine-id, else the host name.
    #[arg(long, value_name = "ID", requires = "ship")]
    ship_host_id: Option<String>,
    /// The stream's replicas when --ship makes it (1 to 5).
    #[arg(long, value_name = "N", default_value_t = 1)]
    ship_replicas: usize,
    /// The Unix socket (the same API; the principal is the peer's uid, no
    /// token). Default: <data-dir>/api.sock. Made 0666: who connects is
    /// known from SO_PEERCRED, not from the file mode. Unix only: refused
    /// on Windows, which serves TCP on loopback.
    #[arg(long, value_name = "PATH")]
    socket: Option<std::path::PathBuf>,
    /// Members of this group act on every tree over the socket, as root does.
    #[arg(long, value_name = "GROUP")]
    admin_group: Option<String>,
    /// Reads on loopback need no token: every local user then reads every
    /// tree's argv, cwd and the whole export. Only for a single-tenant host.
    #[arg(long)]
    open_reads: bool,
    /// How long a dashboard login lasts (a read-only session in memory;
    /// it also ends when its token is revoked, or the service restarts).
    #[arg(long, default_value = "12h", value_parser = parse_duration)]
    session_ttl: Duration,
    /// Connections served at once on each listener; more are answered 503
    /// (Retry-After), up to 256 at once, then wait in the kernel's backlog.
    /// Accept also waits while fewer than 128 descriptors are free (they
    /// are custody's: /proc reads, pidfds, the ledger).
    #[arg(long, default_value_t = treewarden::config::MAX_CONNECTIONS)]
    max_connections: usize,
    /// Connections one local user (peer uid, on the socket and on loopback
    /// TCP; the source address beyond loopback) may hold at once; past it,
    /// its new connections are answered 503 (Retry-After) and closed.
    #[arg(long, default_value_t = treewarden::config::MAX_CONNECTIONS_PER_UID)]
    max_connections_per_uid: usize,
    /// How long a request's head may take to arrive, a keep-alive
    /// connection may idle between requests, and an answer may wait for
    /// the peer to read it, before the connection is closed.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    header_timeout: Duration,
    /// The memory all the live trees of one principal (a local user on the
    /// socket, a token) may use together: a cgroup per principal above its
    /// trees' (`memory.max`), so N trees at once cannot take N times one
    /// tree's limit. Needs the cgroup boundary and the memory controller;
    /// without them serve refuses to start (exit 2).
    #[arg(long, value_name = "SIZE", value_parser = treewarden::ledger::parse_size)]
    principal_memory_max: Option<u64>,
    /// The processes all of one principal's trees may hold together
    /// (`pids.max` of its cgroup), as --principal-memory-max.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    principal_pids_max: Option<u64>,
    /// The CPU all of one principal's trees may use together, as a
    /// percentage of one CPU (`cpu.max` of its cgroup; `50%`, `200%`), as
    /// --principal-memory-max.
    #[arg(long, value_name = "PCT", value_parser = treewarden::ledger::parse_cpu_pct)]
    principal_cpu_max: Option<u32>,
    /// Whom an unsettled tree refuses new work to: `owner` (the same owner
    /// record, or the same requester: socket uid, token; default) or `host`
    /// (every spawn on the host).
    #[arg(long, value_name = "SCOPE", default_value = "owner")]
    dispatch_scope: treewarden::custody::DispatchScope,
}

/// `treewarden serve`: the service. Exit 0 after a clean shutdown (every
/// owned tree torn down), 125 when it could not start or settle.
#[cfg(any(target_os = "linux", windows))]
pub fn serve(config: &Config, args: ServeArgs) -> CliResult {
    /// `serve`'s flags as the library's options.
    fn serve_inner(config: &Config, args: ServeArgs) -> CliResult {
        use treewarden::serve::{ServeOptions, serve};
        use treewarden::service::ServiceConfig;
        /// The service runs in `/` (`proc::SERVICE_DIR`; Windows has none): its
        /// working directory is nothing a tree or a client should reach (a
        /// tree's `cwd` through a magic link, or any path the service itself
        /// would resolve relative to it), so it starts there, its own paths made
        /// absolute first (as given, against the directory it was started in).
        fn in_root(config: &Config, mut args: ServeArgs) -> Result<(Config, ServeArgs), CliError> {
            let Some(root) = treewarden::proc::SERVICE_DIR else {
                return Ok((config.clone(), args));
            };
            let abs = |p: &std::path::Path| {
                std::path::absolute(p).map_err(|e| CliError::usage(anyhow!("{}: {e}", p.display())))
            };
            let mut config = config.clone();
            config.data_dir = abs(&config.data_dir)?;
            if let Some(c) = &config.cgroup_root {
                config.cgroup_root = Some(abs(c)?);
            }
            for p in [
                &mut args.ready_file,
                &mut args.retain_archive,
                &mut args.socket,
                &mut args.ship_creds,
            ]
            .into_iter()
            .flatten()
            {
                *p = abs(p)?;
            }
            std::env::set_current_dir(root)
                .map_err(|e| CliError::internal(anyhow!("cannot enter {root}: {e}")))?;
            Ok((config, args))
        }
        let (root_config, args) = in_root(config, args)?;
        let config = &root_config;
        let opts = ServeOptions {
            service: ServiceConfig {
                listen: args.listen,
                scan_interval: args.scan_interval,
                full_scan_interval: args.full_scan_interval,
                sweep_interval: args.sweep_interval,
                sweep_concurrency: args.sweep_concurrency,
                default_grace: args.grace,
                shutdown_grace: args.shutdown_grace,
                drain_timeout: args.drain_timeout,
                ready_file: args.ready_file,
                allow_commands: args.allow_commands,
                allow_env: args.allow_env,
                observer: config.observer,
                observer_rcvbuf: config.observer_rcvbuf,
                log_max: args.log_max,
                min_free: args.min_free,
                max_trees_per_principal: args.max_trees_per_user,
                max_grace: args.max_grace,
                ended_logs: treewarden::service::EndedLogs {
                    per_principal: args.ended_logs_per_user,
                    keep_for: args.ended_logs_for,
                },
            },
            retain: args.retain,
            retain_every: args.retain_every,
            retain_archive: args.retain_archive,
            ship_otlp: args.ship_otlp,
            ship_nats: match &args.ship {
                None => None,
                Some(urls) => Some(
                    treewarden::service::nats::NatsConfig::new(
                        urls,
                        args.ship_creds.clone(),
                        args.ship_host_id.as_deref(),
                        args.ship_replicas,
                    )
                    .map_err(|e| CliError::usage(anyhow!("--ship: {e}")))?,
                ),
            },
            socket: args.socket,
            admin_group: args.admin_group,
            open_reads: args.open_reads,
            session_ttl: args.session_ttl,
            limits: treewarden::http::conn::ConnLimits {
                max_total: args.max_connections,
                max_per_uid: args.max_connections_per_uid,
                header_read: args.header_timeout,
                ..treewarden::http::conn::ConnLimits::default()
            },
            dispatch_scope: args.dispatch_scope,
            evidence_max: args.evidence_max,
            holds: treewarden::custody::HoldCaps {
                per_tree: args.max_held_per_tree,
                per_principal: args.max_held_per_user,
                reserve: treewarden::http::conn::ConnLimits::default().reserve_fds,
            },
            principal_limits: treewarden::ledger::Limits {
                memory_max: args.principal_memory_max,
                pids_max: args.principal_pids_max,
                cpu_max_pct: args.principal_cpu_max,
            },
            shutdown_on_signals: true,
        };
        serve(config, opts, tokio_util::sync::CancellationToken::new()).map_err(|e| {
            if e.usage {
                CliError::usage(anyhow!(e))
            } else {
                CliError::internal(anyhow!(e))
            }
        })
    }

    let telemetry = treewarden::telemetry::init(args.log_format, "info");
    let result = serve_inner(config, args);
    telemetry.shutdown();
    result
}
