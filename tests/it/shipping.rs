//! Shipping over OTLP (issue 15): `serve --ship-otlp URL` sends every
//! ledger event as an OTLP log record to URL/v1/logs, from a durable cursor;
//! a receiver that goes away for a while and comes back loses nothing.
//! The receiver here is a real HTTP/1.1 server on 127.0.0.1 that decodes
//! the protobuf with the OpenTelemetry project's own message types.

use std::collections::BTreeMap;
use std::io::{BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry_proto::tonic::collector::logs::v1::ExportLogsServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use prost::Message;
use serde_json::Value;

use crate::serve::Server;
use crate::util::{parse_ndjson, wait_until};

/// One received record: its attributes (as strings) and its body.
#[derive(Clone, Debug)]
struct Record {
    attrs: BTreeMap<String, String>,
    body: String,
}

type Got = Arc<Mutex<Vec<Record>>>;

/// An OTLP/HTTP receiver on a fixed port; `stop` closes the listener and
/// every open connection, so the port refuses until the next `start`.
struct Receiver {
    port: u16,
    stop: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<TcpStream>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

fn decode(body: &[u8]) -> Vec<Record> {
    let req = ExportLogsServiceRequest::decode(body).expect("an OTLP logs request");
    let text = |v: &Option<opentelemetry_proto::tonic::common::v1::AnyValue>| match v
        .as_ref()
        .and_then(|v| v.value.clone())
    {
        Some(AnyValue::StringValue(s)) => s,
        Some(AnyValue::IntValue(i)) => i.to_string(),
        other => format!("{other:?}"),
    };
    let mut out = Vec::new();
    for rl in req.resource_logs {
        for sl in rl.scope_logs {
            for r in sl.log_records {
                out.push(Record {
                    attrs: r
                        .attributes
                        .iter()
                        .map(|kv| (kv.key.clone(), text(&kv.value)))
                        .collect(),
                    body: text(&r.body),
                });
            }
        }
    }
    out
}

fn serve_conn(stream: TcpStream, got: Got) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
    let Ok(clone) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(clone);
    loop {
        let Some((path, body)) = crate::util::read_http_request(&mut reader) else {
            return;
        };
        if path == "/v1/logs" {
            got.lock().expect("lock").extend(decode(&body));
        }
        let mut w = &stream;
        if w.write_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n",
        )
        .is_err()
        {
            return;
        }
    }
}

impl Receiver {
    fn start(port: u16, got: Got) -> Receiver {
        let listener = TcpListener::bind(("127.0.0.1", port)).expect("bind the receiver");
        let port = listener.local_addr().expect("addr").port();
        let stop = Arc::new(AtomicBool::new(false));
        let conns: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let thread = {
            let (stop, conns) = (stop.clone(), conns.clone());
            std::thread::spawn(move || {
                for stream in listener.incoming() {
                    if stop.load(Ordering::SeqCst) {
                        return;
                    }
                    let Ok(stream) = stream else { continue };
                    if let Ok(c) = stream.try_clone() {
                        conns.lock().expect("lock").push(c);
                    }
                    let got = got.clone();
                    std::thread::spawn(move || serve_conn(stream, got));
                }
            })
        };
        Receiver {
            port,
            stop,
            conns,
            thread: Some(thread),
        }
    }

    fn stop(mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop, which then returns and drops the listener.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
        if let Some(t) = self.thread.take() {
            t.join().expect("receiver thread");
        }
        for c in self.conns.lock().expect("lock").drain(..) {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
    }
}

fn metric(server: &Server, name: &str) -> Option<i64> {
    let text = server.get("/metrics").text().ok()?;
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<f64>().ok())
        .map(|v| v as i64)
}

fn spawn_ended(server: &Server, label: &str) -> i64 {
    let (status, body) = server.post(
        "/api/trees",
        Some(&serde_json::json!({"argv": ["sh", "-c", "exit 7"], "label": label})),
    );
    assert_eq!(status, 201, "{body}");
    let id = body["id"].as_i64().expect("id");
    assert!(
        wait_until(Duration::from_secs(20), || {
            server
                .get(&format!("/api/trees/{id}"))
                .json::<Value>()
                .is_ok_and(|t| t["tree"]["state"] == "ended")
        }),
        "tree {id} ends"
    );
    id
}

#[test]
fn every_event_reaches_the_receiver_in_order_and_none_is_lost_while_it_is_down() {
    let got: Got = Arc::default();
    let receiver = Receiver::start(0, got.clone());
    let port = receiver.port;
    // The shipper's retries are logged at DEBUG: the test waits on them.
    let server = Server::start_with_env(
        &["--ship-otlp", &format!("http://127.0.0.1:{port}")],
        &[("TREEWARDEN_LOG", "info,treewarden::service::ship=debug")],
    );
    let seqs_of = |got: &Got, tree: Option<i64>| -> Vec<i64> {
        got.lock()
            .expect("lock")
            .iter()
            .filter(|r| tree.is_none_or(|t| r.attrs.get("tree") == Some(&t.to_string())))
            .filter_map(|r| r.attrs.get("seq").and_then(|s| s.parse().ok()))
            .collect()
    };

    // A new tree's events arrive, each with its attributes and its export line.
    let first = spawn_ended(&server, "shipped");
    let export = |server: &Server| parse_ndjson(&server.get("/api/export").text().expect("export"));
    let want: Vec<i64> = export(&server)
        .iter()
        .filter(|e| e["tree"].as_i64() == Some(first))
        .filter_map(|e| e["seq"].as_i64())
        .collect();
    assert!(
        wait_until(Duration::from_secs(20), || seqs_of(&got, Some(first))
            == want),
        "tree {first}'s events {want:?} arrive in order; got {:?}; log: {}",
        seqs_of(&got, Some(first)),
        server.stderr()
    );
    {
        let records = got.lock().expect("lock");
        let ended = records
            .iter()
            .find(|r| r.attrs.get("kind").map(String::as_str) == Some("tree.ended"))
            .expect("tree.ended shipped");
        let line: Value = serde_json::from_str(&ended.body).expect("the body is the event JSON");
        assert_eq!(
            line["data"]["exit"]["code"], 7,
            "the workload's own exit code"
        );
        assert_eq!(
            ended.attrs.get("hash"),
            line["hash"].as_str().map(String::from).as_ref()
        );
        assert!(ended.attrs.contains_key("host"));
    }

    // The receiver goes away; custody goes on; the lag shows.
    receiver.stop();
    let while_down: Vec<i64> = (0..3)
        .map(|i| spawn_ended(&server, &format!("down-{i}")))
        .collect();
    assert!(
        wait_until(Duration::from_secs(10), || metric(
            &server,
            "treewarden_ship_lag_events"
        )
        .is_some_and(|lag| lag > 0)),
        "the lag metric shows the events not yet shipped"
    );
    // Down for a while: until the shipper has failed and a retry (after
    // its backoff) has failed too.
    assert!(
        wait_until(Duration::from_secs(20), || {
            server
                .stderr()
                .contains("OTLP shipping: export failed again")
        }),
        "the shipper tried and failed while the receiver was down: {}",
        server.stderr()
    );
    assert!(seqs_of(&got, Some(while_down[0])).is_empty());

    // Back: everything arrives, none lost, in seq order per batch.
    let receiver = Receiver::start(port, got.clone());
    let head = export(&server)
        .last()
        .and_then(|e| e["seq"].as_i64())
        .expect("head");
    assert!(
        wait_until(Duration::from_secs(60), || {
            let mut s = seqs_of(&got, None);
            s.sort_unstable();
            s.dedup();
            s.len() as i64 >= head
        }),
        "every event up to {head} arrives; got {:?}",
        seqs_of(&got, None)
    );
    let mut all = seqs_of(&got, None);
    all.sort_unstable();
    all.dedup();
    assert_eq!(
        all[..head as usize],
        (1..=head).collect::<Vec<_>>()[..],
        "seq continuity: no event lost"
    );
    for id in &while_down {
        assert!(
            !seqs_of(&got, Some(*id)).is_empty(),
            "tree {id}'s events arrive"
        );
    }
    // Each record's body is exactly the event as the export has it.
    let by_seq: BTreeMap<i64, Value> = export(&server)
        .into_iter()
        .filter_map(|e| Some((e["seq"].as_i64()?, e)))
        .collect();
    for r in got.lock().expect("lock").iter() {
        let seq: i64 = r.attrs["seq"].parse().expect("seq");
        let body: Value = serde_json::from_str(&r.body).expect("json");
        assert_eq!(Some(&body), by_seq.get(&seq), "record {seq}");
    }
    assert!(
        wait_until(Duration::from_secs(20), || metric(
            &server,
            "treewarden_ship_lag_events"
        ) == Some(0)),
        "the lag returns to 0"
    );
    assert!(server.stderr().contains("the endpoint takes events again"));
    receiver.stop();
}

/// Seals are ledger events (issue 28): they ship with the rest, and the
/// collector's copy alone verifies with the key, off the host.
#[test]
fn seals_ship_with_the_events_and_the_shipped_copy_verifies_with_the_key() {
    let got: Got = Arc::default();
    let receiver = Receiver::start(0, got.clone());
    let server = Server::start(&[
        "--ship-otlp",
        &format!("http://127.0.0.1:{}", receiver.port),
    ]);
    // Set up while the service runs: its sealer picks the setup up.
    let out = std::process::Command::new(crate::util::bin())
        .arg("--data-dir")
        .arg(server.data_dir())
        .args(["seal", "setup", "--interval", "1s"])
        .env_remove("TREEWARDEN_DATA_DIR")
        .output()
        .expect("seal setup");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let key = String::from_utf8_lossy(&out.stdout).trim().to_string();
    spawn_ended(&server, "sealed");
    // The copy: the bodies by seq, contiguous from 1.
    let copy = || -> Vec<Value> {
        let by_seq: BTreeMap<i64, Value> = got
            .lock()
            .expect("lock")
            .iter()
            .filter_map(|r| {
                let v: Value = serde_json::from_str(&r.body).ok()?;
                Some((v["seq"].as_i64()?, v))
            })
            .collect();
        by_seq
            .into_iter()
            .enumerate()
            .take_while(|(i, (seq, _))| *seq == *i as i64 + 1)
            .map(|(_, (_, v))| v)
            .collect()
    };
    let shipped_seals = |events: &[Value]| {
        events
            .iter()
            .filter(|e| e["kind"] == "ledger.seal" && e["data"]["op"] == "seal")
            .count()
    };
    assert!(
        wait_until(Duration::from_secs(30), || shipped_seals(&copy()) >= 2),
        "the service's seals reach the collector: {}",
        server.stderr()
    );
    assert!(
        got.lock()
            .expect("lock")
            .iter()
            .any(|r| r.attrs.get("kind").map(String::as_str) == Some("ledger.seal")),
        "shipped as ledger.seal records"
    );
    let events = copy();
    // The collector stamps its copy with the time of the newest record it
    // holds (an export carries its own time: its last line).
    let at = events
        .last()
        .and_then(|e| e["at"].as_str())
        .expect("at")
        .to_string();
    let mut text = String::new();
    for e in &events {
        text.push_str(&serde_json::to_string(e).expect("json"));
        text.push('\n');
    }
    // The copy's trailer is sealed as the host's are (the collector holds
    // the verification key, so it can derive the key of the epoch after
    // the copy's newest seal): an unsealed one would not verify.
    let next_epoch = events
        .iter()
        .rev()
        .filter(|e| e["kind"] == "ledger.seal")
        .find_map(|e| e["data"]["epoch"].as_u64())
        .map_or(0, |e| e + 1);
    let mut epoch_key = crate::seal::key0(&key);
    for _ in 0..next_epoch {
        epoch_key = crate::seal::next_key(&epoch_key);
    }
    let mut stamp = serde_json::json!({"at": at, "events": events.len(), "epoch": next_epoch});
    stamp["mac"] = crate::seal::recipe_mac(&epoch_key, &stamp).into();
    text.push_str(&serde_json::json!({ "exported": stamp }).to_string());
    text.push('\n');
    let file = server.dir.path().join("collected.ndjson");
    std::fs::write(&file, &text).expect("write the copy");
    let out = std::process::Command::new(crate::util::bin())
        .args(["verify", "--seal-key", &key, "--export"])
        .arg(&file)
        .env_remove("TREEWARDEN_DATA_DIR")
        .env("TREEWARDEN_DATA_DIR", server.dir.path().join("not-here"))
        .output()
        .expect("verify");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "the shipped copy verifies: {stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("sealed: epochs 0 to"), "{stdout}");
    // Cut the copy's newest seal off: the copy says it holds more.
    let cut: Vec<&str> = text.lines().collect();
    let n = cut.len();
    let short = [&cut[..n - 2], &cut[n - 1..]].concat().join("\n");
    std::fs::write(&file, short + "\n").expect("write");
    let out = std::process::Command::new(crate::util::bin())
        .args(["verify", "--seal-key", &key, "--export"])
        .arg(&file)
        .output()
        .expect("verify");
    assert_eq!(out.status.code(), Some(1));
    receiver.stop();
}
