//! The ledger over months (issue 15, in part): exports that stream with
//! constant memory and resume exactly from a seq, over the CLI and HTTP;
//! online backups that verify on their own.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use treewarden::ledger::{Ledger, LedgerOptions};

use crate::util::{self, parse_ndjson};

fn cli(data_dir: &Path) -> Command {
    let mut cmd = Command::new(util::bin());
    cmd.arg("--data-dir")
        .arg(data_dir)
        .env_remove("TREEWARDEN_LOG");
    cmd
}

/// A ledger of `events` free-standing events, each carrying ~400 bytes, as
/// the ledger API writes them (the chain is real).
fn ledger_with(dir: &Path, events: usize) {
    let ledger = Ledger::open(&dir.join("ledger.db"), LedgerOptions::default()).expect("open");
    let pad = "x".repeat(400);
    for i in 0..events {
        ledger
            .append_event(None, util::refused_event(&format!("{i} {pad}")))
            .expect("append");
    }
}

#[test]
fn export_after_a_seq_is_exact_across_pages() {
    let dir = tempfile::tempdir().expect("tempdir");
    ledger_with(dir.path(), 2_345);
    let all = cli(dir.path()).arg("export").output().expect("export");
    assert!(all.status.success());
    let all = parse_ndjson(&String::from_utf8_lossy(&all.stdout));
    let seqs: Vec<i64> = all.iter().filter_map(|e| e["seq"].as_i64()).collect();
    assert_eq!(
        seqs,
        (1..=2_345).collect::<Vec<i64>>(),
        "every event, once, in order"
    );
    for after in [0, 1, 999, 1_000, 1_001, 2_000, 2_344, 2_345, 9_999] {
        let out = cli(dir.path())
            .args(["export", "--after", &after.to_string()])
            .output()
            .expect("export --after");
        assert!(out.status.success());
        let got = parse_ndjson(&String::from_utf8_lossy(&out.stdout));
        let want: Vec<&serde_json::Value> = all
            .iter()
            .filter(|e| e["seq"].as_i64() > Some(after))
            .collect();
        assert_eq!(got.len(), want.len(), "--after {after}");
        assert!(got.iter().zip(want).all(|(a, b)| a == b), "--after {after}");
    }
    // CSV pages keep one header.
    let out = cli(dir.path())
        .args(["export", "--format", "csv", "--after", "500"])
        .output()
        .expect("csv");
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text.lines().filter(|l| l.starts_with("seq,at,")).count(), 1);
    let mut csv = csv::Reader::from_reader(text.as_bytes());
    assert_eq!(csv.records().count(), 2_345 - 500);
    let out = cli(dir.path())
        .args(["export", "--after", "-1"])
        .output()
        .expect("bad");
    assert_eq!(out.status.code(), Some(2));
}

/// The peak RSS (VmHWM, KiB) of `treewarden export` over a ledger, sampled
/// while its output is read slowly (a streaming export is blocked on the
/// pipe most of the time; one that builds its output in memory first has
/// its peak before it writes anything).
fn export_peak_kib(dir: &Path) -> u64 {
    let mut child = cli(dir)
        .arg("export")
        .stdout(Stdio::piped())
        .spawn()
        .expect("export");
    let pid = child.id();
    let mut out = child.stdout.take().expect("stdout");
    let mut peak = 0;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        if let Some(kib) = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("VmHWM:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            })
        {
            peak = peak.max(kib);
        }
        match out.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
    }
    util::wait_child(&mut child, Duration::from_secs(60)).expect("export ends");
    peak
}

#[test]
fn export_memory_does_not_grow_with_the_ledger() {
    let small = tempfile::tempdir().expect("tempdir");
    let large = tempfile::tempdir().expect("tempdir");
    ledger_with(small.path(), 2_000);
    ledger_with(large.path(), 20_000);
    let (s, l) = (export_peak_kib(small.path()), export_peak_kib(large.path()));
    util::say(&format!(
        "export peak RSS: {s} KiB for 2,000 events, {l} KiB for 20,000 ({:.2}x)",
        l as f64 / s.max(1) as f64
    ));
    assert!(s > 0 && l > 0, "VmHWM read");
    assert!(
        (l as f64) <= 1.3 * s as f64,
        "10x the events, {l} KiB vs {s} KiB: the export must stream"
    );
}

#[test]
fn export_over_http_streams_resumes_and_downloads() {
    let server = crate::serve::Server::start(&[]);
    for _ in 0..3 {
        let (status, _) = server.post(
            "/api/trees",
            Some(&serde_json::json!({"argv": ["true"], "label": "export"})),
        );
        assert_eq!(status, 201);
    }
    let full = server.get("/api/export");
    assert_eq!(full.status(), 200);
    let disposition = full
        .headers()
        .get("content-disposition")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    assert!(
        disposition.contains("attachment") && disposition.contains(".ndjson"),
        "{disposition}"
    );
    let all = parse_ndjson(&full.text().expect("body"));
    assert!(all.len() > 5);
    let mid = all[all.len() / 2]["seq"].as_i64().expect("seq");
    let rest = parse_ndjson(
        &server
            .get(&format!("/api/export?after={mid}"))
            .text()
            .expect("body"),
    );
    let want: Vec<&serde_json::Value> = all
        .iter()
        .filter(|e| e["seq"].as_i64() > Some(mid))
        .collect();
    // The trees may have written more since the first export: compare up
    // to its last event (the exactness of `after` is what is checked here).
    let last = all.last().and_then(|e| e["seq"].as_i64());
    let rest: Vec<serde_json::Value> = rest
        .into_iter()
        .filter(|e| e["seq"].as_i64() <= last)
        .collect();
    assert_eq!(rest.len(), want.len());
    assert!(rest.iter().zip(want).all(|(a, b)| a == b));
    assert_eq!(server.get("/api/export?after=-3").status(), 400);
}

#[test]
fn a_backup_taken_while_trees_are_spawned_verifies_on_its_own() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    assert!(
        cli(&data)
            .args(["run", "--", "true"])
            .status()
            .expect("run")
            .success()
    );
    // Spawns run while the backups are taken.
    let writer = {
        let data = data.clone();
        std::thread::spawn(move || {
            for _ in 0..15 {
                let _ = cli(&data).args(["run", "--", "true"]).status();
            }
        })
    };
    let mut copies = Vec::new();
    for i in 0..5 {
        let dest = dir.path().join(format!("copy-{i}.db"));
        let out = cli(&data)
            .arg("backup")
            .arg(&dest)
            .output()
            .expect("backup");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(String::from_utf8_lossy(&out.stdout).contains("verified"));
        copies.push(dest);
    }
    writer.join().expect("writer");
    for dest in &copies {
        // Each copy verifies on its own, as a data dir of its own.
        let own = dir
            .path()
            .join(format!("restore-{}", dest.display().to_string().len()));
        std::fs::create_dir_all(&own).expect("dir");
        let restored = own.join("ledger.db");
        std::fs::copy(dest, &restored).expect("copy");
        let out = cli(&own).arg("verify").output().expect("verify");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stdout)
        );
        std::fs::remove_dir_all(&own).expect("cleanup");
    }
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&copies[0])
        .expect("stat")
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600);
    // A backup never overwrites.
    let out = cli(&data)
        .arg("backup")
        .arg(&copies[0])
        .output()
        .expect("backup");
    assert_eq!(out.status.code(), Some(2));
}

/// A backup is written where the operator says, a shared directory such as
/// `/tmp` included: the data dir's privacy rule is the live ledger's, not
/// the copy's. The copy is 0600 and verifies on its own; nothing else is
/// left beside it.
#[test]
fn a_backup_into_tmp_itself_is_written_0600_and_verifies() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    assert!(
        cli(&data)
            .args(["run", "--", "true"])
            .status()
            .expect("run")
            .success()
    );
    // /tmp itself: shared (1777) and in use by others. A name of this test's
    // own, removed on every path by the guard.
    let tmp = std::path::Path::new("/tmp");
    let tmp_mode = std::fs::metadata(tmp)
        .expect("stat /tmp")
        .permissions()
        .mode();
    assert_ne!(tmp_mode & 0o1000, 0, "/tmp is sticky here ({tmp_mode:o})");
    struct Gone(std::path::PathBuf);
    impl Drop for Gone {
        fn drop(&mut self) {
            for suffix in ["", "-wal", "-shm", "-journal"] {
                let mut p = self.0.clone().into_os_string();
                p.push(suffix);
                let _ = std::fs::remove_file(p);
            }
        }
    }
    let dest = Gone(tmp.join(format!(
        "tw-backup-test-{}-{}.db",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_nanos()
    )));
    let out = cli(&data)
        .arg("backup")
        .arg(&dest.0)
        .output()
        .expect("backup");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("verified"));
    let mode = std::fs::metadata(&dest.0)
        .expect("stat")
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600, "the copy is private to its owner");
    let mut wal = dest.0.clone().into_os_string();
    wal.push("-wal");
    assert!(
        !std::path::Path::new(&wal).exists(),
        "the verification left no WAL beside the copy"
    );
    // /tmp itself was left as it was (the privacy rule would have made
    // an empty sticky directory 0700).
    let after = std::fs::metadata(tmp)
        .expect("stat /tmp")
        .permissions()
        .mode();
    assert_eq!(after & 0o7777, tmp_mode & 0o7777);
}

/// Reads an SSE response line by line on a thread of its own; lines come
/// back through a channel, so every wait on them is bounded.
fn sse_lines(resp: reqwest::blocking::Response) -> std::sync::mpsc::Receiver<String> {
    use std::io::BufRead;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(resp).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// The next SSE event (id, kind, data) within `limit`, skipping comments.
fn next_event(
    rx: &std::sync::mpsc::Receiver<String>,
    limit: Duration,
) -> Option<(i64, String, serde_json::Value)> {
    let deadline = std::time::Instant::now() + limit;
    let (mut id, mut kind, mut data) = (None, None, None);
    loop {
        let left = deadline.checked_duration_since(std::time::Instant::now())?;
        let line = rx.recv_timeout(left).ok()?;
        if let Some(v) = line.strip_prefix("id:") {
            id = v.trim().parse().ok();
        } else if let Some(v) = line.strip_prefix("event:") {
            kind = Some(v.trim().to_string());
        } else if let Some(v) = line.strip_prefix("data:") {
            data = serde_json::from_str(v.trim()).ok();
        } else if line.is_empty() && id.is_some() {
            return Some((id?, kind?, data?));
        }
    }
}

#[test]
fn the_event_stream_sends_each_new_event_with_its_seq_and_resumes() {
    let server = crate::serve::Server::start(&[]);
    let client = reqwest::blocking::Client::builder()
        .no_proxy()
        .build()
        .expect("client");
    let resp = client
        .get(server.url("/api/events/stream"))
        .bearer_auth(&server.token)
        .send()
        .expect("stream");
    assert_eq!(resp.status(), 200);
    assert!(
        resp.headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"))
    );
    let rx = sse_lines(resp);
    let (status, tree) = server.post(
        "/api/trees",
        Some(&serde_json::json!({"argv": ["true"], "label": "sse"})),
    );
    assert_eq!(status, 201);
    // The first event the stream sends for the new tree is its creation,
    // with the ledger's seq as the SSE id.
    let mut created = None;
    for _ in 0..50 {
        let Some((id, kind, data)) = next_event(&rx, Duration::from_secs(10)) else {
            break;
        };
        assert_eq!(data["seq"].as_i64(), Some(id), "{data}");
        assert_eq!(data["kind"].as_str(), Some(kind.as_str()));
        if kind == "tree.created" && data["tree"] == tree["id"] {
            created = Some(id);
            break;
        }
    }
    let created = created.expect("tree.created arrived on the stream");
    // A reconnect with Last-Event-ID resumes exactly after it.
    let resp = client
        .get(server.url("/api/events/stream"))
        .bearer_auth(&server.token)
        .header("Last-Event-ID", created.to_string())
        .send()
        .expect("resume");
    let rx = sse_lines(resp);
    let (id, _, _) = next_event(&rx, Duration::from_secs(10)).expect("the next event");
    assert_eq!(id, created + 1);
    let bad = client
        .get(server.url("/api/events/stream"))
        .bearer_auth(&server.token)
        .header("Last-Event-ID", "x")
        .send()
        .expect("bad");
    assert_eq!(bad.status(), 400);
}

#[test]
fn the_head_is_published_rarely_and_always_last() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = cli(dir.path())
        .env("TREEWARDEN_LOG", "info")
        .env("NO_COLOR", "1")
        .args(["run", "--", "sh", "-c", "sleep 0.2 & sleep 0.2 & wait"])
        .output()
        .expect("run");
    assert!(out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    let heads: Vec<&str> = err.lines().filter(|l| l.contains("ledger head")).collect();
    // A run commits a dozen events; the head is published at INFO on the
    // first commit and once more as the ledger closes, not per commit.
    assert!(!heads.is_empty() && heads.len() <= 3, "{heads:?}");
    let last = heads.last().expect("a head");
    let field = |name: &str| {
        last.split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{name}=")))
            .map(String::from)
            .expect("field")
    };
    let expect = format!("{}:{}", field("seq"), field("hash"));
    let out = cli(dir.path())
        .args(["verify", "--expect-head", &expect])
        .output()
        .expect("verify");
    assert!(
        out.status.success(),
        "the last published head is the ledger's head: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    let events = parse_ndjson(&String::from_utf8_lossy(
        &cli(dir.path())
            .arg("export")
            .output()
            .expect("export")
            .stdout,
    ));
    assert!(
        events.len() > heads.len() * 2,
        "fewer head lines than commits"
    );
}

/// A ledger of `trees` ended trees, each with `members` members seen and
/// exited, written through the ledger API as a teardown writes them.
fn ledger_with_trees(dir: &Path, trees: usize, members: usize) {
    use treewarden::ledger::{
        ExitRecord, IdentityRecord, MemberRecord, NewTree, OwnerKind, OwnerRecord, TreeState,
    };
    let ledger = Ledger::open(&dir.join("ledger.db"), LedgerOptions::default()).expect("open");
    let owner = ledger
        .register_owner(&OwnerRecord {
            identity: IdentityRecord {
                pid: 1,
                start_ticks: 1,
                boot_id: "ledger-life".into(),
            },
            kind: OwnerKind::Run,
        })
        .expect("owner");
    for t in 0..trees {
        let id = ledger
            .create_tree(&NewTree {
                label: Some(format!("tree-{t}")),
                boundary: treewarden::proc::BoundaryKind::Session,
                owner,
                argv: vec!["sh".into(), "-c".into(), "make -j8 all".into()],
                cwd: Some("/srv/build".into()),
                grace_ms: Some(5000),
                timeout_ms: None,
                limits: Default::default(),
                first_signal: None,
            })
            .expect("tree");
        let ids: Vec<IdentityRecord> = (0..members)
            .map(|m| IdentityRecord {
                pid: 10_000 + m as i32,
                start_ticks: (t * 1000 + m) as u64,
                boot_id: "ledger-life".into(),
            })
            .collect();
        let seen: Vec<MemberRecord> = ids
            .iter()
            .map(|i| MemberRecord {
                identity: i.clone(),
                ppid: 10_000,
                pgid: 10_000,
                sid: 10_000,
                cgroup: None,
                uid: Some(1000),
                exe: Some("/usr/bin/cc1".into()),
                cmdline: vec!["cc1".into(), "-O2".into(), format!("src/file{t}.c")],
                cwd: Some("/srv/build".into()),
            })
            .collect();
        ledger.observe_members(id, &seen).expect("members");
        let exits: Vec<(IdentityRecord, Option<ExitRecord>)> = ids
            .into_iter()
            .map(|i| {
                (
                    i,
                    Some(ExitRecord {
                        code: Some(0),
                        signal: None,
                        cpu_usec: None,
                    }),
                )
            })
            .collect();
        ledger.record_exits(id, &exits, "parent").expect("exits");
        ledger.end_tree(id, TreeState::Ended, None).expect("end");
    }
}

#[test]
fn export_memory_at_1000_trees_is_within_1_3x_of_100() {
    let small = tempfile::tempdir().expect("tempdir");
    let large = tempfile::tempdir().expect("tempdir");
    ledger_with_trees(small.path(), 100, 5);
    ledger_with_trees(large.path(), 1_000, 5);
    let (s, l) = (export_peak_kib(small.path()), export_peak_kib(large.path()));
    util::say(&format!(
        "export peak RSS: {s} KiB for 100 trees, {l} KiB for 1,000 trees ({:.2}x)",
        l as f64 / s.max(1) as f64
    ));
    assert!(s > 0 && l > 0, "VmHWM read");
    assert!(
        (l as f64) <= 1.3 * s as f64,
        "10x the trees, {l} KiB vs {s} KiB: the export must stream"
    );
}

#[test]
fn a_backup_taken_while_the_service_spawns_verifies_on_its_own() {
    let server = crate::serve::Server::start(&[]);
    let dir = tempfile::tempdir().expect("tempdir");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Spawns through the API, ending on their own, while the backups are taken.
    let spawned = std::thread::scope(|scope| {
        let spawner = scope.spawn(|| {
            let mut n = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) && n < 200 {
                let (status, _) = server.post(
                    "/api/trees",
                    Some(&serde_json::json!({"argv": ["sh", "-c", "exit 0"], "label": "backup"})),
                );
                assert_eq!(status, 201);
                n += 1;
            }
            n
        });
        let mut heads = Vec::new();
        for i in 0..4 {
            let dest = dir.path().join(format!("copy-{i}.db"));
            let out = cli(&server.data_dir())
                .arg("backup")
                .arg(&dest)
                .output()
                .expect("backup");
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            heads.push(dest);
        }
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let n = spawner.join().expect("spawner");
        (n, heads)
    });
    let (n, copies) = spawned;
    assert!(n > 0, "the service spawned while the backups ran");
    for dest in &copies {
        let own = dir.path().join(format!(
            "restore-{}",
            dest.file_stem().and_then(|s| s.to_str()).unwrap_or("x")
        ));
        std::fs::create_dir_all(&own).expect("dir");
        std::fs::copy(dest, own.join("ledger.db")).expect("copy");
        let out = cli(&own).arg("verify").output().expect("verify");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
    // The copies differ: each is a snapshot of its own moment of a ledger
    // that kept growing.
    let events = |p: &Path| {
        Ledger::open(p, LedgerOptions::default())
            .expect("open")
            .head()
            .expect("head")
            .map_or(0, |(seq, _)| seq)
    };
    let first = events(&copies[0]);
    let last = events(&copies[copies.len() - 1]);
    assert!(last >= first && first > 0, "{first} .. {last}");
}
