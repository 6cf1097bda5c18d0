//! Sealed evidence (issue 28): `seal setup` prints the verification key
//! once and keeps only the current epoch's key on the host; every epoch is
//! sealed (by `serve` on its own timer, or `seal now`); `verify --seal-key`
//! proves the seals on a live ledger and on an NDJSON export alone, and
//! names the epoch of each attack done the way root would do it: the
//! triggers dropped with the sqlite3 API, the chain recomputed with the
//! documented recipe (the forger of `rules.rs`), seals made with the key
//! root finds in the key file.
//!
//! Every ledger here is made by the real binary with a 1 s interval.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use hmac::{Hmac, KeyInit, Mac};
use rusqlite::params;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::custody::Env;
use crate::rules::{forger, open, recipe_hash};
use crate::util::{KillOnDrop, bin, signal, wait_child, wait_until};

// ---------------------------------------------------------------------------
// The documented recipe (src/ledger/seal.rs), written again here.

pub(crate) fn key0(seed_hex: &str) -> [u8; 32] {
    let seed = hex::decode(seed_hex.trim()).expect("the key is hex");
    let mut h = Sha256::new();
    h.update(b"treewarden seal v1 key 0");
    h.update(&seed);
    h.finalize().into()
}

pub(crate) fn next_key(key: &[u8; 32]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"treewarden seal v1 next");
    h.update(key);
    h.finalize().into()
}

/// `hex(hmac_sha256(key, canonical JSON of data without "mac"))`.
pub(crate) fn recipe_mac(key: &[u8; 32], data: &Value) -> String {
    let mut data = data.clone();
    data.as_object_mut().expect("object").remove("mac");
    let text = serde_json::to_string(&data).expect("json");
    let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(key).expect("any key length");
    mac.update(text.as_bytes());
    hex::encode(mac.finalize().into_bytes())
}

// ---------------------------------------------------------------------------
// Helpers

pub(crate) fn tw(data_dir: &Path, args: &[&str]) -> std::process::Output {
    Command::new(bin())
        .arg("--data-dir")
        .arg(data_dir)
        .args(args)
        .env_remove("TREEWARDEN_DATA_DIR")
        .env_remove("TREEWARDEN_LOG")
        .env_remove("TREEWARDEN_SEAL_KEY")
        .env("TREEWARDEN_BOUNDARY", "session")
        .stdin(Stdio::null())
        .output()
        .expect("run treewarden")
}

pub(crate) fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// `seal setup --interval 1s`: the key it printed (the whole of stdout).
pub(crate) fn setup(data_dir: &Path) -> String {
    let out = tw(data_dir, &["seal", "setup", "--interval", "1s"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let key = text(&out.stdout).trim().to_string();
    assert_eq!(key.len(), 64, "the key alone on stdout: {key:?}");
    assert_eq!(text(&out.stdout).lines().count(), 1);
    key
}

/// A workload event: `run -- sh -c 'exit CODE'`.
pub(crate) fn work(data_dir: &Path, code: i32) {
    let out = tw(
        data_dir,
        &["run", "--quiet", "--", "sh", "-c", &format!("exit {code}")],
    );
    assert_eq!(out.status.code(), Some(code), "{}", text(&out.stderr));
}

pub(crate) fn seals(data_dir: &Path) -> Vec<Value> {
    let conn = open(&data_dir.join("ledger.db"));
    let mut stmt = conn
        .prepare("SELECT data FROM events WHERE kind = 'ledger.seal' ORDER BY seq")
        .expect("prepare");
    stmt.query_map([], |r| r.get::<_, String>(0))
        .expect("query")
        .map(|t| serde_json::from_str(&t.expect("row")).expect("json"))
        .collect()
}

pub(crate) fn epochs(data_dir: &Path) -> Vec<u64> {
    seals(data_dir)
        .iter()
        .filter_map(|s| s["epoch"].as_u64())
        .collect()
}

/// `seal now` until a seal newer than the newest one now is made
/// (bounded): between tries it waits for the time `seal now` said the next
/// seal is due, so it starts two or three processes per seal, not hundreds.
pub(crate) fn seal_next(data_dir: &Path) {
    let before = epochs(data_dir).last().copied();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let out = tw(data_dir, &["seal", "now"]);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        if epochs(data_dir).last().copied() > before {
            return;
        }
        assert!(Instant::now() < deadline, "an epoch ended and was sealed");
        wait_for_due(&text(&out.stdout));
    }
}

/// Waits (bounded) for the time `seal now` said the next seal is due.
pub(crate) fn wait_for_due(said: &str) {
    let due = said
        .rsplit("next seal due at ")
        .next()
        .and_then(|t| humantime::parse_rfc3339(t.trim()).ok())
        .unwrap_or_else(|| panic!("seal now says when the next seal is due: {said}"));
    assert!(
        wait_until(Duration::from_secs(5), || std::time::SystemTime::now()
            >= due),
        "the clock reaches {said}"
    );
}

/// `verify ARGS` on a data dir: (exit code, stdout, stderr).
pub(crate) fn verify(data_dir: &Path, args: &[&str]) -> (Option<i32>, String, String) {
    let out = tw(data_dir, &[&["verify"], args].concat());
    (out.status.code(), text(&out.stdout), text(&out.stderr))
}

fn assert_fails(data_dir: &Path, key: &str, what: &str) -> String {
    let (code, out, err) = verify(data_dir, &["--seal-key", key]);
    assert_eq!(
        code,
        Some(1),
        "verify should fail: stdout {out} stderr {err}"
    );
    assert!(
        err.contains(what),
        "verify should name {what:?}, said: {err}"
    );
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    err
}

/// `export` then `verify --export`: the same stderr line as `verify` on
/// the ledger (the verdict, word for word).
fn assert_export_agrees(data_dir: &Path, key: &str, ledger_said: &str) {
    let out = tw(data_dir, &["export"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let file = data_dir.with_extension("ndjson");
    std::fs::write(&file, &out.stdout).expect("write the export");
    let scratch = tempfile::tempdir().expect("temp dir");
    // No data dir at all: the file alone.
    let (code, stdout, err) = verify(
        &scratch.path().join("none"),
        &["--seal-key", key, "--export", file.to_str().expect("utf-8")],
    );
    assert_eq!(code, Some(1), "the export fails too: {stdout} {err}");
    assert_eq!(err, ledger_said, "the same verdict on the export");
}

/// A copy of a sealed data dir (ledger checkpointed into the file, key file).
pub(crate) fn copy_sealed(data_dir: &Path, parent: &Path, name: &str) -> PathBuf {
    let conn = open(&data_dir.join("ledger.db"));
    conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
        .expect("checkpoint");
    drop(conn);
    let dir = parent.join(name);
    std::fs::create_dir(&dir).expect("copy dir");
    for f in ["ledger.db", "seal.key"] {
        std::fs::copy(data_dir.join(f), dir.join(f)).expect("copy");
    }
    dir
}

pub(crate) type Ev = (String, Option<i64>, String, Value);

pub(crate) fn all_events(conn: &rusqlite::Connection) -> Vec<Ev> {
    crate::rules::events(conn)
        .into_iter()
        .map(|(_, at, tree, kind, data, _, _)| {
            (at, tree, kind, serde_json::from_str(&data).expect("json"))
        })
        .collect()
}

/// What root does with the file: drop the event triggers, write `evs` as
/// the whole chain from seq 1 with every hash recomputed by the recipe.
/// With `reseal = Some((key, from))`, every seal of epoch `from` or later
/// is made again over the new chain with `key` (a key root holds).
pub(crate) fn rewrite(conn: &rusqlite::Connection, evs: &[Ev], reseal: Option<(&[u8; 32], u64)>) {
    for t in [
        "events_gapless",
        "events_linked",
        "events_no_update",
        "events_no_delete",
    ] {
        conn.execute_batch(&format!("DROP TRIGGER IF EXISTS {t}"))
            .expect("drop a trigger");
    }
    conn.execute_batch("DELETE FROM events").expect("delete");
    let mut prev = "0".repeat(64);
    for (i, (at, tree, kind, data)) in evs.iter().enumerate() {
        let seq = i as i64 + 1;
        let mut data = data.clone();
        if let Some((key, from)) = reseal
            && kind == "ledger.seal"
            && data["epoch"].as_u64().is_some_and(|e| e >= from)
        {
            data["head_seq"] = (seq - 1).into();
            data["head_hash"] = prev.clone().into();
            data["mac"] = recipe_mac(key, &data).into();
        }
        let text = serde_json::to_string(&data).expect("json");
        let hash = recipe_hash(&prev, seq, at, *tree, kind, &text);
        conn.execute(
            "INSERT INTO events (seq, at, tree, kind, data, prev_hash, hash) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
            params![seq, at, tree, kind, text, prev, hash],
        )
        .expect("insert");
        prev = hash;
    }
    assert!(
        crate::rules::chain_consistent(conn),
        "precondition: the forger recomputed every hash"
    );
}

/// The key root finds in the key file (the current epoch's).
pub(crate) fn key_in_file(data_dir: &Path) -> (u64, [u8; 32]) {
    let text = std::fs::read_to_string(data_dir.join("seal.key")).expect("key file");
    let record: Value = serde_json::from_str(text.trim()).expect("record");
    let key = hex::decode(record["key"].as_str().expect("key")).expect("hex");
    (
        record["epoch"].as_u64().expect("epoch"),
        key.try_into().expect("32 bytes"),
    )
}

/// A ledger with sealing set up and several sealed epochs, events between
/// them, closed cleanly at the end: (data dir, key).
pub(crate) fn sealed_ledger(env: &Env) -> (PathBuf, String) {
    let data = env.data_dir();
    work(&data, 0);
    let key = setup(&data);
    for code in 1..=3 {
        work(&data, code);
        seal_next(&data);
    }
    let out = tw(&data, &["seal", "close"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("clean close"),
        "{}",
        text(&out.stdout)
    );
    let got = epochs(&data);
    assert!(got.len() >= 4, "several seals: {got:?}");
    assert_eq!(
        got,
        (0..got.len() as u64).collect::<Vec<_>>(),
        "consecutive epochs from 0"
    );
    (data, key)
}

/// The seq of the first event after the first `seal` whose kind is `kind`,
/// and the epoch of the first seal after that event.
fn event_and_next_seal(evs: &[Ev], kind: &str, nth: usize) -> (usize, u64) {
    let at = evs
        .iter()
        .enumerate()
        .filter(|(_, e)| e.2 == kind)
        .nth(nth)
        .map(|(i, _)| i)
        .expect("such an event");
    let epoch = evs[at..]
        .iter()
        .find(|e| e.2 == "ledger.seal" && e.3["op"] != "setup")
        .and_then(|e| e.3["epoch"].as_u64())
        .expect("a seal after it");
    (at, epoch)
}

// ---------------------------------------------------------------------------
// Tests

/// `treewarden serve` on 127.0.0.1:0 in `env` (its log in serve.stderr),
/// up when its ready file is written; ended by its pid on drop.
pub(crate) fn start_serve(env: &Env) -> KillOnDrop {
    let ready = env.dir().join("addr");
    let err = std::fs::File::create(env.dir().join("serve.stderr")).expect("stderr");
    let _ = std::fs::remove_file(&ready);
    let child = env
        .cmd()
        .args(["serve", "--listen", "127.0.0.1:0", "--ready-file"])
        .arg(&ready)
        .env("TREEWARDEN_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(err)
        .spawn()
        .expect("serve");
    let child = KillOnDrop(child);
    assert!(
        wait_until(Duration::from_secs(30), || ready.exists()),
        "serve came up"
    );
    child
}

/// `GET /api/export` (what the dashboard's link and the runbook's API
/// route fetch) is the same export as `treewarden export`: a whole NDJSON
/// export of a sealed, live ledger ends with its own time, and verifies
/// on its own with the key (it once carried no trailer and failed).
#[test]
fn the_api_export_of_a_live_sealed_ledger_verifies_on_its_own() {
    let env = Env::new("session").expect("the session boundary always forms");
    let data = env.data_dir();
    work(&data, 0);
    let key = setup(&data);
    let _server = start_serve(&env);
    assert!(wait_until(Duration::from_secs(20), || epochs(&data).len() >= 2));
    let addr = std::fs::read_to_string(env.dir().join("addr")).expect("ready file");
    let token = std::fs::read_to_string(data.join("api-token")).expect("token");
    let response = reqwest::blocking::Client::new()
        .get(format!("http://{}/api/export", addr.trim()))
        .bearer_auth(token.trim())
        .send()
        .expect("GET /api/export");
    // The download's name (the dashboard's link too) names host and time.
    let disposition = response
        .headers()
        .get("content-disposition")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").expect("hostname");
    assert!(
        disposition.starts_with(&format!(
            "attachment; filename=\"treewarden-audit-{}-",
            host.trim()
        )) && disposition.ends_with("Z.ndjson\""),
        "{disposition}"
    );
    let body = response.text().expect("body");
    let last = body.lines().last().expect("lines");
    assert!(last.starts_with("{\"exported\":"), "{last}");
    let file = env.dir().join("api-export.ndjson");
    std::fs::write(&file, &body).expect("write the export");
    let scratch = tempfile::tempdir().expect("temp dir");
    let (code, out, err) = verify(
        &scratch.path().join("none"),
        &[
            "--seal-key",
            &key,
            "--export",
            file.to_str().expect("utf-8"),
        ],
    );
    assert_eq!(
        code,
        Some(0),
        "the API's export verifies alone: {out} {err}"
    );
}

/// Root's edit of the live ledger, in one write transaction of its own
/// (the service waits for the lock, then writes and seals on top).
fn as_root_live(data_dir: &Path, f: impl FnOnce(&rusqlite::Connection)) {
    let conn = open(&data_dir.join("ledger.db"));
    conn.execute_batch("BEGIN IMMEDIATE")
        .expect("root takes the write lock");
    f(&conn);
    conn.execute_batch("COMMIT").expect("commit the forgery");
}

/// Root's forgery of a live ledger: returns what `verify` must name.
type Attack = fn(&rusqlite::Connection, &Path) -> String;

#[test]
fn attacks_on_a_live_ledger_are_named_while_the_service_seals_on() {
    // Each attack on its own live ledger: serve sealing every second,
    // root rewriting the file under it, the service writing and sealing on.
    let attacks: [(&str, Attack); 4] = [
        ("edited", |conn, _| {
            let mut evs = all_events(conn);
            let (at, epoch) = event_and_next_seal(&evs, "tree.ended", 1);
            assert_eq!(evs[at].3["exit"]["code"], 1, "ground truth: exit 1");
            evs[at].3["exit"]["code"] = 0.into();
            rewrite(conn, &evs, None);
            format!("epoch {epoch}: the sealed head")
        }),
        ("resealed", |conn, data| {
            let (_, later) = key_in_file(data);
            let mut evs = all_events(conn);
            let (at, epoch) = event_and_next_seal(&evs, "tree.ended", 1);
            evs[at].3["exit"]["code"] = 0.into();
            rewrite(conn, &evs, Some((&later, epoch)));
            format!("epoch {epoch}: the seal's MAC does not match")
        }),
        ("stripped", |conn, _| {
            let evs: Vec<Ev> = all_events(conn)
                .into_iter()
                .filter(|e| {
                    !(e.2 == "ledger.seal" && [1, 2].contains(&e.3["epoch"].as_u64().unwrap_or(99)))
                })
                .collect();
            rewrite(conn, &evs, None);
            "epochs 1 to 2 are not sealed".into()
        }),
        ("truncated", |conn, _| {
            conn.execute_batch("DROP TRIGGER events_no_delete")
                .expect("drop");
            let cut: i64 = conn
                .query_row(
                    "SELECT seq FROM events WHERE kind = 'ledger.seal' AND json_extract(data, '$.epoch') = 1",
                    [],
                    |r| r.get(0),
                )
                .expect("seal 1");
            conn.execute("DELETE FROM events WHERE seq >= ?1", [cut])
                .expect("truncate");
            "epochs 1 to ".into()
        }),
    ];
    for (name, attack) in attacks {
        let env = Env::new("session").expect("the session boundary always forms");
        let data = env.data_dir();
        work(&data, 0);
        let key = setup(&data);
        let _server = start_serve(&env);
        let log = || std::fs::read_to_string(env.dir().join("serve.stderr")).unwrap_or_default();
        // Tree 2 exits 1 between seals, then three more epochs pass.
        assert!(wait_until(Duration::from_secs(20), || epochs(&data).len() >= 2));
        work(&data, 1);
        let n = epochs(&data).len();
        assert!(
            wait_until(Duration::from_secs(20), || epochs(&data).len() >= n + 3),
            "[{name}] sealed on: {}",
            log()
        );
        let (code, out, err) = verify(&data, &["--seal-key", &key]);
        assert_eq!(code, Some(0), "[{name}] untouched and live: {out} {err}");
        let mut what = String::new();
        as_root_live(&data, |conn| what = attack(conn, &data));
        // The host goes on: new writes, new seals on top of the forgery.
        work(&data, 5);
        let n = epochs(&data).len();
        assert!(
            wait_until(Duration::from_secs(20), || epochs(&data).len() > n),
            "[{name}] the service seals on after the forgery: {}",
            log()
        );
        let said = assert_fails(&data, &key, &what);
        assert!(said.contains("epoch"), "[{name}] names the epoch: {said}");
        assert_export_agrees(&data, &key, &said);
    }
}

#[test]
fn each_attack_is_detected_and_named_with_its_epoch_on_the_ledger_and_its_export() {
    let env = Env::new("session").expect("the session boundary always forms");
    let (data, key) = sealed_ledger(&env);
    let (code, out, err) = verify(&data, &["--seal-key", &key]);
    assert_eq!(code, Some(0), "the untouched ledger verifies: {out} {err}");
    assert!(
        out.contains("sealed: epochs 0 to") && out.contains("clean close"),
        "{out}"
    );
    let root = env.dir().join("forged");
    std::fs::create_dir(&root).expect("dir");

    // 1. An event edited, the chain recomputed: the first seal above it
    // names it (its head is not this chain's).
    let dir = copy_sealed(&data, &root, "edited");
    let conn = forger(&dir, &[]);
    let mut evs = all_events(&conn);
    let (at, epoch) = event_and_next_seal(&evs, "tree.ended", 1);
    assert_eq!(
        evs[at].3["exit"]["code"], 1,
        "tree 2 exited 1 (ground truth)"
    );
    evs[at].3["exit"]["code"] = 0.into();
    rewrite(&conn, &evs, None);
    // Thorough: the row the event made is edited to match (else `verify`
    // names the row that disagrees with its event).
    conn.execute("UPDATE trees SET exit_code = 0 WHERE id = ?1", [evs[at].1])
        .expect("edit the row too");
    drop(conn);
    let said = assert_fails(&dir, &key, &format!("epoch {epoch}: the sealed head"));
    assert_export_agrees(&dir, &key, &said);
    // Without the key the edit passes: the chain alone cannot tell.
    let (code, _, err) = verify(&dir, &[]);
    assert_eq!(
        code,
        Some(0),
        "the recomputed chain verifies without a key: {err}"
    );

    // 2. The same edit, every later seal made again with the key root
    // finds in the key file (a later epoch's): the first resealed epoch's
    // MAC fails.
    let dir = copy_sealed(&data, &root, "resealed");
    let (file_epoch, file_key) = key_in_file(&dir);
    assert!(file_epoch > epoch, "the file holds a later key");
    let conn = forger(&dir, &[]);
    let mut evs = all_events(&conn);
    evs[at].3["exit"]["code"] = 0.into();
    rewrite(&conn, &evs, Some((&file_key, epoch)));
    drop(conn);
    let said = assert_fails(
        &dir,
        &key,
        &format!("epoch {epoch}: the seal's MAC does not match"),
    );
    assert_export_agrees(&dir, &key, &said);

    // 3. Seals stripped: some (a gap with its time range), all (no seal),
    // and the setup too (the key matches no seal).
    let dir = copy_sealed(&data, &root, "stripped-some");
    let conn = forger(&dir, &[]);
    let evs: Vec<Ev> = all_events(&conn)
        .into_iter()
        .filter(|e| {
            !(e.2 == "ledger.seal" && [1, 2].contains(&e.3["epoch"].as_u64().unwrap_or(99)))
        })
        .collect();
    rewrite(&conn, &evs, None);
    drop(conn);
    let said = assert_fails(&dir, &key, "epochs 1 to 2 are not sealed");
    assert_export_agrees(&dir, &key, &said);

    let dir = copy_sealed(&data, &root, "stripped-all");
    let conn = forger(&dir, &[]);
    let evs: Vec<Ev> = all_events(&conn)
        .into_iter()
        .filter(|e| !(e.2 == "ledger.seal" && e.3["op"] != "setup"))
        .collect();
    rewrite(&conn, &evs, None);
    drop(conn);
    let said = assert_fails(&dir, &key, "holds no seal");
    assert_export_agrees(&dir, &key, &said);

    let dir = copy_sealed(&data, &root, "stripped-setup");
    let conn = forger(&dir, &[]);
    let evs: Vec<Ev> = all_events(&conn)
        .into_iter()
        .filter(|e| e.2 != "ledger.seal")
        .collect();
    rewrite(&conn, &evs, None);
    drop(conn);
    let said = assert_fails(&dir, &key, "the seal key matches no seal");
    assert_export_agrees(&dir, &key, &said);

    // 4. Reordered: two events below a seal swapped, and two seals swapped.
    let dir = copy_sealed(&data, &root, "reordered");
    let conn = forger(&dir, &[]);
    let mut evs = all_events(&conn);
    let (at, epoch) = event_and_next_seal(&evs, "tree.created", 2);
    evs.swap(at, at + 1);
    rewrite(&conn, &evs, None);
    drop(conn);
    let said = assert_fails(&dir, &key, &format!("epoch {epoch}: the sealed head"));
    assert_export_agrees(&dir, &key, &said);

    let dir = copy_sealed(&data, &root, "seals-reordered");
    let conn = forger(&dir, &[]);
    let mut evs = all_events(&conn);
    let s1 = evs
        .iter()
        .position(|e| e.2 == "ledger.seal" && e.3["epoch"] == 1)
        .expect("seal 1");
    let s2 = evs
        .iter()
        .position(|e| e.2 == "ledger.seal" && e.3["epoch"] == 2)
        .expect("seal 2");
    evs.swap(s1, s2);
    rewrite(&conn, &evs, None);
    drop(conn);
    let said = assert_fails(&dir, &key, "epochs 1 to 1 are not sealed");
    assert_export_agrees(&dir, &key, &said);

    // 5. Truncated and continued: everything from seal 1 on deleted, then
    // the real binary writes on and seals with the key the host still has.
    let dir = copy_sealed(&data, &root, "truncated");
    let conn = forger(&dir, &["events_no_delete"]);
    let cut: i64 = conn
        .query_row(
            "SELECT seq FROM events WHERE kind = 'ledger.seal' AND json_extract(data, '$.epoch') = 1",
            [],
            |r| r.get(0),
        )
        .expect("seal 1");
    conn.execute("DELETE FROM events WHERE seq >= ?1", [cut])
        .expect("truncate");
    drop(conn);
    work(&dir, 42);
    seal_next(&dir);
    let said = assert_fails(&dir, &key, "epochs 1 to ");
    assert!(said.contains("are not sealed"), "{said}");
    assert_export_agrees(&dir, &key, &said);

    // 6. A key that is not this ledger's.
    let wrong = "ab".repeat(32);
    let said = assert_fails(&data, &wrong, "does not match this ledger's seal setup");
    assert_export_agrees(&data, &wrong, &said);
    // And a ledger never sealed, checked with a key (#15425).
    let plain = env.dir().join("plain");
    work(&plain, 0);
    assert_fails(&plain, &key, "the seal key matches no seal");
    let out = tw(&plain, &["export"]);
    assert!(
        !text(&out.stdout).contains("\"exported\""),
        "an unsealed ledger's export is the plain NDJSON"
    );
}

#[test]
fn a_live_sealed_service_verifies_from_one_snapshot_and_an_unclean_stop_goes_stale() {
    let env = Env::new("session").expect("the session boundary always forms");
    let data = env.data_dir();
    work(&data, 0);
    let key = setup(&data);
    let serve = || start_serve(&env);
    let log = || std::fs::read_to_string(env.dir().join("serve.stderr")).unwrap_or_default();
    let mut server = serve();
    // The service seals on its own: epochs follow one another.
    assert!(
        wait_until(Duration::from_secs(20), || epochs(&data).len() >= 3),
        "the service sealed three epochs: {:?} {}",
        epochs(&data),
        log()
    );
    // Live: while a writer adds events and the service seals, every verify
    // reads one snapshot and passes (#27532).
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (stop, data) = (stop.clone(), data.clone());
        std::thread::spawn(move || {
            let mut n = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                work(&data, 0);
                n += 1;
            }
            n
        })
    };
    let started = Instant::now();
    let mut verified = 0;
    while started.elapsed() < Duration::from_secs(4) {
        let (code, out, err) = verify(&data, &["--seal-key", &key]);
        assert_eq!(code, Some(0), "live verify: {out} {err} {}", log());
        verified += 1;
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let written = writer.join().expect("writer");
    assert!(
        verified >= 2 && written >= 2,
        "{verified} verifies during {written} runs"
    );
    // The export of the live ledger gives the same verdict.
    let out = tw(&data, &["export"]);
    let file = env.dir().join("live.ndjson");
    std::fs::write(&file, &out.stdout).expect("export");
    let (code, out, err) = verify(
        &env.dir().join("none"),
        &[
            "--seal-key",
            &key,
            "--export",
            file.to_str().expect("utf-8"),
        ],
    );
    assert_eq!(code, Some(0), "the live export verifies: {out} {err}");

    // A clean stop (SIGTERM) closes: verify asks for no fresher seal.
    let pid = server.id();
    signal(pid, rustix::process::Signal::TERM);
    wait_child(&mut server.0, Duration::from_secs(60)).expect("serve exits");
    let closed = seals(&data).last().cloned().expect("a seal");
    assert_eq!(
        closed["op"],
        "close",
        "the shutdown closed: {closed} {}",
        log()
    );
    let made = Instant::now();
    assert!(wait_until(Duration::from_secs(10), || made.elapsed()
        > Duration::from_secs(3)));
    let (code, out, err) = verify(&data, &["--seal-key", &key]);
    assert_eq!(code, Some(0), "closed, so not stale: {out} {err}");

    // Started again, it seals on (the epochs while it was down are late),
    // then a SIGKILL: no close, and once two intervals pass verify says
    // which epoch is overdue.
    let mut server = serve();
    let after_close = epochs(&data).len();
    assert!(
        wait_until(Duration::from_secs(20), || epochs(&data).len()
            > after_close + 1),
        "sealing resumed: {}",
        log()
    );
    let (code, out, err) = verify(&data, &["--seal-key", &key]);
    assert_eq!(code, Some(0), "resumed: {out} {err}");
    assert!(
        !out.contains(" 0 late"),
        "the epochs it was down in are late: {out}"
    );
    signal(server.id(), rustix::process::Signal::KILL);
    wait_child(&mut server.0, Duration::from_secs(10)).expect("killed");
    let last = *epochs(&data).last().expect("seals");
    let mut said = String::new();
    assert!(
        wait_until(Duration::from_secs(15), || {
            let (code, _, err) = verify(&data, &["--seal-key", &key]);
            said = err;
            code == Some(1)
        }),
        "a writer stopped uncleanly goes stale"
    );
    assert!(
        said.contains(&format!("epoch {}: not sealed, and overdue", last + 1)),
        "{said}"
    );
}

#[test]
fn no_old_key_is_left_in_any_file_of_the_data_dir() {
    let env = Env::new("session").expect("the session boundary always forms");
    let data = env.data_dir();
    work(&data, 0);
    let seed = setup(&data);
    let k0 = key0(&seed);
    let files = |dir: &Path| -> Vec<(PathBuf, Vec<u8>)> {
        let mut out = Vec::new();
        let mut stack = vec![dir.to_path_buf()];
        while let Some(d) = stack.pop() {
            for entry in std::fs::read_dir(&d).expect("read dir") {
                let path = entry.expect("entry").path();
                if path.is_dir() {
                    stack.push(path);
                } else if let Ok(bytes) = std::fs::read(&path) {
                    out.push((path, bytes));
                }
            }
        }
        out
    };
    let holds = |bytes: &[u8], needle: &[u8]| bytes.windows(needle.len()).any(|w| w == needle);
    let found = |key: &[u8; 32]| -> Vec<PathBuf> {
        let hex = hex::encode(key);
        files(&data)
            .into_iter()
            .filter(|(_, b)| holds(b, hex.as_bytes()) || holds(b, key))
            .map(|(p, _)| p)
            .collect()
    };
    // Control: right after setup, key(0) is in the key file (so the search
    // can find a key), the file is 0600, and the seed is nowhere.
    assert_eq!(found(&k0), vec![data.join("seal.key")]);
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(data.join("seal.key"))
        .expect("key file")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    let seed_bytes: [u8; 32] = hex::decode(&seed).expect("hex").try_into().expect("32");
    assert!(found(&seed_bytes).is_empty(), "the seed is not on the host");

    // Epochs pass and are sealed (events between them).
    for code in 0..3 {
        work(&data, code);
        seal_next(&data);
    }
    let (epoch, current) = key_in_file(&data);
    assert!(epoch >= 3, "the key evolved: epoch {epoch}");
    let mut key = k0;
    for e in 0..epoch {
        assert!(
            found(&key).is_empty(),
            "key({e}) is gone from every file: {:?}",
            found(&key)
        );
        key = next_key(&key);
    }
    assert_eq!(key, current, "the file holds key({epoch}), derived one way");
    assert!(found(&seed_bytes).is_empty());

    // The refusals: set up twice, an interval under 1s, `seal now` on a
    // ledger without sealing; one line each, exit 2, nothing written.
    let out = tw(&data, &["seal", "setup"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("already set up"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(key_in_file(&data).1, current, "the key file is untouched");
    let plain = env.dir().join("plain");
    work(&plain, 0);
    let out = tw(&plain, &["seal", "setup", "--interval", "500ms"]);
    assert_eq!(out.status.code(), Some(2));
    let out = tw(&plain, &["seal", "now"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("not set up"),
        "{}",
        text(&out.stderr)
    );
    assert!(!plain.join("seal.key").exists());
}

/// `seal setup` on a data dir with no ledger yet makes one, as `run` and
/// `serve` do, so a runbook can set sealing up before the first start; the
/// ledger it made then takes work and verifies with the key it printed.
#[test]
fn seal_setup_on_a_fresh_data_dir_makes_the_ledger() {
    let env = Env::new("session").expect("the session boundary always forms");
    let data = env.dir().join("fresh");
    assert!(!data.exists());
    let key = setup(&data);
    assert!(data.join("ledger.db").is_file(), "the ledger was made");
    assert!(data.join("seal.key").is_file());
    work(&data, 0);
    let out = tw(&data, &["seal", "close"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let (code, out, err) = verify(&data, &["--seal-key", &key]);
    assert_eq!(code, Some(0), "{out} {err}");
    // `seal now` still needs a ledger: a mistyped --data-dir is refused.
    let missing = env.dir().join("mistyped");
    let out = tw(&missing, &["seal", "now"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(!missing.exists(), "nothing made for a command that reads");
}

#[test]
fn epochs_no_sealer_ran_in_are_sealed_late_by_the_next() {
    let env = Env::new("session").expect("the session boundary always forms");
    let data = env.data_dir();
    work(&data, 0);
    let key = setup(&data);
    let t = Instant::now();
    // No sealer for three intervals and more.
    assert!(wait_until(Duration::from_secs(10), || t.elapsed()
        > Duration::from_millis(3500)));
    let out = tw(&data, &["seal", "now"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let got = seals(&data);
    let sealed: Vec<&Value> = got.iter().filter(|s| s["op"] == "seal").collect();
    assert!(sealed.len() >= 3, "each ended epoch has its seal: {got:?}");
    assert_eq!(sealed[0]["late"], true, "epoch 0 was sealed late");
    let (code, out, err) = verify(&data, &["--seal-key", &key]);
    assert_eq!(code, Some(0), "late seals are valid seals: {out} {err}");
    assert!(out.contains("late from epoch 0"), "and are reported: {out}");
}

#[test]
fn a_prune_keeps_every_seal_and_attacks_after_it_are_still_named() {
    let env = Env::new("session").expect("the session boundary always forms");
    let (data, key) = sealed_ledger(&env);
    let before = seals(&data).len();
    // The database refuses to delete a seal, even under a prune's
    // checkpoint: root appends a checkpoint that covers everything (the
    // triggers accept an append), and inside that transaction a covered
    // tree event may go (the control) but a seal may not.
    {
        let conn = open(&data.join("ledger.db"));
        conn.execute_batch("BEGIN IMMEDIATE").expect("begin");
        let (head, prev, at): (i64, String, String) = conn
            .query_row(
                "SELECT seq, hash, at FROM events ORDER BY seq DESC LIMIT 1",
                [],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .expect("head");
        let cp = serde_json::json!({"pruned_through": head, "before": "9999-01-01T00:00:00.000Z"});
        let text = serde_json::to_string(&cp).expect("json");
        let hash = recipe_hash(&prev, head + 1, &at, None, "ledger.checkpoint", &text);
        conn.execute(
            "INSERT INTO events (seq, at, tree, kind, data, prev_hash, hash) VALUES (?1, ?2, NULL, 'ledger.checkpoint', ?3, ?4, ?5)",
            params![head + 1, at, text, prev, hash],
        )
        .expect("append a covering checkpoint");
        conn.execute("DELETE FROM events WHERE tree = 1", [])
            .expect("the control: a covered tree's events may go");
        let refused = conn.execute(
            "DELETE FROM events WHERE kind = 'ledger.seal' AND json_extract(data, '$.epoch') = 0",
            [],
        );
        assert!(
            refused.is_err_and(|e| e.to_string().contains("never a seal")),
            "migration 0007's guard refuses to delete a seal"
        );
        conn.execute_batch("ROLLBACK").expect("rollback");
    }
    let archive = env.dir().join("archive.ndjson");
    let out = tw(
        &data,
        &[
            "prune",
            "--before",
            "now",
            "--archive",
            archive.to_str().expect("utf-8"),
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).starts_with("pruned"),
        "{}",
        text(&out.stdout)
    );
    assert_eq!(seals(&data).len(), before, "no seal was pruned");
    assert!(
        !std::fs::read_to_string(&archive)
            .expect("archive")
            .contains("ledger.seal"),
        "the archive holds no seal"
    );
    {
        let conn = open(&data.join("ledger.db"));
        let refused = conn.execute(
            "DELETE FROM events WHERE kind = 'ledger.seal' AND json_extract(data, '$.op') = 'seal'",
            [],
        );
        assert!(refused.is_err(), "the guard refuses to delete a seal");
    }
    // Sealed again after the checkpoint, then: the pruned ledger, its
    // archive and its export verify with the key.
    seal_next(&data);
    let (code, out, err) = verify(
        &data,
        &[
            "--seal-key",
            &key,
            "--archive",
            archive.to_str().expect("utf-8"),
        ],
    );
    assert_eq!(code, Some(0), "pruned + sealed verifies: {out} {err}");
    assert!(out.contains("from checkpoint"), "{out}");
    let exported = tw(&data, &["export"]);
    let file = env.dir().join("pruned.ndjson");
    std::fs::write(&file, &exported.stdout).expect("export");
    let (code, out, err) = verify(
        &env.dir().join("none"),
        &[
            "--seal-key",
            &key,
            "--export",
            file.to_str().expect("utf-8"),
        ],
    );
    assert_eq!(code, Some(0), "the pruned export verifies: {out} {err}");

    let root = env.dir().join("forged");
    std::fs::create_dir(&root).expect("dir");
    // Root edits the checkpoint (say, to hide what was pruned) with the
    // chain recomputed above it: the seal after it names it. The events
    // below the checkpoint keep their stored hashes (a sparse chain), so
    // the forger recomputes only from the checkpoint on.
    let dir = copy_sealed(&data, &root, "checkpoint-edited");
    let conn = forger(&dir, &["events_no_update"]);
    let (cp, cp_data): (i64, String) = conn
        .query_row(
            "SELECT seq, data FROM events WHERE kind = 'ledger.checkpoint'",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .expect("checkpoint");
    let mut cp_data: Value = serde_json::from_str(&cp_data).expect("json");
    cp_data["trees"] = 0.into();
    conn.execute(
        "UPDATE events SET data = ?2 WHERE seq = ?1",
        params![cp, serde_json::to_string(&cp_data).expect("json")],
    )
    .expect("edit");
    crate::rules::rechain(&conn, cp);
    drop(conn);
    let epoch = seals(&dir)
        .iter()
        .filter(|s| s["op"] == "seal" && s["head_seq"].as_i64() >= Some(cp))
        .filter_map(|s| s["epoch"].as_u64())
        .next()
        .expect("a seal after the checkpoint");
    let said = assert_fails(&dir, &key, &format!("epoch {epoch}: the sealed head"));
    assert_export_agrees(&dir, &key, &said);

    // Root strips the seal that followed the prune: a gap, named.
    let dir = copy_sealed(&data, &root, "stripped-after-prune");
    let conn = forger(&dir, &["events_no_delete", "events_no_update"]);
    let last: i64 = conn
        .query_row(
            "SELECT max(seq) FROM events WHERE kind = 'ledger.seal'",
            [],
            |r| r.get(0),
        )
        .expect("last seal");
    // The newest seal (made after the checkpoint) is cut off.
    let stripped = *epochs(&dir).last().expect("seals");
    conn.execute("DELETE FROM events WHERE seq >= ?1", [last])
        .expect("strip the tail");
    drop(conn);
    // The host writes on and seals again with its (later) key.
    work(&dir, 7);
    seal_next(&dir);
    let said = assert_fails(&dir, &key, "are not sealed");
    assert!(said.contains(&format!("epochs {stripped} to")), "{said}");
    assert_export_agrees(&dir, &key, &said);
}

#[test]
fn a_crash_between_a_seals_commit_and_the_keys_overwrite_is_mended_by_the_next_sealer() {
    if !treewarden::testhook::ENABLED {
        crate::util::skip("crash points exist in debug builds only (cargo test without --release)");
        return;
    }
    let env = Env::new("session").expect("the session boundary always forms");
    let data = env.data_dir();
    work(&data, 0);
    let key = setup(&data);
    seal_next(&data);
    let (epoch, _) = key_in_file(&data);
    // The next seal commits, then the process dies before the key file
    // is overwritten: the file is one epoch behind the ledger.
    let sealed = epochs(&data).len();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let out = Command::new(bin())
            .arg("--data-dir")
            .arg(&data)
            .args(["seal", "now"])
            .env("TREEWARDEN_TEST_CRASH_AT", "seal-committed")
            .env_remove("TREEWARDEN_DATA_DIR")
            .output()
            .expect("seal now");
        if epochs(&data).len() > sealed {
            assert_eq!(out.status.code(), None, "aborted: {}", text(&out.stderr));
            break;
        }
        assert!(Instant::now() < deadline, "an epoch ended");
        wait_for_due(&text(&out.stdout));
    }
    let (behind, _) = key_in_file(&data);
    assert_eq!(behind, epoch, "the key file was not overwritten");
    let last = *epochs(&data).last().expect("seals");
    assert!(last >= behind, "the ledger is ahead of the key file");
    // The next sealer evolves past the newest seal first: no epoch is
    // sealed twice, the old key is gone, and the ledger verifies.
    let out = tw(&data, &["seal", "close"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let got = epochs(&data);
    assert_eq!(
        got,
        (0..got.len() as u64).collect::<Vec<_>>(),
        "consecutive, none twice"
    );
    let (now, _) = key_in_file(&data);
    assert!(now > last, "the key moved past the newest seal");
    let (code, out, err) = verify(&data, &["--seal-key", &key]);
    assert_eq!(code, Some(0), "{out} {err}");
}
