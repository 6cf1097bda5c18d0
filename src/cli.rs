//! Command-line interface: clap definitions, config assembly and the
//! dispatch to `commands/` (one file a command). With `commands/`, the only place
//! that uses `anyhow`; every failure leaves here on stderr with a distinct
//! exit code: one line for our own errors, clap's whole message (with its
//! suggestions) for bad arguments — exit 2, or 125 for `run`, whose other
//! statuses belong to the command it runs (as with timeout(1) and env(1)).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use treewarden::config::{BoundaryChoice, Config, ObserverMode};
use treewarden::ledger::ExportFormat;

use crate::commands::{SealCommand, backup, doctor, export, prune, seal, verify};
use crate::exit::{CliError, CliResult, EXIT_INTERNAL, EXIT_USAGE};

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
    /// One tree's incident report (Markdown or HTML): the verdict, the
    /// timeline, the process tree, escapes, survivors, and the proof
    /// references `verify` checks.
    Report(crate::commands::ReportArgs),
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
    /// Ship the ledger's events to NATS JetStream once, up to the head, from
    /// the same durable cursor as `serve --ship` (for hosts that only `run`:
    /// a timer runs it).
    ///
    /// Exit 0 when caught up; 2 on a bad argument or no ledger; 3 when no
    /// server answered or acknowledged in time; 4 when the stream refused an
    /// event (the ledger was rewound or forked, or another ledger ships under
    /// this host id); 125 when the ledger cannot be read.
    Ship(crate::commands::ShipArgs),
    /// The fleet's view of what hosts shipped to JetStream.
    #[command(subcommand)]
    Fleet(crate::commands::FleetCommand),
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
        /// ndjson (one event per line, the evidence `verify --export`
        /// checks), csv, or ocsf (OCSF 1.5.0 Process Activity for a SIEM: a
        /// view naming the seq and hash of each event it came from).
        #[arg(long, default_value = "ndjson", value_enum)]
        format: ExportFormat,
        /// Only events at or after T: RFC 3339 (`2024-05-01T12:00:00Z`) or an
        /// age (`2h`, `30m`).
        #[arg(long, value_name = "T")]
        since: Option<String>,
        /// Only events before T (same forms as --since).
        #[arg(long, value_name = "T")]
        until: Option<String>,
        /// Only events of this tree.
        #[arg(long, value_name = "ID")]
        tree: Option<String>,
        /// Only events whose kind starts with this (`kill.`, `signal.sent`).
        /// With --since, --until or --tree, the export proves itself:
        /// `verify --export` checks each event is the ledger's and none in
        /// the filter was left out.
        #[arg(long, value_name = "PREFIX")]
        kind: Option<String>,
        /// Only events after this seq (exclusive): an incremental export
        /// resumes from the last seq it wrote.
        #[arg(long, value_name = "SEQ")]
        after: Option<i64>,
        /// Write to this new file instead of stdout; a directory gets the
        /// default name, which names the host and the time
        /// (`treewarden-audit-HOST-20260101T120000Z.ndjson`).
        #[arg(long, short = 'o', value_name = "PATH")]
        output: Option<PathBuf>,
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
        /// The root public key `seal setup --pub` wrote (a file): check a
        /// public-key ledger's seals and its export's trailer with no
        /// secret; on a ledger, also that no sealed epoch's private key is
        /// left in any file of its data dir.
        #[arg(long, value_name = "FILE", conflicts_with = "seal_key")]
        seal_pub: Option<PathBuf>,
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
            | Command::Report(_)
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
        Command::Report(args) => crate::commands::report(config, args),
        Command::Logs(args) => crate::commands::logs(config, args),
        Command::Sweep(args) => crate::commands::sweep(config, args),
        Command::Resolve(args) => crate::commands::resolve(config, args),
        Command::Serve(args) => crate::commands::serve(config, args),
        Command::Token(cmd) => crate::commands::token(config, cmd),
        Command::Ship(args) => crate::commands::ship(config, args),
        Command::Fleet(cmd) => crate::commands::fleet(config, cmd),
        Command::Doctor { json } => doctor(config, json),
        Command::Export {
            format,
            since,
            until,
            tree,
            kind,
            after,
            output,
        } => export(
            config,
            format,
            (since.as_deref(), until.as_deref()),
            (tree.as_deref(), kind.as_deref()),
            after,
            output.as_deref(),
        ),
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
            seal_pub,
            export,
        } => verify(
            config,
            expect_head.as_deref(),
            &archive,
            json,
            (seal_key.as_deref(), seal_pub.as_deref()),
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
