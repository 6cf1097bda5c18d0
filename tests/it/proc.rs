//! `src/proc` against real processes: held spawn, boundaries, guarded
//! signals, identity checks, the reaper.
//!
//! The subreaper flag and the reaper (one thread that waits for *every*
//! child) are process-wide, so tests that need them cannot share the test
//! binary's process with tests running in parallel threads: the reaper would
//! reap their children. Those tests re-run this very binary
//! (`current_exe() --exact proc::harness --ignored`) with the scenario in
//! `TW_PROC_SCENARIO`; the `#[ignore]`d [`harness`] test installs the reaper,
//! runs the scenario with assertions, and prints `TWRESULT ok` or
//! `TWRESULT skipped: <why>`. The outer test checks the exit status and that
//! line. Tests without a reaper reap their own children by pid
//! (`reap_child`, which waits on that one pid only).
//!
//! Every test runs its children in a temp dir, ends them by identity, group or
//! cgroup (a [`Cleanup`] guard does so even when an assertion fails) and
//! asserts that nothing it started is left running.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use treewarden::config::BoundaryChoice;
use treewarden::proc::{
    self, BoundaryKind, Delivery, ExecFailureKind, ExitStatus, GroupDelivery, GroupRecord,
    Identity, Liveness, ProcError, Reaper, Sig, SpawnSpec, SpawnStdio,
};

use crate::util::{pid_alive, skip, wait_until};

const LIMIT: Duration = Duration::from_secs(10);

fn own_pid() -> i32 {
    std::process::id() as i32
}

fn sh(script: &str, dir: &Path) -> SpawnSpec {
    SpawnSpec {
        argv: vec!["sh".into(), "-c".into(), script.into()],
        cwd: Some(dir.to_path_buf()),
        env: None,
        stdio: SpawnStdio::Null,
        container: None,
        cgroup_settings: Vec::new(),
        parent_settings: Vec::new(),
        log_file: None,
        umask: None,
        credentials: None,
        tty: None,
    }
}

/// A writable cgroup root for tree cgroups, or the reason there is none.
fn cgroup_root() -> Result<PathBuf, String> {
    let override_ = std::env::var_os("TREEWARDEN_CGROUP_ROOT").map(PathBuf::from);
    let root = proc::cgroup_root(override_.as_deref())
        .map_err(|e| e.to_string())?
        .ok_or_else(|| "no cgroup v2 hierarchy mounted".to_owned())?;
    proc::check_cgroup_writable(&root)?;
    if !proc::own_cgroup_dir()
        .ok()
        .flatten()
        .is_some_and(|d| d.exists())
    {
        return Err("cannot locate our own cgroup".into());
    }
    Ok(root)
}

/// A fresh tree cgroup path under the root (not created yet).
fn tree_cgroup(root: &Path) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    root.join(format!(
        "tree-test-{}-{}",
        own_pid(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

/// Ends whatever a test registered, by identity and cgroup, even on panic.
#[derive(Default)]
struct Cleanup {
    identities: Vec<Identity>,
    cgroups: Vec<PathBuf>,
}

impl Cleanup {
    fn pid(&mut self, pid: i32) {
        if let Ok(Some(id)) = proc::identity_of(pid) {
            self.identities.push(id);
        }
    }
    /// Kills everything registered and asserts none of it still runs.
    fn finish(&mut self) {
        for id in self.identities.drain(..) {
            let _ = proc::signal_process(&id, Sig::Kill);
            assert!(
                wait_until(LIMIT, || id.check() != Liveness::Same),
                "{id} still running after cleanup"
            );
            // Our own child: reap it (a no-op ECHILD error otherwise).
            let _ = proc::reap_child(id.pid, Some(Duration::from_millis(1)));
        }
        for cg in self.cgroups.drain(..) {
            if cg.exists() {
                let _ = proc::cgroup_kill(&cg);
                assert!(
                    proc::remove_cgroup_when_empty(&cg, LIMIT).unwrap_or(false),
                    "cgroup {} left behind",
                    cg.display()
                );
            }
        }
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for id in &self.identities {
                let _ = proc::signal_process(id, Sig::Kill);
            }
            for cg in &self.cgroups {
                let _ = proc::cgroup_kill(cg);
                let _ = proc::remove_cgroup_when_empty(cg, LIMIT);
            }
        } else {
            self.finish();
        }
    }
}

fn read_pids(file: &Path, expect: usize) -> Vec<i32> {
    let mut pids = Vec::new();
    assert!(
        wait_until(LIMIT, || {
            pids = std::fs::read_to_string(file)
                .unwrap_or_default()
                .lines()
                .filter_map(|l| l.trim().parse().ok())
                .collect();
            pids.len() >= expect
        }),
        "{} never listed {expect} pids",
        file.display()
    );
    pids
}

// ---------------------------------------------------------------------------
// The re-exec harness.

/// Runs `scenario` in a fresh copy of this test binary that installs the
/// subreaper and reaper. Returns false when the scenario skipped.
fn run_in_own_process(scenario: &str) -> bool {
    let exe = std::env::current_exe().expect("test binary path");
    let out = std::process::Command::new(exe)
        .args([
            "--exact",
            "proc::harness",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("TW_PROC_SCENARIO", scenario)
        .output()
        .expect("re-run the test binary");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "harness {scenario} failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    let result = stdout
        .lines()
        .find_map(|l| l.split_once("TWRESULT ").map(|(_, r)| r.trim()))
        .unwrap_or_else(|| panic!("harness {scenario} printed no result:\n{stdout}\n{stderr}"));
    for line in stdout.lines().filter(|l| l.contains("TWNOTE ")) {
        eprintln!("{scenario}: {line}");
    }
    if let Some(why) = result.strip_prefix("skipped: ") {
        skip(why);
        return false;
    }
    assert_eq!(result, "ok", "harness {scenario}");
    true
}

/// Not a test on its own: the body of the re-executed process (see the module doc).
#[test]
#[ignore = "runs only when re-executed by another test (TW_PROC_SCENARIO)"]
fn harness() {
    let Ok(scenario) = std::env::var("TW_PROC_SCENARIO") else {
        skip("harness runs only when re-executed by another test");
        return;
    };
    let reaper = Reaper::install().expect("install the reaper");
    let outcome = match scenario.as_str() {
        "group_kill_session" => group_kill_after_leader_reaped(reaper, BoundaryKind::Session),
        "group_kill_cgroup" => group_kill_after_leader_reaped(reaper, BoundaryKind::Cgroup),
        "escapee_session" => setsid_escapee(reaper, BoundaryKind::Session),
        "escapee_cgroup" => setsid_escapee(reaper, BoundaryKind::Cgroup),
        "reaper_keeps_exits" => reaper_keeps_exits(reaper),
        "clone3_denied" => clone3_denied(),
        other => panic!("unknown scenario {other}"),
    };
    // On its own line: libtest prints "test proc::harness ... " before us.
    match outcome {
        Ok(()) => println!("\nTWRESULT ok"),
        Err(why) => println!("\nTWRESULT skipped: {why}"),
    }
}

/// Spawns `script` on the given boundary (cgroup under a fresh tree cgroup).
fn spawn_tree(
    script: &str,
    dir: &Path,
    kind: BoundaryKind,
    cleanup: &mut Cleanup,
) -> Result<proc::Spawned, String> {
    let mut spec = sh(script, dir);
    let choice = match kind {
        BoundaryKind::Cgroup => BoundaryChoice::Cgroup,
        BoundaryKind::Session => BoundaryChoice::Session,
        BoundaryKind::Job => unreachable!("no job boundary on Linux"),
    };
    let root = cgroup_root();
    if let (BoundaryKind::Cgroup, Err(why)) = (kind, &root) {
        return Err(format!("no writable cgroup v2: {why}"));
    }
    let resolved = proc::resolve_boundary(choice, root.as_deref().ok())
        .map_err(|e| format!("cgroup boundary unavailable: {e}"))?;
    assert_eq!(resolved, kind);
    if kind == BoundaryKind::Cgroup {
        let root = root?;
        let cg = tree_cgroup(&root);
        cleanup.cgroups.push(cg.clone());
        spec.container = Some(cg);
    }
    let held = proc::spawn_held(&spec).expect("spawn held");
    assert_eq!((held.pgid, held.sid), (held.pid, held.pid));
    let spawned = held.release().expect("release");
    cleanup.pid(spawned.pid);
    Ok(spawned)
}

/// Waits until the reaper has reported all `pids` as adopted, unclaimed exits.
fn collect_unclaimed(reaper: &Reaper, pids: &[i32]) -> Vec<(i32, ExitStatus)> {
    let mut got: Vec<(i32, ExitStatus)> = Vec::new();
    assert!(
        wait_until(LIMIT, || {
            got = reaper.unclaimed();
            pids.iter().all(|p| got.iter().any(|(q, _)| q == p))
        }),
        "reaper did not report {pids:?} as unclaimed exits; got {got:?}"
    );
    got
}

/// Acceptance 1: SIGTERM-ignoring grandchildren survive their leader, whose
/// exit has been reaped; the recorded pgid (and cgroup) still kills them all.
fn group_kill_after_leader_reaped(reaper: &Reaper, kind: BoundaryKind) -> Result<(), String> {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cleanup = Cleanup::default();
    let script = "trap '' TERM; sleep 1000 & echo $! >> pids; sleep 1000 & echo $! >> pids";
    let root = spawn_tree(script, dir.path(), kind, &mut cleanup)?;
    let rec: GroupRecord = root.group_record();

    // The leader exits and is reaped before anyone signals anything.
    assert_eq!(
        reaper.wait_exit(root.pid, Some(LIMIT)),
        Some(ExitStatus::Exited(0))
    );
    assert!(
        proc::read_stat(root.pid).expect("read").is_none(),
        "leader reaped"
    );
    let kids = read_pids(&dir.path().join("pids"), 2);
    for &kid in &kids {
        cleanup.pid(kid);
        let stat = proc::read_stat(kid)
            .expect("read")
            .expect("grandchild alive");
        assert_eq!((stat.pgid, stat.sid), (rec.pgid, rec.sid));
        assert_eq!(stat.ppid, own_pid(), "grandchild adopted by the subreaper");
    }

    // SIGTERM is ignored: the group survives it, and is still the recorded one.
    assert_eq!(
        proc::signal_group(&rec, Sig::Term).expect("term"),
        GroupDelivery::Sent { members: 2 }
    );
    assert!(
        kids.iter().all(|&k| pid_alive(k)),
        "TERM-ignoring members survive TERM"
    );

    match kind {
        BoundaryKind::Session => {
            assert_eq!(
                proc::signal_group(&rec, Sig::Kill).expect("kill"),
                GroupDelivery::Sent { members: 2 }
            );
        }
        BoundaryKind::Cgroup => {
            let cg = root.cgroup.clone().expect("cgroup boundary");
            let mut members = proc::cgroup_pids(&cg).expect("cgroup.procs");
            members.sort_unstable();
            let mut expected = kids.clone();
            expected.sort_unstable();
            assert_eq!(members, expected);
            proc::cgroup_kill(&cg).expect("cgroup.kill");
            assert!(wait_until(LIMIT, || !proc::cgroup_populated(&cg).unwrap_or(true)));
        }
        BoundaryKind::Job => unreachable!("no job boundary on Linux"),
    }
    assert!(
        wait_until(LIMIT, || kids.iter().all(|&k| !pid_alive(k))),
        "whole group dead"
    );
    let exits = collect_unclaimed(reaper, &kids);
    for kid in &kids {
        assert!(
            exits.contains(&(*kid, ExitStatus::Signaled(9))),
            "{exits:?}"
        );
    }
    // Nothing is sent to a dead group: it is empty, or (its leader's pid
    // taken by another process since, which a busy host does within
    // moments) the recycled leader is refused. Never `Sent`.
    match proc::signal_group(&rec, Sig::Kill).expect("kill") {
        GroupDelivery::Empty => {}
        GroupDelivery::NotRecorded(why) if why.contains("not the recorded leader") => {}
        other => panic!("a dead group was signalled: {other:?}"),
    }
    if let Some(cg) = &root.cgroup {
        assert!(proc::remove_cgroup_if_empty(cg).expect("rmdir"));
        assert!(!cg.exists(), "tree cgroup removed");
    }
    cleanup.finish();
    Ok(())
}

/// Acceptance 2: a descendant that calls setsid() leaves the group; the
/// cgroup still kills it, the session boundary reports it (adopted by us).
fn setsid_escapee(reaper: &Reaper, kind: BoundaryKind) -> Result<(), String> {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cleanup = Cleanup::default();
    let script = "setsid sleep 1000 & echo $! > esc";
    let root = spawn_tree(script, dir.path(), kind, &mut cleanup)?;
    let rec = root.group_record();
    assert_eq!(
        reaper.wait_exit(root.pid, Some(LIMIT)),
        Some(ExitStatus::Exited(0))
    );
    let esc = read_pids(&dir.path().join("esc"), 1)[0];
    cleanup.pid(esc);
    let mut stat = None;
    assert!(
        wait_until(LIMIT, || {
            stat = proc::read_stat(esc).ok().flatten();
            stat.as_ref()
                .is_some_and(|s| s.sid == esc && s.comm == "sleep")
        }),
        "escapee made its own session: {stat:?}"
    );
    let stat = stat.expect("escapee stat");
    assert_ne!(stat.pgid, rec.pgid, "escaped the recorded group");
    assert_eq!(stat.ppid, own_pid(), "escapee re-parented to the subreaper");
    println!(
        "TWNOTE escapee pid {esc} sid {} ppid {} (subreaper {})",
        stat.sid,
        stat.ppid,
        own_pid()
    );
    // The recorded group is empty: killpg cannot reach the escapee.
    assert_eq!(
        proc::signal_group(&rec, Sig::Kill).expect("kill"),
        GroupDelivery::Empty
    );
    match kind {
        BoundaryKind::Cgroup => {
            let cg = root.cgroup.clone().expect("cgroup");
            assert_eq!(proc::cgroup_pids(&cg).expect("procs"), vec![esc]);
            proc::cgroup_kill(&cg).expect("cgroup.kill");
            assert!(
                wait_until(LIMIT, || !pid_alive(esc)),
                "cgroup.kill got the escapee"
            );
            assert!(proc::remove_cgroup_when_empty(&cg, LIMIT).expect("rmdir"));
            assert!(!cg.exists());
        }
        BoundaryKind::Session => {
            // Reported (adopted, above); ended by its verified identity.
            let id = proc::identity_of(esc).expect("read").expect("alive");
            assert_eq!(
                proc::signal_process(&id, Sig::Kill).expect("kill"),
                Delivery::Sent
            );
            assert!(wait_until(LIMIT, || !pid_alive(esc)));
        }
        BoundaryKind::Job => unreachable!("no job boundary on Linux"),
    }
    let exits = collect_unclaimed(reaper, &[esc]);
    assert!(exits.contains(&(esc, ExitStatus::Signaled(9))), "{exits:?}");
    cleanup.finish();
    Ok(())
}

/// Acceptance 7: an exit reaped before anyone asks is kept for its owner (and
/// not handed out as unclaimed); an adopted orphan's exit is reported by
/// `take_unclaimed`.
fn reaper_keeps_exits(reaper: &Reaper) -> Result<(), String> {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cleanup = Cleanup::default();
    let root = spawn_tree("exit 3", dir.path(), BoundaryKind::Session, &mut cleanup)?;
    // Gone from /proc means the reaper's wait4 has reaped it; nobody asked
    // yet. The reaper records a batch of reaped exits after its last wait4
    // of the batch: the record follows within a bounded while (the kernel
    // lane once read it between the two).
    assert!(wait_until(LIMIT, || proc::read_stat(root.pid)
        .ok()
        .flatten()
        .is_none()));
    assert!(
        wait_until(LIMIT, || reaper.exit_of(root.pid).is_some()),
        "the reaped exit is recorded"
    );
    let unclaimed = reaper.unclaimed();
    assert!(
        !unclaimed.iter().any(|(p, _)| *p == root.pid),
        "an announced child's exit is never handed out as unclaimed"
    );
    assert_eq!(reaper.exit_of(root.pid), Some(ExitStatus::Exited(3)));
    assert_eq!(
        reaper.wait_exit(root.pid, Some(Duration::ZERO)),
        Some(ExitStatus::Exited(3))
    );
    assert_eq!(ExitStatus::Exited(3).code_for_shell(), 3);
    assert_eq!(ExitStatus::Signaled(15).code_for_shell(), 143);

    // `on_exit` (issue 30: a root watched without a descriptor): a callback
    // left for an exit already reaped is called at once, one left before the
    // exit when it is reaped, each with that child's own status; a pid that
    // is no announced child of ours is refused (the caller uses a pidfd).
    let (tx, rx) = std::sync::mpsc::channel();
    let sent = tx.clone();
    let early = reaper.on_exit(root.pid, Box::new(move |e| sent.send(e).unwrap_or(())));
    assert!(early.is_ok(), "an announced, reaped child is accepted");
    assert_eq!(rx.recv_timeout(Duration::ZERO), Ok(ExitStatus::Exited(3)));
    let live = spawn_tree(
        "exec sleep 1000",
        dir.path(),
        BoundaryKind::Session,
        &mut cleanup,
    )?;
    let sent = tx.clone();
    let before = reaper.on_exit(live.pid, Box::new(move |e| sent.send(e).unwrap_or(())));
    assert!(before.is_ok(), "an announced, live child is accepted");
    assert!(rx.try_recv().is_err(), "no call before the exit");
    let id = proc::identity_of(live.pid)
        .expect("read")
        .expect("live child");
    assert_eq!(
        proc::signal_process(&id, Sig::Term).expect("term"),
        Delivery::Sent
    );
    assert_eq!(rx.recv_timeout(LIMIT), Ok(ExitStatus::Signaled(15)));
    assert_eq!(
        reaper.exit_of(live.pid),
        Some(ExitStatus::Signaled(15)),
        "the callback does not take the status from its owner"
    );
    let stranger = reaper.on_exit(1, Box::new(move |e| tx.send(e).unwrap_or(())));
    assert!(stranger.is_err(), "pid 1 is no announced child");

    let root = spawn_tree(
        "sleep 1000 & echo $! > orphan",
        dir.path(),
        BoundaryKind::Session,
        &mut cleanup,
    )?;
    assert_eq!(
        reaper.wait_exit(root.pid, Some(LIMIT)),
        Some(ExitStatus::Exited(0))
    );
    let orphan = read_pids(&dir.path().join("orphan"), 1)[0];
    cleanup.pid(orphan);
    assert!(wait_until(LIMIT, || proc::read_stat(orphan)
        .ok()
        .flatten()
        .is_some_and(|s| s.ppid == own_pid() && s.comm == "sleep")));
    let id = proc::identity_of(orphan).expect("read").expect("orphan");
    assert_eq!(
        proc::signal_process(&id, Sig::Term).expect("term"),
        Delivery::Sent
    );
    let exits = collect_unclaimed(reaper, &[orphan]);
    assert!(
        exits.contains(&(orphan, ExitStatus::Signaled(15))),
        "{exits:?}"
    );

    // A burst (issue 30: a drain's exits, recorded in batches, one lock and
    // one wake-up a batch): forty adopted orphans ended at once, each with
    // a waiter of its own, and every waiter gets its own orphan's status.
    let root = spawn_tree(
        "for i in $(seq 40); do sleep 1000 & echo $! >> burst; done",
        dir.path(),
        BoundaryKind::Session,
        &mut cleanup,
    )?;
    assert_eq!(
        reaper.wait_exit(root.pid, Some(LIMIT)),
        Some(ExitStatus::Exited(0))
    );
    let burst = read_pids(&dir.path().join("burst"), 40);
    for &p in &burst {
        cleanup.pid(p);
    }
    assert!(wait_until(LIMIT, || burst.iter().all(|&p| {
        proc::read_stat(p)
            .ok()
            .flatten()
            .is_some_and(|s| s.ppid == own_pid())
    })));
    let ids: Vec<_> = burst
        .iter()
        .map(|&p| proc::identity_of(p).expect("read").expect("orphan"))
        .collect();
    let got: Vec<Option<ExitStatus>> = std::thread::scope(|s| {
        let waiters: Vec<_> = burst
            .iter()
            .map(|&p| s.spawn(move || reaper.wait_unclaimed(p, LIMIT)))
            .collect();
        for id in &ids {
            assert_eq!(
                proc::signal_process(id, Sig::Kill).expect("kill"),
                Delivery::Sent
            );
        }
        waiters
            .into_iter()
            .map(|w| w.join().expect("a waiter"))
            .collect()
    });
    assert!(
        got.iter().all(|e| *e == Some(ExitStatus::Signaled(9))),
        "{got:?}"
    );
    cleanup.finish();
    Ok(())
}

#[test]
fn leader_reaped_group_still_killed_by_recorded_pgid_session() {
    run_in_own_process("group_kill_session");
}

#[test]
fn leader_reaped_group_still_killed_by_cgroup_kill() {
    run_in_own_process("group_kill_cgroup");
}

#[test]
fn setsid_escapee_is_reported_on_session_boundary() {
    run_in_own_process("escapee_session");
}

#[test]
fn setsid_escapee_is_killed_by_cgroup_boundary() {
    run_in_own_process("escapee_cgroup");
}

#[test]
fn reaper_keeps_early_exits_and_reports_adopted_orphans() {
    run_in_own_process("reaper_keeps_exits");
}

// ---------------------------------------------------------------------------
// In-process tests: no reaper; each reaps its own children by pid.

fn assert_refused(result: Result<impl std::fmt::Debug, ProcError>, needle: &str) {
    match result {
        Err(ProcError::Refused { reason, .. }) => {
            assert!(
                reason.contains(needle),
                "reason {reason:?} lacks {needle:?}"
            )
        }
        other => panic!("expected a refusal ({needle}), got {other:?}"),
    }
}

#[test]
fn sentinel_targets_are_refused() {
    let me = proc::self_identity().expect("self identity");
    let with_pid = |pid: i32| Identity { pid, ..me.clone() };
    assert_refused(
        proc::signal_process(&with_pid(0), Sig::Term),
        "own process group",
    );
    assert_refused(
        proc::signal_process(&with_pid(-1), Sig::Term),
        "every process",
    );
    assert_refused(proc::signal_process(&with_pid(-42), Sig::Term), "negative");
    assert_refused(proc::signal_process(&with_pid(1), Sig::Kill), "init");
    assert_refused(proc::signal_process(&me, Sig::Kill), "treewarden itself");

    let stat = proc::read_stat(own_pid()).expect("read").expect("self");
    let group = |pgid: i32, sid: i32| GroupRecord {
        pgid,
        sid,
        leader: with_pid(pgid),
    };
    // The reason the guard (src/proc/sys/linux/signal.rs) gives for our own group,
    // by the check that catches it first: its pgid may be our own pid (we
    // lead it), or 0 inside a pid namespace it lies outside of.
    let own_group_reason = |what: &str| match stat.pgid {
        0 => format!("{what} 0 means the caller's own process group"),
        1 => format!("{what} 1 is init"),
        p if p == own_pid() => format!("{what} {p} is treewarden itself"),
        p => format!("{what} {p} is treewarden's own process group"),
    };
    if stat.pgid != own_pid() {
        assert_refused(
            proc::signal_process(&with_pid(stat.pgid), Sig::Kill),
            &own_group_reason("pid"),
        );
    } else {
        skip(
            "this test process leads its own process group: the own-group guard \
             of signal_process is the own-pid guard, checked above",
        );
    }
    assert_refused(
        proc::signal_group(&group(stat.pgid, stat.sid), Sig::Kill),
        &own_group_reason("process group"),
    );
    assert_refused(
        proc::signal_group(&group(0, 0), Sig::Kill),
        "own process group",
    );
    assert_refused(proc::signal_group(&group(1, 1), Sig::Kill), "init");
    assert_refused(
        proc::signal_group(&group(-1, -1), Sig::Kill),
        "every process",
    );
    if stat.sid != stat.pgid && stat.sid != own_pid() && stat.sid > 1 {
        assert_refused(
            proc::signal_process(&with_pid(stat.sid), Sig::Kill),
            &format!("pid {} is treewarden's own session", stat.sid),
        );
    } else {
        skip(&format!(
            "the own-session guard is not reached separately: session {} is our \
             group {}, our own pid {}, init, or outside our pid namespace",
            stat.sid,
            stat.pgid,
            own_pid()
        ));
    }
    let message = proc::signal_process(&with_pid(1), Sig::Kill)
        .expect_err("refused")
        .to_string();
    assert_eq!(message, "refused to signal 1: pid 1 is init");

    // A cgroup that holds treewarden itself is refused too.
    match proc::own_cgroup_dir() {
        Ok(Some(own)) => assert_refused(proc::cgroup_kill(&own), "contains treewarden"),
        _ => skip("no cgroup v2: the own-cgroup guard is not exercised"),
    }
    // We are still here.
    assert_eq!(me.check(), Liveness::Same);
}

#[test]
fn held_child_runs_nothing_before_release() {
    let dir = tempfile::tempdir().expect("tempdir");
    let marker = dir.path().join("started");
    let held = proc::spawn_held(&sh("touch started; exec sleep 1000", dir.path())).expect("spawn");
    let mut cleanup = Cleanup::default();
    cleanup.pid(held.pid);
    let stat = proc::read_stat(held.pid)
        .expect("read")
        .expect("held child");
    let exe = std::fs::read_link(format!("/proc/{}/exe", held.pid)).expect("exe");
    assert_eq!(
        exe,
        std::env::current_exe().expect("exe"),
        "still our image: nothing exec'd"
    );
    assert_ne!(stat.comm, "sh");
    assert_eq!(
        (stat.pgid, stat.sid),
        (held.pid, held.pid),
        "own session and group"
    );
    assert!(!marker.exists(), "nothing ran while held");

    let spawned = held.release().expect("release");
    assert!(wait_until(LIMIT, || marker.exists()), "ran after release");
    assert_eq!(spawned.identity.check(), Liveness::Same);
    assert!(spawned.pidfd().is_some());
    assert_eq!(
        proc::signal_process(&spawned.identity, Sig::Term).expect("term"),
        Delivery::Sent
    );
    assert_eq!(
        proc::reap_child(spawned.pid, Some(LIMIT)).expect("reap"),
        Some(ExitStatus::Signaled(15))
    );
    assert_eq!(spawned.identity.check(), Liveness::Gone);
    cleanup.finish();
}

#[test]
fn cancelled_held_child_never_execs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let held = proc::spawn_held(&sh("touch started", dir.path())).expect("spawn");
    let pid = held.pid;
    held.cancel().expect("cancel");
    assert!(
        proc::read_stat(pid).expect("read").is_none(),
        "killed and reaped"
    );
    assert!(!dir.path().join("started").exists(), "never ran");

    // Dropping a held child cancels it as well.
    let held = proc::spawn_held(&sh("touch started", dir.path())).expect("spawn");
    let pid = held.pid;
    drop(held);
    assert!(proc::read_stat(pid).expect("read").is_none());
    assert!(!dir.path().join("started").exists());
}

#[test]
fn exec_failures_map_to_shell_codes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let spec = |argv0: OsString| SpawnSpec {
        argv: vec![argv0],
        cwd: Some(dir.path().to_path_buf()),
        env: None,
        stdio: SpawnStdio::Null,
        container: None,
        cgroup_settings: Vec::new(),
        parent_settings: Vec::new(),
        log_file: None,
        umask: None,
        credentials: None,
        tty: None,
    };
    let check = |argv0: OsString, kind: ExecFailureKind, code: u8| {
        let held = proc::spawn_held(&spec(argv0.clone())).expect("spawn");
        let pid = held.pid;
        let failure = held.release().expect_err("exec must fail");
        assert_eq!(
            (failure.kind, failure.exit_code()),
            (kind, code),
            "{failure}"
        );
        assert!(proc::read_stat(pid).expect("read").is_none(), "reaped");
        failure.to_string()
    };
    let msg = check(
        "treewarden-no-such-program".into(),
        ExecFailureKind::NotFound,
        127,
    );
    assert!(msg.contains("command not found"), "{msg}");
    check(
        dir.path().join("missing/prog").into(),
        ExecFailureKind::NotFound,
        127,
    );
    let script = dir.path().join("not-executable");
    std::fs::write(&script, "#!/bin/sh\ntrue\n").expect("write");
    let msg = check(script.into(), ExecFailureKind::NotExecutable, 126);
    assert!(msg.contains("not executable"), "{msg}");

    // A cwd that does not exist fails before the child is held.
    let mut bad = spec("true".into());
    bad.cwd = Some(dir.path().join("nope"));
    match proc::spawn_held(&bad) {
        Err(ProcError::ChildSetup { step, .. }) => assert_eq!(step, "chdir"),
        other => panic!("expected a chdir failure, got {other:?}"),
    }
}

#[test]
fn identity_tracks_zombies_and_missing_pids() {
    let me = proc::self_identity().expect("self");
    assert_eq!(me.check(), Liveness::Same);
    assert_eq!(proc::boot_id().expect("boot id"), me.boot_id);
    let other_boot = Identity {
        boot_id: "not-this-boot".into(),
        ..me.clone()
    };
    assert_eq!(other_boot.check(), Liveness::Recycled);
    let pid_max = std::fs::read_to_string("/proc/sys/kernel/pid_max").expect("pid_max");
    let unused = pid_max.trim().parse::<i32>().expect("number") + 1;
    assert!(proc::identity_of(unused).expect("read").is_none());

    let dir = tempfile::tempdir().expect("tempdir");
    let child = proc::spawn_held(&sh("exit 0", dir.path()))
        .expect("spawn")
        .release()
        .expect("release");
    // No reaper here: the child stays a zombie until we reap it.
    assert!(wait_until(LIMIT, || proc::read_stat(child.pid)
        .ok()
        .flatten()
        .is_some_and(|s| s.state == 'Z')));
    assert_eq!(child.identity.check(), Liveness::Gone, "a zombie is dead");
    assert_eq!(
        proc::signal_process(&child.identity, Sig::Kill).expect("signal"),
        Delivery::Gone
    );
    assert_eq!(
        proc::reap_child(child.pid, Some(LIMIT)).expect("reap"),
        Some(ExitStatus::Exited(0))
    );
    assert_eq!(child.identity.check(), Liveness::Gone);
}

#[test]
fn group_is_signalled_only_while_it_is_the_recorded_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cleanup = Cleanup::default();
    let root = proc::spawn_held(&sh("exec sleep 1000", dir.path()))
        .expect("spawn")
        .release()
        .expect("release");
    cleanup.pid(root.pid);
    let rec = root.group_record();

    // A record whose leader started earlier than the live pid == pgid process:
    // the pgid was recycled. Nothing is sent.
    let mut stale = rec.clone();
    stale.leader.start_ticks -= 1;
    assert!(matches!(
        proc::signal_group(&stale, Sig::Term).expect("signal"),
        GroupDelivery::NotRecorded(why) if why.contains("not the recorded leader")
    ));
    // Members in another session than recorded: not our group either.
    let mut other_session = rec.clone();
    other_session.sid = root.pid + 1;
    assert!(matches!(
        proc::signal_group(&other_session, Sig::Term).expect("signal"),
        GroupDelivery::NotRecorded(why) if why.contains("session")
    ));
    assert_eq!(root.identity.check(), Liveness::Same, "nothing was sent");

    assert_eq!(
        proc::signal_group(&rec, Sig::Term).expect("signal"),
        GroupDelivery::Sent { members: 1 }
    );
    assert_eq!(
        proc::reap_child(root.pid, Some(LIMIT)).expect("reap"),
        Some(ExitStatus::Signaled(15))
    );
    assert_eq!(
        proc::signal_group(&rec, Sig::Term).expect("signal"),
        GroupDelivery::Empty
    );
    assert!(proc::group_members(rec.pgid).expect("scan").is_empty());
    cleanup.finish();
}

/// Time since boot in clock ticks (USER_HZ is 100 on every Linux ABI).
fn uptime_ticks() -> u64 {
    let text = std::fs::read_to_string("/proc/uptime").expect("uptime");
    let secs: f64 = text
        .split_whitespace()
        .next()
        .and_then(|s| s.parse().ok())
        .expect("uptime seconds");
    (secs * 100.0) as u64
}

/// Forces the kernel to hand out `pid` next (as root), spawning held children
/// until one gets it. Bounded: other threads of the suite also take pids.
fn respawn_at_pid(pid: i32, dir: &Path) -> Option<proc::Spawned> {
    for _ in 0..50 {
        std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string()).ok()?;
        let held = proc::spawn_held(&sh("exec sleep 1000", dir)).expect("spawn");
        if held.pid == pid {
            return Some(held.release().expect("release"));
        }
        held.cancel().expect("cancel");
    }
    None
}

#[test]
fn identity_refuses_a_recycled_pid_and_pgid() {
    if !crate::util::is_root() {
        skip("forcing pid reuse through ns_last_pid needs root");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cleanup = Cleanup::default();
    let old = proc::spawn_held(&sh("exec sleep 1000", dir.path()))
        .expect("spawn")
        .release()
        .expect("release");
    let old_rec = old.group_record();
    assert_eq!(
        proc::signal_process(&old.identity, Sig::Kill).expect("kill"),
        Delivery::Sent
    );
    assert_eq!(
        proc::reap_child(old.pid, Some(LIMIT)).expect("reap"),
        Some(ExitStatus::Signaled(9))
    );

    // Start ticks have a resolution of one clock tick (USER_HZ = 100 on
    // Linux): let a tick pass, as any real pid wrap-around would.
    assert!(wait_until(LIMIT, || uptime_ticks() > old.identity.start_ticks + 1));
    let Some(new) = respawn_at_pid(old.pid, dir.path()) else {
        skip("could not win the pid-reuse race in 50 tries");
        return;
    };
    cleanup.pid(new.pid);
    assert_eq!(new.pid, old.pid);
    assert_ne!(new.identity, old.identity);
    assert_eq!(old.identity.check(), Liveness::Recycled);
    assert_eq!(
        proc::signal_process(&old.identity, Sig::Term).expect("signal"),
        Delivery::Recycled
    );
    // The new process is a session and group leader with the old pgid, but
    // its leader started after the record: the old record reaches nothing.
    assert!(matches!(
        proc::signal_group(&old_rec, Sig::Kill).expect("signal"),
        GroupDelivery::NotRecorded(_)
    ));
    assert_eq!(
        new.identity.check(),
        Liveness::Same,
        "the new process was not hit"
    );
    assert!(pid_alive(new.pid));
    assert_eq!(
        proc::signal_process(&new.identity, Sig::Kill).expect("kill"),
        Delivery::Sent
    );
    assert_eq!(
        proc::reap_child(new.pid, Some(LIMIT)).expect("reap"),
        Some(ExitStatus::Signaled(9))
    );
    cleanup.finish();
}

#[test]
fn held_child_joins_its_cgroup_before_exec() {
    let root = match cgroup_root() {
        Ok(root) => root,
        Err(why) => return skip(&format!("no writable cgroup v2: {why}")),
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let cg = tree_cgroup(&root);
    let mut spec = sh("exec sleep 1000", dir.path());
    spec.container = Some(cg.clone());

    let held = proc::spawn_held(&spec).expect("spawn");
    assert_eq!(proc::cgroup_pids(&cg).expect("procs"), vec![held.pid]);
    held.cancel().expect("cancel");
    assert!(!cg.exists(), "cancel removes the tree cgroup");

    let mut cleanup = Cleanup::default();
    cleanup.cgroups.push(cg.clone());
    let tree = proc::spawn_held(&spec)
        .expect("spawn")
        .release()
        .expect("release");
    cleanup.pid(tree.pid);
    assert!(proc::cgroup_populated(&cg).expect("events"));
    assert!(
        !proc::remove_cgroup_if_empty(&cg).expect("rmdir"),
        "populated: kept"
    );
    assert!(proc::cgroup_freeze(&cg, LIMIT).expect("freeze"), "frozen");
    assert_eq!(
        proc::read_stat(tree.pid).expect("read").map(|s| s.pid),
        Some(tree.pid)
    );
    assert!(proc::cgroup_thaw(&cg, LIMIT).expect("thaw"), "thawed");
    proc::cgroup_kill(&cg).expect("cgroup.kill");
    assert_eq!(
        proc::reap_child(tree.pid, Some(LIMIT)).expect("reap"),
        Some(ExitStatus::Signaled(9))
    );
    assert!(proc::remove_cgroup_when_empty(&cg, LIMIT).expect("rmdir"));
    assert!(!cg.exists());
    cleanup.finish();
}

#[test]
fn boundary_resolution_follows_the_choice() {
    assert_eq!(
        proc::resolve_boundary(BoundaryChoice::Session, None).expect("session"),
        BoundaryKind::Session
    );
    assert_eq!(
        proc::resolve_boundary(BoundaryChoice::Auto, None).expect("auto"),
        BoundaryKind::Session
    );
    assert!(matches!(
        proc::resolve_boundary(BoundaryChoice::Cgroup, None),
        Err(ProcError::NoCgroup(_))
    ));
    let not_cgroup = tempfile::tempdir().expect("tempdir");
    assert!(matches!(
        proc::cgroup_root(Some(not_cgroup.path())),
        Err(ProcError::NoCgroup(_))
    ));
    assert_eq!("cgroup".parse::<BoundaryKind>(), Ok(BoundaryKind::Cgroup));
    assert_eq!(BoundaryKind::Session.to_string(), "session");
    match cgroup_root() {
        Ok(root) => assert_eq!(
            proc::resolve_boundary(BoundaryChoice::Auto, Some(&root)).expect("auto"),
            BoundaryKind::Cgroup
        ),
        Err(why) => skip(&format!("auto -> cgroup not exercised: {why}")),
    }
}

#[test]
fn doctor_prints_the_probe() {
    let out = std::process::Command::new(crate::util::bin())
        .args(["doctor", "--json"])
        .output()
        .expect("run doctor");
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    for key in [
        "cgroup_v2",
        "cgroup_writable",
        "cgroup_kill",
        "pidfd",
        "subreaper",
        "proc_connector",
        "auto_boundary",
    ] {
        assert!(v.get(key).is_some(), "doctor --json lacks {key}: {v}");
    }
    assert_eq!(v["pidfd"]["available"], true, "kernel >= 5.3 has pidfd");
    assert_eq!(v["subreaper"]["available"], true);

    let out = std::process::Command::new(crate::util::bin())
        .arg("doctor")
        .output()
        .expect("run doctor");
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.lines().any(|l| l.starts_with("auto_boundary ")),
        "{text}"
    );
    // What this host can do, in every CI log: it says which tests below ran
    // for real and which printed "skipped".
    for line in text.lines() {
        crate::util::say(&format!("doctor: {line}"));
    }
}

/// Linux 6.9+ (`PIDFD_SIGNAL_PROCESS_GROUP`)?
fn kernel_at_least(major: u32, minor: u32) -> bool {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut parts = release
        .trim()
        .split(['.', '-'])
        .map(|p| p.parse::<u32>().unwrap_or(0));
    let (a, b) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    (a, b) >= (major, minor)
}

#[test]
fn group_signals_take_the_pidfd_path_where_the_kernel_has_it_and_killpg_elsewhere() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cleanup = Cleanup::default();
    let new_kernel = kernel_at_least(6, 9);
    assert_eq!(
        proc::pidfd_group_signals_supported(),
        new_kernel,
        "PIDFD_SIGNAL_PROCESS_GROUP exists from Linux 6.9"
    );
    // The leader alive, with a member of its group: on 6.9+ the signal goes
    // through the leader's pidfd, elsewhere through the checked killpg; the
    // whole group gets it either way.
    let root = proc::spawn_held(&sh("sleep 1000 & echo $! > member; wait", dir.path()))
        .expect("spawn")
        .release()
        .expect("release");
    cleanup.pid(root.pid);
    let member_file = dir.path().join("member");
    let member = read_pids(&member_file, 1)[0];
    cleanup.pid(member);
    let rec = root.group_record();
    let (delivery, path) = proc::signal_group_via(&rec, Sig::Term, &[]).expect("signal");
    assert!(
        matches!(delivery, GroupDelivery::Sent { .. }),
        "{delivery:?}"
    );
    let expected = if new_kernel {
        proc::GroupPath::Pidfd
    } else {
        proc::GroupPath::Killpg
    };
    assert_eq!(path, expected);
    crate::util::say(&format!(
        "group signal path on {}: {path:?}",
        std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
    ));
    assert_eq!(
        proc::reap_child(root.pid, Some(LIMIT)).expect("reap"),
        Some(ExitStatus::Signaled(15))
    );
    assert!(
        wait_until(LIMIT, || !pid_alive(member)),
        "the member got it too"
    );
    cleanup.finish();
}

/// In this re-executed process only: clone3 answers ENOSYS (a seccomp
/// filter), so a held child is forked and moved into its cgroup; it is
/// there before exec all the same.
fn clone3_denied() -> Result<(), String> {
    let root = cgroup_root()?;
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    // Where clone3 works, a child is born in its cgroup.
    let mut spec = sh(
        "cat /proc/self/cgroup > cgroup; exec sleep 1000",
        dir.path(),
    );
    spec.container = Some(tree_cgroup(&root));
    let held = proc::spawn_held(&spec).map_err(|e| e.to_string())?;
    assert!(
        held.born_in_container,
        "clone3(CLONE_INTO_CGROUP) works on this kernel"
    );
    held.cancel().expect("cancel");
    proc::deny_clone3_in_this_thread()
        .map_err(|e| format!("cannot install a seccomp filter: {e}"))?;
    let cg = tree_cgroup(&root);
    spec.container = Some(cg.clone());
    let held = proc::spawn_held(&spec).expect("the fallback spawns");
    assert!(!held.born_in_container, "clone3 refused: forked and moved");
    let procs = std::fs::read_to_string(cg.join("cgroup.procs")).unwrap_or_default();
    assert!(
        procs.lines().any(|l| l.trim() == held.pid.to_string()),
        "in its cgroup before release: {procs}"
    );
    let spawned = held.release().expect("release");
    let seen = read_file_eventually(&dir.path().join("cgroup"));
    let rel = cg.file_name().expect("name").to_string_lossy().into_owned();
    assert!(
        seen.trim().ends_with(&rel),
        "the command ran in its cgroup: {seen}"
    );
    proc::cgroup_kill(&cg).expect("cgroup.kill");
    let _ = proc::reap_child(spawned.pid, Some(LIMIT));
    assert!(proc::remove_cgroup_when_empty(&cg, LIMIT).expect("remove"));
    println!(
        "TWNOTE clone3 refused by seccomp: the child was forked and moved into {}",
        cg.display()
    );
    Ok(())
}

fn read_file_eventually(path: &Path) -> String {
    let mut text = String::new();
    wait_until(LIMIT, || {
        text = std::fs::read_to_string(path).unwrap_or_default();
        text.ends_with('\n')
    });
    text
}

#[test]
fn a_child_is_moved_into_its_cgroup_where_clone3_is_refused() {
    run_in_own_process("clone3_denied");
}
