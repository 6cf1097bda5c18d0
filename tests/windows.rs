//! The Windows suite (issue 27): real Windows processes (cmd, ping, the
//! `win_helper` example) in real Job Objects, a real ledger, under wine in
//! CI (`tests/run`: `cargo test --target x86_64-pc-windows-gnu --test
//! windows` with `tests/windows/wine-run` as the runner).
//!
//! Ground truth is what the workload says: each helper writes its pid to
//! `<dir>/<marker>.pid`; a survivor is a pid whose process (same creation
//! time) still runs. Every test ends what it started by its own pid.

#![cfg(windows)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use treewarden::proc::{Identity, Liveness, Sig};

/// Bounds scaled for a loaded CI machine under wine.
const WAIT: Duration = Duration::from_secs(60);

struct Env {
    dir: tempfile::TempDir,
    /// Processes to end (by identity) if a test fails half-way.
    started: std::cell::RefCell<Vec<Identity>>,
}

impl Drop for Env {
    fn drop(&mut self) {
        for id in self.started.borrow().iter() {
            if id.check() == Liveness::Same {
                let _ = treewarden::proc::signal_process(id, Sig::Kill);
            }
        }
    }
}

fn helper() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    // target/<triple>/debug/deps/windows-*.exe -> target/<triple>/debug/examples/
    let debug = exe.parent().and_then(Path::parent).expect("target dir");
    let h = debug.join("examples").join("win_helper.exe");
    assert!(
        h.is_file(),
        "{} missing: build it first (cargo build --target x86_64-pc-windows-gnu --example win_helper)",
        h.display()
    );
    h
}

impl Env {
    fn new() -> Self {
        Env {
            dir: tempfile::tempdir().expect("tempdir"),
            started: std::cell::RefCell::new(Vec::new()),
        }
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_treewarden"));
        c.arg("--data-dir").arg(self.data()).args(args);
        c
    }

    fn output(&self, args: &[&str]) -> Output {
        self.cmd(args)
            .stdin(Stdio::null())
            .output()
            .expect("treewarden runs")
    }

    /// A background treewarden, its output in files (a pipe nobody reads
    /// could fill and stall it).
    fn spawn(&self, args: &[&str]) -> Child {
        let out = std::fs::File::create(self.dir.path().join("run.out")).expect("run.out");
        let err = std::fs::File::create(self.dir.path().join("run.err")).expect("run.err");
        self.cmd(args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .expect("treewarden starts")
    }

    /// What the background treewarden wrote on stderr.
    fn run_err(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("run.err")).unwrap_or_default()
    }

    fn pids(&self) -> String {
        self.dir.path().display().to_string()
    }

    /// The identity of the helper that wrote `<marker>.pid`, once it did.
    fn wait_marker(&self, marker: &str) -> Option<Identity> {
        let file = self.dir.path().join(format!("{marker}.pid"));
        let mut id = None;
        wait_until(WAIT, || {
            id = std::fs::read_to_string(&file)
                .ok()
                .and_then(|text| text.trim().parse::<i32>().ok())
                .and_then(|pid| treewarden::proc::identity_of(pid).ok().flatten());
            id.is_some()
        });
        if let Some(id) = &id {
            self.started.borrow_mut().push(id.clone());
        }
        id
    }

    fn show(&self, tree: i64) -> Value {
        let out = self.output(&["show", &tree.to_string(), "--json"]);
        assert!(
            out.status.success(),
            "show: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("show --json is JSON")
    }

    fn verify(&self) {
        let out = self.output(&["verify"]);
        assert!(
            out.status.success(),
            "verify: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// Polls `cond` every 20 ms until it holds (`true`) or `limit` passes.
fn wait_until(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let until = Instant::now() + limit;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= until {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20)); // the poll interval of wait_until, not a wait for a condition
    }
}

fn gone_within(id: &Identity, wait: Duration) -> bool {
    wait_until(wait, || id.check() != Liveness::Same)
}

fn wait_child(child: &mut Child, wait: Duration) -> Option<std::process::ExitStatus> {
    let mut status = None;
    wait_until(wait, || {
        status = child.try_wait().ok().flatten();
        status.is_some()
    });
    if status.is_none() {
        let _ = child.kill();
    }
    status
}

/// Every `TERMINATE_JOB` (and `TERMINATE_PROCESS`) of the tree follows a
/// committed `kill.authorized` it cites, in the event chain and in the
/// signals table; returns how many `TERMINATE_JOB`s on target kind `job`.
fn assert_terminations_authorized(detail: &Value) -> usize {
    let events = detail["events"].as_array().expect("events");
    let mut authorized = Vec::new();
    let mut jobs = 0;
    for e in events {
        match e["kind"].as_str() {
            Some("kill.authorized") => authorized.push(e["data"]["authorization"].as_i64()),
            Some("signal.sent")
                if matches!(
                    e["data"]["signal"].as_str(),
                    Some("TERMINATE_JOB" | "TERMINATE_PROCESS" | "SIGKILL")
                ) =>
            {
                let auth = e["data"]["authorization"].as_i64();
                assert!(auth.is_some(), "a forced kill without authorization: {e}");
                assert!(
                    authorized.contains(&auth),
                    "a forced kill before its kill.authorized: {e}"
                );
                if e["data"]["signal"] == "TERMINATE_JOB" {
                    assert_eq!(e["data"]["target_kind"], "job", "{e}");
                    jobs += 1;
                }
            }
            _ => {}
        }
    }
    for s in detail["signals"].as_array().expect("signals") {
        if s["signal"] == "TERMINATE_JOB" {
            assert!(s["authorization"].as_i64().is_some(), "{s}");
        }
    }
    jobs
}

/// The Done-when workload, with our helpers in place of ping (they ignore
/// CTRL_BREAK, so only the job's terminate ends them): a background
/// grandchild (`start /b`) and a foreground one, a 2 s timeout.
#[test]
fn timeout_with_a_background_grandchild_ends_the_whole_job() {
    let env = Env::new();
    let h = helper();
    let line = format!(
        "start /b {h} sleep bg-1 600 {d} & {h} sleep fg-1 600 {d}",
        h = h.display(),
        d = env.pids()
    );
    let mut run = env.spawn(&[
        "run",
        "--timeout",
        "2s",
        "--grace",
        "500ms",
        "--quiet",
        "--",
        "cmd",
        "/c",
        &line,
    ]);
    let bg = env
        .wait_marker("bg-1")
        .expect("the background grandchild started");
    let fg = env
        .wait_marker("fg-1")
        .expect("the foreground grandchild started");
    let status = wait_child(&mut run, WAIT).expect("run exits");
    let err = env.run_err();
    assert_eq!(status.code(), Some(124), "{err}");
    assert!(
        gone_within(&bg, Duration::from_secs(10)),
        "background grandchild survived"
    );
    assert!(
        gone_within(&fg, Duration::from_secs(10)),
        "foreground grandchild survived"
    );
    let detail = env.show(1);
    assert_eq!(detail["tree"]["boundary"], "job");
    assert_eq!(assert_terminations_authorized(&detail), 1, "{detail}");
    env.verify();
}

/// A root that exits at once leaving a child: run returns the root's code,
/// and the child (in the job, ignoring the break) is terminated with
/// authority.
#[test]
fn a_root_that_exits_leaving_a_child_is_followed_by_the_job_terminate() {
    let env = Env::new();
    let h = helper().display().to_string();
    let mut run = env.spawn(&[
        "run",
        "--grace",
        "300ms",
        "--quiet",
        "--",
        &h,
        "spawn-exit",
        "root-2",
        "600",
        &env.pids(),
    ]);
    let child = env.wait_marker("root-2-child").expect("the child started");
    let status = wait_child(&mut run, WAIT).expect("run exits");
    let err = env.run_err();
    assert_eq!(status.code(), Some(0), "the root's own status: {err}");
    assert!(
        gone_within(&child, Duration::from_secs(10)),
        "the root's child survived"
    );
    let detail = env.show(1);
    assert_eq!(assert_terminations_authorized(&detail), 1, "{detail}");
    env.verify();
}

/// Authorization before every TerminateJobObject, across several trees,
/// in the exported chain as verify reads it; and the database refuses a
/// TERMINATE_JOB row without one.
#[test]
fn every_terminate_job_follows_its_committed_authorization() {
    let env = Env::new();
    let h = helper().display().to_string();
    for i in 0..2 {
        let marker = format!("auth-{i}");
        let out = env.output(&[
            "run",
            "--timeout",
            "1s",
            "--grace",
            "200ms",
            "--quiet",
            "--",
            &h,
            "sleep",
            &marker,
            "600",
            &env.pids(),
        ]);
        assert_eq!(
            out.status.code(),
            Some(124),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let id = env.wait_marker(&marker).expect("helper started");
        assert!(gone_within(&id, Duration::from_secs(10)));
    }
    for tree in 1..=2 {
        assert_eq!(assert_terminations_authorized(&env.show(tree)), 1);
    }
    env.verify();
    let conn = rusqlite::Connection::open(env.data().join("ledger.db")).expect("open ledger");
    let refused = conn.execute(
        "INSERT INTO signals (tree_id, signal, target_kind, target, result, authorization_id, at)
         VALUES (1, 'TERMINATE_JOB', 'job', 'job:x', 'sent', NULL, 'now')",
        [],
    );
    assert!(
        refused.is_err(),
        "TERMINATE_JOB without an authorization was accepted"
    );
}

/// The ledger's write lock held by another connection when the teardown
/// must authorize: no TerminateJobObject, exit 125, the tree ambiguous,
/// and the survivor alive after run exits (the job's KILL_ON_JOB_CLOSE was
/// cleared before the authorization, so run's exit does not kill it). Once
/// the lock is gone, the sweep finishes the teardown with authority.
#[test]
fn a_held_ledger_lock_skips_the_terminate_and_leaves_the_survivor_alive() {
    let env = Env::new();
    let h = helper().display().to_string();
    let mut run = env.spawn(&[
        "run",
        "--timeout",
        "3s",
        "--grace",
        "300ms",
        "--quiet",
        "--",
        &h,
        "sleep",
        "lock-4",
        "600",
        &env.pids(),
    ]);
    let survivor = env.wait_marker("lock-4").expect("helper started");
    let lock = rusqlite::Connection::open(env.data().join("ledger.db")).expect("open ledger");
    lock.execute_batch("BEGIN IMMEDIATE")
        .expect("take the write lock");
    let status = wait_child(&mut run, WAIT).expect("run exits");
    let err = env.run_err();
    assert_eq!(status.code(), Some(125), "{err}");
    assert!(err.contains("forced kill skipped"), "{err}");
    // run has exited and closed its job handle: the survivor lives on.
    // An absence has no event to wait for: it is watched for half a second
    // (KILL_ON_JOB_CLOSE, had it been left set, acts at the close).
    assert!(
        !gone_within(&survivor, Duration::from_millis(500)),
        "the survivor was killed behind the ledger's back"
    );
    lock.execute_batch("ROLLBACK").expect("release the lock");
    drop(lock);
    let detail = env.show(1);
    assert!(
        !detail["signals"]
            .as_array()
            .expect("signals")
            .iter()
            .any(|s| s["signal"] == "TERMINATE_JOB"),
        "{detail}"
    );
    let out = env.output(&["sweep"]);
    assert!(
        out.status.success(),
        "sweep: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        gone_within(&survivor, Duration::from_secs(10)),
        "the sweep did not end the survivor"
    );
    assert_terminations_authorized(&env.show(1));
    env.verify();
}

/// The owner (run) dies without its teardown: the job's last handle closes
/// and KILL_ON_JOB_CLOSE (recorded before the root ran) ends the tree; the
/// sweep then settles the record.
#[test]
fn owner_death_closes_the_job_and_the_sweep_settles_the_tree() {
    let env = Env::new();
    let h = helper().display().to_string();
    let mut run = env.spawn(&[
        "run",
        "--quiet",
        "--",
        &h,
        "sleep",
        "owner-5",
        "600",
        &env.pids(),
    ]);
    let member = env.wait_marker("owner-5").expect("helper started");
    run.kill().expect("end the owner");
    let _ = run.wait();
    assert!(
        gone_within(&member, Duration::from_secs(20)),
        "the job's close did not end the tree"
    );
    let detail = env.show(1);
    let flags = detail["tree"]["flags"].to_string();
    assert!(
        flags.contains("kill_on_job_close"),
        "the standing kill is on the record: {flags}"
    );
    let out = env.output(&["sweep"]);
    assert!(
        out.status.success(),
        "sweep: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let state = env.show(1)["tree"]["state"]
        .as_str()
        .unwrap_or("")
        .to_string();
    assert!(
        matches!(state.as_str(), "ended" | "vanished"),
        "swept: {state}"
    );
    env.verify();
}

/// A member asking for CREATE_BREAKAWAY_FROM_JOB is refused (the job has
/// no BREAKAWAY_OK).
#[test]
fn breakaway_from_the_job_is_refused() {
    let env = Env::new();
    let h = helper().display().to_string();
    let out = env.output(&[
        "run",
        "--quiet",
        "--",
        &h,
        "breakaway",
        "brk-6",
        &env.pids(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    if let Some(escaped) = env
        .dir
        .path()
        .join("brk-6-escaped.pid")
        .is_file()
        .then(|| env.wait_marker("brk-6-escaped"))
        .flatten()
    {
        let _ = treewarden::proc::signal_process(&escaped, Sig::Kill);
    }
    assert!(
        stdout.contains("breakaway refused"),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.status.code(), Some(3), "{stdout}");
    env.verify();
}

/// Exit codes as on Linux: the command's own status, 127 for a program
/// that is not there (the tree recorded spawn_failed), 124 on timeout
/// (above).
#[test]
fn exit_codes_are_the_commands_own_and_127_for_no_such_program() {
    let env = Env::new();
    let out = env.output(&["run", "--quiet", "--", "cmd", "/c", "exit 7"]);
    assert_eq!(
        out.status.code(),
        Some(7),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = env.output(&["run", "--quiet", "--", "no-such-program-tw27"]);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(127), "{err}");
    assert!(err.contains("command not found"), "{err}");
    assert_eq!(env.show(2)["tree"]["state"], "spawn_failed");
    env.verify();
}

/// One HTTP/1.1 request to the service on 127.0.0.1 (a fresh connection,
/// `Connection: close`): its status and body. No client crate builds for
/// this target's suite; this is all the tests need.
fn http(
    addr: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&Value>,
) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect to the service");
    s.set_read_timeout(Some(WAIT)).expect("read timeout");
    let body = body.map(Value::to_string).unwrap_or_default();
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    if let Some(t) = token {
        req.push_str(&format!("Authorization: Bearer {t}\r\n"));
    }
    if !body.is_empty() || method == "POST" {
        req.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    req.push_str("\r\n");
    req.push_str(&body);
    s.write_all(req.as_bytes()).expect("send the request");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read the answer");
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    // A chunked body (the streaming answers) is de-chunked crudely: the
    // JSON answers the tests read are sent whole.
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        let mut out = String::new();
        let mut left = rest;
        while let Some((size, tail)) = left.split_once("\r\n") {
            let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            if n == 0 || tail.len() < n {
                break;
            }
            out.push_str(&tail[..n]);
            left = tail[n..].trim_start_matches("\r\n");
        }
        out
    } else {
        rest.to_string()
    };
    (status, body)
}

/// The live `ping.exe` members the ledger names for `tree`, by identity
/// (pid + creation time, re-checked now), once there are `want` of them.
fn live_pings(env: &Env, tree: i64, want: usize) -> Vec<Identity> {
    let mut found = Vec::new();
    wait_until(WAIT, || {
        found = env.show(tree)["members"]
            .as_array()
            .map(|ms| {
                ms.iter()
                    .filter(|m| m["exited_at"].is_null())
                    .filter(|m| {
                        let exe = format!("{} {}", m["exe"], m["cmdline"]).to_ascii_lowercase();
                        exe.contains("ping")
                    })
                    .filter_map(|m| {
                        let id = Identity {
                            pid: m["pid"].as_i64()? as i32,
                            start_ticks: m["start_ticks"].as_u64()?,
                            boot_id: m["boot_id"].as_str()?.to_string(),
                        };
                        (id.check() == Liveness::Same).then_some(id)
                    })
                    .collect()
            })
            .unwrap_or_default();
        found.len() >= want
    });
    env.started.borrow_mut().extend(found.iter().cloned());
    found
}

/// `serve` on 127.0.0.1:0 in `env`'s data dir (its stderr in
/// `serve.err`), once it wrote its address: the child and the address.
fn start_serve(env: &Env) -> (Child, String) {
    let ready = env.dir.path().join("ready");
    let err = std::fs::File::create(env.dir.path().join("serve.err")).expect("serve.err");
    let serve = env
        .cmd(&[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--ready-file",
            &ready.display().to_string(),
            "--scan-interval",
            "200ms",
            "--grace",
            "500ms",
            "--shutdown-grace",
            "500ms",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(err)
        .spawn()
        .expect("serve starts");
    let serve_id = treewarden::proc::identity_of(serve.id() as i32)
        .ok()
        .flatten()
        .expect("serve's identity");
    env.started.borrow_mut().push(serve_id);
    let mut addr = String::new();
    assert!(
        wait_until(WAIT, || {
            addr = std::fs::read_to_string(&ready).unwrap_or_default();
            !addr.is_empty()
        }),
        "serve never became ready: {}",
        std::fs::read_to_string(env.dir.path().join("serve.err")).unwrap_or_default()
    );
    assert!(addr.starts_with("127.0.0.1:"), "{addr}");
    (serve, addr)
}

/// The service's admin token (the api-token file serve made).
fn admin_token(env: &Env) -> String {
    std::fs::read_to_string(env.data().join("api-token"))
        .expect("the api-token file")
        .trim()
        .to_string()
}

/// Polls `show TREE --json` until the tree is in a terminal state.
fn settled(env: &Env, tree: i64) -> Value {
    let mut detail = Value::Null;
    wait_until(WAIT, || {
        detail = env.show(tree);
        matches!(
            detail["tree"]["state"].as_str(),
            Some("ended" | "vanished" | "spawn_failed" | "resolved")
        )
    });
    detail
}

/// The brief's ping workload: a background grandchild (`start /b`) and a
/// foreground one.
const PINGS: &str = "start /b ping -n 600 127.0.0.1 & ping -n 600 127.0.0.1";

/// `serve` on Windows (issue 27): TCP on 127.0.0.1:0, a token for every
/// request but the open ones (401 without), a spawn of the ping workload
/// with a background grandchild, a kill over HTTP whose `TERMINATE_JOB`
/// follows its committed `kill.authorized`, and a shutdown through the API
/// (`POST /api/shutdown`, admins only: wine's console-less CI cannot
/// deliver the Ctrl+Break serve also drains on) whose drain ends the tree
/// it owns the same way. No ping of either tree
/// is left (checked by each ping's own pid and creation time); `verify`
/// passes after.
#[test]
fn serve_over_tcp_spawns_kills_and_drains_with_authority() {
    let env = Env::new();
    // `token` works on Windows: a spawn-scoped token made before serve runs.
    let out = env.output(&[
        "token", "create", "--scope", "spawn", "--name", "wine", "--json",
    ]);
    assert!(
        out.status.success(),
        "token create: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let made: Value = serde_json::from_slice(&out.stdout).expect("token create --json");
    let token = made["token"].as_str().expect("token").to_string();
    let (mut serve, addr) = start_serve(&env);
    let serve_err =
        || std::fs::read_to_string(env.dir.path().join("serve.err")).unwrap_or_default();

    let (status, _) = http(&addr, "GET", "/healthz", None, None);
    assert_eq!(status, 200, "/healthz answers without a token");
    let (status, body) = http(&addr, "GET", "/api/trees", None, None);
    assert_eq!(status, 401, "a read without a token: {body}");
    let spawn = serde_json::json!({ "argv": ["cmd", "/c", PINGS], "grace": "500ms" });
    let (status, body) = http(&addr, "POST", "/api/trees", None, Some(&spawn));
    assert_eq!(status, 401, "a spawn without a token: {body}");
    let (status, body) = http(
        &addr,
        "POST",
        "/api/trees",
        Some(&token),
        Some(&serde_json::json!({ "argv": ["cmd", "/c", "exit 0"], "user": "someone" })),
    );
    assert_eq!(status, 422, "another user is refused on Windows: {body}");

    // A spawn, its pings found by the scans, then a kill over HTTP.
    let (status, body) = http(&addr, "POST", "/api/trees", Some(&token), Some(&spawn));
    assert_eq!(status, 201, "spawn: {body}");
    let first = serde_json::from_str::<Value>(&body).expect("tree row")["id"]
        .as_i64()
        .expect("tree id");
    let pings = live_pings(&env, first, 2);
    assert_eq!(pings.len(), 2, "both pings seen: {}", env.show(first));
    let (status, body) = http(
        &addr,
        "POST",
        &format!("/api/trees/{first}/kill?grace=500ms"),
        Some(&token),
        None,
    );
    assert_eq!(status, 200, "kill: {body}");
    for p in &pings {
        assert!(
            gone_within(p, Duration::from_secs(20)),
            "{p} survived the kill"
        );
    }
    let detail = env.show(first);
    assert!(assert_terminations_authorized(&detail) >= 1, "{detail}");
    assert!(
        detail["events"]
            .as_array()
            .is_some_and(|es| es.iter().any(|e| e["kind"] == "kill.requested")),
        "who asked is on the record: {detail}"
    );

    // A second tree, left running; the API's shutdown starts the drain
    // (only an admin's: the spawn token is refused).
    let (status, body) = http(&addr, "POST", "/api/trees", Some(&token), Some(&spawn));
    assert_eq!(status, 201, "spawn: {body}");
    let second = serde_json::from_str::<Value>(&body).expect("tree row")["id"]
        .as_i64()
        .expect("tree id");
    let pings = live_pings(&env, second, 2);
    assert_eq!(pings.len(), 2, "both pings seen: {}", env.show(second));
    let (status, body) = http(&addr, "POST", "/api/shutdown", Some(&token), None);
    assert_eq!(status, 403, "a spawn token may not shut down: {body}");
    let admin = admin_token(&env);
    let (status, body) = http(&addr, "POST", "/api/shutdown", Some(&admin), None);
    assert_eq!(status, 202, "shutdown: {body}");
    let status = wait_child(&mut serve, WAIT).expect("serve exits after its drain");
    assert_eq!(status.code(), Some(0), "serve settled: {}", serve_err());
    for p in &pings {
        assert!(
            gone_within(p, Duration::from_secs(20)),
            "{p} survived the drain"
        );
    }
    let detail = env.show(second);
    assert!(
        matches!(detail["tree"]["state"].as_str(), Some("ended" | "vanished")),
        "{detail}"
    );
    assert!(assert_terminations_authorized(&detail) >= 1, "{detail}");
    env.verify();
}

/// `serve --socket` is Unix-only: refused on Windows with one line (exit 2).
#[test]
fn serve_with_a_unix_socket_is_refused_on_windows() {
    let env = Env::new();
    let out = env.output(&["serve", "--listen", "127.0.0.1:0", "--socket", "api.sock"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--socket") && err.trim().lines().count() == 1,
        "{err}"
    );
    let out = env.output(&["serve", "--listen", "0.0.0.0:0"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("loopback"), "{err}");
}

/// The service's exit watches on Windows: a root's exit (the reaper's
/// thread-pool wait on the handle kept since its creation) ends its tree
/// with the root's own code; a client owner's exit (an `ExitWatch` on the
/// owner's identity-checked handle) tears its tree down, the
/// `TERMINATE_JOB` after its committed authorization.
#[test]
fn serve_ends_a_tree_at_its_roots_exit_and_at_its_owners_exit() {
    let env = Env::new();
    let (mut serve, addr) = start_serve(&env);
    let token = admin_token(&env);
    let (status, body) = http(
        &addr,
        "POST",
        "/api/trees",
        Some(&token),
        Some(&serde_json::json!({ "argv": ["cmd", "/c", "exit 3"] })),
    );
    assert_eq!(status, 201, "spawn: {body}");
    let quick = serde_json::from_str::<Value>(&body).expect("tree row")["id"]
        .as_i64()
        .expect("tree id");
    let detail = settled(&env, quick);
    assert_eq!(detail["tree"]["state"], "ended", "{detail}");
    assert_eq!(
        detail["tree"]["exit"]["code"], 3,
        "the root's own code: {detail}"
    );

    // A client owner: a helper that runs until ended (by its identity).
    let h = helper().display().to_string();
    let mut owner = Command::new(&h)
        .args(["sleep", "owner-7", "600", &env.pids()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .expect("the owner starts");
    let owner_id = env.wait_marker("owner-7").expect("the owner wrote its pid");
    let (status, body) = http(
        &addr,
        "POST",
        "/api/trees",
        Some(&token),
        Some(&serde_json::json!({
            "argv": ["cmd", "/c", PINGS],
            "owner_pid": owner_id.pid,
            "owner_start_ticks": owner_id.start_ticks,
        })),
    );
    assert_eq!(status, 201, "spawn for a client: {body}");
    let owned = serde_json::from_str::<Value>(&body).expect("tree row")["id"]
        .as_i64()
        .expect("tree id");
    let pings = live_pings(&env, owned, 2);
    assert_eq!(pings.len(), 2, "both pings seen: {}", env.show(owned));
    assert_eq!(
        treewarden::proc::signal_process(&owner_id, Sig::Kill).expect("end the owner"),
        treewarden::proc::Delivery::Sent
    );
    let _ = wait_child(&mut owner, WAIT);
    for p in &pings {
        assert!(
            gone_within(p, Duration::from_secs(20)),
            "{p} survived its owner's exit"
        );
    }
    let detail = settled(&env, owned);
    assert_eq!(detail["tree"]["state"], "ended", "{detail}");
    assert!(assert_terminations_authorized(&detail) >= 1, "{detail}");
    let (status, body) = http(&addr, "POST", "/api/shutdown", Some(&token), None);
    assert_eq!(status, 202, "shutdown: {body}");
    let status = wait_child(&mut serve, WAIT).expect("serve exits after its drain");
    assert_eq!(status.code(), Some(0));
    env.verify();
}

/// Frame kinds of streamed stdio (`Upgrade: treewarden-stdio/1`): each
/// frame `[kind u8][length u32 big-endian][payload]`.
const STDIN: u8 = 0;
const STDOUT: u8 = 1;
const STDERR: u8 = 2;
const EXIT: u8 = 3;

fn write_frame(s: &mut impl std::io::Write, kind: u8, payload: &[u8]) {
    let len = u32::try_from(payload.len()).expect("a frame's length");
    let mut frame = Vec::with_capacity(5 + payload.len());
    frame.push(kind);
    frame.extend_from_slice(&len.to_be_bytes());
    frame.extend_from_slice(payload);
    s.write_all(&frame).expect("write a frame");
}

fn read_frame(s: &mut impl std::io::Read) -> (u8, Vec<u8>) {
    let mut head = [0u8; 5];
    s.read_exact(&mut head).expect("a frame's head");
    let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
    let mut payload = vec![0; len];
    s.read_exact(&mut payload).expect("a frame's payload");
    (head[0], payload)
}

/// Sends a spawn asking for streamed stdio and reads its answer's head
/// (byte by byte: the frames follow it on the same connection): the
/// status and the head's text.
fn spawn_streamed(
    s: &mut std::net::TcpStream,
    addr: &str,
    token: &str,
    body: &Value,
) -> (u16, String) {
    use std::io::{Read, Write};
    let body = body.to_string();
    let req = format!(
        "POST /api/trees HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\n\
         Connection: Upgrade\r\nUpgrade: treewarden-stdio/1\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).expect("send the spawn");
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        s.read_exact(&mut byte).expect("the answer's head");
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head).into_owned();
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, head)
}

/// An ACP-style stdio server hosted by the Windows service: `serve` over
/// TCP with a token spawns `win_helper rpc-echo` with `"stdio": "stream"`;
/// 100 JSON-RPC requests go in as stdin frames and each answer comes back
/// on stdout with its id and payload; an empty stdin frame (the
/// half-close) ends the server's stdin, it exits 0, stdout's and stderr's
/// ends come, then the exit frame, last, names the tree ended by its
/// root's exit, as the ledger does.
#[test]
fn serve_hosts_a_json_rpc_stdio_child_over_streamed_stdio() {
    use std::io::Read;
    let env = Env::new();
    let (mut serve, addr) = start_serve(&env);
    let token = admin_token(&env);
    let h = helper().display().to_string();
    let mut s = std::net::TcpStream::connect(&addr).expect("connect to the service");
    s.set_read_timeout(Some(WAIT)).expect("read timeout");
    s.set_nodelay(true).expect("nodelay");
    let (status, head) = spawn_streamed(
        &mut s,
        &addr,
        &token,
        &serde_json::json!({ "argv": [h, "rpc-echo"], "stdio": "stream" }),
    );
    assert_eq!(status, 101, "{head}");
    let tree: i64 = head
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("treewarden-tree")
                .then(|| value.trim().parse().ok())?
        })
        .expect("the tree's id in the 101");

    let mut out = Vec::new();
    let mut err = Vec::new();
    for i in 0..100u32 {
        let params = serde_json::json!({ "n": i, "text": format!("message {i}: ünïcode ✓") });
        let req = serde_json::json!({
            "jsonrpc": "2.0", "id": i, "method": "session/echo", "params": params,
        });
        write_frame(&mut s, STDIN, format!("{req}\n").as_bytes());
        let line = loop {
            if let Some(nl) = out.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = out.drain(..=nl).collect();
                break line;
            }
            match read_frame(&mut s) {
                (STDOUT, chunk) if !chunk.is_empty() => out.extend(chunk),
                (STDERR, chunk) if !chunk.is_empty() => err.extend(chunk),
                (kind, chunk) => panic!(
                    "answer {i}: a frame {kind} ({}) before it; stderr: {}",
                    String::from_utf8_lossy(&chunk),
                    String::from_utf8_lossy(&err)
                ),
            }
        };
        let answer: Value = serde_json::from_slice(&line).expect("an answer is JSON");
        assert_eq!(answer["id"], i, "{answer}");
        assert_eq!(answer["result"], params, "{answer}");
    }

    // The half-close: stdin ends, the server exits 0.
    write_frame(&mut s, STDIN, &[]);
    let mut ended = Vec::new();
    let exit = loop {
        match read_frame(&mut s) {
            (EXIT, payload) => break payload,
            (kind @ (STDOUT | STDERR), chunk) if chunk.is_empty() => ended.push(kind),
            (STDOUT, chunk) => panic!("stdout after the last answer: {chunk:?}"),
            (STDERR, chunk) => err.extend(chunk),
            (kind, chunk) => panic!("a frame {kind}: {chunk:?}"),
        }
    };
    ended.sort_unstable();
    assert_eq!(
        ended,
        [STDOUT, STDERR],
        "both ends before the exit frame; stderr: {}",
        String::from_utf8_lossy(&err)
    );
    assert!(out.is_empty(), "{}", String::from_utf8_lossy(&out));
    let exit: Value = serde_json::from_slice(&exit).expect("the exit frame is JSON");
    assert_eq!(exit["id"], tree, "{exit}");
    assert_eq!(exit["state"], "ended", "{exit}");
    assert_eq!(exit["outcome"]["kind"], "exited", "{exit}");
    assert_eq!(exit["outcome"]["exit"]["code"], 0, "{exit}");
    // The exit frame is the last: the service ends the stream after it.
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    assert!(rest.is_empty(), "bytes after the exit frame: {rest:?}");

    let detail = settled(&env, tree);
    assert_eq!(detail["tree"]["state"], "ended", "{detail}");
    assert_eq!(detail["tree"]["exit"]["code"], 0, "{detail}");
    let events = detail["events"].as_array().expect("events");
    assert!(
        !events.iter().any(|e| e["kind"] == "kill.requested"),
        "ended by its root's exit, not a kill: {detail}"
    );
    let (status, body) = http(&addr, "POST", "/api/shutdown", Some(&token), None);
    assert_eq!(status, 202, "shutdown: {body}");
    let status = wait_child(&mut serve, WAIT).expect("serve exits after its drain");
    assert_eq!(status.code(), Some(0));
    env.verify();
}
