//! Reads: rows back into typed shapes. Each public read runs in one snapshot.

use rusqlite::{Connection, OptionalExtension, Row, params, params_from_iter, types::Value};

use super::error::{Fail, LedgerError};
use super::event::{Event, RowKind};
use super::types::{
    AuthorizationRow, EventFilter, EventRow, ExitRecord, IdentityRecord, MemberCounts, MemberRow,
    ObservationRow, OwnerRow, PageAt, Resources, SignalRow, TokenRow, TreeDetail, TreeFilter,
    TreeId, TreeRow, TreeState,
};

const TREE_COLUMNS: &str =
    "t.id, t.label, t.state, t.boundary, o.id, o.pid, o.start_ticks, o.boot_id, o.kind,
     t.argv, t.cwd, t.root_pid, t.root_start_ticks, t.boot_id, t.pgid, t.sid, t.cgroup,
     t.created_at, t.ended_at, t.exit_code, t.exit_signal, t.flags, t.note,
     t.grace_ms, t.timeout_ms, t.first_signal, t.requester_uid, t.requested_by, t.run_uid, t.run_gid";

fn json_column<T: serde::de::DeserializeOwned>(row: &Row<'_>, idx: usize) -> rusqlite::Result<T> {
    let text: String = row.get(idx)?;
    serde_json::from_str(&text).map_err(|e| {
        rusqlite::Error::FromSqlConversionFailure(idx, rusqlite::types::Type::Text, Box::new(e))
    })
}

/// Clock ticks read back. The one conversion, for reads and writes alike: a
/// negative value is corrupt and fails the read, never clamped to another identity.
pub(crate) fn ticks(row: &Row<'_>, idx: usize) -> rusqlite::Result<u64> {
    let value: i64 = row.get(idx)?;
    u64::try_from(value).map_err(|e| {
        rusqlite::Error::FromSqlConversionFailure(idx, rusqlite::types::Type::Integer, Box::new(e))
    })
}

/// A count (or a fleet's stream sequence) read back: 0 where negative.
pub(crate) fn unsigned(row: &Row<'_>, idx: usize) -> rusqlite::Result<u64> {
    Ok(u64::try_from(row.get::<_, i64>(idx)?).unwrap_or(0))
}

fn opt_ticks(row: &Row<'_>, idx: usize) -> rusqlite::Result<Option<u64>> {
    match row.get::<_, Option<i64>>(idx)? {
        None => Ok(None),
        Some(_) => ticks(row, idx).map(Some),
    }
}

fn exit_of(code: Option<i32>, signal: Option<i32>) -> Option<ExitRecord> {
    (code.is_some() || signal.is_some()).then_some(ExitRecord {
        code,
        signal,
        cpu_usec: None,
    })
}

fn tree_from_row(row: &Row<'_>) -> rusqlite::Result<TreeRow> {
    let state: String = row.get(2)?;
    let state: TreeState = state.parse().map_err(|e: String| {
        rusqlite::Error::FromSqlConversionFailure(2, rusqlite::types::Type::Text, e.into())
    })?;
    Ok(TreeRow {
        id: row.get(0)?,
        label: row.get(1)?,
        state,
        boundary: row.get(3)?,
        owner: OwnerRow {
            id: row.get(4)?,
            pid: row.get(5)?,
            start: ticks(row, 6)?,
            boot_id: row.get(7)?,
            kind: row.get(8)?,
        },
        argv: json_column(row, 9)?,
        cwd: row.get(10)?,
        root_pid: row.get(11)?,
        root_start_ticks: opt_ticks(row, 12)?,
        boot_id: row.get(13)?,
        pgid: row.get(14)?,
        sid: row.get(15)?,
        cgroup: row.get(16)?,
        created_at: row.get(17)?,
        ended_at: row.get(18)?,
        exit: exit_of(row.get(19)?, row.get(20)?),
        flags: json_column(row, 21)?,
        note: row.get(22)?,
        grace_ms: opt_ticks(row, 23)?,
        timeout_ms: opt_ticks(row, 24)?,
        first_signal: row.get(25)?,
        requester_uid: row.get(26)?,
        requested_by: match row.get::<_, Option<String>>(27)? {
            None => None,
            Some(_) => Some(json_column(row, 27)?),
        },
        run_uid: row.get(28)?,
        run_gid: row.get(29)?,
    })
}

fn token_from_row(row: &Row<'_>) -> rusqlite::Result<TokenRow> {
    let scope: String = row.get(2)?;
    Ok(TokenRow {
        id: row.get(0)?,
        name: row.get(1)?,
        scope: scope.parse().map_err(|e: String| {
            rusqlite::Error::FromSqlConversionFailure(2, rusqlite::types::Type::Text, e.into())
        })?,
        created_at: row.get(3)?,
        revoked_at: row.get(4)?,
    })
}

/// Every token, oldest first.
pub(crate) fn tokens(conn: &Connection) -> Result<Vec<TokenRow>, Fail> {
    let mut stmt = conn.prepare_cached(
        "SELECT id, name, scope, created_at, revoked_at FROM api_tokens ORDER BY id",
    )?;
    let rows = stmt.query_map([], token_from_row)?;
    Ok(rows.collect::<Result<_, _>>()?)
}

/// The live (unrevoked) token with this SHA-256, if any.
pub(crate) fn token_by_hash(conn: &Connection, sha256: &str) -> Result<Option<TokenRow>, Fail> {
    Ok(conn
        .prepare_cached(
            "SELECT id, name, scope, created_at, revoked_at FROM api_tokens
             WHERE sha256 = ?1 AND revoked_at IS NULL",
        )?
        .query_row([sha256], token_from_row)
        .optional()?)
}

pub(crate) fn instance_id(conn: &Connection) -> Result<String, Fail> {
    Ok(conn
        .prepare_cached("SELECT value FROM ledger_meta WHERE key = 'instance_id'")?
        .query_row([], |r| r.get(0))?)
}

/// The directories that hold this ledger's per-tree cgroups (named
/// `<prefix>-<tree id>`), as recorded: each process makes them next to its
/// own cgroup, so there may be several.
pub(crate) fn cgroup_dirs(conn: &Connection, prefix: &str) -> Result<Vec<String>, Fail> {
    let mut stmt = conn.prepare_cached(
        "SELECT DISTINCT substr(cgroup, 1, length(cgroup) - length(?1 || '-' || id) - 1)
         FROM trees WHERE cgroup IS NOT NULL AND cgroup LIKE '%/' || ?1 || '-' || id",
    )?;
    let rows = stmt.query_map([prefix], |r| r.get(0))?;
    Ok(rows.collect::<Result<_, _>>()?)
}

pub(crate) fn tree(conn: &Connection, id: TreeId) -> Result<Option<TreeRow>, Fail> {
    let sql = format!(
        "SELECT {TREE_COLUMNS} FROM trees t JOIN owners o ON o.id = t.owner_id WHERE t.id = ?1"
    );
    Ok(conn
        .prepare_cached(&sql)?
        .query_row([id.0], tree_from_row)
        .optional()?)
}

/// `IN (?, …)` for `states` and its arguments (`IN (NULL)`, which matches
/// nothing, when there are none).
fn states_in(states: &[TreeState]) -> (String, Vec<Value>) {
    let args: Vec<Value> = if states.is_empty() {
        vec![Value::Null]
    } else {
        states
            .iter()
            .map(|s| Value::Text(s.as_str().to_string()))
            .collect()
    };
    (format!("IN ({})", vec!["?"; args.len()].join(", ")), args)
}

/// Trees whose state is in `states` (all trees when `None`), oldest first.
pub(crate) fn trees(conn: &Connection, states: Option<&[TreeState]>) -> Result<Vec<TreeRow>, Fail> {
    let (filter, args) = match states {
        None => (String::new(), Vec::new()),
        Some(states) => {
            let (set, args) = states_in(states);
            (format!("WHERE t.state {set}"), args)
        }
    };
    let sql = format!(
        "SELECT {TREE_COLUMNS} FROM trees t JOIN owners o ON o.id = t.owner_id {filter} ORDER BY t.id"
    );
    let mut stmt = conn.prepare_cached(&sql)?;
    let rows = stmt.query_map(params_from_iter(args), tree_from_row)?;
    Ok(rows.collect::<Result<_, _>>()?)
}

/// The ids of the trees in `states`, through the state index (no row is
/// decoded).
pub(crate) fn tree_ids(conn: &Connection, states: &[TreeState]) -> Result<Vec<i64>, Fail> {
    let (set, args) = states_in(states);
    let sql = format!("SELECT id FROM trees WHERE state {set} ORDER BY id");
    let mut stmt = conn.prepare_cached(&sql)?;
    let rows = stmt.query_map(params_from_iter(args), |r| r.get::<_, i64>(0))?;
    Ok(rows.collect::<Result<_, _>>()?)
}

/// One page of trees, newest first: those with an id below `before`, in
/// `states` (any when `None`), with exactly `label` when given. A keyset on
/// the primary key: a page costs the same at tree 10 and at tree 10 million.
pub(crate) fn tree_page(
    conn: &Connection,
    filter: &TreeFilter,
    at: PageAt,
    limit: usize,
) -> Result<Vec<TreeRow>, Fail> {
    let first = match filter.since {
        Some(since) => match first_tree_since(conn, since)? {
            Some(id) => Some(id),
            // No tree was created since then.
            None => return Ok(Vec::new()),
        },
        None => None,
    };
    let last = match filter.until {
        Some(until) => match last_tree_before(conn, until)? {
            Some(id) => Some(id),
            // No tree was created before then.
            None => return Ok(Vec::new()),
        },
        None => None,
    };
    let (sql, args) = tree_page_sql(filter, (first, last), at, limit);
    let mut stmt = conn.prepare_cached(&sql)?;
    let rows = stmt.query_map(params_from_iter(args), tree_from_row)?;
    let mut rows: Vec<TreeRow> = rows.collect::<Result<_, _>>()?;
    // A page of newer trees is read upwards from its bound (so it is the
    // page right above it), and shown newest first like every page.
    if matches!(at, PageAt::After(_)) {
        rows.reverse();
    }
    Ok(rows)
}

/// The first tree created at or after `since`, found without a scan of
/// `trees`: the first event at or after `since` (the `events_at` index),
/// then the first `tree.created` from there on (the primary key). Tree ids
/// and their `tree.created` events are written in one transaction, so they
/// come in the same order. (A wall-clock step back between two events can
/// misplace the bound by that step: `at` is the writer's clock.)
const FIRST_TREE_SINCE: &str = "SELECT tree FROM events
     WHERE seq >= (SELECT seq FROM events WHERE at >= ?1 ORDER BY at LIMIT 1)
       AND kind = 'tree.created'
     ORDER BY seq LIMIT 1";

fn first_tree_since(conn: &Connection, since: std::time::SystemTime) -> Result<Option<i64>, Fail> {
    let at = humantime::format_rfc3339_millis(since).to_string();
    let mut stmt = conn.prepare_cached(FIRST_TREE_SINCE)?;
    Ok(stmt.query_row([at], |r| r.get(0)).optional()?)
}

/// The last tree created before `until`, found as [`FIRST_TREE_SINCE`]
/// finds the first: the last event before `until`, then the last
/// `tree.created` up to it.
const LAST_TREE_BEFORE: &str = "SELECT tree FROM events
     WHERE seq <= (SELECT seq FROM events WHERE at < ?1 ORDER BY at DESC LIMIT 1)
       AND kind = 'tree.created'
     ORDER BY seq DESC LIMIT 1";

fn last_tree_before(conn: &Connection, until: std::time::SystemTime) -> Result<Option<i64>, Fail> {
    let at = humantime::format_rfc3339_millis(until).to_string();
    let mut stmt = conn.prepare_cached(LAST_TREE_BEFORE)?;
    Ok(stmt.query_row([at], |r| r.get(0)).optional()?)
}

/// The SQL of one page of `filter`, with the id range its times bound
/// (`first`, `last`: inclusive).
fn tree_page_sql(
    filter: &TreeFilter,
    (first, last): (Option<i64>, Option<i64>),
    at: PageAt,
    limit: usize,
) -> (String, Vec<Value>) {
    let states = filter.states.as_deref();
    let label = filter.label.as_deref();
    let owner = filter.owner;
    let mut clauses: Vec<String> = Vec::new();
    let mut args: Vec<Value> = Vec::new();
    if let Some(part) = &filter.label_contains {
        clauses.push("instr(t.label, ?) > 0".into());
        args.push(Value::Text(part.clone()));
    }
    if let Some(last) = last {
        clauses.push("t.id <= ?".into());
        args.push(Value::Integer(last));
    }
    if let Some(states) = states {
        clauses.push(format!(
            "t.state IN ({})",
            vec!["?"; states.len().max(1)].join(", ")
        ));
        if states.is_empty() {
            args.push(Value::Null);
        }
        args.extend(states.iter().map(|s| Value::Text(s.as_str().to_string())));
    }
    if let Some(label) = label {
        clauses.push("t.label = ?".into());
        args.push(Value::Text(label.to_string()));
    }
    match owner {
        None => {}
        Some(super::TreeOwner::Uid(uid)) => {
            clauses.push("t.requester_uid = ?".into());
            args.push(Value::Integer(i64::from(uid)));
        }
        Some(super::TreeOwner::Token(id)) => {
            clauses.push("json_extract(t.requested_by, '$.token_id') = ?".into());
            args.push(Value::Integer(id));
        }
        Some(super::TreeOwner::Nobody) => clauses.push("0".into()),
    }
    if let Some(first) = first {
        clauses.push("t.id >= ?".into());
        args.push(Value::Integer(first));
    }
    let order = match at {
        PageAt::Newest => "DESC",
        PageAt::Before(id) => {
            clauses.push("t.id < ?".into());
            args.push(Value::Integer(id));
            "DESC"
        }
        PageAt::After(id) => {
            clauses.push("t.id > ?".into());
            args.push(Value::Integer(id));
            "ASC"
        }
    };
    let filter = if clauses.is_empty() {
        String::new()
    } else {
        format!("WHERE {}", clauses.join(" AND "))
    };
    // The limit is written into the text, not bound: see `events_sql`.
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let sql = format!(
        "SELECT {TREE_COLUMNS} FROM trees t JOIN owners o ON o.id = t.owner_id {filter} ORDER BY t.id {order} LIMIT {limit}"
    );
    (sql, args)
}

pub(crate) fn members(conn: &Connection, id: TreeId) -> Result<Vec<MemberRow>, Fail> {
    let mut stmt = conn.prepare_cached(
        "SELECT pid, start_ticks, boot_id, ppid, pgid, sid, cgroup, uid, exe, cmdline, cwd,
                first_seen, last_seen, exited_at, exit_code, exit_signal, escaped_at
         FROM members WHERE tree_id = ?1 ORDER BY id",
    )?;
    let rows = stmt.query_map([id.0], |row| {
        let cmdline: Option<String> = row.get(9)?;
        Ok(MemberRow {
            pid: row.get(0)?,
            start_ticks: ticks(row, 1)?,
            boot_id: row.get(2)?,
            ppid: row.get(3)?,
            pgid: row.get(4)?,
            sid: row.get(5)?,
            cgroup: row.get(6)?,
            uid: row.get(7)?,
            exe: row.get(8)?,
            cmdline: cmdline
                .and_then(|c| serde_json::from_str(&c).ok())
                .unwrap_or_default(),
            cwd: row.get(10)?,
            first_seen: row.get(11)?,
            last_seen: row.get(12)?,
            exited_at: row.get(13)?,
            exit: exit_of(row.get(14)?, row.get(15)?),
            escaped_at: row.get(16)?,
        })
    })?;
    Ok(rows.collect::<Result<_, _>>()?)
}

fn observations(conn: &Connection, id: TreeId) -> Result<Vec<ObservationRow>, Fail> {
    let mut stmt = conn.prepare_cached(
        "SELECT id, kind, pid, start_ticks, boot_id, at, detail
         FROM observations WHERE tree_id = ?1 ORDER BY id",
    )?;
    let rows = stmt.query_map([id.0], |row| {
        Ok(ObservationRow {
            id: row.get(0)?,
            kind: row.get(1)?,
            identity: IdentityRecord {
                pid: row.get(2)?,
                start_ticks: ticks(row, 3)?,
                boot_id: row.get(4)?,
            },
            at: row.get(5)?,
            detail: json_column(row, 6)?,
        })
    })?;
    Ok(rows.collect::<Result<_, _>>()?)
}

fn signals(conn: &Connection, id: TreeId) -> Result<Vec<SignalRow>, Fail> {
    let mut stmt = conn.prepare_cached(
        "SELECT id, signal, target_kind, target, result, authorization_id, at
         FROM signals WHERE tree_id = ?1 ORDER BY id",
    )?;
    let rows = stmt.query_map([id.0], |row| {
        Ok(SignalRow {
            id: row.get(0)?,
            signal: row.get(1)?,
            target_kind: row.get(2)?,
            target: row.get(3)?,
            result: row.get(4)?,
            authorization: row.get(5)?,
            at: row.get(6)?,
        })
    })?;
    Ok(rows.collect::<Result<_, _>>()?)
}

fn authorizations(conn: &Connection, id: TreeId) -> Result<Vec<AuthorizationRow>, Fail> {
    let mut stmt = conn.prepare_cached(
        "SELECT id, reason, targets, at FROM kill_authorizations WHERE tree_id = ?1 ORDER BY id",
    )?;
    let rows = stmt.query_map([id.0], |row| {
        Ok(AuthorizationRow {
            id: row.get(0)?,
            reason: row.get(1)?,
            targets: json_column(row, 2)?,
            at: row.get(3)?,
        })
    })?;
    Ok(rows.collect::<Result<_, _>>()?)
}

pub(crate) fn tree_detail(conn: &Connection, id: TreeId) -> Result<Option<TreeDetail>, Fail> {
    let Some(tree) = tree(conn, id)? else {
        return Ok(None);
    };
    let events = events(
        conn,
        &EventFilter {
            tree: Some(id),
            ..EventFilter::default()
        },
    )?;
    let resources = events
        .iter()
        .rev()
        .find_map(|e| match e.event() {
            Event::TreeEnded(ended) => Some(ended.resources),
            _ => None,
        })
        .flatten();
    Ok(Some(TreeDetail {
        tree,
        resources,
        members: members(conn, id)?,
        observations: observations(conn, id)?,
        signals: signals(conn, id)?,
        authorizations: authorizations(conn, id)?,
        events,
    }))
}

pub(crate) fn event_from_row(row: &Row<'_>) -> rusqlite::Result<EventRow> {
    Ok(EventRow {
        seq: row.get(0)?,
        at: row.get(1)?,
        tree: row.get(2)?,
        kind: RowKind::parse(&row.get::<_, String>(3)?),
        data: json_column(row, 4)?,
        prev_hash: row.get(5)?,
        hash: row.get(6)?,
    })
}

pub(crate) fn events(conn: &Connection, filter: &EventFilter) -> Result<Vec<EventRow>, Fail> {
    let (sql, args) = events_sql(filter)?;
    let mut stmt = conn.prepare_cached(&sql)?;
    let rows = stmt.query_map(params_from_iter(args), event_from_row)?;
    Ok(rows.collect::<Result<_, _>>()?)
}

/// The statement and arguments of an event read (apart, so a test can ask
/// SQLite for its plan).
fn events_sql(filter: &EventFilter) -> Result<(String, Vec<Value>), Fail> {
    let mut clauses = Vec::new();
    let mut args: Vec<Value> = Vec::new();
    if let Some(since) = filter.since {
        clauses.push("at >= ?");
        // Times are fixed-width RFC 3339 UTC with milliseconds, so text order is time order.
        args.push(Value::Text(
            humantime::format_rfc3339_millis(since).to_string(),
        ));
    }
    if let Some(tree) = filter.tree {
        clauses.push("tree = ?");
        args.push(Value::Integer(tree.0));
    }
    if let Some(after) = filter.after_seq {
        clauses.push("seq > ?");
        args.push(Value::Integer(after));
    }
    if let Some(before) = filter.before_seq {
        clauses.push("seq < ?");
        args.push(Value::Integer(before));
    }
    if let Some(prefix) = &filter.kind_prefix {
        // Case-sensitive, like `str::starts_with` (LIKE would fold ASCII case).
        clauses.push("instr(kind, ?) = 1");
        args.push(Value::Text(prefix.clone()));
    }
    let search = &filter.search;
    if let Some(kinds) = &search.kinds {
        clauses.push(if kinds.is_empty() {
            "0"
        } else {
            "kind IN (SELECT value FROM json_each(?))"
        });
        if !kinds.is_empty() {
            args.push(Value::Text(serde_json::to_string(kinds)?));
        }
    }
    if let Some(until) = search.until {
        clauses.push("at < ?");
        args.push(Value::Text(
            humantime::format_rfc3339_millis(until).to_string(),
        ));
    }
    if let Some(text) = &search.text {
        clauses.push("instr(data, ?) > 0");
        args.push(Value::Text(text.clone()));
    }
    if let Some(label) = &search.tree_label {
        clauses.push("tree IN (SELECT id FROM trees WHERE instr(label, ?) > 0)");
        args.push(Value::Text(label.clone()));
    }
    let mut sql = String::from("SELECT seq, at, tree, kind, data, prev_hash, hash FROM events");
    if !clauses.is_empty() {
        sql.push_str(" WHERE ");
        sql.push_str(&clauses.join(" AND "));
    }
    sql.push_str(if filter.newest_first {
        " ORDER BY seq DESC"
    } else {
        " ORDER BY seq"
    });
    if let Some(limit) = filter.limit {
        let limit = i64::try_from(limit)
            .map_err(|_| LedgerError::Other(format!("limit {limit} is too large")))?;
        // Written into the text, not bound: SQLite (3.53, bundled) plans
        // with a bound LIMIT's value, so every run of a cached statement
        // with `LIMIT ?` was prepared again (3 µs a run became 9.5 µs, and
        // a quarter of the shipper's ledger thread); a few distinct limits
        // are a few cached statements.
        sql.push_str(&format!(" LIMIT {limit}"));
    }
    Ok((sql, args))
}

/// How many trees are in each state (states with none are left out).
pub(crate) fn tree_counts(conn: &Connection) -> Result<Vec<(TreeState, u64)>, Fail> {
    // Kept by triggers (migration 0005): one row per state, not a pass over every tree.
    let mut stmt =
        conn.prepare_cached("SELECT state, n FROM tree_counts WHERE n > 0 ORDER BY state")?;
    let rows = stmt.query_map([], |row| {
        Ok((row.get::<_, String>(0)?, row.get::<_, i64>(1)?))
    })?;
    let mut out = Vec::new();
    for row in rows {
        let (state, n) = row?;
        let state: TreeState = state
            .parse()
            .map_err(|e: String| Fail::Ledger(LedgerError::Corrupt(e)))?;
        out.push((state, u64::try_from(n).unwrap_or(0)));
    }
    Ok(out)
}

/// Live and escaped member counts of each of `ids`, in one query (trees
/// with no members are left out). The ids travel as one JSON array, so the
/// statement text, and its cached preparation, is the same for any number.
pub(crate) fn member_counts(
    conn: &Connection,
    ids: &[TreeId],
) -> Result<Vec<(TreeId, MemberCounts)>, Fail> {
    let ids = serde_json::to_string(&ids.iter().map(|id| id.0).collect::<Vec<_>>())?;
    let mut stmt = conn.prepare_cached(
        "SELECT tree_id, SUM(exited_at IS NULL), COUNT(escaped_at), COUNT(*) FROM members
         WHERE tree_id IN (SELECT value FROM json_each(?1)) GROUP BY tree_id",
    )?;
    let rows = stmt.query_map([ids], |row| {
        Ok((
            TreeId(row.get(0)?),
            MemberCounts {
                live: unsigned(row, 1)?,
                escaped: unsigned(row, 2)?,
                seen: unsigned(row, 3)?,
            },
        ))
    })?;
    Ok(rows.collect::<Result<_, _>>()?)
}

/// The sum of the `exit.cpu_usec` of a tree's `member.exited` events
/// (`None` when none has one), and whether the exit of `root` (a pid) is
/// among them. Read once, when the tree ends.
pub(crate) fn reaped_cpu_usec(
    conn: &Connection,
    id: TreeId,
    root: Option<i32>,
) -> Result<(Option<u64>, bool), Fail> {
    let mut stmt = conn.prepare_cached(
        "SELECT sum(json_extract(data, '$.exit.cpu_usec')),
                coalesce(max(json_extract(data, '$.identity.pid') = ?2
                             AND json_extract(data, '$.exit.cpu_usec') IS NOT NULL), 0)
         FROM events WHERE tree = ?1 AND kind = 'member.exited'",
    )?;
    let (sum, root_in): (Option<i64>, i64) =
        stmt.query_row(params![id.0, root], |r| Ok((r.get(0)?, r.get(1)?)))?;
    Ok((sum.and_then(|s| u64::try_from(s).ok()), root_in != 0))
}

/// What each of `ids` that has ended consumed (its `tree.ended`'s
/// `resources`); trees without are left out. One lookup per tree, each a
/// walk back from the tree's newest event, where `tree.ended` is.
pub(crate) fn ended_resources(
    conn: &Connection,
    ids: &[TreeId],
) -> Result<Vec<(TreeId, Resources)>, Fail> {
    let mut stmt = conn.prepare_cached(
        "SELECT json_extract(data, '$.resources') FROM events
         WHERE tree = ?1 AND kind = 'tree.ended' ORDER BY seq DESC LIMIT 1",
    )?;
    let mut out = Vec::new();
    for id in ids {
        let found: Option<Option<String>> = stmt.query_row([id.0], |r| r.get(0)).optional()?;
        if let Some(r) = found
            .flatten()
            .and_then(|text| serde_json::from_str(&text).ok())
        {
            out.push((*id, r));
        }
    }
    Ok(out)
}

/// Each of `ids` with its events of the kinds an outcome reads
/// ([`super::outcome::OUTCOME_KINDS`]), in seq order, typed.
pub(crate) fn outcome_events(
    conn: &Connection,
    ids: &[TreeId],
) -> Result<Vec<(TreeId, Vec<super::Event>)>, Fail> {
    let kinds = super::outcome::OUTCOME_KINDS
        .iter()
        .map(|k| format!("'{}'", k.as_str()))
        .collect::<Vec<_>>()
        .join(", ");
    let mut stmt = conn.prepare_cached(&format!(
        "SELECT kind, data FROM events WHERE tree = ?1 AND kind IN ({kinds}) ORDER BY seq"
    ))?;
    let mut out = Vec::with_capacity(ids.len());
    for id in ids {
        let rows = stmt.query_map([id.0], |r| {
            Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?))
        })?;
        let mut events = Vec::new();
        for row in rows {
            let (kind, data) = row?;
            let data: serde_json::Value = serde_json::from_str(&data).unwrap_or_default();
            events.push(super::Event::decode(&super::RowKind::parse(&kind), &data));
        }
        out.push((*id, events));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    /// The reads the dashboard and the API page with are keyset reads: SQLite
    /// walks an index (the primary key, or `events_tree`) in order and stops
    /// at the limit; it never sorts a whole table into a temporary B-tree
    /// (which would make a page cost grow with the ledger).
    #[test]
    fn paged_reads_walk_an_index_and_never_sort_the_table() {
        use super::{FIRST_TREE_SINCE, LAST_TREE_BEFORE, events_sql, tree_page_sql};
        use crate::ledger::{EventFilter, PageAt, TreeId, TreeState};
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("ledger.db");
        drop(crate::ledger::Ledger::open(&path, Default::default()).expect("migrate"));
        let conn = rusqlite::Connection::open(&path).expect("open");
        let plan = |sql: &str, args: Vec<rusqlite::types::Value>| -> String {
            let mut stmt = conn
                .prepare(&format!("EXPLAIN QUERY PLAN {sql}"))
                .expect("plan");
            let rows = stmt
                .query_map(rusqlite::params_from_iter(args), |r| r.get::<_, String>(3))
                .expect("rows");
            rows.map(|r| r.expect("row")).collect::<Vec<_>>().join("; ")
        };
        let running = [TreeState::Running];
        for (states, label, at) in [
            (None, None, PageAt::Newest),
            (None, None, PageAt::Before(5000)),
            (None, None, PageAt::After(5000)),
            (Some(&running[..]), None, PageAt::Before(5000)),
            (Some(&running[..]), None, PageAt::After(5000)),
            (None, Some("ci"), PageAt::Newest),
        ] {
            let filter = crate::ledger::TreeFilter {
                states: states.map(<[TreeState]>::to_vec),
                label: label.map(str::to_string),
                label_contains: label.map(str::to_string),
                ..Default::default()
            };
            let (sql, args) = tree_page_sql(&filter, (None, Some(9000)), at, 100);
            let p = plan(&sql, args);
            assert!(!p.contains("TEMP B-TREE"), "tree page sorts: {p}");
        }
        // `since` on trees: the first event at the time (an index search),
        // then the primary key from there; never a scan of either table.
        let p = plan(
            FIRST_TREE_SINCE,
            vec![rusqlite::types::Value::Text(
                "2026-01-01T00:00:00.000Z".into(),
            )],
        );
        assert!(
            p.contains("events_at"),
            "since finds its event by index: {p}"
        );
        assert!(!p.contains("TEMP B-TREE"), "since sorts: {p}");
        let until = plan(
            LAST_TREE_BEFORE,
            vec![rusqlite::types::Value::Text(
                "2026-01-01T00:00:00.000Z".into(),
            )],
        );
        assert!(
            until.contains("events_at") && !until.contains("TEMP B-TREE"),
            "until finds its event by index: {until}"
        );
        assert!(
            !p.contains("SCAN events") || p.contains("PRIMARY KEY"),
            "since scans: {p}"
        );
        for filter in [
            EventFilter {
                newest_first: true,
                limit: Some(200),
                ..EventFilter::default()
            },
            EventFilter {
                newest_first: true,
                before_seq: Some(9000),
                limit: Some(200),
                ..EventFilter::default()
            },
            EventFilter {
                tree: Some(TreeId(3)),
                newest_first: true,
                limit: Some(200),
                ..EventFilter::default()
            },
            EventFilter {
                after_seq: Some(9000),
                limit: Some(1000),
                ..EventFilter::default()
            },
        ] {
            let (sql, args) = events_sql(&filter).expect("sql");
            let p = plan(&sql, args);
            assert!(!p.contains("TEMP B-TREE"), "event page sorts: {p}");
            // A keyset bound is a search of the primary key, not a scan.
            if filter.before_seq.is_some() || filter.after_seq.is_some() {
                assert!(p.contains("PRIMARY KEY"), "keyset page scans: {p}");
            }
        }
    }

    /// A page read run again with other bounds is not prepared again: a
    /// bound `LIMIT ?` made SQLite re-plan every run of the cached
    /// statement (its value feeds the planner), so limits are literals.
    #[test]
    fn a_cached_page_read_is_not_prepared_again() {
        use super::{PageAt, events_sql, tree_page_sql};
        let (dir, _ledger) = ledger();
        let conn = rusqlite::Connection::open(dir.path().join("ledger.db")).expect("open");
        let statuses = |sql: &str, runs: Vec<Vec<rusqlite::types::Value>>| {
            let mut stmt = conn.prepare(sql).expect("prepare");
            for args in runs {
                let n = stmt
                    .query_map(rusqlite::params_from_iter(args), |_| Ok(()))
                    .expect("query")
                    .count();
                assert_eq!(n, 0, "an empty ledger's page");
            }
            stmt.get_status(rusqlite::StatementStatus::RePrepare)
        };
        let events = (1..4)
            .map(|after| {
                events_sql(&EventFilter {
                    after_seq: Some(after),
                    limit: Some(256),
                    ..EventFilter::default()
                })
                .expect("sql")
            })
            .collect::<Vec<_>>();
        assert!(
            events.iter().all(|(sql, _)| *sql == events[0].0),
            "one statement"
        );
        assert_eq!(
            statuses(
                &events[0].0,
                events.iter().map(|(_, a)| a.clone()).collect()
            ),
            0,
            "{}",
            events[0].0
        );
        let trees = (1..4)
            .map(|at| {
                tree_page_sql(
                    &crate::ledger::TreeFilter::default(),
                    (None, None),
                    PageAt::Before(at * 10),
                    100,
                )
            })
            .collect::<Vec<_>>();
        assert_eq!(
            statuses(&trees[0].0, trees.iter().map(|(_, a)| a.clone()).collect()),
            0,
            "{}",
            trees[0].0
        );
    }

    use crate::ledger::{
        Event, EventFilter, IdentityRecord, Ledger, LedgerOptions, MemberCounts, MemberRecord,
        NewTree, OwnerKind, OwnerRecord, SignalRecord, TreeId,
    };

    fn ident(pid: i32) -> IdentityRecord {
        IdentityRecord {
            pid,
            start_ticks: 1000 + pid as u64,
            boot_id: "b0a7-1d".into(),
        }
    }

    fn member(pid: i32) -> MemberRecord {
        MemberRecord {
            identity: ident(pid),
            ppid: 1,
            pgid: 10,
            sid: 10,
            cgroup: None,
            uid: Some(1000),
            exe: None,
            cmdline: vec!["sleep".into()],
            cwd: None,
        }
    }

    fn ledger() -> (tempfile::TempDir, Ledger) {
        let dir = tempfile::tempdir().expect("temp dir");
        let ledger = Ledger::open(
            &dir.path().join("ledger.db"),
            LedgerOptions {
                busy_timeout: Duration::from_secs(2),
                ..LedgerOptions::default()
            },
        )
        .expect("open");
        (dir, ledger)
    }

    fn tree(ledger: &Ledger) -> TreeId {
        let owner = ledger
            .register_owner(&OwnerRecord {
                identity: ident(1),
                kind: OwnerKind::Run,
            })
            .expect("owner");
        ledger
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
            .expect("tree")
    }

    #[test]
    fn member_counts_match_the_member_rows() {
        let (_dir, ledger) = ledger();
        let (a, b, empty, unasked) = (tree(&ledger), tree(&ledger), tree(&ledger), tree(&ledger));
        ledger
            .observe_members(a, &[member(100), member(101), member(102)])
            .expect("observe");
        // 101 escaped and then exited; 102 exited: one live, one escape.
        ledger
            .record_escape(a, &member(101), "left")
            .expect("escape");
        ledger
            .record_exits(a, &[(ident(101), None), (ident(102), None)], "init")
            .expect("exits");
        ledger
            .record_escape(b, &member(200), "left")
            .expect("escape");
        ledger
            .observe_members(unasked, &[member(300)])
            .expect("observe");
        let counts = ledger.member_counts(&[a, b, empty]).expect("counts");
        assert_eq!(counts.len(), 2, "{counts:?}");
        assert_eq!(
            counts[&a],
            MemberCounts {
                live: 1,
                escaped: 1,
                seen: 3
            }
        );
        assert_eq!(
            counts[&b],
            MemberCounts {
                live: 1,
                escaped: 1,
                seen: 1
            }
        );
        // The same answer the full detail read gives.
        for id in [a, b] {
            let d = ledger.tree_detail(id).expect("detail").expect("tree");
            let live = d.members.iter().filter(|m| m.exited_at.is_none()).count();
            let esc = d.members.iter().filter(|m| m.escaped_at.is_some()).count();
            assert_eq!(
                (counts[&id].live, counts[&id].escaped, counts[&id].seen),
                (live as u64, esc as u64, d.members.len() as u64)
            );
        }
        assert!(ledger.member_counts(&[]).expect("none").is_empty());
    }

    #[test]
    fn kind_prefix_and_newest_first_keep_the_newest_matches() {
        let (_dir, ledger) = ledger();
        let id = tree(&ledger);
        for i in 0..7 {
            ledger
                .append_event(
                    Some(id),
                    Event::SweepStarted(crate::ledger::event::SweepStarted {
                        candidates: i,
                        pid: 1,
                    }),
                )
                .expect("event");
            ledger
                .append_event(
                    None,
                    Event::DispatchRefused(crate::ledger::event::DispatchRefused {
                        tree: id,
                        reason: format!("{i}"),
                        unsettled: 1,
                        by: None,
                    }),
                )
                .expect("event");
        }
        let all = ledger.events(&EventFilter::default()).expect("all");
        for prefix in ["sweep.", "dispatch.", "tree.", "SWEEP.", "nothing", "%"] {
            let want: Vec<i64> = all
                .iter()
                .rev()
                .filter(|e| e.kind.as_str().starts_with(prefix))
                .take(4)
                .map(|e| e.seq)
                .collect();
            let got: Vec<i64> = ledger
                .events(&EventFilter {
                    kind_prefix: Some(prefix.into()),
                    newest_first: true,
                    limit: Some(4),
                    ..EventFilter::default()
                })
                .expect("filtered")
                .iter()
                .map(|e| e.seq)
                .collect();
            assert_eq!(got, want, "prefix {prefix:?}");
        }
        // Defaults unchanged: oldest first.
        let oldest = ledger
            .events(&EventFilter {
                limit: Some(3),
                ..EventFilter::default()
            })
            .expect("oldest");
        assert_eq!(oldest.iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 2, 3]);
    }

    #[test]
    fn record_signals_checks_the_tree_once_and_only_when_there_are_signals() {
        let (_dir, ledger) = ledger();
        let missing = TreeId(999);
        ledger
            .record_signals(missing, &[])
            .expect("nothing to record");
        let term = SignalRecord {
            signal: "SIGTERM".into(),
            target_kind: crate::ledger::TargetKind::Group,
            target: "10".into(),
            result: "sent".into(),
            authorization: None,
        };
        assert!(
            ledger
                .record_signals(missing, std::slice::from_ref(&term))
                .is_err()
        );
        let id = tree(&ledger);
        ledger
            .record_signals(id, &[term.clone(), term])
            .expect("signals");
        let d = ledger.tree_detail(id).expect("detail").expect("tree");
        assert_eq!(d.signals.len(), 2);
    }
}
