//! Helpers shared by the integration tests: bounded condition polls (never
//! fixed sleeps), temp dirs, and the path of the real binary.

#![allow(dead_code)]

use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

/// The `treewarden` binary built for this test run.
pub fn bin() -> std::path::PathBuf {
    // The kernel lane names the binary beside the test binary it copied
    // (tests/vm/run): a copy elsewhere must not reach back to the checkout
    // this was compiled in, which the guest may not see.
    std::env::var_os("TREEWARDEN_TEST_BIN")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from(env!("CARGO_BIN_EXE_treewarden")))
}

/// The factor every poll bound is scaled by: `TREEWARDEN_TEST_POLL_SCALE`
/// (the kernel lane, tests/vm/run, sets it: a TCG guest runs several times
/// slower than the host), else 1. It lengthens only how long a poll may
/// wait for its condition, never a sleep: a condition that holds early ends
/// the poll early.
pub fn poll_scale() -> f64 {
    static SCALE: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *SCALE.get_or_init(|| {
        std::env::var("TREEWARDEN_TEST_POLL_SCALE")
            .ok()
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|f| f.is_finite() && *f >= 1.0)
            .unwrap_or(1.0)
    })
}

/// A poll bound scaled by [`poll_scale`].
pub fn scaled(limit: Duration) -> Duration {
    limit.mul_f64(poll_scale())
}

/// How much busier than its CPUs the host is now: the 1-minute load
/// average over the CPUs, at least 1 (an idle host) and at most 5. A bound
/// on how fast shared work finishes (the figure, met on a quiet
/// host) is multiplied by it, and the measured figure printed either way.
pub fn load_factor() -> f64 {
    let load = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| {
            l.split_whitespace()
                .next()
                .and_then(|x| x.parse::<f64>().ok())
        })
        .unwrap_or(0.0);
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    (load / cpus).clamp(1.0, 5.0)
}

/// Polls `cond` every few milliseconds until it holds or `limit` (scaled
/// by [`poll_scale`]) passes. Returns whether it held. Waits on a
/// condition, never a fixed sleep.
pub fn wait_until(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + scaled(limit);
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

/// Whether every one of `pids` stays alive for all of `span` (polled, as
/// [`wait_until`]). The negative checks ("the tree is left alone") name
/// the pids they saw instead of recounting markers: a marked process in
/// the middle of an `execve` shows an empty `/proc/<pid>/environ` for a
/// moment, so a recount can miss a live process (CI saw it once).
pub fn stay_alive(pids: &[i32], span: Duration) -> bool {
    !pids.is_empty() && !wait_until(span, || pids.iter().any(|p| !pid_alive(*p)))
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
        let Some(environ) = read_environ(pid) else {
            continue;
        };
        if environ.split(|b| *b == 0).any(|v| v == needle.as_bytes()) && pid_alive(pid) {
            out.push(pid);
        }
    }
    out.sort_unstable();
    out
}

/// A process's environment. A user process in the middle of an `execve`
/// shows an empty one for a moment (the new image's is not laid out yet):
/// an empty read of a live process that is not a kernel thread is read
/// again, a bounded few times, so a marked process is not missed (nor
/// "gone") because it was exec'ing.
fn read_environ(pid: i32) -> Option<Vec<u8>> {
    const PF_KTHREAD: u64 = 0x0020_0000;
    let path = format!("/proc/{pid}/environ");
    for _ in 0..20 {
        let environ = std::fs::read(&path).ok()?;
        if !environ.is_empty() {
            return Some(environ);
        }
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // Fields after the comm: state ppid pgrp session tty tpgid flags.
        let flags = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(6))
            .and_then(|f| f.parse::<u64>().ok())?;
        if flags & PF_KTHREAD != 0 || !pid_alive(pid) {
            return Some(environ);
        }
        std::thread::sleep(Duration::from_millis(1)); // an execve lays out the new environment within this
    }
    Some(Vec::new())
}

/// Ends every live process carrying `TW_TEST_MARK=<mark>` by its pid
/// (SIGKILL), again for each one found after a pass (a member forked while
/// the pass ran), until none is left or a bounded while has passed.
/// Returns what is still alive (empty: all ended).
pub fn end_marked(mark: &str) -> Vec<i32> {
    let mut left = Vec::new();
    wait_until(Duration::from_secs(10), || {
        left = marked_processes(mark);
        for pid in &left {
            if let Some(pid) = rustix::process::Pid::from_raw(*pid) {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
            }
        }
        left.is_empty()
    });
    left
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

/// Whether this run is the kernel lane's (tests/vm/run sets
/// `TREEWARDEN_LANE=1` in the guest).
pub fn in_lane() -> bool {
    std::env::var_os("TREEWARDEN_LANE").is_some_and(|v| v == "1")
}

/// The cgroup v2 directory this process lives in, by mountinfo and
/// `/proc/self/cgroup` (independently of the product's own reader).
pub fn own_cgroup() -> Option<std::path::PathBuf> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let mount = mountinfo.lines().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        if !right.starts_with("cgroup2 ") {
            return None;
        }
        left.split_whitespace().nth(4).map(std::path::PathBuf::from)
    })?;
    let cgroup = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let rel = cgroup.lines().find_map(|l| l.strip_prefix("0::"))?;
    let dir = mount.join(rel.trim_start_matches('/'));
    dir.join("cgroup.procs").exists().then_some(dir)
}

/// Where the tests make their cgroups: `TREEWARDEN_TEST_CGROUP_PARENT`
/// when set, else this process's own cgroup. The kernel lane sets it: its
/// guest starts the test process as systemd starts a delegated unit, in
/// `/system.slice/treewarden.service`, and does there what the product does
/// (proc/sys/linux/delegation.rs): it moves the process into the leaf
/// `treewarden.service/harness` and enables every controller for its
/// siblings, so the tests' cgroups (children of `treewarden.service`) get
/// them. A test cgroup made next to the test process in its own cgroup
/// would get none (cgroup v2's "no internal processes" rule).
pub fn test_cgroup_parent() -> Option<std::path::PathBuf> {
    match std::env::var_os("TREEWARDEN_TEST_CGROUP_PARENT") {
        Some(p) => {
            let p = std::path::PathBuf::from(p);
            p.join("cgroup.procs").exists().then_some(p)
        }
        None => own_cgroup(),
    }
}

/// A free-standing `sweep.started` event (`candidates` set to `n`), for
/// tests that need events in a chain and nothing else of them.
pub fn sweep_event(n: u64) -> treewarden::ledger::Event {
    treewarden::ledger::Event::SweepStarted(treewarden::ledger::event::SweepStarted {
        candidates: n,
        pid: std::process::id(),
    })
}

/// A free-standing `sweep.refused` event carrying `reason` (any text: a
/// pad of a given size, escapes, non-ASCII).
pub fn refused_event(reason: &str) -> treewarden::ledger::Event {
    treewarden::ledger::Event::SweepRefused(treewarden::ledger::event::Reason {
        reason: reason.to_string(),
    })
}

/// The pids a workload wrote to `path` (one a line), once there are `n`
/// (bounded: 20 s).
pub fn printed_pids(path: &std::path::Path, n: usize) -> Vec<i32> {
    let mut pids = Vec::new();
    let ok = wait_until(Duration::from_secs(20), || {
        pids = std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect();
        pids.len() >= n
    });
    assert!(ok, "{}: {pids:?}", path.display());
    pids
}
