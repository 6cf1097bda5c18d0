//! Command-line interface: clap definitions, config assembly and output
//! formatting (human tables and `--json`). With `commands.rs`, the only place
//! that uses `anyhow`; every failure leaves here on stderr with a distinct
//! exit code: one line for our own errors, clap's whole message (with its
//! suggestions) for bad arguments — exit 2, or 125 for `run`, whose other
//! statuses belong to the command it runs (as with timeout(1) and env(1)).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use treewarden::config::{BoundaryChoice, Config, ObserverMode};
use treewarden::ledger::{EventFilter, ExportFormat, Ledger, LedgerError, LedgerOptions, TreeId};

use crate::commands::open_existing_ledger;
use crate::exit::{CliError, CliResult, EXIT_BROKEN, EXIT_INTERNAL, EXIT_USAGE};

#[derive(Parser, Debug)]
#[command(name = "treewarden", version, about = "Takes custody of process trees")]
pub struct Cli {
    /// Directory holding the ledger (default: /var/lib/treewarden for root,
    /// else $XDG_STATE_HOME/treewarden).
    #[arg(long, global = true, env = "TREEWARDEN_DATA_DIR", value_name = "DIR")]
    data_dir: Option<PathBuf>,

    /// Ownership boundary for new trees (auto: a cgroup where the host
    /// allows, else session and process group).
    #[arg(
        long,
        global = true,
        env = "TREEWARDEN_BOUNDARY",
        default_value = "auto",
        value_enum
    )]
    boundary: BoundaryChoice,

    /// cgroup v2 directory under which tree cgroups are made (default: discovered).
    #[arg(
        long,
        global = true,
        env = "TREEWARDEN_CGROUP_ROOT",
        value_name = "DIR"
    )]
    cgroup_root: Option<PathBuf>,

    /// How long a ledger write waits for another writer before failing.
    #[arg(long, global = true, env = "TREEWARDEN_BUSY_TIMEOUT", default_value = "2s", value_parser = parse_duration)]
    busy_timeout: Duration,

    /// Space the ledger keeps allocated for itself (its WAL, preallocated
    /// at open), so that when something else fills the disk the next kill's
    /// authorization still commits; 0: none.
    #[arg(long, global = true, env = "TREEWARDEN_LEDGER_RESERVE", default_value = "8M", value_name = "SIZE", value_parser = parse_size_or_zero)]
    ledger_reserve: u64,

    /// Proc-connector observer beside the scans: auto (where available), on
    /// (required: refuse to start work without it) or off (scans only).
    #[arg(
        long,
        global = true,
        env = "TREEWARDEN_OBSERVER",
        default_value = "auto",
        value_enum
    )]
    observer: ObserverMode,

    /// Receive buffer of the observer's netlink socket in bytes (0: 1 MiB).
    #[arg(
        long,
        global = true,
        env = "TREEWARDEN_OBSERVER_RCVBUF",
        default_value = "0",
        hide = true
    )]
    observer_rcvbuf: usize,

    #[command(subcommand)]
    command: Command,
}

// Parsed once at start and matched once: the size of its largest variant
// (serve's many options) costs nothing worth a Box.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
enum Command {
    /// Spawn CMD as an owned tree and stay its owner; tear the whole tree
    /// down when the root exits, on timeout, or on SIGINT/SIGTERM/SIGHUP.
    ///
    /// Exit: the root's status; 124 timeout; 128+N signal N; 125 treewarden
    /// failed (cannot record, teardown ambiguous, dispatch refused); 126 not
    /// executable; 127 not found.
    Run(crate::commands::RunArgs),
    /// The custodian of a tree whose root exited (`run --lifetime owner`).
    #[command(hide = true)]
    Custody(crate::commands::CustodyArgs),
    /// Tear one tree down, with the same rules as run.
    Kill(crate::commands::KillArgs),
    /// List trees (live by default).
    Ls(crate::commands::LsArgs),
    /// One tree: members, escapes, signals, authorizations, events.
    Show(crate::commands::ShowArgs),
    /// A tree's captured stdout and stderr (trees spawned through the API;
    /// `run` passes its output through).
    Logs(crate::commands::LogsArgs),
    /// One orphan sweep now: tear down every tree whose owner is gone.
    Sweep(crate::commands::SweepArgs),
    /// Record an operator's resolution of an ambiguous tree; reopens dispatch.
    Resolve(crate::commands::ResolveArgs),
    /// The service: HTTP API, dashboard, /metrics, scans, sweeps. It owns
    /// the trees spawned through the API and tears them down on SIGTERM.
    Serve(crate::commands::ServeArgs),
    /// Scoped bearer tokens for the service's TCP listener (kept in the
    /// ledger as hashes; effective at once, no restart).
    #[command(subcommand)]
    Token(crate::commands::TokenCommand),
    /// Report what this host supports (cgroup v2, pidfd, subreaper, proc
    /// connector) and which boundary `auto` picks.
    Doctor {
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Write the audit trail (hash-chained events) for incident review.
    ///
    /// Exit 0 on success; 2 on a bad argument or when no ledger exists at the
    /// data directory (nothing is created); 125 when the ledger cannot be read.
    Export {
        /// ndjson (one event per line) or csv.
        #[arg(long, default_value = "ndjson", value_enum)]
        format: ExportFormat,
        /// Only events at or after T: RFC 3339 (`2024-05-01T12:00:00Z`) or an
        /// age (`2h`, `30m`).
        #[arg(long, value_name = "T")]
        since: Option<String>,
        /// Only events of this tree.
        #[arg(long, value_name = "ID")]
        tree: Option<String>,
        /// Only events after this seq (exclusive): an incremental export
        /// resumes from the last seq it wrote.
        #[arg(long, value_name = "SEQ")]
        after: Option<i64>,
    },
    /// Copy the ledger to DEST (a new file) while it is in use, through
    /// SQLite's online backup, then verify the copy on its own.
    ///
    /// Exit 0 with the copy's summary; 2 when DEST exists or no ledger
    /// exists at the data directory; 1 when the copy does not verify; 125
    /// when the copy cannot be made.
    Backup {
        /// The new file (refused if it exists; created 0600).
        #[arg(value_name = "DEST")]
        dest: PathBuf,
    },
    /// Remove the events and rows of trees that ended before T (never a
    /// live, ambiguous or otherwise unsettled tree's), after writing them to
    /// an fsynced archive; leaves a `ledger.checkpoint` event from which
    /// `verify` proves what remains.
    ///
    /// Exit 0 with a summary (also when nothing was prunable); 2 on a bad
    /// argument, an existing archive, or no ledger at the data directory;
    /// 125 when the prune failed (nothing was deleted, no archive is left).
    Prune {
        /// Trees that ended before T: `now`, RFC 3339 (`2024-05-01T12:00:00Z`)
        /// or an age (`30d`: thirty days ago).
        #[arg(long, value_name = "T")]
        before: String,
        /// Write the removed events here first (NDJSON, the export format;
        /// a new file, created 0600). Without it they are gone.
        #[arg(long, value_name = "FILE")]
        archive: Option<PathBuf>,
        /// Print the report as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Forward-secure seals over the hash chain (docs/THREAT-MODEL.md):
    /// set up, seal the epochs due, close at a clean stop.
    #[command(subcommand)]
    Seal(SealCommand),
    /// Check the ledger: SQLite integrity, the whole hash chain (from the
    /// newest checkpoint, after a prune), every SIGKILL preceded by its
    /// authorization, (with --expect-head) truncation, and (with
    /// --seal-key) the seals.
    ///
    /// Exit 0 with a one-line summary; 1 with the first break; 2 on a bad
    /// argument or when no ledger (or export) exists.
    Verify {
        /// The verification key `seal setup` printed: check every seal's
        /// MAC, that epochs are consecutive from the setup, that every event
        /// at or below a seal's head is covered, and that the newest seal is
        /// at most two intervals old at the time of the read (or the
        /// writer closed cleanly).
        #[arg(
            long,
            value_name = "KEY",
            env = "TREEWARDEN_SEAL_KEY",
            hide_env_values = true
        )]
        seal_key: Option<String>,
        /// Verify this NDJSON export (`treewarden export`) alone instead of
        /// the ledger: no data directory needed; same verdict.
        #[arg(long, value_name = "FILE", conflicts_with_all = ["expect_head", "archive"])]
        export: Option<PathBuf>,
        /// The head published elsewhere (the `ledger head` log line), as
        /// SEQ:HASH; the ledger must contain exactly this event.
        #[arg(long, value_name = "SEQ:HASH")]
        expect_head: Option<String>,
        /// Also prove that this archive (written by `prune --archive`) is
        /// exactly what a checkpoint pruned and chains into the ledger.
        /// Repeatable: archives of later prunes vouch for earlier checkpoints.
        #[arg(long, value_name = "FILE")]
        archive: Vec<PathBuf>,
        /// Print the report as one JSON object (also when it fails).
        #[arg(long)]
        json: bool,
    },
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the man page (roff) on stdout: `treewarden man | man -l -`.
    Man,
}

#[derive(Subcommand, Debug)]
enum SealCommand {
    /// Make a seed, print the verification key once on stdout (keep it off
    /// this host), record the interval in the ledger and keep only epoch
    /// 0's key, in <data-dir>/seal.key (0600). Refused when set up before.
    ///
    /// Exit 0 with the key on stdout; 2 when sealing is set up already, on a
    /// bad interval, or when no ledger exists; 125 when it cannot be recorded.
    Setup {
        /// How long an epoch is (every epoch is sealed; at least 1s).
        #[arg(long, default_value = "15m", value_parser = parse_duration)]
        interval: Duration,
    },
    /// Seal every ended epoch not sealed yet, at once (those past their
    /// next epoch marked late): for a host without `serve`, e.g. from cron.
    ///
    /// Exit 0; 2 when sealing is not set up; 125 when a seal cannot be made.
    Now,
    /// A clean stop: seal the ended epochs and the current one, marked as a
    /// close, so `verify --seal-key` asks for no fresher seal. (`serve`
    /// does this at its shutdown.)
    Close,
}

/// Parses a duration for clap ([`treewarden::config::parse_duration`]).
/// A size as `--log-max` takes it, or `0` (none).
pub fn parse_size_or_zero(s: &str) -> Result<u64, String> {
    if s.trim() == "0" {
        return Ok(0);
    }
    treewarden::ledger::parse_size(s)
}

pub fn parse_duration(s: &str) -> Result<Duration, String> {
    treewarden::config::parse_duration(s)
}

impl Cli {
    fn config(&self) -> Config {
        Config {
            data_dir: self
                .data_dir
                .clone()
                .unwrap_or_else(Config::default_data_dir),
            boundary: self.boundary,
            cgroup_root: self.cgroup_root.clone(),
            busy_timeout: self.busy_timeout,
            ledger_reserve: self.ledger_reserve,
            observer: self.observer,
            observer_rcvbuf: self.observer_rcvbuf,
        }
    }
}

pub fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return usage_error(e),
    };
    if matches!(
        cli.command,
        Command::Ls(_)
            | Command::Show(_)
            | Command::Logs(_)
            | Command::Export { .. }
            | Command::Verify { .. }
            | Command::Seal(_)
            | Command::Doctor { .. }
            | Command::Completions { .. }
            | Command::Man
    ) {
        // Commands that only print: a reader that closes the pipe early
        // (`ls | head -1`) ends them quietly (status 141), like any Unix tool.
        treewarden::proc::default_sigpipe();
    }
    if !matches!(cli.command, Command::Serve(_)) {
        // serve sets up its own logging (format, level, OTLP).
        init_tracing();
    }
    let config = cli.config();
    let result: CliResult = run_command(cli.command, &config);
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("treewarden: {}", e.error);
            ExitCode::from(e.code)
        }
    }
}

fn run_command(command: Command, config: &Config) -> CliResult {
    match command {
        Command::Run(args) => crate::commands::run(config, args),
        Command::Custody(args) => crate::commands::custody(config, args),
        Command::Kill(args) => crate::commands::kill(config, args),
        Command::Ls(args) => crate::commands::ls(config, args),
        Command::Show(args) => crate::commands::show(config, args),
        Command::Logs(args) => crate::commands::logs(config, args),
        Command::Sweep(args) => crate::commands::sweep(config, args),
        Command::Resolve(args) => crate::commands::resolve(config, args),
        Command::Serve(args) => crate::commands::serve(config, args),
        Command::Token(cmd) => crate::commands::token(config, cmd),
        #[cfg(unix)]
        Command::Doctor { json } => doctor(config, json),
        #[cfg(windows)]
        Command::Doctor { json } => crate::windows_cli::doctor(config, json),
        Command::Export {
            format,
            since,
            tree,
            after,
        } => export(config, format, since.as_deref(), tree.as_deref(), after),
        Command::Backup { dest } => backup(config, &dest),
        Command::Prune {
            before,
            archive,
            json,
        } => prune(config, &before, archive, json),
        Command::Seal(cmd) => seal(config, cmd),
        Command::Verify {
            expect_head,
            archive,
            json,
            seal_key,
            export,
        } => verify(
            config,
            expect_head.as_deref(),
            &archive,
            json,
            seal_key.as_deref(),
            export.as_deref(),
        ),
        Command::Completions { shell } => {
            let mut cmd = <Cli as clap::CommandFactory>::command();
            clap_complete::generate(shell, &mut cmd, "treewarden", &mut std::io::stdout());
            Ok(0)
        }
        Command::Man => {
            let cmd = <Cli as clap::CommandFactory>::command();
            clap_mangen::Man::new(cmd)
                .render(&mut std::io::stdout())
                .map_err(CliError::internal)?;
            Ok(0)
        }
    }
}

/// The boundary `run` would use with the configured `--boundary`.
#[cfg(unix)]
fn run_boundary_row(
    config: &Config,
    probe: &treewarden::proc::Probe,
) -> (&'static str, String, String) {
    let choice = config.boundary;
    match treewarden::proc::resolve_boundary(choice, probe.cgroup_root.as_deref()) {
        Ok(kind) => (
            "run_boundary",
            kind.to_string(),
            format!("--boundary {choice}"),
        ),
        Err(e) => (
            "run_boundary",
            "none".into(),
            format!("--boundary {choice}: {e}"),
        ),
    }
}

/// Whether `run` would start the observer with the configured `--observer`,
/// and why (not).
#[cfg(unix)]
fn observer_row(config: &Config, probe: &treewarden::proc::Probe) -> (bool, String, String) {
    let mode = config.observer;
    let cap = &probe.proc_connector;
    match (mode, cap.available) {
        (ObserverMode::Off, _) => (false, "off".into(), "--observer off: scans only".into()),
        (_, true) => (
            true,
            "on".into(),
            format!("--observer {mode}: proc connector available"),
        ),
        (ObserverMode::Auto, false) => (
            false,
            "off".into(),
            format!("--observer auto: scans only; {}", cap.note),
        ),
        (ObserverMode::On, false) => (
            false,
            "refuse".into(),
            format!("--observer on: run will refuse to start work; {}", cap.note),
        ),
    }
}

/// The cgroup root's layout: root / delegated / shared / not delegated.
#[cfg(unix)]
fn layout_row(probe: &treewarden::proc::Probe) -> (&'static str, String, String) {
    match &probe.cgroup_layout {
        Some(l) => ("cgroup_layout", l.layout.to_string(), l.note.clone()),
        None => ("cgroup_layout", "-".into(), "no cgroup root".into()),
    }
}

/// Whether limits (`--pids-max`, `--memory-max`, `--cpu-max`) will work.
#[cfg(unix)]
fn limits_row(probe: &treewarden::proc::Probe) -> (&'static str, String, String) {
    let layout_ok = probe.cgroup_layout.as_ref().is_some_and(|l| l.limits);
    let usable: Vec<&str> = ["pids", "memory", "cpu"]
        .into_iter()
        .filter(|c| probe.cgroup_controllers.iter().any(|o| o == c))
        .collect();
    let value = match (layout_ok, usable.len()) {
        (false, _) | (true, 0) => "no",
        (true, 3) => "yes",
        (true, _) => "partly",
    };
    let offered = if probe.cgroup_controllers.is_empty() {
        "none".to_string()
    } else {
        probe.cgroup_controllers.join(" ")
    };
    let why = match &probe.cgroup_layout {
        Some(l) if !l.limits => format!("; {}", l.layout),
        _ => String::new(),
    };
    (
        "limits",
        value.into(),
        format!("controllers offered to tree cgroups: {offered}{why}"),
    )
}

/// `treewarden doctor [--json]`: the host probe, as a table or one JSON object.
#[cfg(unix)]
fn doctor(config: &Config, json: bool) -> CliResult {
    let probe = treewarden::proc::probe(config.cgroup_root.as_deref());
    let (observer_runs, observer_value, observer_note) = observer_row(config, &probe);
    if json {
        let mut value = serde_json::to_value(&probe).map_err(CliError::internal)?;
        value["observer"] = serde_json::json!({
            "mode": config.observer,
            "would_run": observer_runs,
            "state": observer_value,
            "reason": observer_note,
        });
        let text = serde_json::to_string_pretty(&value).map_err(CliError::internal)?;
        println!("{text}");
        return Ok(0);
    }
    let opt = |v: Option<String>| v.unwrap_or_else(|| "-".into());
    let cap =
        |c: &treewarden::proc::Capability| (if c.available { "yes" } else { "no" }).to_owned();
    let rows: Vec<(&str, String, String)> = vec![
        ("kernel", probe.kernel_release.clone(), String::new()),
        ("boot_id", opt(probe.boot_id.clone()), String::new()),
        (
            "pid_max",
            opt(probe.pid_max.map(|p| p.to_string())),
            String::new(),
        ),
        (
            "cgroup_v2",
            cap(&probe.cgroup_v2),
            probe.cgroup_v2.note.clone(),
        ),
        (
            "cgroup_root",
            opt(probe.cgroup_root.as_ref().map(|p| p.display().to_string())),
            String::new(),
        ),
        (
            "cgroup_writable",
            cap(&probe.cgroup_writable),
            probe.cgroup_writable.note.clone(),
        ),
        (
            "cgroup_kill",
            cap(&probe.cgroup_kill),
            probe.cgroup_kill.note.clone(),
        ),
        (
            "cgroup_freeze",
            cap(&probe.cgroup_freeze),
            probe.cgroup_freeze.note.clone(),
        ),
        layout_row(&probe),
        limits_row(&probe),
        ("pidfd", cap(&probe.pidfd), probe.pidfd.note.clone()),
        (
            "pidfd_group_signal",
            cap(&probe.pidfd_group_signal),
            probe.pidfd_group_signal.note.clone(),
        ),
        (
            "subreaper",
            cap(&probe.subreaper),
            probe.subreaper.note.clone(),
        ),
        (
            "proc_connector",
            cap(&probe.proc_connector),
            probe.proc_connector.note.clone(),
        ),
        (
            "auto_boundary",
            probe.auto_boundary.to_string(),
            probe.auto_reason.clone(),
        ),
        run_boundary_row(config, &probe),
        ("observer", observer_value, observer_note),
    ];
    let name_w = rows.iter().map(|r| r.0.len()).max().unwrap_or(0);
    let value_w = rows.iter().map(|r| r.1.len()).max().unwrap_or(0);
    for (name, value, note) in rows {
        let line = format!("{name:<name_w$}  {value:<value_w$}  {note}");
        println!("{}", line.trim_end());
    }
    Ok(0)
}

/// `--expect-head SEQ:HASH`.
fn parse_head(s: &str) -> Result<(i64, String), String> {
    let bad = || format!("malformed --expect-head {s:?}: expected SEQ:HASH (64 hex digits)");
    let (seq, hash) = s.split_once(':').ok_or_else(bad)?;
    let seq: i64 = seq.trim().parse().map_err(|_| bad())?;
    let hash = hash.trim().to_ascii_lowercase();
    if seq < 1 || hash.len() != 64 || !hash.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(bad());
    }
    Ok((seq, hash))
}

fn export(
    config: &Config,
    format: ExportFormat,
    since: Option<&str>,
    tree: Option<&str>,
    after: Option<i64>,
) -> CliResult {
    if after.is_some_and(|a| a < 0) {
        return Err(CliError::usage(anyhow::anyhow!(
            "malformed --after: a seq is 0 or more"
        )));
    }
    let since = since
        .map(|v| treewarden::ledger::parse_since(v).map_err(|e| format!("--since: {e}")))
        .transpose()
        .map_err(|e| CliError::usage(anyhow::anyhow!(e)))?;
    let tree = tree
        .map(|t| {
            t.parse::<i64>()
                .map(TreeId)
                .map_err(|_| format!("malformed --tree {t:?}: expected a tree id"))
        })
        .transpose()
        .map_err(|e| CliError::usage(anyhow::anyhow!(e)))?;
    let ledger = open_existing_ledger(config)?;
    if let Some(id) = tree
        && ledger.tree(id).map_err(CliError::internal)?.is_none()
    {
        return Err(CliError::usage(anyhow::anyhow!("unknown tree {}", id.0)));
    }
    let filter = EventFilter {
        since,
        tree,
        after_seq: after,
        ..EventFilter::default()
    };
    let stdout = std::io::stdout();
    ledger
        .export(&filter, format, &mut stdout.lock())
        .map_err(CliError::internal)?;
    Ok(0)
}

/// `treewarden backup DEST`: an online copy, verified on its own.
fn backup(config: &Config, dest: &std::path::Path) -> CliResult {
    if dest.exists() {
        return Err(CliError::usage(anyhow::anyhow!(
            "{} exists: a backup is written to a new file",
            dest.display()
        )));
    }
    let ledger = open_existing_ledger(config)?;
    ledger
        .backup_to(dest)
        .map_err(|e| CliError::internal(anyhow::anyhow!("backup to {}: {e}", dest.display())))?;
    let report = Ledger::open(dest, LedgerOptions::from_config(config))
        .and_then(|copy| copy.verify(None))
        .map_err(|e| {
            CliError::with_code(
                EXIT_BROKEN,
                anyhow::anyhow!("the copy at {} does not verify: {e}", dest.display()),
            )
        })?;
    if let Some(found) = &report.first_break {
        return Err(CliError::with_code(
            EXIT_BROKEN,
            anyhow::anyhow!("the copy at {} does not verify: {found}", dest.display()),
        ));
    }
    let head = match &report.head {
        Some((seq, hash)) => format!("head {seq}:{hash}"),
        None => "no head".to_string(),
    };
    println!(
        "backup {}: {} events, {head}, verified",
        dest.display(),
        report.events
    );
    Ok(0)
}

/// `--before T` of `prune`: `now`, a time, or an age; never in the future.
pub fn parse_before(s: &str) -> Result<std::time::SystemTime, String> {
    let now = std::time::SystemTime::now();
    if s == "now" {
        return Ok(now);
    }
    let at = treewarden::ledger::parse_since(s).map_err(|e| format!("--before: {e}"))?;
    if at > now {
        return Err(format!("--before {s:?} is in the future"));
    }
    Ok(at)
}

/// `treewarden prune --before T [--archive FILE]`.
fn prune(config: &Config, before: &str, archive: Option<PathBuf>, json: bool) -> CliResult {
    let before = parse_before(before).map_err(|e| CliError::usage(anyhow::anyhow!(e)))?;
    if let Some(path) = &archive
        && (path.exists() || path.symlink_metadata().is_ok())
    {
        return Err(CliError::usage(anyhow::anyhow!(
            "{} exists: an archive is written to a new file",
            path.display()
        )));
    }
    let ledger = open_existing_ledger(config)?;
    // A tree with an unsettled marker on disk has evidence the ledger has
    // not taken yet: never pruned, whatever its row says.
    let keep = treewarden::custody::markers::all(&config.data_dir)
        .into_iter()
        .map(|(tree, _)| TreeId(tree))
        .collect();
    let report = ledger
        .prune(&treewarden::ledger::PruneRequest {
            before,
            archive,
            keep,
        })
        .map_err(|e| CliError::internal(anyhow::anyhow!("prune: {e}")))?;
    let logs = treewarden::custody::remove_logs(&config.data_dir, &report.pruned_trees);
    if json {
        let mut v = serde_json::to_value(&report).map_err(CliError::internal)?;
        v["logs_removed"] = logs.into();
        println!("{v}");
        return Ok(0);
    }
    match report.checkpoint {
        None => println!("nothing to prune: no tree ended before that time"),
        Some(seq) => println!(
            "pruned {} events of {} trees (through seq {}); {} events kept below it; checkpoint seq {seq}{}",
            report.events,
            report.trees,
            report.pruned_through,
            report.kept_below,
            report
                .archive
                .as_ref()
                .map(|p| format!("; archive {} (fsynced)", p.display()))
                .unwrap_or_default()
        ),
    }
    if logs > 0 {
        println!("removed the captured logs of {logs} pruned trees");
    }
    Ok(0)
}

/// `treewarden seal setup|now|close`.
fn seal(config: &Config, cmd: SealCommand) -> CliResult {
    use treewarden::ledger::seal::MIN_INTERVAL;
    if let SealCommand::Setup { interval } = &cmd
        && *interval < MIN_INTERVAL
    {
        return Err(CliError::usage(anyhow::anyhow!(
            "--interval {}: at least 1s",
            humantime::format_duration(*interval)
        )));
    }
    let ledger = open_existing_ledger(config)?;
    match cmd {
        SealCommand::Setup { interval } => {
            let report = ledger
                .seal_setup(&config.data_dir, interval)
                .map_err(|e| match e {
                    LedgerError::Invariant(m) => {
                        CliError::usage(anyhow::anyhow!("seal setup: {m}"))
                    }
                    e => CliError::internal(anyhow::anyhow!("seal setup: {e}")),
                })?;
            println!("{}", report.key.to_hex());
            eprintln!(
                "treewarden: sealing set up (seq {}, epoch 0 from {}, interval {}); the verification key above is shown once: keep it off this host. {} holds only the current epoch's key.",
                report.seq,
                report.start,
                humantime::format_duration(report.interval),
                report.key_file.display()
            );
            Ok(0)
        }
        SealCommand::Now | SealCommand::Close => {
            let close = matches!(cmd, SealCommand::Close);
            let run = ledger
                .seal_due(&config.data_dir, close)
                .map_err(|e| CliError::internal(anyhow::anyhow!("seal: {e}")))?
                .ok_or_else(|| {
                    CliError::usage(anyhow::anyhow!(
                        "sealing is not set up in this ledger (treewarden seal setup)"
                    ))
                })?;
            let next = run
                .next_due
                .map(treewarden::ledger::timestamp)
                .unwrap_or_default();
            match (run.sealed.first(), run.sealed.last()) {
                (Some(first), Some(last)) if first == last => println!(
                    "sealed epoch {first}{}{}; next seal due at {next}",
                    if run.late > 0 { " (late)" } else { "" },
                    if run.closed { ", as a clean close" } else { "" }
                ),
                (Some(first), Some(last)) => println!(
                    "sealed epochs {first} to {last} ({} late){}; next seal due at {next}",
                    run.late,
                    if run.closed {
                        ", the last as a clean close"
                    } else {
                        ""
                    }
                ),
                _ => println!("no epoch to seal; next seal due at {next}"),
            }
            Ok(0)
        }
    }
}

fn verify(
    config: &Config,
    expect_head: Option<&str>,
    archives: &[PathBuf],
    json: bool,
    seal_key: Option<&str>,
    export: Option<&std::path::Path>,
) -> CliResult {
    let expect_head = expect_head
        .map(parse_head)
        .transpose()
        .map_err(|e| CliError::usage(anyhow::anyhow!(e)))?;
    let seal_key = seal_key
        .map(treewarden::ledger::seal::SealKey::parse)
        .transpose()
        .map_err(|e| CliError::usage(anyhow::anyhow!("--seal-key: {e}")))?;
    let broken =
        |what: String| CliError::with_code(EXIT_BROKEN, anyhow::anyhow!("verify failed: {what}"));
    let path = match export {
        Some(file) => {
            if !file.is_file() {
                return Err(CliError::usage(anyhow::anyhow!(
                    "no export at {}",
                    file.display()
                )));
            }
            file.to_path_buf()
        }
        None => crate::commands::existing_ledger_path(config)?,
    };
    for archive in archives {
        if !archive.is_file() {
            return Err(CliError::usage(anyhow::anyhow!(
                "no archive at {}",
                archive.display()
            )));
        }
    }
    let asked_seals = seal_key.is_some();
    // Set up but not asked to check: said, so a reader does not take the
    // chain's "ok" for the seals'.
    let mut unchecked_seals = false;
    let report = match export {
        Some(file) => treewarden::ledger::verify_export(file, seal_key),
        None => Ledger::open(&path, LedgerOptions::from_config(config)).and_then(|ledger| {
            unchecked_seals = !asked_seals && ledger.seal_setup_of()?.is_some();
            let (mut report, sealed) = ledger.verify_sealed(expect_head, seal_key)?;
            if report.first_break.is_none() && !archives.is_empty() {
                for (_, archived) in ledger.verify_archives(archives)? {
                    if archived.first_break.is_some() {
                        report.first_break = archived.first_break;
                        break;
                    }
                }
            }
            Ok((report, sealed))
        }),
    };
    let (report, sealed) = match report {
        Ok(report) => report,
        // A file SQLite cannot read as a database is a failed verification.
        Err(e @ LedgerError::Corrupt(_)) => return Err(broken(e.to_string())),
        Err(e) => {
            return Err(CliError::internal(anyhow::anyhow!(
                "{}: {e}",
                path.display()
            )));
        }
    };
    print_verify(
        &report,
        sealed,
        archives.len(),
        export.is_some(),
        unchecked_seals,
        json,
    )
}

/// `verify`'s answer: the JSON object, or one line (`ok: …`), or the first
/// break as the error (exit 1).
fn print_verify(
    report: &treewarden::ledger::VerifyReport,
    sealed: Option<treewarden::ledger::SealReport>,
    archives: usize,
    export: bool,
    unchecked_seals: bool,
    json: bool,
) -> CliResult {
    let broken =
        |what: String| CliError::with_code(EXIT_BROKEN, anyhow::anyhow!("verify failed: {what}"));
    if json {
        let text = serde_json::to_string(&serde_json::json!({
            "ok": report.first_break.is_none(),
            "events": report.events,
            "head": report.head.as_ref().map(|(seq, hash)| serde_json::json!({"seq": seq, "hash": hash})),
            "checkpoint": report.checkpoint,
            "archives": archives,
            "seal": sealed,
            "first_break": report.first_break.as_ref().map(|b| b.to_string()),
        }))
        .map_err(CliError::internal)?;
        println!("{text}");
        return Ok(if report.first_break.is_some() {
            EXIT_BROKEN
        } else {
            0
        });
    }
    match &report.first_break {
        Some(found) => Err(broken(found.to_string())),
        None => {
            let head = match &report.head {
                Some((seq, hash)) => format!("head {seq}:{hash}"),
                None => "no head".to_string(),
            };
            let from = report
                .checkpoint
                .map(|seq| format!(", from checkpoint seq {seq}"))
                .unwrap_or_default();
            let archived = if archives == 0 {
                String::new()
            } else {
                format!(", {archives} archive(s) chain in")
            };
            let integrity = if export { "export" } else { "integrity ok" };
            let sealed = sealed
                .map(|s| {
                    format!(
                        ", sealed: epochs 0 to {} ({} seals, {} late{}), the newest made {}{}, {} events after it not sealed yet",
                        s.last_epoch,
                        s.seals,
                        s.late,
                        s.first_late
                            .map(|e| format!(" from epoch {e}"))
                            .unwrap_or_default(),
                        s.last_made_at,
                        if s.closed { " as a clean close" } else { "" },
                        s.unsealed
                    )
                })
                .unwrap_or_else(|| {
                    if unchecked_seals {
                        ", sealing set up (seals not checked: no --seal-key)".to_string()
                    } else {
                        String::new()
                    }
                });
            println!(
                "ok: {} events, {head}{from}, {integrity}{archived}{sealed}",
                report.events
            );
            Ok(0)
        }
    }
}

/// Help and version go out as clap prints them; a bad argument is clap's
/// whole message (what was wrong, its "did you mean" hint, the usage line)
/// on stderr, and exit 2 — or 125 for `run`, whose 1..=124 and 126..
/// belong to the command it runs.
fn usage_error(e: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    match e.kind() {
        ErrorKind::DisplayHelp
        | ErrorKind::DisplayVersion
        | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => e.exit(),
        _ => {
            let _ = e.print();
            let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
            ExitCode::from(if subcommand_of(&args) == Some("run") {
                EXIT_INTERNAL
            } else {
                EXIT_USAGE
            })
        }
    }
}

/// The subcommand named on a command line clap refused: the first word that
/// is neither an option nor the value of a global option that takes one.
fn subcommand_of(args: &[std::ffi::OsString]) -> Option<&str> {
    const WITH_VALUE: [&str; 6] = [
        "--data-dir",
        "--boundary",
        "--cgroup-root",
        "--busy-timeout",
        "--observer",
        "--observer-rcvbuf",
    ];
    let mut skip_next = false;
    for arg in args {
        let arg = arg.to_str()?;
        if skip_next {
            skip_next = false;
            continue;
        }
        if arg == "--" {
            return None;
        }
        if arg.starts_with('-') {
            skip_next = WITH_VALUE.contains(&arg);
            continue;
        }
        return Some(arg);
    }
    None
}

/// Logs go to stderr so that command output on stdout stays clean.
fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("TREEWARDEN_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(treewarden::telemetry::use_color())
        .with_writer(std::io::stderr)
        .try_init();
}
