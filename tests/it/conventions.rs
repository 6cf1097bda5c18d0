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
        assert_eq!(
            crate::util::parse_ndjson(&String::from_utf8_lossy(&out.stdout)).len(),
            all
        );
    }
    let out = env.output(&["export", "--since", "2999-01-01T02:00:00+02:00"]);
    assert!(out.stdout.is_empty());
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
    assert!(!first.contains("http-equiv=\"refresh\""), "refresh paused");
    assert!(
        page("?all=1").contains("http-equiv=\"refresh\""),
        "refresh by default"
    );
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
