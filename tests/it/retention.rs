//! Retention (issue 15): `prune --before T --archive F` removes ended
//! trees' events and rows after an fsynced archive, never a live or
//! unsettled tree's; `verify` proves the rest from the `ledger.checkpoint`,
//! `verify --archive F` proves the archive chains into it; the database
//! refuses every other delete; a prune that cannot finish leaves nothing
//! half-done.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;
use treewarden::ledger::{
    IdentityRecord, Ledger, LedgerOptions, NewTree, OwnerKind, OwnerRecord, PruneRequest, TreeState,
};

use crate::custody::Env;
use crate::util::{self, parse_ndjson, wait_until};

fn tree_of(e: &Value) -> Option<i64> {
    e["tree"].as_i64()
}

fn seqs(events: &[Value]) -> Vec<i64> {
    events.iter().filter_map(|e| e["seq"].as_i64()).collect()
}

fn read_archive(path: &Path) -> Vec<Value> {
    parse_ndjson(&std::fs::read_to_string(path).expect("archive"))
}

fn verify_with(env: &Env, archives: &[&Path]) -> std::process::Output {
    let mut cmd = env.cmd();
    cmd.arg("verify");
    for a in archives {
        cmd.arg("--archive").arg(a);
    }
    cmd.output().expect("verify")
}

#[test]
fn prune_before_now_leaves_only_the_checkpoint_and_live_trees() {
    for boundary in ["session", "cgroup"] {
        let Some(env) = Env::new(boundary) else {
            continue;
        };
        let ended = |code: &str| {
            let out = env.output(&["run", "--", "sh", "-c", &format!("exit {code}")]);
            assert_eq!(out.status.code(), Some(code.parse().expect("code")));
        };
        ended("3");
        // The live tree starts between ended ones, so its events are
        // interleaved with theirs in seq order.
        let mut live = env.spawn_run(&[], "sleep 600");
        assert!(env.wait_marked(1), "[{boundary}] the live tree runs");
        let live_pids = env.marked();
        ended("4");
        ended("5");
        let before = env.export();
        let live_tree = before
            .iter()
            .filter(|e| e["kind"] == "tree.spawned")
            .find(|e| live_pids.contains(&(e["data"]["root"]["pid"].as_i64().unwrap_or(-1) as i32)))
            .and_then(tree_of)
            .expect("the live tree's tree.spawned names the marked root pid");
        let live_first = before
            .iter()
            .find(|e| tree_of(e) == Some(live_tree))
            .and_then(|e| e["seq"].as_i64())
            .expect("live tree event");
        assert!(
            before
                .iter()
                .any(|e| tree_of(e) != Some(live_tree) && e["seq"].as_i64() > Some(live_first)),
            "[{boundary}] ended trees' events come after the live tree's first"
        );

        let archive = env.dir.path().join("archive-1.ndjson");
        let out = env
            .cmd()
            .args(["prune", "--before", "now", "--archive"])
            .arg(&archive)
            .output()
            .expect("prune");
        assert!(
            out.status.success(),
            "[{boundary}] prune: {}",
            String::from_utf8_lossy(&out.stderr)
        );

        // What remains: the live tree's events (all of them) and the checkpoint.
        let after = env.export();
        let checkpoint = after.last().expect("an event remains").clone();
        assert_eq!(checkpoint["kind"], "ledger.checkpoint");
        assert_eq!(
            after
                .iter()
                .filter(|e| e["kind"] == "ledger.checkpoint")
                .count(),
            1
        );
        for e in &after[..after.len() - 1] {
            assert_eq!(
                tree_of(e),
                Some(live_tree),
                "[{boundary}] only the live tree's events remain: {e}"
            );
        }
        let live_before: Vec<&Value> = before
            .iter()
            .filter(|e| tree_of(e) == Some(live_tree))
            .collect();
        for e in &live_before {
            assert!(after.contains(e), "[{boundary}] the live tree keeps {e}");
        }
        // The archive is exactly the rest of the trail, as it was.
        let archived = read_archive(&archive);
        let want: Vec<&Value> = before
            .iter()
            .filter(|e| tree_of(e) != Some(live_tree))
            .collect();
        assert_eq!(
            archived.len(),
            want.len(),
            "[{boundary}] every pruned event archived"
        );
        assert!(archived.iter().zip(&want).all(|(a, b)| a == *b));
        assert_eq!(
            checkpoint["data"]["pruned_through"].as_i64(),
            archived.last().and_then(|e| e["seq"].as_i64())
        );
        assert_eq!(checkpoint["data"]["pruned"]["trees"], 3);
        // The live tree is untouched: its processes run, its row is there.
        assert!(
            live_pids.iter().all(|p| util::pid_alive(*p)),
            "[{boundary}] prune killed nothing"
        );
        let shown = env.show(live_tree);
        assert_eq!(shown["tree"]["state"], "running");

        let out = verify_with(&env, &[]);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "[{boundary}] verify: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(text.contains("from checkpoint"), "{text}");
        let out = verify_with(&env, &[&archive]);
        assert!(
            out.status.success(),
            "[{boundary}] verify --archive: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );

        // One edited archived line (an exit code changed) fails; so does a dropped line.
        let text = std::fs::read_to_string(&archive).expect("archive");
        let edited = env.dir.path().join("edited.ndjson");
        let mut lines: Vec<String> = text.lines().map(String::from).collect();
        let i = lines
            .iter()
            .position(|l| l.contains("\"exit\":{\"code\":4"))
            .expect("the exit 4 tree's end is archived");
        lines[i] = lines[i].replace("\"exit\":{\"code\":4", "\"exit\":{\"code\":0");
        std::fs::write(&edited, lines.join("\n") + "\n").expect("write");
        let out = verify_with(&env, &[&edited]);
        assert_eq!(
            out.status.code(),
            Some(1),
            "[{boundary}] an edited archive must fail"
        );
        assert!(String::from_utf8_lossy(&out.stderr).contains("content edited"));
        let dropped = env.dir.path().join("dropped.ndjson");
        let mut lines: Vec<String> = text.lines().map(String::from).collect();
        lines.remove(1);
        std::fs::write(&dropped, lines.join("\n") + "\n").expect("write");
        assert_eq!(verify_with(&env, &[&dropped]).status.code(), Some(1));

        // The database refuses any other delete or update.
        {
            let conn = rusqlite::Connection::open(env.ledger_path()).expect("open");
            conn.busy_timeout(Duration::from_secs(5)).expect("busy");
            let refused = |sql: &str| {
                let e = conn.execute(sql, []).expect_err(sql);
                assert!(e.to_string().contains("invariant"), "{sql}: {e}");
            };
            refused(&format!("DELETE FROM events WHERE seq = {live_first}"));
            refused(&format!("DELETE FROM trees WHERE id = {live_tree}"));
            refused(&format!("DELETE FROM members WHERE tree_id = {live_tree}"));
            refused(&format!(
                "UPDATE events SET kind = 'x' WHERE seq = {}",
                checkpoint["seq"]
            ));
        }

        // The live tree ends; a second prune takes it and the first
        // checkpoint, and both archives together prove the whole history.
        let out = env.output(&["kill", &live_tree.to_string(), "--grace", "2s"]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        util::wait_child(&mut live, Duration::from_secs(20)).expect("run ends");
        let archive2 = env.dir.path().join("archive-2.ndjson");
        let out = env
            .cmd()
            .args(["prune", "--before", "now", "--archive"])
            .arg(&archive2)
            .output()
            .expect("prune");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let after2 = env.export();
        assert_eq!(
            after2.len(),
            1,
            "[{boundary}] only the new checkpoint: {after2:?}"
        );
        assert_eq!(after2[0]["kind"], "ledger.checkpoint");
        let mut all: Vec<i64> = seqs(&read_archive(&archive));
        all.extend(seqs(&read_archive(&archive2)));
        all.sort_unstable();
        assert_eq!(
            all,
            (1..after2[0]["seq"].as_i64().expect("seq")).collect::<Vec<_>>(),
            "[{boundary}] the two archives hold every event before the new checkpoint, once"
        );
        assert!(verify_with(&env, &[&archive, &archive2]).status.success());
        assert!(verify_with(&env, &[&archive2]).status.success());
        // The first archive's checkpoint was itself pruned: alone it cannot
        // be placed; with the second, it can.
        assert_eq!(verify_with(&env, &[&archive]).status.code(), Some(1));
        // The chain goes on from the checkpoint.
        assert_eq!(env.output(&["run", "--", "true"]).status.code(), Some(0));
        env.assert_verifies(boundary);
        assert_eq!(
            env.output(&["prune", "--before", "now"]).status.code(),
            Some(0)
        );
        env.assert_verifies(boundary);
    }
}

fn new_tree(ledger: &Ledger, label: &str) -> treewarden::ledger::TreeId {
    let owner = ledger
        .register_owner(&OwnerRecord {
            identity: IdentityRecord {
                pid: 1,
                start_ticks: 1,
                boot_id: "retention-test".into(),
            },
            kind: OwnerKind::Run,
        })
        .expect("owner");
    ledger
        .create_tree(&NewTree {
            label: Some(label.into()),
            boundary: treewarden::proc::BoundaryKind::Session,
            owner,
            argv: vec!["true".into()],
            cwd: None,
            grace_ms: None,
            timeout_ms: None,
            limits: Default::default(),
            first_signal: None,
        })
        .expect("tree")
}

#[test]
fn unsettled_trees_are_never_pruned() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let ledger = Ledger::open(&data.join("ledger.db"), LedgerOptions::default()).expect("open");
    let ended = new_tree(&ledger, "ended");
    ledger.end_tree(ended, TreeState::Ended, None).expect("end");
    let ambiguous = new_tree(&ledger, "ambiguous");
    ledger
        .set_state(ambiguous, TreeState::Ambiguous, Some("test"))
        .expect("ambiguous");
    let left = new_tree(&ledger, "survivors-left");
    ledger
        .set_state(left, TreeState::Ambiguous, Some("test"))
        .expect("ambiguous");
    ledger
        .resolve(left, "left alive", &[], None)
        .expect("resolve");
    ledger.add_flag(left, "survivors_left").expect("flag");
    let marked = new_tree(&ledger, "marker");
    ledger
        .end_tree(marked, TreeState::Ended, None)
        .expect("end");
    ledger
        .append_event(None, util::sweep_event(0))
        .expect("sweep");
    drop(ledger);
    // A marker on disk: evidence not yet in the ledger.
    std::fs::create_dir_all(data.join("unsettled")).expect("dir");
    std::fs::write(data.join(format!("unsettled/tree-{}", marked.0)), "{}").expect("marker");

    let out = std::process::Command::new(util::bin())
        .arg("--data-dir")
        .arg(&data)
        .args(["prune", "--before", "now", "--json"])
        .output()
        .expect("prune");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(report["trees"], 1, "{report}");

    let ledger = Ledger::open(&data.join("ledger.db"), LedgerOptions::default()).expect("open");
    assert!(ledger.tree(ended).expect("read").is_none());
    for kept in [ambiguous, left, marked] {
        assert!(
            ledger.tree(kept).expect("read").is_some(),
            "tree {} kept",
            kept.0
        );
    }
    let kinds: HashSet<String> = ledger
        .events(&Default::default())
        .expect("events")
        .into_iter()
        .map(|e| e.kind.to_string())
        .collect();
    assert!(
        !kinds.contains("sweep.started"),
        "an old tree-less event is pruned"
    );
    assert!(ledger.verify(None).expect("verify").is_ok());
    // The counts the dashboard and /metrics read (kept by triggers) are
    // what the rows say, after creations, state changes and a prune.
    let truth: Vec<(String, u64)> = {
        let conn = rusqlite::Connection::open(data.join("ledger.db")).expect("open");
        let mut stmt = conn
            .prepare("SELECT state, count(*) FROM trees GROUP BY state ORDER BY state")
            .expect("prepare");
        stmt.query_map([], |r| Ok((r.get(0)?, r.get::<_, i64>(1)? as u64)))
            .expect("query")
            .collect::<Result<_, _>>()
            .expect("rows")
    };
    let counted: Vec<(String, u64)> = ledger
        .tree_counts()
        .expect("counts")
        .into_iter()
        .map(|(s, n)| (s.as_str().to_string(), n))
        .collect();
    assert_eq!(counted, truth);
    // Nothing to prune the second time round: no checkpoint, no archive.
    let archive = dir.path().join("none.ndjson");
    let report = ledger
        .prune(&PruneRequest {
            before: std::time::SystemTime::now(),
            archive: Some(archive.clone()),
            keep: vec![marked],
        })
        .expect("prune");
    // The first checkpoint itself is old enough now, so it may go.
    if report.checkpoint.is_none() {
        assert!(!archive.exists());
    }
    assert!(ledger.verify(None).expect("verify").is_ok());
}

/// A ledger of `trees` ended trees made through the ledger API.
fn ledger_with_ended(path: &Path, trees: usize) {
    let ledger = Ledger::open(path, LedgerOptions::default()).expect("open");
    for i in 0..trees {
        let t = new_tree(&ledger, &format!("t{i}"));
        ledger.end_tree(t, TreeState::Ended, None).expect("end");
    }
}

fn snapshot(path: &Path) -> Vec<treewarden::ledger::EventRow> {
    Ledger::open(path, LedgerOptions::default())
        .expect("open")
        .events(&Default::default())
        .expect("events")
}

#[test]
fn a_prune_under_a_held_write_lock_deletes_nothing_and_leaves_no_archive() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let db = data.join("ledger.db");
    ledger_with_ended(&db, 20);
    let before = snapshot(&db);
    let lock = rusqlite::Connection::open(&db).expect("open");
    lock.execute_batch("BEGIN IMMEDIATE").expect("write lock");
    let archive = dir.path().join("archive.ndjson");
    let out = std::process::Command::new(util::bin())
        .arg("--data-dir")
        .arg(&data)
        .args([
            "--busy-timeout",
            "300ms",
            "prune",
            "--before",
            "now",
            "--archive",
        ])
        .arg(&archive)
        .output()
        .expect("prune");
    assert_eq!(
        out.status.code(),
        Some(125),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("busy") && err.lines().count() == 1, "{err}");
    assert!(
        !archive.exists(),
        "the archive of a prune that did not commit is removed"
    );
    lock.execute_batch("ROLLBACK").expect("unlock");
    drop(lock);
    assert_eq!(snapshot(&db), before, "nothing was deleted");
    // With the lock gone the same prune succeeds.
    let out = std::process::Command::new(util::bin())
        .arg("--data-dir")
        .arg(&data)
        .args(["prune", "--before", "now", "--archive"])
        .arg(&archive)
        .output()
        .expect("prune");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(read_archive(&archive).len(), before.len());
}

/// A small tmpfs, unmounted on every path.
struct Tmpfs(PathBuf);

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
    }
}

#[test]
fn a_prune_whose_archive_hits_a_full_disk_deletes_nothing() {
    if !util::is_root() {
        util::skip("mounting a small tmpfs needs root");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let db = data.join("ledger.db");
    ledger_with_ended(&db, 200);
    let before = snapshot(&db);
    let mnt = dir.path().join("small");
    std::fs::create_dir(&mnt).expect("dir");
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=64k", "tmpfs"])
        .arg(&mnt)
        .status()
        .expect("mount");
    if !mounted.success() {
        util::skip("cannot mount a tmpfs here");
        return;
    }
    let _guard = Tmpfs(mnt.clone());
    let archive = mnt.join("archive.ndjson");
    let out = std::process::Command::new(util::bin())
        .arg("--data-dir")
        .arg(&data)
        .args(["prune", "--before", "now", "--archive"])
        .arg(&archive)
        .output()
        .expect("prune");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(125), "{err}");
    assert!(
        err.contains("No space left") || err.contains("full"),
        "{err}"
    );
    assert!(!archive.exists(), "no partial archive is left");
    assert_eq!(snapshot(&db), before, "nothing was deleted");
    let ledger = Ledger::open(&db, LedgerOptions::default()).expect("open");
    assert!(ledger.verify(None).expect("verify").is_ok());
}

#[test]
fn serve_retain_prunes_ended_trees_on_its_own() {
    let server = crate::serve::Server::start(&["--retain", "1s", "--retain-every", "200ms"]);
    let (status, body) = server.post(
        "/api/trees",
        Some(&serde_json::json!({"argv": ["echo", "captured"], "label": "retained"})),
    );
    assert_eq!(status, 201, "{body}");
    let id = body["id"].as_i64().expect("id");
    // A live tree's captured log stays while its record does.
    let (status, live) = server.post(
        "/api/trees",
        Some(&server.body("echo live-output; sleep 300")),
    );
    assert_eq!(status, 201, "{live}");
    let live = live["id"].as_i64().expect("id");
    let log = |id: i64| {
        server
            .data_dir()
            .join("logs")
            .join(format!("tree-{id}.log"))
    };
    assert!(wait_until(Duration::from_secs(10), || log(id).exists()
        && log(live).exists()));
    let gone = wait_until(Duration::from_secs(30), || {
        server.get(&format!("/api/trees/{id}")).status() == 404
    });
    assert!(gone, "the ended tree is pruned once older than --retain");
    // Its captured log goes with its record (the prune's caller removes it
    // right after the commit).
    assert!(
        wait_until(Duration::from_secs(5), || !log(id).exists()),
        "the pruned tree's log is removed"
    );
    assert!(log(live).exists(), "the live tree's log is kept");
    assert_eq!(server.get(&format!("/api/trees/{live}")).status(), 200);
    let events = parse_ndjson(&server.get("/api/export").text().expect("export"));
    assert!(events.iter().all(|e| tree_of(e) != Some(id)));
    assert!(events.iter().any(|e| e["kind"] == "ledger.checkpoint"));
    let out = std::process::Command::new(util::bin())
        .arg("--data-dir")
        .arg(server.data_dir())
        .arg("verify")
        .output()
        .expect("verify");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn events_not_yet_shipped_are_never_pruned() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("data/ledger.db");
    ledger_with_ended(&db, 6);
    let ledger = Ledger::open(&db, LedgerOptions::default()).expect("open");
    let events = ledger.events(&Default::default()).expect("events");
    // The endpoint acknowledged the first three trees' events only.
    let third_end = events
        .iter()
        .filter(|e| e.kind.as_str() == "tree.ended")
        .nth(2)
        .map(|e| e.seq)
        .expect("three trees ended");
    ledger.init_ship_cursor("otlp").expect("cursor");
    ledger.set_ship_cursor("otlp", third_end).expect("ack");
    let report = ledger
        .prune(&PruneRequest {
            before: std::time::SystemTime::now(),
            archive: None,
            keep: vec![],
        })
        .expect("prune");
    assert_eq!(report.trees, 3, "{report:?}");
    let left = ledger.events(&Default::default()).expect("events");
    let unshipped: Vec<i64> = events
        .iter()
        .filter(|e| e.seq > third_end)
        .map(|e| e.seq)
        .collect();
    let kept: Vec<i64> = left
        .iter()
        .filter(|e| e.kind.as_str() != "ledger.checkpoint")
        .map(|e| e.seq)
        .collect();
    assert_eq!(kept, unshipped, "every event past the cursor is kept");
    assert!(ledger.verify(None).expect("verify").is_ok());
    // Once shipped, they go too.
    let head = ledger.head().expect("head").map(|(s, _)| s).expect("head");
    ledger.set_ship_cursor("otlp", head).expect("ack");
    let report = ledger
        .prune(&PruneRequest {
            before: std::time::SystemTime::now(),
            archive: None,
            keep: vec![],
        })
        .expect("prune");
    assert_eq!(report.trees, 3);
    assert_eq!(ledger.events(&Default::default()).expect("events").len(), 1);
    assert!(ledger.verify(None).expect("verify").is_ok());
}
