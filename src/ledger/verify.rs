//! `verify`: SQLite's own integrity check, then the whole hash chain
//! recomputed, then the authority rule (every SIGKILL preceded by its
//! authorization), then every row readers are shown against the events that
//! made it (`projection.rs`), then the expected head. Stops at the first
//! break.

use std::collections::HashMap;

use rusqlite::Connection;

use sha2::{Digest, Sha256};

use super::chain;
use super::error::{Fail, LedgerError};
use super::event::{Event, RowKind};
use super::prune;
use super::seal::SealCheck;
use super::types::{EventKind, EventRow, SealReport, VerifyBreak, VerifyReport};

/// `report` stopped at `found`, with no seal report.
fn halted<E>(
    mut report: VerifyReport,
    found: VerifyBreak,
) -> Result<(VerifyReport, Option<SealReport>), E> {
    report.first_break = Some(found);
    Ok((report, None))
}

fn broke(seq: Option<i64>, what: impl Into<String>) -> Option<VerifyBreak> {
    Some(VerifyBreak {
        seq,
        what: what.into(),
    })
}

/// `seals`: the check `verify --seal-key` adds, and the time the ledger
/// was read (freshness is judged at it).
// Over 100 lines on purpose: the checks of a live ledger in their order (integrity, foreign keys,
// the chain, signal rows, the projection, the expected head, the backup stamp, the seals), each
// ending the report at its first break.
pub(crate) fn verify(
    conn: &Connection,
    expect_head: Option<(i64, String)>,
    seals: Option<(SealCheck, std::time::SystemTime)>,
) -> Result<(VerifyReport, Option<SealReport>), Fail> {
    let (seals, mut read_at) = match seals {
        Some((check, at)) => (Some(check), Some(at)),
        None => (None, None),
    };
    let mut report = VerifyReport::default();

    let problems: Vec<String> = {
        let mut stmt = conn.prepare("PRAGMA integrity_check")?;
        let rows = stmt.query_map([], |r| r.get::<_, String>(0))?;
        rows.collect::<Result<_, _>>()?
    };
    if problems.len() != 1 || problems[0] != "ok" {
        report.first_break = broke(
            None,
            format!(
                "integrity_check: {}",
                problems.first().map_or("no answer", String::as_str)
            ),
        );
        return Ok((report, None));
    }
    report.integrity_ok = true;

    let fk_problem: Option<(String, i64)> = {
        let mut stmt = conn.prepare("PRAGMA foreign_key_check")?;
        let mut rows = stmt.query([])?;
        match rows.next()? {
            Some(row) => Some((row.get(0)?, row.get::<_, Option<i64>>(1)?.unwrap_or(0))),
            None => None,
        }
    };
    if let Some((table, rowid)) = fk_problem {
        report.first_break = broke(
            None,
            format!("foreign_key_check: {table} row {rowid} refers to a missing row"),
        );
        return Ok((report, None));
    }

    let (found, seals) = walk_chain(conn, &mut report, seals)?;
    if let Some(found) = found {
        return halted(report, found);
    }

    if let Some(found) = check_signal_rows(conn)? {
        return halted(report, found);
    }

    if let Some(found) = super::projection::check(conn)? {
        return halted(report, found);
    }

    if let Some((seq, hash)) = expect_head {
        report.first_break = match &report.head {
            None => broke(
                Some(seq),
                format!("expected head {seq} but the ledger has no events (truncated)"),
            ),
            Some((head_seq, _)) if *head_seq < seq => broke(
                Some(seq),
                format!("expected head {seq} but the ledger ends at {head_seq} (truncated)"),
            ),
            Some(_) => {
                let stored: Option<String> = conn
                    .query_row("SELECT hash FROM events WHERE seq = ?1", [seq], |r| {
                        r.get(0)
                    })
                    .ok();
                match stored {
                    Some(stored) if stored.eq_ignore_ascii_case(&hash) => None,
                    Some(stored) => broke(
                        Some(seq),
                        format!("hash is {stored}, but the expected head says {hash}"),
                    ),
                    None => broke(Some(seq), "expected head event is missing"),
                }
            }
        };
    }
    // A backup is judged at the time it was taken (its stamp's), while it
    // still ends at the head its stamp names: a restored backup written to
    // since is a live ledger again, judged now.
    let backup = super::seal::read_backup_stamp(conn)?.filter(|stamp| {
        let named = stamp["head"]["seq"]
            .as_i64()
            .zip(stamp["head"]["hash"].as_str());
        named == report.head.as_ref().map(|(s, h)| (*s, h.as_str()))
    });
    if let Some(stamp) = &backup
        && read_at.is_some()
    {
        read_at = stamp["at"]
            .as_str()
            .and_then(|t| humantime::parse_rfc3339(t).ok());
    }
    let stamp = match (&backup, seals.as_ref()) {
        (Some(stamp), Some(check)) => Some(check_stamp(check, stamp, &report)),
        (Some(stamp), None) => {
            report.trailer = Some(format!(
                "a backup taken at {} (its stamp not checked: no --seal-key or --seal-pub)",
                stamp["at"].as_str().unwrap_or("an unknown time")
            ));
            None
        }
        (None, _) => None,
    };
    // An edited stamp is named before the seals are judged at its time.
    if report.first_break.is_none()
        && let Some(Err(found)) = &stamp
    {
        return halted(report, found.clone());
    }
    let (mut report, sealed) = finish_seals(report, seals, read_at)?;
    if report.first_break.is_none()
        && let Some(Ok(note)) = stamp
    {
        report.trailer = Some(note);
    }
    Ok((report, sealed))
}

/// A backup's stamp against the copy: sealed with the key its newest seal
/// handed on, naming the copy's head. Returns what it proves.
fn check_stamp(
    check: &SealCheck,
    stamp: &serde_json::Value,
    report: &VerifyReport,
) -> Result<String, VerifyBreak> {
    let epoch = check.check_backup_stamp(stamp)?;
    let named = stamp["head"]["seq"]
        .as_i64()
        .zip(stamp["head"]["hash"].as_str());
    let walked = report.head.as_ref().map(|(s, h)| (*s, h.as_str()));
    if named != walked {
        return Err(VerifyBreak {
            seq: None,
            what: format!(
                "the backup's stamp names head {} but the copy ends at {} (written to since it was taken, or cut)",
                named.map_or("none".to_string(), |(s, h)| format!("{s}:{h}")),
                walked.map_or("none".to_string(), |(s, h)| format!("{s}:{h}"))
            ),
        });
    }
    Ok(format!(
        "a backup, proven up to seq {} at {} (its stamp sealed with epoch {epoch}'s key)",
        named.map_or(0, |(s, _)| s),
        stamp["at"].as_str().unwrap_or_default()
    ))
}

/// The seal check's end (when asked, and nothing broke before it).
fn finish_seals(
    report: VerifyReport,
    seals: Option<SealCheck>,
    read_at: Option<std::time::SystemTime>,
) -> Result<(VerifyReport, Option<SealReport>), Fail> {
    let Some(seals) = seals else {
        return Ok((report, None));
    };
    if report.first_break.is_some() {
        return Ok((report, None));
    }
    match seals.finish(read_at) {
        Ok(sealed) => Ok((report, Some(sealed))),
        Err(found) => halted(report, found),
    }
}

/// The last line of a whole NDJSON export of a sealed ledger (every path's:
/// the CLI's, `/api/export`, the dashboard's link): not an event, but the
/// export's own time (freshness is judged at it), where it was made, the
/// head it stops at, its filter and how many events it holds, sealed with
/// the key of the epoch after the newest seal (`seal.rs`, [`TrailerKey`]):
/// cutting the export or editing the line fails `verify --export
/// --seal-key`. Trailers of earlier builds carry only `at` and `events`.
///
/// [`TrailerKey`]: super::seal::TrailerKey
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub(crate) struct ExportStamp {
    /// The trailer's form: 2 (absent in an earlier build's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) v: Option<u32>,
    pub(crate) at: String,
    pub(crate) events: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) host: Option<String>,
    /// `/etc/machine-id` (none where the host has no such file).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) machine_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) boot_id: Option<String>,
    /// The newest event the export holds (null for an empty ledger).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) head: Option<Option<StampHead>>,
    /// What the export selected: `{}` for the whole ledger.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) filter: Option<serde_json::Value>,
    /// A filtered export's (form 3): the Merkle tree over every event up
    /// to `head`, its leaf count, root, and the head's own inclusion path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) tree_size: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) root: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) head_path: Option<Vec<String>>,
}

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct StampHead {
    pub(crate) seq: i64,
    pub(crate) hash: String,
}

#[derive(serde::Serialize, serde::Deserialize)]
pub(crate) struct ExportTrailer {
    pub(crate) exported: ExportStamp,
}

/// The export's trailer as read: its line, its fields, and its object as
/// written (the MAC covers exactly that).
struct ReadStamp {
    line: usize,
    stamp: ExportStamp,
    raw: serde_json::Value,
}

/// `verify --export FILE`: the same chain walk (and seal check) over an
/// NDJSON export alone, in two passes over the file (the newest checkpoint
/// first, as the ledger's walk reads it first). Without SQLite there is no
/// integrity check and no `signals` table: the chain's own SIGKILL rule holds.
/// Then the trailer: its count and head are the export's, and (with a seal
/// key) it is sealed with the key the export's newest seal handed on.
// Over 100 lines on purpose: two passes over one export file (the newest checkpoint first, then
// the walk), the first pass's findings carried into the second, then the trailer's checks.
pub(crate) fn verify_export(
    path: &std::path::Path,
    seals: Option<SealCheck>,
    as_of: Option<std::time::SystemTime>,
) -> Result<(VerifyReport, Option<SealReport>), LedgerError> {
    use std::io::BufRead;
    let open = || {
        std::fs::File::open(path)
            .map(std::io::BufReader::new)
            .map_err(|e| LedgerError::Other(format!("{}: {e}", path.display())))
    };
    let read_err = |e: std::io::Error| LedgerError::Other(format!("{}: {e}", path.display()));
    let mut report = VerifyReport {
        // Nothing to check below the events: the file is the record.
        integrity_ok: true,
        ..VerifyReport::default()
    };
    let fail = |mut report: VerifyReport, line: usize, what: String| {
        report.first_break = Some(VerifyBreak {
            seq: None,
            what: format!("line {line}: {what}"),
        });
        Ok((report, None))
    };
    // Pass 1: the newest checkpoint, the trailer, and whether the export
    // holds seals at all.
    let mut checkpoint = None;
    let mut stamp: Option<ReadStamp> = None;
    let mut sealed = false;
    // The first inclusion proof's line: a filtered export's.
    let mut proofs: Option<usize> = None;
    for (i, line) in open()?.lines().enumerate() {
        let line = line.map_err(read_err)?;
        if line.trim().is_empty() {
            continue;
        }
        if let Some(s) = &stamp {
            return fail(
                report,
                i + 1,
                format!("an event after the export's last line (line {})", s.line),
            );
        }
        if let Ok(value) = serde_json::from_str::<serde_json::Value>(&line)
            && let Some(raw) = value.get("exported")
        {
            match serde_json::from_value::<ExportTrailer>(value.clone()) {
                Ok(trailer) => {
                    stamp = Some(ReadStamp {
                        line: i + 1,
                        stamp: trailer.exported,
                        raw: raw.clone(),
                    });
                    continue;
                }
                Err(e) => return fail(report, i + 1, format!("the trailer is malformed: {e}")),
            }
        }
        if line.starts_with("{\"proof\":") {
            proofs = proofs.or(Some(i + 1));
            continue;
        }
        match serde_json::from_str::<EventRow>(&line) {
            Ok(e) if e.kind == EventKind::LedgerCheckpoint => {
                checkpoint = match prune::Checkpoint::from_data(e.seq, &e.data) {
                    Some(cp) => Some(cp),
                    None => {
                        return fail(report, i + 1, "ledger.checkpoint data is malformed".into());
                    }
                }
            }
            Ok(e) => sealed |= e.kind == EventKind::LedgerSeal,
            Err(e) => return fail(report, i + 1, format!("not an exported event: {e}")),
        }
    }
    match (&stamp, proofs) {
        (Some(s), _) if s.stamp.root.is_some() => {
            return verify_filtered(path, s, seals);
        }
        (None, Some(line)) => {
            return fail(
                report,
                line,
                "an inclusion proof, but the export has no trailer to prove against: its end was cut".into(),
            );
        }
        (Some(s), Some(line)) => {
            let at = s.line;
            return fail(
                report,
                line,
                format!(
                    "an inclusion proof, but the trailer (line {at}) names no Merkle root: edited"
                ),
            );
        }
        (Some(_) | None, None) => {}
    }
    report.checkpoint = checkpoint.as_ref().map(|c| c.seq);
    // When it was read: its trailer's time, else the time the caller
    // judges a trail without one at (a stream's last event).
    let read_at = stamp
        .as_ref()
        .and_then(|s| humantime::parse_rfc3339(&s.stamp.at).ok())
        .or(as_of);
    // Pass 2: the walk.
    let mut walk = Walk::new(checkpoint, seals);
    for (i, line) in open()?.lines().enumerate() {
        let line = line.map_err(read_err)?;
        if line.trim().is_empty() || stamp.as_ref().is_some_and(|s| s.line == i + 1) {
            continue;
        }
        let e: EventRow = match serde_json::from_str(&line) {
            Ok(e) => e,
            Err(e) => return fail(report, i + 1, format!("not an exported event: {e}")),
        };
        if !e.data.is_object() {
            return fail(report, i + 1, "data is not a JSON object".into());
        }
        let row = WalkRow {
            seq: e.seq,
            at: e.at,
            tree: e.tree.map(|t| t.0),
            kind: e.kind,
            data_text: chain::canonical_string(&e.data),
            prev_hash: e.prev_hash,
            hash: e.hash,
        };
        if let Some(found) = walk.step(row, &mut report) {
            return halted(report, found);
        }
    }
    if let Some(found) = walk.finish() {
        return halted(report, found);
    }
    if let Some(s) = &stamp
        && let Some(what) = stamp_disagrees(&s.stamp, &report)
    {
        let line = s.line;
        return fail(report, line, what);
    }
    // The trailer's seal is judged after the seals' own verdict, so that a
    // broken or stale run of seals is named as such first.
    let trailer = match (&stamp, walk.seals.as_ref()) {
        (Some(s), Some(check)) => check.check_trailer(s.line, &s.raw),
        (Some(_), None) if sealed => {
            Ok("the trailer is sealed but not checked (no --seal-key or --seal-pub)".to_string())
        }
        (Some(_), None) => Ok("the trailer (time, host, head, count) is unauthenticated: an unsealed ledger's export (the chain proves each event, not where the export ends)".to_string()),
        (None, _) => Ok("no trailer: the export is not bound as a whole (the chain proves each event; a cut export passes)".to_string()),
    };
    let (mut report, sealed) = finish_seals(report, walk.seals.take(), read_at)
        .map_err(|f| f.into_ledger(std::time::Duration::ZERO))?;
    if report.first_break.is_some() {
        return Ok((report, sealed));
    }
    match trailer {
        Ok(note) => report.trailer = Some(note),
        Err(found) => return halted(report, found),
    }
    Ok((report, sealed))
}

/// `verify --export` of a filtered export (its trailer names a Merkle
/// root, `export.rs`): every event's hash recomputed; each event proven the
/// ledger's by its link to the next event (consecutive seqs) or by the
/// inclusion proof after it, leading to the trailer's root; every event
/// taken by the trailer's selection, except the ledger's seals, which walk
/// the seal check; the head proven the root's last leaf; the count the
/// trailer's. A left-out event fails the count (the events held are
/// distinct, genuine and selected, so as many as the trailer names are all
/// of them); the trailer's own seal binds count, selection, root and head.
// Over 100 lines on purpose: one pass over the file with each line's rules in the order they
// are checked, then the trailer's; each rule is a few lines.
fn verify_filtered(
    path: &std::path::Path,
    stamp: &ReadStamp,
    mut seals: Option<SealCheck>,
) -> Result<(VerifyReport, Option<SealReport>), LedgerError> {
    use std::io::BufRead;
    let file = std::fs::File::open(path)
        .map(std::io::BufReader::new)
        .map_err(|e| LedgerError::Other(format!("{}: {e}", path.display())))?;
    let mut report = VerifyReport {
        integrity_ok: true,
        ..VerifyReport::default()
    };
    let fail = |mut report: VerifyReport, what: String| {
        report.first_break = Some(VerifyBreak { seq: None, what });
        Ok((report, None))
    };
    let hex32 = |h: &str| {
        hex::decode(h)
            .ok()
            .and_then(|b| <[u8; 32]>::try_from(b).ok())
    };
    let hexes = |p: &[String]| {
        p.iter()
            .map(|h| hex32(h))
            .collect::<Option<Vec<[u8; 32]>>>()
    };
    let t = &stamp.stamp;
    let trailer_line = stamp.line;
    let (Some(root), Some(size)) = (t.root.as_deref().and_then(hex32), t.tree_size) else {
        return fail(
            report,
            format!("line {trailer_line}: the trailer's Merkle root or tree size is malformed"),
        );
    };
    let selection: super::export::Selection =
        match serde_json::from_value(t.filter.clone().unwrap_or_default()) {
            Ok(s) => s,
            Err(e) => {
                return fail(
                    report,
                    format!("line {trailer_line}: the trailer's filter is malformed: {e}"),
                );
            }
        };
    // The head the trailer names is the root's last leaf.
    let head = t.head.clone().flatten();
    let head_proven = match (&head, t.head_path.as_deref().and_then(hexes)) {
        (None, _) => size == 0,
        (Some(h), Some(p)) => chain::merkle_leaf(&h.hash).is_some_and(|leaf| {
            chain::merkle_included(size.saturating_sub(1), size, leaf, &p, &root)
        }),
        (Some(_), None) => false,
    };
    if !head_proven {
        return fail(
            report,
            format!(
                "line {trailer_line}: the trailer's head is not the last leaf of its Merkle root (edited)"
            ),
        );
    }
    // The newest event not proven yet (seq, hash): its link to the next
    // event, or the proof after it, proves it and the run it ends.
    let mut pending: Option<(i64, String)> = None;
    let mut last_seq = 0i64;
    for (i, line) in file.lines().enumerate() {
        let line = line.map_err(|e| LedgerError::Other(format!("{}: {e}", path.display())))?;
        let n = i + 1;
        if line.trim().is_empty() || n == trailer_line {
            continue;
        }
        if line.starts_with("{\"proof\":") {
            let p: super::export::ProofLine = match serde_json::from_str(&line) {
                Ok(p) => p,
                Err(e) => {
                    return fail(
                        report,
                        format!("line {n}: the inclusion proof is malformed: {e}"),
                    );
                }
            };
            let p = p.proof;
            let Some((seq, hash)) = pending.take().filter(|(s, _)| *s == p.seq) else {
                return fail(
                    report,
                    format!(
                        "line {n}: an inclusion proof of seq {}, which is not the event before it",
                        p.seq
                    ),
                );
            };
            let proven =
                hexes(&p.path)
                    .zip(chain::merkle_leaf(&hash))
                    .is_some_and(|(path, leaf)| {
                        chain::merkle_included(p.index, size, leaf, &path, &root)
                    });
            if !proven {
                report.first_break = broke(
                    Some(seq),
                    format!(
                        "line {n}: the inclusion proof does not lead to the trailer's Merkle root: the event (or a run of events linked to it) is not the ledger's, or was edited and rehashed"
                    ),
                );
                return Ok((report, None));
            }
            continue;
        }
        let e: EventRow = match serde_json::from_str(&line) {
            Ok(e) => e,
            Err(e) => return fail(report, format!("line {n}: not an exported event: {e}")),
        };
        if !e.data.is_object() {
            return fail(report, format!("line {n}: data is not a JSON object"));
        }
        let hash = e.recomputed_hash();
        if hash != e.hash {
            report.first_break = broke(
                Some(e.seq),
                "hash does not match the recomputed hash (content edited)",
            );
            return Ok((report, None));
        }
        if e.seq <= last_seq {
            report.first_break = broke(Some(e.seq), format!("out of order: after seq {last_seq}"));
            return Ok((report, None));
        }
        if let Some((seq, h)) = pending.take()
            && (e.seq != seq + 1 || e.prev_hash != h)
        {
            report.first_break = broke(
                Some(seq),
                format!(
                    "not proven the ledger's: no inclusion proof follows it, and seq {} does not link to it (a proof line removed, or the event between them left out)",
                    e.seq
                ),
            );
            return Ok((report, None));
        }
        last_seq = e.seq;
        if selection.takes(e.seq, &e.at, e.tree.map(|t| t.0), e.kind.as_str()) {
            report.events += 1;
        } else if e.kind != EventKind::LedgerSeal {
            report.first_break = broke(
                Some(e.seq),
                format!(
                    "{} at {} is outside the export's filter {}",
                    e.kind.as_str(),
                    e.at,
                    t.filter.clone().unwrap_or_default()
                ),
            );
            return Ok((report, None));
        }
        if e.kind == EventKind::LedgerSeal
            && let Some(check) = seals.as_mut()
            && let Some(found) = check.step(e.seq, &e.kind, &e.data, &e.prev_hash)
        {
            return halted(report, found);
        }
        pending = Some((e.seq, e.hash));
    }
    if let Some((seq, _)) = pending {
        report.first_break = broke(
            Some(seq),
            "the export ends without this event's inclusion proof (its end was cut)",
        );
        return Ok((report, None));
    }
    if t.events != report.events {
        let what = format!(
            "line {trailer_line}: the export says its filter took {} events but {} are there (an event left out, or the export cut or added to)",
            t.events, report.events
        );
        return fail(report, what);
    }
    report.head = head.map(|h| (h.seq, h.hash));
    let read_at = humantime::parse_rfc3339(&t.at).ok();
    let trailer = match seals.as_ref() {
        Some(check) => check.check_trailer(trailer_line, &stamp.raw),
        None => Ok("the trailer is not checked (no --seal-key or --seal-pub): the events are proven against its root, not the root or count against the ledger's key".to_string()),
    };
    let (mut report, sealed) = finish_seals(report, seals, read_at)
        .map_err(|f| f.into_ledger(std::time::Duration::ZERO))?;
    if report.first_break.is_some() {
        return Ok((report, sealed));
    }
    match trailer {
        Ok(note) => {
            report.trailer = Some(format!(
                "a filtered export ({}): {} events proven against the Merkle root of the ledger's {size} events; {note}",
                t.filter.clone().unwrap_or_default(),
                report.events
            ));
            Ok((report, sealed))
        }
        Err(found) => halted(report, found),
    }
}

/// What a trailer says that the export it ends does not bear out: its
/// event count, or its head.
fn stamp_disagrees(stamp: &ExportStamp, report: &VerifyReport) -> Option<String> {
    if stamp.events != report.events {
        return Some(format!(
            "the export says it holds {} events but {} are there (cut or added to)",
            stamp.events, report.events
        ));
    }
    let head = stamp.head.as_ref()?;
    let walked = report.head.as_ref().map(|(seq, hash)| StampHead {
        seq: *seq,
        hash: hash.clone(),
    });
    if *head != walked {
        let name = |h: &Option<StampHead>| {
            h.as_ref()
                .map_or("no event".to_string(), |h| format!("{}:{}", h.seq, h.hash))
        };
        return Some(format!(
            "the trailer names head {} but the export ends at {} (cut or added to)",
            name(head),
            name(&walked)
        ));
    }
    None
}

/// One event as the walk sees it: `data_text` as stored (the ledger) or
/// the canonical text of the exported object (an NDJSON export).
pub(crate) struct WalkRow {
    pub(crate) seq: i64,
    pub(crate) at: String,
    pub(crate) tree: Option<i64>,
    pub(crate) kind: RowKind,
    pub(crate) data_text: String,
    pub(crate) prev_hash: String,
    pub(crate) hash: String,
}

/// The chain walk over events in seq order, from the ledger or an export.
///
/// Without a checkpoint the chain is whole from seq 1 (prev_hash the
/// genesis). With one (the newest `ledger.checkpoint`, see `prune.rs`),
/// events at or below its `pruned_through` P are the survivors of pruning:
/// each must still prove its content, adjacent ones must link, and their
/// count and digest must be what the checkpoint recorded; above P the
/// chain is whole again, starting at P + 1 from the checkpoint's `hash`.
/// With a [`SealCheck`], every event also goes through it (`seal.rs`).
pub(crate) struct Walk {
    checkpoint: Option<prune::Checkpoint>,
    boundary: i64,
    boundary_hash: String,
    kept: Sha256,
    kept_n: u64,
    /// The previous event walked (seq, hash).
    prev: Option<(i64, String)>,
    /// kill.authorized events seen so far: authorization id -> tree.
    authorized: HashMap<i64, Option<i64>>,
    pub(crate) seals: Option<SealCheck>,
}

impl Walk {
    pub(crate) fn new(checkpoint: Option<prune::Checkpoint>, seals: Option<SealCheck>) -> Walk {
        let (boundary, boundary_hash) = checkpoint
            .as_ref()
            .map_or((0, chain::GENESIS.to_string()), |c| {
                (c.pruned_through, c.hash.clone())
            });
        Walk {
            checkpoint,
            boundary,
            boundary_hash,
            kept: Sha256::new(),
            kept_n: 0,
            prev: None,
            authorized: HashMap::new(),
            seals,
        }
    }

    // Over 100 lines on purpose: the chain's rules for one event (hash, seq, checkpoint,
    // authority, seals) in the order verify applies them, which is the contract; each rule is a
    // few lines.
    pub(crate) fn step(&mut self, row: WalkRow, report: &mut VerifyReport) -> Option<VerifyBreak> {
        let WalkRow {
            seq,
            at,
            tree,
            kind,
            data_text,
            prev_hash: stored_prev,
            hash: stored_hash,
        } = row;
        let boundary = self.boundary;
        if seq <= boundary {
            // A survivor of pruning: linked where its predecessor survived too.
            let linked_to = match &self.prev {
                Some((p, h)) if *p == seq - 1 => Some(h.as_str()),
                _ if seq == 1 => Some(chain::GENESIS),
                _ => None,
            };
            if linked_to.is_some_and(|h| h != stored_prev) {
                return broke(
                    Some(seq),
                    "prev_hash does not match the previous event's hash (reordered or replaced)",
                );
            }
            self.kept.update(stored_hash.as_bytes());
            self.kept_n += 1;
        } else {
            let (expected_seq, expected_prev) = match &self.prev {
                Some((p, h)) if *p > boundary => (p + 1, h.as_str()),
                _ => (boundary + 1, self.boundary_hash.as_str()),
            };
            if seq != expected_seq {
                return broke(
                    Some(expected_seq),
                    format!("event {expected_seq} is missing (the next stored event is {seq})"),
                );
            }
            if stored_prev != expected_prev {
                let what = if expected_seq == boundary + 1 && boundary > 0 {
                    "prev_hash does not match the checkpoint's hash of the last pruned event"
                } else {
                    "prev_hash does not match the previous event's hash (reordered or replaced)"
                };
                return broke(Some(seq), what);
            }
        }
        let data: serde_json::Value = match serde_json::from_str(&data_text) {
            Ok(data) => data,
            Err(e) => return broke(Some(seq), format!("data is not JSON: {e}")),
        };
        if chain::canonical_string(&data) != data_text {
            return broke(Some(seq), "data is not in canonical form (edited)");
        }
        // The text is canonical (checked above): hash it as it is stored.
        let hash =
            chain::event_hash_of_text(&stored_prev, seq, &at, tree, kind.as_str(), &data_text);
        if hash != stored_hash {
            return broke(
                Some(seq),
                "hash does not match the recomputed hash (content edited)",
            );
        }

        // The two payloads the chain's authority rule reads must decode;
        // every other kind (an unknown one too) is proven by its hash alone.
        match Event::decode(&kind, &data) {
            Event::KillAuthorized(k) => {
                self.authorized.insert(k.authorization.0, tree);
            }
            // The forced kills: SIGKILL, and on Windows TerminateJobObject
            // and TerminateProcess.
            Event::SignalSent(s) if s.signal.is_kill() => {
                match s.authorization.and_then(|a| self.authorized.get(&a.0)) {
                    Some(auth_tree) if *auth_tree == tree => {}
                    Some(_) => {
                        return broke(Some(seq), "SIGKILL cites an authorization of another tree");
                    }
                    None => {
                        return broke(
                            Some(seq),
                            "SIGKILL without an earlier kill.authorized event",
                        );
                    }
                }
            }
            Event::Other(o)
                if matches!(
                    o.kind.known(),
                    Some(EventKind::KillAuthorized | EventKind::SignalSent)
                ) =>
            {
                return broke(Some(seq), o.why.clone());
            }
            _ => {}
        }
        if let Some(seals) = self.seals.as_mut()
            && let Some(found) = seals.step(seq, &kind, &data, &stored_prev)
        {
            return Some(found);
        }

        report.events += 1;
        report.head = Some((seq, stored_hash.clone()));
        self.prev = Some((seq, stored_hash));
        None
    }

    /// After the last event: the survivors below the checkpoint are what it recorded.
    pub(crate) fn finish(&mut self) -> Option<VerifyBreak> {
        let cp = self.checkpoint.as_ref()?;
        let digest = hex::encode(std::mem::take(&mut self.kept).finalize());
        if self.kept_n != cp.kept_events || digest != cp.kept_digest {
            return broke(
                Some(cp.seq),
                format!(
                    "the {} events held at or below the checkpoint's pruned_through {} are not the {} it recorded (removed, added or edited)",
                    self.kept_n, cp.pruned_through, cp.kept_events
                ),
            );
        }
        None
    }
}

/// Walks every event in seq order. Returns the first break.
fn walk_chain(
    conn: &Connection,
    report: &mut VerifyReport,
    walk_seals: Option<SealCheck>,
) -> Result<(Option<VerifyBreak>, Option<SealCheck>), Fail> {
    let checkpoint = match prune::latest_checkpoint(conn)? {
        Ok(cp) => cp,
        Err(found) => return Ok((Some(found), None)),
    };
    report.checkpoint = checkpoint.as_ref().map(|c| c.seq);
    let mut walk = Walk::new(checkpoint, walk_seals);
    let mut stmt =
        conn.prepare("SELECT seq, at, tree, kind, data, prev_hash, hash FROM events ORDER BY seq")?;
    let mut rows = stmt.query([])?;
    while let Some(row) = rows.next()? {
        let row = WalkRow {
            seq: row.get(0)?,
            at: row.get(1)?,
            tree: row.get(2)?,
            kind: RowKind::parse(&row.get::<_, String>(3)?),
            data_text: row.get(4)?,
            prev_hash: row.get(5)?,
            hash: row.get(6)?,
        };
        if let Some(found) = walk.step(row, report) {
            return Ok((Some(found), None));
        }
    }
    let found = walk.finish();
    Ok((found, walk.seals.take()))
}

/// Every SIGKILL row in `signals` must cite an authorization of its tree,
/// committed no later than the signal.
fn check_signal_rows(conn: &Connection) -> Result<Option<VerifyBreak>, Fail> {
    let mut stmt = conn.prepare(
        "SELECT s.id, s.tree_id, s.at, ka.id, ka.tree_id, ka.at,
                (SELECT e.seq FROM events e WHERE e.kind = 'signal.sent'
                   AND json_extract(e.data, '$.id') = s.id AND e.tree = s.tree_id) AS seq
         FROM signals s LEFT JOIN kill_authorizations ka ON ka.id = s.authorization_id
         WHERE s.signal = 'SIGKILL' ORDER BY s.id",
    )?;
    let mut rows = stmt.query([])?;
    while let Some(row) = rows.next()? {
        let id: i64 = row.get(0)?;
        let tree: i64 = row.get(1)?;
        let at: String = row.get(2)?;
        let auth: Option<i64> = row.get(3)?;
        let auth_tree: Option<i64> = row.get(4)?;
        let auth_at: Option<String> = row.get(5)?;
        let seq: Option<i64> = row.get(6)?;
        let problem = match (auth, auth_tree, auth_at) {
            (None, _, _) => Some("has no kill authorization".to_string()),
            (Some(a), Some(t), _) if t != tree => {
                Some(format!("cites authorization {a} of tree {t}"))
            }
            (Some(a), _, Some(a_at)) if a_at > at => {
                Some(format!("precedes its authorization {a}"))
            }
            _ if seq.is_none() => Some("has no signal.sent event in the chain".to_string()),
            _ => None,
        };
        if let Some(problem) = problem {
            return Ok(broke(
                seq,
                format!("SIGKILL signal row {id} (tree {tree}) {problem}"),
            ));
        }
    }
    Ok(None)
}
