//! `verify`: SQLite's own integrity check, then the whole hash chain
//! recomputed, then the authority rule (every SIGKILL preceded by its
//! authorization), then the expected head. Stops at the first break.

use std::collections::HashMap;

use rusqlite::Connection;

use sha2::{Digest, Sha256};

use super::chain;
use super::error::Fail;
use super::prune;
use super::types::{VerifyBreak, VerifyReport};

fn broke(seq: Option<i64>, what: impl Into<String>) -> Option<VerifyBreak> {
    Some(VerifyBreak {
        seq,
        what: what.into(),
    })
}

pub(crate) fn verify(
    conn: &Connection,
    expect_head: Option<(i64, String)>,
) -> Result<VerifyReport, Fail> {
    let mut report = VerifyReport {
        events: 0,
        head: None,
        integrity_ok: false,
        first_break: None,
        checkpoint: None,
    };

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
        return Ok(report);
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
        return Ok(report);
    }

    if let Some(found) = walk_chain(conn, &mut report)? {
        report.first_break = Some(found);
        return Ok(report);
    }

    if let Some(found) = check_signal_rows(conn)? {
        report.first_break = Some(found);
        return Ok(report);
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
    Ok(report)
}

/// Walks every event in seq order. Returns the first break.
///
/// Without a checkpoint the chain is whole from seq 1 (prev_hash the
/// genesis). With one (the newest `ledger.checkpoint`, see `prune.rs`),
/// events at or below its `pruned_through` P are the survivors of pruning:
/// each must still prove its content, adjacent ones must link, and their
/// count and digest must be what the checkpoint recorded; above P the
/// chain is whole again, starting at P + 1 from the checkpoint's `hash`.
fn walk_chain(conn: &Connection, report: &mut VerifyReport) -> Result<Option<VerifyBreak>, Fail> {
    let checkpoint = match prune::latest_checkpoint(conn)? {
        Ok(cp) => cp,
        Err(found) => return Ok(Some(found)),
    };
    report.checkpoint = checkpoint.as_ref().map(|c| c.seq);
    let (boundary, boundary_hash) = checkpoint
        .as_ref()
        .map_or((0, chain::GENESIS.to_string()), |c| {
            (c.pruned_through, c.hash.clone())
        });
    let mut kept = Sha256::new();
    let mut kept_n = 0_u64;
    let mut stmt =
        conn.prepare("SELECT seq, at, tree, kind, data, prev_hash, hash FROM events ORDER BY seq")?;
    let mut rows = stmt.query([])?;
    // The previous event walked (seq, hash).
    let mut prev: Option<(i64, String)> = None;
    // kill.authorized events seen so far: authorization id -> tree.
    let mut authorized: HashMap<i64, Option<i64>> = HashMap::new();
    while let Some(row) = rows.next()? {
        let seq: i64 = row.get(0)?;
        let at: String = row.get(1)?;
        let tree: Option<i64> = row.get(2)?;
        let kind: String = row.get(3)?;
        let data_text: String = row.get(4)?;
        let stored_prev: String = row.get(5)?;
        let stored_hash: String = row.get(6)?;

        if seq <= boundary {
            // A survivor of pruning: linked where its predecessor survived too.
            let linked_to = match &prev {
                Some((p, h)) if *p == seq - 1 => Some(h.as_str()),
                _ if seq == 1 => Some(chain::GENESIS),
                _ => None,
            };
            if linked_to.is_some_and(|h| h != stored_prev) {
                return Ok(broke(
                    Some(seq),
                    "prev_hash does not match the previous event's hash (reordered or replaced)",
                ));
            }
            kept.update(stored_hash.as_bytes());
            kept_n += 1;
        } else {
            let (expected_seq, expected_prev) = match &prev {
                Some((p, h)) if *p > boundary => (p + 1, h.as_str()),
                _ => (boundary + 1, boundary_hash.as_str()),
            };
            if seq != expected_seq {
                return Ok(broke(
                    Some(expected_seq),
                    format!("event {expected_seq} is missing (the next stored event is {seq})"),
                ));
            }
            if stored_prev != expected_prev {
                let what = if expected_seq == boundary + 1 && boundary > 0 {
                    "prev_hash does not match the checkpoint's hash of the last pruned event"
                } else {
                    "prev_hash does not match the previous event's hash (reordered or replaced)"
                };
                return Ok(broke(Some(seq), what));
            }
        }
        let data: serde_json::Value = match serde_json::from_str(&data_text) {
            Ok(data) => data,
            Err(e) => return Ok(broke(Some(seq), format!("data is not JSON: {e}"))),
        };
        if chain::canonical_string(&data) != data_text {
            return Ok(broke(Some(seq), "data is not in canonical form (edited)"));
        }
        // The text is canonical (checked above): hash it as it is stored.
        let hash = chain::event_hash_of_text(&stored_prev, seq, &at, tree, &kind, &data_text);
        if hash != stored_hash {
            return Ok(broke(
                Some(seq),
                "hash does not match the recomputed hash (content edited)",
            ));
        }

        match kind.as_str() {
            "kill.authorized" => {
                if let Some(id) = data.get("authorization").and_then(|v| v.as_i64()) {
                    authorized.insert(id, tree);
                }
            }
            "signal.sent" if data.get("signal").and_then(|v| v.as_str()) == Some("SIGKILL") => {
                let auth = data.get("authorization").and_then(|v| v.as_i64());
                match auth.and_then(|a| authorized.get(&a)) {
                    Some(auth_tree) if *auth_tree == tree => {}
                    Some(_) => {
                        return Ok(broke(
                            Some(seq),
                            "SIGKILL cites an authorization of another tree",
                        ));
                    }
                    None => {
                        return Ok(broke(
                            Some(seq),
                            "SIGKILL without an earlier kill.authorized event",
                        ));
                    }
                }
            }
            _ => {}
        }

        report.events += 1;
        report.head = Some((seq, stored_hash.clone()));
        prev = Some((seq, stored_hash));
    }
    if let Some(cp) = &checkpoint {
        let digest = hex::encode(kept.finalize());
        if kept_n != cp.kept_events || digest != cp.kept_digest {
            return Ok(broke(
                Some(cp.seq),
                format!(
                    "the {kept_n} events held at or below the checkpoint's pruned_through {} are not the {} it recorded (removed, added or edited)",
                    cp.pruned_through, cp.kept_events
                ),
            ));
        }
    }
    Ok(None)
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
