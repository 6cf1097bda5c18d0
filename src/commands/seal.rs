//! `treewarden seal`: set up, rotate and check the sealed epochs.

use super::*;
use std::time::Duration;

use treewarden::config::Config;
use treewarden::ledger::LedgerError;

use crate::exit::{CliError, CliResult};

#[derive(clap::Subcommand, Debug)]
pub enum SealCommand {
    /// Make a seed, print the verification key once on stdout (keep it off
    /// this host), record the interval in the ledger and keep only epoch
    /// 0's key, in <data-dir>/seal.key (0600). Refused when set up before.
    ///
    /// Makes the ledger when there is none yet, as `run` and `serve` do.
    /// Exit 0 with the key on stdout; 2 when sealing is set up already or on
    /// a bad interval; 125 when it cannot be recorded.
    ///
    /// With --pub FILE: public-key seals (Ed25519, a key pair per epoch,
    /// each epoch's key certifying the next one's and then erased); the
    /// root public key goes to FILE (a new file) and stdout, and `verify
    /// --seal-pub FILE` checks the seals with no secret.
    Setup {
        /// How long an epoch is (every epoch is sealed; at least 1s).
        #[arg(long, default_value = "15m", value_parser = parse_duration)]
        interval: Duration,
        /// Seal with public keys, writing the root public key here (a new
        /// file: take it off this host, to the auditor).
        #[arg(long = "pub", value_name = "FILE")]
        public: Option<std::path::PathBuf>,
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

/// `treewarden seal setup|now|close`.
pub fn seal(config: &Config, cmd: SealCommand) -> CliResult {
    use treewarden::ledger::seal::MIN_INTERVAL;
    if let SealCommand::Setup { interval, .. } = &cmd
        && *interval < MIN_INTERVAL
    {
        return Err(CliError::usage(anyhow::anyhow!(
            "--interval {}: at least 1s",
            humantime::format_duration(*interval)
        )));
    }
    // `seal setup` makes the ledger, as `run` and `serve` do, so that a
    // runbook can set sealing up before the first start; `now` and `close`
    // need one that exists (a missing one is a mistyped --data-dir).
    let ledger = match cmd {
        SealCommand::Setup { .. } => open_ledger(config)?,
        SealCommand::Now | SealCommand::Close => open_existing_ledger(config)?,
    };
    match cmd {
        SealCommand::Setup { interval, public } => {
            if let Some(file) = &public
                && file.symlink_metadata().is_ok()
            {
                return Err(CliError::usage(anyhow::anyhow!(
                    "--pub {}: exists (the root public key is written to a new file)",
                    file.display()
                )));
            }
            let report = ledger
                .seal_setup(&config.data_dir, interval, public.is_some())
                .map_err(|e| match e {
                    LedgerError::Invariant(m) => {
                        CliError::usage(anyhow::anyhow!("seal setup: {m}"))
                    }
                    e => CliError::internal(anyhow::anyhow!("seal setup: {e}")),
                })?;
            if let (Some(file), Some(root)) = (&public, &report.public) {
                write_public(file, root)?;
                println!("{root}");
                eprintln!(
                    "treewarden: public-key sealing set up (seq {}, epoch 0 from {}, interval {}); the root public key above is in {}: take it off this host (`verify --seal-pub FILE`). {} holds only the current epoch's private key and the next one's.",
                    report.seq,
                    report.start,
                    humantime::format_duration(report.interval),
                    file.display(),
                    report.key_file.display()
                );
                return Ok(0);
            }
            let Some(key) = report.key else {
                return Err(CliError::internal(anyhow::anyhow!(
                    "seal setup: no verification key was made"
                )));
            };
            println!("{}", key.to_hex());
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

/// Writes the root public key to `file`, a new file, fsynced.
fn write_public(file: &std::path::Path, root: &str) -> Result<(), CliError> {
    use std::io::Write;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(file)
        .and_then(|mut f| {
            f.write_all(format!("{root}\n").as_bytes())?;
            f.sync_all()
        })
        .map_err(|e| {
            CliError::internal(anyhow::anyhow!(
                "--pub {}: {e} (sealing is set up: the root public key is {root})",
                file.display()
            ))
        })
}
