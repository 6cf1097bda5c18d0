//! Retention: `prune --before T` removes the events and rows of trees that
//! ended before T, after writing them to an fsynced archive, and leaves a
//! `ledger.checkpoint` event from which `verify` proves what remains.
//!
//! # Why not "delete a prefix"
//!
//! The events of live trees are interleaved in seq order with those of
//! ended ones, so the events a prune may remove are not a prefix of the
//! chain. Pruning only the prefix below the oldest event of any kept tree
//! would let one long-lived tree (a service's own daemon, an ambiguous tree
//! awaiting an operator for weeks) hold every later ended tree's events
//! forever. So the prune removes exactly the ended trees' events (and the
//! tree-less ones older than T), wherever they are, and the checkpoint
//! proves the sparse remainder instead:
//!
//! - `pruned_through` P is the highest seq any prune has removed, and
//!   `hash` the hash of event P. Every event above P is still there, so the
//!   chain above P is whole: its first event's `prev_hash` is `hash`.
//! - At or below P some events remain (those of trees that were live or
//!   ended after T). Each still proves its own content (its hash is
//!   recomputed from its `prev_hash` and content, and adjacent survivors
//!   still link), and `kept_below` holds their count and a digest of their
//!   hashes in seq order, so removing, reordering or editing any of them
//!   breaks `verify`. The checkpoint is itself a chain event, so it cannot
//!   be changed without breaking the chain after it.
//! - `pruned` holds the count, first and last seq and a digest of the
//!   removed events' hashes: an archive proves it is exactly what was
//!   removed (`verify --archive`) and chains into the ledger where its
//!   events and the survivors are neighbours.
//!
//! A digest is `hex(sha256(hash_1 || hash_2 || …))` over the events' 64-hex
//! hashes in seq order; a hash commits to its event's seq and content.
//!
//! # Order of work
//!
//! 1. In one read snapshot: plan (which trees, which events, the digests)
//!    and write the archive (a new file), then fsync it and its directory.
//! 2. In one `BEGIN IMMEDIATE` transaction (FULL): plan again, refuse if
//!    the plan changed, append the checkpoint (the chain's new head), delete.
//!    The database's guards (migration 0005) let a delete through only while
//!    the head is a checkpoint that covers the row.
//!
//! A failure at any step deletes nothing; an archive written for a prune
//! that did not commit is removed. The prune never removes events the
//! shipping cursor has not passed (they have not left the host yet).

use std::collections::HashSet;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};

use rusqlite::{Connection, OptionalExtension, params};
use sha2::{Digest, Sha256};

use super::chain;
use super::db::Writer;
use super::error::{Fail, LedgerError};
use super::event::{Checkpointed, Event, KeptEvents, PrunedEvents, RowKind};
use super::types::{EventKind, EventRow, TreeId, VerifyBreak, VerifyReport};

/// What to prune.
#[derive(Clone, Debug)]
pub struct PruneRequest {
    /// Trees that ended before this moment (and tree-less events older than it).
    pub before: std::time::SystemTime,
    /// Where to write the removed events first (NDJSON, the export format);
    /// must not exist.
    pub archive: Option<PathBuf>,
    /// Trees never to prune whatever their row says (e.g. those with an
    /// unsettled marker on disk).
    pub keep: Vec<TreeId>,
}

/// What a prune did.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct PruneReport {
    /// The checkpoint event's seq, or `None` when nothing was prunable.
    pub checkpoint: Option<i64>,
    pub events: u64,
    pub trees: u64,
    /// Highest seq ever pruned (the checkpoint's `pruned_through`).
    pub pruned_through: i64,
    /// Events still held at or below `pruned_through`.
    pub kept_below: u64,
    pub archive: Option<PathBuf>,
    /// The ids of the trees removed (their captured logs go with them).
    #[serde(skip)]
    pub pruned_trees: Vec<i64>,
}

/// The checkpoint as `verify` reads it back from the chain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Checkpoint {
    pub(crate) seq: i64,
    pub(crate) pruned_through: i64,
    pub(crate) hash: String,
    pub(crate) kept_events: u64,
    pub(crate) kept_digest: String,
    pub(crate) pruned_events: u64,
    pub(crate) pruned_digest: String,
}

impl Checkpoint {
    pub(crate) fn from_data(seq: i64, data: &serde_json::Value) -> Option<Checkpoint> {
        Some(Checkpoint {
            seq,
            pruned_through: data.get("pruned_through")?.as_i64()?,
            hash: data.get("hash")?.as_str()?.to_string(),
            kept_events: data.pointer("/kept_below/events")?.as_u64()?,
            kept_digest: data.pointer("/kept_below/digest")?.as_str()?.to_string(),
            pruned_events: data.pointer("/pruned/events")?.as_u64()?,
            pruned_digest: data.pointer("/pruned/digest")?.as_str()?.to_string(),
        })
    }
}

/// The newest `ledger.checkpoint` in the chain: `Ok(None)` when there is
/// none, `Err` with a break when its data cannot be read.
pub(crate) fn latest_checkpoint(
    conn: &Connection,
) -> Result<Result<Option<Checkpoint>, VerifyBreak>, Fail> {
    let found: Option<(i64, String)> = conn
        .prepare_cached(
            "SELECT seq, data FROM events WHERE kind = 'ledger.checkpoint' ORDER BY seq DESC LIMIT 1",
        )?
        .query_row([], |r| Ok((r.get(0)?, r.get(1)?)))
        .optional()?;
    let Some((seq, text)) = found else {
        return Ok(Ok(None));
    };
    let parsed = serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|data| Checkpoint::from_data(seq, &data));
    Ok(parsed.map(Some).ok_or(VerifyBreak {
        seq: Some(seq),
        what: "ledger.checkpoint data is malformed".into(),
    }))
}

/// Which events and trees a prune removes, and the digests the checkpoint
/// will carry. Two plans of one ledger state are equal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    /// Nothing above this seq is touched (the head, or the shipping cursor).
    limit: i64,
    before: String,
    trees: Vec<i64>,
    events: u64,
    first: i64,
    last: i64,
    digest: String,
    pruned_through: i64,
    hash: String,
    kept: u64,
    kept_digest: String,
    previous: Option<i64>,
}

/// Receives each event a prune removes, in seq order (the archive writer).
type ArchiveSink<'a> = dyn FnMut(&EventRow) -> Result<(), LedgerError> + 'a;

const TERMINAL: &str = "('ended', 'vanished', 'spawn_failed', 'resolved')";

/// Plans a prune on `conn` (a snapshot); `archive` receives each removed
/// event as it is found. `limit`: the seq bound fixed by an earlier plan
/// (phase 2), or `None` to read it now.
// Over 100 lines on purpose: one read-only snapshot's plan: the bound, the trees that go, then
// one ordered pass over the events that hashes what goes and what stays (the kept digest at two
// bounds) and feeds the archive; the pass's running state is local to it.
fn plan(
    conn: &Connection,
    before: &str,
    keep: &HashSet<i64>,
    limit: Option<i64>,
    mut archive: Option<&mut ArchiveSink<'_>>,
) -> Result<Option<Plan>, Fail> {
    let limit = match limit {
        Some(limit) => limit,
        None => {
            let head = super::db::read_head(conn)?.map_or(0, |(seq, _)| seq);
            let shipped: Option<i64> =
                conn.query_row("SELECT min(seq) FROM ship_cursor", [], |r| r.get(0))?;
            shipped.map_or(head, |s| s.min(head))
        }
    };
    let previous = match latest_checkpoint(conn)? {
        Ok(cp) => cp,
        Err(broken) => return Err(LedgerError::Invariant(format!("cannot prune: {broken}")).into()),
    };
    let trees: Vec<i64> = {
        let sql = format!(
            "SELECT t.id FROM trees t
             WHERE t.state IN {TERMINAL} AND t.ended_at < ?1
               AND NOT (t.state = 'resolved'
                        AND EXISTS (SELECT 1 FROM json_each(t.flags) WHERE value = 'survivors_left')
                        AND NOT EXISTS (SELECT 1 FROM json_each(t.flags) WHERE value = 'survivors_ended'))
               AND NOT EXISTS (SELECT 1 FROM events e WHERE e.tree = t.id AND e.seq > ?2)
             ORDER BY t.id"
        );
        let mut stmt = conn.prepare(&sql)?;
        let rows = stmt.query_map(params![before, limit], |r| r.get::<_, i64>(0))?;
        rows.collect::<Result<Vec<_>, _>>()?
            .into_iter()
            .filter(|id| !keep.contains(id))
            .collect()
    };
    let set: HashSet<i64> = trees.iter().copied().collect();
    let (prev_p, prev_hash) = previous
        .as_ref()
        .map_or((0, chain::GENESIS.to_string()), |c| {
            (c.pruned_through, c.hash.clone())
        });

    let mut pruned = Sha256::new();
    let mut kept = Sha256::new();
    let mut kept_n = 0_u64;
    // The kept digest up to the last pruned event, and up to the previous
    // checkpoint's bound: the checkpoint covers survivors up to whichever is higher.
    let mut kept_at_last: Option<(Sha256, u64)> = None;
    let mut kept_at_prev: Option<(Sha256, u64)> = None;
    let (mut n, mut first, mut last, mut last_hash) = (0_u64, 0_i64, 0_i64, String::new());
    // The scan reaches the previous checkpoint's bound even when `limit`
    // (the shipping cursor) is below it: the survivors' digest covers
    // every event held at or below the new `pruned_through`.
    let mut stmt = conn.prepare(
        "SELECT seq, at, tree, kind, data, prev_hash, hash FROM events WHERE seq <= ?1 ORDER BY seq",
    )?;
    let mut rows = stmt.query([limit.max(prev_p)])?;
    while let Some(row) = rows.next()? {
        let seq: i64 = row.get(0)?;
        let at: String = row.get(1)?;
        let tree: Option<i64> = row.get(2)?;
        let hash: String = row.get(6)?;
        if seq > prev_p && kept_at_prev.is_none() {
            kept_at_prev = Some((kept.clone(), kept_n));
        }
        // Seals are never pruned (migration 0007): their epochs must stay
        // consecutive from the setup.
        let goes = seq <= limit
            && match tree {
                Some(t) => set.contains(&t),
                None => {
                    at.as_str() < before
                        && RowKind::parse(&row.get::<_, String>(3)?) != EventKind::LedgerSeal
                }
            };
        if goes {
            if let Some(sink) = archive.as_mut() {
                sink(&super::read::event_from_row(row)?)?;
            }
            if n == 0 {
                first = seq;
            }
            n += 1;
            last = seq;
            pruned.update(hash.as_bytes());
            last_hash = hash;
            kept_at_last = Some((kept.clone(), kept_n));
        } else {
            kept.update(hash.as_bytes());
            kept_n += 1;
        }
    }
    if n == 0 {
        return Ok(None);
    }
    let kept_at_prev = kept_at_prev.unwrap_or((kept, kept_n));
    let ((kept_digest, kept_count), pruned_through, hash) = if last > prev_p {
        (kept_at_last.unwrap_or_default(), last, last_hash)
    } else {
        (kept_at_prev, prev_p, prev_hash)
    };
    Ok(Some(Plan {
        limit,
        before: before.to_string(),
        trees,
        events: n,
        first,
        last,
        digest: hex::encode(pruned.finalize()),
        pruned_through,
        hash,
        kept: kept_count,
        kept_digest: hex::encode(kept_digest.finalize()),
        previous: previous.map(|c| c.seq),
    }))
}

/// Writes the archive (a new file) from a plan made in the same snapshot,
/// fsyncs it and its directory. On failure the file is removed.
fn write_archive(
    conn: &Connection,
    path: &Path,
    before: &str,
    keep: &HashSet<i64>,
) -> Result<Option<Plan>, LedgerError> {
    use super::fsmode::Mode as _;
    let io = |what: &str, e: std::io::Error| {
        let msg = format!("archive {}: {what}: {e}", path.display());
        if e.kind() == std::io::ErrorKind::StorageFull {
            LedgerError::Full(msg)
        } else {
            LedgerError::Other(msg)
        }
    };
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| io("cannot create", e))?;
    let result = (|| {
        let mut out = std::io::BufWriter::with_capacity(256 * 1024, &file);
        let mut sink = |row: &EventRow| -> Result<(), LedgerError> {
            let line =
                serde_json::to_vec(row).map_err(|e| LedgerError::Other(format!("archive: {e}")))?;
            out.write_all(&line)
                .and_then(|()| out.write_all(b"\n"))
                .map_err(|e| io("cannot write", e))
        };
        let planned = plan(conn, before, keep, None, Some(&mut sink))
            .map_err(|f| f.into_ledger(std::time::Duration::ZERO))?;
        out.flush().map_err(|e| io("cannot write", e))?;
        drop(out);
        file.sync_all().map_err(|e| io("cannot fsync", e))?;
        let dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| io("cannot fsync its directory", e))?;
        Ok(planned)
    })();
    if result.as_ref().map_or(true, Option::is_none) {
        // Failed, or nothing to prune: no archive is left behind.
        let _ = std::fs::remove_file(path);
    }
    result
}

/// Phase 1, on a read snapshot: the plan, and the archive written.
pub(crate) fn prepare(conn: &Connection, req: &PruneRequest) -> Result<Option<Plan>, LedgerError> {
    let before = super::timestamp(req.before);
    let keep: HashSet<i64> = req.keep.iter().map(|t| t.0).collect();
    match &req.archive {
        Some(path) => write_archive(conn, path, &before, &keep),
        None => plan(conn, &before, &keep, None, None)
            .map_err(|f| f.into_ledger(std::time::Duration::ZERO)),
    }
}

/// Phase 2, inside the write transaction: the same plan again, the
/// checkpoint, the deletes.
pub(crate) fn commit(
    w: &mut Writer<'_>,
    req: &PruneRequest,
    planned: &Plan,
) -> Result<PruneReport, Fail> {
    let keep: HashSet<i64> = req.keep.iter().map(|t| t.0).collect();
    let now = plan(w.tx, &planned.before, &keep, Some(planned.limit), None)?;
    if now.as_ref() != Some(planned) {
        return Err(LedgerError::Other(
            "the ledger changed between the archive and the delete (a tree it covers got a new event); nothing was deleted"
                .into(),
        )
        .into());
    }
    let data = Checkpointed {
        before: planned.before.clone(),
        pruned_through: planned.pruned_through,
        hash: planned.hash.clone(),
        pruned: PrunedEvents {
            events: planned.events,
            trees: planned.trees.len() as u64,
            first: planned.first,
            last: planned.last,
            digest: planned.digest.clone(),
        },
        kept_below: KeptEvents {
            events: planned.kept,
            digest: planned.kept_digest.clone(),
        },
        archive: req
            .archive
            .as_ref()
            .and_then(|p| p.file_name())
            .map(|n| n.to_string_lossy().into_owned()),
        previous: planned.previous,
    };
    let checkpoint = w.event(None, &Event::LedgerCheckpoint(Box::new(data)))?;
    w.tx.execute_batch(
        "CREATE TEMP TABLE IF NOT EXISTS prune_trees (id INTEGER PRIMARY KEY);
         DELETE FROM temp.prune_trees;",
    )?;
    {
        let mut insert =
            w.tx.prepare("INSERT INTO temp.prune_trees (id) VALUES (?1)")?;
        for id in &planned.trees {
            insert.execute([id])?;
        }
    }
    let deleted = w.tx.execute(
        "DELETE FROM events WHERE seq <= ?1
           AND (tree IN (SELECT id FROM temp.prune_trees)
                OR (tree IS NULL AND at < ?2 AND kind <> 'ledger.seal'))",
        params![planned.limit, planned.before],
    )?;
    if deleted as u64 != planned.events {
        return Err(LedgerError::Other(format!(
            "prune deleted {deleted} events, planned {}; nothing was deleted",
            planned.events
        ))
        .into());
    }
    w.tx.execute_batch(
        "DELETE FROM signals WHERE tree_id IN (SELECT id FROM temp.prune_trees);
         DELETE FROM kill_authorizations WHERE tree_id IN (SELECT id FROM temp.prune_trees);
         DELETE FROM observations WHERE tree_id IN (SELECT id FROM temp.prune_trees);
         DELETE FROM members WHERE tree_id IN (SELECT id FROM temp.prune_trees);
         DELETE FROM scans WHERE tree_id IN (SELECT id FROM temp.prune_trees);",
    )?;
    w.tx.execute(
        "DELETE FROM scans WHERE tree_id IS NULL AND at < ?1",
        [&planned.before],
    )?;
    let trees = w.tx.execute(
        "DELETE FROM trees WHERE id IN (SELECT id FROM temp.prune_trees)",
        [],
    )?;
    w.tx.execute_batch("DELETE FROM temp.prune_trees;")?;
    Ok(PruneReport {
        checkpoint: Some(checkpoint),
        events: planned.events,
        trees: trees as u64,
        pruned_through: planned.pruned_through,
        kept_below: planned.kept,
        archive: req.archive.clone(),
        pruned_trees: planned.trees.clone(),
    })
}

/// An archive's events, checked on their own and against the ledger:
/// each hash recomputes from its line; consecutive lines link; the set's
/// digest is the `pruned` digest of a checkpoint (in the ledger, or in one
/// of `others`, archives that are themselves checked); each event links to
/// its neighbours still in the ledger; the checkpoint's `hash` is the
/// archived event at its `pruned_through`.
pub(crate) fn verify_archives(
    conn: &Connection,
    paths: &[PathBuf],
) -> Result<Vec<(PathBuf, VerifyReport, Option<i64>)>, Fail> {
    // Checkpoints the archives may match: the ledger's, and those archived.
    let mut checkpoints: Vec<Checkpoint> = Vec::new();
    {
        let mut stmt = conn.prepare(
            "SELECT seq, data FROM events WHERE kind = 'ledger.checkpoint' ORDER BY seq",
        )?;
        let mut rows = stmt.query([])?;
        while let Some(row) = rows.next()? {
            let seq: i64 = row.get(0)?;
            let text: String = row.get(1)?;
            if let Some(cp) = serde_json::from_str(&text)
                .ok()
                .and_then(|d| Checkpoint::from_data(seq, &d))
            {
                checkpoints.push(cp);
            }
        }
    }
    let mut scanned = Vec::new();
    for path in paths {
        let scan = scan_archive(conn, path)?;
        checkpoints.extend(scan.checkpoints.iter().cloned());
        scanned.push((path.clone(), scan));
    }
    let mut out = Vec::new();
    for (path, scan) in scanned {
        let mut report = VerifyReport {
            events: scan.events,
            head: scan.last.clone(),
            integrity_ok: true,
            first_break: scan.first_break.clone(),
            ..VerifyReport::default()
        };
        let mut matched = None;
        if report.first_break.is_none() {
            match checkpoints
                .iter()
                .find(|c| c.pruned_digest == scan.digest && c.pruned_events == scan.events)
            {
                None => {
                    report.first_break = Some(VerifyBreak {
                        seq: None,
                        what: format!(
                            "{}: its {} events are not what any checkpoint pruned (digest {})",
                            path.display(),
                            scan.events,
                            scan.digest
                        ),
                    })
                }
                Some(cp) => {
                    matched = Some(cp.seq);
                    if let Some(h) = scan.hash_at(cp.pruned_through)
                        && h != cp.hash
                    {
                        report.first_break = Some(VerifyBreak {
                            seq: Some(cp.pruned_through),
                            what: "the archived event at the checkpoint's pruned_through has another hash".into(),
                        });
                    }
                }
            }
        }
        report.checkpoint = matched;
        out.push((path, report, matched));
    }
    Ok(out)
}

struct ArchiveScan {
    events: u64,
    last: Option<(i64, String)>,
    digest: String,
    checkpoints: Vec<Checkpoint>,
    first_break: Option<VerifyBreak>,
}

impl ArchiveScan {
    /// The archived hash at `seq`, if it is the archive's last event (a
    /// checkpoint's `pruned_through` is the last event its prune removed,
    /// or an earlier prune's bound, which this archive does not hold).
    fn hash_at(&self, seq: i64) -> Option<&str> {
        self.last
            .as_ref()
            .filter(|(s, _)| *s == seq)
            .map(|(_, h)| h.as_str())
    }
}

// Over 100 lines on purpose: one pass over an archive file, each line checked (order, chain,
// trailer) as it is read, with the pass's state local to it.
fn scan_archive(conn: &Connection, path: &Path) -> Result<ArchiveScan, Fail> {
    let mut scan = ArchiveScan {
        events: 0,
        last: None,
        digest: String::new(),
        checkpoints: Vec::new(),
        first_break: None,
    };
    let file = std::fs::File::open(path)
        .map_err(|e| LedgerError::NotFound(format!("archive {}: {e}", path.display())))?;
    let mut digest = Sha256::new();
    let mut ledger_hash = conn.prepare("SELECT hash, prev_hash FROM events WHERE seq = ?1")?;
    let broke = |seq: Option<i64>, what: String| {
        Some(VerifyBreak {
            seq,
            what: format!("archive {}: {what}", path.display()),
        })
    };
    for (lineno, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line =
            line.map_err(|e| LedgerError::Other(format!("archive {}: {e}", path.display())))?;
        if line.trim().is_empty() {
            continue;
        }
        let e: EventRow = match serde_json::from_str(&line) {
            Ok(e) => e,
            Err(err) => {
                scan.first_break =
                    broke(None, format!("line {} is not an event: {err}", lineno + 1));
                return Ok(scan);
            }
        };
        if !e.data.is_object() {
            scan.first_break = broke(Some(e.seq), "data is not an object".into());
            return Ok(scan);
        }
        let hash = e.recomputed_hash();
        if hash != e.hash {
            scan.first_break = broke(
                Some(e.seq),
                "hash does not match the recomputed hash (content edited)".into(),
            );
            return Ok(scan);
        }
        match &scan.last {
            Some((s, _)) if e.seq <= *s => {
                scan.first_break =
                    broke(Some(e.seq), format!("seq {} after {s} (reordered)", e.seq));
                return Ok(scan);
            }
            Some((s, h)) if e.seq == s + 1 && &e.prev_hash != h => {
                scan.first_break = broke(
                    Some(e.seq),
                    "prev_hash does not match the previous line's hash".into(),
                );
                return Ok(scan);
            }
            _ => {}
        }
        if e.seq == 1 && e.prev_hash != chain::GENESIS {
            scan.first_break = broke(
                Some(1),
                "the first event does not start from the genesis hash".into(),
            );
            return Ok(scan);
        }
        // Neighbours still in the ledger.
        let before: Option<(String, String)> = ledger_hash
            .query_row([e.seq - 1], |r| Ok((r.get(0)?, r.get(1)?)))
            .optional()?;
        if let Some((h, _)) = before
            && h != e.prev_hash
        {
            scan.first_break = broke(
                Some(e.seq),
                format!("prev_hash does not match the ledger's event {}", e.seq - 1),
            );
            return Ok(scan);
        }
        let after: Option<(String, String)> = ledger_hash
            .query_row([e.seq + 1], |r| Ok((r.get(0)?, r.get(1)?)))
            .optional()?;
        if let Some((_, prev)) = after
            && prev != e.hash
        {
            scan.first_break = broke(
                Some(e.seq),
                format!("the ledger's event {} does not chain from it", e.seq + 1),
            );
            return Ok(scan);
        }
        if e.kind == EventKind::LedgerCheckpoint
            && let Some(cp) = Checkpoint::from_data(e.seq, &e.data)
        {
            scan.checkpoints.push(cp);
        }
        digest.update(e.hash.as_bytes());
        scan.events += 1;
        scan.last = Some((e.seq, e.hash));
    }
    scan.digest = hex::encode(digest.finalize());
    Ok(scan)
}
