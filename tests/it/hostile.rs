//! Hostile local users (issue 24): what a user with a shell and the 0666
//! socket can do to the service, reproduced for real (a real descriptor
//! limit on the real service, real sockets), with the record checked
//! against what the workload's processes are (found by their marker).

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::serve::Server;
use crate::util::{bin, say, wait_until};

/// The tree's events, read from the ledger file by the CLI (the service's
/// own listeners may be the thing under attack).
pub(crate) fn tree_events(s: &Server, tree: i64) -> Vec<Value> {
    let out = Command::new(bin())
        .env("TREEWARDEN_DATA_DIR", s.data_dir())
        .args(["export", "--format", "ndjson", "--tree", &tree.to_string()])
        .output()
        .expect("run export");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    crate::util::parse_ndjson(&String::from_utf8_lossy(&out.stdout))
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

fn set_nofile(pid: Option<u32>, n: u64) {
    use rustix::process::{Pid, Resource, Rlimit, prlimit};
    let pid = pid.map(|p| Pid::from_raw(p as i32).expect("a pid"));
    prlimit(
        pid,
        Resource::Nofile,
        Rlimit {
            current: Some(n),
            maximum: Some(n),
        },
    )
    .expect("prlimit NOFILE");
}

/// Finding 2: with the service at `nofile 200` and 400 idle connections
/// on its socket, a root tree's timeout was recorded `timeout` -> `ended`
/// with no signal and an exit for a process still running (`/proc` reads
/// failing with EMFILE were taken for "no process"). Now accept pauses
/// while descriptors are short, so the teardown has its own: the
/// TERM-ignoring tree is torn down with its authorization — and in no case
/// is it recorded ended while a process of it lives.
#[test]
fn out_of_descriptors_a_timed_out_tree_is_never_recorded_ended_while_alive() {
    let s = Server::start(&[]);
    let body = json!({
        "argv": ["sh", "-c", "trap '' TERM; sleep 600 & sleep 600 & wait"],
        "env": { "TW_TEST_MARK": s.mark },
        "grace": "200ms",
        "timeout": "4s",
        "label": "fd-starved",
    });
    let (status, v) = s.post("/api/trees", Some(&body));
    assert_eq!(status, 201, "{v}");
    let tree = v["id"].as_i64().expect("tree id");
    assert!(
        wait_until(Duration::from_secs(10), || s.marked().len() >= 3),
        "the tree's three processes run"
    );
    let pid = s.pid().expect("serve runs");
    set_nofile(Some(pid), 200);
    // This test's own descriptors: 400 sockets and then some.
    set_nofile(
        None,
        rustix::process::getrlimit(rustix::process::Resource::Nofile)
            .maximum
            .unwrap_or(4096)
            .max(1024),
    );
    let sock = s.data_dir().join("api.sock");
    let conns: Vec<UnixStream> = (0..400)
        .filter_map(|_| UnixStream::connect(&sock).ok())
        .collect();
    assert_eq!(conns.len(), 400, "400 idle connections made");
    say(&format!(
        "service fds with 400 idle connections: {}",
        open_fds(pid)
    ));
    let gone = wait_until(Duration::from_secs(40), || s.marked().is_empty());
    // The end is recorded after the verifying scan, a moment after the
    // last survivor is gone (longer under load): wait for it, bounded.
    let mut events = tree_events(&s, tree);
    if gone {
        wait_until(Duration::from_secs(20), || {
            events = tree_events(&s, tree);
            events.iter().any(|e| e["kind"] == "tree.ended")
        });
    }
    let kinds: Vec<&str> = events.iter().filter_map(|e| e["kind"].as_str()).collect();
    if kinds.contains(&"tree.ended") {
        assert!(
            s.marked().is_empty(),
            "recorded ended while {:?} live: {kinds:?}",
            s.marked()
        );
    }
    assert!(
        gone,
        "the tree was not torn down: {kinds:?}; log: {}",
        s.stderr()
    );
    let seq = |pred: &dyn Fn(&Value) -> bool| {
        events
            .iter()
            .find(|e| pred(e))
            .and_then(|e| e["seq"].as_i64())
    };
    let auth = seq(&|e| e["kind"] == "kill.authorized").expect("an authorization");
    let kill = seq(&|e| e["kind"] == "signal.sent" && e["data"]["signal"] == "SIGKILL")
        .expect("a SIGKILL row");
    assert!(auth < kill, "authorization {auth} before SIGKILL {kill}");
    assert!(kinds.contains(&"tree.ended"), "{kinds:?}");
    drop(conns);
}

/// Finding 2's slowloris: connections that send half a request head and
/// then nothing were held for ever (1,000 held 40 s: fds 22 -> 1,021).
/// Each is now closed once the header timeout passes, and the service's
/// descriptors come back.
#[test]
fn half_sent_requests_are_closed_after_the_header_timeout_and_their_descriptors_return() {
    let s = Server::start(&["--header-timeout", "1s"]);
    let pid = s.pid().expect("serve runs");
    let before = open_fds(pid);
    let sock = s.data_dir().join("api.sock");
    let mut conns: Vec<UnixStream> = (0..50)
        .map(|_| {
            let mut c = UnixStream::connect(&sock).expect("connect");
            c.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
                .expect("half a head");
            c.set_read_timeout(Some(Duration::from_secs(15)))
                .expect("read timeout");
            c
        })
        .collect();
    let t0 = Instant::now();
    for c in &mut conns {
        let mut buf = [0u8; 512];
        // EOF, or hyper's 408 then EOF: either way the connection ends.
        loop {
            match c.read(&mut buf) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) => panic!("connection still open after {:?}: {e}", t0.elapsed()),
            }
        }
    }
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    drop(conns);
    assert!(
        wait_until(Duration::from_secs(10), || open_fds(pid) <= before + 2),
        "descriptors back: {} before, {} now",
        before,
        open_fds(pid)
    );
}

/// One local user cannot hold every connection: past its cap, its new
/// connections are answered 503 (with `Retry-After`) and closed, and
/// another request of it is served as soon as one of its connections ends.
#[test]
fn one_uid_holds_at_most_its_cap_of_connections() {
    let s = Server::start(&["--max-connections-per-uid", "5"]);
    let sock = s.data_dir().join("api.sock");
    let held: Vec<UnixStream> = (0..5)
        .map(|_| UnixStream::connect(&sock).expect("connect"))
        .collect();
    let healthz = |c: &mut UnixStream| -> String {
        c.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("read timeout");
        let _ = c.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        let mut out = String::new();
        let _ = c.read_to_string(&mut out);
        out
    };
    // The sixth is answered 503 and closed, not served.
    let mut answer = String::new();
    let over = wait_until(Duration::from_secs(10), || {
        let mut c = UnixStream::connect(&sock).expect("connect");
        answer = healthz(&mut c);
        answer.starts_with("HTTP/1.1 503")
    });
    assert!(
        over,
        "a sixth connection of the same uid is answered 503: {answer}"
    );
    let lower = answer.to_ascii_lowercase();
    assert!(lower.contains("retry-after: 1"), "{answer}");
    assert!(lower.contains("connection: close"), "{answer}");
    assert!(answer.contains("\"code\":\"Unavailable\""), "{answer}");
    drop(held);
    let served = wait_until(Duration::from_secs(10), || {
        let mut c = UnixStream::connect(&sock).expect("connect");
        healthz(&mut c).starts_with("HTTP/1.1 200")
    });
    assert!(served, "served again once the uid's connections ended");
}

/// A streamed-stdio connection gives its slot back at the upgrade: it is
/// its tree's stdio (a tree capped by `--max-trees-per-user`), not a
/// request slot, so a caller holding as many stdio trees as its cap of
/// connections still gets an ordinary request served, and each stream
/// still carries its tree's stdio to the end.
#[test]
fn streamed_stdio_connections_leave_the_callers_request_slots() {
    let s = Server::start(&["--max-connections-per-uid", "3"]);
    let frame = |kind: u8, payload: &[u8]| {
        let mut f = vec![kind];
        f.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        f.extend_from_slice(payload);
        f
    };
    let read_frame = |c: &mut std::net::TcpStream| {
        let mut head = [0u8; 5];
        c.read_exact(&mut head).expect("a frame's head");
        let mut payload =
            vec![0; u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize];
        c.read_exact(&mut payload).expect("a frame's payload");
        (head[0], payload)
    };
    let body = json!({ "argv": ["cat"], "stdio": "stream" }).to_string();
    let mut streams = Vec::new();
    for _ in 0..3 {
        let mut c = std::net::TcpStream::connect(&s.addr).expect("connect");
        c.set_read_timeout(Some(Duration::from_secs(30)))
            .expect("read timeout");
        write!(
            c,
            "POST /api/trees HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\n\
             Connection: Upgrade\r\nUpgrade: treewarden-stdio/1\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            s.token,
            body.len()
        )
        .expect("send the spawn");
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            c.read_exact(&mut byte).expect("the answer's head");
            head.push(byte[0]);
        }
        let head = String::from_utf8_lossy(&head).into_owned();
        assert!(head.starts_with("HTTP/1.1 101"), "{head}");
        streams.push(c);
    }
    // Three stdio trees held, as many as the cap: an ordinary request.
    let mut answer = String::new();
    let served = wait_until(Duration::from_secs(10), || {
        let mut c = std::net::TcpStream::connect(&s.addr).expect("connect");
        c.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("read timeout");
        let _ = write!(
            c,
            "GET /api/trees HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nConnection: close\r\n\r\n",
            s.token
        );
        answer.clear();
        let _ = c.read_to_string(&mut answer);
        answer.starts_with("HTTP/1.1 200")
    });
    assert!(
        served,
        "a request beside {} stdio streams: {answer}",
        streams.len()
    );
    for c in &mut streams {
        c.write_all(&frame(0, b"hi\n")).expect("stdin");
        assert_eq!(read_frame(c), (1, b"hi\n".to_vec()));
        c.write_all(&frame(0, b"")).expect("stdin's end");
        let end = loop {
            if let (3, end) = read_frame(c) {
                break end;
            }
        };
        let end: Value = serde_json::from_slice(&end).expect("the exit frame");
        assert_eq!(end["outcome"]["kind"], "exited", "{end}");
    }
}

fn tree_detail(s: &Server, tree: i64) -> Value {
    let out = Command::new(bin())
        .env("TREEWARDEN_DATA_DIR", s.data_dir())
        .args(["show", &tree.to_string(), "--json"])
        .output()
        .expect("run show");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("show --json")
}

fn start_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    rest.split(' ').nth(19)?.parse().ok()
}

/// How long a forked member lives before it exits.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ChildLife {
    /// 3 ms: long enough for the observer to read it at its fork.
    Brief,
    /// Not at all: it exits at once, often before anything read its uid.
    None,
}

/// Another user's process, placed on a member's pid: it writes every
/// signal it receives to `record` (its handlers are in place once the
/// file says `ready`); a SIGKILL (or any signal it could not catch and
/// that ended it) leaves it a zombie of its parent, the [`Spawner`],
/// which never reaps it, so its pid stays its own until the spawner ends.
struct Victim {
    pid: i32,
    record: std::path::PathBuf,
}

/// The victims' parent: a process of the other user from its start, which
/// forks a victim for each record path it reads and says its pid. A
/// victim forked by root and then moved to the user (`Command::uid`) is
/// root's between its fork and its `setuid`, a process of the member's own
/// uid on its identity: the documented same-uid residual (RESIDUALS.md,
/// "Two processes on one pid in one clock tick"), not what these races
/// test. Forked here, it never had any uid but the user's.
struct Spawner {
    child: std::process::Child,
    ask: std::process::ChildStdin,
    said: std::io::BufReader<std::process::ChildStdout>,
}

const SPAWNER: &str = r#"
import os, sys
victim = sys.argv[1]
for line in sys.stdin:
    pid = os.fork()
    if pid == 0:
        null = os.open("/dev/null", os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(null, 1)
        os.execvp("python3", ["python3", "-c", victim, line.strip()])
    print(pid, flush=True)
"#;

impl Spawner {
    fn start(user: &crate::privilege::TestUser) -> Spawner {
        use std::os::unix::process::CommandExt;
        let mut child = Command::new("python3")
            .args(["-c", SPAWNER, VICTIM])
            .current_dir("/")
            .uid(user.uid)
            .gid(user.gid)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("spawn the other user's spawner");
        let ask = child.stdin.take().expect("stdin");
        let said = std::io::BufReader::new(child.stdout.take().expect("stdout"));
        Spawner { child, ask, said }
    }

    /// A victim writing to `record`, forked now.
    fn victim(&mut self, record: &std::path::Path) -> Victim {
        use std::io::{BufRead, Write};
        writeln!(self.ask, "{}", record.display()).expect("ask the spawner");
        let mut line = String::new();
        self.said.read_line(&mut line).expect("the victim's pid");
        let pid = line.trim().parse().expect("a pid");
        Victim {
            pid,
            record: record.to_path_buf(),
        }
    }
}

impl Drop for Spawner {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The victim's program: every catchable signal a teardown might send is
/// written down, the process carries on.
const VICTIM: &str = r#"
import signal, sys, time
out = sys.argv[1]
def seen(n, _):
    with open(out, "a") as f:
        f.write(f"signal {n}\n")
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT,
          signal.SIGUSR1, signal.SIGUSR2, signal.SIGCONT, signal.SIGALRM,
          signal.SIGPIPE, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU):
    signal.signal(s, seen)
with open(out, "a") as f:
    f.write("ready\n")
while True:
    time.sleep(600)
"#;

impl Victim {
    fn pid(&self) -> i32 {
        self.pid
    }

    /// What the victim itself saw: `None` while it is unharmed (running,
    /// not stopped, no signal written down), else what happened to it.
    fn harm(&mut self) -> Option<String> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid)).unwrap_or_default();
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, r)| r.trim_start().chars().next());
        if matches!(state, None | Some('Z' | 'X')) {
            return Some(format!("ended (state {state:?})"));
        }
        let text = std::fs::read_to_string(&self.record).unwrap_or_default();
        let signals: Vec<&str> = text.lines().filter(|l| *l != "ready").collect();
        if !signals.is_empty() {
            return Some(format!("received {signals:?}"));
        }
        let stat =
            std::fs::read_to_string(format!("/proc/{}/stat", self.pid())).unwrap_or_default();
        if stat
            .rsplit_once(')')
            .is_some_and(|(_, r)| r.trim_start().starts_with('T'))
        {
            return Some("stopped".into());
        }
        None
    }

    fn ready(&self) -> bool {
        std::fs::read_to_string(&self.record).is_ok_and(|t| t.lines().any(|l| l == "ready"))
    }
}

impl Drop for Victim {
    /// Ends the victim by its pid, which is its own while its spawner lives
    /// (a victim that ended is the spawner's zombie, never reaped).
    fn drop(&mut self) {
        if let Some(pid) = rustix::process::Pid::from_raw(self.pid) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        }
    }
}

/// The race of a member's pid, `races` times: a tree forks members that
/// live `life`, and each time one is gone its pid is given, as root
/// (`/proc/sys/kernel/ns_last_pid`), to a process of `user` (a real user
/// made with useradd), until that process has the member's identity (the
/// same pid and start tick) and the ledger records the member with it.
/// Up to ten such victims share one tree, which is then killed through the
/// API. Returns, for each victim, the pid and what harmed it (checked from
/// the victim's side), plus the ledger's view.
fn race_members_pid(
    user: &crate::privilege::TestUser,
    life: ChildLife,
    races: usize,
) -> Option<Vec<(i32, Option<String>)>> {
    let s = Server::start(&[]);
    // The victims' folder: theirs to write, reachable by them.
    let public = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(
        public.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .expect("chmod");
    let mut outcome = Vec::new();
    let mut serial = 0;
    let mut never_read = 0;
    while outcome.len() < races {
        let want = (races - outcome.len()).min(10);
        let dir = tempfile::tempdir().expect("tempdir");
        let (born, next) = (dir.path().join("born"), dir.path().join("next"));
        for f in [&born, &next] {
            let ok = Command::new("mkfifo").arg(f).status().expect("mkfifo");
            assert!(ok.success());
        }
        // The tree forks a member, which lives `life`; the tree reaps it
        // at once and says its pid; then waits for "next".
        let life_line = match life {
            ChildLife::Brief => "time.sleep(0.003)",
            // Under half a millisecond, spread over the time the observer
            // takes from reading a fork to reading its details.
            ChildLife::None => {
                "d = random.random() * 0.0005; t = time.perf_counter()\n        while time.perf_counter() - t < d: pass"
            }
        };
        let script = format!(
            r#"
import os, random, sys, time
born = open(sys.argv[1], "w", buffering=1)
nxt = open(sys.argv[2], "r")
while True:
    pid = os.fork()
    if pid == 0:
        {life_line}
        os._exit(0)
    os.waitpid(pid, 0)
    born.write(f"{{pid}}\n")
    if nxt.readline().strip() != "next":
        break
time.sleep(600)
"#
        );
        let body = json!({
            "argv": ["python3", "-c", script, born.to_str().expect("utf-8"), next.to_str().expect("utf-8")],
            "env": { "TW_TEST_MARK": s.mark },
            "grace": "300ms",
            "label": "same-tick",
        });
        let (status, v) = s.post("/api/trees", Some(&body));
        assert_eq!(status, 201, "{v}");
        let tree = v["id"].as_i64().expect("tree id");
        let mut born_r = std::io::BufReader::new(std::fs::File::open(&born).expect("born fifo"));
        let mut next_w = std::fs::OpenOptions::new()
            .write(true)
            .open(&next)
            .expect("next fifo");
        // Declared before the victims: they are ended (dropped) first.
        let mut spawner = Spawner::start(user);
        let mut victims: Vec<Victim> = Vec::new();
        let mut tries = 0;
        while victims.len() < want && tries < 100 * want {
            tries += 1;
            let mut line = String::new();
            std::io::BufRead::read_line(&mut born_r, &mut line).expect("a pid");
            let member: u32 = line.trim().parse().expect("pid");
            // The member's pid to another user's process, now.
            serial += 1;
            let record = public.path().join(format!("victim-{serial}"));
            std::fs::write(&record, "").expect("victim's record");
            std::os::unix::fs::chown(&record, Some(user.uid), Some(user.gid)).expect("chown");
            let _ = std::fs::write("/proc/sys/kernel/ns_last_pid", (member - 1).to_string());
            let v = spawner.victim(&record);
            let vstart = start_ticks(member).filter(|_| v.pid() as u32 == member);
            // Did the ledger record the member, with the victim's start?
            let mut row = None;
            if let Some(vstart) = vstart {
                wait_until(Duration::from_millis(500), || {
                    row = tree_detail(&s, tree)["members"].as_array().and_then(|ms| {
                        ms.iter()
                            .find(|m| m["pid"] == member && m["start_ticks"] == vstart)
                            .cloned()
                    });
                    row.is_some()
                });
            }
            if let Some(row) = row {
                if row["uid"].is_null() {
                    never_read += 1;
                }
                say(&format!(
                    "another user's process {member} holds a recorded member's identity (recorded uid: {})",
                    row["uid"]
                ));
                victims.push(v);
            } else {
                drop(v);
            }
            next_w.write_all(b"next\n").expect("next");
        }
        next_w.write_all(b"stop\n").expect("stop");
        drop(next_w);
        if victims.is_empty() {
            crate::util::skip(&format!(
                "could not place a process on a member's pid within its clock tick in {tries} tries"
            ));
            return None;
        }
        assert!(
            wait_until(Duration::from_secs(20), || victims
                .iter()
                .all(Victim::ready)),
            "each victim's handlers are in place"
        );
        // Three scans of the service see them (its scan counter, not a
        // sleep); then the tree is killed.
        let scans = || -> u64 {
            s.get("/metrics")
                .text()
                .unwrap_or_default()
                .lines()
                .filter(|l| l.starts_with("treewarden_scan_duration_seconds_count"))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum::<f64>() as u64
        };
        let before = scans();
        assert!(
            wait_until(Duration::from_secs(10), || scans() >= before + 3),
            "the service scans"
        );
        let (status, k) = s.post(&format!("/api/trees/{tree}/kill"), None);
        assert_eq!(status, 200, "{k}");
        assert!(
            wait_until(Duration::from_secs(20), || s.marked().is_empty()),
            "the tree is torn down"
        );
        // The teardown's last step (verify) is over once the tree ended.
        wait_until(Duration::from_secs(10), || {
            tree_detail(&s, tree)["tree"]["state"] == "ended"
        });
        let detail = tree_detail(&s, tree);
        for v in &mut victims {
            let vpid = v.pid();
            let mut harm = v.harm();
            // The ledger's view, for the message.
            let signalled: Vec<&Value> = detail["signals"]
                .as_array()
                .expect("signals")
                .iter()
                .filter(|r| {
                    r["target_kind"] == "pid"
                        && r["target"].as_str() == Some(vpid.to_string().as_str())
                })
                .collect();
            let escaped = detail["members"]
                .as_array()
                .expect("members")
                .iter()
                .any(|m| m["pid"] == vpid && !m["escaped_at"].is_null());
            let authorized = detail["authorizations"]
                .as_array()
                .expect("authorizations")
                .iter()
                .any(|a| a.to_string().contains(&format!("\"pid\":{vpid}")));
            if harm.is_none() && (!signalled.is_empty() || escaped || authorized) {
                harm = Some(format!(
                    "the ledger: signals {signalled:?}, escaped {escaped}, authorized {authorized}"
                ));
            }
            outcome.push((vpid, harm));
        }
    }
    say(&format!(
        "{} races, {never_read} of them on a member recorded without a uid",
        outcome.len()
    ));
    Some(outcome)
}

/// Finding 1: a member exits and another user's process takes its pid
/// *within the same clock tick* (placed there as root through
/// `/proc/sys/kernel/ns_last_pid`), so it has the member's identity (pid,
/// start ticks, boot). It is never recorded as a member or an escape, and
/// never signalled, though the tree around it is torn down.
#[test]
fn another_users_process_on_a_members_pid_within_the_tick_is_never_signalled() {
    if !crate::util::is_root() {
        crate::util::skip("needs root (ns_last_pid, a process of another uid)");
        return;
    }
    let Some(user) = crate::privilege::TestUser::create() else {
        return;
    };
    let Some(outcome) = race_members_pid(&user, ChildLife::Brief, 1) else {
        return;
    };
    let harmed: Vec<_> = outcome.iter().filter(|(_, h)| h.is_some()).collect();
    assert!(harmed.is_empty(), "{harmed:?}");
}

/// The same race where the member exits at once, often before anything
/// read it as itself (it was recorded with no uid, or with the uid of
/// whatever held its pid when its details were read): a process known
/// only by its identity is never signalled by it. `TW_PID_RACES` races
/// (48 by default, about 13 s: on the code that signalled by identity one
/// race in 16 to 24 harmed its victim, so 48 find that with odds of about
/// nine in ten; 50 for the measured figure), each
/// checked from the victim's side: the signals it wrote down, and its exit
/// status.
#[test]
fn another_users_process_on_the_pid_of_a_member_never_read_is_never_signalled() {
    if !crate::util::is_root() {
        crate::util::skip("needs root (ns_last_pid, a process of another uid)");
        return;
    }
    let races = std::env::var("TW_PID_RACES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(48);
    let Some(user) = crate::privilege::TestUser::create() else {
        return;
    };
    let Some(outcome) = race_members_pid(&user, ChildLife::None, races) else {
        return;
    };
    let harmed: Vec<_> = outcome.iter().filter(|(_, h)| h.is_some()).collect();
    assert!(
        harmed.is_empty(),
        "{} of {} victims harmed: {harmed:?}",
        harmed.len(),
        outcome.len()
    );
}

/// Every file and folder below `dir` whose mode lets group or others in,
/// but the API socket (0666 by design: who connects is told by
/// SO_PEERCRED, docs/THREAT-MODEL.md).
fn open_to_others(dir: &std::path::Path) -> Vec<(std::path::PathBuf, u32)> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let Ok(meta) = std::fs::symlink_metadata(e.path()) else {
                continue;
            };
            if meta.file_type().is_socket() {
                continue;
            }
            if meta.is_dir() {
                stack.push(e.path());
            }
            let mode = meta.permissions().mode() & 0o777;
            if mode & 0o077 != 0 {
                out.push((e.path(), mode));
            }
        }
    }
    out
}

/// Finding 9: a data dir that already existed as 0755 was left so, and
/// `teardown/` was made 0755. Now an existing data dir with group or other
/// bits is tightened to 0700, and everything treewarden makes in it is
/// private; a shared directory (sticky, as /tmp) is refused in one line.
#[test]
fn the_data_dir_and_everything_in_it_are_private_and_a_shared_one_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    // A folder as the test leaves it (with `mode`, and a file of another's
    // in it where `in_use`), and `run -- true` with it as the data dir.
    let folder = |name: &str, mode: u32, in_use: bool| {
        let path = dir.path().join(name);
        std::fs::create_dir(&path).expect("folder");
        if in_use {
            std::fs::write(path.join("someone-elses"), "x").expect("a file of another's");
        }
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).expect("chmod");
        let run = Command::new(bin())
            .current_dir(dir.path())
            .env("TREEWARDEN_DATA_DIR", &path)
            .args(["run", "--", "true"])
            .output()
            .expect("run");
        let mode = std::fs::metadata(&path)
            .expect("folder")
            .permissions()
            .mode()
            & 0o7777;
        (path, run, mode)
    };
    let (data, run, mode) = folder("data", 0o755, false);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert_eq!(mode, 0o700, "tightened");
    assert!(
        data.join("teardown").is_dir(),
        "the teardown's lease folder was made"
    );
    let open = open_to_others(&data);
    assert!(open.is_empty(), "open to others: {open:?}");

    // A folder shared on purpose, as /tmp is: sticky, and others' files in it.
    let (shared, refused, mode) = folder("shared", 0o1777, true);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(125), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    assert!(err.contains("is shared"), "{err}");
    assert_eq!(mode, 0o1777, "a shared folder is left as it is");
    assert!(
        !shared.join("ledger.db").exists(),
        "nothing written into it"
    );

    // An empty sticky folder of this user's (a tmpfs mounted for the data
    // dir has a 1777 root) is the data dir's own: tightened.
    let (_, run, mode) = folder("fresh-mount", 0o1777, false);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert_eq!(mode, 0o700);
}

/// A data dir owned by another user, even 0700, was accepted by root: its
/// owner can replace the ledger in it (or read every tree's argv). Now a
/// data dir not owned by the caller is refused whatever its mode, in one
/// line, with treewarden's own exit code (125), by `run` and by `serve`,
/// and nothing is written into it.
#[test]
fn a_data_dir_owned_by_another_user_is_refused_whatever_its_mode() {
    use std::os::unix::fs::PermissionsExt;
    if !crate::util::is_root() {
        crate::util::skip("needs root (a folder of another user's)");
        return;
    }
    let Some(user) = crate::privilege::TestUser::create() else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    for mode in [0o700, 0o755] {
        let data = dir.path().join(format!("data-{mode:o}"));
        std::fs::create_dir(&data).expect("folder");
        std::os::unix::fs::chown(&data, Some(user.uid), Some(user.gid)).expect("chown");
        std::fs::set_permissions(&data, std::fs::Permissions::from_mode(mode)).expect("chmod");
        for args in [
            &["run", "--", "true"][..],
            &["serve", "--listen", "127.0.0.1:0"][..],
        ] {
            let mut child = Command::new(bin())
                .current_dir(dir.path())
                .env("TREEWARDEN_DATA_DIR", &data)
                .env("TREEWARDEN_LOG", "error")
                .args(args)
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("treewarden");
            let status = crate::util::wait_child(&mut child, Duration::from_secs(20));
            let mut err = String::new();
            if status.is_none() {
                let _ = child.kill();
                let _ = child.wait();
            }
            if let Some(mut e) = child.stderr.take() {
                let _ = e.read_to_string(&mut err);
            }
            let what = format!("{args:?} with a {mode:o} data dir of uid {}", user.uid);
            assert_eq!(status.and_then(|s| s.code()), Some(125), "{what}: {err}");
            assert_eq!(err.trim().lines().count(), 1, "{what}: one line: {err}");
            assert!(
                err.contains("owned by uid") && err.contains(&user.uid.to_string()),
                "{what}: {err}"
            );
            let written: Vec<_> = std::fs::read_dir(&data)
                .expect("the folder")
                .flatten()
                .map(|e| e.file_name())
                .collect();
            assert!(written.is_empty(), "{what}: written into it: {written:?}");
        }
    }
}

fn token(s: &Server, scope: &str) -> (i64, String) {
    let out = Command::new(bin())
        .env("TREEWARDEN_DATA_DIR", s.data_dir())
        .args([
            "token", "create", "--scope", scope, "--name", "hostile", "--json",
        ])
        .output()
        .expect("token create");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("json");
    (
        v["id"].as_i64().expect("id"),
        v["token"].as_str().expect("token").to_string(),
    )
}

/// An open event stream, read line by line on a thread: `None` from
/// [`Stream::line`] once the server has ended it.
struct Stream(std::sync::mpsc::Receiver<String>);

impl Stream {
    fn open(s: &Server, token: &str) -> (u16, Option<Stream>) {
        let client = reqwest::blocking::Client::builder()
            .no_proxy()
            .build()
            .expect("client");
        let resp = client
            .get(format!("http://{}/api/events/stream?after=0", s.addr))
            .bearer_auth(token)
            .send()
            .expect("stream");
        let status = resp.status().as_u16();
        if status != 200 {
            return (status, None);
        }
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(resp).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        (status, Some(Stream(rx)))
    }

    /// The next line within `limit`: `Ok(None)` when the stream ended.
    fn line(&self, limit: Duration) -> Result<Option<String>, ()> {
        match self.0.recv_timeout(limit) {
            Ok(l) => Ok(Some(l)),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Ok(None),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Err(()),
        }
    }
}

/// Finding 7: a revoked token's open `/api/events/stream` kept receiving
/// events (argv included). It now ends within a second or so of the
/// revocation, while events keep coming; and one principal holds at most
/// four streams.
#[test]
fn a_revoked_tokens_event_stream_ends_and_one_principal_holds_at_most_four() {
    let s = Server::start(&[]);
    let (id, read) = token(&s, "read");
    let (_, Some(stream)) = Stream::open(&s, &read) else {
        panic!("the stream opens");
    };
    // It streams: the ledger's first events arrive.
    let first = stream.line(Duration::from_secs(10));
    assert!(matches!(first, Ok(Some(_))), "{first:?}");
    let revoked = Command::new(bin())
        .env("TREEWARDEN_DATA_DIR", s.data_dir())
        .args(["token", "revoke", &id.to_string()])
        .output()
        .expect("revoke");
    assert!(revoked.status.success());
    let t0 = Instant::now();
    let mut ended = false;
    while t0.elapsed() < Duration::from_secs(10) {
        // Events keep coming: a tree a second.
        let (status, _) = s.post("/api/trees", Some(&s.body("true")));
        assert_eq!(status, 201);
        match stream.line(Duration::from_millis(300)) {
            Ok(None) => {
                ended = true;
                break;
            }
            Ok(Some(_)) => {
                // Drain what is already there.
                while let Ok(Some(_)) = stream.line(Duration::from_millis(1)) {}
            }
            Err(()) => {}
        }
    }
    assert!(
        ended,
        "the revoked token's stream still runs after {:?}",
        t0.elapsed()
    );
    say(&format!(
        "stream ended {:?} after the revocation",
        t0.elapsed()
    ));
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    // A new stream with it is refused outright.
    assert_eq!(Stream::open(&s, &read).0, 401);

    let (_, other) = token(&s, "read");
    let held: Vec<Stream> = (0..4)
        .map(|_| Stream::open(&s, &other).1.expect("one of its four streams"))
        .collect();
    assert_eq!(Stream::open(&s, &other).0, 503, "a fifth of the same token");
    assert_eq!(
        Stream::open(&s, &s.token).0,
        200,
        "another principal's still opens"
    );
    drop(held);
}

/// Finding 4: `--allow-command` was a denylist of the environment: only
/// PATH and LD_* were refused, so BASH_ENV (or SHELLOPTS=xtrace with a PS4
/// holding `$(...)`) ran code of the request's choosing before an allowed
/// bash script. Now a request may set only what `--allow-env` names, and
/// the tree inherits only the safe set of the service's own environment.
#[test]
fn under_allow_command_the_environment_is_an_allowlist_too() {
    let dir = tempfile::tempdir().expect("tempdir");
    let evil = dir.path().join("evil.sh");
    let pwned = dir.path().join("pwned");
    std::fs::write(&evil, format!("touch {}\n", pwned.display())).expect("evil.sh");
    let evil_s = evil.to_str().expect("utf-8");
    let s = Server::start_with_env(
        &[
            "--allow-command",
            "bash",
            "--allow-env",
            "GREETING",
            "--allow-env",
            "TW_TEST_MARK",
        ],
        // The service's own environment: not handed to an allowed command.
        &[("BASH_ENV", evil_s)],
    );
    let out = dir.path().join("out");
    let script = format!("echo \"$GREETING\" > {}", out.display());
    for env in [
        json!({ "BASH_ENV": evil_s }),
        json!({ "SHELLOPTS": "xtrace", "PS4": format!("$(. {evil_s})") }),
        json!({ "PATH": "/tmp" }),
        json!({ "LD_PRELOAD": "/tmp/x.so" }),
    ] {
        let (status, v) = s.post(
            "/api/trees",
            Some(&json!({ "argv": ["bash", "-c", &script], "env": env })),
        );
        assert_eq!(status, 422, "{env}: {v}");
        assert!(
            v["error"]
                .as_str()
                .is_some_and(|e| e.contains("--allow-env")),
            "{v}"
        );
    }
    let (status, v) = s.post(
        "/api/trees",
        Some(&json!({
            "argv": ["bash", "-c", &script],
            "env": { "GREETING": "hello", "TW_TEST_MARK": s.mark },
        })),
    );
    assert_eq!(status, 201, "{v}");
    assert!(
        wait_until(Duration::from_secs(10), || std::fs::read_to_string(&out)
            .is_ok_and(|t| t == "hello\n")),
        "the allowed command ran with the allowed variable"
    );
    assert!(
        !pwned.exists(),
        "BASH_ENV from the service's environment ran"
    );
}

fn file_len(p: &std::path::Path) -> u64 {
    std::fs::metadata(p).map(|m| m.len()).unwrap_or(0)
}

/// Finding 6: 30 spawns with a 1 MiB argv, each refused by the kernel
/// (E2BIG), added 59 MB to the ledger in 1.4 s. Now argv is stored up to
/// 64 KiB, with the whole argv's length and SHA-256, so a refused spawn
/// costs a bounded row, and the record still proves which argv it was.
#[test]
fn a_huge_argv_is_stored_bounded_with_its_length_and_digest() {
    use sha2::Digest;
    let s = Server::start(&[]);
    let data = s.data_dir();
    let ledger_bytes = || {
        ["ledger.db", "ledger.db-wal"]
            .iter()
            .map(|f| file_len(&data.join(f)))
            .sum::<u64>()
    };
    // One argument over the kernel's 128 KiB cap per argument: E2BIG.
    let huge = "A".repeat(900 * 1024);
    let argv = ["echo".to_string(), huge.clone()];
    let whole = format!("echo\0{huge}");
    let digest = hex::encode(sha2::Sha256::digest(whole.as_bytes()));
    let before = ledger_bytes();
    let mut ids = Vec::new();
    for _ in 0..10 {
        let (status, v) = s.post("/api/trees", Some(&json!({ "argv": argv })));
        assert!(status >= 400, "refused: {status} {v}");
        if let Some(id) = v["tree"].as_i64() {
            ids.push(id);
        }
    }
    let grown = ledger_bytes().saturating_sub(before);
    say(&format!(
        "10 refused 900 KiB spawns grew the ledger by {grown} bytes"
    ));
    assert!(
        grown < 10 * 400 * 1024,
        "{grown} bytes for 10 refused spawns"
    );
    // The record: each tree's argv kept to 64 KiB, with what was cut.
    let out = Command::new(bin())
        .env("TREEWARDEN_DATA_DIR", &data)
        .args(["export", "--format", "ndjson"])
        .output()
        .expect("export");
    let events = crate::util::parse_ndjson(&String::from_utf8_lossy(&out.stdout));
    let created: Vec<&Value> = events
        .iter()
        .filter(|e| e["kind"] == "tree.created")
        .collect();
    assert_eq!(created.len(), 10, "each refused spawn is still recorded");
    for e in created {
        let d = &e["data"];
        assert_eq!(
            d["argv_truncated"]["bytes"],
            whole.len(),
            "{}",
            d["argv_truncated"]
        );
        assert_eq!(d["argv_truncated"]["args"], 2);
        assert_eq!(d["argv_truncated"]["sha256"], digest.as_str());
        let kept: usize = d["argv"]
            .as_array()
            .expect("argv")
            .iter()
            .filter_map(Value::as_str)
            .map(str::len)
            .sum();
        assert!(kept <= 64 * 1024, "{kept}");
    }
}

/// Finding 3, the ledger's reserve: a tree that filled the ledger's
/// filesystem through its own output made root's kill fail ("ledger full")
/// and closed dispatch. The service now refuses new logged trees while the
/// data dir's free space is under a floor, before the ledger's own writes
/// could fail; nothing of a refused spawn is written.
#[test]
fn under_the_free_space_floor_new_logged_trees_are_refused_and_nothing_is_written() {
    // A floor no disk here meets: every logged spawn is under it.
    let s = Server::start(&["--min-free", "1000000T"]);
    let (status, v) = s.post("/api/trees", Some(&s.body("sleep 60")));
    assert_eq!(status, 503, "{v}");
    let err = v["error"].as_str().unwrap_or_default();
    assert!(
        err.contains("--min-free") && err.contains("MiB free"),
        "{v}"
    );
    let out = Command::new(bin())
        .env("TREEWARDEN_DATA_DIR", s.data_dir())
        .args(["ls", "--all", "--json"])
        .output()
        .expect("ls");
    let trees: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(
        trees.as_array().map(Vec::len),
        Some(0),
        "nothing recorded: {trees}"
    );
    assert!(s.marked().is_empty());
}

/// Finding 5, in part: one principal may not hold every tree the host can
/// run. Past `--max-trees-per-user` live trees its spawns are refused (503)
/// until one ends; an admin is not capped.
#[test]
fn one_principal_holds_at_most_its_cap_of_live_trees() {
    let s = Server::start(&["--max-trees-per-user", "2"]);
    let (_, spawn) = token(&s, "spawn");
    let post = |tok: &str, path: &str, body: Option<&Value>| {
        let client = reqwest::blocking::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(60))
            .build()
            .expect("client");
        let mut req = client.post(s.url(path)).bearer_auth(tok);
        if let Some(b) = body {
            req = req.json(b);
        }
        let r = req.send().expect("POST");
        let status = r.status().as_u16();
        (status, r.json::<Value>().unwrap_or(Value::Null))
    };
    let body = s.body("sleep 60");
    let mut mine = Vec::new();
    for _ in 0..2 {
        let (status, v) = post(&spawn, "/api/trees", Some(&body));
        assert_eq!(status, 201, "{v}");
        mine.push(v["id"].as_i64().expect("id"));
    }
    let (status, v) = post(&spawn, "/api/trees", Some(&body));
    assert_eq!(status, 503, "a third: {v}");
    assert!(
        v["error"]
            .as_str()
            .is_some_and(|e| e.contains("--max-trees-per-user")),
        "{v}"
    );
    let (status, v) = post(&s.token, "/api/trees", Some(&body));
    assert_eq!(status, 201, "the admin is not capped: {v}");
    let (status, v) = post(
        &spawn,
        &format!("/api/trees/{}/kill?grace=100ms", mine[0]),
        None,
    );
    assert_eq!(status, 200, "{v}");
    let (status, v) = post(&spawn, "/api/trees", Some(&body));
    assert_eq!(status, 201, "one ended, one more: {v}");
}

/// Finding 3: `--log-max` was enforced once a tick, so a 3-second `yes`
/// wrote 1.9 GB into the data dir before it was cut. Now the logs are
/// capped as they are written (inotify on the logs directory): sampled as
/// the tree writes, the log never holds more than a small multiple of
/// its cap, while the writer's own output (measured by `wc -c` on a tee)
/// is far past it.
#[test]
fn a_fast_writers_log_is_capped_as_it_writes_not_once_a_tick() {
    use std::os::unix::fs::MetadataExt;
    // The default tick (1 s), so the tick cap alone would show.
    let s = Server::start(&["--log-max", "1M", "--scan-interval", "1s"]);
    let count = s.data_dir().join("written");
    let script = format!(
        "yes tw-log-writer | head -c 400000000 | tee /dev/stderr | wc -c > {}",
        count.display()
    );
    let (status, v) = s.post("/api/trees", Some(&s.body(&script)));
    assert_eq!(status, 201, "{v}");
    let id = v["id"].as_i64().expect("id");
    let log = s.data_dir().join("logs").join(format!("tree-{id}.log"));
    let mut most = 0u64;
    let done = wait_until(Duration::from_secs(60), || {
        if let Ok(m) = std::fs::metadata(&log) {
            most = most.max(m.blocks() * 512);
        }
        std::fs::read_to_string(&count).is_ok_and(|c| !c.trim().is_empty())
    });
    assert!(done, "the writer finished");
    let written: u64 = std::fs::read_to_string(&count)
        .expect("count")
        .trim()
        .parse()
        .expect("a number");
    assert_eq!(written, 400_000_000, "the workload's own count");
    // The tick alone let the log reach nearly all of it (394 MB measured);
    // inotify holds it to what the writer writes between two rounds of
    // capping: 24 MB on a quiet machine, 149 MB measured under the whole
    // suite's load on two cores (the capping thread waits for a core).
    assert!(
        most < 200 << 20,
        "the log held {most} bytes at most, cap 1 MiB (written: {written})"
    );
}
