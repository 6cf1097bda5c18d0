//! Helpers shared by the integration tests: bounded condition polls (never
//! fixed sleeps), temp dirs, and the path of the real binary.

#![allow(dead_code)]

use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

/// The `treewarden` binary built for this test run.
pub fn bin() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_BIN_EXE_treewarden"))
}

/// Polls `cond` every few milliseconds until it holds or `limit` passes.
/// Returns whether it held. Waits on a condition, never a fixed sleep.
pub fn wait_until(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5)); // the poll interval of wait_until
    }
}

/// Whether a process with this pid exists and is not a zombie.
pub fn pid_alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            // The state follows the last ')' (comm may contain parentheses).
            let state = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.trim_start().chars().next());
            !matches!(state, Some('Z') | Some('X') | None)
        }
        Err(_) => false,
    }
}

/// Whether this test process runs as root (needed for ns_last_pid and cgroups).
pub fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// Prints the standard skip line; tests that lack a capability say so.
/// Written to the real stderr, past libtest's output capture, so that a
/// skip shows in every CI log instead of only under `--nocapture`.
pub fn skip(why: &str) {
    say(&format!("skipped: {why}"));
}

/// One line to the real stderr, past libtest's output capture (which only
/// takes the `print!` family).
pub fn say(line: &str) {
    use std::io::Write;
    let mut err = std::io::stderr().lock();
    let _ = writeln!(err, "{line}");
}

/// Live (non-zombie) processes whose environment carries
/// `TW_TEST_MARK=<mark>`, sorted. Tests give every process of their trees a
/// unique mark, so survivors are found independently of treewarden (a
/// member it failed to see is still found here).
pub fn marked_processes(mark: &str) -> Vec<i32> {
    let needle = format!("TW_TEST_MARK={mark}");
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(environ) = std::fs::read(entry.path().join("environ")) else {
            continue;
        };
        if environ.split(|b| *b == 0).any(|v| v == needle.as_bytes()) && pid_alive(pid) {
            out.push(pid);
        }
    }
    out.sort_unstable();
    out
}

/// Ends every live process carrying `TW_TEST_MARK=<mark>` by its pid
/// (SIGKILL), then waits (bounded) until none is left.
pub fn end_marked(mark: &str) {
    for pid in marked_processes(mark) {
        if let Some(pid) = rustix::process::Pid::from_raw(pid) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        }
    }
    wait_until(Duration::from_secs(5), || marked_processes(mark).is_empty());
}

/// Waits for a child with a bound; kills it (by pid) and reaps it if the
/// bound passes. `None` then: the child did not exit by itself in time.
pub fn wait_child(child: &mut Child, limit: Duration) -> Option<ExitStatus> {
    let mut status = None;
    wait_until(limit, || {
        status = child.try_wait().ok().flatten();
        status.is_some()
    });
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    status
}

/// Sends a signal to a process we started, by its pid.
pub fn signal(pid: u32, sig: rustix::process::Signal) {
    if let Some(pid) = rustix::process::Pid::from_raw(pid as i32) {
        let _ = rustix::process::kill_process(pid, sig);
    }
}

/// A child that is killed (by its pid, SIGKILL) and reaped when dropped,
/// so a failing assertion cannot leave it running.
pub struct KillOnDrop(pub Child);

impl KillOnDrop {
    pub fn id(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        // `Child::kill` is kill(2) by this child's pid; a child that has
        // already been reaped is neither signalled nor waited for again.
        if self.0.try_wait().ok().flatten().is_none() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// The lines of an NDJSON export, each parsed (a malformed line fails the
/// test).
pub fn parse_ndjson(text: &str) -> Vec<serde_json::Value> {
    text.lines()
        .map(|l| serde_json::from_str(l).expect("ndjson line"))
        .collect()
}

/// Reads one HTTP/1.1 request from a test stub's connection: its path and
/// its body (by `content-length`). `None` when the peer closed or sent
/// something short. For the OTLP/HTTP stubs, which only ever see POSTs.
pub fn read_http_request(
    reader: &mut std::io::BufReader<std::net::TcpStream>,
) -> Option<(String, Vec<u8>)> {
    use std::io::{BufRead, Read};
    let mut line = String::new();
    if reader.read_line(&mut line).unwrap_or(0) == 0 {
        return None;
    }
    let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
    let mut len = 0usize;
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).unwrap_or(0) == 0 {
            return None;
        }
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':')
            && k.eq_ignore_ascii_case("content-length")
        {
            len = v.trim().parse().unwrap_or(0);
        }
    }
    let mut body = vec![0u8; len];
    reader.read_exact(&mut body).ok()?;
    Some((path, body))
}
