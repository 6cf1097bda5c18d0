//! `treewarden export`: the ledger as NDJSON or CSV, streamed; narrowed by
//! time, tree or kind, an NDJSON export carries the proofs that it is
//! whole (`ledger/export.rs`).

use super::*;

use treewarden::config::Config;
use treewarden::ledger::{EventFilter, ExportFormat, TreeId};

use crate::exit::{CliError, CliResult};

pub fn export(
    config: &Config,
    format: ExportFormat,
    (since, until): (Option<&str>, Option<&str>),
    (tree, kind): (Option<&str>, Option<&str>),
    after: Option<i64>,
    output: Option<&std::path::Path>,
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
    let until = until
        .map(|v| treewarden::ledger::parse_since(v).map_err(|e| format!("--until: {e}")))
        .transpose()
        .map_err(|e| CliError::usage(anyhow::anyhow!(e)))?;
    if kind.is_some_and(str::is_empty) {
        return Err(CliError::usage(anyhow::anyhow!(
            "malformed --kind: expected a kind or its prefix (`kill.`)"
        )));
    }
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
        kind_prefix: kind.map(str::to_string),
        search: treewarden::ledger::EventSearch {
            until,
            ..Default::default()
        },
        ..EventFilter::default()
    };
    let Some(output) = output else {
        let stdout = std::io::stdout();
        write(&ledger, &filter, format, &mut stdout.lock())?;
        return Ok(0);
    };
    let path = if output.is_dir() {
        output.join(treewarden::ledger::export_file_name(
            format,
            std::time::SystemTime::now(),
        ))
    } else {
        output.to_path_buf()
    };
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&path)
        .map_err(|e| CliError::usage(anyhow::anyhow!("--output {}: {e}", path.display())))?;
    let mut out = std::io::BufWriter::new(file);
    let written = write(&ledger, &filter, format, &mut out).and_then(|n| {
        out.into_inner()
            .map_err(|e| e.into_error())
            .and_then(|f| f.sync_all())
            .map_err(|e| CliError::internal(anyhow::anyhow!("export: {e}")))
            .map(|()| n)
    });
    match written {
        Ok(n) => {
            println!("{}", path.display());
            let what = if format == ExportFormat::Ocsf {
                "OCSF records"
            } else {
                "events"
            };
            eprintln!("treewarden: {n} {what} exported to {}", path.display());
            Ok(0)
        }
        Err(e) => {
            // A cut file must not pass for an export.
            let _ = std::fs::remove_file(&path);
            Err(e)
        }
    }
}

/// Writes the export; an OCSF one says on stderr how many events it left
/// out as not process activity (the NDJSON export has them). Returns how
/// many lines of events (or records) it wrote.
fn write(
    ledger: &treewarden::ledger::Ledger,
    filter: &EventFilter,
    format: ExportFormat,
    out: &mut dyn std::io::Write,
) -> Result<usize, CliError> {
    if format != ExportFormat::Ocsf {
        return ledger
            .export(filter, format, out)
            .map_err(CliError::internal);
    }
    let counts = ledger
        .export_ocsf(filter, out)
        .map_err(CliError::internal)?;
    if counts.skipped > 0 {
        eprintln!(
            "treewarden: {} events of other kinds left out of the OCSF export (not process activity; the NDJSON export has them)",
            counts.skipped
        );
    }
    Ok(counts.records)
}
