//! The shipped Alertmanager configuration (deploy/alertmanager/) run by a
//! real Alertmanager on loopback: for a fleet whose hosts are all scraped
//! as `127.0.0.1:7878` by node-local Prometheus servers and told apart by
//! their `host` label, one cause on one host pages once, and a cause on one
//! host silences nothing on another.
//!
//! The route and the inhibit rules are the file's own; the test only points
//! the receivers at its webhook and shortens the group waits (the timings
//! decide when a page leaves, not which alerts it holds).

use std::io::{BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};

use crate::serve::tool;
use crate::util::{KillOnDrop, read_http_request, skip, wait_until};

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// What the webhook received: each POST's path and JSON body.
type Received = Arc<Mutex<Vec<(String, Value)>>>;

/// A webhook receiver on 127.0.0.1:0.
fn webhook() -> (u16, Received) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind webhook");
    let port = listener.local_addr().expect("addr").port();
    let got = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&got);
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { return };
            let sink = Arc::clone(&sink);
            std::thread::spawn(move || serve_hook(conn, &sink));
        }
    });
    (port, got)
}

fn serve_hook(conn: TcpStream, sink: &Mutex<Vec<(String, Value)>>) {
    let mut out = conn.try_clone().expect("clone");
    let mut reader = BufReader::new(conn);
    while let Some((path, body)) = read_http_request(&mut reader) {
        let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        sink.lock().expect("sink").push((path, v));
        if out
            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            .is_err()
        {
            return;
        }
    }
}

/// A port nobody listens on now (bound, then let go).
fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

fn alert(host: &str, name: &str, severity: &str) -> Value {
    json!({
        "labels": {
            "alertname": name,
            "severity": severity,
            "host": host,
            "instance": "127.0.0.1:7878",
            "job": "treewarden",
        },
        "annotations": { "summary": format!("{name} on {host}") },
    })
}

/// (host, alert names) of every notification `receiver` got, each sorted.
fn pages(got: &Mutex<Vec<(String, Value)>>, receiver: &str) -> Vec<(String, Vec<String>)> {
    let got = got.lock().expect("sink");
    let mut out: Vec<(String, Vec<String>)> = got
        .iter()
        .filter(|(path, _)| path == &format!("/{receiver}"))
        .map(|(_, v)| {
            let host = v["groupLabels"]["host"].as_str().unwrap_or("").to_string();
            let mut names: Vec<String> = v["alerts"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .map(|x| x["labels"]["alertname"].as_str().unwrap_or("").to_string())
                        .collect()
                })
                .unwrap_or_default();
            names.sort();
            (host, names)
        })
        .collect();
    out.sort();
    out
}

#[test]
fn one_cause_pages_once_per_host_through_a_real_alertmanager() {
    let Some(am) = tool("prometheus-alertmanager").or_else(|| tool("alertmanager")) else {
        skip("Alertmanager not installed (Debian package prometheus-alertmanager)");
        return;
    };
    let shipped = std::fs::read_to_string(repo().join("deploy/alertmanager/alertmanager.yml"))
        .expect("shipped config");
    let (hook, got) = webhook();
    let dir = tempfile::tempdir().expect("temp dir");
    let config = shipped
        .replace(
            "http://127.0.0.1:9094/",
            &format!("http://127.0.0.1:{hook}/"),
        )
        .replace("group_wait: 90s", "group_wait: 3s")
        .replace("group_wait: 30s", "group_wait: 2s");
    assert_ne!(config, shipped, "the receivers were not re-pointed");
    let config_path = dir.path().join("alertmanager.yml");
    std::fs::write(&config_path, &config).expect("write config");
    if let Some(amtool) = tool("amtool") {
        let out = Command::new(amtool)
            .arg("check-config")
            .arg(repo().join("deploy/alertmanager/alertmanager.yml"))
            .output()
            .expect("amtool");
        assert!(
            out.status.success(),
            "amtool check-config: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let log = std::fs::File::create(dir.path().join("am.log")).expect("log");
    let _am = KillOnDrop(
        Command::new(am)
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!(
                "--storage.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            // No gossip: an empty address turns clustering off (its default
            // listens on every interface).
            .arg("--cluster.listen-address=")
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start alertmanager"),
    );
    let http = reqwest::blocking::Client::new();
    assert!(
        wait_until(Duration::from_secs(30), || {
            http.get(format!("{base}/-/ready"))
                .send()
                .is_ok_and(|r| r.status().is_success())
        }),
        "alertmanager not ready: {}",
        std::fs::read_to_string(dir.path().join("am.log")).unwrap_or_default()
    );

    // Host a: a ledger held locked (what once raised five pages in 75 s).
    // Host b: a kill that left survivors, dispatch closed. Host c: one
    // skipped kill with no closed dispatch, and an escape (a ticket).
    let first = json!([
        alert("a", "TreewardenLedgerWriteErrors", "page"),
        alert("a", "TreewardenKillAuthorizationsFailed", "page"),
        alert("a", "TreewardenKillsSkipped", "page"),
        alert("b", "TreewardenKillsSkipped", "page"),
        alert("b", "TreewardenSurvivorsAfterKill", "page"),
        alert("c", "TreewardenKillsSkipped", "page"),
        alert("c", "TreewardenEscapesObserved", "ticket"),
    ]);
    // The rules with `for: 1m` arrive a little later, as they do.
    let later = json!([
        alert("a", "TreewardenAmbiguousTree", "page"),
        alert("a", "TreewardenDispatchClosed", "page"),
        alert("b", "TreewardenAmbiguousTree", "page"),
        alert("b", "TreewardenDispatchClosed", "page"),
    ]);
    for batch in [&first, &later] {
        let r = http
            .post(format!("{base}/api/v2/alerts"))
            .json(batch)
            .send()
            .expect("post alerts");
        assert!(r.status().is_success(), "post: {}", r.status());
    }
    assert!(
        wait_until(Duration::from_secs(30), || pages(&got, "pager").len() >= 3
            && !pages(&got, "tickets").is_empty()),
        "pages: {:?}, tickets: {:?}",
        pages(&got, "pager"),
        pages(&got, "tickets")
    );
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    assert_eq!(
        pages(&got, "pager"),
        vec![
            ("a".to_string(), s(&["TreewardenLedgerWriteErrors"])),
            ("b".to_string(), s(&["TreewardenDispatchClosed"])),
            ("c".to_string(), s(&["TreewardenKillsSkipped"])),
        ],
        "one page per host, holding its cause only"
    );
    assert_eq!(
        pages(&got, "tickets"),
        vec![("c".to_string(), s(&["TreewardenEscapesObserved"]))]
    );
    // What Alertmanager itself says: host c's skipped kill is not muted by
    // a or b, and a's consequences name their inhibitor.
    let all: Value = http
        .get(format!("{base}/api/v2/alerts"))
        .send()
        .expect("get alerts")
        .json()
        .expect("alerts json");
    let muted = |host: &str, name: &str| {
        all.as_array()
            .expect("array")
            .iter()
            .find(|x| x["labels"]["host"] == host && x["labels"]["alertname"] == name)
            .map(|x| {
                x["status"]["inhibitedBy"]
                    .as_array()
                    .is_some_and(|a| !a.is_empty())
            })
            .unwrap_or_else(|| panic!("no {name} on {host}: {all}"))
    };
    assert!(!muted("c", "TreewardenKillsSkipped"));
    assert!(muted("a", "TreewardenKillsSkipped"));
    assert!(muted("a", "TreewardenDispatchClosed"));
    assert!(muted("b", "TreewardenSurvivorsAfterKill"));
    assert!(!muted("b", "TreewardenDispatchClosed"));
}
