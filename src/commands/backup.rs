//! `treewarden backup DEST`: an online copy of the ledger, verified.

use super::*;

use treewarden::config::Config;
use treewarden::ledger::{Ledger, LedgerOptions};

use crate::exit::{CliError, CliResult, EXIT_BROKEN};

/// `treewarden backup DEST`: an online copy, verified on its own.
pub fn backup(config: &Config, dest: &std::path::Path) -> CliResult {
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
    // The copy is verified where it was written, whatever that directory's
    // mode: the data dir's privacy rule is the live ledger's, and a copy
    // into /tmp is what an operator types first (the file itself is 0600).
    let report = Ledger::open_copy(dest, LedgerOptions::from_config(config).busy_timeout)
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
