//! Forensic fidelity: the ledger records exactly what ran, checked against
//! what the workload itself knows (the pids it printed, its argv markers,
//! its exit codes), field by field, on both boundaries; and nothing one tree
//! (or one ledger) leaves behind can hurt another.

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};

use crate::custody::Env;
use crate::util::{pid_alive, signal, wait_child, wait_until};

const BOTH: [&str; 2] = ["cgroup", "session"];

/// The workload: three `sleep`s with distinct argv markers, a `setsid`
/// member (its own session and group), and an orphan that exits 7 once a
/// line arrives on the fifo `go` (the test sends it after the ledger has
/// recorded the orphan: [`Env::release_once_recorded`]). Each is
/// started from a subshell that exits at once, so its parent is gone and
/// the subreaper (`run`) reaps it: its status is knowable, and must be
/// recorded. (A member whose parent in the tree reaps it has a status only
/// that parent saw: the record then says `"reaped_by": "parent"`.) The
/// workload writes `name pid` to `truth` for each.
const WORKLOAD: &str = "\
( sleep 301 & echo \"s301 $!\" >> truth )
( sleep 302 & echo \"s302 $!\" >> truth )
( sleep 303 & echo \"s303 $!\" >> truth )
( setsid sleep 304 & echo \"setsid $!\" >> truth )
( sh -c 'echo \"orphan $$\" >> truth; read x < go; exit 7' orphan7 & )
echo \"root $$\" >> truth
exec sleep 300";

/// `name -> pid` as the workload wrote them.
fn truth(dir: &Path) -> HashMap<String, i64> {
    std::fs::read_to_string(dir.join("truth"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let (name, pid) = l.split_once(' ')?;
            Some((name.to_string(), pid.trim().parse().ok()?))
        })
        .collect()
}

fn member(show: &Value, pid: i64) -> Value {
    show["members"]
        .as_array()
        .and_then(|ms| ms.iter().find(|m| m["pid"].as_i64() == Some(pid)))
        .cloned()
        .unwrap_or(Value::Null)
}

#[test]
fn the_record_matches_what_the_workload_knows_on_both_boundaries() {
    for b in BOTH {
        for observer in ["auto", "off"] {
            let Some(env) = Env::new(b) else { continue };
            let label = format!("{b}, observer {observer}");
            env.make_go_fifo();
            let mut run = env.spawn_run(
                &[
                    "--timeout",
                    "1500ms",
                    "--grace",
                    "2s",
                    "--observer",
                    observer,
                ],
                WORKLOAD,
            );
            // The orphan exits 7 once the record has seen it alive.
            assert!(
                wait_until(Duration::from_secs(10), || truth(env.dir.path())
                    .contains_key("orphan")),
                "[{label}] the orphan never ran: {}",
                env.stderr_of(&run)
            );
            env.release_once_recorded(&label, truth(env.dir.path())["orphan"]);
            let status = wait_child(&mut run, Duration::from_secs(30)).expect("run exits");
            let err = env.stderr_of(&run);
            assert_eq!(status.code(), Some(124), "[{label}] {err}");
            assert!(env.wait_none_marked(), "[{label}] {:?}", env.marked());
            let t = truth(env.dir.path());
            assert_eq!(t.len(), 6, "[{label}] the workload's truth: {t:?}");
            let show = env.show(1);

            // The root: what it ran after `env` exec'd `sh` and `sh` exec'd
            // `sleep`, and its status (it died of the teardown's SIGTERM;
            // `run` reaped it).
            let root = member(&show, t["root"]);
            assert_eq!(
                root["cmdline"],
                json!(["sleep", "300"]),
                "[{label}] root argv after its execs: {root}"
            );
            assert_eq!(
                show["tree"]["exit"],
                json!({"code": null, "signal": 15}),
                "[{label}] the tree's exit is the root's SIGTERM"
            );
            assert_eq!(root["exit"]["signal"], 15, "[{label}] root member: {root}");
            let ended = show["events"]
                .as_array()
                .and_then(|es| es.iter().find(|e| e["kind"] == "tree.ended"))
                .cloned()
                .unwrap_or(Value::Null);
            assert_eq!(ended["data"]["exit"]["signal"], 15, "[{label}] {ended}");

            // Each exec'd member shows what it ran, and its exit.
            for (name, argv) in [
                ("s301", json!(["sleep", "301"])),
                ("s302", json!(["sleep", "302"])),
                ("s303", json!(["sleep", "303"])),
                ("setsid", json!(["sleep", "304"])),
            ] {
                let m = member(&show, t[name]);
                assert_eq!(m["cmdline"], argv, "[{label}] {name}: {m}");
                assert_eq!(
                    m["exit"]["signal"], 15,
                    "[{label}] {name} died of SIGTERM: {m}"
                );
                assert!(m["exited_at"].is_string(), "[{label}] {name}: {m}");
            }

            // The escapee: its row shows where it went (setsid made it the
            // leader of its own session and group); the observation keeps
            // where it was.
            let pid = t["setsid"];
            let m = member(&show, pid);
            assert_eq!(
                (m["pgid"].as_i64(), m["sid"].as_i64()),
                (Some(pid), Some(pid)),
                "[{label}] {m}"
            );
            assert!(m["escaped_at"].is_string(), "[{label}] {m}");
            let escape = show["observations"]
                .as_array()
                .and_then(|os| {
                    os.iter().find(|o| {
                        o["kind"] == "escape" && o["identity"]["pid"].as_i64() == Some(pid)
                    })
                })
                .cloned()
                .unwrap_or(Value::Null);
            assert_eq!(
                escape["detail"]["member"]["sid"].as_i64(),
                Some(pid),
                "[{label}] {escape}"
            );

            // The orphan exited 7 after its parent was gone: `run`, its
            // subreaper, reaped it and recorded the code.
            let m = member(&show, t["orphan"]);
            assert_eq!(
                m["cmdline"],
                json!([
                    "sh",
                    "-c",
                    "echo \"orphan $$\" >> truth; read x < go; exit 7",
                    "orphan7"
                ]),
                "[{label}] {m}"
            );
            assert_eq!(
                m["exit"],
                json!({"code": 7, "signal": null}),
                "[{label}] {m}"
            );

            // No exit without a status says nothing: each names its reaper.
            for e in show["events"].as_array().into_iter().flatten() {
                if e["kind"] == "member.exited" {
                    assert!(e["data"]["reaped_by"].is_string(), "[{label}] {e}");
                }
            }
            env.assert_verifies(&label);
        }
    }
}

#[test]
fn a_member_that_execs_later_gets_a_member_exec_event() {
    // The third: `sh` exec'ing `sh` keeps the comm; with the observer off
    // only the scan's stack-address check can notice it.
    let same_name = json!(["sh", "-c", "sleep 305; :", "tw-same-name"]);
    for (observer, program, expect) in [
        ("auto", "sleep 305", json!(["sleep", "305"])),
        ("off", "sleep 305", json!(["sleep", "305"])),
        ("off", "sh -c 'sleep 305; :' tw-same-name", same_name),
    ] {
        let Some(env) = Env::new("session") else {
            return;
        };
        let mut run = env.spawn_run(
            &["--quiet", "--scan-interval", "50ms", "--observer", observer],
            &format!("(echo \"sub $(exec sh -c 'echo $PPID')\" >> truth; while [ ! -e go ]; do sleep 0.01; done; exec {program}) & wait"),
        );
        assert!(wait_until(Duration::from_secs(20), || truth(
            env.dir.path()
        )
        .contains_key("sub")));
        let sub = truth(env.dir.path())["sub"];
        // Recorded (as the subshell) before it execs.
        assert!(
            wait_until(Duration::from_secs(20), || member(&env.show(1), sub)["pid"]
                .as_i64()
                == Some(sub)),
            "[{observer}] the subshell is recorded"
        );
        std::fs::write(env.dir.path().join("go"), b"").expect("go");
        assert!(
            wait_until(
                Duration::from_secs(10),
                || member(&env.show(1), sub)["cmdline"] == expect
            ),
            "[{observer}] row after exec: {}",
            member(&env.show(1), sub)
        );
        let exec = env
            .export()
            .into_iter()
            .find(|e| {
                e["kind"] == "member.exec" && e["data"]["identity"]["pid"].as_i64() == Some(sub)
            })
            .unwrap_or(Value::Null);
        assert_eq!(exec["data"]["to"]["argv"], expect, "[{observer}] {exec}");
        assert_eq!(exec["data"]["from"]["argv"][0], "sh", "[{observer}] {exec}");
        signal(run.id(), rustix::process::Signal::TERM);
        wait_child(&mut run, Duration::from_secs(20)).expect("run exits");
        assert!(env.wait_none_marked());
    }
}

/// Per-tree cgroup directories of this test's cgroup root.
fn tree_cgroups(env: &Env) -> Vec<String> {
    let Some(root) = env.cgroup_root() else {
        return Vec::new();
    };
    let mut v: Vec<String> = std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().is_dir())
        .filter_map(|e| e.file_name().to_str().map(String::from))
        .collect();
    v.sort();
    v
}

#[test]
fn two_ledgers_and_leftover_cgroups_never_stop_a_spawn() {
    let Some(a) = Env::new("cgroup") else {
        return;
    };
    let root = a.cgroup_root().expect("cgroup root").to_path_buf();
    // Leftovers of every name the product could pick for tree 1: the old
    // `tree-1` and another ledger's `tw-…-1`, both empty.
    for name in ["tree-1", "tw-00000000-1"] {
        std::fs::create_dir(root.join(name)).expect("leftover cgroup");
    }
    // A second data dir on the same cgroup root, running its tree 1 at the
    // same moment as the first.
    let b_dir = tempfile::tempdir().expect("tempdir");
    let mut run_a = a.spawn_run(&["--quiet"], "sleep 306");
    let mut run_b = a
        .cmd()
        .env("TREEWARDEN_DATA_DIR", b_dir.path().join("data"))
        .args(["run", "--quiet", "--"])
        .args(a.marked_argv("sleep 307"))
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("second run");
    // Both trees are up once both cgroups of tree 1 exist (counting
    // processes would not tell the two trees apart).
    let count = |names: &[String]| {
        names
            .iter()
            .filter(|n| n.starts_with("tw-") && n.ends_with("-1") && *n != "tw-00000000-1")
            .count()
    };
    assert!(
        wait_until(Duration::from_secs(20), || count(&tree_cgroups(&a)) == 2),
        "{:?}",
        tree_cgroups(&a)
    );
    let names = tree_cgroups(&a);
    let ours: Vec<&String> = names
        .iter()
        .filter(|n| n.starts_with("tw-") && n.ends_with("-1") && *n != "tw-00000000-1")
        .collect();
    assert_eq!(
        ours.len(),
        2,
        "two ledgers, two different names for tree 1: {names:?}"
    );
    for run in [&mut run_a, &mut run_b] {
        signal(run.id(), rustix::process::Signal::TERM);
        wait_child(run, Duration::from_secs(20)).expect("run exits");
    }
    assert!(a.wait_none_marked());
    // The product's own cgroups are gone; the unknown old-style leftover it
    // never needed is the test's to remove.
    let left = tree_cgroups(&a);
    assert!(
        left.iter().all(|n| n == "tree-1" || n == "tw-00000000-1"),
        "{left:?}"
    );

    // A leftover of this ledger's own next name (a crash of a restored
    // copy): removed if empty, refused if populated.
    let show = a.show(1);
    let cg = show["tree"]["cgroup"]
        .as_str()
        .expect("cgroup recorded")
        .to_string();
    let next = cg.trim_end_matches("-1").to_string() + "-2";
    std::fs::create_dir(&next).expect("empty leftover of the next name");
    let out = a.output(&["run", "--", "true"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!Path::new(&next).exists(), "removed with its tree");
}

/// A sweep removes the empty cgroup of an ended tree and of an id this
/// ledger recorded nothing under, and leaves a live tree's, also when it is
/// empty (its one process moved out): the tree still runs, its cgroup is
/// still its boundary. Ground truth: the directories on cgroupfs.
#[test]
fn a_sweep_removes_the_leftover_cgroups_of_ended_trees_only() {
    let Some(env) = Env::new("cgroup") else {
        return;
    };
    let root = env.cgroup_root().expect("cgroup root").to_path_buf();
    // Tree 1 ends; tree 2 lives, its root (exec'd sleep) moved out of its
    // cgroup into a leaf of the test's own.
    let out = env.output(&["run", "--quiet", "--", "true"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let pidfile = env.dir().join("root.pid");
    let mut run = env.spawn_run(
        &["--quiet"],
        &format!("echo $$ > {}; exec sleep 308", pidfile.display()),
    );
    assert!(env.wait_marked(1), "{}", env.stderr_of(&run));
    assert!(wait_until(Duration::from_secs(10), || {
        std::fs::read_to_string(&pidfile).is_ok_and(|t| t.ends_with('\n'))
    }));
    let pid = std::fs::read_to_string(&pidfile)
        .expect("pid")
        .trim()
        .to_string();
    let live = env.show(2)["tree"]["cgroup"]
        .as_str()
        .expect("cgroup of tree 2")
        .to_string();
    let outside = root.join("outside");
    std::fs::create_dir(&outside).expect("leaf outside the tree");
    std::fs::write(outside.join("cgroup.procs"), &pid).expect("move the root out");
    assert!(
        wait_until(Duration::from_secs(10), || {
            std::fs::read_to_string(Path::new(&live).join("cgroup.events"))
                .is_ok_and(|t| t.contains("populated 0"))
        }),
        "tree 2's cgroup empties"
    );
    // Leftovers: tree 1's cgroup made again (what a crash between its end
    // and its rmdir leaves), and one of an id no tree has.
    let prefix = live.trim_end_matches("-2").to_string();
    let ended = format!("{prefix}-1");
    let unknown = format!("{prefix}-77");
    for dir in [&ended, &unknown] {
        std::fs::create_dir(dir).expect("leftover");
    }
    let out = env.output(&["sweep", "--grace", "100ms"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !Path::new(&ended).exists(),
        "the ended tree's leftover is removed"
    );
    assert!(
        !Path::new(&unknown).exists(),
        "the unknown id's leftover is removed"
    );
    assert!(
        Path::new(&live).is_dir(),
        "the live tree's empty cgroup stays"
    );
    assert!(
        pid_alive(pid.parse().expect("pid")),
        "the live tree runs on"
    );
    signal(run.id(), rustix::process::Signal::TERM);
    wait_child(&mut run, Duration::from_secs(20)).expect("run exits");
    assert!(env.wait_none_marked(), "{:?}", env.marked());
}

#[test]
fn a_populated_unknown_cgroup_of_the_same_name_is_refused() {
    let Some(env) = Env::new("cgroup") else {
        return;
    };
    let out = env.output(&["run", "--", "true"]);
    assert_eq!(out.status.code(), Some(0));
    let cg = env.show(1)["tree"]["cgroup"]
        .as_str()
        .expect("cgroup")
        .to_string();
    let next = std::path::PathBuf::from(cg.trim_end_matches("-1").to_string() + "-2");
    std::fs::create_dir(&next).expect("next name");
    // A process the ledger does not know sits in it.
    let mut stranger = env
        .cmd_for("sh")
        .args([
            "-c",
            &format!(
                "echo $$ > {}/cgroup.procs && exec env TW_TEST_MARK={} sleep 308",
                next.display(),
                env.mark
            ),
        ])
        .spawn()
        .expect("stranger");
    assert!(env.wait_marked(1));
    let out = env.output(&["run", "--", "true"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(125), "{err}");
    assert!(err.contains("holds processes"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    assert!(
        pid_alive(stranger.id() as i32),
        "the stranger is never touched"
    );
    env.end_leftovers();
    wait_child(&mut stranger, Duration::from_secs(10)).expect("stranger ends");
    assert!(wait_until(Duration::from_secs(5), || std::fs::remove_dir(
        &next
    )
    .is_ok()
        || !next.exists()));
}

#[test]
fn twenty_trees_leave_no_per_tree_file_and_the_ledger_is_private() {
    let Some(env) = Env::new("session") else {
        return;
    };
    for _ in 0..20 {
        let out = env.output(&["run", "--", "true"]);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let mut files = Vec::new();
    for entry in walk(&env.data_dir()) {
        files.push(
            entry
                .strip_prefix(env.data_dir())
                .expect("inside")
                .display()
                .to_string(),
        );
    }
    files.sort();
    assert!(
        files.iter().all(|f| matches!(
            f.as_str(),
            "ledger.db" | "ledger.db-wal" | "ledger.db-shm" | "teardown"
        )),
        "only the ledger (and the empty lease dir) after 20 trees: {files:?}"
    );
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &Path| std::fs::metadata(p).expect("stat").permissions().mode() & 0o777;
    assert_eq!(mode(&env.data_dir()), 0o700);
    assert_eq!(mode(&env.ledger_path()), 0o600);
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        out.push(e.path());
        if e.path().is_dir() {
            out.extend(walk(&e.path()));
        }
    }
    out
}

#[test]
fn a_teardown_under_a_held_write_lock_leaves_its_whole_trail_once_the_ledger_is_writable() {
    for b in BOTH {
        let Some(env) = Env::new(b) else { continue };
        let mut run = env.spawn_run(
            &[
                "--busy-timeout",
                "300ms",
                "--timeout",
                "1s",
                "--grace",
                "100ms",
            ],
            "trap '' TERM; sleep 309 & wait",
        );
        assert!(env.wait_marked(2), "[{b}] {:?}", env.marked());
        // Hold the write lock through the timeout and the whole teardown.
        let lock = rusqlite::Connection::open(env.ledger_path()).expect("open");
        lock.execute_batch("BEGIN IMMEDIATE").expect("lock");
        let status = wait_child(&mut run, Duration::from_secs(60)).expect("run exits");
        assert_eq!(status.code(), Some(125), "[{b}] {}", env.stderr_of(&run));
        let survivors = env.marked();
        assert!(
            !survivors.is_empty(),
            "[{b}] survivors left alive as evidence"
        );
        lock.execute_batch("ROLLBACK").expect("unlock");
        drop(lock);

        // The first reader already sees the whole trail.
        assert_eq!(env.show(1)["tree"]["state"], "ambiguous", "[{b}]");

        // `resolve` with a live survivor is refused, naming `kill`.
        let out = env.output(&["resolve", "1", "--note", "looked at it"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "[{b}] {err}");
        assert!(
            err.contains("live survivor") && err.contains("treewarden kill 1"),
            "[{b}] {err}"
        );

        // The tree is ambiguous in the ledger, and its trail says what
        // happened, in order.
        let show = env.show(1);
        assert_eq!(show["tree"]["state"], "ambiguous", "[{b}] {}", show["tree"]);
        let kinds: Vec<(String, Value)> = show["events"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|e| {
                (
                    e["kind"].as_str().unwrap_or("").to_string(),
                    e["data"].clone(),
                )
            })
            .collect();
        let pos = |pred: &dyn Fn(&(String, Value)) -> bool| kinds.iter().position(pred);
        let terminating = pos(&|(k, d)| k == "tree.state" && d["to"] == "terminating");
        let term = pos(&|(k, d)| k == "signal.sent" && d["signal"] == "SIGTERM");
        let skipped = pos(&|(k, d)| {
            k == "kill.skipped"
                && d["reason"]
                    .as_str()
                    .is_some_and(|r| r.contains("authority could not be written"))
        });
        let ambiguous = pos(&|(k, d)| k == "tree.state" && d["to"] == "ambiguous");
        assert!(
            terminating.is_some() && terminating < term && term < skipped && skipped < ambiguous,
            "[{b}] timeout, SIGTERM, kill.skipped, ambiguous in order: {kinds:?}"
        );
        let reason = &kinds[terminating.unwrap_or(0)].1["reason"];
        assert!(
            reason.as_str().is_some_and(|r| r.starts_with("timeout")),
            "[{b}] {reason}"
        );
        assert!(
            kinds[skipped.unwrap_or(0)].1["deferred_from"].is_string(),
            "[{b}] deferred events say when they happened"
        );
        assert!(
            !env.marked().is_empty(),
            "[{b}] the refused resolve touched nothing"
        );

        // `kill` works on the ambiguous tree and is what settles it.
        let out = env.output(&["kill", "1", "--grace", "100ms"]);
        assert!(
            out.status.success(),
            "[{b}] kill: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(env.wait_none_marked(), "[{b}]");
        assert!(env.assert_kills_authorized() > 0);
        env.assert_verifies(b);
        // The trail was written once, not once per reader.
        let skipped_count = env.kinds().iter().filter(|k| *k == "kill.skipped").count();
        assert_eq!(skipped_count, 1, "[{b}]");
    }
}

/// `run` told to stop while another connection holds the ledger's write
/// lock: it fails closed (125), its survivors alive; the lock is released.
fn fail_closed_under_a_held_lock(env: &Env, script: &str) {
    let mut run = env.spawn_run(
        &["--busy-timeout", "300ms", "--grace", "100ms", "--quiet"],
        script,
    );
    assert!(env.wait_marked(2));
    let lock = rusqlite::Connection::open(env.ledger_path()).expect("open");
    lock.execute_batch("BEGIN IMMEDIATE").expect("lock");
    signal(run.id(), rustix::process::Signal::TERM);
    assert_eq!(
        wait_child(&mut run, Duration::from_secs(30)).and_then(|s| s.code()),
        Some(125)
    );
    lock.execute_batch("ROLLBACK").expect("unlock");
}

#[test]
fn resolve_force_records_the_survivors_it_leaves() {
    let Some(env) = Env::new("session") else {
        return;
    };
    fail_closed_under_a_held_lock(&env, "trap '' TERM; sleep 310 & wait");
    let alive = env.marked();
    let out = env.output(&["resolve", "1", "--note", "left for the owner", "--force"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let show = env.show(1);
    let resolved = show["events"]
        .as_array()
        .and_then(|es| es.iter().find(|e| e["kind"] == "tree.resolved"))
        .cloned()
        .unwrap_or(Value::Null);
    let left: Vec<i64> = resolved["data"]["survivors_left"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|id| id["pid"].as_i64())
        .collect();
    for pid in &alive {
        assert!(left.contains(&i64::from(*pid)), "{pid} named in {resolved}");
    }
    assert!(
        show["tree"]["flags"]
            .as_array()
            .is_some_and(|f| f.contains(&json!("survivors_left")))
    );
    // Dispatch is open again.
    assert_eq!(env.output(&["run", "--", "true"]).status.code(), Some(0));
    // The tree stays killable: `kill` ends what was left, with authority,
    // and the tree stays `resolved` (flagged `survivors_ended`).
    let out = env.output(&["kill", "1", "--grace", "100ms"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(env.wait_none_marked(), "{:?}", env.marked());
    assert!(env.assert_kills_authorized() > 0);
    let tree = &env.show(1)["tree"];
    assert_eq!(tree["state"], "resolved");
    assert!(
        tree["flags"]
            .as_array()
            .is_some_and(|f| f.contains(&json!("survivors_ended"))),
        "{tree}"
    );
}

#[test]
fn a_force_resolved_tree_is_swept_once_its_owner_is_gone() {
    let Some(env) = Env::new("session") else {
        return;
    };
    fail_closed_under_a_held_lock(&env, "trap '' TERM; sleep 311 & wait");
    let out = env.output(&["resolve", "1", "--note", "left", "--force"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!env.marked().is_empty());
    let out = env.output(&["sweep", "--grace", "100ms"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(env.wait_none_marked(), "{:?}", env.marked());
    assert!(env.assert_kills_authorized() > 0);
    env.assert_verifies("-");
}

#[test]
fn an_orphan_closed_by_the_sweep_leaves_no_cgroup_behind() {
    let Some(env) = Env::new("cgroup") else {
        return;
    };
    // The owner is SIGKILLed (no teardown of its own); its tree ends on its
    // own; the sweep closes it, and nothing of it stays under the root.
    let mut run = env.spawn_run(&["--quiet"], "sleep 0.5");
    assert!(env.wait_marked(1));
    signal(run.id(), rustix::process::Signal::KILL);
    let _ = wait_child(&mut run, Duration::from_secs(20));
    assert!(env.wait_none_marked());
    assert_eq!(
        tree_cgroups(&env).len(),
        1,
        "the orphan's cgroup is still there"
    );
    let out = env.output(&["sweep"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(env.show(1)["tree"]["state"], "ended");
    assert!(tree_cgroups(&env).is_empty(), "{:?}", tree_cgroups(&env));
}

/// A principal's parent cgroup (`serve --principal-*`) and what the sweep
/// (the one every `serve` start runs first, then every `--sweep-interval`)
/// makes of those a crash or a stopped service left: one with no tree in
/// it is removed, as is an ended tree's cgroup inside one; one a process
/// still lives in stays, until it is empty; another ledger's is not
/// touched. No controller is needed for any of this, so it runs here.
#[test]
fn a_sweep_removes_principal_cgroups_left_empty_and_keeps_populated_and_foreign_ones() {
    let Some(env) = Env::new("cgroup") else {
        return;
    };
    let root = env.cgroup_root().expect("a cgroup root").to_path_buf();
    let out = env.output(&["run", "--", "true"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // This ledger's prefix, from its first tree's recorded cgroup.
    let cgroup = env.show(1)["tree"]["cgroup"]
        .as_str()
        .expect("the tree's cgroup")
        .to_owned();
    let prefix = cgroup
        .rsplit('/')
        .next()
        .and_then(|n| n.strip_suffix("-1"))
        .expect("tw-<8 hex>-1")
        .to_owned();
    let empty = root.join(format!("{prefix}-p-uid-4242"));
    let with_ended = root.join(format!("{prefix}-p-tok-5"));
    let populated = root.join(format!("{prefix}-p-uid-4343"));
    let foreign = root.join("tw-00000000-p-uid-4242");
    /// Removes what this test made, children first, on every path.
    struct Made(Vec<std::path::PathBuf>, Option<std::process::Child>);
    impl Drop for Made {
        fn drop(&mut self) {
            if let Some(mut c) = self.1.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
            for d in self.0.iter().rev() {
                let _ = wait_until(Duration::from_secs(5), || {
                    std::fs::remove_dir(d).is_ok() || !d.exists()
                });
            }
        }
    }
    let mut made = Made(Vec::new(), None);
    for d in [
        empty.clone(),
        with_ended.clone(),
        with_ended.join(format!("{prefix}-998")),
        populated.clone(),
        populated.join(format!("{prefix}-999")),
        foreign.clone(),
    ] {
        std::fs::create_dir(&d).expect("a test cgroup");
        made.0.push(d);
    }
    // A process of nobody this ledger knows in a tree cgroup of the third.
    let sleeper = std::process::Command::new("sleep")
        .arg("600")
        .env("TW_TEST_MARK", &env.mark)
        .spawn()
        .expect("sleep");
    let pid = sleeper.id();
    made.1 = Some(sleeper);
    std::fs::write(
        populated.join(format!("{prefix}-999/cgroup.procs")),
        pid.to_string(),
    )
    .expect("move the sleeper in");
    let out = env.output(&["sweep"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!empty.exists(), "an empty principal cgroup is removed");
    assert!(
        !with_ended.exists(),
        "an ended tree's cgroup in one goes, then the principal's"
    );
    assert!(
        populated.join(format!("{prefix}-999")).exists(),
        "a populated tree cgroup stays"
    );
    assert!(populated.exists(), "and its principal's with it");
    assert!(foreign.exists(), "another ledger's is not this sweep's");
    // Once its process is gone (cgroup.events: populated 0), the next
    // sweep removes both.
    if let Some(mut c) = made.1.take() {
        let _ = c.kill();
        let _ = c.wait();
    }
    let events = populated.join("cgroup.events");
    assert!(
        wait_until(Duration::from_secs(5), || std::fs::read_to_string(&events)
            .unwrap_or_default()
            .contains("populated 0")),
        "the sleeper's cgroup empties"
    );
    let out = env.output(&["sweep"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!populated.exists(), "emptied, then removed");
    assert!(foreign.exists());
    drop(made);
    assert!(tree_cgroups(&env).is_empty(), "{:?}", tree_cgroups(&env));
}

/// The workload of the process-tree tests: a root shell, a child shell
/// that forks a grandchild `sleep` and then execs a `sleep` of its own, and
/// the root's own `sleep`. Each writes `name pid ppid` to `truth` (the
/// grandchild's line is written by its parent, the child: `$!` and `$$`).
/// The child execs only once a line arrives on the fifo `go`: the test
/// sends it after the ledger has the child as `sh`, so the exec is one the
/// record can show (under load both the observer and the scan may first
/// read a child that has already exec'd, and then there is no exec to see).
const HIERARCHY: &str = "\
echo \"root $$ $PPID\" >> truth
sh -c 'echo \"child $$ $PPID\" >> truth; sleep 311 & echo \"grandchild $! $$\" >> truth; read x < go; exec sleep 312' &
echo \"rootsleep $! $$\" >> truth
wait";

/// Lets the hierarchy's child exec (see [`HIERARCHY`]) once the ledger
/// records it running `sh`.
fn release_child_once_recorded(env: &Env, b: &str) {
    env.release_once_recorded(b, lineage(env.dir.path())["child"].0);
}

/// `name -> (pid, ppid)` as the workload wrote them.
fn lineage(dir: &Path) -> HashMap<String, (i64, i64)> {
    std::fs::read_to_string(dir.join("truth"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            let name = w.next()?.to_string();
            Some((name, (w.next()?.parse().ok()?, w.next()?.parse().ok()?)))
        })
        .collect()
}

/// `show --tree`: the members as the process tree the workload itself
/// reports (each parent -> child pair it printed), on both boundaries; the
/// child's exec is marked, and the pstree-like text nests them the same way.
#[test]
fn show_tree_is_the_hierarchy_the_workload_printed() {
    for b in BOTH {
        let Some(env) = Env::new(b) else { continue };
        // The teardown comes on the timeout; every member has long been
        // seen by then (a bounded wait below proves it first).
        env.make_go_fifo();
        let mut run = env.spawn_run(&["--timeout", "6s", "--grace", "2s"], HIERARCHY);
        assert!(
            wait_until(Duration::from_secs(10), || lineage(env.dir.path()).len()
                == 4),
            "[{b}] the workload's truth: {:?}",
            lineage(env.dir.path())
        );
        release_child_once_recorded(&env, b);
        let status = wait_child(&mut run, Duration::from_secs(30)).expect("run exits");
        assert_eq!(status.code(), Some(124), "[{b}] {}", env.stderr_of(&run));
        assert!(env.wait_none_marked(), "[{b}] {:?}", env.marked());
        let t = lineage(env.dir.path());
        let out = env.output(&["show", "1", "--tree", "--json"]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let forest: Value = serde_json::from_slice(&out.stdout).expect("hierarchy json");
        let node = |pid: i64| -> Value {
            fn find(v: &Value, pid: i64) -> Option<Value> {
                if v["pid"].as_i64() == Some(pid) {
                    return Some(v.clone());
                }
                v["children"].as_array()?.iter().find_map(|c| find(c, pid))
            }
            forest
                .as_array()
                .and_then(|f| f.iter().find_map(|n| find(n, pid)))
                .unwrap_or_else(|| panic!("[{b}] pid {pid} not in {forest}"))
        };
        let children = |v: &Value| -> Vec<i64> {
            v["children"]
                .as_array()
                .map(|c| c.iter().filter_map(|c| c["pid"].as_i64()).collect())
                .unwrap_or_default()
        };
        let root = t["root"].0;
        assert_eq!(
            forest[0]["pid"].as_i64(),
            Some(root),
            "[{b}] the root first: {forest}"
        );
        for name in ["child", "rootsleep", "grandchild"] {
            let (pid, ppid) = t[name];
            assert!(
                children(&node(ppid)).contains(&pid),
                "[{b}] {name} {pid} is not under {ppid}: {forest}"
            );
            assert_eq!(node(pid)["ppid"].as_i64(), Some(ppid), "[{b}] {name}");
        }
        let child = node(t["child"].0);
        assert!(
            child["execs"].as_u64() >= Some(1),
            "[{b}] the child exec'd: {child}"
        );
        for name in ["root", "child", "rootsleep", "grandchild"] {
            assert_eq!(node(t[name].0)["exited"], true, "[{b}] {name} exited");
        }
        // The text: the grandchild two levels under the root, below the child.
        let out = env.output(&["show", "1", "--tree"]);
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let line_of = |pid: i64| {
            text.lines()
                .position(|l| l.contains(&format!("({pid})")))
                .unwrap_or_else(|| panic!("[{b}] {pid} not drawn:\n{text}"))
        };
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[line_of(root)].starts_with("sh("), "[{b}]\n{text}");
        let c = line_of(t["child"].0);
        let g = line_of(t["grandchild"].0);
        assert!(g > c, "[{b}]\n{text}");
        assert!(lines[c].contains("[exec"), "[{b}]\n{text}");
        assert!(
            lines[g].starts_with("│ └─sleep(") || lines[g].starts_with("  └─sleep("),
            "[{b}]\n{text}"
        );
    }
}

/// One member that ends on the SIGTERM (a plain `sleep`) and one that
/// ignores it (`trap '' TERM`, then `exec sleep`): each prints its pid.
const GRACE_AND_KILL: &str = "\
echo \"root $$\" >> truth
sleep 321 & echo \"yields $!\" >> truth
sh -c 'trap \"\" TERM; echo \"holds $$\" >> truth; exec sleep 322' &
wait";

/// `show --tree`'s force-killed mark against what the workload did: the
/// member that ended on the SIGTERM during the grace and the root are not
/// marked, the one that ignored it and lived to the kill is, on both
/// boundaries (the record: its `signal.sent` SIGKILL, delivered to the
/// target the authorization named it in).
#[test]
fn show_tree_marks_force_killed_only_what_the_kill_reached() {
    for b in BOTH {
        let Some(env) = Env::new(b) else { continue };
        let mut run = env.spawn_run(&["--timeout", "2s", "--grace", "1s"], GRACE_AND_KILL);
        assert!(
            wait_until(Duration::from_secs(10), || lineage_pids(env.dir.path())
                .len()
                == 3),
            "[{b}] the workload's truth: {:?}",
            lineage_pids(env.dir.path())
        );
        let status = wait_child(&mut run, Duration::from_secs(30)).expect("run exits");
        assert_eq!(status.code(), Some(124), "[{b}] {}", env.stderr_of(&run));
        assert!(env.wait_none_marked(), "[{b}] {:?}", env.marked());
        let t = lineage_pids(env.dir.path());
        let out = env.output(&["show", "1", "--tree", "--json"]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let forest: Value = serde_json::from_slice(&out.stdout).expect("hierarchy json");
        let mut all = Vec::new();
        let mut stack: Vec<Value> = forest.as_array().cloned().unwrap_or_default();
        while let Some(n) = stack.pop() {
            stack.extend(n["children"].as_array().cloned().unwrap_or_default());
            all.push(n);
        }
        let node = |pid: i64| -> &Value {
            all.iter()
                .find(|n| n["pid"].as_i64() == Some(pid))
                .unwrap_or_else(|| panic!("[{b}] pid {pid} not in {forest}"))
        };
        assert_eq!(node(t["holds"])["force_killed"], true, "[{b}] {forest}");
        for name in ["root", "yields"] {
            let n = node(t[name]);
            assert_eq!(n["force_killed"], false, "[{b}] {name}: {n}");
            assert_eq!(n["kill_authorized"], false, "[{b}] {name}: {n}");
            assert_eq!(n["exited"], true, "[{b}] {name}: {n}");
        }
        let killed: Vec<i64> = all
            .iter()
            .filter(|n| n["force_killed"] == true)
            .filter_map(|n| n["pid"].as_i64())
            .collect();
        assert_eq!(killed, vec![t["holds"]], "[{b}] only the holdout: {forest}");
        // The text marks the same line.
        let text =
            String::from_utf8_lossy(&env.output(&["show", "1", "--tree"]).stdout).to_string();
        let marked: Vec<&str> = text
            .lines()
            .filter(|l| l.contains("force-killed"))
            .collect();
        assert_eq!(marked.len(), 1, "[{b}]\n{text}");
        assert!(
            marked[0].contains(&format!("({})", t["holds"])),
            "[{b}]\n{text}"
        );
    }
}

/// `name -> pid` as the workload wrote them.
fn lineage_pids(dir: &Path) -> HashMap<String, i64> {
    std::fs::read_to_string(dir.join("truth"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            Some((w.next()?.to_string(), w.next()?.parse().ok()?))
        })
        .collect()
}

/// Who asked, as a reviewer needs it: a `run` started under sudo by a user
/// who logged in as another records `SUDO_USER` and the audit login uid
/// beside uid 0, as the kernel and the environment say them (the login uid
/// set on the launching shell, read back from /proc by the shell itself).
#[test]
fn a_cli_run_records_the_login_uid_and_the_sudo_user_behind_it() {
    let Some(env) = Env::new("session") else {
        return;
    };
    let said = env.dir.path().join("loginuid");
    let mut cmd = env.cmd_for("sh");
    cmd.arg("-c")
        .arg(r#"echo 4242 > /proc/self/loginuid 2>/dev/null; cat /proc/self/loginuid > "$1"; exec "$2" run --quiet -- true"#)
        .arg("sh")
        .arg(&said)
        .arg(crate::util::bin())
        .env("SUDO_USER", "alice");
    let mut child = cmd.spawn().expect("sh");
    let status = wait_child(&mut child, Duration::from_secs(60)).expect("run ends");
    assert!(status.success(), "{status:?}");
    let login: u32 = std::fs::read_to_string(&said)
        .expect("the shell's loginuid")
        .trim()
        .parse()
        .expect("a number");
    let conn = rusqlite::Connection::open(env.ledger_path()).expect("ledger");
    let by: String = conn
        .query_row(
            "SELECT json_extract(data, '$.by') FROM events WHERE kind = 'tree.created'",
            [],
            |r| r.get(0),
        )
        .expect("tree.created names its requester");
    let by: Value = serde_json::from_str(&by).expect("json");
    assert_eq!(by["via"], "cli", "{by}");
    assert_eq!(by["sudo_user"], "alice", "{by}");
    if login == u32::MAX {
        crate::util::skip("the login uid could not be set here (no audit support): checked absent");
        assert!(by.get("login_uid").is_none(), "{by}");
    } else {
        assert_eq!(by["login_uid"], json!(login), "{by}");
    }
}
