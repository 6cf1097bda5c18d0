//! Tenants and the service's descriptors (issue 43, N8): on the session
//! boundary every loose member is held by a pidfd, and one user's tree of
//! hundreds of `setsid` children used to take the service's descriptors
//! down to the serving loop's reserve, so accept paused for every user.
//! Reproduced for real: the service at `nofile 700`, a real user's tree
//! forking 620 `setsid sleep`s on the socket, and another real user's
//! spawns and the admin's `/healthz` timed by this test while they live.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::privilege::{TestUser, public_dir};
use crate::serve::{Server, tool};
use crate::util::{say, skip, wait_until};

/// The escapees of the attacking tree: more than `nofile` leaves above
/// the serving loop's reserve (700 - 128 = 572).
const ESCAPEES: usize = 620;

/// The service's descriptor limit (soft and hard).
const NOFILE: u64 = 700;

/// The requesters' descriptor limit, which their trees take: not above
/// the service's hard one (a raise is refused), nor under what the service
/// has open (the held child opens the cwd under it, with the service's
/// close-on-exec descriptors still open).
const CLIENT_NOFILE: u64 = NOFILE;

/// Descriptors the serving loop keeps free (`ConnLimits::reserve_fds`).
const RESERVE: u64 = 128;

/// The longest a request may take to count as answered promptly; the
/// unfixed service never answered (accept paused for as long as the
/// escapees lived).
const PROMPT: Duration = Duration::from_secs(10);

fn set_nofile(pid: u32, n: u64) {
    use rustix::process::{Pid, Resource, Rlimit, prlimit};
    prlimit(
        Some(Pid::from_raw(pid as i32).expect("a pid")),
        Resource::Nofile,
        Rlimit {
            current: Some(n),
            maximum: Some(n),
        },
    )
    .expect("prlimit NOFILE");
}

/// The service's open descriptors, and how many of them are pidfds.
fn fds_of(pid: u32) -> (usize, usize) {
    let mut open = 0;
    let mut pidfds = 0;
    for e in std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
    {
        open += 1;
        if std::fs::read_link(e.path()).is_ok_and(|l| l.to_string_lossy().contains("pidfd")) {
            pidfds += 1;
        }
    }
    (open, pidfds)
}

/// One request on the Unix socket with curl as `user` (root when `None`),
/// bounded by [`PROMPT`] twice over: (status, body, how long it took).
/// Status 0: no answer in that time.
fn timed_curl(
    sock: &Path,
    user: Option<&TestUser>,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> (u16, Value, Duration) {
    // A tree takes its requester's limits: the requester's `nofile` must
    // fit under the service's hard one (a raise is refused).
    let mut cmd = Command::new("prlimit");
    cmd.arg(format!("--nofile={CLIENT_NOFILE}:{CLIENT_NOFILE}"))
        .arg("--");
    match user {
        Some(u) => {
            cmd.arg("setpriv")
                .arg(format!("--reuid={}", u.uid))
                .arg(format!("--regid={}", u.gid))
                .arg("--clear-groups")
                .arg("curl");
        }
        None => {
            cmd.arg("curl");
        }
    }
    cmd.current_dir("/")
        .args(["-sS", "--max-time"])
        .arg((2 * PROMPT.as_secs()).to_string())
        .arg("--unix-socket")
        .arg(sock)
        .args(["-X", method, "-w", "\n%{http_code}"]);
    if let Some(b) = body {
        cmd.args(["-H", "content-type: application/json", "-d"])
            .arg(b.to_string());
    }
    cmd.arg(format!("http://localhost{path}"));
    let t0 = Instant::now();
    let out = cmd.output().expect("curl");
    let took = t0.elapsed();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    let value = serde_json::from_str(body).unwrap_or_else(|_| Value::String(body.to_string()));
    (code.trim().parse().unwrap_or(0), value, took)
}

/// A spawn body carrying the server's marker.
fn body(s: &Server, script: &str) -> Value {
    json!({
        "argv": ["sh", "-c", script],
        "env": {"TW_TEST_MARK": s.mark},
        "grace": "200ms",
    })
}

/// `/proc/<pid>/stat`'s ppid, session and start time.
fn stat_of(pid: i32) -> Option<(i32, i32, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let f: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    // After the comm: state ppid pgrp session ... starttime (the 20th).
    Some((f[1].parse().ok()?, f[3].parse().ok()?, f[19].parse().ok()?))
}

/// The root's children that left its session: the escapees, by identity.
fn escapees_of(root: i32, mark: &str) -> Vec<(i32, u64)> {
    crate::util::marked_processes(mark)
        .into_iter()
        .filter_map(|pid| {
            let (ppid, sid, start) = stat_of(pid)?;
            (ppid == root && sid != root).then_some((pid, start))
        })
        .collect()
}

/// Whether the process `pid` started at `start` still runs.
fn still_runs(pid: i32, start: u64) -> bool {
    crate::util::pid_alive(pid) && stat_of(pid).is_some_and(|(_, _, s)| s == start)
}

/// The tree's recorded escapes, read from the ledger file (not through the
/// service, whose accept this test is about).
fn recorded_escapes(s: &Server, tree: i64) -> i64 {
    let Ok(db) = rusqlite::Connection::open_with_flags(
        s.data_dir().join("ledger.db"),
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
    ) else {
        return 0;
    };
    let _ = db.busy_timeout(Duration::from_secs(5));
    db.query_row(
        "SELECT count(*) FROM members WHERE tree_id = ?1 AND escaped_at IS NOT NULL",
        [tree],
        |r| r.get(0),
    )
    .unwrap_or(0)
}

/// One unlabelled (or labelled, `name{...}`) sample of a scrape.
fn sample(metrics: &str, name: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{name} "))?.trim().parse().ok())
}

/// N8: with the service at `nofile 700`, user A's tree forks 620 `setsid
/// sleep`s (each a loose member the service used to hold by a pidfd: 620
/// of its 700 descriptors, accept paused under the 128 kept free). Now a
/// tree holds at most `--max-held-per-tree` (256) and all holds at most
/// half of what `nofile` leaves above the reserve (286): the rest are
/// recorded escapes, kept by identity and uid, and the tree is flagged
/// `holds_capped` once. While A's escapees live, user B's spawns on the
/// socket and the admin's `/healthz` over TCP are answered at once, the
/// service's descriptors stay above the reserve, and A's kill still ends
/// every escapee (checked by pid and start time).
#[test]
fn one_users_setsid_escapees_leave_the_services_descriptors_to_everyone() {
    for t in ["setsid", "prlimit"] {
        if tool(t).is_none() {
            skip(&format!("{t} (util-linux) not installed"));
            return;
        }
    }
    let Some(a) = TestUser::create() else {
        return;
    };
    let Some(b) = TestUser::create() else {
        return;
    };
    let public = public_dir();
    let sock = public.path().join("api.sock");
    // The session boundary: escapees leave the group and are not in a
    // cgroup, so each one is signalled by itself.
    let s = Server::start_with_env(
        &["--socket", sock.to_str().expect("utf-8 path")],
        &[("TREEWARDEN_BOUNDARY", "session")],
    );
    let pid = s.pid().expect("serve runs");
    set_nofile(pid, NOFILE);
    let (base, _) = fds_of(pid);

    let script =
        format!("i=0; while [ $i -lt {ESCAPEES} ]; do setsid sleep 600 & i=$((i+1)); done; wait");
    let (status, v, _) = timed_curl(
        &sock,
        Some(&a),
        "POST",
        "/api/trees",
        Some(&body(&s, &script)),
    );
    assert_eq!(status, 201, "A's spawn: {v}; {}", s.stderr());
    let tree = v["id"].as_i64().expect("id");
    let root = v["root_pid"].as_i64().expect("root pid") as i32;
    let mut escapees = Vec::new();
    assert!(
        wait_until(Duration::from_secs(120), || {
            escapees = escapees_of(root, &s.mark);
            escapees.len() >= ESCAPEES
        }),
        "{} of {ESCAPEES} escapees run",
        escapees.len()
    );
    // Every escape recorded: each was vetted (and held, up to the caps).
    let recorded = wait_until(Duration::from_secs(120), || {
        recorded_escapes(&s, tree) >= ESCAPEES as i64
    });
    let (open, pidfds) = fds_of(pid);
    say(&format!(
        "N8: {} escapees, {} recorded; service fds {open} (pidfds {pidfds}; {base} before) under nofile {NOFILE}",
        escapees.len(),
        recorded_escapes(&s, tree)
    ));
    assert!(recorded, "escapes recorded: {}", recorded_escapes(&s, tree));

    // While they live: B's spawns on the socket, and the admin over TCP.
    let mut b_took = Vec::new();
    for _ in 0..5 {
        let (status, v, took) = timed_curl(
            &sock,
            Some(&b),
            "POST",
            "/api/trees",
            Some(&body(&s, "exit 0")),
        );
        assert_eq!(
            status,
            201,
            "B's spawn while A's escapees live, after {took:?}: {v}; service fds {:?}",
            fds_of(pid)
        );
        b_took.push(took);
    }
    let http = reqwest::blocking::Client::builder()
        .no_proxy()
        .timeout(2 * PROMPT)
        .build()
        .expect("http client");
    let t0 = Instant::now();
    let health = http.get(s.url("/healthz")).bearer_auth(&s.token).send();
    let health_took = t0.elapsed();
    assert!(
        health.as_ref().is_ok_and(|r| r.status() == 200),
        "the admin's /healthz over TCP after {health_took:?}: {health:?}"
    );
    let (open, pidfds) = fds_of(pid);
    say(&format!(
        "N8: B's spawns answered in {:?} ms; admin /healthz over TCP in {} ms; service fds {open} (pidfds {pidfds})",
        b_took.iter().map(|d| d.as_millis()).collect::<Vec<_>>(),
        health_took.as_millis()
    ));
    for took in &b_took {
        assert!(*took < PROMPT, "B's spawns: {b_took:?}");
    }
    assert!(health_took < PROMPT, "/healthz took {health_took:?}");
    assert!(
        (open as u64) < NOFILE - RESERVE,
        "the service's descriptors reached the reserve: {open} open of {NOFILE}"
    );

    // The caps, as the service counts and records them.
    let metrics = s.get("/metrics").text().expect("metrics");
    let held = sample(&metrics, "treewarden_held_pidfds").expect("held gauge");
    let refused = sample(&metrics, "treewarden_holds_refused_total{cap=\"tree\"}").unwrap_or(0.0);
    say(&format!(
        "N8: treewarden_held_pidfds {held}, holds refused by the tree cap {refused}"
    ));
    assert!(held <= 256.0, "held past the tree cap: {held}");
    assert!(refused > 0.0, "no hold refused: {metrics}");
    let (status, t, _) = timed_curl(&sock, None, "GET", &format!("/api/trees/{tree}"), None);
    assert_eq!(status, 200, "{t}");
    let flags = t["tree"]["flags"].as_array().cloned().unwrap_or_default();
    assert!(flags.iter().any(|f| f == "holds_capped"), "{flags:?}");
    let (status, events, _) = timed_curl(
        &sock,
        None,
        "GET",
        &format!("/api/events?tree={tree}&limit=10000"),
        None,
    );
    assert_eq!(status, 200, "{events}");
    let capped: Vec<&Value> = events
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["kind"] == "tree.holds_capped")
        .collect();
    assert_eq!(capped.len(), 1, "one tree.holds_capped: {capped:?}");
    assert_eq!(capped[0]["data"]["cap"], "tree", "{capped:?}");

    // A's kill ends every escapee, held or not.
    let (status, k, took) = timed_curl(
        &sock,
        Some(&a),
        "POST",
        &format!("/api/trees/{tree}/kill?grace=200ms"),
        None,
    );
    assert_eq!(status, 200, "A's kill after {took:?}: {k}; {}", s.stderr());
    assert_eq!(k["state"], "ended", "{k}");
    let left: Vec<(i32, u64)> = escapees
        .iter()
        .copied()
        .filter(|&(p, st)| still_runs(p, st))
        .collect();
    say(&format!(
        "N8: A's kill took {} ms; escapees left {}",
        took.as_millis(),
        left.len()
    ));
    assert!(left.is_empty(), "escapees outlived the kill: {left:?}");
    assert!(
        wait_until(Duration::from_secs(20), || s.marked().is_empty()),
        "left: {:?}",
        s.marked()
    );
    // Every hold given back once the tree is gone.
    assert!(
        wait_until(Duration::from_secs(20), || {
            let m = s.get("/metrics").text().unwrap_or_default();
            sample(&m, "treewarden_held_pidfds") == Some(0.0)
        }),
        "holds not given back"
    );
}
