//! Shipping to NATS JetStream (`serve --ship`, `treewarden ship`) against
//! real `nats-server` processes on 127.0.0.1: a 3-node JetStream cluster
//! (or one node where a test needs no more), random free ports, store dirs
//! in temp dirs, each server ended by its own pid. What the stream holds is
//! read back with an async-nats consumer and compared, field by field, with
//! the ledger's own export.
//!
//! Without `nats-server` (Debian package `nats-server`) each test prints
//! "skipped: <why>", and fails where TREEWARDEN_LANE_REQUIRED=1 or CI is set.

use std::collections::BTreeSet;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer, stream};
use serde_json::Value;

use crate::serve::Server;
use crate::util::{bin, parse_ndjson, say, skip, wait_child, wait_until};

/// `nats-server`'s path, or `None` after the skip line (a failure where a
/// lane requires it).
pub(crate) fn nats_server() -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("nats-server"))
            .find(|p| p.is_file())
    });
    if found.is_none() {
        let required = std::env::var("TREEWARDEN_LANE_REQUIRED").is_ok_and(|v| v == "1")
            || std::env::var_os("CI").is_some_and(|v| !v.is_empty());
        assert!(
            !required,
            "nats-server is not installed (Debian package nats-server; tests/setup installs it)"
        );
        skip("nats-server not installed (Debian package nats-server)");
    }
    found
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// One `nats-server` process, its ports and store dir.
pub(crate) struct Node {
    child: Option<Child>,
    pub(crate) port: u16,
    config: PathBuf,
    log: PathBuf,
}

impl Node {
    fn start(exe: &Path, config: &Path, log: &Path, port: u16) -> Node {
        let mut node = Node {
            child: None,
            port,
            config: config.to_path_buf(),
            log: log.to_path_buf(),
        };
        node.restart(exe);
        node
    }

    pub(crate) fn restart(&mut self, exe: &Path) {
        assert!(self.child.is_none(), "node already running");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("node log");
        self.child = Some(
            Command::new(exe)
                .arg("-c")
                .arg(&self.config)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .expect("start nats-server"),
        );
    }

    /// SIGTERM by its own pid (a clean stop), then reaped.
    pub(crate) fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            crate::util::signal(child.id(), rustix::process::Signal::TERM);
            if wait_child(&mut child, Duration::from_secs(20)).is_none() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }

    /// SIGKILL by its own pid, then reaped.
    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = wait_child(&mut child, Duration::from_secs(10));
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A JetStream cluster (or one node) on loopback.
pub(crate) struct Nats {
    pub(crate) exe: PathBuf,
    pub(crate) nodes: Vec<Node>,
    dir: tempfile::TempDir,
}

impl Nats {
    /// `n` nodes in one cluster (`n == 1`: a plain JetStream server), ready
    /// to take a stream (a meta leader elected), else `None` after saying why.
    pub(crate) fn start(exe: &Path, n: usize) -> Option<Nats> {
        let dir = tempfile::tempdir().expect("temp dir");
        let ports: Vec<(u16, u16)> = (0..n).map(|_| (free_port(), free_port())).collect();
        let routes: Vec<String> = ports
            .iter()
            .map(|(_, c)| format!("nats-route://127.0.0.1:{c}"))
            .collect();
        let mut nodes = Vec::new();
        for (i, (port, cport)) in ports.iter().enumerate() {
            let store = dir.path().join(format!("store-{i}"));
            let cluster = if n > 1 {
                format!(
                    "cluster {{\n  name: twtest\n  listen: 127.0.0.1:{cport}\n  routes: [{}]\n}}\n",
                    routes.join(", ")
                )
            } else {
                String::new()
            };
            let config = dir.path().join(format!("n{i}.conf"));
            std::fs::write(
                &config,
                format!(
                    "server_name: n{i}\nlisten: 127.0.0.1:{port}\nhttp: 0\njetstream {{\n  store_dir: \"{}\"\n}}\n{cluster}",
                    store.display()
                ),
            )
            .expect("node config");
            let log = dir.path().join(format!("n{i}.log"));
            nodes.push(Node::start(exe, &config, &log, *port));
        }
        let nats = Nats {
            exe: exe.to_path_buf(),
            nodes,
            dir,
        };
        let url = nats.url();
        let mut last = String::new();
        let ready = wait_until(Duration::from_secs(60), || {
            block_on(async {
                let client = match connect(&url).await {
                    Ok(c) => c,
                    Err(e) => {
                        last = e.to_string();
                        return false;
                    }
                };
                // JetStream answers for streams once a meta leader leads.
                match jetstream::new(client).get_stream("TW_READY_PROBE").await {
                    Ok(_) => true,
                    Err(e) => {
                        last = e.to_string();
                        last.contains("stream not found")
                    }
                }
            })
        });
        if !ready {
            say(&format!(
                "the {n}-node JetStream cluster did not become ready in 60 s ({last}): {}",
                nats.logs()
            ));
            return None;
        }
        Some(nats)
    }

    /// Every node's client URL, comma separated (the `--ship` form).
    pub(crate) fn url(&self) -> String {
        self.nodes
            .iter()
            .map(|n| format!("nats://127.0.0.1:{}", n.port))
            .collect::<Vec<_>>()
            .join(",")
    }

    fn logs(&self) -> String {
        (0..self.nodes.len())
            .map(|i| {
                std::fs::read_to_string(self.dir.path().join(format!("n{i}.log")))
                    .unwrap_or_default()
            })
            .collect::<Vec<_>>()
            .join("\n---\n")
    }
}

/// A client of the servers `url` names (comma separated, as `--ship`).
pub(crate) async fn connect(url: &str) -> Result<async_nats::Client, async_nats::ConnectError> {
    let servers: Vec<&str> = url.split(',').collect();
    async_nats::connect(servers).await
}

pub(crate) fn block_on<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(f)
}

/// One stored message: its stream sequence, headers, and body.
#[derive(Debug)]
pub(crate) struct Stored {
    pub(crate) stream_seq: u64,
    headers: std::collections::BTreeMap<String, String>,
    pub(crate) body: Value,
}

/// Every message of `subject` in the stream, in stream order, read by an
/// ephemeral pull consumer.
pub(crate) fn read_subject(url: &str, subject: &str) -> Vec<Stored> {
    try_read_subject(url, subject).expect("the stream read back")
}

/// [`read_subject`], an error while the cluster elects a leader.
fn try_read_subject(url: &str, subject: &str) -> Result<Vec<Stored>, String> {
    let e = |e: &dyn std::fmt::Display| e.to_string();
    block_on(async {
        use futures_util::StreamExt;
        let client = connect(url).await.map_err(|x| e(&x))?;
        let js = jetstream::new(client);
        let stream = js.get_stream("TREEWARDEN").await.map_err(|x| e(&x))?;
        let mut consumer = stream
            .create_consumer(consumer::pull::Config {
                filter_subject: subject.to_string(),
                deliver_policy: consumer::DeliverPolicy::All,
                ack_policy: consumer::AckPolicy::None,
                ..Default::default()
            })
            .await
            .map_err(|x| e(&x))?;
        let mut out = Vec::new();
        let started = Instant::now();
        loop {
            let mut batch = consumer
                .fetch()
                .max_messages(500)
                .expires(Duration::from_millis(500))
                .messages()
                .await
                .map_err(|x| e(&x))?;
            let before = out.len();
            while let Some(m) = batch.next().await {
                let m = m.map_err(|x| e(&x))?;
                let info = m.info().map_err(|x| e(&x))?;
                let headers = m
                    .headers
                    .iter()
                    .flat_map(|h| h.iter())
                    .map(|(k, v)| {
                        (
                            k.to_string(),
                            v.iter().map(|v| v.as_str()).collect::<Vec<_>>().join(","),
                        )
                    })
                    .collect();
                out.push(Stored {
                    stream_seq: info.stream_sequence,
                    headers,
                    body: serde_json::from_slice(&m.payload).expect("a JSON body"),
                });
            }
            // An empty fetch ends the read only once the consumer has
            // nothing left to deliver: a fetch can come back empty while
            // the cluster settles, with messages still pending.
            if out.len() == before {
                let pending = consumer.info().await.map_err(|x| e(&x))?.num_pending;
                if pending == 0 {
                    return Ok(out);
                }
                if started.elapsed() > Duration::from_secs(30) {
                    return Err(format!("{pending} messages still pending after 30 s"));
                }
            }
        }
    })
}

/// The ledger's events, from `treewarden export` on its data dir.
fn ledger_events(data: &Path) -> Vec<Value> {
    let out = Command::new(bin())
        .env("TREEWARDEN_DATA_DIR", data)
        .arg("export")
        .output()
        .expect("export");
    assert!(
        out.status.success(),
        "export: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    parse_ndjson(&String::from_utf8_lossy(&out.stdout))
        .into_iter()
        .filter(|e| e.get("seq").is_some())
        .collect()
}

fn seqs(stored: &[Stored]) -> Vec<i64> {
    stored
        .iter()
        .filter_map(|m| m.body["seq"].as_i64())
        .collect()
}

/// A unique host id per test (the stream is the tests' own anyway).
pub(crate) fn host(tag: &str) -> String {
    format!("t-{tag}-{}", std::process::id())
}

/// Spawns `sh -c "exit 0"` and waits until its tree is recorded ended.
///
/// Or `vanished`, when its own events say why: another process took the
/// root's pid (its group's and session's id) between the root's exit and
/// the teardown's look, and the teardown then refuses the group as the
/// tree's (`kill.skipped`, "... recycled") and closes it vanished. On this
/// host other tests make that happen on purpose (`hostile::`, `custody::`,
/// `proc::`, `rules::` set `/proc/sys/kernel/ns_last_pid`, host-wide, to
/// put a stranger on a pid they freed), so a shipping test that runs beside
/// them may lose a root's pid the same way; what these tests need, a tree
/// whose events are all written, holds either way. A tree neither ended nor
/// so vanished within the wait fails with its row and the service's log.
pub(crate) fn spawn_ended(server: &Server, label: &str) -> i64 {
    let (status, body) = server.post(
        "/api/trees",
        Some(&serde_json::json!({"argv": ["sh", "-c", "exit 0"], "label": label})),
    );
    assert_eq!(status, 201, "{body}");
    let id = body["id"].as_i64().expect("id");
    let mut row = Value::Null;
    let settled = wait_until(Duration::from_secs(20), || {
        match server.get(&format!("/api/trees/{id}")).json::<Value>() {
            Ok(t) => {
                let done = matches!(t["tree"]["state"].as_str(), Some("ended" | "vanished"));
                row = t;
                done
            }
            Err(_) => false,
        }
    });
    assert!(
        settled,
        "tree {id} ends; its row: {row}; log: {}",
        server.stderr()
    );
    if row["tree"]["state"] == "vanished" {
        let recycled = row["events"].as_array().is_some_and(|events| {
            events.iter().any(|e| {
                e["kind"] == "kill.skipped"
                    && e["data"]["reason"]
                        .as_str()
                        .is_some_and(|r| r.ends_with(": recycled"))
            })
        });
        assert!(
            recycled,
            "tree {id} vanished, and not for a pid taken by another process: {row}; log: {}",
            server.stderr()
        );
        say(&format!(
            "jetstream: tree {id}'s root pid was taken by another process before its teardown looked (a test beside this one set ns_last_pid): recorded vanished"
        ));
    }
    id
}

pub(crate) fn metric(server: &Server, name: &str) -> Option<f64> {
    let text = server.get("/metrics").text().ok()?;
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<f64>().ok())
}

/// The stream holds exactly the ledger's events, in order, each once.
pub(crate) fn stream_matches_ledger(url: &str, subject: &str, data: &Path) -> bool {
    let events = ledger_events(data);
    let Ok(stored) = try_read_subject(url, subject) else {
        return false;
    };
    seqs(&stored)
        == events
            .iter()
            .filter_map(|e| e["seq"].as_i64())
            .collect::<Vec<_>>()
}

/// Shipping caught up: within `wait` the stream holds exactly the ledger's
/// events, in order, each once; then the lag metric is back to 0.
pub(crate) fn shipped_everything(server: &Server, url: &str, subject: &str, wait: Duration) {
    let data = server.data_dir();
    assert!(
        wait_until(wait, || stream_matches_ledger(url, subject, &data)),
        "shipping resumes, every event once, in order; log: {}",
        server.stderr()
    );
    assert!(
        wait_until(Duration::from_secs(20), || metric(
            server,
            "treewarden_ship_lag_events"
        ) == Some(0.0)),
        "lag back to 0"
    );
}

#[test]
fn events_reach_a_three_node_cluster_in_order_with_their_headers() {
    let Some(exe) = nats_server() else { return };
    let Some(nats) = Nats::start(&exe, 3).or_else(|| {
        say("jetstream: the 3-node cluster did not form; this test runs on one node");
        Nats::start(&exe, 1)
    }) else {
        panic!("no JetStream server became ready");
    };
    let replicas = if nats.nodes.len() == 3 { "3" } else { "1" };
    let id = host("order");
    let subject = format!("treewarden.{id}.events");
    let server = Server::start(&[
        "--ship",
        &nats.url(),
        "--ship-host-id",
        &id,
        "--ship-replicas",
        replicas,
    ]);
    for i in 0..3 {
        spawn_ended(&server, &format!("shipped-{i}"));
    }
    let data = server.data_dir();
    assert!(
        wait_until(Duration::from_secs(30), || stream_matches_ledger(
            &nats.url(),
            &subject,
            &data
        )),
        "the stream holds the ledger's events; log: {}",
        server.stderr()
    );
    // Ground truth: the ledger's own export, field by field.
    let events = ledger_events(&data);
    let stored = read_subject(&nats.url(), &subject);
    assert_eq!(stored.len(), events.len());
    let mut last_stream_seq = 0;
    for (m, e) in stored.iter().zip(&events) {
        for field in ["seq", "at", "tree", "kind", "data", "prev_hash", "hash"] {
            assert_eq!(m.body[field], e[field], "field {field} of seq {}", e["seq"]);
        }
        let seq = e["seq"].as_i64().expect("seq");
        let hash = e["hash"].as_str().expect("hash");
        let h = |k: &str| m.headers.get(k).map(String::as_str);
        assert_eq!(
            h("Nats-Msg-Id"),
            Some(format!("{id}:{seq}:{}", &hash[..16]).as_str())
        );
        assert_eq!(h("ce-specversion"), Some("1.0"));
        assert_eq!(h("ce-id"), Some(format!("{id}:{seq}").as_str()));
        assert_eq!(h("ce-source"), Some(format!("treewarden://{id}").as_str()));
        assert_eq!(h("ce-type"), e["kind"].as_str());
        assert_eq!(h("ce-time"), e["at"].as_str());
        assert_eq!(h("content-type"), Some("application/json"));
        assert!(m.stream_seq > last_stream_seq, "stream order is seq order");
        last_stream_seq = m.stream_seq;
    }
    // The stream as the shipper made it.
    let config = block_on(async {
        let client = connect(&nats.url()).await.expect("connect");
        let mut s = jetstream::new(client)
            .get_stream("TREEWARDEN")
            .await
            .expect("stream");
        s.info().await.expect("info").config.clone()
    });
    assert!(config.deny_delete && config.deny_purge, "{config:?}");
    assert_eq!(config.storage, stream::StorageType::File);
    assert_eq!(config.duplicate_window, Duration::from_secs(120));
    assert_eq!(config.num_replicas.to_string(), replicas);
    // Caught up: no lag, nothing refused.
    assert!(
        wait_until(Duration::from_secs(10), || metric(
            &server,
            "treewarden_ship_lag_events"
        ) == Some(0.0)),
        "lag 0"
    );
    assert_eq!(metric(&server, "treewarden_ship_refused_total"), Some(0.0));
}

/// `treewarden ship` on a data dir, with extra environment; its exit status
/// and stderr.
pub(crate) fn ship(
    data: &Path,
    url: &str,
    id: &str,
    env: &[(&str, &str)],
) -> (Option<i32>, String) {
    let mut cmd = Command::new(bin());
    cmd.env("TREEWARDEN_DATA_DIR", data)
        .args(["ship", url, "--host-id", id, "--timeout", "3s"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("ship");
    (
        out.status.code(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// A data dir with a few `run` trees' events.
pub(crate) fn ledger_with_runs(n: usize) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    for _ in 0..n {
        let status = Command::new(bin())
            .env("TREEWARDEN_DATA_DIR", dir.path())
            .env("TREEWARDEN_BOUNDARY", "session")
            .args(["run", "--", "true"])
            .status()
            .expect("run");
        assert!(status.success());
    }
    dir
}

fn cursor(data: &Path) -> Option<i64> {
    let ledger = treewarden::ledger::Ledger::open(
        &data.join("ledger.db"),
        treewarden::ledger::LedgerOptions::default(),
    )
    .expect("open the ledger");
    ledger.ship_cursor("nats").expect("cursor")
}

#[test]
fn a_replay_after_a_crash_between_ack_and_cursor_is_stored_once() {
    let Some(exe) = nats_server() else { return };
    let Some(nats) = Nats::start(&exe, 1) else {
        panic!("no JetStream server became ready");
    };
    let data = ledger_with_runs(3);
    let id = host("replay");
    let subject = format!("treewarden.{id}.events");
    // `ship` dies (abort, as abrupt as SIGKILL) after the stream acked the
    // batch and before the cursor moved.
    let (code, out) = ship(
        data.path(),
        &nats.url(),
        &id,
        &[("TREEWARDEN_TEST_CRASH_AT", "ship-acked")],
    );
    assert_eq!(code, None, "killed by its abort: {out}");
    let events = ledger_events(data.path());
    let want: Vec<i64> = events.iter().filter_map(|e| e["seq"].as_i64()).collect();
    assert_eq!(
        seqs(&read_subject(&nats.url(), &subject)),
        want,
        "acked before the crash"
    );
    assert_eq!(cursor(data.path()), Some(0), "the cursor did not move");
    // The replay: every event again, each a duplicate within the window.
    let (code, out) = ship(data.path(), &nats.url(), &id, &[]);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("shipped 0 events"), "all duplicates: {out}");
    assert_eq!(
        seqs(&read_subject(&nats.url(), &subject)),
        want,
        "no seq twice"
    );
    assert_eq!(cursor(data.path()), want.last().copied());
}

#[test]
fn a_replay_past_the_duplicate_window_resumes_without_storing_twice() {
    let Some(exe) = nats_server() else { return };
    let Some(nats) = Nats::start(&exe, 1) else {
        panic!("no JetStream server became ready");
    };
    // The operator's stream, made before any host ships, with a 1 s window.
    block_on(async {
        let client = connect(&nats.url()).await.expect("connect");
        jetstream::new(client)
            .create_stream(stream::Config {
                name: "TREEWARDEN".into(),
                subjects: vec!["treewarden.*.events".into()],
                storage: stream::StorageType::File,
                deny_delete: true,
                deny_purge: true,
                duplicate_window: Duration::from_secs(1),
                ..Default::default()
            })
            .await
            .expect("the stream");
    });
    let data = ledger_with_runs(2);
    let id = host("window");
    let subject = format!("treewarden.{id}.events");
    let (code, _) = ship(
        data.path(),
        &nats.url(),
        &id,
        &[("TREEWARDEN_TEST_CRASH_AT", "ship-acked")],
    );
    assert_eq!(code, None);
    let want: Vec<i64> = ledger_events(data.path())
        .iter()
        .filter_map(|e| e["seq"].as_i64())
        .collect();
    // Past the window the ids are forgotten: the server refuses the replay
    // by its expected sequence, and the shipper finds its own events there.
    // The window has passed once a probe id published after the shipper's
    // is no longer a duplicate (the server forgets ids in the order it
    // took them), on another host's subject of the same stream.
    let probe = |url: &str| {
        block_on(async {
            let js = jetstream::new(connect(url).await.expect("connect"));
            js.send_publish(
                format!("treewarden.{id}probe.events"),
                jetstream::message::PublishMessage::build()
                    .payload("probe".into())
                    .message_id("window-probe"),
            )
            .await
            .expect("publish")
            .await
            .expect("the probe is stored")
            .duplicate
        })
    };
    assert!(!probe(&nats.url()), "the probe's first publish is new");
    assert!(
        wait_until(Duration::from_secs(20), || !probe(&nats.url())),
        "the 1 s duplicate window never passed"
    );
    let (code, out) = ship(data.path(), &nats.url(), &id, &[]);
    assert_eq!(code, Some(0), "{out}");
    assert_eq!(
        seqs(&read_subject(&nats.url(), &subject)),
        want,
        "no seq twice"
    );
    assert_eq!(cursor(data.path()), want.last().copied());
}

#[test]
fn a_rewound_ledger_is_refused_by_the_server_and_counted() {
    let Some(exe) = nats_server() else { return };
    let Some(nats) = Nats::start(&exe, 1) else {
        panic!("no JetStream server became ready");
    };
    let id = host("rewind");
    let subject = format!("treewarden.{id}.events");
    let args = ["--ship", &nats.url(), "--ship-host-id", &id];
    let mut server = Server::start(&args);
    spawn_ended(&server, "before");
    let data = server.data_dir();
    assert!(
        wait_until(Duration::from_secs(30), || stream_matches_ledger(
            &nats.url(),
            &subject,
            &data
        )),
        "shipped; log: {}",
        server.stderr()
    );
    // An older copy, taken while it runs.
    let copy = server.dir.path().join("older.db");
    let status = Command::new(bin())
        .env("TREEWARDEN_DATA_DIR", &data)
        .arg("backup")
        .arg(&copy)
        .stdout(Stdio::null())
        .status()
        .expect("backup");
    assert!(status.success());
    spawn_ended(&server, "after");
    assert!(
        wait_until(Duration::from_secs(30), || stream_matches_ledger(
            &nats.url(),
            &subject,
            &data
        )),
        "shipped; log: {}",
        server.stderr()
    );
    let original = read_subject(&nats.url(), &subject);
    assert_eq!(server.terminate().and_then(|s| s.code()), Some(0));
    // The older copy comes back (in a fresh data dir) and writes on.
    let restored = Server::start_seeded(&copy, &args);
    spawn_ended(&restored, "forked");
    assert!(
        wait_until(Duration::from_secs(30), || metric(
            &restored,
            "treewarden_ship_refused_total"
        )
        .is_some_and(|n| n >= 1.0)),
        "the refusal is counted; log: {}",
        restored.stderr()
    );
    assert!(
        restored.stderr().contains("wrong last sequence"),
        "the server's refusal is logged: {}",
        restored.stderr()
    );
    // The stream is what the original ledger shipped, not one event more.
    let now = read_subject(&nats.url(), &subject);
    assert_eq!(seqs(&now), seqs(&original));
    let hashes =
        |s: &[Stored]| -> Vec<Value> { s.iter().map(|m| m.body["hash"].clone()).collect() };
    assert_eq!(hashes(&now), hashes(&original));
    assert!(
        metric(&restored, "treewarden_ship_lag_events").is_some_and(|n| n > 0.0),
        "the lag shows the events held back"
    );
    // `ship` on the same ledger says so with its own exit code.
    let (code, out) = ship(&restored.data_dir(), &nats.url(), &id, &[]);
    assert_eq!(code, Some(4), "{out}");
    assert!(out.contains("refused by the stream"), "{out}");
}

#[test]
fn a_stopped_server_blocks_no_spawn_and_shipping_resumes_from_the_cursor() {
    let Some(exe) = nats_server() else { return };
    let Some(mut nats) = Nats::start(&exe, 1) else {
        panic!("no JetStream server became ready");
    };
    let id = host("down");
    let subject = format!("treewarden.{id}.events");
    let server = Server::start(&["--ship", &nats.url(), "--ship-host-id", &id]);
    let data = server.data_dir();
    // Spawn latency with the server up, then down.
    let spawn_time = |label: &str| {
        let t = Instant::now();
        spawn_ended(&server, label);
        t.elapsed()
    };
    let up: Vec<Duration> = (0..5).map(|i| spawn_time(&format!("up-{i}"))).collect();
    assert!(
        wait_until(Duration::from_secs(30), || stream_matches_ledger(
            &nats.url(),
            &subject,
            &data
        )),
        "shipped; log: {}",
        server.stderr()
    );
    nats.nodes[0].stop();
    let down: Vec<Duration> = (0..5).map(|i| spawn_time(&format!("down-{i}"))).collect();
    let median = |v: &[Duration]| {
        let mut v = v.to_vec();
        v.sort();
        v[v.len() / 2]
    };
    say(&format!(
        "jetstream: spawn-to-ended median {:?} with the server up, {:?} with it down",
        median(&up),
        median(&down)
    ));
    assert!(
        median(&down) <= median(&up) * 3 + Duration::from_millis(250),
        "custody does not wait on shipping: up {up:?}, down {down:?}"
    );
    assert!(
        metric(&server, "treewarden_ship_lag_events").is_some_and(|n| n > 0.0),
        "the backlog shows while the server is down"
    );
    let held = cursor(&data).expect("cursor");
    let head = ledger_events(&data)
        .last()
        .and_then(|e| e["seq"].as_i64())
        .expect("head");
    assert!(
        held < head,
        "the cursor holds at {held} below the head {head}"
    );
    // Back on the same port and store: shipping resumes where it stopped.
    let exe = nats.exe.clone();
    nats.nodes[0].restart(&exe);
    shipped_everything(&server, &nats.url(), &subject, Duration::from_secs(60));
    let stored = seqs(&read_subject(&nats.url(), &subject));
    assert_eq!(
        stored.iter().collect::<BTreeSet<_>>().len(),
        stored.len(),
        "no seq twice"
    );
}

/// `treewarden fleet verify` on one host; its exit status and output.
fn fleet_verify(url: &str, id: &str) -> (Option<i32>, String) {
    let out = Command::new(bin())
        .args(["fleet", "verify", "--nats", url, id])
        .stdin(Stdio::null())
        .output()
        .expect("fleet verify");
    (
        out.status.code(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[test]
fn fleet_verify_proves_a_host_from_the_stream_and_names_a_forged_event() {
    let Some(exe) = nats_server() else { return };
    let Some(nats) = Nats::start(&exe, 1) else {
        panic!("no JetStream server became ready");
    };
    let data = ledger_with_runs(2);
    let id = host("fleet");
    let subject = format!("treewarden.{id}.events");
    let (code, out) = ship(data.path(), &nats.url(), &id, &[]);
    assert_eq!(code, Some(0), "{out}");
    let events = ledger_events(data.path());
    let (code, out) = fleet_verify(&nats.url(), &id);
    assert_eq!(code, Some(0), "an untouched stream verifies: {out}");
    assert!(
        out.contains(&format!("{} events from the stream", events.len())),
        "{out}"
    );
    // A forger with publish rights appends the next seq: linked to the real
    // head, a fresh message id in the shipper's form, the right expected
    // sequence, so the server takes it; its data is not what its hash says.
    let stored = read_subject(&nats.url(), &subject);
    let last = stored.last().expect("a shipped event");
    let mut forged = last.body.clone();
    let seq = last.body["seq"].as_i64().expect("seq") + 1;
    forged["seq"] = seq.into();
    forged["prev_hash"] = last.body["hash"].clone();
    forged["data"] = serde_json::json!({"forged": true});
    let hash = format!("{:064x}", 0xf0_u64);
    forged["hash"] = hash.clone().into();
    block_on(async {
        let js = jetstream::new(connect(&nats.url()).await.expect("connect"));
        js.send_publish(
            subject.clone(),
            jetstream::message::PublishMessage::build()
                .payload(serde_json::to_vec(&forged).expect("json").into())
                .message_id(format!("{id}:{seq}:{}", &hash[..16]))
                .expected_last_subject_sequence(last.stream_seq)
                .header("ce-id", format!("{id}:{seq}").as_str()),
        )
        .await
        .expect("publish")
        .await
        .expect("the server takes the forged event");
    });
    let (code, out) = fleet_verify(&nats.url(), &id);
    assert_eq!(code, Some(1), "the forged event fails: {out}");
    assert!(out.contains(&format!("seq {seq}")), "names the seq: {out}");
    // The host's own next event is refused by the server, not hidden.
    let status = Command::new(bin())
        .env("TREEWARDEN_DATA_DIR", data.path())
        .env("TREEWARDEN_BOUNDARY", "session")
        .args(["run", "--", "true"])
        .status()
        .expect("run");
    assert!(status.success());
    let (code, out) = ship(data.path(), &nats.url(), &id, &[]);
    assert_eq!(code, Some(4), "{out}");
}

#[test]
fn bad_shipping_flags_are_refused_with_one_line_and_exit_2() {
    let dir = tempfile::tempdir().expect("temp dir");
    let data = dir.path().join("data");
    let run = |args: &[&str]| {
        let out = Command::new(bin())
            .env("TREEWARDEN_DATA_DIR", &data)
            .env("TREEWARDEN_BOUNDARY", "session")
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("treewarden");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let one_line = |(code, err): (Option<i32>, String), what: &str| {
        assert_eq!(code, Some(2), "{err}");
        assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
        assert!(err.contains(what), "{what} in {err}");
    };
    one_line(
        run(&[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--ship",
            "http://127.0.0.1:4222",
        ]),
        "--ship: http://127.0.0.1:4222: a NATS server is nats://HOST:PORT",
    );
    one_line(
        run(&[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--ship",
            "nats://127.0.0.1:4222",
            "--ship-host-id",
            "a.b",
        ]),
        "NATS subject token",
    );
    // `ship` with no ledger creates none.
    one_line(run(&["ship", "nats://127.0.0.1:4222"]), "ledger");
    assert!(!data.join("ledger.db").exists());
}

#[test]
fn a_cluster_node_killed_mid_shipping_loses_and_duplicates_nothing() {
    let Some(exe) = nats_server() else { return };
    let Some(mut nats) = Nats::start(&exe, 3) else {
        panic!("the 3-node JetStream cluster did not form");
    };
    let id = host("node");
    let subject = format!("treewarden.{id}.events");
    let server = Server::start(&[
        "--ship",
        &nats.url(),
        "--ship-host-id",
        &id,
        "--ship-replicas",
        "3",
    ]);
    for i in 0..4 {
        spawn_ended(&server, &format!("before-{i}"));
    }
    // One node dies (SIGKILL) while events keep coming: a stream with three
    // replicas keeps its quorum; the shipper's client moves to a live node.
    nats.nodes[0].kill();
    for i in 0..8 {
        spawn_ended(&server, &format!("after-{i}"));
    }
    let live = nats.nodes[1..]
        .iter()
        .map(|n| format!("nats://127.0.0.1:{}", n.port))
        .collect::<Vec<_>>()
        .join(",");
    // Every event once, in order, on the surviving nodes.
    shipped_everything(&server, &live, &subject, Duration::from_secs(60));
    assert_eq!(metric(&server, "treewarden_ship_refused_total"), Some(0.0));
}

#[test]
fn fleet_verify_checks_a_sealed_hosts_seals_from_the_stream_alone() {
    let Some(exe) = nats_server() else { return };
    let Some(nats) = Nats::start(&exe, 1) else {
        panic!("no JetStream server became ready");
    };
    let data = ledger_with_runs(1);
    let cli = |args: &[&str]| {
        let out = Command::new(bin())
            .env("TREEWARDEN_DATA_DIR", data.path())
            .env("TREEWARDEN_BOUNDARY", "session")
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("treewarden");
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let printed = cli(&["seal", "setup", "--interval", "1s"]);
    let key = printed
        .lines()
        .map(str::trim)
        .find(|l| l.len() == 64 && l.chars().all(|c| c.is_ascii_hexdigit()))
        .unwrap_or_else(|| panic!("no key printed: {printed}"))
        .to_string();
    cli(&["run", "--", "true"]);
    // Sealed, not closed: the newest seal's freshness must be judged.
    assert!(
        wait_until(Duration::from_secs(10), || cli(&["seal", "now"])
            .contains("sealed epoch")),
        "epoch 0 was never sealed"
    );
    let id = host("sealed");
    let (code, out) = ship(data.path(), &nats.url(), &id, &[]);
    assert_eq!(code, Some(0), "{out}");
    // The stream carries no trailer: its seals are judged as of its last
    // event, with the key `seal setup` printed, and nothing else.
    let out = Command::new(bin())
        .args([
            "fleet",
            "verify",
            "--nats",
            &nats.url(),
            &id,
            "--seal-key",
            &key,
        ])
        .stdin(Stdio::null())
        .output()
        .expect("fleet verify");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(text.contains("sealed: epochs 0 to"), "{text}");
    // Another key is not the host's.
    let wrong = format!("{:064x}", 7);
    let out = Command::new(bin())
        .args([
            "fleet",
            "verify",
            "--nats",
            &nats.url(),
            &id,
            "--seal-key",
            &wrong,
        ])
        .stdin(Stdio::null())
        .output()
        .expect("fleet verify");
    assert_eq!(out.status.code(), Some(1), "a wrong key fails");
}
