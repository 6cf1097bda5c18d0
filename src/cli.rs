//! Command-line interface: clap definitions, config assembly and output
//! formatting (human tables and `--json`). The only place besides `main.rs`
//! that uses `anyhow`; every failure leaves here as one line on stderr and a
//! distinct exit code.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use treewarden::config::{BoundaryChoice, Config};

/// Exit code for bad input: unknown tree, malformed duration, empty command.
#[allow(dead_code)] // used by the commands of later issues
pub const EXIT_USAGE: u8 = 2;
/// Exit code when treewarden itself failed (cannot record, ambiguous, refused).
pub const EXIT_INTERNAL: u8 = 125;

/// An error that knows which exit code it maps to.
#[derive(Debug)]
pub struct CliError {
    pub code: u8,
    pub error: anyhow::Error,
}

#[allow(dead_code)] // some constructors serve the commands of later issues
impl CliError {
    pub fn usage(error: impl Into<anyhow::Error>) -> Self {
        Self {
            code: EXIT_USAGE,
            error: error.into(),
        }
    }
    pub fn internal(error: impl Into<anyhow::Error>) -> Self {
        Self {
            code: EXIT_INTERNAL,
            error: error.into(),
        }
    }
    pub fn with_code(code: u8, error: impl Into<anyhow::Error>) -> Self {
        Self {
            code,
            error: error.into(),
        }
    }
}

/// Result of a subcommand: the exit code on success.
pub type CliResult = Result<u8, CliError>;

#[derive(Parser, Debug)]
#[command(name = "treewarden", version, about = "Takes custody of process trees")]
pub struct Cli {
    /// Directory holding the ledger (default: /var/lib/treewarden for root,
    /// else $XDG_STATE_HOME/treewarden).
    #[arg(long, global = true, env = "TREEWARDEN_DATA_DIR", value_name = "DIR")]
    data_dir: Option<PathBuf>,

    /// Ownership boundary for new trees: auto, cgroup or session.
    #[arg(
        long,
        global = true,
        env = "TREEWARDEN_BOUNDARY",
        default_value = "auto"
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

    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    // Each issue adds its commands here; only commands that work are listed.
    /// Report what this host supports (cgroup v2, pidfd, subreaper, proc
    /// connector) and which boundary `auto` picks.
    Doctor {
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
    },
}

/// Parses a humantime duration (`500ms`, `5s`, `10m`) with a one-line error.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("malformed duration {s:?}: {e}"))
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
        }
    }
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing();
    let config = cli.config();
    let result: CliResult = run_command(cli.command, &config);
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("treewarden: {:#}", e.error);
            ExitCode::from(e.code)
        }
    }
}

fn run_command(command: Command, config: &Config) -> CliResult {
    match command {
        Command::Doctor { json } => doctor(config, json),
    }
}

/// The boundary `run` would use with the configured `--boundary`.
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

/// `treewarden doctor [--json]`: the host probe, as a table or one JSON object.
fn doctor(config: &Config, json: bool) -> CliResult {
    let probe = treewarden::proc::probe(config.cgroup_root.as_deref());
    if json {
        let text = serde_json::to_string_pretty(&probe).map_err(CliError::internal)?;
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
        ("pidfd", cap(&probe.pidfd), probe.pidfd.note.clone()),
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
    ];
    let name_w = rows.iter().map(|r| r.0.len()).max().unwrap_or(0);
    let value_w = rows.iter().map(|r| r.1.len()).max().unwrap_or(0);
    for (name, value, note) in rows {
        let line = format!("{name:<name_w$}  {value:<value_w$}  {note}");
        println!("{}", line.trim_end());
    }
    Ok(0)
}

/// Logs go to stderr so that command output on stdout stays clean.
fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("TREEWARDEN_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}
