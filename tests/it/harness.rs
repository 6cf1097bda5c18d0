//! The API a harness needs (issue 25), against the real `serve`: a
//! machine-readable `code` in every error body, `GET /api/trees/{id}/wait`
//! (a long poll woken by the tree's end) and its typed `outcome`, the followed
//! log, the per-tree event stream, the label and state filters of the tree
//! list, `first_signal`, the grace cap (`--max-grace`) and numeric users.
//!
//! Trees end on a condition the test controls: each blocks reading a FIFO
//! in the test's temp dir, and ends when the test writes to it. Every tree
//! carries the server's marker, so nothing outlives a test (`Server`'s
//! `Drop` ends what is marked).

use std::io::Read;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::serve::Server;
use crate::util::{is_root, say, scaled, skip, wait_until};

fn mkfifo(dir: &Path, name: &str) -> PathBuf {
    let p = dir.join(name);
    rustix::fs::mkfifoat(rustix::fs::CWD, &p, rustix::fs::Mode::from_raw_mode(0o600))
        .expect("mkfifo");
    p
}

/// Opens the FIFO for writing (the tree's `read` then returns): the tree's
/// root exits.
fn release(fifo: &Path) {
    std::fs::write(fifo, "go\n").expect("write the fifo");
}

/// A body whose tree blocks until `fifo` is written.
fn blocked(s: &Server, fifo: &Path, label: &str) -> Value {
    let mut b = s.body(&format!("read x < '{}'", fifo.display()));
    b["label"] = json!(label);
    b
}

fn spawn(s: &Server, body: &Value) -> i64 {
    let (status, v) = s.post("/api/trees", Some(body));
    assert_eq!(status, 201, "spawn answered {v}; log: {}", s.stderr());
    v["id"].as_i64().expect("tree id")
}

fn get(s: &Server, path: &str) -> (u16, Value) {
    let r = s.get(path);
    let status = r.status().as_u16();
    (status, r.json().unwrap_or(Value::Null))
}

#[test]
fn every_error_body_names_its_code_beside_its_message() {
    let s = Server::start(&["--max-grace", "2s"]);
    let cases: Vec<(u16, Value, &str)> = vec![
        {
            let (st, v) = get(&s, "/api/trees/999999");
            (st, v, "NotFound")
        },
        {
            let (st, v) = get(&s, "/api/trees/abc");
            (st, v, "BadRequest")
        },
        {
            let (st, v) = get(&s, "/api/no-such-endpoint");
            (st, v, "NotFound")
        },
        {
            // Over the operator's cap: one clear refusal, with the code.
            let mut b = s.body("exit 0");
            b["grace"] = json!("3s");
            let (st, v) = s.post("/api/trees", Some(&b));
            (st, v, "BadRequest")
        },
        {
            let mut b = s.body("exit 0");
            b["first_signal"] = json!("KILL");
            let (st, v) = s.post("/api/trees", Some(&b));
            (st, v, "BadRequest")
        },
        {
            let r = s.get_anon("/api/trees");
            let st = r.status().as_u16();
            (st, r.json().unwrap_or(Value::Null), "Unauthorized")
        },
    ];
    for (status, body, code) in cases {
        assert!(status >= 400, "{body}");
        assert_eq!(body["code"], code, "status {status}: {body}");
        assert!(
            body["error"].as_str().is_some_and(|e| !e.is_empty()),
            "{body}"
        );
    }
    let (st, v) = {
        let mut b = s.body("exit 0");
        b["grace"] = json!("3s");
        s.post("/api/trees", Some(&b))
    };
    assert_eq!(st, 422);
    assert!(
        v["error"]
            .as_str()
            .is_some_and(|e| e.contains("--max-grace")),
        "{v}"
    );
    // The document lists the codes.
    let (_, doc) = get(&s, "/api/openapi.json");
    let codes = &doc["components"]["schemas"]["ErrorCode"]["enum"];
    for c in [
        "DispatchClosed",
        "Ambiguous",
        "Forbidden",
        "NotFound",
        "BadRequest",
        "Unavailable",
    ] {
        assert!(
            codes.as_array().is_some_and(|a| a.contains(&json!(c))),
            "{c} not in {codes}"
        );
    }
}

#[test]
fn wait_answers_as_soon_as_the_tree_ends_and_at_its_timeout_otherwise() {
    let s = Server::start(&[]);
    let fifo = mkfifo(s.dir.path(), "release");
    let id = spawn(&s, &blocked(&s, &fifo, "wait"));
    // At its timeout, the tree as it stands.
    let t0 = Instant::now();
    let (st, v) = get(&s, &format!("/api/trees/{id}/wait?timeout=300ms"));
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["state"], "running", "{v}");
    assert_eq!(v["outcome"], Value::Null, "no outcome while it runs: {v}");
    assert!(
        t0.elapsed() >= Duration::from_millis(300),
        "{:?}",
        t0.elapsed()
    );
    // Held, then answered as the tree ends.
    let (tx, rx) = mpsc::channel();
    let url = s.url(&format!("/api/trees/{id}/wait?timeout=30s"));
    let token = s.token.clone();
    let waiter = std::thread::spawn(move || {
        let r = reqwest::blocking::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(60))
            .build()
            .expect("client")
            .get(url)
            .bearer_auth(token)
            .send()
            .expect("wait");
        let v: Value = r.json().expect("json");
        tx.send((Instant::now(), v)).expect("send");
    });
    // The request is held while the tree runs: no answer before it ends.
    assert!(
        rx.recv_timeout(Duration::from_millis(500)).is_err(),
        "the wait answered while the tree ran"
    );
    let released = Instant::now();
    release(&fifo);
    let (answered, v) = rx
        .recv_timeout(scaled(Duration::from_secs(10)))
        .expect("wait answered");
    waiter.join().expect("waiter");
    assert_eq!(v["state"], "ended", "{v}");
    assert_eq!(v["exit"]["code"], 0, "{v}");
    assert_eq!(v["outcome"]["kind"], "exited", "{v}");
    assert_eq!(v["outcome"]["forced"], Value::Null, "{v}");
    let latency = answered.duration_since(released);
    say(&format!(
        "wait answered {} ms after the tree's release",
        latency.as_millis()
    ));
    assert!(latency < scaled(Duration::from_secs(2)), "{latency:?}");
    // Over the bound: refused with the code.
    let (st, v) = get(&s, &format!("/api/trees/{id}/wait?timeout=10m"));
    assert_eq!((st, v["code"].as_str()), (400, Some("BadRequest")), "{v}");
}

#[test]
fn a_timeout_and_a_kill_end_alike_and_are_told_apart_by_the_typed_outcome() {
    let s = Server::start(&[]);
    let mut timed = s.body("exec sleep 600");
    timed["timeout"] = json!("300ms");
    timed["grace"] = json!("200ms");
    let timed = spawn(&s, &timed);
    let mut killed = s.body("exec sleep 600");
    killed["grace"] = json!("200ms");
    let killed = spawn(&s, &killed);
    let (st, k) = s.post(&format!("/api/trees/{killed}/kill"), None);
    assert_eq!(st, 200, "{k}");
    let (_, t) = get(&s, &format!("/api/trees/{timed}/wait?timeout=30s"));
    let (_, k) = get(&s, &format!("/api/trees/{killed}/wait?timeout=30s"));
    // The same status: the root ended by the first signal, both times.
    assert_eq!(t["exit"], k["exit"], "{t} {k}");
    assert_eq!(t["exit"]["signal"], 15, "{t}");
    assert_eq!(t["outcome"]["kind"], "timed_out", "{t}");
    assert_eq!(t["outcome"]["by"], Value::Null, "{t}");
    assert_eq!(k["outcome"]["kind"], "killed", "{k}");
    assert!(
        k["outcome"]["by"]
            .as_str()
            .is_some_and(|b| b.starts_with("token ") || b.starts_with("uid ")),
        "the kill names who asked: {k}"
    );
    assert!(s.marked().is_empty(), "{:?}", s.marked());
}

#[test]
fn a_followed_log_streams_each_write_once_and_ends_with_the_tree() {
    let s = Server::start(&[]);
    let fifo = mkfifo(s.dir.path(), "second");
    let id = spawn(
        &s,
        &s.body(&format!(
            "echo first; read x < '{}'; echo second",
            fifo.display()
        )),
    );
    let mut r = s.get(&format!("/api/trees/{id}/log?follow=1"));
    assert_eq!(r.status(), 200);
    // The first line arrives while the tree still runs (blocked on the
    // FIFO): the answer is a stream, not a read of the log at its end.
    let mut got = Vec::new();
    let mut buf = [0u8; 64];
    while !got.ends_with(b"first\n") {
        let n = r.read(&mut buf).expect("read the stream");
        assert!(n > 0, "the stream ended before the first line: {got:?}");
        got.extend_from_slice(&buf[..n]);
    }
    let released = Instant::now();
    release(&fifo);
    // The rest, once, and the stream ends by itself with the tree.
    r.read_to_end(&mut got).expect("the stream ends");
    say(&format!(
        "a followed log ended {} ms after its tree's release",
        released.elapsed().as_millis()
    ));
    assert_eq!(String::from_utf8_lossy(&got), "first\nsecond\n");
    // With `tail`, as `tail -n 1 -f`: the last line, then the end (the
    // tree is over).
    let mut r = s.get(&format!("/api/trees/{id}/log?follow=1&tail=1"));
    assert_eq!(r.status(), 200);
    let mut last = String::new();
    r.read_to_string(&mut last).expect("the stream ends");
    assert_eq!(last, "second\n");
}

#[test]
fn one_trees_stream_carries_only_its_events_and_ends_with_it() {
    let s = Server::start(&[]);
    let other = spawn(&s, &s.body("exit 0"));
    let id = spawn(&s, &s.body("exit 3"));
    let mut r = s.get(&format!("/api/events/stream?tree={id}"));
    assert_eq!(r.status(), 200);
    // The stream ends by itself once the tree has ended (bounded by the
    // client's timeout if it did not).
    let mut text = String::new();
    r.read_to_string(&mut text).expect("the stream ends");
    let events: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(|d| serde_json::from_str(d).expect("event json"))
        .collect();
    assert!(!events.is_empty(), "{text}");
    assert!(events.iter().all(|e| e["tree"] == id), "{text}");
    assert!(events.iter().all(|e| e["tree"] != other));
    let kinds: Vec<&str> = events.iter().filter_map(|e| e["kind"].as_str()).collect();
    assert_eq!(kinds.first(), Some(&"tree.created"), "{kinds:?}");
    assert!(kinds.contains(&"tree.ended"), "{kinds:?}");
    // Each item as the document describes it: `id` the seq, `event` the kind.
    let ids: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("id: "))
        .collect();
    assert_eq!(ids.len(), events.len());
    for (i, e) in ids.iter().zip(&events) {
        assert_eq!(i.parse::<i64>().ok(), e["seq"].as_i64());
    }
    let (st, v) = get(&s, "/api/events/stream?tree=999999");
    assert_eq!((st, v["code"].as_str()), (404, Some("NotFound")), "{v}");
}

#[test]
fn the_tree_list_filters_by_label_and_liveness_in_one_request() {
    let s = Server::start(&[]);
    let fifo_a = mkfifo(s.dir.path(), "a");
    let fifo_b = mkfifo(s.dir.path(), "b");
    let a = spawn(&s, &blocked(&s, &fifo_a, "call a&b=1"));
    let b = spawn(&s, &blocked(&s, &fifo_b, "call-b"));
    let ids = |path: &str| -> Vec<i64> {
        let (st, v) = get(&s, path);
        assert_eq!(st, 200, "{path}: {v}");
        v.as_array()
            .expect("list")
            .iter()
            .filter_map(|t| t["id"].as_i64())
            .collect()
    };
    assert_eq!(ids("/api/trees?label=call%20a%26b%3D1&alive=1"), vec![a]);
    assert_eq!(ids("/api/trees?label=call-b"), vec![b]);
    assert_eq!(ids("/api/trees?state=running&label=call-b"), vec![b]);
    release(&fifo_a);
    assert!(
        wait_until(Duration::from_secs(10), || ids(
            "/api/trees?label=call%20a%26b%3D1&alive=1"
        )
        .is_empty()),
        "tree {a} still listed alive"
    );
    assert_eq!(ids("/api/trees?label=call%20a%26b%3D1&alive=0"), vec![a]);
    assert_eq!(
        ids("/api/trees?label=call%20a%26b%3D1&state=ended"),
        vec![a]
    );
    let (st, v) = get(&s, "/api/trees?state=sleeping");
    assert_eq!((st, v["code"].as_str()), (400, Some("BadRequest")), "{v}");
    release(&fifo_b);
}

#[test]
fn first_signal_is_the_one_the_teardown_sends_first() {
    let s = Server::start(&[]);
    let got = s.dir.path().join("got");
    // The root records the signal it gets and exits (`wait` returns at a
    // trapped signal); its background child ignores SIGTERM and, as a
    // background job of a shell, SIGINT: it is force-killed.
    let mut b = s.body(&format!(
        "trap 'echo INT > \"{got}\"; exit 0' INT; trap '' TERM; sleep 1000 & wait",
        got = got.display()
    ));
    b["first_signal"] = json!("INT");
    b["grace"] = json!("500ms");
    let id = spawn(&s, &b);
    let (st, k) = s.post(&format!("/api/trees/{id}/kill"), None);
    assert_eq!(st, 200, "{k}");
    assert_eq!(k["state"], "ended", "{k}");
    assert!(k["force_killed"].as_u64() >= Some(1), "{k}");
    assert_eq!(
        std::fs::read_to_string(&got).ok().as_deref(),
        Some("INT\n"),
        "the root did not get SIGINT: {k}"
    );
    let (_, detail) = get(&s, &format!("/api/trees/{id}"));
    let first = detail["signals"]
        .as_array()
        .and_then(|a| a.first())
        .cloned()
        .unwrap_or(Value::Null);
    assert_eq!(first["signal"], "SIGINT", "{detail}");
    assert_eq!(detail["tree"]["first_signal"], "SIGINT", "{detail}");
    assert!(s.marked().is_empty(), "{:?}", s.marked());
}

#[test]
fn a_numeric_user_is_a_uid() {
    if !is_root() {
        skip("a_numeric_user_is_a_uid: naming a user needs the service to run as root");
        return;
    }
    let s = Server::start(&[]);
    let mut b = s.body("exit 0");
    b["user"] = json!("0");
    let (st, v) = s.post("/api/trees", Some(&b));
    assert_eq!(st, 201, "{v}");
    assert_eq!(v["run_uid"], 0, "{v}");
    // A uid the user database does not know runs as that uid.
    let mut b = s.body("id -u > \"$TW_OUT\"");
    let out = s.dir.path().join("uid");
    std::fs::set_permissions(
        s.dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .expect("chmod");
    b["user"] = json!("54321");
    b["cwd"] = json!("/");
    b["env"]["TW_OUT"] = json!(out.display().to_string());
    let (st, v) = s.post("/api/trees", Some(&b));
    assert_eq!(st, 201, "{v}");
    let id = v["id"].as_i64().expect("id");
    let (_, t) = get(&s, &format!("/api/trees/{id}/wait?timeout=20s"));
    assert_eq!(t["state"], "ended", "{t}");
    assert_eq!(t["run_uid"], 54321, "{t}");
    assert_eq!(
        std::fs::read_to_string(&out).ok().as_deref(),
        Some("54321\n")
    );
}

#[test]
fn stdio_descriptors_pass_only_over_the_socket_and_must_match_the_header() {
    let s = Server::start(&[]);
    let r = reqwest::blocking::Client::builder()
        .no_proxy()
        .build()
        .expect("client")
        .post(s.url("/api/trees"))
        .bearer_auth(&s.token)
        .header("Treewarden-Stdio", "stdin")
        .json(&s.body("exit 0"))
        .send()
        .expect("POST");
    assert_eq!(r.status(), 400);
    let v: Value = r.json().expect("json");
    assert_eq!(v["code"], "BadRequest", "{v}");
    assert!(
        v["error"]
            .as_str()
            .is_some_and(|e| e.contains("Unix socket")),
        "{v}"
    );
    // Nothing was spawned.
    let (_, trees) = get(&s, "/api/trees?all=1");
    assert_eq!(trees.as_array().map(Vec::len), Some(0), "{trees}");
}

/// One request on the service's Unix socket, its first bytes sent with
/// `fds` (SCM_RIGHTS); the raw answer (status line, headers, body).
fn socket_request(
    sock: &Path,
    head: &str,
    body: &str,
    fds: &[std::os::fd::BorrowedFd<'_>],
) -> String {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    use std::io::Write;
    let mut stream = std::os::unix::net::UnixStream::connect(sock).expect("connect");
    stream
        .set_read_timeout(Some(scaled(Duration::from_secs(30))))
        .expect("timeout");
    let request = format!(
        "{head}\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let bytes = request.as_bytes();
    let mut space = [std::mem::MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(4))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() {
        assert!(control.push(SendAncillaryMessage::ScmRights(fds)));
    }
    let sent = rustix::net::sendmsg(
        &stream,
        &[std::io::IoSlice::new(bytes)],
        &mut control,
        SendFlags::empty(),
    )
    .expect("sendmsg");
    stream.write_all(&bytes[sent..]).expect("the rest");
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    answer
}

#[test]
fn descriptors_sent_on_the_socket_become_the_trees_stdio() {
    let s = Server::start(&[]);
    let sock = s.data_dir().join("api.sock");
    let body = |script: &str| {
        json!({"argv": ["sh", "-c", script], "env": {"TW_TEST_MARK": s.mark}}).to_string()
    };
    // stdout on our pipe: what the tree writes arrives here, not in the log.
    let (r, w) = rustix::pipe::pipe().expect("pipe");
    let answer = socket_request(
        &sock,
        "POST /api/trees HTTP/1.1\r\nTreewarden-Stdio: stdout",
        &body("echo via-the-descriptor"),
        &[w.as_fd()],
    );
    assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");
    drop(w);
    let mut out = String::new();
    std::fs::File::from(r)
        .read_to_string(&mut out)
        .expect("read");
    assert_eq!(out, "via-the-descriptor\n");
    // The header and what came must agree; descriptors need the header.
    let (r2, w2) = rustix::pipe::pipe().expect("pipe");
    for (head, fds) in [
        (
            "POST /api/trees HTTP/1.1\r\nTreewarden-Stdio: stdin,stdout",
            vec![r2.as_fd()],
        ),
        ("POST /api/trees HTTP/1.1", vec![w2.as_fd()]),
        (
            "POST /api/trees HTTP/1.1\r\nTreewarden-Stdio: stdout,stdout",
            vec![w2.as_fd(), w2.as_fd()],
        ),
    ] {
        let answer = socket_request(&sock, head, &body("echo no"), &fds);
        assert!(answer.starts_with("HTTP/1.1 400"), "{head}: {answer}");
        assert!(answer.contains("\"code\":\"BadRequest\""), "{answer}");
    }
    // More than a request passes, in one message: the connection ends, unanswered.
    // The header names all three, so only the refusal of the message (not
    // a header mismatch) can stop it: the answer is empty.
    let four = [r2.as_fd(), w2.as_fd(), r2.as_fd(), w2.as_fd()];
    let answer = socket_request(
        &sock,
        "POST /api/trees HTTP/1.1\r\nTreewarden-Stdio: stdin,stdout,stderr",
        &body("echo no"),
        &four,
    );
    assert!(answer.is_empty(), "no answer to four descriptors: {answer}");
    // Only the first tree was spawned.
    let (_, trees) = get(&s, "/api/trees?all=1");
    assert_eq!(trees.as_array().map(Vec::len), Some(1), "{trees}");
}

/// One request on a kept-alive Unix-socket connection, its first bytes
/// sent with `fds`; the answer's status line and body (read by its
/// `Content-Length`, so the connection stays open for the next).
fn keepalive_request(
    stream: &mut std::os::unix::net::UnixStream,
    head: &str,
    fds: &[std::os::fd::BorrowedFd<'_>],
) -> (String, String) {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    use std::io::Write;
    let request = format!("{head}\r\nHost: localhost\r\nContent-Length: 0\r\n\r\n");
    let bytes = request.as_bytes();
    let mut space = [std::mem::MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(4))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() {
        assert!(control.push(SendAncillaryMessage::ScmRights(fds)));
    }
    let sent = rustix::net::sendmsg(
        &*stream,
        &[std::io::IoSlice::new(bytes)],
        &mut control,
        SendFlags::empty(),
    )
    .expect("sendmsg");
    stream.write_all(&bytes[sent..]).expect("the rest");
    let mut got = Vec::new();
    let mut byte = [0u8; 1];
    while !got.ends_with(b"\r\n\r\n") {
        let n = stream.read(&mut byte).expect("read the head");
        assert!(
            n > 0,
            "the connection closed: {}",
            String::from_utf8_lossy(&got)
        );
        got.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&got).to_string();
    let len: usize = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-length:")
                .map(|v| v.trim().parse().expect("a length"))
        })
        .expect("a content-length");
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body).expect("the body");
    (
        head.lines().next().unwrap_or_default().to_string(),
        String::from_utf8_lossy(&body).to_string(),
    )
}

/// Whether the pipe whose read end this is has no writer left (a read
/// gives end of file), polled: `false` while some process holds its write
/// end.
fn writers_gone(r: &std::os::fd::OwnedFd, within: Duration) -> bool {
    rustix::fs::fcntl_setfl(r, rustix::fs::OFlags::NONBLOCK).expect("nonblock");
    wait_until(within, || {
        let mut b = [0u8; 8];
        matches!(rustix::io::read(r, &mut b), Ok(0))
    })
}

/// The review's finding: a descriptor sent with a request other than a
/// spawn was kept until the connection closed. Now the request is refused
/// unserved (400: only a spawn passes descriptors) and the descriptor
/// closed — seen from the pipe it belongs to (end of file once our own
/// write end is closed) while the connection stays open and serves the
/// next request.
#[test]
fn a_descriptor_sent_with_a_request_other_than_a_spawn_is_closed_once_answered() {
    // An idle connection outlives the poll below (the header timeout would
    // otherwise close it, and with it the descriptor, at 10 s).
    let s = Server::start(&["--header-timeout", "120s"]);
    let mut stream =
        std::os::unix::net::UnixStream::connect(s.data_dir().join("api.sock")).expect("connect");
    stream
        .set_read_timeout(Some(scaled(Duration::from_secs(30))))
        .expect("timeout");
    let (r, w) = rustix::pipe::pipe().expect("pipe");
    let (status, body) = keepalive_request(&mut stream, "GET /api/trees HTTP/1.1", &[w.as_fd()]);
    assert!(status.starts_with("HTTP/1.1 400"), "{status}: {body}");
    assert!(body.contains("\"code\":\"BadRequest\""), "{body}");
    drop(w);
    assert!(
        writers_gone(&r, Duration::from_secs(5)),
        "the service still holds the descriptor after the answer"
    );
    // The same connection, still open, serves the next request.
    let (status, body) = keepalive_request(&mut stream, "GET /api/trees HTTP/1.1", &[]);
    assert!(status.starts_with("HTTP/1.1 200"), "{status}: {body}");
}

/// While the service has fewer descriptors free than its reserve (its soft
/// `nofile` lowered under it), descriptors sent on a connection accepted
/// before are closed at once and their request refused, 503 with its
/// `code`; a request without descriptors on the same connection is still
/// served, and once the limit is back, descriptors are taken again.
#[test]
fn descriptors_sent_while_the_reserve_is_short_are_refused_with_a_code() {
    use rustix::process::{Pid, Resource, Rlimit, prlimit};
    let s = Server::start(&["--header-timeout", "120s"]);
    let pid = s.pid().expect("serve runs");
    let mut stream =
        std::os::unix::net::UnixStream::connect(s.data_dir().join("api.sock")).expect("connect");
    stream
        .set_read_timeout(Some(scaled(Duration::from_secs(30))))
        .expect("timeout");
    // Accepted and served while descriptors are plenty.
    let (status, _) = keepalive_request(&mut stream, "GET /api/trees HTTP/1.1", &[]);
    assert!(status.starts_with("HTTP/1.1 200"), "{status}");
    let target = Pid::from_raw(pid as i32).expect("a pid");
    // Its hard limit as it is (lowering the soft one only), from /proc.
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("limits");
    let hard = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(4))
        .and_then(|h| h.parse::<u64>().ok());
    let open = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("the service's fds")
        .count() as u64;
    // 64 free: under the reserve (128), room enough to serve.
    let old = prlimit(
        Some(target),
        Resource::Nofile,
        Rlimit {
            current: Some(open + 64),
            maximum: hard,
        },
    )
    .expect("lower nofile");
    let (r, w) = rustix::pipe::pipe().expect("pipe");
    let refused = keepalive_request(&mut stream, "GET /api/trees HTTP/1.1", &[w.as_fd()]);
    let plain = keepalive_request(&mut stream, "GET /api/trees HTTP/1.1", &[]);
    prlimit(Some(target), Resource::Nofile, old).expect("restore nofile");
    let (status, body) = refused;
    assert!(status.starts_with("HTTP/1.1 503"), "{status}: {body}");
    let v: Value = serde_json::from_str(&body).expect("a json body");
    assert_eq!(v["code"], "Unavailable", "{v}");
    assert!(
        v["error"].as_str().unwrap_or("").contains("descriptors"),
        "{v}"
    );
    drop(w);
    assert!(
        writers_gone(&r, Duration::from_secs(5)),
        "the refused descriptor is closed"
    );
    assert!(plain.0.starts_with("HTTP/1.1 200"), "{plain:?}");
    // The limit back: a descriptor is taken again (and, with a request
    // that is not a spawn, refused 400 and closed).
    let (r, w) = rustix::pipe::pipe().expect("pipe");
    let (status, body) = keepalive_request(&mut stream, "GET /api/trees HTTP/1.1", &[w.as_fd()]);
    assert!(status.starts_with("HTTP/1.1 400"), "{status}: {body}");
    drop(w);
    assert!(writers_gone(&r, Duration::from_secs(5)));
}

#[test]
fn a_label_stream_carries_only_the_events_of_that_labels_trees() {
    let s = Server::start(&[]);
    let mut b = s.body("exit 0");
    b["label"] = json!("other");
    let other = spawn(&s, &b);
    let mut b = s.body("exit 5");
    b["label"] = json!("call x");
    let mine = spawn(&s, &b);
    // From the start of the trail: the label's events only, through the
    // end of its tree (the stream itself goes on: read until then).
    let r = s.get("/api/events/stream?label=call%20x&after=0");
    assert_eq!(r.status(), 200);
    let mut reader = std::io::BufReader::new(r);
    let mut events = Vec::new();
    let mut line = String::new();
    while std::io::BufRead::read_line(&mut reader, &mut line).expect("read") > 0 {
        if let Some(d) = line.trim_end().strip_prefix("data: ") {
            let e: Value = serde_json::from_str(d).expect("json");
            let end = e["kind"] == "tree.ended";
            events.push(e);
            if end {
                break;
            }
        }
        line.clear();
    }
    assert!(!events.is_empty());
    assert!(events.iter().all(|e| e["tree"] == mine), "{events:?}");
    assert!(events.iter().all(|e| e["tree"] != other));
}
