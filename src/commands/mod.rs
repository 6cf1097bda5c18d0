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

mod backup;
mod custody;
mod doctor;
mod export;
mod fleet;
mod kill;
mod logs;
mod ls;
mod prune;
mod report;
mod resolve;
mod run;
mod seal;
mod serve;
mod ship;
mod show;
mod sweep;
mod token;
mod tty;
mod verify;

pub use backup::backup;
pub use custody::{CustodyArgs, custody};
use custody::{KeepArgs, hand_over};
pub use doctor::doctor;
pub use export::export;
pub use fleet::FleetCommand;
pub use kill::{KillArgs, kill};
pub use logs::{LogsArgs, logs};
use ls::root_exited_members_alive;
pub use ls::{LsArgs, ls};
pub use prune::prune;
pub use report::{ReportArgs, report};
pub use resolve::{ResolveArgs, resolve};
use run::RunStatus;
pub use run::{RunArgs, run};
pub use seal::{SealCommand, seal};
pub use serve::ServeArgs;
pub use ship::ShipArgs;
pub use show::{ShowArgs, show};
pub use sweep::{SweepArgs, sweep};
pub use token::TokenCommand;
use tty::TtyRelay;
pub use verify::verify;
// `serve` and `token` drive the service, which src/lib.rs builds on Linux
// and Windows only: on macOS they are `no_service.rs`'s refusals.
#[cfg_attr(target_os = "macos", path = "no_service.rs")]
mod service;
pub use service::{fleet, serve, ship, token};

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

/// The CLI's user as the ledger records it.
fn cli_requester() -> treewarden::ledger::Requester {
    treewarden::ledger::Requester {
        via: "cli".into(),
        uid: Some(treewarden::proc::current_uid()),
        pid: Some(std::process::id() as i32),
        login_uid: treewarden::proc::login_uid(),
        sudo_user: std::env::var("SUDO_USER").ok().filter(|u| !u.is_empty()),
        ..Default::default()
    }
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

/// Opens the ledger for a reader, after writing what unsettled markers kept
/// (a teardown that failed closed under a held lock), so the reader sees the
/// whole trail ([`Ambiguity::settle_record`]).
fn open_for_reading(config: &Config) -> Result<Ledger, CliError> {
    let engine = signal_engine(config)?;
    engine.ambiguity().settle_record();
    Ok(engine.ledger().clone())
}

fn print_json(value: &impl serde::Serialize) -> Result<(), CliError> {
    let text = serde_json::to_string_pretty(value).map_err(CliError::internal)?;
    println!("{text}");
    Ok(())
}

/// The most teardowns a command settles on its way (`run`, `ls`, `kill`).
const SETTLE_LIMIT: usize = 8;

/// `kill` and `sweep` finish what they started: interrupts are noted and
/// ignored ([`treewarden::proc::shield_from_interrupts`]).
use treewarden::proc::shield_from_interrupts;
