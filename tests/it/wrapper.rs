//! The wrapper as harnesses use it (issue 26): owners that are processes
//! (not the thread that spawned `run`), `--owner-pid`, the caller's tree id
//! and status on file descriptors, teardowns finished by the next process
//! that can write their authorization, a fresh ledger under concurrent
//! first uses.
//!
//! Ground truth as elsewhere: every process of a test tree carries a marker
//! in its environment ([`Env::marked`]); owners are killed by their pid.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::custody::Env;
use crate::util::{KillOnDrop, bin, say, signal, skip, wait_child, wait_until};

/// Waits until no marked process lives; returns how long that took.
fn time_until_none_marked(env: &Env, limit: Duration) -> Option<Duration> {
    let t0 = Instant::now();
    wait_until(limit, || env.marked().is_empty()).then(|| t0.elapsed())
}

#[test]
fn a_wrapper_spawned_from_a_thread_that_exits_keeps_its_tree_until_the_process_dies() {
    let Some(env) = Env::new("session") else {
        return;
    };
    if Command::new("python3")
        .arg("-c")
        .arg("pass")
        .status()
        .is_err()
    {
        skip("python3 is not installed");
        return;
    }
    // A Python owner starts `run --die-with-parent` from a worker thread,
    // as a thread pool does, and the thread exits at once; the process
    // lives on (it waits for a file that never comes).
    let mut argv = vec![
        bin().display().to_string(),
        "run".into(),
        "--quiet".into(),
        "--die-with-parent".into(),
        "--".into(),
    ];
    argv.extend(env.marked_argv("sleep 600 & wait"));
    let script = format!(
        r#"
import os, subprocess, sys, threading, time
argv = {argv:?}
def start():
    subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
t = threading.Thread(target=start)
t.start(); t.join()
open("thread-gone", "w").close()
while not os.path.exists("never"):
    time.sleep(0.05)
"#
    );
    let owner = KillOnDrop(
        env.cmd_for("python3")
            .args(["-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("python owner"),
    );
    assert!(env.wait_marked(2), "the tree started: {:?}", env.marked());
    assert!(wait_until(Duration::from_secs(20), || env
        .dir()
        .join("thread-gone")
        .exists()));
    // The spawning thread is gone: the old PR_SET_PDEATHSIG fired at once.
    // A second of the owner process living must leave the tree alone.
    assert!(
        !wait_until(Duration::from_secs(1), || env.marked().len() < 2),
        "the tree was torn down while its owner process lives: {:?}",
        env.marked()
    );
    let show = env.show(1);
    assert_eq!(show["tree"]["state"], "running", "{show}");
    // Now the process dies: the tree follows within a second.
    signal(owner.id(), rustix::process::Signal::KILL);
    let took = time_until_none_marked(&env, Duration::from_secs(10));
    say(&format!(
        "wrapper: tree gone {took:?} after its owner process died"
    ));
    let took = took.expect("the tree outlived its owner process");
    assert!(took < Duration::from_secs(1), "took {took:?}");
    assert!(wait_until(Duration::from_secs(10), || {
        env.show(1)["tree"]["state"] == "ended"
    }));
    drop(owner);
}

#[test]
fn owner_pid_binds_the_tree_to_that_process_and_is_checked() {
    let Some(env) = Env::new("session") else {
        return;
    };
    let mut owner = KillOnDrop(
        Command::new("sleep")
            .arg("600")
            .stdin(Stdio::null())
            .spawn()
            .expect("owner"),
    );
    let pid = owner.id().to_string();
    // A start time that is not the owner's: refused (125, run's own
    // failure: its other statuses are the command's), nothing recorded.
    let out = env.output(&[
        "run",
        "--owner-pid",
        &pid,
        "--owner-start-ticks",
        "1",
        "--",
        "true",
    ]);
    assert_eq!(out.status.code(), Some(125), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("recycled"), "{err}");
    // No such process: refused too.
    let out = env.output(&["run", "--owner-pid", "999999999", "--", "true"]);
    assert_eq!(out.status.code(), Some(125), "{out:?}");
    assert!(
        !env.ledger_path().exists()
            || env
                .output(&["ls", "--all", "--json"])
                .stdout
                .starts_with(b"[]")
    );

    let run = KillOnDrop(env.spawn_run(&["--quiet", "--owner-pid", &pid], "sleep 600 & wait"));
    assert!(env.wait_marked(2));
    let show = env.show(1);
    assert_eq!(
        show["tree"]["owner"]["pid"].as_i64(),
        Some(owner.id() as i64),
        "{show}"
    );
    assert_eq!(show["tree"]["owner"]["kind"], "client", "{show}");
    signal(owner.id(), rustix::process::Signal::KILL);
    let _ = owner.0.wait();
    let took = time_until_none_marked(&env, Duration::from_secs(10));
    say(&format!(
        "wrapper: --owner-pid tree gone {took:?} after its owner died"
    ));
    assert!(took.expect("the tree outlived its owner") < Duration::from_secs(1));
    let mut run = run;
    let status = wait_child(&mut run.0, Duration::from_secs(10)).expect("run exits");
    assert_eq!(status.code(), Some(129), "{}", env.stderr_of(&run.0));
}

#[test]
fn forty_concurrent_first_uses_of_a_new_ledger_all_succeed() {
    let Some(env) = Env::new("session") else {
        return;
    };
    // Forty wrappers at once on a data dir that does not exist yet: the
    // ledger is created and migrated once, and none of them fails. With the
    // default busy timeout, as users run it (the env's short one is for
    // tests of a held lock).
    let t0 = Instant::now();
    let children: Vec<_> = (0..40)
        .map(|_| {
            env.cmd()
                .env_remove("TREEWARDEN_BUSY_TIMEOUT")
                .args(["run", "--quiet", "--", "true"])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .expect("start run")
        })
        .collect();
    let mut failures = Vec::new();
    for child in children {
        let out = child.wait_with_output().expect("run exits");
        if out.status.code() != Some(0) {
            failures.push(format!(
                "{:?}: {}",
                out.status.code(),
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
    }
    say(&format!(
        "wrapper: 40 concurrent first uses took {:?}",
        t0.elapsed()
    ));
    assert!(
        failures.is_empty(),
        "{} of 40 failed: {failures:#?}",
        failures.len()
    );
    let out = env.output(&["ls", "--all", "--json"]);
    let trees: serde_json::Value = serde_json::from_slice(&out.stdout).expect("ls json");
    assert_eq!(trees.as_array().map(Vec::len), Some(40), "{trees}");
    env.assert_verifies("forty first uses");
}

/// A `run --timeout` whose authorization cannot be written (a real second
/// connection holds `BEGIN IMMEDIATE`): it exits 125 leaving its survivors.
/// Returns them.
fn fail_closed_under_a_held_lock(env: &Env, extra: &[&str]) -> Vec<i32> {
    let mut args = vec!["--grace", "100ms", "--timeout", "3s", "--quiet"];
    args.extend_from_slice(extra);
    let mut run = KillOnDrop(env.spawn_run(&args, "trap '' TERM; sleep 600 & wait"));
    assert!(env.wait_marked(2), "{:?}", env.marked());
    let survivors = env.marked();
    let lock = rusqlite::Connection::open(env.ledger_path()).expect("open ledger");
    lock.execute_batch("BEGIN IMMEDIATE")
        .expect("take the write lock");
    let status = wait_child(&mut run.0, Duration::from_secs(60)).expect("run exits");
    lock.execute_batch("ROLLBACK").expect("release the lock");
    drop(lock);
    let err = env.stderr_of(&run.0);
    assert_eq!(status.code(), Some(125), "{err}");
    assert!(err.contains("forced kill skipped"), "{err}");
    assert!(
        err.contains("survivor(s) alive as evidence"),
        "says what it left: {err}"
    );
    assert!(
        survivors.iter().all(|p| crate::util::pid_alive(*p)),
        "survivors are left alive as evidence"
    );
    survivors
}

#[test]
fn the_next_run_finishes_a_teardown_that_could_not_be_authorized() {
    let Some(env) = Env::new("session") else {
        return;
    };
    let survivors = fail_closed_under_a_held_lock(&env, &[]);
    assert!(env.data_dir().join("unsettled/tree-1").exists());
    // The lock is gone: the next `run -- true` exits 0, and on its way it
    // finished tree 1's teardown — no `sweep`.
    let out = env.output(&["run", "--quiet", "--", "true"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        survivors.iter().all(|p| !crate::util::pid_alive(*p)),
        "the survivors were killed: {:?}",
        env.marked()
    );
    assert!(!env.data_dir().join("unsettled/tree-1").exists());
    let show = env.show(1);
    assert_eq!(show["tree"]["state"], "ended", "{show}");
    // With a fresh authorization naming exactly the survivors.
    let events = env.export();
    let auth: Vec<_> = events
        .iter()
        .filter(|e| e["tree"] == 1 && e["kind"] == "kill.authorized")
        .collect();
    assert_eq!(
        auth.len(),
        1,
        "one authorization, the finishing one: {auth:?}"
    );
    let mut named: Vec<i64> = auth[0]["data"]["targets"]
        .as_array()
        .expect("targets")
        .iter()
        .flat_map(|t| t["identities"].as_array().cloned().unwrap_or_default())
        .filter_map(|id| id["pid"].as_i64())
        .collect();
    named.sort_unstable();
    let mut expected: Vec<i64> = survivors.iter().map(|p| i64::from(*p)).collect();
    expected.sort_unstable();
    assert_eq!(named, expected, "{}", auth[0]);
    assert!(env.assert_kills_authorized() > 0);
    assert!(
        !events.iter().any(|e| e["kind"] == "dispatch.refused"),
        "dispatch was never refused"
    );
    env.assert_verifies("finished by the next run");
}

#[test]
fn an_unsettled_tree_refuses_dispatch_to_its_owner_only_unless_the_scope_is_the_host() {
    let Some(env) = Env::new("session") else {
        return;
    };
    let mut owner = KillOnDrop(
        Command::new("sleep")
            .arg("600")
            .stdin(Stdio::null())
            .spawn()
            .expect("owner"),
    );
    let pid = owner.id().to_string();
    fail_closed_under_a_held_lock(&env, &["--owner-pid", &pid]);
    let code = |args: &[&str]| {
        let out = env.output(args);
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    // Its owner lives, so nothing settles it; work for that owner is refused.
    let (c, err) = code(&["run", "--quiet", "--owner-pid", &pid, "--", "true"]);
    assert_eq!(c, Some(125), "{err}");
    assert!(
        err.contains("dispatch refused: tree 1 is unsettled"),
        "{err}"
    );
    // Other owners go on.
    let (c, err) = code(&["run", "--quiet", "--", "true"]);
    assert_eq!(c, Some(0), "{err}");
    // Unless the scope is the host.
    let (c, err) = code(&["run", "--quiet", "--dispatch-scope", "host", "--", "true"]);
    assert_eq!(c, Some(125), "{err}");
    assert!(
        err.contains("dispatch refused: tree 1 is unsettled"),
        "{err}"
    );
    // The owner dies: the next run finishes the teardown, and dispatch
    // reopens for the whole host by itself.
    signal(owner.id(), rustix::process::Signal::KILL);
    let _ = owner.0.wait();
    let (c, err) = code(&["run", "--quiet", "--dispatch-scope", "host", "--", "true"]);
    assert_eq!(c, Some(0), "{err}");
    assert!(env.wait_none_marked(), "{:?}", env.marked());
    assert_eq!(env.show(1)["tree"]["state"], "ended");
}

/// `sh -c 'exec treewarden run ARGS 3>id 4>status'` in the env's dir: the
/// exit code, the id file's text and the status line parsed.
fn run_with_fds(env: &Env, args: &str) -> (Option<i32>, String, serde_json::Value) {
    let script = format!("exec \"$0\" run --quiet --id-fd 3 --status-fd 4 {args} 3>id 4>status");
    let out = env
        .cmd_for("sh")
        .args(["-c", &script])
        .arg(bin())
        .stdin(Stdio::null())
        .output()
        .expect("run");
    let id = std::fs::read_to_string(env.dir().join("id")).unwrap_or_default();
    let status = std::fs::read_to_string(env.dir().join("status")).unwrap_or_default();
    assert_eq!(status.lines().count(), 1, "one status line: {status:?}");
    let status = serde_json::from_str(&status).expect("status json");
    (out.status.code(), id, status)
}

#[test]
fn id_fd_and_status_fd_tell_the_caller_its_tree_and_runs_own_verdict() {
    let Some(env) = Env::new("session") else {
        return;
    };
    // The command's own `exit 125`: the status line says it was the
    // command's (error null). The id was there before the command ran, the
    // command got it as TREEWARDEN_TREE_ID, and neither descriptor leaked
    // into it.
    let (code, id, status) = run_with_fds(
        &env,
        "-- sh -c 'cat id > id-seen; echo $TREEWARDEN_TREE_ID > env-seen; \
         for n in 3 4; do [ -e /proc/self/fd/$n ] && echo $n >> leaked; done; exit 125'",
    );
    assert_eq!(code, Some(125));
    assert_eq!(id, "1\n");
    assert_eq!(
        std::fs::read_to_string(env.dir().join("id-seen")).unwrap_or_default(),
        "1\n"
    );
    assert_eq!(
        std::fs::read_to_string(env.dir().join("env-seen")).unwrap_or_default(),
        "1\n"
    );
    assert!(
        !env.dir().join("leaked").exists(),
        "a descriptor leaked into the command"
    );
    assert_eq!(
        status,
        serde_json::json!({"tree": 1, "state": "ended", "exit": {"code": 125, "signal": null}, "error": null})
    );

    // A timeout: the root killed by the teardown's SIGTERM, run exits 124.
    let (code, id, status) = run_with_fds(&env, "--timeout 200ms -- sleep 600");
    assert_eq!(code, Some(124));
    assert_eq!(id, "2\n");
    assert_eq!(
        status,
        serde_json::json!({"tree": 2, "state": "ended", "exit": {"code": null, "signal": 15}, "error": null})
    );

    // treewarden's own failure, before any tree: error says it, tree null.
    let (code, id, status) = run_with_fds(&env, "--owner-pid 999999999 -- true");
    assert_eq!(code, Some(125));
    assert_eq!(id, "");
    assert_eq!(status["tree"], serde_json::Value::Null, "{status}");
    assert_eq!(status["exit"], serde_json::Value::Null, "{status}");
    assert!(
        status["error"]
            .as_str()
            .is_some_and(|e| e.contains("no such process")),
        "{status}"
    );

    // The command's stdio is not the caller's descriptor to take.
    let out = env.output(&["run", "--status-fd", "1", "--", "true"]);
    assert_eq!(out.status.code(), Some(125));
    assert!(String::from_utf8_lossy(&out.stderr).contains("use 3 or above"));
}

#[test]
fn lifetime_owner_returns_the_roots_status_at_once_and_keeps_what_it_left_until_the_owner_dies() {
    let Some(env) = Env::new("session") else {
        return;
    };
    // The owner is run's parent: a shell that runs `run --lifetime owner`
    // in the foreground, writes its status, then becomes a long sleep (same
    // pid, same start time: the owner lives on). The background job ignores
    // SIGTERM, so its end needs the authorized SIGKILL.
    let job: Vec<String> = env
        .marked_argv("trap '' TERM; sleep 600 & exit 0")
        .iter()
        .map(|a| format!("'{}'", a.replace('\'', "'\\''")))
        .collect();
    let script = format!(
        "\"$0\" run --quiet --lifetime owner --grace 200ms -- {}; echo $? > code; exec sleep 600",
        job.join(" ")
    );
    let t0 = Instant::now();
    let owner = KillOnDrop(
        env.cmd_for("sh")
            .args(["-c", &script])
            .arg(bin())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("owner shell"),
    );
    let code_file = env.dir().join("code");
    assert!(wait_until(Duration::from_secs(10), || {
        std::fs::read_to_string(&code_file).is_ok_and(|c| c.ends_with('\n'))
    }));
    let returned = t0.elapsed();
    say(&format!(
        "wrapper: --lifetime owner run returned after {returned:?}"
    ));
    assert_eq!(
        std::fs::read_to_string(&code_file).unwrap_or_default(),
        "0\n"
    );
    assert!(
        returned < Duration::from_secs(1),
        "returned after {returned:?}"
    );
    // The job lives on while its owner does.
    assert!(env.wait_marked(1));
    assert!(
        !wait_until(Duration::from_millis(800), || env.marked().is_empty()),
        "the background job died with its root"
    );
    let show = env.show(1);
    assert_eq!(show["tree"]["state"], "running", "{show}");
    assert_eq!(
        show["tree"]["owner"]["pid"].as_i64(),
        Some(owner.id() as i64),
        "{show}"
    );
    let ls = env.output(&["ls"]);
    assert!(
        String::from_utf8_lossy(&ls.stdout).contains("root exited, members alive"),
        "{}",
        String::from_utf8_lossy(&ls.stdout)
    );
    let events = env.export();
    assert!(
        events.iter().any(|e| e["kind"] == "member.exited"
            && e["data"]["identity"]["pid"] == show["tree"]["root_pid"]
            && e["data"]["exit"]["code"] == 0),
        "the root's exit is recorded"
    );
    // The owner dies: the job is torn down within a second, with its
    // authorization.
    signal(owner.id(), rustix::process::Signal::KILL);
    let took = time_until_none_marked(&env, Duration::from_secs(10));
    say(&format!(
        "wrapper: kept tree gone {took:?} after its owner died"
    ));
    let took = took.expect("the kept tree outlived its owner");
    assert!(took < Duration::from_secs(1), "took {took:?}");
    assert!(wait_until(Duration::from_secs(10), || env.show(1)["tree"]
        ["state"]
        == "ended"));
    assert!(
        env.assert_kills_authorized() > 0,
        "the SIGKILL had its authorization"
    );
    env.assert_verifies("kept tree");
    drop(owner);
}

#[test]
fn api_lifetime_owner_keeps_what_the_root_left_until_the_owner_dies() {
    let s = crate::serve::Server::start(&[]);
    let mut client = KillOnDrop(
        Command::new("sleep")
            .arg("300")
            .stdin(Stdio::null())
            .spawn()
            .expect("client process"),
    );
    let mut body = s.body("trap '' TERM; sleep 600 & exit 0");
    body["owner_pid"] = serde_json::json!(client.id());
    body["lifetime"] = serde_json::json!("owner");
    // Without an owner it is refused: nothing would end the tree.
    let mut orphan = body.clone();
    orphan.as_object_mut().map(|o| o.remove("owner_pid"));
    let (status, v) = s.post("/api/trees", Some(&orphan));
    assert_eq!(status, 422, "{v}");
    assert!(v.to_string().contains("owner_pid"), "{v}");

    let t0 = Instant::now();
    let (status, v) = s.post("/api/trees", Some(&body));
    assert_eq!(status, 201, "{v}");
    let id = v["id"].as_i64().expect("tree id");
    let tree = |id: i64| -> serde_json::Value {
        s.get(&format!("/api/trees/{id}"))
            .json()
            .expect("tree json")
    };
    // The root's exit is recorded and reported at once; the tree lives on.
    assert!(
        wait_until(Duration::from_secs(10), || tree(id)["tree"]["flags"]
            .as_array()
            .is_some_and(|f| f.iter().any(|f| f == "root_exited"))),
        "{}",
        tree(id)
    );
    let reported = t0.elapsed();
    say(&format!(
        "wrapper: API root exit reported after {reported:?}"
    ));
    assert!(reported < Duration::from_secs(1), "{reported:?}");
    let t = tree(id);
    assert_eq!(t["tree"]["state"], "running", "{t}");
    assert!(
        !wait_until(Duration::from_millis(800), || s.marked().is_empty()),
        "the background job died with its root"
    );
    // The owner dies: torn down within a second, with its authorization.
    let _ = client.0.kill();
    let _ = client.0.wait();
    let killed = Instant::now();
    assert!(wait_until(Duration::from_secs(10), || s
        .marked()
        .is_empty()));
    let took = killed.elapsed();
    say(&format!(
        "wrapper: API kept tree gone {took:?} after its owner died"
    ));
    assert!(took < Duration::from_secs(1), "{took:?}");
    assert!(wait_until(
        Duration::from_secs(10),
        || tree(id)["tree"]["state"] == "ended"
    ));
    let events = tree(id)["events"].as_array().cloned().unwrap_or_default();
    assert!(
        events.iter().any(|e| e["kind"] == "kill.authorized"),
        "the SIGKILL had its authorization: {events:?}"
    );
}
