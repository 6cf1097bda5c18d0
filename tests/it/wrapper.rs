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
use crate::util::{KillOnDrop, bin, say, signal, skip, stay_alive, wait_child, wait_until};

/// The forty-process burst takes this exclusively; the tests that measure
/// "within a second" take it shared, so the burst of this module is never
/// what they measure.
static BURST: std::sync::RwLock<()> = std::sync::RwLock::new(());

fn timed() -> std::sync::RwLockReadGuard<'static, ()> {
    BURST.read().unwrap_or_else(|e| e.into_inner())
}

/// "Within a second", the issue's bar, measured on a quiet host; on a host
/// whose load exceeds its CPUs (the suite, and other work, on two cores) the
/// bound scales with the load (at most 5 s), and the measured figure is
/// printed either way.
fn a_second() -> Duration {
    Duration::from_secs_f64(crate::util::load_factor())
}

/// Waits until no marked process lives; returns how long that took.
fn time_until_none_marked(env: &Env, limit: Duration) -> Option<Duration> {
    let t0 = Instant::now();
    wait_until(limit, || env.marked().is_empty()).then(|| t0.elapsed())
}

#[test]
fn a_wrapper_spawned_from_a_thread_that_exits_keeps_its_tree_until_the_process_dies() {
    let _timed = timed();
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
import signal, subprocess, threading
argv = {argv:?}
def start():
    subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
t = threading.Thread(target=start)
t.start(); t.join()
open("thread-gone", "w").close()
# The owner lives on, doing nothing, until the test SIGKILLs it.
while True:
    signal.pause()
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
    let tree = env
        .marked_at_least(2)
        .unwrap_or_else(|| panic!("the tree started: {:?}", env.marked()));
    assert!(wait_until(Duration::from_secs(20), || env
        .dir()
        .join("thread-gone")
        .exists()));
    // The spawning thread is gone: the old PR_SET_PDEATHSIG fired at once.
    // A second of the owner process living must leave the tree alone.
    assert!(
        stay_alive(&tree, Duration::from_secs(1)),
        "the tree {tree:?} was torn down while its owner process lives: {:?}",
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
    assert!(took < a_second(), "took {took:?}");
    assert!(wait_until(Duration::from_secs(10), || {
        env.show(1)["tree"]["state"] == "ended"
    }));
    drop(owner);
}

#[test]
fn owner_pid_binds_the_tree_to_that_process_and_is_checked() {
    let _timed = timed();
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
    assert!(took.expect("the tree outlived its owner") < a_second());
    let mut run = run;
    let status = wait_child(&mut run.0, Duration::from_secs(10)).expect("run exits");
    assert_eq!(status.code(), Some(129), "{}", env.stderr_of(&run.0));
}

#[test]
fn forty_concurrent_first_uses_of_a_new_ledger_all_succeed() {
    let _burst = BURST.write().unwrap_or_else(|e| e.into_inner());
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
    let _timed = timed();
    let Some(env) = Env::new("session") else {
        return;
    };
    lifetime_owner_case(&env, "no service");
}

#[test]
fn lifetime_owner_under_run_meets_the_same_bar_with_a_service_running() {
    let _timed = timed();
    let Some(env) = Env::new("session") else {
        return;
    };
    // The env's data dir is the running service's: run, ls, show and the
    // export all use that ledger, the service watching it meanwhile.
    let s = crate::serve::Server::start(&[]);
    std::os::unix::fs::symlink(s.data_dir(), env.data_dir()).expect("data dir link");
    lifetime_owner_case(&env, "serve running");
    drop(s);
}

/// `run --lifetime owner -- sh -c 'trap "" TERM; sleep 600 & exit 0'` from
/// an owner shell: returns 0 within a second, the job lives while the
/// owner does, and is torn down within a second of the owner's death, with
/// its authorization.
fn lifetime_owner_case(env: &Env, label: &str) {
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
        "wrapper: [{label}] --lifetime owner run returned after {returned:?}"
    ));
    assert_eq!(
        std::fs::read_to_string(&code_file).unwrap_or_default(),
        "0\n"
    );
    assert!(returned < a_second(), "returned after {returned:?}");
    // The job lives on while its owner does.
    let job = env.marked_at_least(1).expect("the background job lives");
    assert!(
        stay_alive(&job, Duration::from_millis(800)),
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
    let took = time_until_none_marked(env, Duration::from_secs(10));
    say(&format!(
        "wrapper: [{label}] kept tree gone {took:?} after its owner died"
    ));
    let took = took.expect("the kept tree outlived its owner");
    assert!(took < a_second(), "took {took:?}");
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
    let _timed = timed();
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
    assert!(reported < a_second(), "{reported:?}");
    let t = tree(id);
    assert_eq!(t["tree"]["state"], "running", "{t}");
    let mut job = Vec::new();
    assert!(wait_until(Duration::from_secs(10), || {
        job = s.marked();
        !job.is_empty()
    }));
    assert!(
        stay_alive(&job, Duration::from_millis(800)),
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
    assert!(took < a_second(), "{took:?}");
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

/// Drives `run` on a real pseudo-terminal, as a user's terminal would be:
/// python's `os.openpty`, the wrapper's stdio on the slave. Prints one JSON
/// object: what the terminal showed, run's exit code, whether the
/// terminal's mode came back.
const PTY_DRIVER: &str = r#"
import fcntl, json, os, select, struct, subprocess, sys, termios, time
spec = json.loads(sys.argv[1])
master, slave = os.openpty()
fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
before = termios.tcgetattr(slave)
p = subprocess.Popen(spec["argv"], stdin=slave, stdout=slave, stderr=slave,
                     start_new_session=True, cwd=spec["cwd"])
out = b""
def read_until(token, limit):
    global out
    deadline = time.time() + limit
    while token.encode() not in out and time.time() < deadline:
        r, _, _ = select.select([master], [], [], 0.05)
        if r:
            try:
                out += os.read(master, 4096)
            except OSError:
                break
    return token.encode() in out
steps = []
for step in spec["steps"]:
    if step[0] == "expect":
        steps.append([step[1], read_until(step[1], 20)])
    elif step[0] == "write":
        os.write(master, step[1].encode())
    elif step[0] == "resize":
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", step[1], step[2], 0, 0))
        os.kill(p.pid, 28)  # SIGWINCH, as the kernel sends it to a foreground job
try:
    code = p.wait(timeout=30)
except subprocess.TimeoutExpired:
    p.kill(); code = p.wait()
read_until("\0never", 0.2)
print(json.dumps({"code": code, "steps": steps, "restored": termios.tcgetattr(slave) == before,
                  "raw_seen": out.decode("utf-8", "replace")}))
"#;

/// Runs [`PTY_DRIVER`]; `None` (after a skip line) without python3.
fn on_a_pty(
    env: &Env,
    run_args: &[&str],
    script: &str,
    steps: serde_json::Value,
) -> Option<serde_json::Value> {
    if Command::new("python3")
        .arg("-c")
        .arg("import pty")
        .status()
        .map(|s| !s.success())
        .unwrap_or(true)
    {
        skip("python3 with its pty support is not installed");
        return None;
    }
    let mut argv = vec![bin().display().to_string(), "run".into()];
    argv.extend(run_args.iter().map(|a| a.to_string()));
    argv.push("--".into());
    argv.extend(env.marked_argv(script));
    let spec = serde_json::json!({"argv": argv, "steps": steps, "cwd": env.dir()});
    let out = env
        .cmd_for("python3")
        .args(["-c", PTY_DRIVER])
        .arg(spec.to_string())
        .stdin(Stdio::null())
        .output()
        .expect("pty driver");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(serde_json::from_slice(&out.stdout).expect("driver json"))
}

#[test]
fn under_a_pty_the_tree_gets_a_terminal_window_sizes_and_ctrl_c_as_sigint() {
    let Some(env) = Env::new("session") else {
        return;
    };
    let script = "trap 'echo got-INT; exit 7' INT; trap 'echo size $(stty size)' WINCH; \
                  tty; echo start $(stty size); echo ready; while :; do sleep 0.05; done";
    let Some(r) = on_a_pty(
        &env,
        &["--quiet"],
        script,
        serde_json::json!([
            ["expect", "ready"],
            ["resize", 40, 100],
            ["expect", "size 40 100"],
            ["write", "\u{3}"],
            ["expect", "got-INT"],
        ]),
    ) else {
        return;
    };
    let seen = r["raw_seen"].as_str().unwrap_or_default().to_string();
    assert!(
        seen.contains("/dev/pts/"),
        "run -- tty prints a terminal: {seen}"
    );
    assert!(seen.contains("start 24 80"), "the caller's size: {seen}");
    for step in r["steps"].as_array().expect("steps") {
        assert_eq!(step[1], true, "never saw {}: {seen}", step[0]);
    }
    // Ctrl-C reached the tree as SIGINT (its trap ran), run passed on 7.
    assert_eq!(r["code"], 7, "{seen}");
    assert_eq!(r["restored"], true, "the caller's terminal mode came back");
    assert!(env.wait_none_marked(), "{:?}", env.marked());
    let show = env.show(1);
    assert_eq!(show["tree"]["state"], "ended", "{show}");
}

#[test]
fn under_a_pty_a_timeout_still_tears_the_tree_down_with_its_first_signal() {
    let Some(env) = Env::new("session") else {
        return;
    };
    let Some(r) = on_a_pty(
        &env,
        &["--quiet", "--timeout", "1s", "--grace", "200ms"],
        "trap 'echo got-TERM; exit 3' TERM; tty; echo ready; sleep 600 & wait",
        serde_json::json!([["expect", "ready"], ["expect", "got-TERM"]]),
    ) else {
        return;
    };
    let seen = r["raw_seen"].as_str().unwrap_or_default().to_string();
    assert!(seen.contains("/dev/pts/"), "{seen}");
    for step in r["steps"].as_array().expect("steps") {
        assert_eq!(step[1], true, "never saw {}: {seen}", step[0]);
    }
    assert_eq!(r["code"], 124, "{seen}");
    assert_eq!(r["restored"], true);
    assert!(env.wait_none_marked(), "{:?}", env.marked());
    // And --no-tty leaves the tree without a controlling terminal, even on
    // a terminal (its stdin is still the caller's: `tty` would name it).
    let Some(r) = on_a_pty(
        &env,
        &["--quiet", "--no-tty"],
        "(exec < /dev/tty) 2>/dev/null && echo has-ctty || echo no-terminal",
        serde_json::json!([["expect", "no-terminal"]]),
    ) else {
        return;
    };
    assert_eq!(r["steps"][0][1], true, "{}", r["raw_seen"]);
    assert_eq!(r["code"], 0);
}
