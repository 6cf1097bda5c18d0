//! The fleet's index (`treewarden fleet serve`): what hosts shipped to
//! JetStream, as the fleet's consumer received it, in an embedded SQLite
//! file of its own (`fleet.db` under `fleet --data`). It lives here because
//! only `ledger/` knows SQL; it is never a host's ledger and holds no chain
//! of its own: the stream is the record, this index is rebuildable from it
//! (`fleet rebuild`), and every verdict it stores was computed by the
//! ledger's own walk (`service::nats::verify_host`).
//!
//! Several `fleet serve` sharing one durable consumer share this file
//! (WAL, a busy timeout): a message is stored once by its stream sequence,
//! whichever instance received it.

use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use rusqlite::{Connection, OptionalExtension, params};

use super::error::LedgerError;
use super::read::unsigned;

/// The index's file name under `--data`.
pub const FILE: &str = "fleet.db";

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS hosts (
  host TEXT PRIMARY KEY,
  -- 'key' (HMAC verification key) or 'pub' (root public key)
  material TEXT NOT NULL,
  value TEXT NOT NULL,
  added_at TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
  stream_seq INTEGER PRIMARY KEY,
  host TEXT NOT NULL,
  seq INTEGER,
  at TEXT,
  kind TEXT,
  tree INTEGER,
  -- ambiguous | force-kill | orphan | unkillable (what the dashboard lists)
  notable TEXT,
  msg_id TEXT,
  ce_id TEXT,
  body BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS events_by_host ON events(host, stream_seq);
CREATE INDEX IF NOT EXISTS events_notable ON events(notable, at) WHERE notable IS NOT NULL;
CREATE TABLE IF NOT EXISTS verdicts (
  host TEXT PRIMARY KEY,
  through_stream_seq INTEGER NOT NULL,
  events INTEGER NOT NULL,
  head_seq INTEGER,
  last_at TEXT,
  ok INTEGER NOT NULL,
  why TEXT,
  break_seq INTEGER,
  seal_made_at TEXT,
  checked_at TEXT NOT NULL
);
";

/// A host's registered verification material.
#[derive(Clone, Debug, serde::Serialize)]
pub struct HostMaterial {
    pub host: String,
    /// `key` (an HMAC verification key) or `pub` (a root public key).
    pub material: String,
    /// The public key, or for `key` the key file's path under `--data`.
    pub value: String,
    pub added_at: String,
}

/// One message as the consumer received it.
#[derive(Clone, Debug)]
pub struct FleetMessage {
    pub stream_seq: u64,
    pub host: String,
    pub msg_id: Option<String>,
    pub ce_id: Option<String>,
    pub body: Vec<u8>,
}

/// A message read back for a walk.
pub type StoredMessage = FleetMessage;

/// A host's latest verdict, as `fleet serve` computed it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Verdict {
    pub host: String,
    /// The walk covered the host's messages up to this stream sequence.
    pub through_stream_seq: u64,
    pub events: u64,
    pub head_seq: Option<i64>,
    pub last_at: Option<String>,
    pub ok: bool,
    /// The first break, as the walk named it.
    pub why: Option<String>,
    pub break_seq: Option<i64>,
    pub seal_made_at: Option<String>,
    pub checked_at: String,
}

/// A notable event across hosts (the dashboard's second table).
#[derive(Clone, Debug, serde::Serialize)]
pub struct Notable {
    pub host: String,
    pub seq: Option<i64>,
    pub at: Option<String>,
    pub tree: Option<i64>,
    pub notable: String,
    pub kind: String,
}

/// One indexed event of a tree (the tree's page).
#[derive(Clone, Debug)]
pub struct IndexedEvent {
    pub stream_seq: u64,
    pub body: Vec<u8>,
}

/// What the dashboard's notable list is filtered by.
#[derive(Clone, Debug, Default)]
pub struct NotableFilter {
    pub host: Option<String>,
    pub notable: Option<String>,
    /// RFC 3339; events at or after it.
    pub since: Option<String>,
    pub limit: usize,
}

/// The index: one connection, behind a lock (its callers are a consumer
/// loop and a few page handlers).
pub struct FleetIndex {
    conn: Mutex<Connection>,
    /// `--data`: HMAC verification keys live in `keys/HOST.key` under it.
    dir: std::path::PathBuf,
}

fn fail(e: rusqlite::Error) -> LedgerError {
    LedgerError::Other(format!("fleet index: {e}"))
}

/// What the dashboard lists of an event, from its kind and data.
pub fn notable_of(kind: &str, data: &serde_json::Value) -> Option<&'static str> {
    match kind {
        "kill.authorized" => Some("force-kill"),
        "sweep.orphan_found" => Some("orphan"),
        "member.unkillable" => Some("unkillable"),
        "tree.state" if data["to"] == "ambiguous" => Some("ambiguous"),
        _ => None,
    }
}

fn now() -> String {
    humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string()
}

impl FleetIndex {
    /// Opens (making, where absent) `dir/fleet.db`, readable by its owner only.
    pub fn open(dir: &Path) -> Result<FleetIndex, LedgerError> {
        std::fs::create_dir_all(dir)
            .map_err(|e| LedgerError::Other(format!("{}: {e}", dir.display())))?;
        let path = dir.join(FILE);
        {
            // Made readable by its owner only: it holds verification keys.
            use super::fsmode::Mode as _;
            std::fs::OpenOptions::new()
                .append(true)
                .create(true)
                .mode(0o600)
                .open(&path)
                .map_err(|e| LedgerError::Other(format!("{}: {e}", path.display())))?;
        }
        let conn = Connection::open(&path).map_err(fail)?;
        conn.busy_timeout(Duration::from_secs(10)).map_err(fail)?;
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(fail)?;
        conn.pragma_update(None, "synchronous", "NORMAL")
            .map_err(fail)?;
        conn.execute_batch(SCHEMA).map_err(fail)?;
        Ok(FleetIndex {
            conn: Mutex::new(conn),
            dir: dir.to_path_buf(),
        })
    }

    /// Every row `sql` answers for `params`, each read by `f`, in order.
    fn all<T>(
        &self,
        sql: &str,
        params: impl rusqlite::Params,
        f: impl FnMut(&rusqlite::Row<'_>) -> rusqlite::Result<T>,
    ) -> Result<Vec<T>, LedgerError> {
        let conn = self.conn();
        let mut stmt = conn.prepare(sql).map_err(fail)?;
        let rows = stmt.query_map(params, f).map_err(fail)?;
        rows.collect::<Result<_, _>>().map_err(fail)
    }

    fn conn(&self) -> std::sync::MutexGuard<'_, Connection> {
        self.conn
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Registers (or replaces) a host's verification material. A public
    /// key is stored in the row; an HMAC verification key (it can make
    /// seals, not only check them) never enters SQLite: it is written to
    /// `keys/HOST.key` (owner-only) and the row names the file.
    pub fn add_host(&self, host: &str, material: &str, value: &str) -> Result<(), LedgerError> {
        let value = if material == "key" {
            let keys = self.dir.join("keys");
            let io = |e: std::io::Error| LedgerError::Other(format!("{}: {e}", keys.display()));
            std::fs::create_dir_all(&keys).map_err(io)?;
            let name = format!("keys/{host}.key");
            let path = self.dir.join(&name);
            let _ = std::fs::remove_file(&path);
            use super::fsmode::Mode as _;
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)
                .map_err(io)?;
            std::io::Write::write_all(&mut f, format!("{value}\n").as_bytes()).map_err(io)?;
            f.sync_all().map_err(io)?;
            name
        } else {
            value.to_string()
        };
        self.conn()
            .execute(
                "INSERT INTO hosts (host, material, value, added_at) VALUES (?1, ?2, ?3, ?4)
                 ON CONFLICT(host) DO UPDATE SET material = ?2, value = ?3, added_at = ?4",
                params![host, material, value, now()],
            )
            .map_err(fail)?;
        // The verdict was computed with other material: computed again.
        self.conn()
            .execute("DELETE FROM verdicts WHERE host = ?1", [host])
            .map_err(fail)?;
        Ok(())
    }

    pub fn hosts(&self) -> Result<Vec<HostMaterial>, LedgerError> {
        self.all(
            "SELECT host, material, value, added_at FROM hosts ORDER BY host",
            [],
            |r| {
                Ok(HostMaterial {
                    host: r.get(0)?,
                    material: r.get(1)?,
                    value: r.get(2)?,
                    added_at: r.get(3)?,
                })
            },
        )
    }

    pub fn host(&self, host: &str) -> Result<Option<HostMaterial>, LedgerError> {
        Ok(self.hosts()?.into_iter().find(|h| h.host == host))
    }

    /// The material itself: the public key, or the key file's content.
    pub fn material_value(&self, m: &HostMaterial) -> Result<String, LedgerError> {
        if m.material != "key" {
            return Ok(m.value.clone());
        }
        let path = self.dir.join(&m.value);
        std::fs::read_to_string(&path)
            .map(|s| s.trim().to_string())
            .map_err(|e| LedgerError::Other(format!("{}: {e}", path.display())))
    }

    /// Stores a batch in one transaction; returns how many were new to the
    /// index (a redelivered message is stored once, by its stream sequence).
    pub fn insert(&self, batch: &[FleetMessage]) -> Result<Vec<bool>, LedgerError> {
        let mut conn = self.conn();
        let tx = conn.transaction().map_err(fail)?;
        let mut fresh = Vec::with_capacity(batch.len());
        {
            let mut stmt = tx
                .prepare(
                    "INSERT OR IGNORE INTO events (stream_seq, host, seq, at, kind, tree, notable, msg_id, ce_id, body)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)",
                )
                .map_err(fail)?;
            for m in batch {
                let v: serde_json::Value =
                    serde_json::from_slice(&m.body).unwrap_or(serde_json::Value::Null);
                let kind = v["kind"].as_str().unwrap_or_default();
                let n = stmt
                    .execute(params![
                        i64::try_from(m.stream_seq).unwrap_or(i64::MAX),
                        m.host,
                        v["seq"].as_i64(),
                        v["at"].as_str(),
                        kind,
                        v["tree"].as_i64(),
                        notable_of(kind, &v["data"]),
                        m.msg_id,
                        m.ce_id,
                        m.body,
                    ])
                    .map_err(fail)?;
                fresh.push(n == 1);
            }
        }
        tx.commit().map_err(fail)?;
        Ok(fresh)
    }

    /// Hosts with messages at or below `floor` that their verdict has not
    /// covered yet (and hosts registered with no verdict).
    pub fn hosts_to_verify(&self, floor: u64) -> Result<Vec<String>, LedgerError> {
        self.all(
            "SELECT e.host FROM events e LEFT JOIN verdicts v ON v.host = e.host
                 WHERE e.stream_seq <= ?1
                 GROUP BY e.host
                 HAVING MAX(e.stream_seq) > COALESCE(MAX(v.through_stream_seq), 0)
                 ORDER BY e.host",
            [i64::try_from(floor).unwrap_or(i64::MAX)],
            |r| r.get(0),
        )
    }

    /// A host's messages, in stream order, at or below `floor` (and at or
    /// after `since`, RFC 3339, where given: the tree pages).
    pub fn messages(&self, host: &str, floor: u64) -> Result<Vec<FleetMessage>, LedgerError> {
        self.all(
            "SELECT stream_seq, msg_id, ce_id, body FROM events
                 WHERE host = ?1 AND stream_seq <= ?2 ORDER BY stream_seq",
            params![host, i64::try_from(floor).unwrap_or(i64::MAX)],
            |r| {
                Ok(FleetMessage {
                    stream_seq: unsigned(r, 0)?,
                    host: host.to_string(),
                    msg_id: r.get(1)?,
                    ce_id: r.get(2)?,
                    body: r.get(3)?,
                })
            },
        )
    }

    pub fn set_verdict(&self, v: &Verdict) -> Result<(), LedgerError> {
        self.conn()
            .execute(
                "INSERT OR REPLACE INTO verdicts
                 (host, through_stream_seq, events, head_seq, last_at, ok, why, break_seq, seal_made_at, checked_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)",
                params![
                    v.host,
                    i64::try_from(v.through_stream_seq).unwrap_or(i64::MAX),
                    i64::try_from(v.events).unwrap_or(i64::MAX),
                    v.head_seq,
                    v.last_at,
                    v.ok,
                    v.why,
                    v.break_seq,
                    v.seal_made_at,
                    v.checked_at,
                ],
            )
            .map_err(fail)?;
        Ok(())
    }

    /// Every host's verdict, with each host seen (indexed or registered)
    /// but not verified yet as `None`.
    pub fn verdicts(&self) -> Result<Vec<(String, Option<Verdict>)>, LedgerError> {
        self.all(
            "SELECT h.host, v.through_stream_seq, v.events, v.head_seq, v.last_at, v.ok, v.why,
                        v.break_seq, v.seal_made_at, v.checked_at
                 FROM (SELECT DISTINCT host FROM events UNION SELECT host FROM hosts) h
                 LEFT JOIN verdicts v ON v.host = h.host ORDER BY h.host",
            [],
            |r| {
                let host: String = r.get(0)?;
                let through: Option<i64> = r.get(1)?;
                Ok(match through {
                    None => (host, None),
                    Some(t) => (
                        host.clone(),
                        Some(Verdict {
                            host,
                            through_stream_seq: u64::try_from(t).unwrap_or(0),
                            events: unsigned(r, 2)?,
                            head_seq: r.get(3)?,
                            last_at: r.get(4)?,
                            ok: r.get(5)?,
                            why: r.get(6)?,
                            break_seq: r.get(7)?,
                            seal_made_at: r.get(8)?,
                            checked_at: r.get(9)?,
                        }),
                    ),
                })
            },
        )
    }

    /// Messages indexed per host.
    pub fn counts(&self) -> Result<Vec<(String, u64, Option<String>)>, LedgerError> {
        self.all(
            "SELECT host, COUNT(*), MAX(at) FROM events GROUP BY host ORDER BY host",
            [],
            |r| Ok((r.get(0)?, unsigned(r, 1)?, r.get(2)?)),
        )
    }

    /// Notable events across hosts, newest first.
    pub fn notables(&self, f: &NotableFilter) -> Result<Vec<Notable>, LedgerError> {
        self.all(
            "SELECT host, seq, at, tree, notable, kind FROM events
                 WHERE notable IS NOT NULL
                   AND (?1 IS NULL OR host = ?1)
                   AND (?2 IS NULL OR notable = ?2)
                   AND (?3 IS NULL OR at >= ?3)
                 ORDER BY at DESC, stream_seq DESC LIMIT ?4",
            params![
                f.host,
                f.notable,
                f.since,
                i64::try_from(f.limit).unwrap_or(i64::MAX)
            ],
            |r| {
                Ok(Notable {
                    host: r.get(0)?,
                    seq: r.get(1)?,
                    at: r.get(2)?,
                    tree: r.get(3)?,
                    notable: r.get(4)?,
                    kind: r.get(5)?,
                })
            },
        )
    }

    /// One tree's events as a host shipped them, in stream order.
    pub fn tree_events(&self, host: &str, tree: i64) -> Result<Vec<IndexedEvent>, LedgerError> {
        self.all(
            "SELECT stream_seq, body FROM events WHERE host = ?1 AND tree = ?2 ORDER BY stream_seq",
            params![host, tree],
            |r| {
                Ok(IndexedEvent {
                    stream_seq: unsigned(r, 0)?,
                    body: r.get(1)?,
                })
            },
        )
    }

    /// The number of messages indexed, all hosts.
    pub fn total(&self) -> Result<u64, LedgerError> {
        let n: i64 = self
            .conn()
            .query_row("SELECT COUNT(*) FROM events", [], |r| r.get(0))
            .map_err(fail)?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    /// The highest stream sequence indexed.
    pub fn last_stream_seq(&self) -> Result<u64, LedgerError> {
        let n: Option<i64> = self
            .conn()
            .query_row("SELECT MAX(stream_seq) FROM events", [], |r| r.get(0))
            .optional()
            .map_err(fail)?
            .flatten();
        Ok(n.and_then(|n| u64::try_from(n).ok()).unwrap_or(0))
    }

    /// `fleet rebuild`: forgets every message and verdict (the registered
    /// hosts stay), so the next consumer re-reads the stream from its first.
    pub fn clear(&self) -> Result<(), LedgerError> {
        self.conn()
            .execute_batch("DELETE FROM events; DELETE FROM verdicts;")
            .map_err(fail)
    }
}
