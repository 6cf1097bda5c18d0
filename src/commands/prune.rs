//! `treewarden prune`: drop ended trees before a date, into an archive.

use super::*;
use std::path::PathBuf;

use treewarden::config::Config;

use crate::exit::{CliError, CliResult};

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
pub fn prune(config: &Config, before: &str, archive: Option<PathBuf>, json: bool) -> CliResult {
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
        .map(|(tree, _)| tree)
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
