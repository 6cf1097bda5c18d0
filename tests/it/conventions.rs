//! The conventions users already know (issue 16): timeout(1)'s exit codes
//! and bare seconds, `-s SIG`, env(1)'s `--env`/`--cwd`, a summary line like
//! `systemd-run --wait`, quiet broken pipes, completions and a man page.

use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;

use crate::custody::Env;
use crate::util::wait_child;

#[test]
fn run_speaks_timeouts_language() {
    let Some(env) = Env::new("session") else {
        return;
    };
    // A bare number is seconds; the timeout is 124.
    let started = std::time::Instant::now();
    let out = env.output(&["run", "--quiet", "--timeout", "1", "--", "sleep", "9"]);
    assert_eq!(
        out.status.code(),
        Some(124),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "{:?}",
        started.elapsed()
    );
    // Flags it does not know, and values it refuses, are its own failure: 125.
    for args in [
        vec!["run", "--no-such-flag", "--", "true"],
        vec!["run", "--timeout", "nonsense", "--", "true"],
    ] {
        let out = env.output(&args);
        assert_eq!(out.status.code(), Some(125), "{args:?}");
    }
}

#[test]
fn signal_env_cwd_and_the_tree_id_reach_the_job() {
    let Some(env) = Env::new("session") else {
        return;
    };
    // The job reports what it sees, then waits for its first signal.
    let script = "echo \"id=$TREEWARDEN_TREE_ID k=$K pwd=$PWD\" > seen; \
                  trap 'echo INT >> seen; exit 3' INT; trap 'echo TERM >> seen; exit 4' TERM; \
                  sleep 300 & wait";
    let cwd = env.dir.path().join("work");
    std::fs::create_dir(&cwd).expect("cwd");
    let mut run = env.spawn_run(
        &[
            "--timeout",
            "1",
            "--grace",
            "200ms",
            "--signal",
            "INT",
            "--env",
            "K=v=1",
            "--cwd",
            cwd.to_str().expect("utf-8"),
        ],
        script,
    );
    let status = wait_child(&mut run, Duration::from_secs(30)).expect("run exits");
    assert_eq!(status.code(), Some(124));
    let seen = std::fs::read_to_string(cwd.join("seen")).expect("the job wrote what it saw");
    let mut lines = seen.lines();
    assert_eq!(
        lines.next(),
        Some(format!("id=1 k=v=1 pwd={}", cwd.display()).as_str()),
        "{seen}"
    );
    assert_eq!(
        lines.next(),
        Some("INT"),
        "the first signal was SIGINT: {seen}"
    );
    // The ledger says the same.
    let first = env.first_event("signal.sent");
    assert_eq!(first["data"]["signal"], "SIGINT", "{first}");
    // Not a terminal, yet the summary line is there: the tree, why, what.
    let err = env.stderr_of(&run);
    assert!(
        err.lines()
            .any(|l| l.starts_with("treewarden: tree 1 timed out:") && l.contains("torn down")),
        "{err}"
    );
    assert!(env.wait_none_marked());
}

#[test]
fn quiet_pipes_completions_and_a_man_page() {
    let Some(env) = Env::new("session") else {
        return;
    };
    for _ in 0..3 {
        assert_eq!(env.output(&["run", "--", "true"]).status.code(), Some(0));
    }
    // `ls --all | head -1`: the reader closes the pipe after one line.
    let mut ls = env
        .cmd()
        .args(["ls", "--all"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("ls");
    drop(ls.stdout.take());
    let out = ls.wait_with_output().expect("ls ends");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.is_empty(), "quietly: {err}");
    for (args, needle) in [
        (vec!["completions", "bash"], "_treewarden"),
        (vec!["completions", "zsh"], "#compdef treewarden"),
        (vec!["man"], ".TH treewarden"),
    ] {
        let out = env.output(&args);
        assert!(out.status.success(), "{args:?}");
        assert!(
            String::from_utf8_lossy(&out.stdout).contains(needle),
            "{args:?}"
        );
    }
    // The help lists the possible values of every enum flag.
    let out = env.output(&["export", "--help"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("ndjson"));
    let out = env.output(&["--help"]);
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("auto") && help.contains("session"), "{help}");
}

#[test]
fn since_takes_offsets_and_refuses_naive_times() {
    let Some(env) = Env::new("session") else {
        return;
    };
    assert_eq!(env.output(&["run", "--", "true"]).status.code(), Some(0));
    let all = env.export().len();
    // The same moment in two offsets selects the same events.
    for since in ["2020-01-01T00:00:00Z", "2020-01-01T02:00:00+02:00"] {
        let out = env.output(&["export", "--since", since]);
        assert!(out.status.success(), "{since}");
        // The events, then their proofs and trailer (a filtered export).
        let lines = crate::util::parse_ndjson(&String::from_utf8_lossy(&out.stdout));
        assert_eq!(lines.iter().filter(|l| l.get("seq").is_some()).count(), all);
    }
    let out = env.output(&["export", "--since", "2999-01-01T02:00:00+02:00"]);
    let lines = crate::util::parse_ndjson(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(lines.len(), 1, "the trailer alone");
    assert_eq!(lines[0]["exported"]["events"], 0);
    let out = env.output(&["export", "--since", "2020-01-01T00:00:00"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no offset"));
}

#[test]
fn serve_speaks_sd_notify_ready_watchdog_and_stopping() {
    use std::os::unix::net::UnixDatagram;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("notify.sock");
    let sock = UnixDatagram::bind(&path).expect("notify socket");
    sock.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let mut server = crate::serve::Server::start_with_env(
        &["--scan-interval", "100ms"],
        &[
            ("NOTIFY_SOCKET", path.to_str().expect("utf-8")),
            ("WATCHDOG_USEC", "2000000"),
        ],
    );
    // Bounded: each recv waits at most 10 s, and at most 50 datagrams.
    let mut seen = Vec::new();
    let mut buf = [0u8; 512];
    for _ in 0..50 {
        let Ok(n) = sock.recv(&mut buf) else { break };
        let text = String::from_utf8_lossy(&buf[..n]).to_string();
        seen.push(text);
        let all = seen.join("\n");
        if all.contains("READY=1") && all.contains("WATCHDOG=1") {
            break;
        }
    }
    let all = seen.join("\n");
    assert!(all.contains("READY=1"), "{all}");
    assert!(
        all.contains("WATCHDOG=1"),
        "the scan loop pings the watchdog: {all}"
    );
    // The answer came before READY=1 could be waited for by systemd.
    assert_eq!(server.get("/healthz").status(), 200);
    let status = server.terminate().expect("serve exits");
    assert_eq!(status.code(), Some(0));
    let mut stopping = false;
    for _ in 0..50 {
        let Ok(n) = sock.recv(&mut buf) else { break };
        if String::from_utf8_lossy(&buf[..n]).contains("STOPPING=1") {
            stopping = true;
            break;
        }
    }
    assert!(stopping, "STOPPING=1 on SIGTERM");
}

#[test]
fn the_shipped_units_verify() {
    let Ok(out) = std::process::Command::new("systemd-analyze")
        .arg("--version")
        .output()
    else {
        crate::util::skip("systemd-analyze not installed");
        return;
    };
    assert!(out.status.success());
    let dir = tempfile::tempdir().expect("tempdir");
    for unit in [
        "treewarden.service",
        "treewarden-sweep.service",
        "treewarden-sweep.timer",
    ] {
        let text = std::fs::read_to_string(format!("{}/deploy/{unit}", env!("CARGO_MANIFEST_DIR")))
            .expect("unit")
            .replace(
                "/usr/local/bin/treewarden",
                crate::util::bin().to_str().expect("utf-8"),
            );
        std::fs::write(dir.path().join(unit), text).expect("copy");
    }
    let out = std::process::Command::new("systemd-analyze")
        .arg("verify")
        .arg(dir.path().join("treewarden.service"))
        .arg(dir.path().join("treewarden-sweep.service"))
        .arg(dir.path().join("treewarden-sweep.timer"))
        .output()
        .expect("verify");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && err.trim().is_empty(), "{err}");
    let unit = std::fs::read_to_string(dir.path().join("treewarden.service")).expect("unit");
    for line in [
        "Type=notify",
        "WatchdogSec=",
        "UMask=0077",
        "ProtectKernelTunables=yes",
    ] {
        assert!(unit.contains(line), "{line}");
    }
}

#[test]
fn an_ended_trees_resources_come_from_its_cgroup_and_absent_is_not_zero() {
    // Cgroup boundary: the CPU the workload burnt is recorded in
    // `tree.ended` and shown by `show --json`; what the host's cgroup v2
    // does not give (no memory controller on a hybrid host) is absent.
    if let Some(env) = Env::new("cgroup") {
        let burn = "i=0; while [ $i -lt 30000 ]; do i=$((i+1)); done";
        let out = env
            .cmd()
            .args(["run", "--verbose", "--"])
            .args(env.marked_argv(burn))
            .output()
            .expect("run");
        assert_eq!(out.status.code(), Some(0));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("consumed cpu"), "--verbose summary: {err}");
        let show = env.show(1);
        let cpu = show["resources"]["cpu_usec"].as_u64().unwrap_or(0);
        assert!(cpu > 1_000, "the loop burnt CPU: {}", show["resources"]);
        let ended = show["events"]
            .as_array()
            .and_then(|es| es.iter().find(|e| e["kind"] == "tree.ended"))
            .cloned()
            .unwrap_or(Value::Null);
        assert_eq!(ended["data"]["resources"]["cpu_usec"].as_u64(), Some(cpu));
        let controllers = env
            .cgroup_root()
            .and_then(|r| std::fs::read_to_string(r.join("cgroup.controllers")).ok())
            .unwrap_or_default();
        if !controllers.contains("memory") {
            assert!(
                show["resources"].get("memory_peak_bytes").is_none(),
                "absent, not zero"
            );
        }
    }
    // Session boundary: no cgroup; the CPU of what treewarden reaped (the
    // rusage of its waits) is known, nothing else is — absent, not zeros.
    if let Some(env) = Env::new("session") {
        assert_eq!(env.output(&["run", "--", "true"]).status.code(), Some(0));
        let r = &env.show(1)["resources"];
        assert!(r.get("cpu_usec").is_some(), "{r}");
        for absent in ["memory_peak_bytes", "pids_peak", "io_read_bytes"] {
            assert!(r.get(absent).is_none(), "{absent} absent, not zero: {r}");
        }
    }
}

/// Parses dash's `times` output: the shell's own user and system time on
/// its first line (`0m0.280000s 0m0.000000s`), in microseconds.
fn own_cpu_usec(times: &str) -> u64 {
    let secs = |t: &str| -> f64 {
        let (m, s) = t.trim_end_matches('s').split_once('m').expect("NmS.SSSs");
        m.parse::<f64>().expect("minutes") * 60.0 + s.parse::<f64>().expect("seconds")
    };
    let first = times.lines().next().expect("a line");
    let mut parts = first.split_whitespace();
    let user = secs(parts.next().expect("user"));
    let sys = secs(parts.next().expect("sys"));
    ((user + sys) * 1e6) as u64
}

#[test]
fn a_session_trees_cpu_is_what_its_reaped_members_say_they_used() {
    let Some(env) = Env::new("session") else {
        return;
    };
    // The root burns CPU, and so does an orphan (its parent subshell exits
    // at once, so it is reparented to run, the subreaper, which reaps it):
    // each writes its own CPU time (`times`) when done — the ground truth.
    let burn = |n: u32| format!("i=0; while [ $i -lt {n} ]; do i=$((i+1)); done");
    let script = format!(
        "( ( {}; times > orphan.times; touch orphan.done ) & ); \
         while [ ! -e orphan.done ]; do sleep 0.02; done; {}; times > root.times",
        burn(150_000),
        burn(100_000)
    );
    let out = env.output(&["run", "--", "sh", "-c", &script]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let read = |f: &str| std::fs::read_to_string(env.dir().join(f)).expect(f);
    let truth = own_cpu_usec(&read("orphan.times")) + own_cpu_usec(&read("root.times"));
    let show = env.show(1);
    let cpu = show["resources"]["cpu_usec"].as_u64().expect("cpu_usec");
    // `times` counts in clock ticks (10 ms each, two readings); rusage in
    // microseconds and also counts the shells' start-up and the sleeps.
    assert!(
        cpu + 20_000 >= truth && cpu <= truth + truth / 2 + 50_000,
        "treewarden says {cpu} µs, the workload {truth} µs: {}",
        show["resources"]
    );
    // Each reaped member's exit carries its own share.
    let shares: Vec<u64> = show["events"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["kind"] == "member.exited")
        .filter_map(|e| e["data"]["exit"]["cpu_usec"].as_u64())
        .collect();
    assert!(shares.len() >= 2, "the root and the orphan: {shares:?}");
    assert_eq!(shares.iter().sum::<u64>(), cpu);
}

/// Whether the cgroup v2 hierarchy above a test cgroup root offers a
/// controller to tree cgroups.
fn offers(env: &Env, controller: &str) -> bool {
    env.cgroup_root()
        .and_then(|r| std::fs::read_to_string(r.join("cgroup.controllers")).ok())
        .is_some_and(|c| c.split_whitespace().any(|x| x == controller))
}

#[test]
fn limits_are_enforced_or_refused_never_pretended() {
    // The session boundary cannot enforce a limit: refused, nothing started.
    if let Some(env) = Env::new("session") {
        let out = env.output(&["run", "--pids-max", "20", "--", "true"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(125), "{err}");
        assert!(err.contains("cgroup boundary"), "{err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(
            !env.ledger_path().exists() || env.export().is_empty(),
            "nothing recorded"
        );
        for bad in [
            ["--memory-max", "lots"],
            ["--cpu-max", "0%"],
            ["--pids-max", "0"],
        ] {
            let out = env.output(&["run", bad[0], bad[1], "--", "true"]);
            assert_eq!(out.status.code(), Some(125), "{bad:?}");
        }
    }
    let Some(env) = Env::new("cgroup") else {
        return;
    };
    if !offers(&env, "pids") {
        // This host's cgroup v2 gives tree cgroups no pids controller (a
        // hybrid hierarchy): the refusal is what can be tested here.
        let out = env.output(&["run", "--pids-max", "20", "--", "true"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(125), "{err}");
        assert!(err.contains("pids controller"), "{err}");
        crate::util::skip(
            "limit enforcement: the cgroup v2 hierarchy offers no pids controller here (refusal tested instead)",
        );
        return;
    }
    // 50 children under --pids-max 20: never more than 20 in the tree.
    let mut run = env.spawn_run(
        &["--pids-max", "20", "--timeout", "3"],
        "i=0; while [ $i -lt 50 ]; do sleep 30 & i=$((i+1)); done; wait",
    );
    let mut most = 0;
    crate::util::wait_until(Duration::from_secs(2), || {
        most = most.max(env.marked().len());
        false
    });
    let _ = wait_child(&mut run, Duration::from_secs(30));
    assert!(most <= 20 && most > 1, "at most 20 processes, saw {most}");
    let created = env.first_event("tree.created");
    assert_eq!(created["data"]["limits"]["pids_max"], 20, "{created}");
    assert!(env.wait_none_marked());
}

#[test]
fn an_oom_kill_inside_a_tree_is_an_event_and_in_its_resources() {
    let Some(env) = Env::new("cgroup") else {
        return;
    };
    if !offers(&env, "memory") {
        crate::util::skip(
            "OOM kills: the cgroup v2 hierarchy offers no memory controller here (memory.events parsing and recording are unit-tested in custody::oom_tests)",
        );
        return;
    }
    // The shell keeps 200 MB of command substitution in memory under a
    // 32 MiB limit: the kernel's OOM killer ends it.
    let out = env.output(&[
        "run",
        "--memory-max",
        "32M",
        "--",
        "sh",
        "-c",
        "x=$(head -c 200000000 /dev/zero | tr '\\0' a); echo survived",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let swap = std::fs::read_to_string("/proc/swaps")
        .map(|t| t.lines().count() > 1)
        .unwrap_or(false);
    if stdout.contains("survived") && swap {
        // memory.max does not bound swap (memory.swap.max does, and
        // --memory-max leaves it as systemd's MemoryMax= does).
        crate::util::skip(
            "OOM kills: this host swaps, so the workload outgrew memory.max without an OOM kill",
        );
        return;
    }
    assert!(!stdout.contains("survived"), "the limit held: {stdout}");
    let oom = env.first_event("tree.oom_kill");
    assert!(oom["data"]["oom_kills"].as_u64() >= Some(1), "{oom}");
    let shown = env.show(1);
    assert!(
        shown["resources"]["oom_kills"].as_u64() >= Some(1),
        "{shown}"
    );
    assert!(env.wait_none_marked());
}

#[test]
fn the_api_refuses_limits_it_cannot_enforce_with_422() {
    let server = crate::serve::Server::start(&[]);
    let (status, v) = server.post(
        "/api/trees",
        Some(&serde_json::json!({"argv": ["true"], "limits": {"pids_max": 20}})),
    );
    let controllers = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    if status == 201 {
        // A host whose cgroup v2 offers the pids controller enforces it.
        crate::util::skip(&format!(
            "this host enforces pids.max ({controllers:?}); refusal not reachable"
        ));
        return;
    }
    assert_eq!(status, 422, "{v}");
    assert!(
        v["error"]
            .as_str()
            .is_some_and(|e| e.contains("refusing to start")),
        "{v}"
    );
    let (status, _) = server.post(
        "/api/trees",
        Some(&serde_json::json!({"argv": ["true"], "limits": {"memory_max": "lots"}})),
    );
    assert_eq!(status, 422);
    // Nothing was recorded for the refused spawns.
    let trees: Value = server.get("/api/trees?all=1").json().expect("json");
    assert_eq!(trees.as_array().map(Vec::len), Some(0), "{trees}");
}

/// `serve --principal-*` is enforced or refused at start, never pretended:
/// where the host cannot enforce it (no cgroup boundary, no controller for
/// it) `serve` exits 2 (a refused flag) with one line saying why, before it
/// listens.
#[test]
fn principal_limits_the_host_cannot_enforce_stop_serve_at_start() {
    for boundary in ["session", "cgroup"] {
        let Some(env) = Env::new(boundary) else {
            continue;
        };
        for (flag, value, controller) in [
            ("--principal-memory-max", "64M", "memory"),
            ("--principal-pids-max", "100", "pids"),
            ("--principal-cpu-max", "150%", "cpu"),
        ] {
            if boundary == "cgroup" && offers(&env, controller) {
                crate::util::skip(&format!(
                    "{flag}: this host offers the {controller} controller, so serve enforces it (the kernel lane's conventions::ten_concurrent_trees_of_one_principal_… shows memory)"
                ));
                continue;
            }
            let err_path = env.dir().join("serve.stderr");
            let mut serve = env
                .cmd()
                .args(["serve", "--listen", "127.0.0.1:0", flag, value])
                // (serve logs at info by default; its error is one line)
                .env("TREEWARDEN_LOG", "warn")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&err_path).expect("stderr file"))
                .spawn()
                .expect("serve");
            let status = wait_child(&mut serve, Duration::from_secs(30));
            if status.is_none() {
                let _ = serve.kill();
                let _ = serve.wait();
            }
            let err = std::fs::read_to_string(&err_path).unwrap_or_default();
            assert_eq!(
                status.and_then(|s| s.code()),
                Some(2),
                "[{boundary}] {flag}: {err}"
            );
            assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
            let why = if boundary == "session" {
                "cgroup boundary".to_string()
            } else {
                format!("{flag} needs the {controller} controller")
            };
            assert!(err.contains(&why), "[{boundary}] {flag}: {err}");
            assert!(err.contains("refusing to serve"), "{err}");
        }
    }
}

/// Why a `Server`'s trees cannot show a principal's memory limit held
/// here: its cgroup root (a child of the tests' cgroup parent) is offered
/// no memory controller, or this host swaps (memory.max does not bound
/// swap), or not root.
fn principal_memory_unavailable() -> Option<String> {
    if !crate::util::is_root() {
        return Some("needs root for the cgroup boundary".into());
    }
    let Some(parent) = crate::util::test_cgroup_parent() else {
        return Some("no cgroup v2 hierarchy".into());
    };
    let enabled =
        std::fs::read_to_string(parent.join("cgroup.subtree_control")).unwrap_or_default();
    if !enabled.split_whitespace().any(|c| c == "memory") {
        return Some(format!(
            "{} gives its children no memory controller (the kernel lane's guest does: tests/vm/run)",
            parent.display()
        ));
    }
    let swaps = std::fs::read_to_string("/proc/swaps").unwrap_or_default();
    (swaps.lines().count() > 1)
        .then(|| "this host swaps, and memory.max does not bound swap".to_string())
}

/// Issue 43: N concurrent tool calls of one tenant cannot take N times one
/// tree's memory. Ten trees of one principal (the server's token) each
/// hold 8 MiB (about 10 MiB with awk's own), 80 MiB together, under
/// `--principal-memory-max 32M`; each alone fits. The principal's parent cgroup holds them to 32 MiB in all
/// (its `memory.peak`, polled throughout), the kernel's OOM killer ends
/// what does not fit, and each such kill is recorded for the tree whose
/// process it ended: field by field against what each workload wrote (the
/// bytes it held, whether it got to its end). The parent goes with the
/// last tree. Kernel lane (tests/vm/guest-tests); elsewhere the refusal
/// above.
#[test]
fn ten_concurrent_trees_of_one_principal_are_held_to_its_memory_max_and_each_oom_is_its_trees() {
    const TREES: usize = 10;
    const EACH: u64 = 8 << 20;
    const MAX: u64 = 32 << 20;
    if let Some(why) = principal_memory_unavailable() {
        crate::util::skip(&format!("principal memory limit: {why}"));
        return;
    }
    let server = crate::serve::Server::start(&["--principal-memory-max", "32M"]);
    let dir = server.dir.path().to_path_buf();
    for i in 0..TREES {
        rustix::fs::mkfifoat(
            rustix::fs::CWD,
            dir.join(format!("go.{i}")),
            rustix::fs::Mode::from_raw_mode(0o600),
        )
        .expect("mkfifo");
    }
    // Each holds EACH bytes in an awk string (doubled up to it: memcpy,
    // quick even under TCG), says how many, waits on its fifo (getline: no
    // fork while memory is at the limit), lets the bytes go, and says it
    // got to its end. awk is the tree's root (exec).
    let script = |i: usize| {
        format!(
            "exec awk 'BEGIN {{ x = \"a\"; while (length(x) < {EACH}) x = x x; print length(x) > \"held.{i}\"; close(\"held.{i}\"); getline line < \"go.{i}\"; x = \"\"; print \"done\" > \"done.{i}\" }}'"
        )
    };
    // The workload's program read once here, outside the principal's
    // cgroup: its page cache is then charged to this test's cgroup, and at
    // the limit the kernel finds only the trees' own memory to reclaim and
    // OOM-kills at once, instead of evicting those pages and reading them
    // back (over 9p, under TCG, in the lane).
    let warm = std::process::Command::new("awk")
        .arg("BEGIN { x = \"a\" }")
        .output()
        .expect("awk");
    assert!(warm.status.success(), "{warm:?}");
    let t0 = std::time::Instant::now();
    let ids: Vec<i64> = std::thread::scope(|s| {
        let spawns: Vec<_> = (0..TREES)
            .map(|i| {
                let body = server.body(&script(i));
                let server = &server;
                s.spawn(move || server.post("/api/trees", Some(&body)))
            })
            .collect();
        spawns
            .into_iter()
            .map(|h| {
                let (status, v) = h.join().expect("spawn thread");
                assert_eq!(status, 201, "{v}; log: {}", server.stderr());
                v["id"].as_i64().expect("tree id")
            })
            .collect()
    });
    let spawned_in = t0.elapsed();
    let detail = |id: i64| -> Value {
        server
            .get(&format!("/api/trees/{id}"))
            .json()
            .expect("json")
    };
    let held = |i: usize| std::fs::read_to_string(dir.join(format!("held.{i}"))).ok();
    // The parent of the trees' cgroups: the principal's (checked at the
    // end, after what the workloads saw).
    let rows: Vec<Value> = ids.iter().map(|id| detail(*id)["tree"].clone()).collect();
    let cgroup = std::path::PathBuf::from(rows[0]["cgroup"].as_str().expect("a cgroup"));
    let parent = cgroup.parent().expect("a parent").to_path_buf();
    let roots: Vec<i32> = rows
        .iter()
        .map(|r| r["root_pid"].as_i64().expect("a root pid") as i32)
        .collect();
    let read = |f: &str| std::fs::read_to_string(parent.join(f)).unwrap_or_default();
    let keyed = |text: &str, key: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(key)?.trim().parse().ok())
            .unwrap_or(0)
    };
    let parent_max = read("memory.max").trim().to_owned();
    // Until every tree holds its bytes or its root is gone, the parent's
    // peak (files and /proc only: HTTP polls would starve the guest's one
    // CPU).
    let mut peak = 0u64;
    let settled = crate::util::wait_until(Duration::from_secs(120), || {
        peak = peak.max(read("memory.peak").trim().parse().unwrap_or(0));
        (0..TREES).all(|i| held(i).is_some() || !crate::util::pid_alive(roots[i]))
    });
    assert!(
        settled,
        "not every tree held its bytes or ended: {:?}",
        (0..TREES).map(held).collect::<Vec<_>>()
    );
    let settled_in = t0.elapsed();
    peak = peak.max(read("memory.peak").trim().parse().unwrap_or(0));
    let parent_ooms = keyed(&read("memory.events"), "oom_kill ");
    // Let the holders go; each tree ends with its root.
    for (i, root) in roots.iter().enumerate() {
        let fifo = dir.join(format!("go.{i}"));
        let released = crate::util::wait_until(Duration::from_secs(20), || {
            use std::os::unix::fs::OpenOptionsExt as _;
            !crate::util::pid_alive(*root)
                || std::fs::OpenOptions::new()
                    .write(true)
                    .custom_flags(libc::O_NONBLOCK)
                    .open(&fifo)
                    .and_then(|mut f| std::io::Write::write_all(&mut f, b"go\n"))
                    .is_ok()
        });
        assert!(released, "tree {} neither ended nor read its fifo", ids[i]);
    }
    // Each tree's end, by the long poll the API has for it.
    let deadline = std::time::Instant::now() + crate::util::scaled(Duration::from_secs(120));
    for id in &ids {
        loop {
            let row: Value = server
                .get(&format!("/api/trees/{id}/wait?timeout=60s"))
                .json()
                .expect("json");
            if row["state"] == "ended" {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline && row["state"] != "ambiguous",
                "tree {id} did not end: {row}"
            );
        }
    }
    let ended_in = t0.elapsed();
    // What each workload wrote: the bytes it held, whether it got to its
    // end. A tree is whole when it did both.
    let seen: Vec<(i64, Option<u64>, bool, Value)> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| {
            let held_bytes = held(i).and_then(|t| t.trim().parse().ok());
            let done = dir.join(format!("done.{i}")).exists();
            (*id, held_bytes, done, detail(*id))
        })
        .collect();
    let is_whole = |held: Option<u64>, done: bool| held == Some(EACH) && done;
    let whole = seen.iter().filter(|(_, h, d, _)| is_whole(*h, *d)).count();
    let killed_trees = TREES - whole;
    crate::util::say(&format!(
        "principal memory: {whole} of {TREES} trees held {} MiB each, {killed_trees} did not (the parent counted {parent_ooms} OOM kills); the parent's peak {} KiB of {} KiB; spawned in {:.1} s, settled in {:.1} s, ended in {:.1} s",
        EACH >> 20,
        peak >> 10,
        MAX >> 10,
        spawned_in.as_secs_f64(),
        settled_in.as_secs_f64(),
        ended_in.as_secs_f64()
    ));
    assert!(
        killed_trees > 0,
        "every tree held its bytes: the ten held {} MiB together, over the principal's {} MiB",
        whole as u64 * (EACH >> 20),
        MAX >> 20
    );
    assert!(whole > 0, "at least one tree fits: {whole}");
    assert!(
        peak <= MAX,
        "the principal's peak {peak} is over its limit {MAX}"
    );
    // Against what treewarden recorded, tree by tree: an OOM kill for
    // each tree that did not get to hold its bytes and end, none for one
    // that did.
    let mut recorded_kills = 0;
    for (id, held_bytes, done, d) in &seen {
        let oom_events: Vec<&Value> = d["events"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|e| e["kind"] == "tree.oom_kill")
            .collect();
        let kills = d["resources"]["oom_kills"].as_u64();
        if is_whole(*held_bytes, *done) {
            assert!(
                oom_events.is_empty(),
                "tree {id} held its bytes and ended on its own: {d}"
            );
            assert_eq!(kills, Some(0), "tree {id}: {}", d["resources"]);
            assert_eq!(d["tree"]["exit"]["code"], 0, "tree {id}: {}", d["tree"]);
        } else {
            let last = oom_events.last().unwrap_or_else(|| {
                panic!("tree {id} (held {held_bytes:?}, done {done}) has no tree.oom_kill: {d}")
            });
            assert!(kills >= Some(1), "tree {id}: {}", d["resources"]);
            assert_eq!(
                last["data"]["oom_kills"].as_u64(),
                kills,
                "tree {id}: the event's count is the tree's"
            );
            recorded_kills += kills.unwrap_or(0);
        }
        assert!(
            d["resources"]["memory_peak_bytes"].as_u64() < Some(MAX),
            "tree {id} alone stays under the principal's limit: {}",
            d["resources"]
        );
    }
    assert_eq!(
        recorded_kills, parent_ooms,
        "each kill the parent counted is a tree's"
    );
    // One parent for all ten, named for the principal, with its limit.
    let token = rows[0]["requested_by"]["token_id"]
        .as_i64()
        .expect("a token");
    let name = parent
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default()
        .to_owned();
    assert!(
        name.starts_with("tw-") && name.ends_with(&format!("-p-tok-{token}")),
        "{name}"
    );
    for (id, row) in ids.iter().zip(&rows) {
        let c = row["cgroup"].as_str().map(std::path::PathBuf::from);
        assert_eq!(
            c.as_deref().and_then(std::path::Path::parent),
            Some(parent.as_path()),
            "tree {id}"
        );
    }
    assert_eq!(parent_max, MAX.to_string(), "the principal's limit");
    assert!(
        crate::util::wait_until(Duration::from_secs(10), || !parent.exists()),
        "the principal's cgroup goes with its last tree: {}",
        read("cgroup.events")
    );
}

#[test]
fn an_api_trees_output_is_captured_capped_and_served() {
    let server = crate::serve::Server::start(&["--log-max", "64K"]);
    let (status, tree) = server.post(
        "/api/trees",
        Some(&server.body(
            "echo to-stdout; echo to-stderr >&2; i=0; while [ $i -lt 3 ]; do echo line-$i; i=$((i+1)); done",
        )),
    );
    assert_eq!(status, 201, "{tree}");
    let id = tree["id"].as_i64().expect("id");
    let log = |q: &str| {
        server
            .get(&format!("/api/trees/{id}/log{q}"))
            .text()
            .expect("log")
    };
    assert!(
        crate::util::wait_until(Duration::from_secs(10), || log("").contains("line-2")),
        "{}",
        log("")
    );
    let all = log("");
    assert!(
        all.contains("to-stdout\n") && all.contains("to-stderr\n"),
        "{all}"
    );
    assert_eq!(log("?tail=2"), "line-1\nline-2\n");
    // The same through the CLI, and the tree page shows it.
    let out = std::process::Command::new(crate::util::bin())
        .env("TREEWARDEN_DATA_DIR", server.data_dir())
        .args(["logs", &id.to_string(), "--tail", "1"])
        .output()
        .expect("logs");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "line-2\n");
    assert!(
        server
            .get(&format!("/trees/{id}"))
            .text()
            .expect("page")
            .contains("to-stderr")
    );
    // A tree that writes 1 MiB keeps at most about --log-max of it, the newest.
    let (status, big) = server.post(
        "/api/trees",
        Some(&server.body(
            "i=0; while [ $i -lt 16384 ]; do echo \"line $i ................................................\"; i=$((i+1)); done; sleep 2",
        )),
    );
    assert_eq!(status, 201);
    let big = big["id"].as_i64().expect("id");
    let path = server
        .data_dir()
        .join("logs")
        .join(format!("tree-{big}.log"));
    use std::os::unix::fs::MetadataExt;
    assert!(
        crate::util::wait_until(Duration::from_secs(20), || {
            std::fs::read_to_string(&path).is_ok_and(|t| t.contains("line 16383 "))
                && std::fs::metadata(&path).is_ok_and(|m| m.blocks() * 512 <= 96 * 1024)
        }),
        "capped: {:?}",
        std::fs::metadata(&path).map(|m| (m.len(), m.blocks() * 512))
    );
    let tail = server
        .get(&format!("/api/trees/{big}/log?tail=1"))
        .text()
        .expect("tail");
    assert!(
        tail.starts_with("line 16383 "),
        "the newest bytes are kept: {tail}"
    );
    assert_eq!(server.get("/api/trees/999/log").status(), 404);
    // A tree of `run` captured nothing: the CLI says so.
    let out = std::process::Command::new(crate::util::bin())
        .env("TREEWARDEN_DATA_DIR", server.data_dir())
        .args(["logs", "999"])
        .output()
        .expect("logs");
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn logs_follow_hands_out_every_line_once_across_the_caps_collapses() {
    let server = crate::serve::Server::start(&["--log-max", "64K"]);
    // 20 bursts of 300 numbered lines (~18 KB each), a pause between: the
    // 64K cap drops the oldest blocks many times while `logs --follow` reads.
    let (status, tree) = server.post(
        "/api/trees",
        Some(&server.body(
            "i=0; b=0; while [ $b -lt 20 ]; do j=0; while [ $j -lt 300 ]; do echo \"line $i ..................................................\"; i=$((i+1)); j=$((j+1)); done; b=$((b+1)); sleep 0.25; done",
        )),
    );
    assert_eq!(status, 201, "{tree}");
    let id = tree["id"].as_i64().expect("id");
    let path = server
        .data_dir()
        .join("logs")
        .join(format!("tree-{id}.log"));
    assert!(crate::util::wait_until(Duration::from_secs(10), || {
        std::fs::read_to_string(&path).is_ok_and(|t| t.contains("line 0 "))
    }));
    let out_file = tempfile::NamedTempFile::new().expect("out file");
    let mut follow = std::process::Command::new(crate::util::bin())
        .env("TREEWARDEN_DATA_DIR", server.data_dir())
        .args(["logs", &id.to_string(), "--tail", "1", "--follow"])
        .stdout(out_file.reopen().expect("reopen"))
        .spawn()
        .expect("logs --follow");
    let ended = wait_child(&mut follow, Duration::from_secs(60));
    if ended.is_none() {
        crate::util::signal(follow.id(), rustix::process::Signal::KILL);
        let _ = follow.wait();
    }
    assert!(
        ended.is_some_and(|s| s.success()),
        "logs --follow did not end with its tree"
    );
    let text = std::fs::read_to_string(out_file.path()).expect("output");
    let numbers: Vec<u64> = text
        .lines()
        .map(|l| {
            l.strip_prefix("line ")
                .and_then(|r| r.split(' ').next())
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("not a line of the tree: {l:?}"))
        })
        .collect();
    assert_eq!(numbers.last(), Some(&5999), "followed to the end");
    let first = numbers[0];
    let want: Vec<u64> = (first..=5999).collect();
    assert!(
        numbers == want,
        "gaps or repeats after line {first}: {} lines for {}",
        numbers.len(),
        want.len()
    );
    let written = 6000 * 60;
    let kept = std::fs::metadata(&path).expect("log").len();
    crate::util::say(&format!(
        "followed {} lines; the log holds {kept} of ~{written} bytes written",
        numbers.len()
    ));
}

#[test]
fn the_dashboard_pages_filters_counts_and_answers_browsers_in_html() {
    let server = crate::serve::Server::start(&[]);
    for i in 0..104 {
        let label = if i % 2 == 0 { "even" } else { "odd" };
        let (status, _) = server.post(
            "/api/trees",
            Some(&serde_json::json!({"argv": ["true"], "label": label})),
        );
        assert_eq!(status, 201);
    }
    let page = |q: &str| server.get(&format!("/{q}")).text().expect("page");
    let rows = |html: &str| html.matches("<tr>\n<td><a href=\"/trees/").count();
    let counts = |html: &str| {
        html.split("id=\"counts\"")
            .nth(1)
            .and_then(|r| r.split("</p>").next())
            .unwrap_or_default()
            .to_string()
    };
    assert!(
        crate::util::wait_until(Duration::from_secs(60), || {
            counts(&page("?all=1&refresh=0")).contains("ended</span> 104")
        }),
        "counts by state: {}",
        counts(&page("?all=1&refresh=0"))
    );
    let first = page("?all=1&refresh=0");
    assert_eq!(rows(&first), 100, "one page is 100 trees");
    assert!(
        !first.contains("<script id=\"live\""),
        "live updates paused"
    );
    assert!(
        page("?all=1").contains("<script id=\"live\""),
        "live updates by default"
    );
    assert!(!page("?all=1").contains("http-equiv"), "no timed refresh");
    let older = first
        .split("id=\"older\" href=\"/")
        .nth(1)
        .and_then(|r| r.split('"').next())
        .expect("an older link")
        .replace("&amp;", "&")
        .replace("&#38;", "&");
    let second = page(&older);
    assert_eq!(rows(&second), 4, "the rest on the next page");
    assert!(!second.contains("id=\"older\""), "no page after the last");
    let odd = page("?all=1&label=odd&refresh=0");
    assert_eq!(rows(&odd), 52);
    assert!(!odd.contains(">even<"), "only the label asked for");
    assert_eq!(rows(&page("?state=running&refresh=0")), 0);
    // A browser gets an HTML page for an error; a script still gets JSON.
    let html = server
        .http_get_with("/trees/999999", "text/html,application/xhtml+xml")
        .expect("page");
    assert_eq!(html.0, 404);
    assert!(
        html.1.contains("<h1>404 Not Found</h1>") && html.1.contains("unknown tree 999999"),
        "{}",
        html.1
    );
    let json = server
        .http_get_with("/trees/999999", "application/json")
        .expect("json");
    assert!(json.1.starts_with('{'), "{}", json.1);
    assert_eq!(
        server.get("/?bogus=1").status(),
        400,
        "unknown parameters are refused"
    );
}

#[test]
fn small_truths_an_operator_reads_at_three_in_the_morning() {
    let server = crate::serve::Server::start(&[]);
    // A tree that times out, one killed through the API, one that exits.
    let mut timed = server.body("sleep 30");
    timed["timeout"] = serde_json::json!("300ms");
    let (status, t1) = server.post("/api/trees", Some(&timed));
    assert_eq!(status, 201);
    let (status, t2) = server.post("/api/trees", Some(&server.body("sleep 30")));
    assert_eq!(status, 201);
    let (status, _) = server.post(&format!("/api/trees/{}/kill", t2["id"]), None);
    assert_eq!(status, 200);
    let (status, _) = server.post("/api/trees", Some(&server.body("exit 3")));
    assert_eq!(status, 201);
    let metrics = || server.get("/metrics").text().expect("metrics");
    assert!(
        crate::util::wait_until(Duration::from_secs(20), || {
            let m = metrics();
            ["timeout", "kill", "root_exit"].iter().all(|o| {
                m.contains(&format!(
                    "treewarden_teardown_duration_seconds_count{{origin=\"{o}\"}}"
                ))
            })
        }),
        "the origin label says why: {}",
        metrics()
            .lines()
            .filter(|l| l.contains("teardown_duration_seconds_count"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    // The events page reads as sentences, with the JSON one click away.
    let events = server.get("/events").text().expect("events");
    assert!(events.contains("SIGTERM → group"), "signal summary");
    assert!(
        events.contains("running → terminating: timeout after 300ms"),
        "state summary"
    );
    assert!(events.contains("<details>"), "the data is still there");
    // An ended tree's age is its lifetime, which no longer grows.
    let row = |html: &str, id: &serde_json::Value| {
        html.split(&format!("<td><a href=\"/trees/{id}\">{id}</a></td>"))
            .nth(1)
            .and_then(|r| r.split("</tr>").next())
            .unwrap_or_default()
            .to_string()
    };
    // Wait (bounded) until the tree is at least 2 s old: an age that kept
    // counting would read 2s by then, a lifetime still reads 0s.
    let since_spawn = std::time::Instant::now();
    assert!(crate::util::wait_until(Duration::from_secs(5), || {
        since_spawn.elapsed() >= Duration::from_secs(2)
    }));
    let first = row(
        &server.get("/?all=1&refresh=0").text().expect("page"),
        &t1["id"],
    );
    assert!(first.contains("ended"), "{first}");
    assert!(first.contains("<td>0s</td>"), "a 300 ms life: {first}");
}

#[test]
fn a_sweep_resumes_with_the_first_signal_the_tree_was_given() {
    let Some(env) = Env::new("session") else {
        return;
    };
    // The job says which signal reached it first.
    let mut run = env.spawn_run(
        &["--signal", "INT", "--grace", "200ms", "--quiet"],
        "trap 'echo INT >> got; exit 0' INT; trap 'echo TERM >> got; exit 0' TERM; sleep 300 & wait",
    );
    assert!(env.wait_marked(2));
    // The owner dies without a teardown; the sweep finishes the tree.
    crate::util::signal(run.id(), rustix::process::Signal::KILL);
    let _ = wait_child(&mut run, Duration::from_secs(10));
    let created = env.first_event("tree.created");
    assert_eq!(created["data"]["first_signal"], "SIGINT", "{created}");
    let out = env.output(&["sweep"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(env.wait_none_marked(), "{:?}", env.marked());
    let got = std::fs::read_to_string(env.dir.path().join("got")).unwrap_or_default();
    assert_eq!(got.lines().next(), Some("INT"), "{got}");
    let first = env.first_event("signal.sent");
    assert_eq!(first["data"]["signal"], "SIGINT", "{first}");
}
