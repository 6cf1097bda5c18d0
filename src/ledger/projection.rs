//! `verify`'s projection check: the tables readers are shown (`trees`,
//! `owners`, `members`, `observations`, `signals`, `kill_authorizations`)
//! replayed from the chained events, tree by tree, and compared field by
//! field with what is stored. The hash chain proves the events; this proves
//! that every row a reader sees is what those events made, and that no
//! event's row is missing or extra.
//!
//! The rows are a projection of the events (every writer in `write.rs`
//! changes a row and appends the event that says so in one transaction), so
//! replaying the events gives each row exactly. Fields no event carries are
//! bookkeeping and are not shown as evidence: `members.last_seen` (bumped on
//! every sighting), `trees.evidence_bytes` and `trees.flags`, `scans`,
//! `owners.created_at`.
//!
//! One tree at a time, through the `events (tree, seq)` index: memory is
//! bounded by the largest tree, not the ledger.

use std::collections::BTreeMap;

use rusqlite::Connection;
use rusqlite::types::ValueRef;
use serde_json::{Value, json};

use super::error::Fail;
use super::event::{Event, RowKind};
use super::types::{IdentityRecord, TreeState, VerifyBreak};

/// A row as replayed: its fields in a fixed order, each with the seq of the
/// event that last set it.
#[derive(Default)]
struct Row {
    fields: BTreeMap<&'static str, (Value, i64)>,
}

impl Row {
    fn set(&mut self, field: &'static str, v: Value, seq: i64) {
        self.fields.insert(field, (v, seq));
    }
}

type Key = (i64, i64, String);

fn key(i: &IdentityRecord) -> Key {
    (
        i64::from(i.pid),
        i64::try_from(i.start_ticks).unwrap_or(i64::MAX),
        i.boot_id.clone(),
    )
}

/// What one tree's events say its rows are.
#[derive(Default)]
struct Replay {
    tree: Option<Row>,
    owner: Option<(i64, Row)>,
    members: BTreeMap<Key, Row>,
    /// (kind, identity) → the observation row; survivors are a list.
    observations: BTreeMap<(String, Key), Row>,
    survivors: Vec<(Key, String, Value, i64)>,
    signals: BTreeMap<i64, Row>,
    authorizations: BTreeMap<i64, Row>,
    first_seq: i64,
}

fn opt<T: serde::Serialize>(v: &Option<T>) -> Value {
    v.as_ref().map_or(Value::Null, |x| json!(x))
}

impl Replay {
    fn member_seen(&mut self, seq: i64, at: &str, m: &super::event::MemberSeen) {
        self.members.entry(key(&m.identity)).or_insert_with(|| {
            let mut r = Row::default();
            r.set("ppid", json!(m.ppid), seq);
            r.set("pgid", json!(m.pgid), seq);
            r.set("sid", json!(m.sid), seq);
            r.set("cgroup", opt(&m.cgroup), seq);
            r.set("uid", opt(&m.uid), seq);
            r.set("exe", opt(&m.exe), seq);
            r.set("cmdline", json!(m.cmdline), seq);
            r.set("cwd", opt(&m.cwd), seq);
            r.set("first_seen", json!(at), seq);
            r.set("escaped_at", Value::Null, seq);
            r.set("exited_at", Value::Null, seq);
            r.set("exit_code", Value::Null, seq);
            r.set("exit_signal", Value::Null, seq);
            r
        });
    }

    fn state(&mut self, seq: i64, to: TreeState) {
        if let Some(t) = self.tree.as_mut() {
            t.set("state", json!(to.as_str()), seq);
        }
    }

    /// Applies one event. `Err` names an event that cannot be placed (a
    /// kind this build writes, in a shape it cannot read).
    // Over 100 lines on purpose: one arm per event kind, each setting the rows that kind writes:
    // the arms together are the table of what the chain binds, read best in one place.
    fn apply(&mut self, seq: i64, at: &str, event: &Event) -> Result<(), String> {
        match event {
            Event::TreeCreated(c) => {
                let mut r = Row::default();
                r.set("label", opt(&c.label), seq);
                r.set("state", json!("spawning"), seq);
                r.set("boundary", json!(c.boundary), seq);
                r.set("owner_id", json!(c.owner.id), seq);
                r.set("argv", json!(c.argv), seq);
                r.set("cwd", opt(&c.cwd), seq);
                for f in [
                    "root_pid",
                    "root_start_ticks",
                    "boot_id",
                    "pgid",
                    "sid",
                    "cgroup",
                    "ended_at",
                    "exit_code",
                    "exit_signal",
                    "note",
                ] {
                    r.set(f, Value::Null, seq);
                }
                r.set("created_at", json!(at), seq);
                r.set("grace_ms", opt(&c.grace_ms), seq);
                r.set("timeout_ms", opt(&c.timeout_ms), seq);
                r.set("first_signal", opt(&c.first_signal), seq);
                r.set(
                    "requester_uid",
                    c.by.as_ref()
                        .and_then(|b| b.uid)
                        .map_or(Value::Null, |u| json!(u)),
                    seq,
                );
                r.set("requested_by", opt(&c.by), seq);
                r.set("run_uid", opt(&c.run_uid), seq);
                r.set("run_gid", opt(&c.run_gid), seq);
                self.tree = Some(r);
                let mut o = Row::default();
                o.set("pid", json!(c.owner.pid), seq);
                o.set("start_ticks", json!(c.owner.start), seq);
                o.set("kind", json!(c.owner.kind), seq);
                self.owner = Some((c.owner.id.0, o));
            }
            Event::TreeSpawned(s) => {
                if let Some(t) = self.tree.as_mut() {
                    t.set("state", json!("running"), seq);
                    t.set("root_pid", json!(s.root.pid), seq);
                    t.set("root_start_ticks", json!(key(&s.root).1), seq);
                    t.set("boot_id", json!(s.root.boot_id), seq);
                    t.set("pgid", json!(s.pgid), seq);
                    t.set("sid", json!(s.sid), seq);
                    t.set("cgroup", opt(&s.cgroup), seq);
                }
            }
            Event::TreeSpawnFailed(f) => {
                if let Some(t) = self.tree.as_mut() {
                    t.set("state", json!("spawn_failed"), seq);
                    t.set("ended_at", json!(at), seq);
                    t.set("exit_code", json!(f.exit_code), seq);
                    t.set("note", json!(f.reason), seq);
                }
            }
            Event::TreeState(s) => {
                self.state(seq, s.to);
                if s.to == TreeState::Ambiguous
                    && let (Some(t), Some(reason)) = (self.tree.as_mut(), &s.reason)
                {
                    t.set("note", json!(reason), seq);
                }
            }
            Event::TreeEnded(e) => {
                self.state(seq, e.to);
                if let Some(t) = self.tree.as_mut() {
                    t.set("ended_at", json!(at), seq);
                    t.set("exit_code", opt(&e.exit.and_then(|x| x.code)), seq);
                    t.set("exit_signal", opt(&e.exit.and_then(|x| x.signal)), seq);
                }
            }
            Event::TreeResolved(r) => {
                self.state(seq, TreeState::Resolved);
                if let Some(t) = self.tree.as_mut() {
                    t.set("note", json!(r.note), seq);
                    // The writer's `coalesce(ended_at, now)`: only an
                    // ambiguous tree is resolved, and it has no end yet.
                    t.set("ended_at", json!(at), seq);
                }
            }
            Event::MemberObserved(m) => self.member_seen(seq, at, m),
            Event::EscapeObserved(e) => {
                let k = key(&e.member.identity);
                self.member_seen(seq, at, &e.member);
                if let Some(r) = self.members.get_mut(&k) {
                    // The writer's `coalesce(escaped_at, now)`: an identity
                    // escapes once (the observation's unique index).
                    r.set("escaped_at", json!(at), seq);
                    r.set("ppid", json!(e.member.ppid), seq);
                    r.set("pgid", json!(e.member.pgid), seq);
                    r.set("sid", json!(e.member.sid), seq);
                }
                let mut o = Row::default();
                o.set("at", json!(at), seq);
                o.set("detail", event.to_data().map_err(|e| e.to_string())?, seq);
                self.observations.insert(("escape".into(), k), o);
            }
            Event::MemberExec(x) => {
                if let Some(r) = self.members.get_mut(&key(&x.identity)) {
                    r.set("exe", opt(&x.to.exe), seq);
                    r.set("cmdline", json!(x.to.argv), seq);
                }
            }
            Event::MemberExited(x) => {
                let k = key(&x.identity);
                if let Some(r) = self.members.get_mut(&k) {
                    r.set("exited_at", json!(at), seq);
                    r.set("exit_code", opt(&x.exit.and_then(|e| e.code)), seq);
                    r.set("exit_signal", opt(&x.exit.and_then(|e| e.signal)), seq);
                }
                let mut o = Row::default();
                o.set("at", json!(at), seq);
                o.set("detail", event.to_data().map_err(|e| e.to_string())?, seq);
                self.observations.insert(("exit".into(), k), o);
            }
            Event::SurvivorsRecorded(s) => {
                for v in &s.survivors {
                    let detail =
                        json!({"state": v.state, "rss_bytes": v.rss_bytes, "cmdline": v.cmdline});
                    self.survivors
                        .push((key(&v.identity), s.taken_at.clone(), detail, seq));
                }
            }
            Event::SignalSent(s) => {
                let mut r = Row::default();
                r.set("signal", json!(s.signal), seq);
                r.set("target_kind", json!(s.target_kind), seq);
                r.set("target", json!(s.target), seq);
                r.set("result", json!(s.result), seq);
                r.set("authorization_id", opt(&s.authorization), seq);
                r.set("at", json!(at), seq);
                self.signals.insert(s.id, r);
            }
            Event::KillAuthorized(k) => {
                let mut r = Row::default();
                r.set("reason", json!(k.reason), seq);
                r.set("targets", json!(k.targets), seq);
                r.set("at", json!(at), seq);
                self.authorizations.insert(k.authorization.0, r);
            }
            Event::Other(o) if o.kind.known().is_some() => {
                return Err(format!(
                    "event seq {seq} ({}) cannot be read: {}",
                    o.kind.as_str(),
                    o.why
                ));
            }
            _ => {}
        }
        Ok(())
    }
}

fn to_json(v: ValueRef<'_>) -> Value {
    match v {
        ValueRef::Null => Value::Null,
        ValueRef::Integer(i) => json!(i),
        ValueRef::Real(f) => json!(f),
        ValueRef::Text(t) | ValueRef::Blob(t) => json!(String::from_utf8_lossy(t)),
    }
}

/// Columns stored as JSON text: compared parsed.
const JSON_COLUMNS: [&str; 5] = ["argv", "cmdline", "targets", "detail", "requested_by"];

/// A stored row: its key, and its fields by name.
type Stored = (Value, BTreeMap<&'static str, Value>);

/// The stored rows of `sql` (first column the row's key, the rest named
/// by `fields`).
fn stored(
    conn: &Connection,
    sql: &str,
    tree: i64,
    fields: &[&'static str],
) -> Result<Vec<Stored>, Fail> {
    let mut stmt = conn.prepare_cached(sql)?;
    let mut rows = stmt.query([tree])?;
    let mut out = Vec::new();
    while let Some(r) = rows.next()? {
        let k = to_json(r.get_ref(0)?);
        let mut m = BTreeMap::new();
        for (i, f) in fields.iter().enumerate() {
            let mut v = to_json(r.get_ref(i + 1)?);
            if JSON_COLUMNS.contains(f)
                && let Value::String(s) = &v
            {
                v = serde_json::from_str(s).unwrap_or(v);
            }
            m.insert(*f, v);
        }
        out.push((k, m));
    }
    Ok(out)
}

fn differs(
    table: &str,
    row: &Value,
    want: &Row,
    have: &BTreeMap<&'static str, Value>,
) -> Option<VerifyBreak> {
    for (field, (expected, seq)) in &want.fields {
        let Some(actual) = have.get(field) else {
            continue;
        };
        if actual != expected {
            return Some(VerifyBreak {
                seq: Some(*seq),
                what: format!(
                    "{table} row {row}: {field} is {actual}, but the chain (event seq {seq}) says {expected}"
                ),
            });
        }
    }
    None
}

fn missing(table: &str, row: impl std::fmt::Display, seq: i64) -> Option<VerifyBreak> {
    Some(VerifyBreak {
        seq: Some(seq),
        what: format!("{table} row {row} is missing: event seq {seq} made it"),
    })
}

fn unbacked(table: &str, row: impl std::fmt::Display, tree: i64) -> Option<VerifyBreak> {
    Some(VerifyBreak {
        seq: None,
        what: format!("{table} row {row} (tree {tree}) has no event behind it in the chain"),
    })
}

/// The rows of one table keyed as the replay keys them, against the
/// replay: the first that differs, is missing or has no event. `name`
/// says which row a missing one would be.
fn compare<K: Ord>(
    table: &str,
    tree: i64,
    want: &BTreeMap<K, Row>,
    mut have: BTreeMap<K, Stored>,
    name: impl Fn(&K) -> String,
) -> Option<VerifyBreak> {
    for (k, want) in want {
        let seq = want.fields.values().map(|(_, s)| *s).min().unwrap_or(0);
        let Some((rowid, have)) = have.remove(k) else {
            return missing(table, name(k), seq);
        };
        if let Some(found) = differs(table, &rowid, want, &have) {
            return Some(found);
        }
    }
    have.values()
        .next()
        .and_then(|(rowid, _)| unbacked(table, rowid, tree))
}

fn identity_of(m: &BTreeMap<&'static str, Value>) -> Key {
    (
        m["pid"].as_i64().unwrap_or(0),
        m["start_ticks"].as_i64().unwrap_or(0),
        m["boot_id"].as_str().unwrap_or("").to_string(),
    )
}

const TREE_FIELDS: [&str; 24] = [
    "label",
    "state",
    "boundary",
    "owner_id",
    "argv",
    "cwd",
    "root_pid",
    "root_start_ticks",
    "boot_id",
    "pgid",
    "sid",
    "cgroup",
    "created_at",
    "ended_at",
    "exit_code",
    "exit_signal",
    "note",
    "grace_ms",
    "timeout_ms",
    "first_signal",
    "requester_uid",
    "requested_by",
    "run_uid",
    "run_gid",
];

const MEMBER_FIELDS: [&str; 16] = [
    "pid",
    "start_ticks",
    "boot_id",
    "ppid",
    "pgid",
    "sid",
    "cgroup",
    "uid",
    "exe",
    "cmdline",
    "cwd",
    "first_seen",
    "escaped_at",
    "exited_at",
    "exit_code",
    "exit_signal",
];

/// Every tree's rows against its events; the first divergence.
pub(crate) fn check(conn: &Connection) -> Result<Option<VerifyBreak>, Fail> {
    let trees: Vec<i64> = {
        let mut stmt = conn.prepare(
            "SELECT id FROM trees UNION SELECT DISTINCT tree FROM events WHERE tree IS NOT NULL
             ORDER BY 1",
        )?;
        let rows = stmt.query_map([], |r| r.get(0))?;
        rows.collect::<Result<_, _>>()?
    };
    for tree in trees {
        if let Some(found) = check_tree(conn, tree)? {
            return Ok(Some(found));
        }
    }
    Ok(None)
}

// Over 100 lines on purpose: one tree's replay, then each table it binds compared in turn (tree,
// owner, members, observations, signals and authorizations), the first difference returned.
fn check_tree(conn: &Connection, tree: i64) -> Result<Option<VerifyBreak>, Fail> {
    let mut replay = Replay::default();
    {
        let mut stmt = conn.prepare_cached(
            "SELECT seq, at, kind, data FROM events WHERE tree = ?1 ORDER BY seq",
        )?;
        let mut rows = stmt.query([tree])?;
        while let Some(r) = rows.next()? {
            let seq: i64 = r.get(0)?;
            let at: String = r.get(1)?;
            let kind: String = r.get(2)?;
            let data: String = r.get(3)?;
            if replay.first_seq == 0 {
                replay.first_seq = seq;
            }
            let data: Value = serde_json::from_str(&data).unwrap_or(Value::Null);
            let event = Event::decode(&RowKind::parse(&kind), &data);
            if let Err(why) = replay.apply(seq, &at, &event) {
                return Ok(Some(VerifyBreak {
                    seq: Some(seq),
                    what: why,
                }));
            }
        }
    }
    let id = json!(tree);

    // trees
    let have = stored(
        conn,
        &format!(
            "SELECT id, {} FROM trees WHERE id = ?1",
            TREE_FIELDS.join(", ")
        ),
        tree,
        &TREE_FIELDS,
    )?;
    match (&replay.tree, have.first()) {
        (None, None) => {}
        (None, Some(_)) => return Ok(unbacked("trees", tree, tree)),
        (Some(_), None) => return Ok(missing("trees", tree, replay.first_seq)),
        (Some(want), Some((_, have))) => {
            if let Some(found) = differs("trees", &id, want, have) {
                return Ok(Some(found));
            }
        }
    }
    if replay.tree.is_none() && replay.first_seq != 0 {
        return Ok(Some(VerifyBreak {
            seq: Some(replay.first_seq),
            what: format!("events name tree {tree}, but none of them is its tree.created"),
        }));
    }

    // owners (the tree's owner, as its tree.created names it)
    if let Some((owner, want)) = &replay.owner {
        let have = stored(
            conn,
            "SELECT id, pid, start_ticks, kind FROM owners WHERE id = ?1",
            *owner,
            &["pid", "start_ticks", "kind"],
        )?;
        match have.first() {
            None => return Ok(missing("owners", owner, replay.first_seq)),
            Some((_, have)) => {
                if let Some(found) = differs("owners", &json!(owner), want, have) {
                    return Ok(Some(found));
                }
            }
        }
    }

    // members, by identity
    let have = stored(
        conn,
        &format!(
            "SELECT id, {} FROM members WHERE tree_id = ?1",
            MEMBER_FIELDS.join(", ")
        ),
        tree,
        &MEMBER_FIELDS,
    )?
    .into_iter()
    .map(|(rowid, m)| (identity_of(&m), (rowid, m)))
    .collect();
    let found = compare("members", tree, &replay.members, have, |k| {
        format!("for pid {} (tree {tree})", k.0)
    });
    if found.is_some() {
        return Ok(found);
    }

    // observations: escapes and exits by identity, survivors as a list
    let mut survivors = Vec::new();
    let mut have = BTreeMap::new();
    for (rowid, o) in stored(
        conn,
        "SELECT id, kind, pid, start_ticks, boot_id, at, detail FROM observations WHERE tree_id = ?1",
        tree,
        &["kind", "pid", "start_ticks", "boot_id", "at", "detail"],
    )? {
        let k = identity_of(&o);
        let kind = o["kind"].as_str().unwrap_or("").to_string();
        if kind == "survivor" {
            survivors.push((k, o["at"].clone(), o["detail"].clone(), rowid));
        } else {
            have.insert((kind, k), (rowid, o));
        }
    }
    let found = compare("observations", tree, &replay.observations, have, |k| {
        format!("for the {} of pid {} (tree {tree})", k.0, k.1.0)
    });
    if found.is_some() {
        return Ok(found);
    }
    for (k, at, detail, seq) in &replay.survivors {
        let at = json!(at);
        match survivors
            .iter()
            .position(|(hk, hat, hd, _)| hk == k && *hat == at && hd == detail)
        {
            Some(i) => {
                survivors.swap_remove(i);
            }
            None => {
                return Ok(missing(
                    "observations",
                    format!("for survivor pid {} (tree {tree})", k.0),
                    *seq,
                ));
            }
        }
    }
    if let Some((_, _, _, rowid)) = survivors.first() {
        return Ok(unbacked("observations", rowid, tree));
    }

    // signals and kill authorizations, by id
    for (table, want, sql, fields) in [
        (
            "signals",
            &replay.signals,
            "SELECT id, signal, target_kind, target, result, authorization_id, at
             FROM signals WHERE tree_id = ?1",
            &[
                "signal",
                "target_kind",
                "target",
                "result",
                "authorization_id",
                "at",
            ][..],
        ),
        (
            "kill_authorizations",
            &replay.authorizations,
            "SELECT id, reason, targets, at FROM kill_authorizations WHERE tree_id = ?1",
            &["reason", "targets", "at"][..],
        ),
    ] {
        let have = stored(conn, sql, tree, fields)?
            .into_iter()
            .map(|(k, v)| (k.as_i64().unwrap_or(0), (k, v)))
            .collect();
        let found = compare(table, tree, want, have, |id| id.to_string());
        if found.is_some() {
            return Ok(found);
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    //! The replay against rows the ledger's own writers made, then each
    //! table edited behind their back (SQL on the file, triggers dropped):
    //! the break names the table, the row and the field.

    use std::time::Duration;

    use crate::ledger::{
        ExitRecord, IdentityRecord, KillTarget, Ledger, LedgerOptions, MemberRecord, NewTree,
        OwnerKind, OwnerRecord, SignalRecord, SpawnRecord, SurvivorRecord, TreeState,
    };

    fn ident(pid: i32) -> IdentityRecord {
        IdentityRecord {
            pid,
            start_ticks: 5000 + pid as u64,
            boot_id: "b0a7-1d".into(),
        }
    }

    fn member(pid: i32, argv: &str) -> MemberRecord {
        MemberRecord {
            identity: ident(pid),
            ppid: 1,
            pgid: 10,
            sid: 10,
            cgroup: None,
            uid: Some(1000),
            exe: Some(format!("/bin/{argv}")),
            cmdline: vec![argv.into()],
            cwd: Some("/tmp".into()),
        }
    }

    /// A ledger holding one tree that did everything a tree records:
    /// members, an exec, an escape, exits, survivors, a kill authorized and
    /// sent, its end.
    fn lived() -> (tempfile::TempDir, Ledger) {
        let dir = tempfile::tempdir().expect("temp dir");
        let ledger = Ledger::open(
            &dir.path().join("ledger.db"),
            LedgerOptions {
                busy_timeout: Duration::from_secs(2),
                ..LedgerOptions::default()
            },
        )
        .expect("open");
        let owner = ledger
            .register_owner(&OwnerRecord {
                identity: ident(1),
                kind: OwnerKind::Run,
            })
            .expect("owner");
        let id = ledger
            .create_tree(&NewTree {
                label: Some("nightly".into()),
                boundary: crate::proc::BoundaryKind::Session,
                owner,
                argv: vec!["make".into(), "test".into()],
                cwd: Some("/src".into()),
                grace_ms: Some(100),
                timeout_ms: None,
                limits: Default::default(),
                first_signal: None,
            })
            .expect("tree");
        ledger
            .tree_spawned(
                id,
                &SpawnRecord {
                    root: ident(10),
                    pgid: 10,
                    sid: 10,
                    cgroup: None,
                },
            )
            .expect("spawned");
        ledger
            .observe_members(id, &[member(10, "make"), member(11, "cc")])
            .expect("observe");
        ledger
            .refresh_members(id, &[member(11, "ld")])
            .expect("exec");
        let mut gone = member(12, "daemon");
        gone.sid = 12;
        gone.pgid = 12;
        assert!(ledger.record_escape(id, &gone, "setsid").expect("escape"));
        ledger
            .record_exits(
                id,
                &[(
                    ident(11),
                    Some(ExitRecord {
                        code: Some(2),
                        signal: None,
                        cpu_usec: None,
                    }),
                )],
                "init",
            )
            .expect("exit");
        ledger
            .set_state(id, TreeState::Terminating, Some("timeout"))
            .expect("terminating");
        ledger
            .record_survivors(
                id,
                &[SurvivorRecord {
                    identity: ident(12),
                    state: "S".into(),
                    rss_bytes: 4096,
                    cmdline: vec!["daemon".into()],
                }],
                std::time::SystemTime::now(),
            )
            .expect("survivors");
        ledger
            .set_state(id, TreeState::Killing, None)
            .expect("killing");
        let auth = ledger
            .authorize_kill(
                id,
                &[KillTarget {
                    kind: crate::ledger::TargetKind::Pid,
                    target: "12".into(),
                    identities: vec![ident(12)],
                }],
                "grace expired",
            )
            .expect("authorize");
        ledger
            .record_signal(
                id,
                &SignalRecord {
                    signal: "SIGKILL".into(),
                    target_kind: crate::ledger::TargetKind::Pid,
                    target: "12".into(),
                    result: "sent".into(),
                    authorization: Some(auth),
                },
            )
            .expect("sigkill");
        ledger
            .record_exits(id, &[(ident(10), None), (ident(12), None)], "init")
            .expect("exits");
        ledger
            .end_tree(
                id,
                TreeState::Ended,
                Some(ExitRecord {
                    code: None,
                    signal: Some(9),
                    cpu_usec: None,
                }),
            )
            .expect("end");
        // Tree 2 failed to spawn; tree 3 went ambiguous and was resolved;
        // tree 4 is still ambiguous.
        let failed = ledger
            .create_tree(&NewTree {
                label: None,
                boundary: crate::proc::BoundaryKind::Session,
                owner,
                argv: vec!["nosuch".into()],
                cwd: None,
                grace_ms: None,
                timeout_ms: None,
                limits: Default::default(),
                first_signal: None,
            })
            .expect("tree 2");
        ledger
            .tree_spawn_failed(failed, "exec nosuch: not found", 127)
            .expect("spawn failed");
        for (root, resolve) in [(20, true), (30, false)] {
            let t = ledger
                .create_tree(&NewTree {
                    label: None,
                    boundary: crate::proc::BoundaryKind::Session,
                    owner,
                    argv: vec!["sleep".into()],
                    cwd: None,
                    grace_ms: None,
                    timeout_ms: None,
                    limits: Default::default(),
                    first_signal: None,
                })
                .expect("tree");
            ledger
                .tree_spawned(
                    t,
                    &SpawnRecord {
                        root: ident(root),
                        pgid: root,
                        sid: root,
                        cgroup: None,
                    },
                )
                .expect("spawned");
            ledger
                .set_state(
                    t,
                    TreeState::Ambiguous,
                    Some("authority could not be written"),
                )
                .expect("ambiguous");
            if resolve {
                ledger
                    .resolve(t, "jdoe: gone by hand", &[], None)
                    .expect("resolve");
            }
        }
        (dir, ledger)
    }

    /// `verify`'s verdict after `sql` ran on the file (with the triggers
    /// that would refuse it dropped first).
    fn after(sql: &str) -> Option<String> {
        let (dir, ledger) = lived();
        drop(ledger);
        let conn = rusqlite::Connection::open(dir.path().join("ledger.db")).expect("file");
        let triggers: Vec<String> = conn
            .prepare("SELECT name FROM sqlite_master WHERE type = 'trigger'")
            .expect("triggers")
            .query_map([], |r| r.get(0))
            .expect("names")
            .collect::<Result<_, _>>()
            .expect("names");
        for t in triggers {
            conn.execute_batch(&format!("DROP TRIGGER {t}"))
                .expect("drop");
        }
        conn.execute_batch(sql).expect(sql);
        super::check(&conn).expect("check").map(|b| b.what)
    }

    #[test]
    fn rows_made_by_the_writers_are_what_their_events_say() {
        assert_eq!(after(""), None);
        // A kind a later build writes reads as `Other` and binds no row.
        assert_eq!(
            after(
                "INSERT INTO events (seq, at, tree, kind, data, prev_hash, hash)
                 SELECT max(seq) + 1, '2026-01-01T00:00:00.000Z', 4, 'tree.later_kind', '{}',
                        hash, hash FROM events"
            ),
            None
        );
        let (_dir, ledger) = lived();
        let report = ledger.verify(None).expect("verify");
        assert!(report.first_break.is_none(), "{report:?}");
    }

    #[test]
    fn each_shown_table_edited_alone_is_named_with_its_field() {
        for (sql, says) in [
            (
                "UPDATE trees SET label = 'weekly'",
                "trees row 1: label is \"weekly\"",
            ),
            (
                "UPDATE trees SET exit_signal = 15",
                "trees row 1: exit_signal is 15",
            ),
            (
                "UPDATE trees SET state = 'resolved'",
                "trees row 1: state is \"resolved\"",
            ),
            (
                "UPDATE trees SET argv = '[\"true\"]'",
                "trees row 1: argv is [\"true\"]",
            ),
            ("UPDATE owners SET pid = 2", "owners row 1: pid is 2"),
            (
                "UPDATE members SET cmdline = '[\"cc\"]' WHERE pid = 11",
                "cmdline is [\"cc\"]",
            ),
            (
                "UPDATE members SET exit_code = 0 WHERE pid = 11",
                "exit_code is 0",
            ),
            (
                "UPDATE members SET escaped_at = NULL WHERE pid = 12",
                "escaped_at is null",
            ),
            ("UPDATE members SET sid = 10 WHERE pid = 12", "sid is 10"),
            (
                "DELETE FROM members WHERE pid = 10",
                "members row for pid 10 (tree 1) is missing",
            ),
            (
                "UPDATE observations SET detail = '{}' WHERE kind = 'escape'",
                "observations row",
            ),
            (
                "DELETE FROM observations WHERE kind = 'survivor'",
                "observations row for survivor pid 12 (tree 1) is missing",
            ),
            (
                "UPDATE kill_authorizations SET reason = 'approved'",
                "kill_authorizations row 1: reason is \"approved\"",
            ),
            (
                "UPDATE kill_authorizations SET targets = '[]'",
                "kill_authorizations row 1: targets is []",
            ),
            (
                "UPDATE signals SET target = '13'",
                "signals row 1: target is \"13\"",
            ),
            ("DELETE FROM signals", "signals row 1 is missing"),
            (
                "INSERT INTO signals (tree_id, signal, target_kind, target, result, at)
                 VALUES (1, 'SIGTERM', 'group', '10', 'sent', '2026-01-01T00:00:00.000Z')",
                "signals row 2 (tree 1) has no event behind it in the chain",
            ),
            (
                "DELETE FROM events WHERE kind = 'signal.sent'",
                "signals row 1 (tree 1) has no event behind it in the chain",
            ),
            (
                "UPDATE trees SET note = NULL WHERE id = 2",
                "trees row 2: note is null",
            ),
            (
                "UPDATE trees SET exit_code = 1 WHERE id = 2",
                "trees row 2: exit_code is 1",
            ),
            (
                "UPDATE trees SET note = 'ok' WHERE id = 3",
                "trees row 3: note is \"ok\"",
            ),
            (
                "UPDATE trees SET ended_at = NULL WHERE id = 3",
                "trees row 3: ended_at is null",
            ),
            (
                "UPDATE trees SET state = 'ended' WHERE id = 4",
                "trees row 4: state is \"ended\"",
            ),
            (
                "UPDATE trees SET note = NULL WHERE id = 4",
                "trees row 4: note is null",
            ),
            // A kind this build writes, in a shape it cannot read.
            (
                "INSERT INTO events (seq, at, tree, kind, data, prev_hash, hash)
                 SELECT max(seq) + 1, '2026-01-01T00:00:00.000Z', 4, 'signal.sent', '{}',
                        hash, hash FROM events",
                "(signal.sent) cannot be read",
            ),
        ] {
            let said = after(sql).unwrap_or_else(|| panic!("{sql}: passed"));
            assert!(said.contains(says), "{sql}: said {said:?}, not {says:?}");
        }
    }
}
