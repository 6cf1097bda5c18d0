//! Export of the audit trail for incident review: NDJSON (one event per line,
//! exactly `{"seq","at","tree","kind","data","prev_hash","hash"}`, `data` an
//! object) or CSV (header `seq,at,tree,kind,data,prev_hash,hash`, `data` as
//! its canonical JSON text, `tree` empty when null). The export streams: it
//! reads the events in pages of [`PAGE`] (keyset on `seq`, up to the head
//! read when it starts, so it is exact however the ledger grows meanwhile)
//! and hands each page's bytes on before reading the next, so its memory
//! does not grow with the ledger. Output is whole lines (and whole CSV
//! records) up to any failure, which the caller reports.

use std::io::Write;

use super::chain;
use super::error::LedgerError;
use super::types::{EventRow, ExportFormat};

/// The default name of an export's file (the CLI's `--output DIR`, the
/// API's and the dashboard's download): what it is, this host's name and
/// the time in UTC to the second, so that files from many hosts can sit
/// side by side: `treewarden-audit-web1-20260101T120000Z.ndjson`.
pub fn file_name(format: ExportFormat, at: std::time::SystemTime) -> String {
    let host: String = crate::proc::host_name()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_') {
                c
            } else {
                '_'
            }
        })
        .collect();
    let host = if host.is_empty() { "host".into() } else { host };
    // `2026-01-01T12:00:00.123Z` -> `20260101T120000Z`.
    let stamp = super::timestamp(at);
    let stamp: String = stamp
        .split('.')
        .next()
        .unwrap_or(&stamp)
        .chars()
        .filter(|c| c.is_ascii_digit() || *c == 'T')
        .collect();
    let ext = match format {
        ExportFormat::Ndjson => "ndjson",
        ExportFormat::Csv => "csv",
    };
    format!("treewarden-audit-{host}-{stamp}Z.{ext}")
}

/// Events per page of a streaming export.
pub(crate) const PAGE: usize = 1000;

/// Formats one page; `header` adds the CSV header (the first page's).
pub(crate) fn format(
    rows: &[EventRow],
    format: ExportFormat,
    header: bool,
) -> Result<Vec<u8>, LedgerError> {
    match format {
        ExportFormat::Ndjson => {
            let mut out = Vec::new();
            for row in rows {
                serde_json::to_writer(&mut out, row)
                    .map_err(|e| LedgerError::Other(format!("export: {e}")))?;
                out.push(b'\n');
            }
            Ok(out)
        }
        ExportFormat::Csv => {
            let mut writer = csv::Writer::from_writer(Vec::new());
            let fail = |e: csv::Error| LedgerError::Other(format!("export: {e}"));
            if header {
                writer
                    .write_record(["seq", "at", "tree", "kind", "data", "prev_hash", "hash"])
                    .map_err(fail)?;
            }
            for row in rows {
                writer
                    .write_record([
                        row.seq.to_string(),
                        row.at.clone(),
                        row.tree.map(|t| t.to_string()).unwrap_or_default(),
                        row.kind.to_string(),
                        chain::canonical_string(&row.data),
                        row.prev_hash.clone(),
                        row.hash.clone(),
                    ])
                    .map_err(fail)?;
            }
            writer
                .into_inner()
                .map_err(|e| LedgerError::Other(format!("export: {e}")))
        }
    }
}

pub(crate) fn write_all(bytes: &[u8], out: &mut dyn Write) -> Result<(), LedgerError> {
    out.write_all(bytes)
        .map_err(|e| LedgerError::Other(format!("export: cannot write output: {e}")))
}
