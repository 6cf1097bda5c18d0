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

use super::Ledger;
use super::chain;
use super::error::LedgerError;
use super::types::{EventFilter, EventKind, EventRow, ExportFormat};

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
        ExportFormat::Ocsf => "ocsf.ndjson",
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
        ExportFormat::Ocsf => Err(LedgerError::Invariant(
            "export: OCSF lines are made by ledger/ocsf.rs, not page by page here".into(),
        )),
    }
}

pub(crate) fn write_all(bytes: &[u8], out: &mut dyn Write) -> Result<(), LedgerError> {
    out.write_all(bytes)
        .map_err(|e| LedgerError::Other(format!("export: cannot write output: {e}")))
}

/// What a filtered export selected, as its trailer names it and `verify
/// --export` applies it again to every event the file holds: times are
/// the ledger's own fixed-width RFC 3339 text (so text order is time
/// order), `kind` a prefix.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Selection {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) since: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) until: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) tree: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) kind: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) after: Option<i64>,
}

impl Selection {
    /// The selection of an export's filter; `None` when the filter asks
    /// for something a proven export does not express (a limit, a search).
    pub(crate) fn of(filter: &EventFilter) -> Option<Selection> {
        let search = &filter.search;
        if filter.before_seq.is_some()
            || filter.limit.is_some()
            || search.kinds.is_some()
            || search.text.is_some()
            || search.tree_label.is_some()
        {
            return None;
        }
        Some(Selection {
            since: filter.since.map(super::timestamp),
            until: search.until.map(super::timestamp),
            tree: filter.tree.map(|t| t.0),
            kind: filter.kind_prefix.clone(),
            after: filter.after_seq,
        })
    }

    /// The whole ledger.
    pub(crate) fn is_whole(&self) -> bool {
        *self == Selection::default()
    }

    /// Whether it narrows the ledger by time, tree or kind: such an export
    /// proves itself. `after` alone is an incremental export's cursor (a
    /// shipper's): its events stay plain lines.
    pub(crate) fn narrows(&self) -> bool {
        self.since.is_some() || self.until.is_some() || self.tree.is_some() || self.kind.is_some()
    }

    /// Whether the event is one the selection takes (as `events_sql` does).
    pub(crate) fn takes(&self, seq: i64, at: &str, tree: Option<i64>, kind: &str) -> bool {
        self.since.as_deref().is_none_or(|s| at >= s)
            && self.until.as_deref().is_none_or(|u| at < u)
            && self.tree.is_none_or(|t| tree == Some(t))
            && self.kind.as_deref().is_none_or(|k| kind.starts_with(k))
            && self.after.is_none_or(|a| seq > a)
    }
}

/// One inclusion proof line of a filtered export, right after the event it
/// proves: the last event of each run of consecutive seqs (the run's
/// earlier events are proven by their links to it).
#[derive(serde::Serialize, serde::Deserialize)]
pub(crate) struct ProofLine {
    pub(crate) proof: Inclusion,
}

#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Inclusion {
    pub(crate) seq: i64,
    /// The event's leaf index (its place among the stored events).
    pub(crate) index: u64,
    /// Hex hashes, bottom up (RFC 9162 `PATH`).
    pub(crate) path: Vec<String>,
}

impl Ledger {
    /// A filtered NDJSON export that proves itself (`verify --export`):
    /// the events `selection` takes up to the head, the ledger's seals
    /// among them (a sealed ledger's: the trailer's key is proven by them),
    /// an inclusion proof after the last event of every run of consecutive
    /// seqs, and a trailer naming the Merkle root of every event up to the
    /// head, the head and its own path, the selection and how many events
    /// it took; sealed as a whole export's trailer is. Returns the count.
    // Over 100 lines on purpose: one export in its order (the head fixed, every leaf read for the
    // Merkle tree, the selected events merged with the seals in seq order with a proof after each
    // run, then the trailer); the run in progress is state its closures share.
    pub(crate) fn export_proven(
        &self,
        filter: &EventFilter,
        selection: Selection,
        sink: &mut dyn FnMut(&[u8]) -> Result<(), LedgerError>,
    ) -> Result<usize, LedgerError> {
        let fail = |e: serde_json::Error| LedgerError::Other(format!("export: {e}"));
        let sealed = self.export_seal(&self.dir)?;
        let head = match &sealed {
            Some(s) => s.head.clone(),
            None => self.head()?,
        };
        let at = sealed
            .as_ref()
            .map_or_else(std::time::SystemTime::now, |s| s.at);
        let head_seq = head.as_ref().map_or(0, |h| h.0);
        let (seqs, leaves) = self.read(move |tx| {
            let mut stmt =
                tx.prepare("SELECT seq, hash FROM events WHERE seq <= ?1 ORDER BY seq")?;
            let mut rows = stmt.query([head_seq])?;
            let (mut seqs, mut leaves) = (Vec::new(), Vec::new());
            while let Some(row) = rows.next()? {
                let hash: String = row.get(1)?;
                seqs.push(row.get::<_, i64>(0)?);
                leaves.push(chain::merkle_leaf(&hash).unwrap_or([0; 32]));
            }
            Ok((seqs, leaves))
        })?;
        let tree = chain::Merkle::new(leaves);
        let seals: Vec<EventRow> = if sealed.is_some() {
            self.events(&EventFilter {
                kind_prefix: Some(EventKind::LedgerSeal.as_str().to_string()),
                before_seq: Some(head_seq + 1),
                ..EventFilter::default()
            })?
            .into_iter()
            .filter(|e| e.kind == EventKind::LedgerSeal)
            .collect()
        } else {
            Vec::new()
        };
        let proof = |seq: i64| -> Result<Vec<u8>, LedgerError> {
            let index = seqs.binary_search(&seq).map_err(|_| {
                LedgerError::Invariant(format!("export: seq {seq} is not below the head"))
            })? as u64;
            let line = ProofLine {
                proof: Inclusion {
                    seq,
                    index,
                    path: tree.path(index).iter().map(hex::encode).collect(),
                },
            };
            let mut out = serde_json::to_vec(&line).map_err(fail)?;
            out.push(b'\n');
            Ok(out)
        };
        let mut seals = seals.into_iter().peekable();
        let mut pending: Option<i64> = None;
        let mut out = Vec::new();
        let mut emit = |row: &EventRow, out: &mut Vec<u8>| -> Result<(), LedgerError> {
            if let Some(p) = pending
                && p + 1 != row.seq
            {
                out.extend(proof(p)?);
            }
            serde_json::to_writer(&mut *out, row).map_err(fail)?;
            out.push(b'\n');
            pending = Some(row.seq);
            Ok(())
        };
        let mut page = filter.clone();
        page.newest_first = false;
        page.limit = Some(PAGE);
        let mut n = 0;
        loop {
            let rows = self.events(&page)?;
            let full = rows.len() == PAGE;
            let rows: Vec<EventRow> = rows.into_iter().take_while(|r| r.seq <= head_seq).collect();
            let reached_head = rows.last().is_none_or(|r| r.seq >= head_seq);
            for row in &rows {
                while let Some(seal) = seals.next_if(|s| s.seq < row.seq) {
                    emit(&seal, &mut out)?;
                }
                seals.next_if(|s| s.seq == row.seq);
                emit(row, &mut out)?;
                n += 1;
            }
            if !out.is_empty() {
                sink(&out)?;
                out.clear();
            }
            match rows.last() {
                Some(last) if full && !reached_head => page.after_seq = Some(last.seq),
                _ => break,
            }
        }
        for seal in seals {
            emit(&seal, &mut out)?;
        }
        if let Some(p) = pending {
            out.extend(proof(p)?);
        }
        let stamp = super::verify::ExportStamp {
            v: Some(3),
            at: super::timestamp(at),
            events: n as u64,
            host: Some(crate::proc::host_name()),
            machine_id: super::machine_id(),
            boot_id: crate::proc::boot_id().ok().map(str::to_string),
            head: Some(head.map(|(seq, hash)| super::verify::StampHead { seq, hash })),
            filter: Some(serde_json::to_value(&selection).map_err(fail)?),
            tree_size: Some(tree.size()),
            root: Some(hex::encode(tree.root())),
            head_path: Some(
                tree.path(tree.size().saturating_sub(1))
                    .iter()
                    .map(hex::encode)
                    .collect(),
            ),
        };
        let mut raw = serde_json::to_value(&stamp).map_err(fail)?;
        if let Some(sealed) = &sealed {
            sealed.key.seal(&mut raw);
        }
        serde_json::to_writer(&mut out, &serde_json::json!({ "exported": raw })).map_err(fail)?;
        out.push(b'\n');
        sink(&out)?;
        Ok(n)
    }
}
