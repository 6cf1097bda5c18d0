//! Helpers shared by the integration tests: bounded condition polls (never
//! fixed sleeps), temp dirs, and the path of the real binary.

#![allow(dead_code)]

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
