//! Custody end to end: the real `treewarden` binary owns real process trees
//! of every awkward shape, on the cgroup boundary and on the forced session
//! boundary, and each test ends with zero survivors.
//!
//! Survivors are found independently of treewarden: every process of a test
//! tree carries a unique marker in its environment (`TW_TEST_MARK`), and
//! [`Env::marked`] reads `/proc/*/environ` for it. A member treewarden
//! failed to see is still found this way. At the end each test (and, as a
//! last line of defence, `Drop`) ends its leftovers by pid, never by name.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::Value;

use crate::util::{bin, is_root, pid_alive, signal, skip, wait_child, wait_until};

static SEQ: AtomicUsize = AtomicUsize::new(0);

/// One test's world: a temp dir, its own ledger, its own cgroup root (on the
/// cgroup boundary) and a marker for its processes.
pub struct Env {
    pub dir: tempfile::TempDir,
    pub boundary: &'static str,
    cgroup_root: Option<PathBuf>,
    pub mark: String,
    stderr_files: std::sync::Mutex<std::collections::HashMap<u32, PathBuf>>,
    /// Every `run` [`Env::spawn_run`] started: (pid, start time in ticks),
    /// so that the drop can end one a failed test left running (by its
    /// checked identity, never a recycled pid).
    runs: std::sync::Mutex<Vec<(u32, u64)>>,
}

/// The cgroup v2 directory the tests make their cgroups in
/// ([`crate::util::test_cgroup_parent`]), if a hierarchy exists.
pub fn own_cgroup_dir() -> Option<PathBuf> {
    crate::util::test_cgroup_parent()
}

impl Env {
    /// `None` (after printing "skipped: ...") when the boundary cannot be
    /// formed on this host.
    pub fn new(boundary: &'static str) -> Option<Env> {
        let dir = tempfile::tempdir().expect("temp dir");
        let n = SEQ.fetch_add(1, Ordering::SeqCst);
        let mark = format!("tw-{}-{n}-{}", std::process::id(), boundary);
        let cgroup_root = if boundary == "cgroup" {
            let Some(own) = own_cgroup_dir().filter(|_| is_root()) else {
                skip("cgroup boundary needs root and a writable cgroup v2 hierarchy");
                return None;
            };
            let root = own.join(format!("tw-test-{}-{n}", std::process::id()));
            if let Err(e) = std::fs::create_dir(&root) {
                skip(&format!(
                    "cannot create a test cgroup under {}: {e}",
                    own.display()
                ));
                return None;
            }
            Some(root)
        } else {
            None
        };
        Some(Env {
            dir,
            boundary,
            cgroup_root,
            mark,
            stderr_files: Default::default(),
            runs: Default::default(),
        })
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// The working directory of every command this env runs.
    pub fn dir(&self) -> &std::path::Path {
        self.dir.path()
    }

    pub fn ledger_path(&self) -> PathBuf {
        self.data_dir().join("ledger.db")
    }

    /// The binary with this env's data dir, boundary and cgroup root.
    pub fn cmd(&self) -> Command {
        self.cmd_for(bin())
    }

    /// Any program, with the environment [`Env::cmd`] gives the binary.
    pub fn cmd_for(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new(program);
        c.current_dir(self.dir.path())
            .env("TREEWARDEN_DATA_DIR", self.data_dir())
            .env("TREEWARDEN_BOUNDARY", self.boundary)
            .env_remove("TREEWARDEN_CGROUP_ROOT")
            .env("TREEWARDEN_BUSY_TIMEOUT", "300ms");
        if let Some(root) = &self.cgroup_root {
            c.env("TREEWARDEN_CGROUP_ROOT", root);
        }
        c
    }

    /// `treewarden run [extra] -- env TW_TEST_MARK=... sh -c script`, started
    /// in the background. Its stderr goes to a file, not a pipe: survivors
    /// left alive as evidence inherit it and would hold a pipe open.
    pub fn spawn_run(&self, extra: &[&str], script: &str) -> Child {
        let mut c = self.cmd();
        c.arg("run")
            .args(extra)
            .arg("--")
            .args(self.marked_argv(script));
        let n = SEQ.fetch_add(1, Ordering::SeqCst);
        let err_path = self.dir.path().join(format!("run-{n}.stderr"));
        let err = std::fs::File::create(&err_path).expect("stderr file");
        c.stdin(Stdio::null()).stdout(Stdio::null()).stderr(err);
        let child = c.spawn().expect("start treewarden run");
        self.stderr_files
            .lock()
            .expect("lock")
            .insert(child.id(), err_path);
        if let Some(start) = start_ticks(child.id()) {
            self.runs
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((child.id(), start));
        }
        child
    }

    /// What a `run` started by [`Env::spawn_run`] wrote on stderr.
    pub fn stderr_of(&self, child: &Child) -> String {
        let path = self
            .stderr_files
            .lock()
            .expect("lock")
            .get(&child.id())
            .cloned();
        path.and_then(|p| std::fs::read_to_string(p).ok())
            .unwrap_or_default()
    }

    pub fn marked_argv(&self, script: &str) -> Vec<String> {
        vec![
            "env".into(),
            format!("TW_TEST_MARK={}", self.mark),
            "sh".into(),
            "-c".into(),
            script.into(),
        ]
    }

    /// Runs the binary to completion.
    pub fn output(&self, args: &[&str]) -> Output {
        self.cmd().args(args).output().expect("run treewarden")
    }

    /// Live (non-zombie) processes carrying this env's marker.
    pub fn marked(&self) -> Vec<i32> {
        crate::util::marked_processes(&self.mark)
    }

    /// Waits until at least `n` marked processes are alive. The bound
    /// grows with `n` (each poll reads every process's environment, and a
    /// shell forking 300 children on a loaded host takes its time): 20 s,
    /// or 100 ms a process where that is more.
    pub fn wait_marked(&self, n: usize) -> bool {
        let per_process = Duration::from_millis(100) * u32::try_from(n).unwrap_or(u32::MAX);
        wait_until(Duration::from_secs(20).max(per_process), || {
            self.marked().len() >= n
        })
    }

    /// Waits until at least `n` marked processes are alive and returns the
    /// pids of the poll that saw them (None: not within the bound of
    /// [`Env::wait_marked`]).
    pub fn marked_at_least(&self, n: usize) -> Option<Vec<i32>> {
        let per_process = Duration::from_millis(100) * u32::try_from(n).unwrap_or(u32::MAX);
        let mut seen = Vec::new();
        wait_until(Duration::from_secs(20).max(per_process), || {
            seen = self.marked();
            seen.len() >= n
        })
        .then_some(seen)
    }

    /// Waits until no marked process is alive.
    pub fn wait_none_marked(&self) -> bool {
        wait_until(Duration::from_secs(10), || self.marked().is_empty())
    }

    /// The audit trail, parsed.
    pub fn export(&self) -> Vec<Value> {
        let out = self.output(&["export", "--format", "ndjson"]);
        assert!(
            out.status.success(),
            "export failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        crate::util::parse_ndjson(&String::from_utf8_lossy(&out.stdout))
    }

    /// Every SIGKILL in the trail is preceded by a `kill.authorized` of the
    /// same tree. Returns the number of SIGKILLs checked.
    pub fn assert_kills_authorized(&self) -> usize {
        let events = self.export();
        let mut authorized: HashSet<i64> = HashSet::new();
        let mut kills = 0;
        for e in &events {
            let tree = e["tree"].as_i64().unwrap_or(-1);
            match e["kind"].as_str() {
                Some("kill.authorized") => {
                    authorized.insert(tree);
                }
                Some("signal.sent") if e["data"]["signal"] == "SIGKILL" => {
                    kills += 1;
                    assert!(
                        authorized.contains(&tree),
                        "SIGKILL without a prior kill.authorized for tree {tree}: {e}"
                    );
                }
                _ => {}
            }
        }
        kills
    }

    /// The first event of this kind in the trail (`Null` when none).
    pub fn first_event(&self, kind: &str) -> Value {
        self.export()
            .into_iter()
            .find(|e| e["kind"] == kind)
            .unwrap_or(Value::Null)
    }

    /// `treewarden verify` passes on this env's ledger.
    pub fn assert_verifies(&self, label: &str) {
        let out = self.output(&["verify"]);
        assert!(
            out.status.success(),
            "[{label}] verify: {}",
            String::from_utf8_lossy(&out.stdout)
        );
    }

    pub fn kinds(&self) -> Vec<String> {
        self.export()
            .iter()
            .filter_map(|e| e["kind"].as_str().map(String::from))
            .collect()
    }

    /// Makes the fifo `go` in the env's dir: a workload's `read x < go`
    /// blocks on it until [`Env::release_once_recorded`] writes a line.
    pub fn make_go_fifo(&self) {
        let fifo = self.dir.path().join("go");
        rustix::fs::mkfifoat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
        )
        .expect("mkfifo go");
    }

    /// Writes a line to the fifo `go` once the ledger records `pid` as a
    /// member of tree 1 running `sh`: the workload goes on only after the
    /// record has seen it (a fixed sleep only hoped so). Bounded, and never
    /// blocking on a fifo without its reader.
    pub fn release_once_recorded(&self, label: &str, pid: i64) {
        assert!(
            wait_until(Duration::from_secs(10), || {
                self.show(1)["members"].as_array().is_some_and(|m| {
                    m.iter()
                        .any(|m| m["pid"].as_i64() == Some(pid) && m["cmdline"][0] == "sh")
                })
            }),
            "[{label}] {pid} was never recorded as sh: {}",
            self.show(1)
        );
        let fifo = self.dir.path().join("go");
        let sent = wait_until(Duration::from_secs(10), || {
            use std::os::unix::fs::OpenOptionsExt as _;
            std::fs::OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_NONBLOCK)
                .open(&fifo)
                .and_then(|mut f| std::io::Write::write_all(&mut f, b"go\n"))
                .is_ok()
        });
        assert!(sent, "[{label}] {pid} never opened the fifo");
    }

    /// `show --json` of a tree.
    pub fn show(&self, tree: i64) -> Value {
        let out = self.output(&["show", &tree.to_string(), "--json"]);
        assert!(
            out.status.success(),
            "show failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("show json")
    }

    /// Ends every marked process by pid (cleanup, and the last line of defence).
    /// Ends what a test left: every `run` it started that still runs (a
    /// test that failed before its `run` exited: its teardown would go on
    /// after the test, and a run that failed closed leaves its tree at ppid
    /// 1), then every marked process, until none is left (a tree forking
    /// while it is ended gets new members after the first pass).
    pub fn end_leftovers(&self) {
        let runs = std::mem::take(&mut *self.runs.lock().unwrap_or_else(|e| e.into_inner()));
        for (pid, start) in runs {
            // Only while it is the process spawned (same start time), and
            // not a zombie: a reaped pid may belong to someone else now.
            if start_ticks(pid) == Some(start) && crate::util::pid_alive(pid as i32) {
                signal(pid, rustix::process::Signal::KILL);
            }
        }
        let left = crate::util::end_marked(&self.mark);
        if !left.is_empty() {
            crate::util::say(&format!("marked processes left behind: {left:?}"));
        }
    }

    pub fn cgroup_root(&self) -> Option<&Path> {
        self.cgroup_root.as_deref()
    }
}

/// A process's start time (`/proc/<pid>/stat` field 22), its identity
/// beside the pid.
fn start_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(19)?.parse().ok()
}

impl Drop for Env {
    fn drop(&mut self) {
        self.end_leftovers();
        if let Some(root) = &self.cgroup_root {
            // A cgroup stays busy (EBUSY) until the kernel has let go of its
            // dying tasks: retry for a bounded while, also on a failing test.
            let removed = wait_until(Duration::from_secs(10), || {
                if let Ok(dir) = std::fs::read_dir(root) {
                    for e in dir.flatten() {
                        if e.path().is_dir() {
                            let _ = std::fs::remove_dir(e.path());
                        }
                    }
                }
                std::fs::remove_dir(root).is_ok() || !root.exists()
            });
            if !removed {
                crate::util::say(&format!("test cgroup {} left behind", root.display()));
            }
        }
    }
}

const BOTH: [&str; 2] = ["cgroup", "session"];

/// Starts `script` under `run`, waits for `expect` marked processes, sends
/// SIGTERM to `run`, and checks that the whole tree is gone, `run` exited
/// 143, and every SIGKILL was authorized first.
fn torn_down_on_sigterm(boundary: &'static str, script: &str, expect: usize) {
    let Some(env) = Env::new(boundary) else {
        return;
    };
    let mut run = env.spawn_run(&["--grace", "100ms", "--quiet"], script);
    assert!(
        env.wait_marked(expect),
        "[{boundary}] tree did not reach {expect} processes: {:?}",
        env.marked()
    );
    signal(run.id(), rustix::process::Signal::TERM);
    let status = wait_child(&mut run, Duration::from_secs(30)).expect("run exits");
    let err = env.stderr_of(&run);
    assert_eq!(
        status.code(),
        Some(143),
        "[{boundary}] run exit; stderr: {err}"
    );
    assert!(
        env.wait_none_marked(),
        "[{boundary}] survivors: {:?}",
        env.marked()
    );
    assert!(
        env.assert_kills_authorized() > 0,
        "[{boundary}] a SIGTERM-ignoring tree needs a forced kill"
    );
    let trees = env.output(&["ls", "--all", "--json"]);
    let trees: Value = serde_json::from_slice(&trees.stdout).expect("ls json");
    assert_eq!(trees[0]["state"], "ended", "[{boundary}] {trees}");
    assert_evidence_complete(&env, boundary);
    if let Some(root) = env.cgroup_root() {
        let leftover = || {
            std::fs::read_dir(root)
                .map(|d| d.flatten().filter(|e| e.path().is_dir()).count())
                .unwrap_or(0)
        };
        assert!(
            wait_until(Duration::from_secs(5), || leftover() == 0),
            "[{boundary}] the tree's cgroup directory is removed once it is empty"
        );
    }
}

/// What a forced teardown leaves in the ledger: a survivor snapshot taken
/// (`taken_at`) before its `kill.authorized` though written after the kill,
/// and, once the tree is verified empty, an exit for every member it saw.
fn assert_evidence_complete(env: &Env, label: &str) {
    let events = env.export();
    let at = |e: &Value, key: &str| -> std::time::SystemTime {
        humantime::parse_rfc3339_weak(e[key].as_str().or(e["data"][key].as_str()).expect(key))
            .expect("rfc3339")
    };
    let auth = events
        .iter()
        .find(|e| e["kind"] == "kill.authorized")
        .unwrap_or_else(|| panic!("[{label}] no kill.authorized"));
    let snap = events
        .iter()
        .find(|e| e["kind"] == "survivors.recorded")
        .unwrap_or_else(|| panic!("[{label}] no survivor snapshot"));
    assert!(
        at(snap, "taken_at") <= at(auth, "at"),
        "[{label}] the snapshot was taken before the authorization: {snap} {auth}"
    );
    assert!(
        snap["seq"].as_i64() < auth["seq"].as_i64(),
        "[{label}] the snapshot precedes its authorization in the chain"
    );
    if label == "session" {
        // Without a cgroup the freeze is SIGSTOP to the group: a signal,
        // recorded like the rest, ahead of the authorization.
        let stop = events
            .iter()
            .find(|e| e["kind"] == "signal.sent" && e["data"]["signal"] == "SIGSTOP")
            .unwrap_or_else(|| panic!("[{label}] the SIGSTOP freeze is not recorded"));
        assert!(
            stop["seq"].as_i64() < auth["seq"].as_i64(),
            "[{label}] {stop}"
        );
    }
    let killed: HashSet<i64> = auth["data"]["targets"]
        .as_array()
        .expect("targets")
        .iter()
        .flat_map(|t| t["identities"].as_array().cloned().unwrap_or_default())
        .filter_map(|i| i["pid"].as_i64())
        .collect();
    let snapped: HashSet<i64> = snap["data"]["survivors"]
        .as_array()
        .expect("survivors")
        .iter()
        .filter_map(|s| s["identity"]["pid"].as_i64())
        .collect();
    assert!(
        killed.is_subset(&snapped),
        "[{label}] every authorized target is in the snapshot: {killed:?} vs {snapped:?}"
    );
    let show = env.show(1);
    let members = show["members"].as_array().expect("members");
    assert!(!members.is_empty(), "[{label}] {show}");
    let open: Vec<&Value> = members
        .iter()
        .filter(|m| m["exited_at"].is_null())
        .collect();
    assert!(
        open.is_empty(),
        "[{label}] members without an exit: {open:?}"
    );
    let exits = events
        .iter()
        .filter(|e| e["kind"] == "member.exited")
        .count();
    assert_eq!(
        exits,
        members.len(),
        "[{label}] one member.exited per member"
    );
    // Exit statuses are not asserted: which process reaps a killed member
    // (its own parent, or `run` as subreaper) and whether that happens
    // before the tree's end is recorded is a race the kernel decides.
}

const IGNORE_TERM_GRANDCHILDREN: &str =
    "trap '' TERM; sh -c 'trap \"\" TERM; sleep 600 & sleep 600 & wait' & sleep 600 & wait";

#[test]
fn sigterm_ignoring_grandchildren_are_killed_on_both_boundaries() {
    for b in BOTH {
        torn_down_on_sigterm(b, IGNORE_TERM_GRANDCHILDREN, 5);
    }
}

#[test]
fn setsid_and_setpgid_descendants_are_killed_on_both_boundaries() {
    let script = "trap '' TERM; \
        setsid sh -c 'trap \"\" TERM; sleep 600 & wait' & \
        python3 -c 'import os,signal,time; os.setpgid(0,0); signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)' & \
        sleep 600 & wait";
    for b in BOTH {
        torn_down_on_sigterm(b, script, 5);
    }
}

#[test]
fn daemonizing_double_fork_is_killed_on_both_boundaries() {
    // The middle process exits at once: the daemon is re-parented to `run`
    // (the subreaper) in a session of its own.
    let script =
        "trap '' TERM; (setsid sh -c 'trap \"\" TERM; sleep 600 & wait' &); sleep 600 & wait";
    for b in BOTH {
        torn_down_on_sigterm(b, script, 4);
    }
}

#[test]
fn wide_and_deep_trees_are_killed_on_both_boundaries() {
    let wide = "trap '' TERM; i=0; while [ $i -lt 300 ]; do sleep 600 & i=$((i+1)); done; wait";
    // Forty levels, each a sleep that is the parent of the next level.
    let deep = "trap '' TERM; cat > deep.sh <<'EOF'\n\
        trap '' TERM\n\
        if [ \"$1\" -gt 0 ]; then sh ./deep.sh $(($1 - 1)) & fi\n\
        exec sleep 600\n\
        EOF\n\
        sh ./deep.sh 40 & wait";
    for b in BOTH {
        torn_down_on_sigterm(b, wide, 301);
        torn_down_on_sigterm(b, deep, 42);
    }
}

#[test]
fn a_tree_that_keeps_forking_is_killed_on_both_boundaries() {
    let script = "trap '' TERM; while :; do sleep 600 & sleep 0.01; done";
    for b in BOTH {
        torn_down_on_sigterm(b, script, 20);
    }
}

#[test]
fn leader_exiting_first_or_killed_first_still_ends_the_tree() {
    for b in BOTH {
        let Some(env) = Env::new(b) else { continue };
        // The leader exits 7 once its children run; the children ignore SIGTERM.
        let script = "trap '' TERM; sleep 600 & sleep 600 & \
                      while [ ! -e ready ]; do sleep 0.01; done; exit 7";
        let mut run = env.spawn_run(&["--grace", "100ms", "--quiet"], script);
        assert!(env.wait_marked(3), "[{b}] {:?}", env.marked());
        std::fs::write(env.dir.path().join("ready"), b"").expect("ready file");
        let status = wait_child(&mut run, Duration::from_secs(30)).expect("run exits");
        assert_eq!(
            status.code(),
            Some(7),
            "[{b}] the root's status: {}",
            env.stderr_of(&run)
        );
        assert!(
            env.wait_none_marked(),
            "[{b}] survivors: {:?}",
            env.marked()
        );
        // The children ignore SIGTERM: only an authorized SIGKILL ends them.
        let kills_after_exit = env.assert_kills_authorized();
        assert!(
            kills_after_exit > 0,
            "[{b}] the SIGTERM-ignoring children left by the exiting leader need a forced kill"
        );

        // The leader killed first: 128 + 9.
        let script = "trap '' TERM; sleep 600 & sleep 600 & \
                      while [ ! -e ready2 ]; do sleep 0.01; done; kill -9 $$";
        let mut run = env.spawn_run(&["--grace", "100ms", "--quiet"], script);
        assert!(env.wait_marked(3), "[{b}] {:?}", env.marked());
        std::fs::write(env.dir.path().join("ready2"), b"").expect("ready file");
        let status = wait_child(&mut run, Duration::from_secs(30)).expect("run exits");
        assert_eq!(status.code(), Some(137), "[{b}] {}", env.stderr_of(&run));
        assert!(
            env.wait_none_marked(),
            "[{b}] survivors: {:?}",
            env.marked()
        );
        // The same ledger: the second tree's forced kill adds to the first's.
        let kills_after_kill = env.assert_kills_authorized();
        assert!(
            kills_after_kill > kills_after_exit,
            "[{b}] the SIGTERM-ignoring children left by the killed leader need a forced kill \
             ({kills_after_kill} SIGKILLs in the ledger, {kills_after_exit} before this tree)"
        );
    }
}

#[test]
fn run_passes_exit_status_and_times_out_with_124() {
    let Some(env) = Env::new("session") else {
        return;
    };
    let out = env
        .cmd()
        .args(["run", "--", "sh", "-c", "echo hello; exit 3"])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(3));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hello\n");
    let mut run = env.spawn_run(
        &["--timeout", "300ms", "--grace", "100ms"],
        "trap '' TERM; sleep 600 & wait",
    );
    let status = wait_child(&mut run, Duration::from_secs(30)).expect("run exits");
    assert_eq!(status.code(), Some(124), "{}", env.stderr_of(&run));
    assert!(env.wait_none_marked());
}

#[test]
fn bad_input_exits_2_and_runs_own_failures_125() {
    let Some(env) = Env::new("session") else {
        return;
    };
    // `run`'s own failures are 125 (its other statuses are the command's,
    // as with timeout(1)); a flag clap refuses gets clap's whole message,
    // with its suggestion.
    for (args, needle) in [
        (vec!["run", "--"], "empty command"),
        (
            vec!["run", "--grace", "5x", "--", "true"],
            "malformed duration",
        ),
        (
            vec!["run", "--no-such-flag", "--", "true"],
            "--no-such-flag",
        ),
        (vec!["run", "--timout", "5s", "--", "true"], "--timeout"),
        (
            vec!["run", "--signal", "KILL", "--", "true"],
            "authorization",
        ),
    ] {
        let out = env.output(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(125), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    // Read commands never create a ledger: a wrong --data-dir is named.
    let out = env.output(&["ls"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("check --data-dir"));
    assert!(!env.ledger_path().exists());
    assert_eq!(env.output(&["run", "--", "true"]).status.code(), Some(0));
    for (args, needle) in [
        (vec!["kill", "999"], "unknown tree 999"),
        (vec!["show", "999"], "unknown tree 999"),
        (vec!["resolve", "999", "--note", "x"], "unknown tree 999"),
    ] {
        let out = env.output(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    }
    // Exec failures: 127 not found, 126 not executable, recorded as spawn_failed.
    let out = env.output(&["run", "--", "./definitely-not-here"]);
    assert_eq!(
        out.status.code(),
        Some(127),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::write(env.dir.path().join("noexec"), b"#!/bin/sh\n").expect("file");
    let out = env.output(&["run", "--", "./noexec"]);
    assert_eq!(
        out.status.code(),
        Some(126),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let kinds = env.kinds();
    assert_eq!(
        kinds.iter().filter(|k| *k == "tree.spawn_failed").count(),
        2,
        "{kinds:?}"
    );
}

#[test]
fn owner_killed_then_sweep_ends_the_orphan_and_spares_live_owners() {
    for b in BOTH {
        let Some(env) = Env::new(b) else { continue };
        let mut orphaned =
            env.spawn_run(&["--grace", "100ms", "--quiet"], IGNORE_TERM_GRANDCHILDREN);
        assert!(env.wait_marked(5), "[{b}] {:?}", env.marked());
        let orphan_pids = env.marked();
        // A second tree whose owner stays alive.
        let other = Env {
            dir: tempfile::tempdir().expect("tmp"),
            boundary: b,
            cgroup_root: None,
            mark: format!("{}-live", env.mark),
            stderr_files: Default::default(),
            runs: Default::default(),
        };
        let mut live = {
            let mut c = env.cmd();
            c.args(["run", "--quiet", "--"])
                .args(other.marked_argv("sleep 600 & wait"));
            c.stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            c.spawn().expect("second run")
        };
        assert!(other.wait_marked(2));

        signal(orphaned.id(), rustix::process::Signal::KILL);
        wait_child(&mut orphaned, Duration::from_secs(10)).expect("owner dies");
        assert!(
            orphan_pids.iter().all(|p| pid_alive(*p)),
            "[{b}] the tree outlives its owner until the sweep"
        );

        let out = env.output(&["sweep", "--grace", "100ms", "--json"]);
        assert!(
            out.status.success(),
            "[{b}] sweep: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let report: Value = serde_json::from_slice(&out.stdout).expect("sweep json");
        assert_eq!(
            report["orphans"].as_array().map(Vec::len),
            Some(1),
            "[{b}] {report}"
        );
        assert_eq!(report["owned"], 1, "[{b}] {report}");
        assert!(
            env.wait_none_marked(),
            "[{b}] survivors: {:?}",
            env.marked()
        );
        assert_eq!(
            other.marked().len(),
            2,
            "[{b}] the live owner's tree is untouched"
        );
        assert!(
            env.assert_kills_authorized() > 0,
            "[{b}] the orphan's SIGTERM-ignoring tree needs the sweep's forced kill"
        );
        let kinds = env.kinds();
        assert!(
            kinds.contains(&"sweep.orphan_found".to_string()),
            "{kinds:?}"
        );

        signal(live.id(), rustix::process::Signal::TERM);
        wait_child(&mut live, Duration::from_secs(20)).expect("live run exits");
        assert!(other.wait_none_marked());
    }
}

#[test]
fn authorization_write_failing_under_a_held_lock_skips_the_kill_and_closes_dispatch() {
    for b in BOTH {
        let Some(env) = Env::new(b) else { continue };
        let mut run = env.spawn_run(
            &["--grace", "100ms", "--quiet"],
            "trap '' TERM; sleep 600 & wait",
        );
        assert!(env.wait_marked(2), "[{b}] {:?}", env.marked());
        let survivors = env.marked();

        // Another connection holds the write lock past the busy timeout.
        let lock = rusqlite::Connection::open(env.ledger_path()).expect("open ledger");
        lock.execute_batch("BEGIN IMMEDIATE")
            .expect("take the write lock");
        signal(run.id(), rustix::process::Signal::TERM);
        assert_failed_closed(&env, &mut run, &survivors, b);
        // Dispatch is refused while the tree is unsettled (reads still work).
        assert_dispatch_refused(&env, b);

        // Once writable, the sweep completes the teardown with authority.
        lock.execute_batch("ROLLBACK").expect("release the lock");
        drop(lock);
        assert_settled_by_sweep(&env, b);
        let out = env.output(&["run", "--", "true"]);
        assert_eq!(
            out.status.code(),
            Some(0),
            "[{b}] dispatch reopens: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// `run` was told to stop while the ledger refused writes: it failed closed —
/// exit 125 saying the forced kill was skipped, every survivor alive.
fn assert_failed_closed(env: &Env, run: &mut Child, survivors: &[i32], label: &str) {
    let status = wait_child(run, Duration::from_secs(60)).expect("run exits");
    let err = env.stderr_of(run);
    assert_eq!(status.code(), Some(125), "[{label}] {err}");
    assert!(err.contains("forced kill skipped"), "[{label}] {err}");
    assert!(
        survivors.iter().all(|p| pid_alive(*p)),
        "[{label}] survivors are left alive as evidence"
    );
}

/// New work is refused host-wide (`--dispatch-scope host`) while a tree is
/// unsettled (nothing settled on the way: `--no-settle`).
fn assert_dispatch_refused(env: &Env, label: &str) {
    let out = env.output(&[
        "run",
        "--dispatch-scope",
        "host",
        "--no-settle",
        "--",
        "true",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(125), "[{label}] {err}");
    assert!(err.contains("dispatch refused"), "[{label}] {err}");
}

/// Once the ledger takes writes, a sweep completes the teardown with
/// authority: nothing of the tree is left, every SIGKILL was authorized.
fn assert_settled_by_sweep(env: &Env, label: &str) {
    let out = env.output(&["sweep", "--grace", "100ms"]);
    assert!(
        out.status.success(),
        "[{label}] sweep: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(env.wait_none_marked(), "[{label}] {:?}", env.marked());
    assert!(
        env.assert_kills_authorized() > 0,
        "[{label}] no authorized SIGKILL"
    );
}

/// A small tmpfs, unmounted on drop.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(dir: &Path, size: &str) -> Option<Tmpfs> {
        std::fs::create_dir_all(dir).ok()?;
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        ok.then(|| Tmpfs(dir.to_path_buf()))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

#[test]
fn authorization_write_failing_on_a_full_disk_skips_the_kill_until_space_returns() {
    if !is_root() {
        skip("a full disk needs a tmpfs mount, which needs root");
        return;
    }
    let Some(env) = Env::new("session") else {
        return;
    };
    let Some(_fs) = Tmpfs::mount(&env.data_dir(), "2m") else {
        skip("mount -t tmpfs failed");
        return;
    };
    // Without the ledger's reserve: the write fails, and fails closed.
    let mut run = env.spawn_run(
        &["--grace", "100ms", "--quiet", "--ledger-reserve", "0"],
        "trap '' TERM; sleep 600 & wait",
    );
    assert!(env.wait_marked(2), "{:?}", env.marked());
    let survivors = env.marked();
    // Fill the disk to the last byte.
    let filler = env.data_dir().join("filler");
    let _ = Command::new("dd")
        .args(["if=/dev/zero", "bs=4k"])
        .arg(format!("of={}", filler.display()))
        .stderr(Stdio::null())
        .status();
    signal(run.id(), rustix::process::Signal::TERM);
    assert_failed_closed(&env, &mut run, &survivors, "full disk");
    assert_dispatch_refused(&env, "full disk");

    std::fs::remove_file(&filler).expect("free space");
    assert_settled_by_sweep(&env, "full disk");
    let out = env.output(&["verify"]);
    assert!(
        out.status.success(),
        "verify: {}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// Issue 24, finding 3: whatever fills the disk (a tree's log, a tree's
/// files, anyone's), the ledger keeps its reserve (its WAL preallocated at
/// open, room no other writer can take), so the kill's authorization
/// commits and the teardown completes instead of failing closed. Ground
/// truth: the marked survivors are gone, and the filler really left no
/// byte free.
#[test]
fn on_a_disk_filled_by_another_writer_the_ledgers_reserve_still_authorizes_the_kill() {
    if !is_root() {
        skip("a full disk needs a tmpfs mount, which needs root");
        return;
    }
    let Some(env) = Env::new("session") else {
        return;
    };
    let Some(_fs) = Tmpfs::mount(&env.data_dir(), "24m") else {
        skip("mount -t tmpfs failed");
        return;
    };
    let mut run = env.spawn_run(
        &["--grace", "100ms", "--quiet"],
        "trap '' TERM; sleep 600 & wait",
    );
    assert!(env.wait_marked(2), "{:?}", env.marked());
    let filler = env.data_dir().join("filler");
    let _ = Command::new("dd")
        .args(["if=/dev/zero", "bs=4k"])
        .arg(format!("of={}", filler.display()))
        .stderr(Stdio::null())
        .status();
    let free = rustix::fs::statvfs(env.data_dir()).expect("statvfs");
    assert_eq!(free.f_bavail, 0, "the disk is full");
    signal(run.id(), rustix::process::Signal::TERM);
    let status = wait_child(&mut run, Duration::from_secs(60)).expect("run exits");
    let err = env.stderr_of(&run);
    assert_ne!(status.code(), Some(125), "not failed closed: {err}");
    assert!(env.wait_none_marked(), "{:?}", env.marked());
    assert!(env.assert_kills_authorized() > 0, "no authorized SIGKILL");
    std::fs::remove_file(&filler).expect("free space");
    let out = env.output(&["verify"]);
    assert!(
        out.status.success(),
        "verify: {}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn resolve_reopens_dispatch_after_an_operator_decision() {
    let Some(env) = Env::new("session") else {
        return;
    };
    let mut run = env.spawn_run(
        &["--grace", "100ms", "--quiet"],
        "trap '' TERM; sleep 600 & wait",
    );
    assert!(env.wait_marked(2));
    let lock = rusqlite::Connection::open(env.ledger_path()).expect("open ledger");
    lock.execute_batch("BEGIN IMMEDIATE").expect("lock");
    signal(run.id(), rustix::process::Signal::TERM);
    assert_eq!(
        wait_child(&mut run, Duration::from_secs(30)).and_then(|s| s.code()),
        Some(125)
    );
    lock.execute_batch("ROLLBACK").expect("unlock");
    drop(lock);
    // The operator ends the survivors by hand, then records the decision.
    env.end_leftovers();
    let out = env.output(&["resolve", "1", "--note", "killed by hand after inspection"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = env.output(&["run", "--", "true"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(env.kinds().contains(&"tree.resolved".to_string()));
}

#[test]
fn a_recycled_pgid_is_never_signalled_by_the_sweep() {
    if !is_root() {
        skip("forcing pid reuse through /proc/sys/kernel/ns_last_pid needs root");
        return;
    }
    let Some(env) = Env::new("session") else {
        return;
    };
    // `run` starts under a parent that reaps whatever is orphaned to it, so
    // the tree's pids are freed once its processes die, whoever our pid
    // namespace's init is (one that never reaps would pin them as zombies).
    let mut argv = vec![
        crate::util::bin().display().to_string(),
        "run".into(),
        "--quiet".into(),
        "--".into(),
    ];
    argv.extend(env.marked_argv("sleep 600 & wait"));
    let parent = ReapingParent::start(&env, &argv);
    assert!(env.wait_marked(2));
    let show = env.show(1);
    let pgid = show["tree"]["pgid"]
        .as_i64()
        .or_else(|| show["pgid"].as_i64())
        .expect("pgid") as i32;
    // The owner dies; then the tree's processes, by their pids.
    signal(parent.pid as u32, rustix::process::Signal::KILL);
    assert!(wait_until(Duration::from_secs(10), || !pid_alive(
        parent.pid
    )));
    env.end_leftovers();
    assert!(wait_until(Duration::from_secs(5), || !pid_alive(pgid)));
    assert!(
        wait_until(Duration::from_secs(5), || !Path::new(&format!(
            "/proc/{pgid}"
        ))
        .exists()),
        "pid {pgid} was never reaped"
    );

    // An unrelated process takes the pgid as its own new group.
    let mut impostor = None;
    for _ in 0..50 {
        std::fs::write("/proc/sys/kernel/ns_last_pid", format!("{}", pgid - 1))
            .expect("ns_last_pid");
        // Marked, so that `Env`'s drop ends it by pid should the test fail
        // before its own end (treewarden never reads the marker).
        let child = Command::new("setsid")
            .args(["sleep", "600"])
            .env("TW_TEST_MARK", &env.mark)
            .current_dir(env.dir.path())
            .spawn()
            .expect("impostor");
        if child.id() as i32 == pgid {
            impostor = Some(child);
            break;
        }
        let mut child = child;
        let _ = child.kill();
        let _ = child.wait();
    }
    let Some(mut impostor) = impostor else {
        skip("could not win the pid race in 50 tries");
        return;
    };
    assert!(
        wait_until(Duration::from_secs(5), || {
            std::fs::read_to_string(format!("/proc/{pgid}/stat"))
                .map(|s| {
                    s.rsplit_once(')')
                        .map(|(_, r)| r.split_whitespace().nth(2) == Some(&pgid.to_string()))
                        .unwrap_or(false)
                })
                .unwrap_or(false)
        }),
        "the impostor leads group {pgid}"
    );

    let out = env.output(&["sweep", "--grace", "100ms", "--json"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(pid_alive(pgid), "the impostor was signalled: {text}");
    let events = env.export();
    // The first owner died by SIGKILL before any teardown: any signal that
    // was sent at all would have gone to the impostor's group.
    let signalled: Vec<&Value> = events
        .iter()
        .filter(|e| {
            e["kind"] == "signal.sent"
                && e["data"]["result"]
                    .as_str()
                    .is_some_and(|r| r.starts_with("sent"))
        })
        .collect();
    assert!(
        signalled.is_empty(),
        "no signal may reach the recycled group: {signalled:?} {text}"
    );
    assert!(
        events.iter().any(|e| e["kind"] == "sweep.refused"),
        "{text}"
    );
    let ls: Value =
        serde_json::from_slice(&env.output(&["ls", "--all", "--json"]).stdout).expect("ls");
    assert_eq!(ls[0]["state"], "vanished", "{ls}");
    let _ = impostor.kill();
    let _ = impostor.wait();
    parent.stop();
}

/// A copy of this test binary that is a child subreaper: it starts one
/// command and reaps everything orphaned to it until told to stop, so a test
/// can SIGKILL an owner and still get its tree's pids back for reuse.
struct ReapingParent {
    child: Child,
    dir: PathBuf,
    /// The pid of the command it started.
    pid: i32,
}

impl ReapingParent {
    fn start(env: &Env, argv: &[String]) -> ReapingParent {
        let dir = env.dir.path().join(format!(
            "reaping-parent-{}",
            SEQ.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir(&dir).expect("reaping parent dir");
        let child = env
            .cmd_for(std::env::current_exe().expect("test binary path"))
            .args([
                "--exact",
                "custody::reaping_parent",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("TW_REAPING_PARENT_DIR", &dir)
            .env(
                "TW_REAPING_PARENT_ARGV",
                serde_json::to_string(argv).expect("argv json"),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the reaping parent");
        let pid_file = dir.join("pid");
        let mut pid = None;
        wait_until(Duration::from_secs(10), || {
            pid = std::fs::read_to_string(&pid_file)
                .ok()
                .and_then(|s| s.trim().parse().ok());
            pid.is_some()
        });
        ReapingParent {
            child,
            pid: pid.expect("the reaping parent started its command"),
            dir,
        }
    }

    /// Tells it to stop; true when it exited cleanly within the bound (it
    /// is killed by pid otherwise).
    fn finish(&mut self) -> bool {
        let _ = std::fs::write(self.dir.join("stop"), b"");
        wait_child(&mut self.child, Duration::from_secs(10)).is_some_and(|s| s.success())
    }

    fn stop(mut self) {
        assert!(self.finish(), "the reaping parent did not stop cleanly");
    }
}

impl Drop for ReapingParent {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            self.finish();
        }
    }
}

/// Not a test on its own: the body of [`ReapingParent`].
#[test]
#[ignore = "runs only when re-executed by ReapingParent (TW_REAPING_PARENT_DIR)"]
fn reaping_parent() {
    let (Ok(dir), Ok(argv)) = (
        std::env::var("TW_REAPING_PARENT_DIR"),
        std::env::var("TW_REAPING_PARENT_ARGV"),
    ) else {
        skip("reaping_parent runs only when re-executed by ReapingParent");
        return;
    };
    let dir = PathBuf::from(dir);
    let argv: Vec<String> = serde_json::from_str(&argv).expect("argv json");
    rustix::process::set_child_subreaper(Some(rustix::process::getpid())).expect("subreaper");
    let err = std::fs::File::create(dir.join("stderr")).expect("stderr file");
    let child = Command::new(&argv[0])
        .args(&argv[1..])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(err)
        .spawn()
        .expect("start the command");
    std::fs::write(dir.join("pid.tmp"), child.id().to_string()).expect("pid file");
    std::fs::rename(dir.join("pid.tmp"), dir.join("pid")).expect("pid file");
    // Reap every child (the command and all orphans) until told to stop,
    // bounded so a lost test cannot leave this running.
    let stop = dir.join("stop");
    wait_until(Duration::from_secs(300), || {
        while let Ok(Some(_)) = rustix::process::wait(rustix::process::WaitOptions::NOHANG) {}
        stop.exists()
    });
    drop(child);
}

#[test]
fn kill_from_another_process_tears_the_tree_down_and_run_reports_it() {
    for b in BOTH {
        let Some(env) = Env::new(b) else { continue };
        let mut run = env.spawn_run(&["--quiet"], IGNORE_TERM_GRANDCHILDREN);
        assert!(env.wait_marked(5), "[{b}] {:?}", env.marked());
        let out = env.output(&["kill", "1", "--grace", "100ms"]);
        assert!(
            out.status.success(),
            "[{b}] kill: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("ended"),
            "[{b}] {}",
            String::from_utf8_lossy(&out.stdout)
        );
        assert!(
            env.wait_none_marked(),
            "[{b}] survivors: {:?}",
            env.marked()
        );
        // The root ignored SIGTERM, so it died of the authorized SIGKILL.
        let status = wait_child(&mut run, Duration::from_secs(20)).expect("run exits");
        assert_eq!(status.code(), Some(137), "[{b}] {}", env.stderr_of(&run));
        assert!(env.assert_kills_authorized() > 0);
        // Killing an ended tree is a no-op, not an error.
        let out = env.output(&["kill", "1"]);
        assert!(out.status.success());
    }
}

#[test]
fn die_with_parent_tears_the_tree_down_when_runs_parent_dies() {
    let Some(env) = Env::new("session") else {
        return;
    };
    // A parent shell starts `run --die-with-parent` and waits; the test then
    // kills that shell (by its pid) with SIGKILL.
    let argv = env.marked_argv("sleep 600 & wait");
    let quoted: Vec<String> = argv
        .iter()
        .map(|a| format!("'{}'", a.replace('\'', "'\\''")))
        .collect();
    let script = format!(
        "'{}' run --quiet --die-with-parent -- {} & wait",
        bin().display(),
        quoted.join(" ")
    );
    let mut parent = env
        .cmd_for("sh")
        .args(["-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("parent shell");
    assert!(env.wait_marked(2), "{:?}", env.marked());
    signal(parent.id(), rustix::process::Signal::KILL);
    let _ = parent.wait();
    assert!(
        env.wait_none_marked(),
        "the tree outlived run's parent: {:?}",
        env.marked()
    );
}

#[test]
fn a_survivor_the_ledger_never_recorded_is_still_killed_by_the_sweep() {
    // The write lock is held before the escapee exists, so the ledger never
    // hears of it; only `run` (which adopts it) sees it. The unsettled marker
    // names it, so the later sweep — which has no adoption rule — kills it
    // instead of settling the tree around a live escapee.
    let Some(env) = Env::new("session") else {
        return;
    };
    let script = "trap '' TERM; while [ ! -e go ]; do sleep 0.01; done; \
                  (setsid sh -c 'trap \"\" TERM; exec sleep 600' &); sleep 600 & wait";
    let mut run = env.spawn_run(
        &["--grace", "100ms", "--quiet", "--observer", "off"],
        script,
    );
    assert!(
        wait_until(Duration::from_secs(20), || {
            env.ledger_path().exists() && env.kinds().iter().any(|k| k == "member.observed")
        }),
        "the root was recorded"
    );
    let lock = rusqlite::Connection::open(env.ledger_path()).expect("open ledger");
    lock.execute_batch("BEGIN IMMEDIATE")
        .expect("take the write lock");
    std::fs::write(env.dir.path().join("go"), b"").expect("go file");
    let leader_of_own_session = |pid: i32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| {
                s.rsplit_once(')')
                    .map(|(_, r)| r.split_whitespace().nth(3) == Some(&pid.to_string()))
            })
            .unwrap_or(false)
    };
    let mut escapee = None;
    assert!(wait_until(Duration::from_secs(20), || {
        escapee = env.marked().into_iter().find(|p| {
            leader_of_own_session(*p)
                && std::fs::read_to_string(format!("/proc/{p}/cmdline"))
                    .is_ok_and(|c| c.starts_with("sleep"))
        });
        escapee.is_some()
    }));
    let escapee = escapee.expect("escapee");
    signal(run.id(), rustix::process::Signal::TERM);
    assert_failed_closed(&env, &mut run, &[escapee], "unrecorded escapee");
    lock.execute_batch("ROLLBACK").expect("release");
    drop(lock);
    assert_settled_by_sweep(&env, "unrecorded escapee");
    assert!(
        wait_until(Duration::from_secs(5), || !pid_alive(escapee)),
        "the escapee named only by the marker was killed"
    );
    let out = env.output(&["run", "--", "true"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "dispatch reopens: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_held_write_lock_costs_one_busy_timeout_not_one_per_member() {
    // 21 SIGTERM-ignoring members on the session boundary, 8 of them
    // escapees in sessions of their own (signalled one by one). Under a held
    // write lock every evidence write would wait out the busy timeout
    // (300ms here); after the first refusal the teardown stops trying
    // evidence writes, still attempts the authorization, and fails closed.
    let Some(env) = Env::new("session") else {
        return;
    };
    let script = "trap '' TERM; i=0; while [ $i -lt 12 ]; do sleep 600 & i=$((i+1)); done; \
                  j=0; while [ $j -lt 8 ]; do (setsid sh -c 'trap \"\" TERM; exec sleep 600' &); j=$((j+1)); done; wait";
    let mut run = env.spawn_run(
        &["--grace", "100ms", "--quiet", "--busy-timeout", "300ms"],
        script,
    );
    assert!(env.wait_marked(21), "{:?}", env.marked());
    assert!(
        wait_until(Duration::from_secs(20), || {
            env.kinds()
                .iter()
                .filter(|k| *k == "member.observed")
                .count()
                >= 21
        }),
        "run recorded the members"
    );
    let survivors = env.marked();
    let lock = rusqlite::Connection::open(env.ledger_path()).expect("open ledger");
    lock.execute_batch("BEGIN IMMEDIATE")
        .expect("take the write lock");
    let t0 = std::time::Instant::now();
    signal(run.id(), rustix::process::Signal::TERM);
    assert_failed_closed(&env, &mut run, &survivors, "21 members");
    let took = t0.elapsed();
    assert!(
        took < Duration::from_secs(10),
        "teardown under a held lock took {took:?}: evidence writes were retried per member"
    );
    lock.execute_batch("ROLLBACK").expect("release the lock");
    drop(lock);
    assert_settled_by_sweep(&env, "21 members");
}

#[test]
fn two_kills_of_one_tree_at_once_run_one_teardown() {
    // The teardown lease: the second `kill` waits for the first and then
    // finds the tree ended; without it both would signal, and one's thaw
    // could undo the other's freeze.
    for b in BOTH {
        let Some(env) = Env::new(b) else { continue };
        let mut run = env.spawn_run(&["--quiet"], IGNORE_TERM_GRANDCHILDREN);
        assert!(env.wait_marked(5), "[{b}] {:?}", env.marked());
        // Output to files, not pipes: the waits below are bounded.
        let kill = |n: usize| {
            let err_path = env.dir.path().join(format!("kill-{n}.stderr"));
            let err = std::fs::File::create(&err_path).expect("stderr file");
            let child = env
                .cmd()
                .args(["kill", "1", "--grace", "500ms"])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(err)
                .spawn()
                .expect("kill");
            (child, err_path)
        };
        let (first, second) = (kill(1), kill(2));
        for (mut k, err_path) in [first, second] {
            let status = wait_child(&mut k, Duration::from_secs(60));
            let err = std::fs::read_to_string(&err_path).unwrap_or_default();
            assert!(
                status.is_some_and(|s| s.success()),
                "[{b}] kill ({status:?}): {err}"
            );
        }
        assert!(env.wait_none_marked(), "[{b}] {:?}", env.marked());
        let status = wait_child(&mut run, Duration::from_secs(20)).expect("run exits");
        assert_eq!(status.code(), Some(137), "[{b}] {}", env.stderr_of(&run));
        let events = env.export();
        let terms = events
            .iter()
            .filter(|e| {
                e["kind"] == "signal.sent"
                    && e["data"]["signal"] == "SIGTERM"
                    && e["data"]["target_kind"] == "group"
            })
            .count();
        assert_eq!(terms, 1, "[{b}] one teardown signalled the group");
        let to_terminating = events
            .iter()
            .filter(|e| e["kind"] == "tree.state" && e["data"]["to"] == "terminating")
            .count();
        assert_eq!(to_terminating, 1, "[{b}] one teardown started");
        assert!(env.assert_kills_authorized() > 0);
    }
}

#[test]
fn a_member_seen_before_its_exec_is_shown_with_what_it_runs_now() {
    // A member first seen between its fork and its exec has its parent's
    // command line; once it execs, the ledger's row shows what it runs.
    let Some(env) = Env::new("session") else {
        return;
    };
    let mut run = env.spawn_run(
        &["--quiet", "--scan-interval", "50ms", "--observer", "off"],
        "(while [ ! -e go ]; do sleep 0.01; done; exec sleep 600) & wait",
    );
    // (tree JSON, members) once the tree is in the ledger.
    let show = |env: &Env| -> Option<(Value, Vec<Value>)> {
        let out = env.output(&["show", "1", "--json"]);
        let v: Value = serde_json::from_slice(&out.stdout).ok()?;
        let members = v["members"].as_array().cloned().unwrap_or_default();
        Some((v["tree"].clone(), members))
    };
    let mut subshell = None;
    assert!(
        wait_until(Duration::from_secs(20), || {
            let Some((tree, ms)) = show(&env) else {
                return false;
            };
            let root = tree["root_pid"].as_i64();
            subshell = ms
                .iter()
                .filter(|m| m["cmdline"][0] == "sh" && m["pid"].as_i64() != root)
                .filter_map(|m| m["pid"].as_i64())
                .find(|p| pid_alive(*p as i32) && Some(m_ppid(*p)) == root);
            subshell.is_some()
        }),
        "the subshell was recorded before its exec: {:?}",
        show(&env)
    );
    let subshell = subshell.expect("subshell pid");
    std::fs::write(env.dir.path().join("go"), b"").expect("go file");
    assert!(
        wait_until(Duration::from_secs(10), || {
            show(&env).is_some_and(|(_, ms)| {
                ms.iter().any(|m| {
                    m["pid"].as_i64() == Some(subshell)
                        && m["cmdline"] == serde_json::json!(["sleep", "600"])
                })
            })
        }),
        "the row of {subshell} shows `sleep 600` after its exec: {:?}",
        show(&env)
    );
    signal(run.id(), rustix::process::Signal::TERM);
    wait_child(&mut run, Duration::from_secs(20)).expect("run exits");
    assert!(env.wait_none_marked());
}

/// The parent pid of a live process (0 when it is gone).
fn m_ppid(pid: i64) -> i64 {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .and_then(|(_, r)| r.split_whitespace().nth(1).and_then(|p| p.parse().ok()))
        })
        .unwrap_or(0)
}

/// Inside a pid namespace entered without a new session (`unshare --pid
/// --fork`, as some CI sandboxes and containers run us), our own process
/// group and session live outside the namespace and read as 0. The signal
/// guard must treat that as "no group of ours to protect", not panic: an
/// earlier build died in rustix's `getpgrp` there and every teardown failed.
#[test]
fn teardown_works_inside_a_pid_namespace_whose_session_lies_outside_it() {
    if !crate::util::is_root() {
        skip("needs root to unshare a pid namespace");
        return;
    }
    for boundary in ["cgroup", "session"] {
        let Some(env) = Env::new(boundary) else {
            continue;
        };
        // Precondition: inside, the session really reads as 0.
        let probe = Command::new("unshare")
            .args(["--pid", "--fork", "--kill-child", "--mount-proc", "--"])
            .args(["sh", "-c", "read -r line < /proc/self/stat; echo \"$line\""])
            .output();
        let stat = match probe {
            Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout).into_owned(),
            Ok(out) => {
                skip(&format!(
                    "unshare --pid failed: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                ));
                return;
            }
            Err(e) => {
                skip(&format!("unshare (util-linux) not runnable: {e}"));
                return;
            }
        };
        let after_comm = stat.rsplit_once(')').map(|(_, rest)| rest).unwrap_or("");
        let fields: Vec<&str> = after_comm.split_whitespace().collect();
        assert_eq!(
            (fields.get(2), fields.get(3)),
            (Some(&"0"), Some(&"0")),
            "pgrp and session inside the namespace: {stat}"
        );

        // A shell is the namespace's init and treewarden its child, as
        // under a CI runner (`; exit $?` keeps the shell from exec'ing).
        let mut c = env.cmd_for("unshare");
        c.args(["--pid", "--fork", "--kill-child", "--mount-proc", "--"])
            .args(["sh", "-c", "\"$@\"; exit $?", "sh"])
            .arg(crate::util::bin())
            .args(["run", "--timeout", "300ms", "--grace", "100ms", "--"])
            .args(env.marked_argv("trap '' TERM; sleep 600 & sleep 600 & wait"))
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut child = c.spawn().expect("unshare");
        // `wait_child` kills and reaps `unshare` itself when the bound passes.
        let status = wait_child(&mut child, Duration::from_secs(30));
        let mut err = String::new();
        if let Some(mut pipe) = child.stderr.take() {
            use std::io::Read;
            let _ = pipe.read_to_string(&mut err);
        }
        // What catches a failed teardown: exit 124 (the timeout's teardown
        // completed) and, below, the authorized SIGKILL and `tree.ended`.
        assert_eq!(
            status.and_then(|s| s.code()),
            Some(124),
            "{boundary}: run inside the namespace: {err}"
        );
        // A cleanup check more than a test: once the namespace's init (the
        // shell) ends, the kernel kills everything left in the namespace,
        // so no marked process can outlive it whatever treewarden did.
        assert!(env.wait_none_marked(), "{boundary}: survivors");
        assert!(env.assert_kills_authorized() >= 1, "{boundary}: no SIGKILL");
        let kinds = env.kinds();
        assert!(
            kinds.iter().any(|k| k == "tree.ended"),
            "{boundary}: {kinds:?}"
        );
    }
}

/// `kill`, `sweep` and `resolve` spawn nothing, so a boundary this host cannot
/// form must not stop them (an earlier build resolved it, with a probe
/// cgroup, for every command and refused a teardown with exit 125). `run`
/// still refuses before any work.
#[test]
fn commands_that_only_signal_do_not_need_a_formable_boundary() {
    let Some(env) = Env::new("session") else {
        return;
    };
    let mut run = env.spawn_run(&["--quiet"], IGNORE_TERM_GRANDCHILDREN);
    assert!(env.wait_marked(5), "{:?}", env.marked());
    let no_cgroup = env.dir.path().join("not-a-cgroup");
    let unformable = |args: &[&str]| {
        env.cmd()
            .env("TREEWARDEN_BOUNDARY", "cgroup")
            .env("TREEWARDEN_CGROUP_ROOT", &no_cgroup)
            .args(args)
            .output()
            .expect("treewarden")
    };
    let out = unformable(&["run", "--", "true"]);
    assert_eq!(out.status.code(), Some(125), "run must refuse: {out:?}");
    let out = unformable(&["sweep", "--grace", "100ms"]);
    assert!(out.status.success(), "sweep: {out:?}");
    let out = unformable(&["kill", "1", "--grace", "100ms"]);
    assert!(out.status.success(), "kill: {out:?}");
    let status = wait_child(&mut run, Duration::from_secs(30)).expect("run exits");
    assert_ne!(status.code(), Some(0), "{}", env.stderr_of(&run));
    assert!(env.wait_none_marked(), "survivors: {:?}", env.marked());
    assert!(
        env.assert_kills_authorized() > 0,
        "a forced kill was needed"
    );
}

/// A tree that is empty when its root exits (`run -- true` and the like) is
/// proven empty without a walk of `/proc` (issue 13, session 5: `run` has no
/// child left and the cgroup is empty). The record must still be whole:
/// spawned, the root seen as a member and recorded as exited with the
/// status the workload chose, the tree ended with it, no cgroup and no
/// teardown lease left behind, the chain intact.
#[test]
fn a_tree_empty_when_its_root_exits_has_a_complete_record_on_both_boundaries() {
    for boundary in ["cgroup", "session"] {
        let Some(env) = Env::new(boundary) else {
            continue;
        };
        // The root exits once the record has seen it (a line on `go`).
        env.make_go_fifo();
        let mut run = env.spawn_run(&[], "echo $$ > root; read x < go; exit 7");
        let root = env.dir.path().join("root");
        assert!(
            wait_until(Duration::from_secs(10), || std::fs::read_to_string(&root)
                .is_ok_and(|r| r.ends_with('\n'))),
            "[{boundary}] the root never ran: {}",
            env.stderr_of(&run)
        );
        let pid: i64 = std::fs::read_to_string(&root)
            .expect("root")
            .trim()
            .parse()
            .expect("a pid");
        env.release_once_recorded(boundary, pid);
        let status = wait_child(&mut run, Duration::from_secs(30)).expect("run exits");
        assert_eq!(
            status.code(),
            Some(7),
            "[{boundary}] {}",
            env.stderr_of(&run)
        );
        let show = env.show(1);
        assert_eq!(show["tree"]["state"], "ended", "[{boundary}] {show}");
        assert_eq!(show["tree"]["exit"]["code"], 7, "[{boundary}] {show}");
        let root_pid = show["tree"]["root_pid"].as_i64().expect("root pid");
        let members = show["members"].as_array().expect("members");
        let root = members
            .iter()
            .find(|m| m["pid"].as_i64() == Some(root_pid))
            .unwrap_or_else(|| panic!("[{boundary}] the root is a member: {show}"));
        assert_eq!(root["exit"]["code"], 7, "[{boundary}] {root}");
        assert!(
            members.iter().all(|m| !m["exited_at"].is_null()),
            "[{boundary}] every member has its exit: {members:?}"
        );
        let events = env.export();
        let kinds: Vec<&str> = events
            .iter()
            .filter(|e| e["tree"] == 1)
            .filter_map(|e| e["kind"].as_str())
            .collect();
        assert_eq!(
            kinds.first(),
            Some(&"tree.created"),
            "[{boundary}] {kinds:?}"
        );
        assert!(kinds.contains(&"tree.spawned"), "[{boundary}] {kinds:?}");
        assert_eq!(kinds.last(), Some(&"tree.ended"), "[{boundary}] {kinds:?}");
        let root_exit = events
            .iter()
            .find(|e| {
                e["kind"] == "member.exited"
                    && e["data"]["identity"]["pid"].as_i64() == Some(root_pid)
            })
            .unwrap_or_else(|| panic!("[{boundary}] no member.exited for the root"));
        assert_eq!(
            root_exit["data"]["exit"]["code"], 7,
            "[{boundary}] {root_exit}"
        );
        assert!(
            !events
                .iter()
                .any(|e| e["kind"] == "signal.sent" || e["kind"] == "kill.authorized"),
            "[{boundary}] nothing was signalled"
        );
        if boundary == "cgroup" {
            let cg = show["tree"]["cgroup"].as_str().expect("cgroup recorded");
            assert!(!Path::new(cg).exists(), "[{boundary}] {cg} removed");
        }
        let leases: Vec<_> = std::fs::read_dir(env.data_dir().join("teardown"))
            .map(|d| d.filter_map(Result::ok).map(|e| e.path()).collect())
            .unwrap_or_default();
        assert!(
            leases.is_empty(),
            "[{boundary}] lease files left: {leases:?}"
        );
        assert!(env.marked().is_empty(), "[{boundary}] nothing of it runs");
        env.assert_verifies(boundary);
    }
}

/// Milliseconds from a tree's `terminating` to its `kill.authorized`: the
/// grace its teardown waited (its members ignore SIGTERM).
pub(crate) fn waited_grace_ms(events: &[Value], tree: i64) -> u64 {
    let at = |pred: &dyn Fn(&Value) -> bool| {
        events
            .iter()
            .find(|e| e["tree"] == tree && pred(e))
            .and_then(|e| humantime::parse_rfc3339(e["at"].as_str()?).ok())
            .unwrap_or_else(|| panic!("tree {tree}: no such event in {events:?}"))
    };
    let term = at(&|e| e["kind"] == "tree.state" && e["data"]["to"] == "terminating");
    let auth = at(&|e| e["kind"] == "kill.authorized");
    auth.duration_since(term)
        .expect("authorized after TERM")
        .as_millis() as u64
}

/// `kill` without `--grace` waits the grace recorded with the tree (its
/// run's `--grace 400ms`), not a default of its own (before issue 29 it
/// waited 5 s whatever the tree was given); `--grace` still overrides.
#[test]
fn kill_honours_the_grace_recorded_with_the_tree() {
    let Some(env) = Env::new("session") else {
        return;
    };
    let mut run = env.spawn_run(&["--quiet", "--grace", "400ms"], IGNORE_TERM_GRANDCHILDREN);
    assert!(env.wait_marked(5), "{:?}", env.marked());
    let out = env.output(&["kill", "1"]);
    assert!(
        out.status.success(),
        "kill: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(env.wait_none_marked(), "survivors: {:?}", env.marked());
    let _ = wait_child(&mut run, Duration::from_secs(20)).expect("run exits");
    let waited = waited_grace_ms(&env.export(), 1);
    // At least the recorded grace; far below the old 5 s default (bounded
    // by 4 s so a loaded host cannot make it pass by accident either way).
    assert!((400..4000).contains(&waited), "waited {waited} ms");
}

/// The test world's own cleanup, on the path a failed test takes (the env
/// dropped while its `run` still runs): the `run` is ended by its checked
/// identity, and every marked process with it — also members a tree forks
/// while the first pass runs (a loop forking, a double fork into a new
/// session), which one pass over the marked pids left alive at ppid 1.
#[test]
fn a_dropped_env_ends_its_run_and_every_marked_process() {
    use std::os::unix::process::ExitStatusExt as _;
    let Some(env) = Env::new("session") else {
        return;
    };
    let mark = env.mark.clone();
    let mut run = env.spawn_run(
        &["--quiet"],
        "trap '' TERM; (while :; do sleep 0.01; done) & \
         (setsid sh -c 'trap \"\" TERM; exec sleep 600' &); sleep 600 & wait",
    );
    assert!(env.wait_marked(4), "{:?}", env.marked());
    drop(env);
    let status = wait_child(&mut run, Duration::from_secs(10)).expect("run ended by the drop");
    assert_eq!(status.signal(), Some(9), "{status:?}");
    assert!(
        crate::util::marked_processes(&mark).is_empty(),
        "left: {:?}",
        crate::util::marked_processes(&mark)
    );
}
