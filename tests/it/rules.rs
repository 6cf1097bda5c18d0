//! The design's rules that had no test of their own (issues 11 and 12),
//! each held against real parts:
//!
//! - `verify` rejects a SIGKILL forged the way a forger would forge it
//!   (triggers dropped with the sqlite3 API, the chain recomputed with the
//!   documented recipe), names every way a SIGKILL row can lack its
//!   authority, fails on a corrupt page (`PRAGMA integrity_check`) and names
//!   a ledger cut off below its published head as truncated;
//! - the boot id recorded is the kernel's;
//! - a sweep treats a recycled owner pid as gone only after the identity
//!   check, a dead but unreaped owner as gone, and an owner whose start time
//!   cannot be read as alive;
//! - the dispatch gate refuses new work while a tree's teardown was
//!   interrupted (`terminating`/`killing`) with its owner gone or the tree is
//!   `ambiguous` in the ledger, not while the owner lives, and reopens once
//!   the sweep or an operator settles it; a sweep that cannot authorize
//!   settles nothing; a stale marker holds the door only while a survivor
//!   it names lives.
//!
//! Every ledger here is made by the real binary; forgeries are written into
//! copies of it. Processes carry `TW_TEST_MARK` and are ended by pid.

use std::fs::File;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rusqlite::{Connection, params};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::custody::Env;
use crate::util::{KillOnDrop, bin, is_root, pid_alive, signal, skip, wait_child, wait_until};

static NEXT: AtomicUsize = AtomicUsize::new(0);

/// Serialises this module's writers of `/proc/sys/kernel/ns_last_pid`.
static PID_RACE: Mutex<()> = Mutex::new(());

// ---------------------------------------------------------------------------
// Helpers

/// `treewarden ARGS` in `env`, run to its end (bounded). stdout goes to
/// /dev/null and stderr to a file: a tree's survivors inherit neither pipe.
/// Returns the exit code and stderr.
fn run_to_end(env: &Env, cmd: Command) -> (Option<i32>, String) {
    let n = NEXT.fetch_add(1, Ordering::SeqCst);
    let err_path = env.dir.path().join(format!("rules-{n}.stderr"));
    let err = File::create(&err_path).expect("stderr file");
    let mut cmd = cmd;
    cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(err);
    let mut child = cmd.spawn().expect("start treewarden");
    let status = wait_child(&mut child, Duration::from_secs(60)).expect("treewarden exits");
    (
        status.code(),
        std::fs::read_to_string(&err_path).unwrap_or_default(),
    )
}

fn tw(env: &Env, args: &[&str]) -> (Option<i32>, String) {
    let mut cmd = env.cmd();
    cmd.args(args);
    run_to_end(env, cmd)
}

/// `treewarden run -- true` at the host-wide gate, settling nothing on
/// its way (`--dispatch-scope host --no-settle`): whether the gate, as the
/// ledger and the markers stand, is open. (A plain `run` finishes what dead
/// owners left first, and is refused only by its own owner's trees:
/// tests/it/wrapper.rs.)
fn dispatch(env: &Env) -> (Option<i32>, String) {
    tw(
        env,
        &[
            "run",
            "--quiet",
            "--dispatch-scope",
            "host",
            "--no-settle",
            "--",
            "true",
        ],
    )
}

/// `treewarden [--data-dir DIR] verify ARGS`: exit code, stdout, stderr.
fn verify(data_dir: &Path, args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(bin())
        .arg("--data-dir")
        .arg(data_dir)
        .arg("verify")
        .args(args)
        .env_remove("TREEWARDEN_DATA_DIR")
        .env_remove("TREEWARDEN_LOG")
        .output()
        .expect("run verify");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `verify` fails (exit 1) with one line on stderr containing `what`.
fn assert_verify_fails(data_dir: &Path, args: &[&str], what: &str) {
    let (code, out, err) = verify(data_dir, args);
    assert_eq!(code, Some(1), "verify {args:?}: stdout {out} stderr {err}");
    assert!(
        err.contains(what),
        "verify {args:?} should name {what:?}, said: {err}"
    );
    assert_eq!(err.lines().count(), 1, "one line: {err}");
}

fn assert_verify_ok(data_dir: &Path, args: &[&str]) {
    let (code, out, err) = verify(data_dir, args);
    assert_eq!(code, Some(0), "verify {args:?}: stdout {out} stderr {err}");
    assert!(out.starts_with("ok: "), "{out}");
}

pub(crate) fn open(path: &Path) -> Connection {
    let conn = Connection::open(path).expect("open ledger file");
    conn.busy_timeout(Duration::from_secs(5))
        .expect("busy timeout");
    conn
}

fn count(conn: &Connection, sql: &str) -> i64 {
    conn.query_row(sql, [], |r| r.get(0)).expect(sql)
}

fn tree_state(env: &Env, tree: i64) -> Option<String> {
    let conn = open(&env.ledger_path());
    conn.query_row("SELECT state FROM trees WHERE id = ?1", [tree], |r| {
        r.get(0)
    })
    .ok()
}

/// A real ledger made by the real binary in `env`: tree 1 ignores SIGTERM
/// and is killed by force on `--timeout` (a `kill.authorized`, SIGKILL
/// rows), tree 2 runs `true`. Checkpointed, so the file alone is the ledger.
fn real_ledger(env: &Env) -> PathBuf {
    let mut run = env.cmd();
    run.args([
        "run",
        "--grace",
        "100ms",
        "--timeout",
        "300ms",
        "--quiet",
        "--",
    ])
    .args(env.marked_argv("trap '' TERM; sleep 600 & wait"));
    let (code, err) = run_to_end(env, run);
    assert_eq!(code, Some(124), "the forced-kill run: {err}");
    assert!(env.wait_none_marked(), "survivors: {:?}", env.marked());
    let (code, err) = dispatch(env);
    assert_eq!(code, Some(0), "{err}");
    let path = env.ledger_path();
    let conn = open(&path);
    assert!(
        count(
            &conn,
            "SELECT count(*) FROM signals WHERE tree_id = 1 AND signal = 'SIGKILL'
             AND authorization_id IS NOT NULL"
        ) > 0,
        "tree 1 was killed by force with authority"
    );
    assert_eq!(count(&conn, "SELECT count(*) FROM trees"), 2);
    conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
        .expect("checkpoint");
    drop(conn);
    path
}

/// A copy of a ledger file in a data dir of its own, under `parent`.
fn copy_ledger(ledger: &Path, parent: &Path, name: &str) -> PathBuf {
    let dir = parent.join(name);
    std::fs::create_dir(&dir).expect("data dir");
    std::fs::copy(ledger, dir.join("ledger.db")).expect("copy ledger");
    dir
}

/// What a forger holding the file does first: open it with the sqlite3 API
/// and drop the triggers in the way.
pub(crate) fn forger(data_dir: &Path, triggers: &[&str]) -> Connection {
    let conn = open(&data_dir.join("ledger.db"));
    for t in triggers {
        conn.execute_batch(&format!("DROP TRIGGER {t}"))
            .expect("the forger drops a trigger");
    }
    conn
}

/// The documented recipe (src/ledger/mod.rs, docs/DECISIONS.md), written
/// again here so that a forgery does not lean on the code under test:
/// `hex(sha256(prev_hash || [seq,at,tree,kind,data]))`, the array as
/// canonical JSON (keys sorted, no whitespace: serde_json's `Value` without
/// `preserve_order`, as this crate builds it).
pub(crate) fn recipe_hash(
    prev: &str,
    seq: i64,
    at: &str,
    tree: Option<i64>,
    kind: &str,
    data: &str,
) -> String {
    let data: Value = serde_json::from_str(data).expect("data is JSON");
    let canonical = serde_json::to_string(&json!([seq, at, tree, kind, data])).expect("json");
    hex::encode(Sha256::digest(format!("{prev}{canonical}").as_bytes()))
}

pub(crate) type EventTuple = (i64, String, Option<i64>, String, String, String, String);

pub(crate) fn events(conn: &Connection) -> Vec<EventTuple> {
    let mut stmt = conn
        .prepare("SELECT seq, at, tree, kind, data, prev_hash, hash FROM events ORDER BY seq")
        .expect("prepare");
    stmt.query_map([], |r| {
        Ok((
            r.get(0)?,
            r.get(1)?,
            r.get(2)?,
            r.get(3)?,
            r.get(4)?,
            r.get(5)?,
            r.get(6)?,
        ))
    })
    .expect("query")
    .collect::<Result<_, _>>()
    .expect("rows")
}

/// Whether every event's prev_hash and hash are the recipe's: then the
/// chain alone shows nothing.
pub(crate) fn chain_consistent(conn: &Connection) -> bool {
    let mut prev = "0".repeat(64);
    for (i, (seq, at, tree, kind, data, stored_prev, hash)) in events(conn).into_iter().enumerate()
    {
        if seq != i as i64 + 1
            || stored_prev != prev
            || recipe_hash(&prev, seq, &at, tree, &kind, &data) != hash
        {
            return false;
        }
        prev = hash;
    }
    true
}

/// Recomputes prev_hash and hash of every event from `from` on.
pub(crate) fn rechain(conn: &Connection, from: i64) {
    let mut prev = if from == 1 {
        "0".repeat(64)
    } else {
        conn.query_row("SELECT hash FROM events WHERE seq = ?1", [from - 1], |r| {
            r.get(0)
        })
        .expect("previous hash")
    };
    for (seq, at, tree, kind, data, _, _) in events(conn).into_iter().filter(|e| e.0 >= from) {
        let hash = recipe_hash(&prev, seq, &at, tree, &kind, &data);
        conn.execute(
            "UPDATE events SET prev_hash = ?2, hash = ?3 WHERE seq = ?1",
            params![seq, prev, hash],
        )
        .expect("rewrite a hash");
        prev = hash;
    }
}

/// Inserts an event at `seq`, moving every later event one up, and
/// recomputes the chain from there (needs the event triggers dropped).
fn insert_event(
    conn: &Connection,
    seq: i64,
    at: &str,
    tree: Option<i64>,
    kind: &str,
    data: &Value,
) {
    conn.execute_batch(&format!(
        "UPDATE events SET seq = -seq - 1 WHERE seq >= {seq};
         UPDATE events SET seq = -seq WHERE seq < 0;"
    ))
    .expect("make room");
    conn.execute(
        "INSERT INTO events (seq, at, tree, kind, data, prev_hash, hash)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?6)",
        params![
            seq,
            at,
            tree,
            kind,
            serde_json::to_string(data).expect("json"),
            "0".repeat(64)
        ],
    )
    .expect("insert the forged event");
    rechain(conn, seq);
}

/// Appends an event after the head, chained by the recipe. The triggers
/// (gapless, linked) accept it: nothing needs dropping.
fn append_event(conn: &Connection, tree: Option<i64>, kind: &str, data: &Value) -> i64 {
    append_event_at(conn, tree, kind, data, None)
}

/// [`append_event`] with its `at` (the head's when `None`): a row and the
/// event that made it carry one time.
fn append_event_at(
    conn: &Connection,
    tree: Option<i64>,
    kind: &str,
    data: &Value,
    at: Option<&str>,
) -> i64 {
    let (head, prev, head_at): (i64, String, String) = conn
        .query_row(
            "SELECT seq, hash, at FROM events ORDER BY seq DESC LIMIT 1",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .expect("head");
    let seq = head + 1;
    let at = at.map_or(head_at, str::to_string);
    let text = serde_json::to_string(data).expect("json");
    let hash = recipe_hash(&prev, seq, &at, tree, kind, &text);
    conn.execute(
        "INSERT INTO events (seq, at, tree, kind, data, prev_hash, hash)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
        params![seq, at, tree, kind, text, prev, hash],
    )
    .expect("append an event");
    seq
}

/// Inserts a SIGKILL `signals` row; returns its id.
fn insert_sigkill_row(conn: &Connection, tree: i64, auth: Option<i64>, at: &str) -> i64 {
    conn.execute(
        "INSERT INTO signals (tree_id, signal, target_kind, target, result, authorization_id, at)
         VALUES (?1, 'SIGKILL', 'group', '4242', 'sent', ?2, ?3)",
        params![tree, auth, at],
    )
    .expect("insert a SIGKILL row");
    conn.last_insert_rowid()
}

/// Tree 1's first authorization: (id, at).
fn first_authorization(conn: &Connection) -> (i64, String) {
    conn.query_row(
        "SELECT id, at FROM kill_authorizations WHERE tree_id = 1 ORDER BY id LIMIT 1",
        [],
        |r| Ok((r.get(0)?, r.get(1)?)),
    )
    .expect("tree 1 has an authorization")
}

// ---------------------------------------------------------------------------
// verify

/// The forger's whole job: a SIGKILL that had no authority, written into
/// the record as if it had been sent. The database refuses it while its
/// triggers stand; with them dropped and every later hash recomputed by the
/// recipe the chain is consistent again, and only `verify`'s authority check
/// is left to see it.
#[test]
fn verify_rejects_a_sigkill_forged_without_authority_and_rechained() {
    let Some(env) = Env::new("session") else {
        return;
    };
    let ledger = real_ledger(&env);
    assert_verify_ok(&env.data_dir(), &[]);
    let dir = copy_ledger(&ledger, env.dir.path(), "forged");
    let conn = forger(&dir, &[]);
    let (term_seq, at, term_data): (i64, String, String) = conn
        .query_row(
            "SELECT seq, at, data FROM events WHERE tree = 1 AND kind = 'signal.sent'
             AND json_extract(data, '$.signal') = 'SIGTERM' ORDER BY seq LIMIT 1",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .expect("tree 1's SIGTERM event");
    let err = conn
        .execute(
            "INSERT INTO signals (tree_id, signal, target_kind, target, result, at)
             VALUES (1, 'SIGKILL', 'group', '4242', 'sent', ?1)",
            [&at],
        )
        .expect_err("the triggers refuse a SIGKILL without authority");
    assert!(err.to_string().contains("invariant"), "{err}");
    drop(conn);

    let conn = forger(
        &dir,
        &[
            "signals_sigkill_needs_authority",
            "events_no_update",
            "events_gapless",
            "events_linked",
        ],
    );
    let id = insert_sigkill_row(&conn, 1, None, &at);
    // The forged event looks like the real SIGTERM event next to it.
    let mut data: Value = serde_json::from_str(&term_data).expect("json");
    data["id"] = json!(id);
    data["signal"] = json!("SIGKILL");
    data["authorization"] = Value::Null;
    let forged = term_seq + 1;
    insert_event(&conn, forged, &at, Some(1), "signal.sent", &data);
    assert!(
        chain_consistent(&conn),
        "precondition: the forger recomputed every hash"
    );
    drop(conn);

    assert_verify_fails(
        &dir,
        &[],
        &format!("seq {forged}: SIGKILL without an earlier kill.authorized event"),
    );
}

/// Each way a SIGKILL can lack its authority is named, in the chain and in
/// the `signals` table; a SIGKILL at the very instant of its authorization
/// is not a break.
#[test]
fn verify_names_each_way_a_sigkill_lacks_its_authority() {
    let Some(env) = Env::new("session") else {
        return;
    };
    let ledger = real_ledger(&env);
    let base = env.dir.path();
    let (auth, auth_at) = first_authorization(&open(&ledger));

    // In the chain only: tree 2's SIGKILL event citing tree 1's authority.
    // Appended by the recipe, it passes every trigger.
    let dir = copy_ledger(&ledger, base, "chain-foreign");
    let conn = forger(&dir, &[]);
    let data = json!({"id": 0, "signal": "SIGKILL", "target_kind": "group",
                      "target": "4242", "result": "sent", "authorization": auth});
    let seq = append_event(&conn, Some(2), "signal.sent", &data);
    drop(conn);
    assert_verify_fails(
        &dir,
        &[],
        &format!("seq {seq}: SIGKILL cites an authorization of another tree"),
    );

    // A row without any authorization (no event: the row is what is forged).
    let dir = copy_ledger(&ledger, base, "row-unauthorized");
    let conn = forger(&dir, &["signals_sigkill_needs_authority"]);
    let id = insert_sigkill_row(&conn, 1, None, &auth_at);
    drop(conn);
    assert_verify_fails(
        &dir,
        &[],
        &format!("SIGKILL signal row {id} (tree 1) has no kill authorization"),
    );

    // A row of tree 2 citing tree 1's authorization.
    let dir = copy_ledger(&ledger, base, "row-foreign");
    let conn = forger(&dir, &["signals_sigkill_needs_authority"]);
    let id = insert_sigkill_row(&conn, 2, Some(auth), &auth_at);
    drop(conn);
    assert_verify_fails(
        &dir,
        &[],
        &format!("SIGKILL signal row {id} (tree 2) cites authorization {auth} of tree 1"),
    );

    // A row sent before its authorization was committed (the trigger only
    // asks that the authorization exists: nothing needs dropping).
    let dir = copy_ledger(&ledger, base, "row-early");
    let conn = forger(&dir, &[]);
    let id = insert_sigkill_row(&conn, 1, Some(auth), "2000-01-01T00:00:00.000Z");
    drop(conn);
    assert_verify_fails(
        &dir,
        &[],
        &format!("SIGKILL signal row {id} (tree 1) precedes its authorization {auth}"),
    );

    // A row with its authority but no event in the chain.
    let dir = copy_ledger(&ledger, base, "row-unchained");
    let conn = forger(&dir, &[]);
    let id = insert_sigkill_row(&conn, 1, Some(auth), &auth_at);
    drop(conn);
    assert_verify_fails(
        &dir,
        &[],
        &format!("SIGKILL signal row {id} (tree 1) has no signal.sent event in the chain"),
    );

    // Not a forgery: a SIGKILL recorded in the same millisecond as its
    // authorization, row and event, is sound.
    let dir = copy_ledger(&ledger, base, "same-instant");
    let conn = forger(&dir, &[]);
    let id = insert_sigkill_row(&conn, 1, Some(auth), &auth_at);
    let data = json!({"id": id, "signal": "SIGKILL", "target_kind": "group",
                      "target": "4242", "result": "sent", "authorization": auth});
    append_event_at(&conn, Some(1), "signal.sent", &data, Some(&auth_at));
    drop(conn);
    assert_verify_ok(&dir, &[]);
}

/// What a reviewer reads (`show`, `ls`, the dashboard, the API) comes from
/// the projection tables; each forgery of them an operator found passing
/// `verify` (an authorization's reason, a tree's label, a member's argv, a
/// SIGKILL's rows deleted) fails now, naming the table, the row and the
/// field, and so does a row with no event behind it. An untouched copy
/// passes.
#[test]
fn verify_names_a_row_that_is_not_what_its_events_say() {
    let Some(env) = Env::new("session") else {
        return;
    };
    let ledger = real_ledger(&env);
    let base = env.dir.path();
    let (auth, _) = first_authorization(&open(&ledger));
    let dir = copy_ledger(&ledger, base, "untouched");
    assert_verify_ok(&dir, &[]);

    let dir = copy_ledger(&ledger, base, "reason");
    let conn = forger(&dir, &["kill_authorizations_no_update"]);
    conn.execute(
        "UPDATE kill_authorizations SET reason = 'approved by alice (INC-1)' WHERE id = ?1",
        [auth],
    )
    .expect("edit the reason");
    drop(conn);
    assert_verify_fails(
        &dir,
        &[],
        &format!("kill_authorizations row {auth}: reason is \"approved by alice (INC-1)\""),
    );

    let dir = copy_ledger(&ledger, base, "label");
    let conn = forger(&dir, &[]);
    conn.execute("UPDATE trees SET label = 'nightly-backup' WHERE id = 1", [])
        .expect("rename the tree");
    drop(conn);
    assert_verify_fails(&dir, &[], "trees row 1: label is \"nightly-backup\"");

    let dir = copy_ledger(&ledger, base, "argv");
    let conn = forger(&dir, &[]);
    let member: i64 = conn
        .query_row("SELECT min(id) FROM members WHERE tree_id = 1", [], |r| {
            r.get(0)
        })
        .expect("a member of tree 1");
    conn.execute(
        "UPDATE members SET cmdline = '[\"make\",\"test\"]' WHERE id = ?1",
        [member],
    )
    .expect("rewrite the argv");
    drop(conn);
    assert_verify_fails(
        &dir,
        &[],
        &format!("members row {member}: cmdline is [\"make\",\"test\"]"),
    );

    let dir = copy_ledger(&ledger, base, "sigkill-deleted");
    let conn = forger(
        &dir,
        &["signals_no_delete", "kill_authorizations_no_delete"],
    );
    let sigkill: i64 = conn
        .query_row(
            "SELECT min(id) FROM signals WHERE tree_id = 1 AND signal = 'SIGKILL'",
            [],
            |r| r.get(0),
        )
        .expect("a SIGKILL row");
    conn.execute_batch(
        "DELETE FROM signals WHERE signal = 'SIGKILL'; DELETE FROM kill_authorizations;",
    )
    .expect("delete the SIGKILL and its authority");
    drop(conn);
    assert_verify_fails(&dir, &[], &format!("signals row {sigkill} is missing"));

    let dir = copy_ledger(&ledger, base, "state");
    let conn = forger(
        &dir,
        &["trees_terminal_is_final", "trees_resolve_only_ambiguous"],
    );
    conn.execute(
        "UPDATE trees SET state = 'resolved', note = 'cleaned up by hand' WHERE id = 1",
        [],
    )
    .expect("edit the state");
    drop(conn);
    assert_verify_fails(&dir, &[], "trees row 1: note is \"cleaned up by hand\"");

    let dir = copy_ledger(&ledger, base, "extra-member");
    let conn = forger(&dir, &[]);
    conn.execute(
        "INSERT INTO members (tree_id, pid, start_ticks, boot_id, cmdline, first_seen, last_seen)
         SELECT 1, 4242, 1, boot_id, '[\"innocent\"]', first_seen, last_seen
         FROM members WHERE tree_id = 1 LIMIT 1",
        [],
    )
    .expect("add a member");
    let extra = conn.last_insert_rowid();
    drop(conn);
    assert_verify_fails(
        &dir,
        &[],
        &format!("members row {extra} (tree 1) has no event behind it in the chain"),
    );
}

/// The chain cannot show that its newest events were cut off; the head
/// published elsewhere can, and `verify --expect-head` calls it truncation.
#[test]
fn verify_expect_head_names_a_cut_off_ledger_as_truncated() {
    let Some(env) = Env::new("session") else {
        return;
    };
    let ledger = real_ledger(&env);
    let base = env.dir.path();
    let conn = open(&ledger);
    let all = events(&conn);
    drop(conn);
    let (head, head_hash) = all.last().map(|e| (e.0, e.6.clone())).expect("events");
    let older = &all[all.len() - 3];
    let at_head = format!("{head}:{head_hash}");

    assert_verify_ok(&env.data_dir(), &["--expect-head", &at_head]);
    // A head published earlier: the ledger has grown since, which is fine.
    assert_verify_ok(
        &env.data_dir(),
        &["--expect-head", &format!("{}:{}", older.0, older.6)],
    );
    // The right seq with another hash.
    assert_verify_fails(
        &env.data_dir(),
        &["--expect-head", &format!("{head}:{}", older.6)],
        &format!("seq {head}: hash is {head_hash}, but the expected head says"),
    );

    // The newest two events cut off (tree 2's last: its `tree.ended` and a
    // member exit or a state change before it, as the run went), and the
    // rows they made rolled back with them: cut consistently, the rows
    // cannot tell; only the published head can.
    let dir = copy_ledger(&ledger, base, "cut");
    let conn = forger(
        &dir,
        &[
            "events_no_delete",
            "trees_terminal_is_final",
            "observations_no_delete",
        ],
    );
    conn.execute("DELETE FROM events WHERE seq > ?1", [head - 2])
        .expect("cut");
    for e in all[all.len() - 2..].iter().rev() {
        let data: Value = serde_json::from_str(&e.4).expect("json");
        assert_eq!(e.2, Some(2), "tree 2's event: {e:?}");
        match e.3.as_str() {
            "tree.ended" | "tree.state" => conn.execute(
                "UPDATE trees SET state = ?1, ended_at = NULL, exit_code = NULL,
                                  exit_signal = NULL WHERE id = 2",
                [data["from"].as_str().expect("from")],
            ),
            "member.exited" => conn
                .execute_batch(&format!(
                    "DELETE FROM observations WHERE tree_id = 2 AND kind = 'exit' AND pid = {pid};
                 UPDATE members SET exited_at = NULL, exit_code = NULL, exit_signal = NULL
                 WHERE tree_id = 2 AND pid = {pid};",
                    pid = data["identity"]["pid"].as_i64().expect("pid")
                ))
                .map(|()| 1),
            other => panic!("no roll-back written for a cut {other}"),
        }
        .expect("roll a row back");
    }
    drop(conn);
    assert_verify_ok(&dir, &[]);
    assert_verify_fails(
        &dir,
        &["--expect-head", &at_head],
        &format!(
            "seq {head}: expected head {head} but the ledger ends at {} (truncated)",
            head - 2
        ),
    );

    // Every event cut off (a ledger with no SIGKILL row, so that nothing
    // but the head is missing).
    let plain = Env::new("session").expect("a session env");
    let (code, err) = dispatch(&plain);
    assert_eq!(code, Some(0), "{err}");
    let conn = open(&plain.ledger_path());
    let plain_head = count(&conn, "SELECT max(seq) FROM events");
    conn.execute_batch(
        "DROP TRIGGER events_no_delete; DELETE FROM events;
         DROP TRIGGER trees_no_delete; DROP TRIGGER members_no_delete;
         DROP TRIGGER observations_no_delete;
         DELETE FROM observations; DELETE FROM members; DELETE FROM trees;",
    )
    .expect("cut everything, rows with it");
    drop(conn);
    assert_verify_ok(&plain.data_dir(), &[]);
    assert_verify_fails(
        &plain.data_dir(),
        &["--expect-head", &format!("{plain_head}:{head_hash}")],
        &format!(
            "seq {plain_head}: expected head {plain_head} but the ledger has no events (truncated)"
        ),
    );
}

/// One byte of one index page flipped in a real ledger file: the chain
/// (table data) is intact, SQLite opens the file, and only
/// `PRAGMA integrity_check` sees it. `verify` must fail naming it.
#[test]
fn verify_fails_when_sqlites_integrity_check_does() {
    let Some(env) = Env::new("session") else {
        return;
    };
    let (code, err) = dispatch(&env);
    assert_eq!(code, Some(0), "{err}");
    let path = env.ledger_path();
    let conn = open(&path);
    conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
        .expect("checkpoint");
    let page_size: i64 = count(&conn, "PRAGMA page_size");
    let root: i64 = count(
        &conn,
        "SELECT rootpage FROM sqlite_master WHERE type = 'index' AND name = 'trees_state'",
    );
    assert_eq!(count(&conn, "SELECT count(*) FROM trees"), 1);
    drop(conn);
    assert_verify_ok(&env.data_dir(), &[]);

    // The index's root is a leaf (one tree) holding one cell: the record
    // ('ended', 1). Its text's last byte goes from 'd' to 'e': the entry
    // stays in order, but no longer matches its row.
    let mut bytes = std::fs::read(&path).expect("read the file");
    let page = ((root - 1) * page_size) as usize;
    assert_eq!(bytes[page], 0x0a, "precondition: a leaf index page");
    assert_eq!(
        u16::from_be_bytes([bytes[page + 3], bytes[page + 4]]),
        1,
        "one cell"
    );
    let cell = page + u16::from_be_bytes([bytes[page + 8], bytes[page + 9]]) as usize;
    // payload size (1-byte varint), header size (1-byte varint), serial types.
    let header = bytes[cell + 1] as usize;
    let text_type = bytes[cell + 2] as usize;
    assert!(text_type >= 13 && text_type % 2 == 1, "a text column");
    let len = (text_type - 13) / 2;
    let text = cell + 1 + header;
    assert_eq!(&bytes[text..text + len], b"ended", "precondition: the key");
    bytes[text + len - 1] = b'e';
    std::fs::write(&path, &bytes).expect("write the file");

    let conn = open(&path);
    let problems: Vec<String> = conn
        .prepare("PRAGMA integrity_check")
        .expect("prepare")
        .query_map([], |r| r.get(0))
        .expect("query")
        .collect::<Result<_, _>>()
        .expect("rows");
    assert!(chain_consistent(&conn), "the chain itself is untouched");
    drop(conn);
    assert_eq!(
        problems.len(),
        1,
        "precondition: exactly one problem: {problems:?}"
    );
    assert_ne!(problems[0], "ok");
    assert_verify_fails(
        &env.data_dir(),
        &[],
        &format!("integrity_check: {}", problems[0]),
    );
}

// ---------------------------------------------------------------------------
// identity: boot id, recycled and unreadable owners

/// The boot id in every identity the ledger records is the kernel's.
#[test]
fn the_boot_id_recorded_is_the_kernels() {
    let Some(env) = Env::new("session") else {
        return;
    };
    let kernel = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .expect("read boot_id")
        .trim()
        .to_string();
    assert_eq!(kernel.len(), 36, "{kernel:?}");
    let mut run = env.cmd();
    run.args(["run", "--quiet", "--"])
        .args(env.marked_argv("sleep 0.2"));
    let (code, err) = run_to_end(&env, run);
    assert_eq!(code, Some(0), "{err}");
    let conn = open(&env.ledger_path());
    for table in ["owners", "trees", "members"] {
        let ids: Vec<String> = conn
            .prepare(&format!("SELECT DISTINCT boot_id FROM {table}"))
            .expect("prepare")
            .query_map([], |r| r.get(0))
            .expect("query")
            .collect::<Result<_, _>>()
            .expect("rows");
        assert_eq!(ids, vec![kernel.clone()], "{table}");
    }
}

/// Start time (field 22 of /proc/<pid>/stat), read independently.
fn start_ticks(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(19)?
        .parse()
        .ok()
}

/// An orphan whose owner's pid now belongs to another process.
struct RecycledOwner {
    env: Env,
    /// The unrelated process now holding the owner's pid (killed by pid on drop).
    impostor: KillOnDrop,
    owner_pid: i32,
    _race: std::sync::MutexGuard<'static, ()>,
}

/// Tree 1 under `run`; while the owner lives, a sweep leaves the tree
/// alone (same pid, same start time). Then the owner is SIGKILLed and
/// reaped, its tree lives on, and an unrelated process is made to take the
/// owner's pid (`ns_last_pid`, root only).
fn orphan_with_recycled_owner() -> Option<RecycledOwner> {
    if !is_root() {
        skip("forcing pid reuse through /proc/sys/kernel/ns_last_pid needs root");
        return None;
    }
    // Held for the whole test: another test's pid games next to ours
    // would take the pid one of us needs.
    let race = PID_RACE.lock().unwrap_or_else(|e| e.into_inner());
    let env = Env::new("session")?;
    let mut run = KillOnDrop(env.spawn_run(&["--grace", "100ms", "--quiet"], "sleep 600 & wait"));
    assert!(env.wait_marked(2), "{:?}", env.marked());
    let owner_pid = run.id() as i32;
    let (pid, start): (i32, i64) = open(&env.ledger_path())
        .query_row(
            "SELECT o.pid, o.start_ticks FROM trees t JOIN owners o ON o.id = t.owner_id
             WHERE t.id = 1",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .expect("tree 1's owner");
    assert_eq!(pid, owner_pid, "the owner is the run process");
    assert_eq!(Some(start as u64), start_ticks(owner_pid));

    let report = sweep(&env);
    assert_eq!(report["examined"], 1, "{report}");
    assert_eq!(
        report["owned"], 1,
        "a live owner's tree is spared: {report}"
    );
    assert_eq!(report["orphans"], json!([]), "{report}");

    signal(run.id(), rustix::process::Signal::KILL);
    wait_child(&mut run.0, Duration::from_secs(10)).expect("the owner dies");
    assert_eq!(env.marked().len(), 2, "the tree outlives its owner");

    // Bounded retries: any fork on the host between our write and our
    // spawn takes the pid first. Afterwards the counter goes back to where
    // it was, so that other tests' freshly freed pids are not handed out
    // again at once.
    let ns_last_pid = || -> i32 {
        std::fs::read_to_string("/proc/sys/kernel/ns_last_pid")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    };
    let high = ns_last_pid();
    let mut impostor = None;
    wait_until(Duration::from_secs(10), || {
        std::fs::write("/proc/sys/kernel/ns_last_pid", format!("{}", owner_pid - 1))
            .expect("ns_last_pid");
        let child = Command::new("sleep")
            .arg("600")
            .env("TW_TEST_MARK", format!("{}-impostor", env.mark))
            .current_dir(env.dir.path())
            .stdin(Stdio::null())
            .spawn()
            .expect("impostor");
        let child = KillOnDrop(child);
        if child.id() as i32 == owner_pid {
            impostor = Some(child);
        }
        impostor.is_some()
    });
    let now = ns_last_pid();
    if now < high {
        let _ = std::fs::write("/proc/sys/kernel/ns_last_pid", high.to_string());
    }
    let Some(impostor) = impostor else {
        skip("could not win the pid race within 10 s");
        return None;
    };
    let now = start_ticks(owner_pid).expect("the impostor's start time");
    assert!(
        now > start as u64,
        "precondition: the pid is alive and started later"
    );
    Some(RecycledOwner {
        env,
        impostor,
        owner_pid,
        _race: race,
    })
}

fn sweep(env: &Env) -> Value {
    let mut cmd = env.cmd();
    cmd.args(["sweep", "--grace", "100ms", "--json"]);
    let (code, out, err) = output_bounded(env, cmd);
    assert_eq!(code, Some(0), "sweep: {err}");
    serde_json::from_str(&out).expect("sweep json")
}

/// Runs a command to its end, bounded (killed by pid after 90 s, which
/// fails the test): exit code, stdout, stderr, through files.
fn output_bounded(env: &Env, mut cmd: Command) -> (Option<i32>, String, String) {
    let n = NEXT.fetch_add(1, Ordering::SeqCst);
    let out_path = env.dir.path().join(format!("rules-{n}.stdout"));
    let err_path = env.dir.path().join(format!("rules-{n}.stderr"));
    cmd.stdin(Stdio::null())
        .stdout(File::create(&out_path).expect("stdout file"))
        .stderr(File::create(&err_path).expect("stderr file"));
    let mut child = cmd.spawn().expect("start the command");
    let status = wait_child(&mut child, Duration::from_secs(90));
    let out = std::fs::read_to_string(&out_path).unwrap_or_default();
    let err = std::fs::read_to_string(&err_path).unwrap_or_default();
    let status = status.unwrap_or_else(|| panic!("{cmd:?} did not end within 90 s: {err}"));
    (status.code(), out, err)
}

/// The sweep, readable: the owner's pid is alive but its start time is
/// later than the record's, so the owner is gone and its tree torn down;
/// the process now holding the pid is never touched.
fn assert_swept_as_orphan(o: &mut RecycledOwner) {
    let report = sweep(&o.env);
    assert_eq!(report["examined"], 1, "{report}");
    assert_eq!(report["owned"], 0, "{report}");
    assert_eq!(report["orphans"][0]["tree"], 1, "{report}");
    assert_eq!(report["orphans"][0]["to"], "ended", "{report}");
    assert!(o.env.wait_none_marked(), "survivors: {:?}", o.env.marked());
    assert!(
        o.impostor.0.try_wait().expect("try_wait").is_none() && pid_alive(o.owner_pid),
        "the process holding the owner's pid lives"
    );
    let found = o.env.export().into_iter().any(|e| {
        e["kind"] == "sweep.orphan_found"
            && e["tree"] == 1
            && e["data"]["owner"]["pid"] == o.owner_pid
    });
    assert!(found, "sweep.orphan_found names the recycled owner");
    assert_eq!(tree_state(&o.env, 1).as_deref(), Some("ended"));
}

/// A sweep that finds the owner's pid alive (a bare `kill(pid, 0)` would
/// say "owner alive") still treats the owner as gone, because the identity
/// check says the pid holds another process.
#[test]
fn a_recycled_owner_pid_is_gone_only_after_the_identity_check() {
    let Some(mut o) = orphan_with_recycled_owner() else {
        return;
    };
    assert!(pid_alive(o.owner_pid));
    assert_swept_as_orphan(&mut o);
}

/// An owner whose start time cannot be read counts as alive: the sweep
/// runs unprivileged under a /proc mounted `hidepid=1` (its own mount
/// namespace), where the pid of the tree's owner is visible but its stat
/// file is not. The pid holds an impostor, so a sweep that could read it
/// would tear the tree down (and does, afterwards, as root).
#[test]
fn an_owner_whose_start_time_cannot_be_read_counts_as_alive() {
    let Some(mut o) = orphan_with_recycled_owner() else {
        return;
    };
    let env = &o.env;
    // The sweep runs as nobody: let it reach and write the data dir.
    std::fs::set_permissions(env.dir.path(), std::fs::Permissions::from_mode(0o755))
        .expect("chmod");
    let mut paths: Vec<PathBuf> = std::fs::read_dir(env.data_dir())
        .expect("data dir")
        .flatten()
        .map(|e| e.path())
        .collect();
    paths.push(env.data_dir());
    for path in paths {
        if let Err(e) = std::os::unix::fs::chown(&path, Some(65534), Some(65534)) {
            // A user namespace without uid 65534 mapped, for one.
            skip(&format!("cannot hand the data dir to uid 65534: {e}"));
            return;
        }
    }

    let script = r#"
        mount -t proc -o hidepid=1 proc /proc || exit 97
        as_nobody() { setpriv --reuid=65534 --regid=65534 --clear-groups -- "$@"; }
        as_nobody cat "/proc/$OWNER/stat" >/dev/null 2>&1 && exit 98
        exec setpriv --reuid=65534 --regid=65534 --clear-groups -- "$TW" sweep --grace 100ms --json
    "#;
    let mut unshare = env.cmd_for("unshare");
    unshare
        .args([
            "--mount",
            "--propagation",
            "private",
            "--",
            "sh",
            "-c",
            script,
        ])
        .env("OWNER", o.owner_pid.to_string())
        .env("TW", bin());
    if Command::new("unshare").arg("--version").output().is_err() {
        skip("no unshare(1)");
        return;
    }
    let (code, stdout, stderr) = output_bounded(env, unshare);
    match code {
        Some(0) => {}
        Some(97) => {
            skip(&format!("cannot mount a /proc with hidepid=1: {stderr}"));
            return;
        }
        Some(98) => panic!("precondition: the owner's stat stayed readable under hidepid=1"),
        _ if stderr.starts_with("unshare:") || stderr.contains("setpriv:") => {
            skip(&format!("no private mount namespace or setpriv: {stderr}"));
            return;
        }
        code => panic!("unprivileged sweep exited {code:?}: {stderr}"),
    }
    let report: Value = serde_json::from_str(&stdout).expect("sweep json");
    assert_eq!(
        report["owned"], 1,
        "unreadable means alive: {report} {stderr}"
    );
    assert_eq!(report["orphans"], json!([]), "{report}");
    assert_eq!(env.marked().len(), 2, "the tree is untouched");
    assert_eq!(tree_state(env, 1).as_deref(), Some("running"));

    // The same sweep able to read the pid, as root: the owner is gone. The
    // data dir goes back to root first (a data dir of another user's is
    // refused, root's sweep included), with whatever nobody's sweep added.
    let mut paths: Vec<PathBuf> = std::fs::read_dir(env.data_dir())
        .expect("data dir")
        .flatten()
        .map(|e| e.path())
        .collect();
    paths.push(env.data_dir());
    for path in paths {
        std::os::unix::fs::chown(&path, Some(0), Some(0)).expect("hand the data dir back to root");
    }
    assert_swept_as_orphan(&mut o);
}

// ---------------------------------------------------------------------------
// The dispatch gate

fn assert_refused(env: &Env, what: &str) {
    let (code, err) = dispatch(env);
    assert_eq!(code, Some(125), "refused: {err}");
    assert!(
        err.contains("dispatch refused: tree 1 is unsettled"),
        "{err}"
    );
    assert!(err.contains(what), "should say {what:?}: {err}");
}

fn assert_open(env: &Env, label: &str) {
    let (code, err) = dispatch(env);
    assert_eq!(code, Some(0), "{label}: {err}");
}

/// The latest `dispatch.refused` event's data.
fn last_refusal(env: &Env) -> Value {
    env.export()
        .into_iter()
        .rev()
        .find(|e| e["kind"] == "dispatch.refused")
        .map(|e| e["data"].clone())
        .expect("a dispatch.refused event")
}

/// A teardown interrupted in `terminating`: the owner (`run`, in a long
/// grace) is SIGKILLed. While it lived dispatch stayed open; once it is
/// gone dispatch is refused, and the sweep that finishes the teardown
/// reopens it.
#[test]
fn dispatch_refused_while_a_teardown_is_interrupted_in_terminating_and_reopened_by_the_sweep() {
    let Some(env) = Env::new("session") else {
        return;
    };
    // Long enough to interrupt the grace, short enough for the resumed
    // teardown, which may use the grace recorded with the tree.
    let mut run = KillOnDrop(env.spawn_run(
        &["--grace", "5s", "--quiet"],
        "trap '' TERM; sleep 600 & wait",
    ));
    assert!(env.wait_marked(2), "{:?}", env.marked());
    signal(run.id(), rustix::process::Signal::TERM);
    assert!(
        wait_until(Duration::from_secs(20), || tree_state(&env, 1).as_deref()
            == Some("terminating")),
        "{:?}",
        tree_state(&env, 1)
    );
    // The owner lives (in its grace): its teardown is not interrupted.
    assert_open(&env, "owner alive in terminating");

    signal(run.id(), rustix::process::Signal::KILL);
    wait_child(&mut run.0, Duration::from_secs(10)).expect("the owner dies");
    assert_eq!(tree_state(&env, 1).as_deref(), Some("terminating"));
    assert_eq!(env.marked().len(), 2, "the survivors live");
    assert_refused(
        &env,
        "teardown interrupted in state terminating and its owner is gone",
    );
    let refusal = last_refusal(&env);
    assert_eq!(refusal["tree"], 1, "{refusal}");
    assert_eq!(refusal["unsettled"], 1, "{refusal}");

    let report = sweep(&env);
    assert_eq!(report["orphans"][0]["from"], "terminating", "{report}");
    assert_eq!(report["orphans"][0]["to"], "ended", "{report}");
    assert!(env.wait_none_marked(), "{:?}", env.marked());
    assert!(env.assert_kills_authorized() > 0);
    assert_open(&env, "after the sweep");
}

/// The same in `killing`: the owner is SIGKILLed the moment the ledger
/// shows its teardown in `killing` (a race the test may lose; it retries,
/// then says it skipped).
#[test]
fn dispatch_refused_while_a_teardown_is_interrupted_in_killing_and_reopened_by_the_sweep() {
    for attempt in 1..=5 {
        let Some(env) = Env::new("session") else {
            return;
        };
        // Many members make the kill and its verification take a while.
        let mut run = KillOnDrop(env.spawn_run(
            &["--grace", "100ms", "--quiet"],
            "trap '' TERM; for i in $(seq 40); do sleep 600 & done; wait",
        ));
        assert!(env.wait_marked(41), "{:?}", env.marked().len());
        let conn = open(&env.ledger_path());
        let state = || -> String {
            conn.query_row("SELECT state FROM trees WHERE id = 1", [], |r| r.get(0))
                .unwrap_or_default()
        };
        signal(run.id(), rustix::process::Signal::TERM);
        // A tight poll (no sleep: the window is milliseconds), bounded.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let s = state();
            if s == "killing" {
                signal(run.id(), rustix::process::Signal::KILL);
                break;
            }
            if s == "ended" || Instant::now() >= deadline {
                break;
            }
        }
        wait_child(&mut run.0, Duration::from_secs(20)).expect("the owner exits");
        if state() != "killing" {
            crate::util::say(&format!(
                "attempt {attempt}: the teardown left killing before its owner died"
            ));
            continue;
        }
        drop(conn);
        assert_refused(
            &env,
            "teardown interrupted in state killing and its owner is gone",
        );
        let report = sweep(&env);
        assert_eq!(report["orphans"][0]["from"], "killing", "{report}");
        // `vanished` when the group's leader, killed before the owner died,
        // has had its pid reused meanwhile (other tests rewind
        // `ns_last_pid`): the sweep then signals nothing, rightly.
        assert!(
            ["ended", "vanished"].contains(&report["orphans"][0]["to"].as_str().unwrap_or("")),
            "{report}"
        );
        assert!(env.wait_none_marked(), "{:?}", env.marked());
        assert_open(&env, "after the sweep");
        return;
    }
    skip("never caught a teardown in killing in 5 attempts");
}

/// A tree `ambiguous` in the ledger refuses dispatch by the ledger alone:
/// the forced kill is skipped because its authorization cannot be committed
/// (the test holds the write lock), the ledger takes the ambiguity once the
/// lock is released, and the unsettled marker is then removed (lost). An
/// operator's resolution reopens dispatch.
#[test]
fn dispatch_refused_while_a_tree_is_ambiguous_in_the_ledger_and_reopened_by_resolve() {
    // The cgroup boundary: its freeze writes no signal row, so the held
    // lock meets the authorization first and later evidence still lands.
    let Some(env) = Env::new("cgroup") else {
        return;
    };
    let mut cmd = env.cmd();
    cmd.env("TREEWARDEN_BUSY_TIMEOUT", "3s")
        .args(["run", "--grace", "2s", "--quiet", "--"])
        .args(env.marked_argv("trap '' TERM; sleep 600 & wait"));
    let err_path = env.dir.path().join("ambiguous-run.stderr");
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(File::create(&err_path).expect("stderr file"));
    let mut run = KillOnDrop(cmd.spawn().expect("run"));
    assert!(env.wait_marked(2), "{:?}", env.marked());
    let survivors = env.marked();

    let conn = open(&env.ledger_path());
    signal(run.id(), rustix::process::Signal::TERM);
    assert!(
        wait_until(Duration::from_secs(20), || count(
            &conn,
            "SELECT count(*) FROM events WHERE tree = 1 AND kind = 'signal.sent'
             AND json_extract(data, '$.signal') = 'SIGTERM'"
        ) > 0),
        "the SIGTERM step is recorded"
    );
    conn.execute_batch("BEGIN IMMEDIATE")
        .expect("take the write lock");
    let marker = env.data_dir().join("unsettled").join("tree-1");
    let marked = wait_until(Duration::from_secs(30), || marker.exists());
    conn.execute_batch("ROLLBACK").expect("release the lock");
    drop(conn);
    assert!(
        marked,
        "the authorization failed and the marker was written"
    );
    let status = wait_child(&mut run.0, Duration::from_secs(30)).expect("run exits");
    let err = std::fs::read_to_string(&err_path).unwrap_or_default();
    assert_eq!(status.code(), Some(125), "{err}");
    assert!(err.contains("forced kill skipped"), "{err}");
    assert!(
        survivors.iter().all(|p| pid_alive(*p)),
        "survivors are left alive as evidence"
    );
    assert_eq!(
        tree_state(&env, 1).as_deref(),
        Some("ambiguous"),
        "the ledger took the ambiguity once the lock was gone: {err}"
    );

    // Both channels hold the door; the one tree counts once.
    let text = std::fs::read_to_string(&marker).expect("the marker stays");
    assert!(text.contains("forced kill skipped"), "{text}");
    assert_refused(&env, "forced kill skipped");
    assert_eq!(last_refusal(&env)["unsettled"], 1);

    // The marker is lost: the ledger alone still refuses, naming the
    // reason the row keeps (`set_state` to ambiguous writes it as the note).
    std::fs::remove_file(&marker).expect("remove the marker");
    assert_refused(&env, "forced kill skipped");
    assert_eq!(last_refusal(&env)["unsettled"], 1);

    // A sweep that cannot commit its authorization settles nothing: it
    // exits non-zero (its report is not settled) and dispatch stays closed.
    let terms = || {
        count(
            &open(&env.ledger_path()),
            "SELECT count(*) FROM events WHERE tree = 1 AND kind = 'signal.sent'
             AND json_extract(data, '$.signal') = 'SIGTERM'",
        )
    };
    let before = terms();
    let mut cmd = env.cmd();
    cmd.env("TREEWARDEN_BUSY_TIMEOUT", "1s")
        .args(["sweep", "--grace", "2s"]);
    let err_path = env.dir.path().join("failing-sweep.stderr");
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(File::create(&err_path).expect("stderr file"));
    let mut sweeping = KillOnDrop(cmd.spawn().expect("sweep"));
    assert!(
        wait_until(Duration::from_secs(20), || terms() > before),
        "the sweep's SIGTERM step is recorded"
    );
    let conn = open(&env.ledger_path());
    conn.execute_batch("BEGIN IMMEDIATE")
        .expect("take the write lock");
    let marked = wait_until(Duration::from_secs(30), || marker.exists());
    conn.execute_batch("ROLLBACK").expect("release the lock");
    drop(conn);
    assert!(marked, "the sweep's authorization failed");
    let status = wait_child(&mut sweeping.0, Duration::from_secs(30)).expect("sweep exits");
    let err = std::fs::read_to_string(&err_path).unwrap_or_default();
    assert_eq!(status.code(), Some(125), "an unsettled sweep fails: {err}");
    assert!(
        survivors.iter().all(|p| pid_alive(*p)),
        "survivors are left alive as evidence"
    );
    assert_refused(&env, "forced kill skipped");

    // The operator ends the survivors by hand and records the decision.
    env.end_leftovers();
    let (code, err) = tw(
        &env,
        &["resolve", "1", "--note", "ended by hand after inspection"],
    );
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(tree_state(&env, 1).as_deref(), Some("resolved"));
    assert_open(&env, "after resolve");
}

/// A marker left for a tree the ledger holds as ended (a teardown that
/// raced another) keeps dispatch closed while a survivor it names lives,
/// and is dropped by the gate once none does.
#[test]
fn a_stale_marker_of_an_ended_tree_closes_dispatch_only_while_a_survivor_it_names_lives() {
    let Some(env) = Env::new("session") else {
        return;
    };
    assert_open(&env, "a fresh ledger");
    assert_eq!(tree_state(&env, 1).as_deref(), Some("ended"));
    let mut survivor = KillOnDrop(
        env.cmd_for("sleep")
            .arg("600")
            .env("TW_TEST_MARK", &env.mark)
            .stdin(Stdio::null())
            .spawn()
            .expect("survivor"),
    );
    let pid = survivor.id() as i32;
    let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").expect("boot id");
    // What `markers::write` leaves: the reason and the survivors by identity.
    let marker = json!({
        "reason": "teardown raced another",
        "survivors": [{
            "pid": pid,
            "start_ticks": start_ticks(pid).expect("start ticks"),
            "boot_id": boot_id.trim(),
        }],
    });
    let dir = env.data_dir().join("unsettled");
    std::fs::create_dir_all(&dir).expect("unsettled dir");
    let path = dir.join("tree-1");
    std::fs::write(&path, marker.to_string()).expect("marker");

    assert_refused(&env, "(1 survivors named by its marker still live)");
    assert!(path.exists(), "kept while its survivor lives");

    survivor.0.kill().expect("kill the survivor by pid");
    survivor.0.wait().expect("reap it");
    assert_open(&env, "every survivor the marker names is gone");
    assert!(!path.exists(), "the stale marker is dropped");
}

/// An owner that died but was not yet reaped by its parent (a zombie still
/// holding its pid, with its own start time) is gone: it runs nothing and
/// can tear nothing down, so the sweep takes its tree.
#[test]
fn an_owner_dead_but_not_yet_reaped_is_gone() {
    let Some(env) = Env::new("session") else {
        return;
    };
    let mut run = KillOnDrop(env.spawn_run(&["--grace", "100ms", "--quiet"], "sleep 600 & wait"));
    assert!(env.wait_marked(2), "{:?}", env.marked());
    let owner = run.id() as i32;
    signal(run.id(), rustix::process::Signal::KILL);
    // The test is its parent and does not reap it yet.
    let state = || {
        std::fs::read_to_string(format!("/proc/{owner}/stat"))
            .ok()
            .and_then(|s| {
                s.rsplit_once(')')
                    .and_then(|(_, r)| r.split_whitespace().next().map(String::from))
            })
    };
    assert!(
        wait_until(Duration::from_secs(10), || state().as_deref() == Some("Z")),
        "the owner is a zombie: {:?}",
        state()
    );
    let report = sweep(&env);
    assert_eq!(report["owned"], 0, "{report}");
    assert_eq!(report["orphans"][0]["tree"], 1, "{report}");
    assert!(env.wait_none_marked(), "survivors: {:?}", env.marked());
    assert_eq!(
        state().as_deref(),
        Some("Z"),
        "still unreaped during the sweep"
    );
    wait_child(&mut run.0, Duration::from_secs(5)).expect("reap the owner");
}
