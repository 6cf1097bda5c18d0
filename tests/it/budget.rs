//! Tenants' budgets, end to end: one real user's flood of spawns or of
//! evidence and output never takes what another user's work needs. The
//! real `treewarden serve` on its Unix socket, driven as real users (made
//! with `useradd`, removed on every path: privilege.rs's helpers); ground
//! truth from the kernel (processes by pid and uid) and the filesystem
//! (`statvfs`, the logs directory).

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_json::{Value, json};

use crate::privilege::{TestUser, curl, events_of, processes_of, public_dir, spawn_body};
use crate::serve::Server;
use crate::util::{bin, pid_alive, say, skip, wait_until};

/// The system's Python (the pyenv shim under /root is not a user's to run).
const PYTHON: &str = "/usr/bin/python3";

/// Opens `n` connections to the socket as `user`, sends one `POST
/// /api/trees` with `body` on each before reading any answer, then reads
/// every answer: their status codes, in connection order.
fn burst(sock: &Path, user: &TestUser, body: &Value, n: usize) -> Vec<u16> {
    const SCRIPT: &str = r#"
import socket, sys
path, body, n = sys.argv[1], sys.argv[2].encode(), int(sys.argv[3])
req = (b"POST /api/trees HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
       b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body)) + body
conns = []
for _ in range(n):
    c = socket.socket(socket.AF_UNIX)
    c.settimeout(120)
    c.connect(path)
    conns.append(c)
for c in conns:
    c.sendall(req)
for c in conns:
    data = b""
    while True:
        chunk = c.recv(65536)
        if not chunk:
            break
        data += chunk
    print(data.split(b"\r\n", 1)[0].decode())
"#;
    let out = Command::new("setpriv")
        .arg(format!("--reuid={}", user.uid))
        .arg(format!("--regid={}", user.gid))
        .arg("--clear-groups")
        .args([PYTHON, "-c", SCRIPT])
        .arg(sock)
        .arg(body.to_string())
        .arg(n.to_string())
        .current_dir("/")
        .output()
        .expect("python burst");
    assert!(
        out.status.success(),
        "burst: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            l.split_whitespace()
                .nth(1)
                .and_then(|c| c.parse().ok())
                .unwrap_or_else(|| panic!("no status in {l:?}"))
        })
        .collect()
}

const TERMINAL: [&str; 4] = ["ended", "vanished", "spawn_failed", "resolved"];

/// The live trees `user` holds, as the API shows them to it.
fn live_trees_of(sock: &Path, user: &TestUser) -> Vec<Value> {
    let (status, v) = curl(sock, Some(user), "GET", "/api/trees", None);
    assert_eq!(status, 200, "{v}");
    v.as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .filter(|t| !TERMINAL.contains(&t["state"].as_str().unwrap_or_default()))
        .collect()
}

/// `--max-trees-per-user` was a count read from the ledger, then a spawn,
/// nothing held between: 40 spawns sent on 40 connections before any
/// answer all read "0 live" and 40 trees ran. Each spawn now takes its
/// place among its principal's spawns in flight before the count is read:
/// at most the cap are admitted, the rest answered 503.
#[test]
fn forty_spawns_sent_at_once_by_one_user_start_at_most_its_cap() {
    if !Path::new(PYTHON).is_file() {
        skip("no /usr/bin/python3 to hold 40 connections as another user");
        return;
    }
    let Some(user) = TestUser::create() else {
        return;
    };
    let public = public_dir();
    let sock = public.path().join("api.sock");
    let s = Server::start(&[
        "--socket",
        sock.to_str().expect("utf-8 path"),
        "--max-trees-per-user",
        "5",
        "--max-connections-per-uid",
        "64",
    ]);
    let statuses = burst(&sock, &user, &spawn_body(&s, "exec sleep 300"), 40);
    let created = statuses.iter().filter(|c| **c == 201).count();
    say(&format!(
        "40 spawns at once under a cap of 5: {created} created, answers {statuses:?}"
    ));
    assert_eq!(statuses.len(), 40);
    assert!(
        statuses.iter().all(|c| *c == 201 || *c == 503),
        "each answered, created or refused: {statuses:?}; {}",
        s.stderr()
    );
    assert!(
        (1..=5).contains(&created),
        "at most the cap admitted: {statuses:?}"
    );
    let live = live_trees_of(&sock, &user);
    assert!(live.len() <= 5, "{} live trees: {live:?}", live.len());
    assert_eq!(live.len(), created, "each 201 is one live tree");
    // The kernel's count: the user's processes are its trees' sleeps.
    let procs = processes_of(user.uid);
    assert!(
        procs.len() <= 5,
        "{} processes run as the user",
        procs.len()
    );
}

/// The flags of tree `id`, as root reads the list of trees.
fn flags_of(sock: &Path, id: i64) -> Vec<String> {
    let (status, v) = curl(sock, None, "GET", "/api/trees?all=1", None);
    assert_eq!(status, 200, "{v}");
    v.as_array()
        .into_iter()
        .flatten()
        .find(|t| t["id"].as_i64() == Some(id))
        .and_then(|t| t["flags"].as_array())
        .map(|f| {
            f.iter()
                .filter_map(Value::as_str)
                .map(String::from)
                .collect()
        })
        .unwrap_or_default()
}

/// Bytes free to a user on the filesystem of `dir`.
fn free_bytes(dir: &Path) -> u64 {
    let st = rustix::fs::statvfs(dir).expect("statvfs");
    st.f_bavail * st.f_frsize
}

/// Iterations the churners have made (one byte each in their count files).
fn iterations(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum()
}

/// One user filled the ledger's disk and the reserve did not save the next
/// kill: ended trees' logs were kept uncounted, a tree churning members
/// with long command lines grew the ledger without bound (its argv stored
/// in `members` and again in `member.observed`), and on a full disk that
/// evidence spent the WAL's reserve; another user's kill then failed
/// ("ledger full") and dispatch closed.
///
/// Now, on a 320 MiB tmpfs: user A churns members with 60 KB command lines
/// in four trees and fills the logs with trees that write 12 MB each; its
/// evidence is budgeted per tree (past it, argv by digest, the tree
/// flagged), its ended logs are bounded per principal; then the disk is
/// filled to the last byte while A's churn goes on, and no evidence is
/// written below the floor that keeps the reserve. User B's kill of its
/// TERM-ignoring tree completes with its authorization (the processes gone,
/// by pid), and a further spawn answers 201.
#[test]
fn one_users_churn_and_logs_never_take_the_reserve_from_anothers_kill() {
    let Some(a) = TestUser::create() else {
        return;
    };
    let Some(b) = TestUser::create() else {
        return;
    };
    let public = public_dir();
    let sock = public.path().join("api.sock");
    let Some(s) = Server::start_on_tmpfs(
        &[
            "--socket",
            sock.to_str().expect("utf-8 path"),
            "--log-max",
            "8M",
            "--max-trees-per-user",
            "8",
            // A budget the four churners each pass within seconds on a
            // loaded host (the default 16M took one of them past two
            // minutes under the whole suite).
            "--evidence-max",
            "4M",
        ],
        "320m",
    ) else {
        return;
    };
    let data = s.data_dir();
    let counts = tempfile::tempdir().expect("count dir");
    std::os::unix::fs::chown(counts.path(), Some(a.uid), Some(a.gid)).expect("chown");

    // B's tree ignores SIGTERM: only an authorized SIGKILL ends it.
    let (status, v) = curl(
        &sock,
        Some(&b),
        "POST",
        "/api/trees",
        Some(&spawn_body(&s, "trap '' TERM; sleep 600 & wait")),
    );
    assert_eq!(status, 201, "{v}; {}", s.stderr());
    let victim = v["id"].as_i64().expect("id");
    let mut victim_pids = Vec::new();
    assert!(
        wait_until(Duration::from_secs(10), || {
            victim_pids = processes_of(b.uid);
            victim_pids.len() >= 2
        }),
        "B's shell and sleep: {victim_pids:?}"
    );

    // A's churners: each iteration a member whose argv (before and after
    // its exec) carries 60 KB.
    let long = "L".repeat(60_000);
    let mut churners = Vec::new();
    for i in 0..4 {
        let script = format!(
            "while :; do sh -c 'sleep 0.2; :' \"$0\" & echo >> {}/c{i}; sleep 0.01; done",
            counts.path().display()
        );
        let body = json!({
            "argv": ["sh", "-c", script, long],
            "env": {"TW_TEST_MARK": s.mark},
            "grace": "200ms",
        });
        let (status, v) = curl(&sock, Some(&a), "POST", "/api/trees", Some(&body));
        assert_eq!(status, 201, "churner {i}: {v}; {}", s.stderr());
        churners.push(v["id"].as_i64().expect("id"));
    }
    // A's loggers: 12 MB of output each (capped at 8 MB while live), then
    // ended, their logs left behind; as many as the cap and the floor let in.
    let mut loggers = Vec::new();
    let logged = wait_until(Duration::from_secs(60), || {
        let (status, v) = curl(
            &sock,
            Some(&a),
            "POST",
            "/api/trees",
            Some(&spawn_body(&s, "head -c 12000000 /dev/zero")),
        );
        if status == 201 {
            loggers.push(v["id"].as_i64().expect("id"));
        }
        loggers.len() >= 12
    });
    // Until every churner has spent its evidence budget (flagged), and
    // 3,000 members at least.
    let churned = wait_until(Duration::from_secs(120), || {
        iterations(counts.path()) >= 3000
            && churners.iter().all(|id| {
                flags_of(&sock, *id)
                    .iter()
                    .any(|f| f == "evidence_over_budget")
            })
    });
    say(&format!(
        "A: {} loggers (all 12: {logged}), {} churn iterations (every churner past its budget: {churned}); {} MiB free",
        loggers.len(),
        iterations(counts.path()),
        free_bytes(&data) >> 20
    ));
    assert!(iterations(counts.path()) >= 3000, "the churn ran");
    assert!(
        churned,
        "every churner passed its evidence budget before the disk was filled"
    );

    // Whatever A's share, the disk is now filled to the last byte, and A's
    // churn goes on under it.
    let filler = data.join("filler");
    let _ = Command::new("dd")
        .args(["if=/dev/zero", "bs=4k"])
        .arg(format!("of={}", filler.display()))
        .stderr(std::process::Stdio::null())
        .status();
    assert_eq!(free_bytes(&data), 0, "the disk is full");
    let at_fill = iterations(counts.path());
    assert!(
        wait_until(Duration::from_secs(60), || {
            iterations(counts.path()) >= at_fill + 1000
        }),
        "the churn went on under the full disk"
    );

    // B's kill of its own tree completes, with its authorization.
    let (status, v) = curl(
        &sock,
        Some(&b),
        "POST",
        &format!("/api/trees/{victim}/kill"),
        None,
    );
    assert_eq!(status, 200, "B's kill: {v}; {}", s.stderr());
    let kinds: Vec<String> = events_of(&sock, victim)
        .iter()
        .filter_map(|e| e["kind"].as_str().map(String::from))
        .collect();
    assert!(
        kinds.iter().any(|k| k == "kill.authorized"),
        "the SIGKILL had its authorization: {kinds:?}"
    );
    assert!(
        wait_until(Duration::from_secs(10), || victim_pids
            .iter()
            .all(|p| !pid_alive(*p))),
        "B's processes are gone: {:?}",
        victim_pids
            .iter()
            .filter(|p| pid_alive(**p))
            .collect::<Vec<_>>()
    );

    // Room back: dispatch is open for others.
    std::fs::remove_file(&filler).expect("free the disk");
    let (status, v) = curl(
        &sock,
        Some(&b),
        "POST",
        "/api/trees",
        Some(&spawn_body(&s, "exec sleep 300")),
    );
    assert_eq!(status, 201, "a further spawn: {v}; {}", s.stderr());

    // A's share was bounded: each churner's evidence past its budget went
    // by digest (flagged), evidence under the floor was dropped (flagged),
    // and A's ended logs stay within its principal's budget (64 MiB).
    for id in &churners {
        let flags = flags_of(&sock, *id);
        assert!(
            flags.iter().any(|f| f == "evidence_over_budget"),
            "tree {id}: {flags:?}"
        );
        assert!(
            flags.iter().any(|f| f == "evidence_dropped"),
            "tree {id}: {flags:?}"
        );
    }
    let ended_logs = || -> u64 {
        loggers
            .iter()
            .map(|id| {
                std::fs::metadata(data.join("logs").join(format!("tree-{id}.log")))
                    .map(|m| m.len())
                    .unwrap_or(0)
            })
            .sum()
    };
    assert!(
        wait_until(Duration::from_secs(10), || ended_logs() <= 64 << 20),
        "A's ended logs: {} MiB",
        ended_logs() >> 20
    );
    for id in &churners {
        let _ = curl(
            &sock,
            None,
            "POST",
            &format!("/api/trees/{id}/kill?grace=100ms"),
            None,
        );
    }
    let out = Command::new(bin())
        .env("TREEWARDEN_DATA_DIR", &data)
        .arg("verify")
        .output()
        .expect("verify");
    assert!(
        out.status.success(),
        "verify: {}",
        String::from_utf8_lossy(&out.stdout)
    );
}
