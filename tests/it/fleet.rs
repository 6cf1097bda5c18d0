//! `treewarden fleet serve` against real `nats-server` processes (the
//! harness of `jetstream.rs`): real ledgers shipped by `treewarden ship`
//! under many host ids, one or two `fleet serve` consuming the stream, the
//! verdicts read from its `/metrics` and its dashboard.

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::jetstream::{
    Nats, host, ledger_with_runs, metric, nats_server, read_subject, ship, shipped_everything,
    spawn_ended, stream_matches_ledger,
};
use crate::util::{bin, wait_child, wait_until};

/// One `fleet serve` process, its pages' address, ended by its own pid.
struct FleetServe {
    child: Option<Child>,
    addr: String,
    log: PathBuf,
}

impl FleetServe {
    fn start(url: &str, data: &Path, consumer: &str) -> FleetServe {
        let log = data.join(format!("fleet-{}.log", rand_tag()));
        let mut child = Command::new(bin())
            .args(["fleet", "serve", "--nats", url, "--listen", "127.0.0.1:0"])
            .arg("--data")
            .arg(data)
            .args(["--consumer", consumer])
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).expect("log"))
            .spawn()
            .expect("fleet serve");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
            {
                if let Some(addr) = line.strip_prefix("fleet listening on http://") {
                    let _ = tx.send(addr.to_string());
                }
            }
        });
        let addr = rx
            .recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|_| {
                panic!(
                    "fleet serve never listened: {}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                )
            });
        FleetServe {
            child: Some(child),
            addr,
            log,
        }
    }

    fn get(&self, path: &str) -> String {
        reqwest::blocking::get(format!("http://{}{path}", self.addr))
            .and_then(|r| r.text())
            .unwrap_or_default()
    }

    /// `name{host="h"}` from `/metrics`.
    fn metric(&self, name: &str, host: &str) -> Option<f64> {
        metric_in(&self.get("/metrics"), name, host)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM by its own pid, then reaped: a clean stop exits 0.
    fn stop(&mut self) -> Option<i32> {
        let mut child = self.child.take()?;
        crate::util::signal(child.id(), rustix::process::Signal::TERM);
        match wait_child(&mut child, Duration::from_secs(20)) {
            Some(status) => status.code(),
            None => {
                let _ = child.kill();
                let _ = child.wait();
                None
            }
        }
    }
}

impl Drop for FleetServe {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn rand_tag() -> String {
    format!(
        "{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    )
}

/// A copy of `data`'s ledger in a data dir of its own under `parent`: the
/// same real events, shipped under another host id.
fn copy_ledger(data: &Path, parent: &Path, name: &str) -> PathBuf {
    let dir = parent.join(name);
    std::fs::create_dir_all(&dir).expect("data dir");
    let status = Command::new(bin())
        .env("TREEWARDEN_DATA_DIR", data)
        .arg("backup")
        .arg(dir.join("ledger.db"))
        .stdout(Stdio::null())
        .status()
        .expect("backup");
    assert!(status.success());
    dir
}

fn events_of(data: &Path) -> u64 {
    let out = Command::new(bin())
        .env("TREEWARDEN_DATA_DIR", data)
        .arg("export")
        .output()
        .expect("export");
    crate::util::parse_ndjson(&String::from_utf8_lossy(&out.stdout))
        .iter()
        .filter(|e| e.get("seq").is_some())
        .count() as u64
}

/// The host's `treewarden_fleet_NAME` in a `/metrics` scrape.
fn metric_in(scrape: &str, name: &str, host: &str) -> Option<f64> {
    let want = format!("treewarden_fleet_{name}{{host=\"{host}\"}} ");
    scrape
        .lines()
        .find_map(|l| l.strip_prefix(&want).and_then(|v| v.trim().parse().ok()))
}

/// Every host's messages in the index and walked (lag 0).
fn caught_up(fleet: &FleetServe, hosts: &[String], events: u64) -> bool {
    let text = fleet.get("/metrics");
    hosts.iter().all(|h| {
        let has = |name: &str, v: f64| {
            text.lines()
                .any(|l| l == format!("treewarden_fleet_{name}{{host=\"{h}\"}} {v}"))
        };
        has("events_indexed", events as f64) && has("lag_events", 0.0)
    })
}

#[test]
fn fifty_hosts_into_one_fleet_each_with_its_verdict_and_a_rechained_host_named() {
    let Some(exe) = nats_server() else { return };
    let Some(nats) = Nats::start(&exe, 1) else {
        panic!("no JetStream server became ready");
    };
    let started = Instant::now();
    let base = ledger_with_runs(2);
    let dirs = tempfile::tempdir().expect("temp dir");
    let n = 50;
    let hosts: Vec<String> = (0..n).map(|i| host(&format!("h{i:02}"))).collect();
    let mut datas = Vec::new();
    for h in &hosts {
        let data = copy_ledger(base.path(), dirs.path(), h);
        let (code, out) = ship(&data, &nats.url(), h, &[]);
        assert_eq!(code, Some(0), "{out}");
        datas.push(data);
    }
    let events = events_of(base.path());
    let fleet_dir = tempfile::tempdir().expect("temp dir");
    let fleet = FleetServe::start(&nats.url(), fleet_dir.path(), "fifty");
    assert!(
        wait_until(Duration::from_secs(60), || caught_up(
            &fleet, &hosts, events
        )),
        "every host indexed and walked; metrics: {}\nlog: {}",
        fleet.get("/metrics"),
        fleet.log()
    );
    for h in &hosts {
        assert_eq!(fleet.metric("chain_broken", h), Some(0.0), "{h}");
    }
    let page = fleet.get("/");
    for h in &hosts {
        assert!(
            page.contains(&format!("id=\"host-{h}\"")),
            "{h} is on the dashboard"
        );
    }
    assert_eq!(page.matches("outcome outcome-ok").count(), n, "{page}");

    // One host rewrites an event of its ledger and re-chains every later
    // one (a forger holding the file), then goes on working and shipping:
    // the server's sequence check cannot see it (the next seq follows the
    // stream's), the fleet's walk does.
    let bad = &hosts[7];
    let data = &datas[7];
    {
        let conn = crate::rules::forger(data, &["events_no_update"]);
        conn.execute(
            "UPDATE events SET data = json_set(data, '$.forged', 1) WHERE seq = 2",
            [],
        )
        .expect("rewrite an event");
        crate::rules::rechain(&conn, 2);
    }
    let status = Command::new(bin())
        .env("TREEWARDEN_DATA_DIR", data)
        .env("TREEWARDEN_BOUNDARY", "session")
        .args(["run", "--", "true"])
        .status()
        .expect("run");
    assert!(status.success());
    let (code, out) = ship(data, &nats.url(), bad, &[]);
    assert_eq!(code, Some(0), "the server takes it: {out}");
    let next = events + 1;
    assert!(
        wait_until(Duration::from_secs(30), || fleet
            .metric("chain_broken", bad)
            == Some(1.0)),
        "the re-chained host is a break; log: {}",
        fleet.log()
    );
    let page = fleet.get(&format!("/?host={bad}"));
    assert!(
        page.contains(&format!("data-seq=\"{next}\"")),
        "the break names seq {next}: {page}"
    );
    assert!(
        fleet
            .log()
            .contains(&format!("host {bad}'s chain is broken")),
        "the log names the host"
    );
    for h in hosts.iter().filter(|h| *h != bad) {
        assert_eq!(
            fleet.metric("chain_broken", h),
            Some(0.0),
            "{h} stays whole"
        );
    }
    crate::util::say(&format!(
        "fleet: {n} hosts × {events} events shipped, indexed and walked, a re-chained host named, in {:.1} s",
        started.elapsed().as_secs_f64()
    ));
    let mut fleet = fleet;
    assert_eq!(fleet.stop(), Some(0), "a clean stop: {}", fleet.log());
}

#[test]
fn two_fleet_serves_sharing_a_consumer_index_every_event_once() {
    let Some(exe) = nats_server() else { return };
    let Some(nats) = Nats::start(&exe, 3) else {
        panic!("no JetStream cluster became ready");
    };
    let base = ledger_with_runs(3);
    let events = events_of(base.path());
    let dirs = tempfile::tempdir().expect("temp dir");
    let fleet_dir = tempfile::tempdir().expect("temp dir");
    let hosts: Vec<String> = (0..20).map(|i| host(&format!("s{i:02}"))).collect();
    // The first host makes the stream; both instances then consume it.
    let first = copy_ledger(base.path(), dirs.path(), &hosts[0]);
    let (code, out) = ship(&first, &nats.url(), &hosts[0], &[]);
    assert_eq!(code, Some(0), "{out}");
    let a = FleetServe::start(&nats.url(), fleet_dir.path(), "shared");
    let b = FleetServe::start(&nats.url(), fleet_dir.path(), "shared");
    for h in &hosts[1..] {
        let data = copy_ledger(base.path(), dirs.path(), h);
        let (code, out) = ship(&data, &nats.url(), h, &[]);
        assert_eq!(code, Some(0), "{out}");
    }
    assert!(
        wait_until(Duration::from_secs(60), || caught_up(&a, &hosts, events)
            && caught_up(&b, &hosts, events)),
        "both see every host walked; a: {}\nb: {}",
        a.log(),
        b.log()
    );
    // Each message was received by one instance, once.
    let received = |f: &FleetServe| -> Vec<f64> {
        hosts
            .iter()
            .map(|h| f.metric("events_received", h).unwrap_or(0.0))
            .collect()
    };
    let (ra, rb) = (received(&a), received(&b));
    for (i, h) in hosts.iter().enumerate() {
        assert_eq!(
            ra[i] + rb[i],
            events as f64,
            "{h}: {} by a, {} by b",
            ra[i],
            rb[i]
        );
        assert_eq!(a.metric("chain_broken", h), Some(0.0), "{h}");
    }
    let (ta, tb): (f64, f64) = (ra.iter().sum(), rb.iter().sum());
    crate::util::say(&format!(
        "fleet: two instances on one consumer: {ta} and {tb} of {} messages",
        events * hosts.len() as u64
    ));
    // The stream holds each event once, too.
    let stored = read_subject(&nats.url(), &format!("treewarden.{}.events", hosts[3]));
    assert_eq!(stored.len() as u64, events);
}

/// `treewarden` on a data dir; its stdout (a failure fails the test).
fn cli(data: &Path, args: &[&str]) -> String {
    let out = Command::new(bin())
        .env("TREEWARDEN_DATA_DIR", data)
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
}

#[test]
fn a_sealed_host_with_its_key_registered_a_force_kill_linked_and_a_rebuild() {
    let Some(exe) = nats_server() else { return };
    let Some(nats) = Nats::start(&exe, 1) else {
        panic!("no JetStream server became ready");
    };
    let data = tempfile::tempdir().expect("temp dir");
    let printed = cli(data.path(), &["seal", "setup", "--interval", "1s"]);
    let key = printed
        .lines()
        .map(str::trim)
        .find(|l| l.len() == 64 && l.chars().all(|c| c.is_ascii_hexdigit()))
        .unwrap_or_else(|| panic!("no key printed: {printed}"))
        .to_string();
    // A root that ignores SIGTERM past a short grace: a force-kill.
    let _ = Command::new(bin())
        .env("TREEWARDEN_DATA_DIR", data.path())
        .env("TREEWARDEN_BOUNDARY", "session")
        .args([
            "run",
            "--timeout",
            "1s",
            "--grace",
            "200ms",
            "--quiet",
            "--",
        ])
        .args(["sh", "-c", "trap '' TERM; sleep 30"])
        .stdin(Stdio::null())
        .status()
        .expect("run");
    assert!(
        wait_until(Duration::from_secs(10), || cli(
            data.path(),
            &["seal", "now"]
        )
        .contains("sealed epoch")),
        "epoch 0 was never sealed"
    );
    let id = host("sealed-fleet");
    let (code, out) = ship(data.path(), &nats.url(), &id, &[]);
    assert_eq!(code, Some(0), "{out}");
    let events = events_of(data.path());

    // `fleet verify --since`: the whole walk, the recent events counted.
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
        .args(["--since", "1h", "--json"])
        .output()
        .expect("fleet verify");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(v["since"]["events"], serde_json::json!(events), "{v}");
    assert_eq!(v["events"], serde_json::json!(events), "{v}");

    let fleet_dir = tempfile::tempdir().expect("temp dir");
    let key_file = fleet_dir.path().join("host.key");
    std::fs::write(&key_file, format!("{key}\n")).expect("key file");
    let fleet_data = fleet_dir.path().join("fleet");
    let fleet_data_s = fleet_data.to_string_lossy().to_string();
    let key_s = key_file.to_string_lossy().to_string();
    cli(
        data.path(),
        &[
            "fleet",
            "hosts",
            "add",
            "--data",
            &fleet_data_s,
            &id,
            "--seal-key",
            &key_s,
        ],
    );
    let listed = cli(
        data.path(),
        &["fleet", "hosts", "ls", "--data", &fleet_data_s],
    );
    assert!(
        listed.contains(&id) && !listed.contains(&key),
        "the key is never shown: {listed}"
    );

    let mut fleet = FleetServe::start(&nats.url(), &fleet_data, "sealed");
    let hosts = [id.clone()];
    assert!(
        wait_until(Duration::from_secs(30), || caught_up(
            &fleet, &hosts, events
        )),
        "walked; metrics: {}\nlog: {}",
        fleet.get("/metrics"),
        fleet.log()
    );
    assert_eq!(
        fleet.metric("chain_broken", &id),
        Some(0.0),
        "{}",
        fleet.log()
    );
    assert!(
        fleet.metric("seal_age_seconds", &id).is_some(),
        "the seal was checked"
    );
    let page = fleet.get("/?outcome=force-kill");
    let link = format!("/hosts/{id}/trees/1");
    assert!(
        page.contains(&link),
        "the force-kill links its tree: {page}"
    );
    let tree = fleet.get(&link);
    assert!(tree.contains("kill.authorized"), "{tree}");
    assert_eq!(fleet.stop(), Some(0));

    // A wrong key is a break, once the verdict is computed again.
    let wrong = fleet_dir.path().join("wrong.key");
    std::fs::write(&wrong, format!("{:064x}\n", 7)).expect("key file");
    let wrong_s = wrong.to_string_lossy().to_string();
    cli(
        data.path(),
        &[
            "fleet",
            "hosts",
            "add",
            "--data",
            &fleet_data_s,
            &id,
            "--seal-key",
            &wrong_s,
        ],
    );
    // Rebuilt from the stream: the same events, walked with the new key.
    let out = Command::new(bin())
        .args([
            "fleet",
            "rebuild",
            "--nats",
            &nats.url(),
            "--data",
            &fleet_data_s,
        ])
        .args(["--consumer", "sealed"])
        .output()
        .expect("rebuild");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let fleet = FleetServe::start(&nats.url(), &fleet_data, "sealed");
    assert!(
        wait_until(Duration::from_secs(30), || fleet
            .metric("chain_broken", &id)
            == Some(1.0)),
        "a wrong key fails the seals; log: {}",
        fleet.log()
    );
    assert_eq!(fleet.metric("events_indexed", &id), Some(events as f64));
}

#[test]
fn no_quorum_for_30_s_holds_the_cursor_grows_the_lag_and_every_event_arrives_once() {
    let Some(exe) = nats_server() else { return };
    let Some(mut nats) = Nats::start(&exe, 3) else {
        panic!("the 3-node JetStream cluster did not form");
    };
    let url = nats.url();
    let id = host("quorum");
    let subject = format!("treewarden.{id}.events");
    let server = crate::serve::Server::start(&[
        "--ship",
        &url,
        "--ship-host-id",
        &id,
        "--ship-replicas",
        "3",
    ]);
    for i in 0..3 {
        spawn_ended(&server, &format!("before-{i}"));
    }
    let data = server.data_dir();
    assert!(
        wait_until(Duration::from_secs(60), || stream_matches_ledger(
            &url, &subject, &data
        )),
        "shipped; log: {}",
        server.stderr()
    );
    let fleet_dir = tempfile::tempdir().expect("temp dir");
    let fleet = FleetServe::start(&url, fleet_dir.path(), "quorum");
    let acked = metric(&server, "treewarden_ship_acked_seq").expect("acked seq");
    // Two of three nodes stop: no quorum for the stream. Custody goes on.
    nats.nodes[1].stop();
    nats.nodes[2].stop();
    let stopped = Instant::now();
    let mut trees = 0;
    let mut lag_seen = 0.0_f64;
    while stopped.elapsed() < Duration::from_secs(30) {
        spawn_ended(&server, &format!("during-{trees}"));
        trees += 1;
        lag_seen = lag_seen.max(metric(&server, "treewarden_ship_lag_events").unwrap_or(0.0));
    }
    assert!(trees > 0);
    assert_eq!(
        metric(&server, "treewarden_ship_acked_seq"),
        Some(acked),
        "the cursor holds without a quorum"
    );
    let lag_then = metric(&server, "treewarden_ship_lag_events").unwrap_or(0.0);
    assert!(
        lag_then > 0.0 && lag_then >= lag_seen,
        "the lag grew: {lag_then}"
    );
    nats.nodes[1].restart(&nats.exe);
    nats.nodes[2].restart(&nats.exe);
    shipped_everything(&server, &url, &subject, Duration::from_secs(120));
    // The ledger is live (a tree's last events can follow its end), so the
    // fleet is held to the ledger's count at each look, and what it stored
    // to what its index holds, both read from one scrape.
    let hosts = [id.clone()];
    let mut events = 0;
    assert!(
        wait_until(Duration::from_secs(90), || {
            events = events_of(&data);
            caught_up(&fleet, &hosts, events)
        }),
        "the fleet catches up to {events} events; metrics: {}\nlog: {}",
        fleet.get("/metrics"),
        fleet.log()
    );
    let scrape = fleet.get("/metrics");
    let value = |name: &str| metric_in(&scrape, name, &id).unwrap_or(0.0);
    // Stored once each. Received may count more: a message delivered while
    // the consumer had no quorum can have its ack lost and come again.
    let indexed = value("events_indexed");
    assert!(indexed >= events as f64, "indexed {indexed} of {events}");
    assert_eq!(value("events_indexed_here"), indexed, "each stored once");
    let received = value("events_received");
    assert!(received >= indexed, "received {received} of {indexed}");
    assert_eq!(fleet.metric("chain_broken", &id), Some(0.0));
    crate::util::say(&format!(
        "fleet: no quorum for 30 s: {trees} trees spawned meanwhile, lag peaked at {lag_then} events, {events} events in the stream once each, {received} deliveries to the fleet"
    ));
}
