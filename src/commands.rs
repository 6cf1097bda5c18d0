//! The custody commands of the CLI: `run`, `kill`, `ls`, `show`, `sweep`,
//! `resolve`. Argument structs, the call into the engine, and human / JSON
//! output. Exit codes follow DESIGN.md: 2 for bad input, 125 when
//! treewarden itself failed, and for `run` the root's status.

use std::ffi::OsString;
use std::io::{IsTerminal, Write};
use std::time::Duration;

use anyhow::anyhow;
use clap::Args;
use treewarden::config::Config;
use treewarden::custody::policy::{self, Grace};
use treewarden::custody::{
    CustodyError, Engine, Lifetime, Origin, Progress, RunOptions, SpawnRequest, TeardownOptions,
};

use treewarden::ledger::{Ledger, LedgerOptions, OwnerKind, TreeId, TreeRow};
use treewarden::proc::{Reaper, Sig, SpawnStdio};

use treewarden::config::parse_duration;

use crate::exit::{CliError, CliResult, EXIT_INTERNAL, EXIT_USAGE};

/// The ledger's path, when a ledger is there: a missing file is a usage
/// error (usually a wrong --data-dir); no command but `run` and `serve`
/// creates one.
pub fn existing_ledger_path(config: &Config) -> Result<std::path::PathBuf, CliError> {
    let path = config.ledger_path();
    if !path.is_file() {
        return Err(CliError::usage(anyhow::anyhow!(
            "no ledger at {} (check --data-dir)",
            path.display()
        )));
    }
    Ok(path)
}

/// Opens an existing ledger for every command but `run` and `serve`. A
/// missing file is a usage error (usually a wrong --data-dir), and these
/// commands never create one.
pub fn open_existing_ledger(config: &Config) -> Result<Ledger, CliError> {
    let path = existing_ledger_path(config)?;
    Ledger::open(&path, LedgerOptions::from_config(config))
        .map_err(|e| CliError::internal(anyhow::anyhow!("{}: {e}", path.display())))
}

#[derive(Args, Debug)]
pub struct RunArgs {
    /// A label for the tree (shown by ls and the dashboard).
    #[arg(long)]
    label: Option<String>,
    /// Time between the first signal and the forced kill (a bare number is
    /// seconds, as in timeout(1)).
    #[arg(long, default_value = policy::DEFAULT_GRACE, value_parser = parse_duration)]
    grace: Duration,
    /// Tear the tree down after this long (exit 124); a bare number is seconds.
    #[arg(long, value_parser = parse_duration)]
    timeout: Option<Duration>,
    /// The first signal of the teardown: TERM (default), INT, HUP, QUIT,
    /// USR1 or USR2, by name or number, as timeout(1) takes it.
    #[arg(short = 's', long = "signal", value_name = "SIG", default_value = "TERM", value_parser = parse_signal)]
    signal: Sig,
    /// Add K=V to the command's environment (repeatable).
    #[arg(long = "env", value_name = "K=V", value_parser = parse_env)]
    env: Vec<(OsString, OsString)>,
    /// Run the command in DIR.
    #[arg(long, value_name = "DIR")]
    cwd: Option<std::path::PathBuf>,
    /// The tree's memory limit (`memory.max`): bytes, or with K, M, G, T.
    /// Like every limit it needs the cgroup boundary and its controller;
    /// without them the run is refused (125), never started unlimited.
    #[arg(long, value_name = "SIZE", value_parser = treewarden::ledger::parse_size)]
    memory_max: Option<u64>,
    /// The tree's process limit (`pids.max`).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pids_max: Option<u64>,
    /// The tree's CPU limit as a percentage of one CPU (`cpu.max`; `50%`,
    /// `200%`), like systemd's CPUQuota=.
    #[arg(long, value_name = "PCT", value_parser = treewarden::ledger::parse_cpu_pct)]
    cpu_max: Option<u32>,
    /// How often the tree is scanned for members and escapes.
    #[arg(long, default_value = "250ms", value_parser = parse_duration)]
    scan_interval: Duration,
    /// Tear the tree down when run's parent process dies (the process, not
    /// the thread that spawned run: a thread pool may retire that thread).
    #[arg(long)]
    die_with_parent: bool,
    /// Run on behalf of this process: it is the tree's owner on the record,
    /// and the tree is torn down when it exits (as --die-with-parent does
    /// for the parent). Allowed only where the caller may signal it.
    #[arg(long, value_name = "PID", value_parser = clap::value_parser!(i32).range(1..))]
    owner_pid: Option<i32>,
    /// The owner's start time in clock ticks (field 22 of /proc/PID/stat),
    /// so a pid recycled since the caller read it is refused.
    #[arg(long, value_name = "TICKS", requires = "owner_pid")]
    owner_start_ticks: Option<u64>,
    /// Whom an unsettled tree (a teardown that could not be authorized)
    /// refuses new work to: `owner` (the same owner record or requester;
    /// default) or `host` (every run on this data dir).
    #[arg(long, value_name = "SCOPE", default_value = "owner")]
    dispatch_scope: treewarden::custody::DispatchScope,
    /// Give the tree its own terminal (a pty as its controlling terminal
    /// and stdio), relayed to this one in raw mode: prompts, full-screen
    /// tools, window resizes and Ctrl-C (SIGINT to the tree through its
    /// terminal) work. Default: when stdin is a terminal (and the lifetime
    /// is `root`: a kept tree's terminal would hang up when run returns).
    #[arg(long, overrides_with = "no_tty")]
    tty: bool,
    /// No terminal for the tree, even when stdin is one (it inherits
    /// run's descriptors, in a session without a controlling terminal).
    #[arg(long, overrides_with = "tty")]
    no_tty: bool,
    /// `root` (default): the tree ends when the command exits. `owner`: run
    /// returns the command's status when it exits, and what it left running
    /// stays in custody (a custodian process) until the owner — run's
    /// parent process, or --owner-pid — exits, `treewarden kill`, or
    /// --timeout.
    #[arg(long, value_name = "LIFETIME", default_value = "root")]
    lifetime: Lifetime,
    /// Do not settle, before starting, what dead owners left: teardowns
    /// that failed closed (finished with a fresh authorization) and orphans
    /// (torn down with their recorded grace, beside the command, at most 8).
    #[arg(long)]
    no_settle: bool,
    /// Write the tree's id and a newline to descriptor N (inherited, 3 or
    /// above) once the tree is recorded, before the command runs; N is then
    /// closed. The command never inherits it.
    #[arg(long, value_name = "N")]
    id_fd: Option<i32>,
    /// Write one JSON line to descriptor N when run ends, on every path:
    /// {"tree", "state", "exit": {"code", "signal"} or null, "error": null
    /// or treewarden's own failure} (docs/INTEGRATION.md).
    #[arg(long, value_name = "N")]
    status_fd: Option<i32>,
    /// No teardown progress and no summary line on stderr.
    #[arg(long, short)]
    quiet: bool,
    /// The summary line on stderr after every run, a clean one too, with
    /// what the tree consumed (like `systemd-run --wait`).
    #[arg(long, short, conflicts_with = "quiet")]
    verbose: bool,
    /// The command and its arguments (after `--` when they start with `-`).
    #[arg(trailing_var_arg = true, value_name = "CMD")]
    command: Vec<OsString>,
}

/// `--signal`: one of the first signals a teardown may send.
fn parse_signal(s: &str) -> Result<Sig, String> {
    Sig::parse_first(s)
}

/// `--env K=V`.
fn parse_env(s: &str) -> Result<(OsString, OsString), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.into(), v.into())),
        _ => Err(format!("malformed --env {s:?}: expected K=V")),
    }
}

#[derive(Args, Debug)]
pub struct KillArgs {
    /// Tree id.
    tree: i64,
    /// Time between the first signal and the forced kill (default: the
    /// grace recorded with the tree, else 5s).
    #[arg(long, value_parser = parse_duration)]
    grace: Option<Duration>,
    /// The first signal (as for run).
    #[arg(short = 's', long = "signal", value_name = "SIG", default_value = "TERM", value_parser = parse_signal)]
    signal: Sig,
    #[arg(long, short)]
    quiet: bool,
    /// Print the teardown report as one JSON object.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
pub struct LsArgs {
    /// Include ended trees.
    #[arg(long)]
    all: bool,
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
pub struct ShowArgs {
    tree: i64,
    #[arg(long)]
    json: bool,
    /// The members as a process tree, like pstree: parent -> child by the
    /// ppid each had when first seen, marked escaped, exec, exited,
    /// force-killed (with --json: the hierarchy as JSON).
    #[arg(long = "tree", id = "tree_view")]
    tree_view: bool,
}

#[derive(Args, Debug)]
pub struct LogsArgs {
    tree: i64,
    /// Only the last N lines.
    #[arg(long, short = 'n', value_name = "N")]
    tail: Option<usize>,
    /// Keep printing what the tree writes until it has ended.
    #[arg(long, short)]
    follow: bool,
}

#[derive(Args, Debug)]
pub struct SweepArgs {
    /// Grace of an orphan whose tree records none (trees recorded before
    /// grace was); every other orphan gets the grace it was spawned with.
    #[arg(long, default_value = policy::DEFAULT_GRACE, value_parser = parse_duration)]
    grace: Duration,
    /// Orphans torn down at once.
    #[arg(long, default_value_t = treewarden::custody::DEFAULT_SWEEP_CONCURRENCY, value_parser = parse_concurrency)]
    concurrency: usize,
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Address to listen on. Beyond loopback, every request needs the token.
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
    /// The Unix socket (the same API; the principal is the peer's uid, no
    /// token). Default: <data-dir>/api.sock. Made 0666: who connects is
    /// known from SO_PEERCRED, not from the file mode.
    #[arg(long, value_name = "PATH")]
    socket: Option<std::path::PathBuf>,
    /// Members of this group act on every tree over the socket, as root does.
    #[arg(long, value_name = "GROUP")]
    admin_group: Option<String>,
    /// Reads on loopback need no token: every local user then reads every
    /// tree's argv, cwd and the whole export. Only for a single-tenant host.
    #[arg(long)]
    open_reads: bool,
    /// Connections served at once on each listener; more wait in the
    /// kernel's backlog. Accept also waits while fewer than 128 descriptors
    /// are free (they are custody's: /proc reads, pidfds, the ledger).
    #[cfg_attr(unix, arg(long, default_value_t = treewarden::http::conn::ConnLimits::default().max_total))]
    #[cfg_attr(windows, arg(long, default_value_t = 0))]
    max_connections: usize,
    /// Connections one local user (peer uid on the socket) may hold at
    /// once; past it, its new connections are closed at once.
    #[cfg_attr(unix, arg(long, default_value_t = treewarden::http::conn::ConnLimits::default().max_per_uid))]
    #[cfg_attr(windows, arg(long, default_value_t = 0))]
    max_connections_per_uid: usize,
    /// How long a request's head may take to arrive, and a keep-alive
    /// connection may idle between requests, before it is closed.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    header_timeout: Duration,
    /// Whom an unsettled tree refuses new work to: `owner` (the same owner
    /// record, or the same requester: socket uid, token; default) or `host`
    /// (every spawn, as before issue 26).
    #[arg(long, value_name = "SCOPE", default_value = "owner")]
    dispatch_scope: treewarden::custody::DispatchScope,
}

#[derive(clap::Subcommand, Debug)]
pub enum TokenCommand {
    /// Make a token; its secret is printed once (only its hash is kept).
    Create {
        /// read: every read; spawn: reads, spawns, and kills/resolutions of
        /// its own trees; admin: everything.
        #[arg(long)]
        scope: treewarden::ledger::TokenScope,
        /// A name for the token list and the audit trail.
        #[arg(long, default_value = "")]
        name: String,
        /// Print {"id", "name", "scope", "token"} as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Every token (never a secret).
    List {
        #[arg(long)]
        json: bool,
    },
    /// Revoke a token: refused from the next request on.
    Revoke { id: i64 },
}

/// The CLI's user as the ledger records it.
fn cli_requester() -> treewarden::ledger::Requester {
    treewarden::ledger::Requester {
        via: "cli".into(),
        uid: Some(treewarden::proc::current_uid()),
        pid: Some(std::process::id() as i32),
        ..Default::default()
    }
}

#[cfg(unix)]
pub fn token(config: &Config, cmd: TokenCommand) -> CliResult {
    let ledger = open_ledger(config)?;
    let internal = |e: treewarden::ledger::LedgerError| CliError::internal(anyhow!(e));
    match cmd {
        TokenCommand::Create { scope, name, json } => {
            let secret = treewarden::http::auth::new_secret()
                .map_err(|e| CliError::internal(anyhow!("random bytes: {e}")))?;
            let hash = treewarden::http::auth::token_hash(&secret);
            let id = ledger
                .create_token(&name, scope, &hash, &cli_requester())
                .map_err(internal)?;
            if json {
                print_json(&serde_json::json!({
                    "id": id, "name": name, "scope": scope, "token": secret,
                }))?;
            } else {
                println!("{secret}");
                eprintln!(
                    "token {id} ({}) made; the secret above is shown only now",
                    scope.as_str()
                );
            }
            Ok(0)
        }
        TokenCommand::List { json } => {
            let tokens = ledger.tokens().map_err(internal)?;
            if json {
                print_json(&tokens)?;
                return Ok(0);
            }
            println!(
                "{:>4}  {:<6}  {:<24}  {:<24}  REVOKED",
                "ID", "SCOPE", "NAME", "CREATED"
            );
            for t in tokens {
                println!(
                    "{:>4}  {:<6}  {:<24}  {:<24}  {}",
                    t.id,
                    t.scope.as_str(),
                    t.name,
                    t.created_at,
                    t.revoked_at.as_deref().unwrap_or("-")
                );
            }
            Ok(0)
        }
        TokenCommand::Revoke { id } => {
            match ledger.revoke_token(id, &cli_requester()) {
                Ok(true) => println!("token {id} revoked"),
                Ok(false) => println!("token {id} was already revoked"),
                Err(treewarden::ledger::LedgerError::NotFound(_)) => {
                    return Err(CliError::usage(anyhow!("unknown token {id}")));
                }
                Err(e) => return Err(internal(e)),
            }
            Ok(0)
        }
    }
}

#[derive(Args, Debug)]
pub struct ResolveArgs {
    tree: i64,
    /// The operator's decision, for the audit trail.
    #[arg(long)]
    note: String,
    /// Print the resolved tree as JSON.
    #[arg(long)]
    json: bool,
    /// Resolve even though survivors the teardown left still live; they are
    /// named in `tree.resolved` (and the tree flagged `survivors_left`).
    #[arg(long)]
    force: bool,
}

/// A sweep's concurrency: 1 to 1024 teardowns at once (one thread each).
fn parse_concurrency(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n @ 1..=1024) => Ok(n),
        _ => Err(format!("{s:?} is not a number of teardowns from 1 to 1024")),
    }
}

fn open_ledger(config: &Config) -> Result<Ledger, CliError> {
    Ledger::open(&config.ledger_path(), LedgerOptions::from_config(config)).map_err(|e| {
        CliError::internal(anyhow!(
            "cannot open the ledger {}: {e}",
            config.ledger_path().display()
        ))
    })
}

/// The engine of a command that spawns (`run`, `serve`): its boundary is
/// resolved now, so a boundary the host cannot form fails before any work.
fn engine(config: &Config, reaper: Option<&'static Reaper>) -> Result<Engine, CliError> {
    let ledger = open_ledger(config)?;
    Engine::new(config, ledger, reaper).map_err(custody_error)
}

/// The engine of a command that only signals (`kill`, `sweep`, `resolve`).
/// The engine of a command that only signals or reads: it never creates a
/// ledger (a missing one is usually a mistyped --data-dir).
fn signal_engine(config: &Config) -> Result<Engine, CliError> {
    Ok(Engine::signal_only(
        config,
        open_existing_ledger(config)?,
        None,
    ))
}

/// Maps an engine error to its exit code, once.
fn custody_error(e: CustodyError) -> CliError {
    let code = match &e {
        CustodyError::UnknownTree(_) | CustodyError::Conflict(_) => EXIT_USAGE,
        CustodyError::Exec(failure) => failure.exit_code(),
        CustodyError::DispatchRefused { .. }
        | CustodyError::Unsupported(_)
        | CustodyError::Ledger(_)
        | CustodyError::Proc(_)
        | CustodyError::Ambiguous { .. }
        | CustodyError::Incomplete { .. } => EXIT_INTERNAL,
    };
    CliError::with_code(code, anyhow!(e))
}

/// Whether a progress line is on the terminal (cleared by [`progress_done`]).
static PROGRESS_SHOWN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Clears the progress line, if one was printed, so the next output starts
/// on a clean line.
fn progress_done(quiet: bool) {
    if !quiet && PROGRESS_SHOWN.swap(false, std::sync::atomic::Ordering::SeqCst) {
        eprint!("\r\x1b[2K");
        let _ = std::io::stderr().flush();
    }
}

/// Prints teardown progress on stderr, only when it is a terminal, only
/// after the first second, at most a few times a second.
fn progress_printer(quiet: bool) -> impl FnMut(&Progress) {
    let tty = !quiet && std::io::stderr().is_terminal();
    let mut last = Duration::ZERO;
    move |p: &Progress| {
        if !tty
            || p.elapsed < Duration::from_secs(1)
            || p.elapsed - last < Duration::from_millis(250)
        {
            return;
        }
        last = p.elapsed;
        let grace = p
            .grace_left
            .map(|g| format!(", grace left {:.1}s", g.as_secs_f64()))
            .unwrap_or_default();
        eprint!(
            "\rtreewarden: {} — {} alive{grace}   ",
            p.phase.as_str(),
            p.alive
        );
        PROGRESS_SHOWN.store(true, std::sync::atomic::Ordering::SeqCst);
        let _ = std::io::stderr().flush();
    }
}

pub fn run(config: &Config, args: RunArgs) -> CliResult {
    // The caller's descriptors first, before anything else opens one.
    let (id_file, status_file) = take_run_fds(args.id_fd, args.status_fd)?;
    let mut status = RunStatus::default();
    let result = run_owned(config, args, &mut status, id_file);
    if let Some(mut file) = status_file {
        if let Err(e) = &result
            && status.error.is_none()
        {
            status.error = Some(format!("{:#}", e.error));
        }
        let line = serde_json::to_string(&status).unwrap_or_default();
        if let Err(e) = writeln!(file, "{line}") {
            tracing::warn!(error = %e, "--status-fd not written");
        }
    }
    result
}

/// The line `run --status-fd N` writes when it ends, on every path: the
/// tree (`null` when none was recorded), its state in the ledger, how its
/// root ended (`null` when unknown), and treewarden's own failure (`null`
/// when there was none) — so a command's own `exit 125` is told from
/// run's. A contract (docs/INTEGRATION.md): fields are only ever added.
#[derive(Debug, Default, serde::Serialize)]
struct RunStatus {
    tree: Option<i64>,
    state: Option<String>,
    exit: Option<RunExit>,
    error: Option<String>,
}

/// The root's end: `code` when it exited, `signal` when a signal killed it.
#[derive(Debug, serde::Serialize)]
struct RunExit {
    code: Option<i32>,
    signal: Option<i32>,
}

impl From<treewarden::proc::ExitStatus> for RunExit {
    fn from(s: treewarden::proc::ExitStatus) -> Self {
        match s {
            treewarden::proc::ExitStatus::Exited(c) => Self {
                code: Some(c),
                signal: None,
            },
            treewarden::proc::ExitStatus::Signaled(n) => Self {
                code: None,
                signal: Some(n),
            },
        }
    }
}

/// `--id-fd` and `--status-fd` (one descriptor may serve both: the id line
/// comes first, the status line last).
fn take_run_fds(
    id_fd: Option<i32>,
    status_fd: Option<i32>,
) -> Result<(Option<std::fs::File>, Option<std::fs::File>), CliError> {
    let take = |flag: &str, n: i32| {
        treewarden::proc::take_inherited_fd(n)
            .map_err(|e| CliError::internal(anyhow!("{flag} {n}: {e}")))
    };
    let id = id_fd.map(|n| take("--id-fd", n)).transpose()?;
    let status = match (status_fd, &id) {
        (Some(n), Some(file)) if Some(n) == id_fd => Some(
            file.try_clone()
                .map_err(|e| CliError::internal(anyhow!("--status-fd {n}: {e}")))?,
        ),
        (Some(n), _) => Some(take("--status-fd", n)?),
        (None, _) => None,
    };
    Ok((id, status))
}

fn run_owned(
    config: &Config,
    args: RunArgs,
    status: &mut RunStatus,
    mut id_file: Option<std::fs::File>,
) -> CliResult {
    if args.command.is_empty() {
        return Err(CliError::internal(anyhow!(
            "empty command: usage is `treewarden run [OPTIONS] -- CMD [ARGS...]`"
        )));
    }
    let reaper = Reaper::install()
        .map_err(|e| CliError::internal(anyhow!("cannot become a subreaper: {e}")))?;
    let named_owner = match (args.owner_pid, args.lifetime) {
        (Some(pid), _) => Some(named_owner(pid, args.owner_start_ticks)?),
        // A tree that outlives its root lives as long as its owner: the
        // caller (run's parent process) unless --owner-pid names another.
        (None, Lifetime::Owner) => Some(named_owner(treewarden::proc::parent_pid(), None)?),
        (None, Lifetime::Root) => None,
    };
    let mut engine = engine(config, Some(reaper))?;
    engine.set_dispatch_scope(args.dispatch_scope);
    // What a teardown could not authorize is finished first, by the first
    // process that finds the ledger writable: this one. Dispatch then judges
    // what is left.
    if !args.no_settle {
        engine.settle_failed_closed(SETTLE_LIMIT);
    }
    let me = treewarden::proc::self_identity().map_err(|e| CliError::internal(anyhow!(e)))?;
    let (owner, owner_kind) = match &named_owner {
        Some(id) => (id.clone(), OwnerKind::Client),
        None => (me.clone(), OwnerKind::Run),
    };
    let env = (!args.env.is_empty()).then(|| {
        let mut env: Vec<(OsString, OsString)> = std::env::vars_os()
            .filter(|(k, _)| !args.env.iter().any(|(added, _)| added == k))
            .collect();
        env.extend(args.env.iter().cloned());
        env
    });
    let req = SpawnRequest {
        argv: args.command,
        label: args.label,
        cwd: args.cwd,
        env,
        limits: treewarden::ledger::Limits {
            memory_max: args.memory_max,
            pids_max: args.pids_max,
            cpu_max_pct: args.cpu_max,
        },
        umask: None,
        first_signal: None,
        // The invoking user is the requester: its uid is on the tree row.
        on_behalf: Some(treewarden::custody::OnBehalf {
            requester: treewarden::ledger::Requester {
                via: "cli".into(),
                uid: Some(treewarden::proc::current_uid()),
                pid: Some(me.pid),
                ..Default::default()
            },
            run_as: None,
        }),
        stdio: SpawnStdio::Inherit,
        owner,
        owner_kind,
        grace: Some(args.grace),
        timeout: args.timeout,
    };
    let opts = RunOptions {
        grace: Grace::resolve(Some(args.grace), None, policy::default_grace(), None),
        timeout: args.timeout,
        scan_interval: args.scan_interval,
        die_with_parent: args.die_with_parent,
        owner: named_owner,
        observer: config.observer,
        observer_rcvbuf: config.observer_rcvbuf,
        first_signal: args.signal,
        lifetime: args.lifetime,
        tty: None,
    };
    let mut opts = opts;
    // Terminal mode: the tree's own pty, the caller's terminal raw (restored
    // when `_raw` drops, before anything more is printed).
    // Not automatic for a tree that outlives run (`--lifetime owner`): its
    // terminal's master closes with run, and the hang-up would reach what
    // the tree keeps running.
    let auto_tty = args.lifetime == Lifetime::Root && treewarden::proc::tty::stdin_is_tty();
    let pty = if args.tty || (!args.no_tty && auto_tty) {
        let pty = treewarden::proc::tty::Pty::open()
            .map_err(|e| CliError::internal(anyhow!("--tty: no pseudo-terminal: {e}")))?;
        pty.copy_size_from_stdin();
        opts.tty = Some(pty.slave().to_path_buf());
        Some(pty)
    } else {
        None
    };
    let mut relay = match &pty {
        Some(p) => Some(TtyRelay::new(p).map_err(|e| CliError::internal(anyhow!("--tty: {e}")))?),
        None => None,
    };
    let raw = match &pty {
        Some(_) => treewarden::proc::tty::RawTerminal::enter()
            .map_err(|e| CliError::internal(anyhow!("--tty: raw mode: {e}")))?,
        None => None,
    };
    let args_for_keep = KeepArgs {
        grace: args.grace,
        signal: args.signal,
        scan_interval: args.scan_interval,
        timeout: args.timeout,
        started: std::time::Instant::now(),
        quiet: args.quiet,
    };
    let mut progress = progress_printer(args.quiet);
    let mut recorded_tree = None;
    // The id goes to the caller once the tree is recorded, before the
    // command runs; the descriptor is closed then (EOF for its reader).
    let mut recorded = |tree: TreeId| {
        recorded_tree = Some(tree.0);
        // The tree's terminal is open on its side now: relay it.
        if let Some(r) = relay.as_mut() {
            r.start();
        }
        if let Some(mut file) = id_file.take()
            && let Err(e) = writeln!(file, "{}", tree.0)
        {
            tracing::warn!(error = %e, "--id-fd not written");
        }
    };
    // Orphans dead wrappers left are torn down beside the command, with the
    // grace each was given, so a host without a sweep timer does not depend
    // on one; run waits for them before it exits (never half done).
    let outcome = std::thread::scope(|scope| {
        let settling = (!args.no_settle).then(|| {
            std::thread::Builder::new()
                .name("tw-settle".into())
                .spawn_scoped(scope, || engine.settle_orphans(SETTLE_LIMIT, args.grace))
        });
        let outcome = engine.run_with(&req, &opts, &mut progress, &mut recorded);
        if let Some(Ok(handle)) = settling {
            let _ = handle.join();
        }
        outcome
    });
    // What the tree wrote is on its way to our stdout; then the caller's
    // terminal gets its mode back.
    if let Some(r) = relay.take() {
        r.finish(Duration::from_secs(2));
    }
    drop(raw);
    progress_done(args.quiet);
    status.tree = recorded_tree;
    let outcome = outcome.map_err(custody_error)?;
    let code = outcome.exit_code();
    status.tree = Some(outcome.tree.0);
    let row = engine.ledger().tree(outcome.tree).ok().flatten();
    status.state = match (&row, &outcome.teardown) {
        (Some(row), _) => Some(row.state.as_str().to_string()),
        (None, Ok(Some(r))) => Some(r.state.as_str().to_string()),
        (None, _) => None,
    };
    status.exit = match outcome.end {
        treewarden::custody::RunEnd::RootExited(s) => Some(s.into()),
        _ => row.as_ref().and_then(|r| r.exit).map(|e| RunExit {
            code: e.code,
            signal: e.signal,
        }),
    };
    if let Ok(None) = outcome.teardown {
        // The root exited and the tree lives on: a custodian keeps it.
        let owner = opts
            .owner
            .clone()
            .ok_or_else(|| CliError::internal(anyhow!("a kept tree without an owner (a bug)")))?;
        return hand_over(config, &engine, &outcome, &owner, &args_for_keep, status);
    }
    if !args.quiet
        && let Some(line) = run_summary(&outcome, args.verbose)
    {
        eprintln!("{line}");
    }
    if let Err(e) = outcome.teardown {
        status.error = Some(e.to_string());
        if let Some(line) = survivors_hold_pipes(&engine, outcome.tree) {
            eprintln!("{line}");
        }
        return Err(CliError::internal(anyhow!(e)));
    }
    Ok(code)
}

/// When `run` failed closed leaving survivors and its stdout or stderr is a
/// pipe: one line saying the survivors hold the caller's pipes (run cannot
/// close another process's descriptors, and must not kill it without an
/// authorization), so a caller waiting for EOF knows why it waits and
/// what ends it.
#[cfg(unix)]
fn survivors_hold_pipes(engine: &Engine, tree: TreeId) -> Option<String> {
    use std::os::unix::fs::FileTypeExt;
    let survivors = engine.survivors_left(tree);
    if survivors.is_empty() {
        return None;
    }
    let pipes: Vec<&str> = [("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")]
        .into_iter()
        .filter(|(_, fd)| std::fs::metadata(fd).is_ok_and(|m| m.file_type().is_fifo()))
        .map(|(name, _)| name)
        .collect();
    let pids: Vec<String> = survivors.iter().map(i32::to_string).collect();
    let held = if pipes.is_empty() {
        String::new()
    } else {
        format!(
            "; they still hold this run's {} (a pipe: a reader waiting for its end waits for them)",
            pipes.join(" and ")
        )
    };
    Some(format!(
        "treewarden: tree {} left {} survivor(s) alive as evidence (pid {}){held}; the next treewarden run, ls, kill or sweep that can write the ledger finishes the teardown",
        tree.0,
        survivors.len(),
        pids.join(", ")
    ))
}

/// `run --tty`'s byte relay: stdin -> the tree's terminal, the tree's
/// terminal -> stdout, and SIGWINCH -> the terminal's size. Threads, as the
/// rest of `run`; the stdin reader is left blocked in its read when run
/// ends (the process exits).
#[cfg(unix)]
struct TtyRelay {
    master_in: Option<std::fs::File>,
    master_out: Option<std::fs::File>,
    master_size: Option<std::fs::File>,
    done: Option<std::sync::mpsc::Receiver<()>>,
    winch: Option<signal_hook::iterator::Handle>,
}

#[cfg(unix)]
impl TtyRelay {
    fn new(pty: &treewarden::proc::tty::Pty) -> std::io::Result<Self> {
        Ok(Self {
            master_in: Some(pty.master().try_clone()?),
            master_out: Some(pty.master().try_clone()?),
            master_size: Some(pty.master().try_clone()?),
            done: None,
            winch: None,
        })
    }

    fn start(&mut self) {
        use std::io::Read;
        if let Some(mut master) = self.master_out.take() {
            let (tx, rx) = std::sync::mpsc::channel();
            self.done = Some(rx);
            let _ = std::thread::Builder::new()
                .name("tw-tty-out".into())
                .spawn(move || {
                    let mut out = std::io::stdout();
                    let mut buf = [0u8; 8192];
                    // EIO once every holder of the tree's side has closed it.
                    while let Ok(n @ 1..) = master.read(&mut buf) {
                        if out.write_all(&buf[..n]).and_then(|()| out.flush()).is_err() {
                            break;
                        }
                    }
                    let _ = tx.send(());
                });
        }
        if let Some(mut master) = self.master_in.take() {
            let _ = std::thread::Builder::new()
                .name("tw-tty-in".into())
                .spawn(move || {
                    let mut input = std::io::stdin();
                    let mut buf = [0u8; 4096];
                    while let Ok(n @ 1..) = input.read(&mut buf) {
                        if master.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                });
        }
        if let Some(master) = self.master_size.take()
            && let Ok(mut winch) =
                signal_hook::iterator::Signals::new([signal_hook::consts::SIGWINCH])
        {
            self.winch = Some(winch.handle());
            let _ = std::thread::Builder::new()
                .name("tw-tty-winch".into())
                .spawn(move || {
                    for _ in winch.forever() {
                        treewarden::proc::tty::copy_stdin_size_to(&master);
                    }
                });
        }
    }

    /// Waits (bounded) until the tree's output is relayed.
    fn finish(self, limit: Duration) {
        if let Some(done) = &self.done {
            let _ = done.recv_timeout(limit);
        }
        if let Some(h) = &self.winch {
            h.close();
        }
    }
}

/// What the custodian of a kept tree needs from `run`'s arguments.
struct KeepArgs {
    grace: Duration,
    signal: Sig,
    scan_interval: Duration,
    timeout: Option<Duration>,
    /// When the tree was spawned (its timeout counts from there).
    started: std::time::Instant,
    quiet: bool,
}

/// `--lifetime owner`, the root exited and members live on: hands the tree
/// to a custodian — a `treewarden custody` process in a session of its own,
/// which outlives `run` — and returns the root's status at once. Without a
/// custodian the tree is torn down now (never left unwatched), and run
/// says so.
fn hand_over(
    config: &Config,
    engine: &Engine,
    outcome: &treewarden::custody::RunOutcome,
    owner: &treewarden::proc::Identity,
    keep: &KeepArgs,
    status: &mut RunStatus,
) -> CliResult {
    let tree = outcome.tree;
    let code = outcome.exit_code();
    let mut argv: Vec<OsString> = vec![
        std::env::current_exe()
            .map(OsString::from)
            .unwrap_or_else(|_| "treewarden".into()),
        "--data-dir".into(),
        config.data_dir.clone().into(),
        "custody".into(),
        tree.0.to_string().into(),
        "--owner-pid".into(),
        owner.pid.to_string().into(),
        "--owner-start-ticks".into(),
        owner.start_ticks.to_string().into(),
        "--grace".into(),
        format!("{}ms", keep.grace.as_millis()).into(),
        "--signal".into(),
        keep.signal.name().into(),
        "--scan-interval".into(),
        format!("{}ms", keep.scan_interval.as_millis()).into(),
    ];
    if let Some(t) = keep.timeout {
        let left = t.saturating_sub(keep.started.elapsed());
        argv.push("--timeout".into());
        argv.push(format!("{}ms", left.as_millis()).into());
    }
    let spec = treewarden::proc::SpawnSpec {
        argv,
        cwd: None,
        env: None,
        stdio: SpawnStdio::Null,
        cgroup: None,
        cgroup_settings: Vec::new(),
        log_file: None,
        umask: None,
        credentials: None,
        tty: None,
    };
    let started = treewarden::proc::spawn_held(&spec)
        .map_err(|e| e.to_string())
        .and_then(|held| held.release().map_err(|e| e.to_string()));
    match started {
        Ok(custodian) => {
            tracing::info!(
                tree = tree.0,
                custodian = custodian.pid,
                "tree kept by a custodian"
            );
            if !keep.quiet {
                eprintln!(
                    "treewarden: tree {} root exited; what it left runs on in custody (custodian pid {}) until its owner (pid {}) exits, `treewarden kill {}`, or its timeout",
                    tree.0, custodian.pid, owner.pid, tree.0
                );
            }
            Ok(code)
        }
        Err(e) => {
            // Never unwatched: torn down now, with the usual rules.
            let reason = format!("root exited; no custodian to keep the tree ({e})");
            let mut opts = TeardownOptions::new(keep.grace, reason, Origin::Run);
            opts.first_signal = keep.signal;
            let report = engine.teardown(tree, &opts, &mut |_| {});
            status.state = report.as_ref().ok().map(|r| r.state.as_str().to_string());
            let msg = format!(
                "tree {}: --lifetime owner could not start its custodian ({e}); the tree was torn down",
                tree.0
            );
            status.error = Some(msg.clone());
            Err(CliError::internal(anyhow!(msg)))
        }
    }
}

/// `treewarden custody TREE --owner-pid P`: the custodian `run --lifetime
/// owner` hands a tree to when its root exits (not for people; hidden).
#[derive(Args, Debug)]
pub struct CustodyArgs {
    tree: i64,
    #[arg(long, value_parser = clap::value_parser!(i32).range(1..))]
    owner_pid: i32,
    #[arg(long)]
    owner_start_ticks: u64,
    #[arg(long, default_value = policy::DEFAULT_GRACE, value_parser = parse_duration)]
    grace: Duration,
    #[arg(short = 's', long = "signal", default_value = "TERM", value_parser = parse_signal)]
    signal: Sig,
    #[arg(long, default_value = "250ms", value_parser = parse_duration)]
    scan_interval: Duration,
    #[arg(long, value_parser = parse_duration)]
    timeout: Option<Duration>,
}

/// The custodian: keeps the tree until its owner exits (or its timeout,
/// a signal, or nothing left), then tears it down.
pub fn custody(config: &Config, args: CustodyArgs) -> CliResult {
    let deadline = args.timeout.map(|t| std::time::Instant::now() + t);
    let engine = signal_engine(config)?;
    let owner = treewarden::proc::Identity {
        pid: args.owner_pid,
        start_ticks: args.owner_start_ticks,
        boot_id: treewarden::proc::boot_id()
            .map_err(|e| CliError::internal(anyhow!(e)))?
            .to_owned(),
    };
    let opts = treewarden::custody::KeepOptions {
        owner,
        deadline,
        scan_interval: args.scan_interval,
        // The grace its run resolved, handed over as it was.
        grace: Grace::from(args.grace),
        first_signal: args.signal,
    };
    let (end, report) = engine
        .keep(TreeId(args.tree), &opts, &mut |_| {})
        .map_err(custody_error)?;
    tracing::info!(
        tree = args.tree,
        ?end,
        state = report.state.as_str(),
        "kept tree torn down"
    );
    Ok(0)
}

/// The most teardowns a command settles on its way (`run`, `ls`, `kill`).
const SETTLE_LIMIT: usize = 8;

/// The process `run --owner-pid` names: it exists, is the one the caller
/// meant (`--owner-start-ticks`), and the caller may signal it.
fn named_owner(pid: i32, start_ticks: Option<u64>) -> Result<treewarden::proc::Identity, CliError> {
    let id = treewarden::proc::identity_of(pid)
        .map_err(|e| CliError::internal(anyhow!(e)))?
        .ok_or_else(|| CliError::internal(anyhow!("--owner-pid {pid}: no such process")))?;
    if let Some(ticks) = start_ticks
        && ticks != id.start_ticks
    {
        return Err(CliError::internal(anyhow!(
            "--owner-pid {pid}: started at tick {}, not {ticks} (the pid was recycled)",
            id.start_ticks
        )));
    }
    if !treewarden::proc::may_signal(pid) {
        return Err(CliError::internal(anyhow!(
            "--owner-pid {pid}: not a process you may signal"
        )));
    }
    Ok(id)
}

/// `, consumed cpu 12.3 ms, …`: the figures the host gave.
fn consumed(r: treewarden::ledger::Resources) -> String {
    match r.summary() {
        s if s.is_empty() => s,
        s => format!("; consumed {s}"),
    }
}

/// One line on stderr, like `systemd-run --wait`, when `run` tore its tree
/// down for any reason but a clean exit of a tree that left nothing behind:
/// the tree, why, what was there, what was forced, and the authority.
fn run_summary(outcome: &treewarden::custody::RunOutcome, always: bool) -> Option<String> {
    use treewarden::custody::RunEnd;
    let why = match outcome.end {
        RunEnd::RootExited(_) => "root exited",
        RunEnd::Timeout => "timed out",
        RunEnd::Signal(_) => "received a signal",
        RunEnd::ParentDied => "parent died",
        RunEnd::OwnerDied => "owner died",
    };
    match &outcome.teardown {
        // Kept (`--lifetime owner`): the line is the custodian's to say.
        Ok(None) => None,
        Ok(Some(r))
            if !always
                && matches!(outcome.end, RunEnd::RootExited(_))
                && r.members_at_start == 0 =>
        {
            None
        }
        Ok(Some(r)) => Some(format!(
            "treewarden: tree {} {why}: {} members torn down, {} force-killed ({} authorization{}), {}, {:.0} ms{}",
            outcome.tree.0,
            r.members_at_start,
            r.force_killed,
            r.authorizations,
            if r.authorizations == 1 { "" } else { "s" },
            r.state.as_str(),
            r.elapsed.as_secs_f64() * 1000.0,
            r.resources.map(consumed).unwrap_or_default()
        )),
        Err(e) => Some(format!(
            "treewarden: tree {} {why}: teardown not settled: {e}",
            outcome.tree.0
        )),
    }
}

pub fn kill(config: &Config, args: KillArgs) -> CliResult {
    shield_from_interrupts();
    let engine = signal_engine(config)?;
    engine.settle_failed_closed(SETTLE_LIMIT);
    let tree = TreeId(args.tree);
    let row = engine
        .ledger()
        .tree(tree)
        .map_err(|e| CliError::internal(anyhow!(e)))?
        .ok_or_else(|| CliError::usage(anyhow!("unknown tree {}", args.tree)))?;
    if row.state.is_terminal() && !row.has_survivors_left() {
        if args.json {
            print_json(&serde_json::json!({"tree": row.id, "state": row.state, "already": true}))?;
            return Ok(0);
        }
        println!("tree {} is already {}", row.id, row.state.as_str());
        return Ok(0);
    }
    // Who asked is in the reason the teardown records, as for the API.
    let reason = format!("treewarden kill by {}", cli_requester());
    // The grace recorded with the tree unless one is asked for (one hop to
    // the policy, one to the teardown).
    let grace = Grace::for_tree(&row, args.grace, policy::default_grace(), None);
    let mut opts = TeardownOptions::new(grace, reason, Origin::Kill);
    opts.first_signal = args.signal;
    let mut progress = progress_printer(args.quiet || args.json);
    let report = engine.teardown(tree, &opts, &mut progress);
    progress_done(args.quiet || args.json);
    let report = report.map_err(custody_error)?;
    if args.json {
        print_json(&report)?;
        return Ok(0);
    }
    println!(
        "tree {} {}: {} members at start, {} force-killed, {:.0} ms",
        report.tree,
        report.state.as_str(),
        report.members_at_start,
        report.force_killed,
        report.elapsed.as_secs_f64() * 1000.0
    );
    Ok(0)
}

/// Opens the ledger for a reader, after writing what unsettled markers kept
/// (a teardown that failed closed under a held lock), so the reader sees the
/// whole trail ([`Engine::settle_record`]).
fn open_for_reading(config: &Config) -> Result<Ledger, CliError> {
    let engine = signal_engine(config)?;
    engine.settle_record();
    Ok(engine.ledger().clone())
}

pub fn ls(config: &Config, args: LsArgs) -> CliResult {
    // A teardown that could not be authorized (its owner gone) is finished
    // by `ls` too, once the ledger takes writes: the list then shows it
    // settled. `show` never does (it is how an operator inspects survivors).
    signal_engine(config)?.settle_failed_closed(SETTLE_LIMIT);
    let ledger = open_for_reading(config)?;
    let trees = ledger
        .list_trees(args.all)
        .map_err(|e| CliError::internal(anyhow!(e)))?;
    if args.json {
        print_json(&trees)?;
        return Ok(0);
    }
    println!(
        "{:>6}  {:<12}  {:<8}  {:>8}  {:<14}  {:<12}  {:<20}  CREATED",
        "ID", "STATE", "BOUNDARY", "ROOT", "OWNER", "END", "LABEL"
    );
    for t in &trees {
        println!("{}", tree_line(t));
    }
    Ok(0)
}

fn tree_line(t: &TreeRow) -> String {
    format!(
        "{:>6}  {:<12}  {:<8}  {:>8}  {:<14}  {:<12}  {:<20}  {}",
        t.id,
        t.state.as_str(),
        t.boundary,
        t.root_pid
            .map(|p| p.to_string())
            .unwrap_or_else(|| "-".into()),
        format!("{} {}", t.owner.kind, t.owner.pid),
        end_reason(t),
        t.label.clone().unwrap_or_default(),
        t.created_at
    )
}

/// How a tree ended, in a word: its root's exit, or why it has none.
fn end_reason(t: &TreeRow) -> String {
    use treewarden::ledger::TreeState as S;
    if root_exited_members_alive(t) {
        return "root exited, members alive".into();
    }
    match (t.state, t.exit) {
        (_, Some(e)) => match (e.code, e.signal) {
            (_, Some(sig)) => format!("signal {sig}"),
            (Some(code), None) => format!("exit {code}"),
            (None, None) => "-".into(),
        },
        (S::Ended, None) => "ended".into(),
        (S::Vanished, None) => "vanished".into(),
        (S::Resolved, None) => "resolved".into(),
        (S::SpawnFailed, None) => "spawn failed".into(),
        _ => "-".into(),
    }
}

/// A kept tree (`--lifetime owner`) whose root exited while members live on.
fn root_exited_members_alive(t: &TreeRow) -> bool {
    !t.state.is_terminal()
        && t.flags
            .iter()
            .any(|f| f == treewarden::custody::ROOT_EXITED_FLAG)
}

pub fn show(config: &Config, args: ShowArgs) -> CliResult {
    let ledger = open_for_reading(config)?;
    let mut detail = ledger
        .tree_detail(TreeId(args.tree))
        .map_err(|e| CliError::internal(anyhow!(e)))?
        .ok_or_else(|| CliError::usage(anyhow!("unknown tree {}", args.tree)))?;
    if detail.resources.is_none() {
        detail.resources = treewarden::custody::live_resources(&detail.tree);
    }
    if args.json && args.tree_view {
        print_json(&detail.hierarchy())?;
        return Ok(0);
    }
    if args.json {
        print_json(&detail)?;
        return Ok(0);
    }
    if args.tree_view {
        print!(
            "{}",
            treewarden::ledger::hierarchy::draw(&detail.hierarchy())
        );
        return Ok(0);
    }
    let t = &detail.tree;
    let state = if root_exited_members_alive(t) {
        format!("{} (root exited, members alive)", t.state.as_str())
    } else {
        t.state.as_str().to_string()
    };
    println!(
        "tree {}  {}  boundary {}  label {}",
        t.id,
        state,
        t.boundary,
        t.label.clone().unwrap_or_default()
    );
    println!(
        "root {}  pgid {}  sid {}  cgroup {}",
        opt(t.root_pid),
        opt(t.pgid),
        opt(t.sid),
        t.cgroup.clone().unwrap_or_else(|| "-".into())
    );
    println!(
        "owner pid {} (start {})  created {}  ended {}",
        t.owner.pid,
        t.owner.start,
        t.created_at,
        t.ended_at.clone().unwrap_or_else(|| "-".into())
    );
    println!("\nmembers ({}):", detail.members.len());
    for m in &detail.members {
        println!(
            "  {:>7} start {:<10} pgid {:<7} sid {:<7} {}{}{}",
            m.pid,
            m.start_ticks,
            opt(m.pgid),
            opt(m.sid),
            m.cmdline.join(" "),
            if m.escaped_at.is_some() {
                "  [escaped]"
            } else {
                ""
            },
            if m.exited_at.is_some() {
                "  [exited]"
            } else {
                ""
            },
        );
    }
    println!("\nobservations ({}):", detail.observations.len());
    for o in &detail.observations {
        println!(
            "  {:<9} {:>7} start {:<10} {}  {}",
            o.kind, o.identity.pid, o.identity.start_ticks, o.at, o.detail
        );
    }
    println!("\nsignals ({}):", detail.signals.len());
    for sig in &detail.signals {
        println!(
            "  {} {:<8} {:<6} {:<24} {}{}",
            sig.at,
            sig.signal,
            sig.target_kind,
            sig.target,
            sig.result,
            sig.authorization
                .map(|a| format!("  (authorization {a})"))
                .unwrap_or_default()
        );
    }
    println!("\nauthorizations ({}):", detail.authorizations.len());
    for a in &detail.authorizations {
        let targets: Vec<String> = a
            .targets
            .iter()
            .map(|t| {
                let pids: Vec<String> = t.identities.iter().map(|i| i.pid.to_string()).collect();
                format!("{} {} [{}]", t.kind, t.target, pids.join(" "))
            })
            .collect();
        println!(
            "  {:>4} {} {}: {}",
            a.id,
            a.at,
            a.reason,
            targets.join("; ")
        );
    }
    println!("\nevents ({}):", detail.events.len());
    for e in &detail.events {
        println!("  {:>6} {} {:<18} {}", e.seq, e.at, e.kind, e.data);
    }
    Ok(0)
}

fn opt(v: Option<i32>) -> String {
    v.map(|v| v.to_string()).unwrap_or_else(|| "-".into())
}

pub fn logs(config: &Config, args: LogsArgs) -> CliResult {
    let engine = signal_engine(config)?;
    let tree = TreeId(args.tree);
    let read_row = |engine: &Engine| {
        engine
            .ledger()
            .tree(tree)
            .map_err(|e| CliError::internal(anyhow!(e)))?
            .ok_or_else(|| CliError::usage(anyhow!("unknown tree {}", args.tree)))
    };
    read_row(&engine)?;
    let data_dir = engine.data_dir().to_path_buf();
    let bytes = treewarden::custody::read_log(&data_dir, tree, args.tail)
        .map_err(|e| CliError::internal(anyhow!("reading the log of tree {}: {e}", args.tree)))?
        .ok_or_else(|| {
            CliError::usage(anyhow!(
                "tree {} captured no output (trees of `run` pass theirs through)",
                args.tree
            ))
        })?;
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(&bytes);
    let _ = out.flush();
    if !args.follow {
        return Ok(0);
    }
    // Follow: print what is appended, poll every 200 ms, until the tree has
    // ended and its output stopped growing; the follower keeps its place
    // across the cap's collapses (custody::LogFollower).
    let path = treewarden::custody::log_path(&data_dir, tree);
    let mut follower = treewarden::custody::LogFollower::after(path, &bytes)
        .map_err(|e| CliError::internal(anyhow!("reading the log: {e}")))?;
    let mut ended_quiet = 0;
    loop {
        std::thread::sleep(Duration::from_millis(200));
        let chunk = follower
            .poll()
            .map_err(|e| CliError::internal(anyhow!("reading the log: {e}")))?;
        if !chunk.is_empty() {
            if out.write_all(&chunk).and_then(|()| out.flush()).is_err() {
                return Ok(0);
            }
            ended_quiet = 0;
        } else if read_row(&engine)?.state.is_terminal() {
            ended_quiet += 1;
            if ended_quiet >= 2 {
                return Ok(0);
            }
        }
    }
}

pub fn sweep(config: &Config, args: SweepArgs) -> CliResult {
    shield_from_interrupts();
    let engine = signal_engine(config)?;
    let mut opts = treewarden::custody::SweepOptions::new(args.grace);
    opts.concurrency = args.concurrency;
    let report = engine.sweep_with(&opts).map_err(custody_error)?;
    if args.json {
        print_json(&report)?;
    } else {
        println!(
            "sweep: {} live trees examined, {} owned, {} orphans",
            report.examined,
            report.owned,
            report.orphans.len()
        );
        for o in &report.orphans {
            match (&o.to, &o.error) {
                (Some(to), _) => println!(
                    "  tree {}: {} -> {} (grace {})",
                    o.tree,
                    o.from.as_str(),
                    to.as_str(),
                    humantime::format_duration(Duration::from_millis(o.grace_ms))
                ),
                (None, Some(e)) => {
                    println!("  tree {}: {} -> unsettled: {e}", o.tree, o.from.as_str())
                }
                (None, None) => {}
            }
        }
    }
    Ok(if report.settled() { 0 } else { EXIT_INTERNAL })
}

pub fn resolve(config: &Config, args: ResolveArgs) -> CliResult {
    let engine = signal_engine(config)?;
    engine
        .resolve_by(
            TreeId(args.tree),
            &args.note,
            args.force,
            Some(&cli_requester()),
        )
        .map_err(custody_error)?;
    if args.json {
        let row = engine
            .ledger()
            .tree(TreeId(args.tree))
            .map_err(|e| CliError::internal(anyhow!(e)))?;
        print_json(&row)?;
        return Ok(0);
    }
    println!("tree {} resolved", args.tree);
    Ok(0)
}

/// A teardown interrupted between freeze and thaw would leave the tree
/// frozen (or SIGSTOPped). `kill` and `sweep` are bounded, so they finish
/// what they started: SIGINT, SIGTERM and SIGHUP are noted and ignored.
/// (SIGKILL cannot be; a tree left frozen by it is in state `killing` and
/// the next sweep resumes it.)
#[cfg(unix)]
fn shield_from_interrupts() {
    let noted = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    for sig in [
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGHUP,
    ] {
        if let Err(e) = signal_hook::flag::register(sig, noted.clone()) {
            tracing::warn!(signal = sig, error = %e, "cannot shield the teardown from this signal");
        }
    }
}

fn print_json(value: &impl serde::Serialize) -> Result<(), CliError> {
    let text = serde_json::to_string_pretty(value).map_err(|e| CliError::internal(anyhow!(e)))?;
    println!("{text}");
    Ok(())
}

/// `treewarden serve`: the service. Exit 0 after a clean shutdown (every
/// owned tree torn down), 125 when it could not start or settle.
#[cfg(unix)]
pub fn serve(config: &Config, args: ServeArgs) -> CliResult {
    let telemetry = treewarden::telemetry::init(args.log_format, "info");
    let result = serve_inner(config, args);
    telemetry.shutdown();
    result
}

/// `serve`'s flags as the library's options.
#[cfg(unix)]
fn serve_inner(config: &Config, args: ServeArgs) -> CliResult {
    use treewarden::service::ServiceConfig;
    use treewarden::service::serve::{ServeOptions, serve};
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
        },
        retain: args.retain,
        retain_every: args.retain_every,
        retain_archive: args.retain_archive,
        ship_otlp: args.ship_otlp,
        socket: args.socket,
        admin_group: args.admin_group,
        open_reads: args.open_reads,
        limits: treewarden::http::conn::ConnLimits {
            max_total: args.max_connections,
            max_per_uid: args.max_connections_per_uid,
            header_read: args.header_timeout,
            ..treewarden::http::conn::ConnLimits::default()
        },
        dispatch_scope: args.dispatch_scope,
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

// The Windows bodies of what the Unix ones above do through Unix-only
// parts (issue 27): see src/windows_cli.rs.
#[cfg(windows)]
use crate::windows_cli::{TtyRelay, shield_from_interrupts, survivors_hold_pipes};
#[cfg(windows)]
pub use crate::windows_cli::{serve, token};
