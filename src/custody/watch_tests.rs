//! Unit tests of [`TreeWatch`] through the kernel seam: what a tick finds,
//! records and reports, on a scripted [`FakeHost`] with a real ledger in a
//! temporary directory. Each test drives the watch the way one of its
//! callers does: `run`'s owner loop (`tick`), the service's refresh
//! (`pids_to_reread`, a snapshot of those pids, `tick_with`), the teardown
//! (deferred exits, degraded evidence, the journal). No real process is
//! read or signalled: fake pids lie above any `pid_max`. The one real file
//! a test reads through the kernel adapter is a `cgroup.procs` it wrote in
//! its own temporary directory.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use super::Engine;
use super::fake::{BOOT, Call, FakeHost, FakeProc, PID_BASE, member, recorded_tree};
use super::observer::ObserverHandle;
use super::watch::TreeWatch;
use crate::ledger::{
    Deferred, EventFilter, EventKind, EventRow, IdentityRecord, Ledger, LedgerError, MemberRow,
    TreeId, TreeState, WriteLock,
};
use crate::proc::{ExitStatus, Identity, ProcKey};

/// A refused write fails after this long: a held lock costs milliseconds.
const BUSY: Duration = Duration::from_millis(40);

/// One recorded tree whose processes are a fake host's. The root (pid
/// [`PID_BASE`]) leads the tree's group and session.
pub(super) struct Rig {
    dir: tempfile::TempDir,
    pub(super) ledger: Ledger,
    pub(super) engine: Engine,
    pub(super) host: Arc<FakeHost>,
    pub(super) tree: TreeId,
    pub(super) root: (i32, u64),
    /// A real directory standing for the tree's cgroup: the fake host
    /// places the tree's processes in it, and the test writes its
    /// `cgroup.procs` for the reads that go through the kernel adapter.
    cgroup: Option<PathBuf>,
}

pub(super) fn rig(reaper: bool, with_cgroup: bool) -> Rig {
    let dir = tempfile::tempdir().expect("tempdir");
    let cgroup = with_cgroup.then(|| dir.path().join("tw-watch-1"));
    if let Some(cg) = &cgroup {
        std::fs::create_dir(cg).expect("cgroup dir");
    }
    let host = Arc::new(FakeHost::new(reaper));
    let root = host
        .world()
        .spawn(member(PID_BASE, 1, PID_BASE, cgroup.as_deref()));
    let (config, ledger, tree) =
        recorded_tree(dir.path(), root, cgroup.as_deref(), "worker", 0, BUSY);
    let engine = Engine::signal_only(&config, ledger.clone(), None).with_host(host.clone());
    Rig {
        dir,
        ledger,
        engine,
        host,
        tree,
        root,
        cgroup,
    }
}

fn identity((pid, start_ticks): (i32, u64)) -> IdentityRecord {
    IdentityRecord {
        pid,
        start_ticks,
        boot_id: BOOT.into(),
    }
}

fn no_exits() -> HashMap<i32, ExitStatus> {
    HashMap::new()
}

impl Rig {
    /// Writes the cgroup's `memory.events` with `kills` OOM kills.
    fn write_oom_kills(&self, kills: u64) {
        let cg = self.cgroup.as_ref().expect("cgroup");
        let text = format!("low 0\nhigh 0\nmax 0\noom {kills}\noom_kill {kills}\n");
        std::fs::write(cg.join("memory.events"), text).expect("memory.events")
    }

    /// The `total` of every `tree.oom_kill` recorded, in order.
    fn oom_totals(&self) -> Vec<u64> {
        self.events("tree.oom_kill")
            .iter()
            .map(|e| e.data["total"].as_u64().expect("a total"))
            .collect()
    }

    /// A watch over the tree as the ledger holds it now (what a restarted
    /// service or a teardown starts from).
    fn watch(&self) -> TreeWatch {
        let (row, members) = self
            .ledger
            .tree_members(self.tree)
            .expect("readable")
            .expect("recorded");
        TreeWatch::new_on(self.engine.host(), &row, &members, &HashSet::new()).expect("a watch")
    }

    fn members(&self) -> Vec<MemberRow> {
        let mut rows = self
            .ledger
            .tree_members(self.tree)
            .expect("readable")
            .expect("recorded")
            .1;
        rows.sort_by_key(|m| m.pid);
        rows
    }

    fn row(&self, pid: i32) -> MemberRow {
        self.members()
            .into_iter()
            .find(|m| m.pid == pid)
            .unwrap_or_else(|| panic!("pid {pid} recorded as a member"))
    }

    fn events(&self, kind: &str) -> Vec<EventRow> {
        self.ledger
            .events(&EventFilter {
                tree: Some(self.tree),
                kind_prefix: Some(kind.into()),
                ..EventFilter::default()
            })
            .expect("events")
    }

    fn hold_write_lock(&self) -> WriteLock {
        WriteLock::hold(&self.dir.path().join("ledger.db"))
    }

    /// Writes the cgroup's `cgroup.procs` as the kernel would list it now:
    /// the fake's live processes in the cgroup.
    fn write_cgroup_procs(&self) {
        let dir = self.cgroup.as_ref().expect("a cgroup rig");
        let pids: Vec<String> = {
            let w = self.host.world();
            w.procs
                .values()
                .filter(|p| p.cgroup.as_deref() == Some(dir.as_path()) && p.state != 'Z')
                .map(|p| p.pid.to_string())
                .collect()
        };
        std::fs::write(dir.join("cgroup.procs"), pids.join("\n")).expect("cgroup.procs");
    }

    fn details_read(&self) -> usize {
        self.host
            .world()
            .calls
            .get(&Call::Details)
            .copied()
            .unwrap_or(0)
    }
}

fn pids(report: &super::TickReport) -> Vec<i32> {
    report.members.iter().map(|m| m.entry.pid).collect()
}

/// A process the tree's root forked, then left: re-parented to init, in a
/// session of its own (a daemon's double fork), optionally in `cgroup`.
fn daemon(cgroup: Option<&Path>) -> FakeProc {
    FakeProc {
        comm: "daemon".into(),
        argv: vec!["daemon".into(), "--detach".into()],
        ..member(0, 1, 0, cgroup)
    }
}

/// Spawns `p` as a leader of its own group and session (its pid, known
/// only once spawned).
fn spawn_leader(w: &mut super::fake::World, p: FakeProc) -> (i32, u64) {
    let (pid, start) = w.spawn(p);
    let p = w.procs.get_mut(&pid).expect("just spawned");
    p.pgid = pid;
    p.sid = pid;
    (pid, start)
}

#[test]
fn a_tick_records_each_new_member_once_with_what_it_runs() {
    let rig = rig(false, false);
    let child = {
        let mut w = rig.host.world();
        let child = w.fork(rig.root.0).expect("the root runs");
        w.exec(child.0, &["helper", "--port", "7"]);
        child
    };
    let mut watch = rig.watch();
    let first = watch.tick(&rig.engine, &no_exits());
    assert_eq!(pids(&first), [rig.root.0, child.0]);
    assert_eq!(first.new_members, 2);
    let row = rig.row(child.0);
    assert_eq!(row.start_ticks, child.1);
    assert_eq!(row.ppid, Some(rig.root.0));
    assert_eq!(row.exe.as_deref(), Some("/fake/bin/helper"));
    assert_eq!(row.cmdline, ["helper", "--port", "7"]);
    assert_eq!(row.cwd.as_deref(), Some("/"));
    assert_eq!(row.uid, Some(0));
    let second = watch.tick(&rig.engine, &no_exits());
    assert_eq!(pids(&second), [rig.root.0, child.0]);
    assert_eq!(second.new_members, 0, "known members are not new again");
    assert_eq!(rig.events("member.observed").len(), 2);
}

#[test]
fn a_member_that_execs_between_ticks_has_its_row_refreshed_to_the_new_program() {
    let rig = rig(false, false);
    let child = rig.host.world().fork(rig.root.0).expect("the root runs");
    let mut watch = rig.watch();
    watch.tick(&rig.engine, &no_exits());
    assert_eq!(rig.row(child.0).cmdline, ["worker", "--fake"]);
    rig.host.world().exec(child.0, &["sleeper", "600"]);
    watch.tick(&rig.engine, &no_exits());
    let row = rig.row(child.0);
    assert_eq!(row.exe.as_deref(), Some("/fake/bin/sleeper"));
    assert_eq!(row.cmdline, ["sleeper", "600"]);
    let execs = rig.events("member.exec");
    assert_eq!(execs.len(), 1, "{execs:?}");
    assert_eq!(execs[0].data["identity"]["pid"], child.0);
    assert_eq!(execs[0].data["from"]["exe"], "/fake/bin/worker");
    assert_eq!(
        execs[0].data["to"]["argv"],
        serde_json::json!(["sleeper", "600"])
    );
    // Noted once: later ticks see the same program.
    watch.tick(&rig.engine, &no_exits());
    assert_eq!(rig.events("member.exec").len(), 1);
    assert_eq!(rig.row(rig.root.0).cmdline, ["worker", "--fake"]);
}

#[test]
fn a_member_that_execs_a_program_of_the_same_name_is_noticed_by_its_new_stack() {
    // `sh` exec'ing `sh -c …` keeps its comm: the stack address, which
    // every exec draws anew, is what changed (a fidelity run under load
    // recorded such a member with its parent's command line).
    let rig = rig(false, false);
    let child = rig.host.world().fork(rig.root.0).expect("the root runs");
    let mut watch = rig.watch();
    watch.tick(&rig.engine, &no_exits());
    rig.host.world().exec(child.0, &["worker", "-c", "exit 7"]);
    watch.tick(&rig.engine, &no_exits());
    assert_eq!(rig.row(child.0).cmdline, ["worker", "-c", "exit 7"]);
    assert_eq!(rig.events("member.exec").len(), 1);
    // The new stack is remembered: the next tick sees no exec, and reads
    // no member's details again.
    let read = rig.details_read();
    watch.tick(&rig.engine, &no_exits());
    assert_eq!(rig.details_read(), read, "an exec noticed twice");
    assert_eq!(rig.events("member.exec").len(), 1);
}

#[test]
fn a_member_first_read_inside_its_exec_gets_its_arguments_on_a_later_tick() {
    // `execve` names the new program (comm) before it places the new
    // arguments and stack: a member first read in between has no command
    // line, and nothing later (no new name, no stack that was known)
    // says it exec'd. A CI run recorded `sleep 301` as `[]` this way.
    let rig = rig(false, false);
    let child = rig.host.world().fork(rig.root.0).expect("the root runs");
    {
        let mut w = rig.host.world();
        let p = w.procs.get_mut(&child.0).expect("the child");
        p.comm = "sleeper".into();
        p.argv.clear();
        p.start_stack = 0;
    }
    let mut watch = rig.watch();
    watch.tick(&rig.engine, &no_exits());
    assert!(rig.row(child.0).cmdline.is_empty(), "read mid-exec");
    {
        let mut w = rig.host.world();
        let p = w.procs.get_mut(&child.0).expect("the child");
        p.argv = vec!["sleeper".into(), "600".into()];
        p.start_stack = 0x7000;
    }
    watch.tick(&rig.engine, &no_exits());
    assert_eq!(rig.row(child.0).cmdline, ["sleeper", "600"]);
    let execs = rig.events("member.exec");
    assert_eq!(execs.len(), 1, "{execs:?}");
    assert_eq!(execs[0].data["from"]["argv"], serde_json::json!([]));
    // Complete now: no more re-reads.
    let read = rig.details_read();
    watch.tick(&rig.engine, &no_exits());
    assert_eq!(rig.details_read(), read);

    // A member that really has no arguments is read again a bounded
    // number of times, then left as it is.
    let bare = rig.host.world().fork(rig.root.0).expect("the root runs");
    rig.host
        .world()
        .procs
        .get_mut(&bare.0)
        .expect("bare")
        .argv
        .clear();
    for _ in 0..20 {
        watch.tick(&rig.engine, &no_exits());
    }
    let read = rig.details_read();
    watch.tick(&rig.engine, &no_exits());
    assert_eq!(rig.details_read(), read, "re-reads are bounded");
    assert_eq!(rig.events("member.exec").len(), 1);
}

#[test]
fn a_stack_address_hidden_as_zero_is_no_exec() {
    // The kernel shows 0 for a process the reader may not ptrace (one that
    // made itself undumpable): that is no exec, and the row keeps its exe.
    let rig = rig(false, false);
    let child = rig.host.world().fork(rig.root.0).expect("the root runs");
    let mut watch = rig.watch();
    watch.tick(&rig.engine, &no_exits());
    rig.host
        .world()
        .procs
        .get_mut(&child.0)
        .expect("the child")
        .start_stack = 0;
    watch.tick(&rig.engine, &no_exits());
    assert!(rig.events("member.exec").is_empty());
    assert_eq!(rig.row(child.0).exe.as_deref(), Some("/fake/bin/worker"));
}

#[test]
fn a_known_member_costs_no_details_read_until_it_execs() {
    // The details (exe, argv, cwd, uid, cgroup) cost several reads per
    // process: a tick reads them at a first sighting and after an exec
    // (a changed comm), never for a member that runs what it ran.
    let rig = rig(false, false);
    let child = rig.host.world().fork(rig.root.0).expect("the root runs");
    let mut watch = rig.watch();
    watch.tick(&rig.engine, &no_exits());
    assert_eq!(rig.details_read(), 2, "the root and the child, first seen");
    for _ in 0..3 {
        watch.tick(&rig.engine, &no_exits());
    }
    assert_eq!(rig.details_read(), 2, "no read for members seen before");
    rig.host.world().exec(child.0, &["sleeper"]);
    watch.tick(&rig.engine, &no_exits());
    assert_eq!(rig.details_read(), 3, "one read for the member that exec'd");
}

#[test]
fn an_idle_tick_makes_no_ledger_write_and_each_finding_is_tried_and_counted() {
    let rig = rig(false, false);
    let a = rig.host.world().fork(rig.root.0).expect("the root runs");
    let mut watch = rig.watch();
    let first = watch.tick(&rig.engine, &no_exits());
    assert_eq!(first.new_members, 2);
    // Every write fails while another connection holds the lock: a tick
    // that reports no write error attempted none.
    let _lock = rig.hold_write_lock();
    let idle = watch.tick(&rig.engine, &no_exits());
    assert_eq!(pids(&idle), [rig.root.0, a.0]);
    assert_eq!(
        idle.write_errors,
        0,
        "nothing new and last_seen bumped less than {:?} ago: no write",
        super::watch::LAST_SEEN_EVERY
    );
    // Each kind of finding is written on the tick that finds it; refused,
    // each counts once.
    rig.host.world().exit(a.0, ExitStatus::Exited(0));
    let exited = watch.tick(&rig.engine, &no_exits());
    assert_eq!((exited.exited, exited.write_errors), (1, 1), "the exit");
    let b = {
        let mut w = rig.host.world();
        let b = w.fork(rig.root.0).expect("the root runs");
        w.setsid(b.0);
        b
    };
    let escaped = watch.tick(&rig.engine, &no_exits());
    assert_eq!(pids(&escaped), [rig.root.0, b.0]);
    assert_eq!(
        escaped.write_errors, 2,
        "the new member's sighting and its escape"
    );
    rig.host.world().exec(rig.root.0, &["sleeper"]);
    let execd = watch.tick(&rig.engine, &no_exits());
    assert_eq!(
        execd.write_errors, 3,
        "the sighting and the escape again (never written), and the exec"
    );
}

#[test]
fn known_members_last_seen_is_bumped_once_every_interval_of_host_time() {
    let rig = rig(false, false);
    let mut watch = rig.watch();
    watch.tick(&rig.engine, &no_exits());
    // A held write lock makes every attempted write count as an error.
    let _lock = rig.hold_write_lock();
    let host = rig.engine.host();
    host.sleep(super::watch::LAST_SEEN_EVERY - Duration::from_millis(1));
    assert_eq!(watch.tick(&rig.engine, &no_exits()).write_errors, 0);
    host.sleep(Duration::from_millis(1));
    let due = watch.tick(&rig.engine, &no_exits());
    assert_eq!(due.write_errors, 1, "the bump was tried");
    // A refused bump is tried again on the next tick.
    assert_eq!(watch.tick(&rig.engine, &no_exits()).write_errors, 1);
}

#[test]
fn the_cgroup_oom_count_is_read_at_most_every_250_ms_of_host_time() {
    let rig = rig(false, true);
    let events = |kills: u64| rig.write_oom_kills(kills);
    let recorded = || rig.oom_totals();
    events(0);
    let mut watch = rig.watch();
    watch.tick(&rig.engine, &no_exits());
    events(1);
    let host = rig.engine.host();
    host.sleep(Duration::from_millis(249));
    watch.tick(&rig.engine, &no_exits());
    assert!(recorded().is_empty(), "not read again within 250 ms");
    host.sleep(Duration::from_millis(1));
    watch.tick(&rig.engine, &no_exits());
    assert_eq!(recorded(), [1]);
}

#[test]
fn a_tick_told_nothing_changed_reads_the_oom_count_only_if_the_members_did() {
    // The service's full scan of a quiet tree (`expect_unchanged`): an OOM
    // kill ends a member, so a tick that finds the same members skips the
    // read; one that finds a member new or gone reads it.
    let rig = rig(false, true);
    let events = |kills: u64| rig.write_oom_kills(kills);
    let recorded = || rig.oom_totals();
    let host = rig.engine.host();
    events(0);
    let mut watch = rig.watch();
    watch.tick(&rig.engine, &no_exits());
    events(1);
    host.sleep(Duration::from_millis(250));
    watch.expect_unchanged();
    watch.tick(&rig.engine, &no_exits());
    assert!(recorded().is_empty(), "the same members: not read");
    watch.tick(&rig.engine, &no_exits());
    assert_eq!(recorded(), [1], "for one tick only");
    events(2);
    host.sleep(Duration::from_millis(250));
    let child = rig.host.world().fork(rig.root.0).expect("the root runs");
    watch.expect_unchanged();
    watch.tick(&rig.engine, &no_exits());
    assert_eq!(recorded(), [1, 2], "a new member: read");
    events(3);
    host.sleep(Duration::from_millis(250));
    rig.host
        .world()
        .exit(child.0, ExitStatus::Signaled(libc::SIGKILL));
    watch.expect_unchanged();
    watch.tick(&rig.engine, &no_exits());
    assert_eq!(recorded(), [1, 2, 3], "a member gone: read");
}

#[test]
fn a_tick_without_the_bump_still_records_a_new_member() {
    let rig = rig(false, false);
    let mut watch = rig.watch();
    watch.tick_full(&rig.engine, &no_exits(), false);
    let child = rig.host.world().fork(rig.root.0).expect("the root runs");
    let report = watch.tick_full(&rig.engine, &no_exits(), false);
    assert_eq!(report.new_members, 1);
    assert_eq!(rig.row(child.0).start_ticks, child.1);
}

#[test]
fn the_service_refresh_rereads_live_members_leaders_and_the_cgroup() {
    // The service's scan loop: the pids to re-read (live members, the
    // group and session leaders, `cgroup.procs`), a snapshot of just those,
    // then `tick_with` over it. A member found only through the cgroup (a
    // daemon in a session of its own, re-parented to init) is found, and
    // no live member is taken for gone.
    let rig = rig(false, true);
    let cg = rig.cgroup.clone().expect("cgroup");
    let child = rig.host.world().fork(rig.root.0).expect("the root runs");
    let mut watch = rig.watch();
    let refresh = |watch: &mut TreeWatch| {
        rig.write_cgroup_procs();
        let reread = watch.pids_to_reread();
        let snap = rig.engine.host().snapshot_pids(reread);
        watch.tick_with(&rig.engine, &no_exits(), &snap, false)
    };
    let first = refresh(&mut watch);
    assert_eq!(pids(&first), [rig.root.0, child.0]);
    assert_eq!(first.new_members, 2);
    assert_eq!(
        watch.cgroup_pids(),
        &HashSet::from([rig.root.0, child.0]),
        "the cgroup's members as this refresh read them"
    );
    let d = spawn_leader(&mut rig.host.world(), daemon(Some(&cg)));
    let second = refresh(&mut watch);
    assert_eq!(pids(&second), [rig.root.0, child.0, d.0]);
    assert_eq!((second.new_members, second.new_escapes), (1, 1));
    assert_eq!(rig.row(d.0).cmdline, ["daemon", "--detach"]);
    assert!(rig.row(d.0).escaped_at.is_some());
    let steady = refresh(&mut watch);
    assert_eq!(steady.members.len(), 3);
    assert_eq!(steady.exited, 0, "every live member was re-read");
    rig.host
        .world()
        .exit(child.0, ExitStatus::Signaled(libc::SIGTERM));
    let after = refresh(&mut watch);
    assert_eq!(pids(&after), [rig.root.0, d.0]);
    assert_eq!(after.exited, 1);
    assert!(rig.row(child.0).exited_at.is_some());
    assert!(rig.row(d.0).exited_at.is_none());
}

#[test]
fn the_root_exit_status_goes_to_the_root_and_never_to_a_later_holder_of_its_pid() {
    // `run` and `serve` spawned the root: the reaper keeps its status by
    // pid. A member that later holds the same pid (another start time) is
    // not the root, and its exit must not be given the root's status.
    let rig = rig(true, false);
    rig.engine.reaped().note_spawned_here(rig.tree);
    let root = rig.root;
    let child = {
        let mut w = rig.host.world();
        w.own_child(root.0);
        w.fork(root.0).expect("the root runs")
    };
    let mut watch = rig.watch();
    watch.tick(&rig.engine, &no_exits());
    // The root exits; its pid goes to a process the child forks (still in
    // the tree's group: found by descent from the child).
    let holder = {
        let mut w = rig.host.world();
        w.exit(root.0, ExitStatus::Exited(3));
        w.spawn(FakeProc {
            pid: root.0,
            ..member(0, child.0, root.0, None)
        })
    };
    assert_eq!(holder.0, root.0);
    assert_ne!(holder.1, root.1);
    let report = watch.tick(&rig.engine, &no_exits());
    assert_eq!(report.exited, 1);
    let root_row = rig
        .members()
        .into_iter()
        .find(|m| (m.pid, m.start_ticks) == root)
        .expect("root row");
    assert_eq!(
        root_row.exit.map(|e| e.code),
        Some(Some(3)),
        "the root's own status"
    );
    rig.host.world().exit(holder.0, ExitStatus::Exited(9));
    watch.tick(&rig.engine, &no_exits());
    let holder_row = rig
        .members()
        .into_iter()
        .find(|m| (m.pid, m.start_ticks) == holder)
        .expect("the new holder of the pid is a member");
    assert_eq!(
        holder_row.exit.map(|e| e.code),
        Some(Some(9)),
        "its own status, not the root's"
    );
}

#[test]
fn an_orphans_status_on_its_way_to_the_reaper_is_waited_for_in_a_tree_spawned_here() {
    // A member that left `/proc` before the reaper collected its status:
    // a tree this process spawned (its subreaper) waits a moment for it; a
    // tree it did not spawn (a sweep's) has no reaper of its orphans to
    // wait for.
    for spawned_here in [true, false] {
        let rig = rig(true, false);
        if spawned_here {
            rig.engine.reaped().note_spawned_here(rig.tree);
        }
        let child = rig.host.world().fork(rig.root.0).expect("the root runs");
        let mut watch = rig.watch();
        watch.tick(&rig.engine, &no_exits());
        rig.host
            .world()
            .exit_reaped_late(child.0, ExitStatus::Exited(4));
        assert_eq!(watch.tick(&rig.engine, &no_exits()).exited, 1);
        let exit = rig.row(child.0).exit.and_then(|e| e.code);
        let expected = spawned_here.then_some(4);
        assert_eq!(exit, expected, "spawned here: {spawned_here}");
    }
}

#[test]
fn a_member_only_the_observer_attributed_joins_the_tick_and_the_scan_feeds_the_observer() {
    let rig = rig(false, false);
    let (d, child) = {
        let mut w = rig.host.world();
        (
            spawn_leader(&mut w, daemon(None)),
            w.fork(rig.root.0).expect("the root runs"),
        )
    };
    // Without the observer the daemon (its parent gone, a session of its
    // own) is nothing of the tree.
    let mut blind = rig.watch();
    assert_eq!(
        pids(&blind.tick(&rig.engine, &no_exits())),
        [rig.root.0, child.0]
    );
    // The observer saw the root fork it (its proc events; here told
    // directly), but never saw the child.
    let observer = ObserverHandle::detached();
    observer.watch(
        rig.tree,
        rig.root.0,
        rig.root.0,
        &Identity {
            pid: rig.root.0,
            start_ticks: rig.root.1,
            boot_id: BOOT.into(),
        },
    );
    let uid = rig.host.world().procs[&d.0].uid;
    observer.attributed(rig.tree, ProcKey::new(d.0, d.1), uid);
    let mut watch = rig.watch();
    watch.set_observer(Some(observer.clone()));
    let report = watch.tick(&rig.engine, &no_exits());
    assert_eq!(pids(&report), [rig.root.0, d.0, child.0], "by pid");
    assert_eq!(report.new_escapes, 1);
    assert!(rig.row(d.0).escaped_at.is_some());
    assert_eq!(rig.events("escape.observed").len(), 1);
    assert!(
        observer
            .members(rig.tree)
            .contains(&ProcKey::new(child.0, child.1)),
        "the scan's members go back to the observer"
    );
    // The child was the one member the observer did not know: the report
    // says so (the service's next tick lists /proc), and says nothing once
    // the observer knows every member.
    assert_eq!(report.unobserved, 1, "the child the observer never saw");
    assert_eq!(watch.tick(&rig.engine, &no_exits()).unobserved, 0);
}

#[test]
fn under_run_a_process_reparented_to_run_is_a_member() {
    // `run` is the subreaper of its one tree: an orphan re-parented to it
    // came from the tree, even in a session of its own (a daemon's double
    // fork whose middle process exited before any scan saw the daemon).
    let run_pid = PID_BASE - 2;
    let rig = rig(false, false);
    let d = {
        let mut w = rig.host.world();
        w.subreaper = Some(run_pid);
        let middle = w.fork(rig.root.0).expect("the root runs");
        let d = w.fork(middle.0).expect("the middle runs");
        w.setsid(d.0);
        w.exit(middle.0, ExitStatus::Exited(0));
        d
    };
    assert_eq!(rig.host.world().procs[&d.0].ppid, run_pid);
    let mut not_run = rig.watch();
    assert_eq!(pids(&not_run.tick(&rig.engine, &no_exits())), [rig.root.0]);
    let mut watch = rig.watch();
    watch.adopt_children_of(run_pid);
    let report = watch.tick(&rig.engine, &no_exits());
    assert_eq!(pids(&report), [rig.root.0, d.0]);
    assert_eq!(report.new_escapes, 1);
    assert!(rig.row(d.0).escaped_at.is_some());
}

#[test]
fn exits_found_after_defer_exits_wait_in_memory_until_taken() {
    // A teardown past its kill authorization: exits are kept, written once
    // after the tree is verified empty.
    let rig = rig(true, false);
    let child = rig.host.world().fork(rig.root.0).expect("the root runs");
    let mut watch = rig.watch();
    watch.tick(&rig.engine, &no_exits());
    watch.defer_exits();
    rig.host
        .world()
        .exit(child.0, ExitStatus::Signaled(libc::SIGKILL));
    let exits: HashMap<i32, ExitStatus> = rig.engine.host().unclaimed_exits().into_iter().collect();
    let report = watch.tick(&rig.engine, &exits);
    assert_eq!(report.exited, 1);
    assert!(rig.row(child.0).exited_at.is_none(), "not written yet");
    assert!(rig.events("member.exited").is_empty());
    let kept = watch.take_deferred_exits();
    assert_eq!(kept.len(), 1, "{kept:?}");
    assert_eq!(kept[0].0, identity(child));
    assert_eq!(kept[0].1.and_then(|e| e.signal), Some(libc::SIGKILL));
    assert!(watch.take_deferred_exits().is_empty(), "taken once");
    // Still deferring: the next exit is kept again.
    rig.host.world().exit(rig.root.0, ExitStatus::Exited(0));
    watch.tick(&rig.engine, &no_exits());
    let kept = watch.take_deferred_exits();
    assert_eq!(
        kept.iter().map(|(id, _)| id.pid).collect::<Vec<_>>(),
        [rig.root.0]
    );
    assert!(rig.events("member.exited").is_empty());
}

#[test]
fn a_refusing_ledger_degrades_the_watch_which_then_skips_and_keeps_the_trail() {
    let rig = rig(false, false);
    let mut watch = rig.watch();
    watch.degrade_on_refusal();
    watch.tick(&rig.engine, &no_exits());
    assert_eq!(watch.degraded(), None);
    let lock = rig.hold_write_lock();
    rig.host.world().fork(rig.root.0).expect("the root runs");
    let refused = watch.tick(&rig.engine, &no_exits());
    assert_eq!(refused.write_errors, 1);
    let why = watch.degraded().expect("degraded by the refusal");
    assert!(why.starts_with("ledger busy"), "{why}");
    assert_eq!(watch.skipped_writes(), 0, "that write was tried");
    // From now on nothing is tried: the trail is kept, in order.
    let state = Deferred::State {
        to: TreeState::Terminating,
        reason: Some("test".into()),
        at: "2026-01-01T00:00:00Z".into(),
    };
    let flag = Deferred::Flag {
        flag: "test_flag".into(),
        at: "2026-01-01T00:00:01Z".into(),
    };
    assert!(watch.record(&rig.ledger, "state", state.clone()).is_none());
    assert!(watch.record(&rig.ledger, "flag", flag.clone()).is_none());
    rig.host.world().fork(rig.root.0).expect("the root runs");
    let skipped = watch.tick(&rig.engine, &no_exits());
    assert_eq!(skipped.members.len(), 3, "found, though not written");
    assert_eq!(skipped.write_errors, 0, "not tried");
    assert_eq!(watch.skipped_writes(), 3, "two trail writes, one sighting");
    assert_eq!(watch.journal(), [state.clone(), flag.clone()]);
    drop(lock);
    assert_eq!(watch.take_journal(), [state, flag]);
    assert!(watch.journal().is_empty());
    watch.ledger_writable_again();
    assert_eq!(watch.degraded(), None);
    assert_eq!(
        rig.ledger.tree(rig.tree).expect("row").expect("row").state,
        TreeState::Running
    );
}

#[test]
fn a_write_rejected_for_another_reason_neither_degrades_the_watch_nor_is_kept() {
    // Only a ledger that takes no writes (busy, full, read-only) stops
    // evidence writes and keeps the trail for a replay. A write rejected
    // for what it says (here: a tree the ledger does not hold) is an error
    // to report, and the next write is still tried.
    let rig = rig(false, false);
    let mut row = rig.ledger.tree(rig.tree).expect("readable").expect("row");
    row.id.0 += 1_000;
    let mut watch =
        TreeWatch::new_on(rig.engine.host(), &row, &[], &HashSet::new()).expect("a watch");
    watch.degrade_on_refusal();
    let flag = || Deferred::Flag {
        flag: "test_flag".into(),
        at: "2026-01-01T00:00:00Z".into(),
    };
    for _ in 0..2 {
        match watch.record(&rig.ledger, "flag", flag()) {
            Some(Err(LedgerError::NotFound(_))) => {}
            other => panic!("tried and rejected as not found: {other:?}"),
        }
    }
    assert_eq!(watch.degraded(), None);
    assert_eq!(watch.skipped_writes(), 0);
    assert!(watch.journal().is_empty());
}

/// A tick whose reads fail (out of descriptors)
/// concludes no exit. The members it could not read are reported as last
/// seen, the report says why it is incomplete, and the exit of a member
/// that really ended is recorded by the first tick that reads again.
#[test]
fn a_tick_whose_reads_fail_records_no_exit_and_reports_the_members_as_last_seen() {
    let rig = rig(false, false);
    let child = rig.host.world().fork(rig.root.0).expect("the root runs");
    let mut watch = rig.watch();
    let first = watch.tick(&rig.engine, &no_exits());
    assert!(first.incomplete.is_none());
    assert_eq!(pids(&first), [rig.root.0, child.0]);

    rig.host.world().unreadable = Some(HashSet::new());
    rig.host.world().exit(child.0, ExitStatus::Exited(3));
    for _ in 0..3 {
        let blind = watch.tick(&rig.engine, &no_exits());
        let why = blind.incomplete.clone().expect("incomplete");
        assert!(why.contains("Too many open files"), "{why}");
        assert_eq!(blind.exited, 0);
        let mut carried = pids(&blind);
        carried.sort_unstable();
        assert_eq!(carried, [rig.root.0, child.0], "unknown is not exited");
    }
    assert!(rig.events(EventKind::MemberExited.as_str()).is_empty());
    assert!(rig.engine.stats().scans_incomplete() >= 3);

    rig.host.world().unreadable = None;
    let seen = watch.tick(&rig.engine, &no_exits());
    assert!(seen.incomplete.is_none());
    assert_eq!(pids(&seen), [rig.root.0]);
    assert_eq!(seen.exited, 1);
    assert_eq!(rig.events(EventKind::MemberExited.as_str()).len(), 1);
    assert!(rig.row(child.0).exited_at.is_some());
    assert!(rig.row(rig.root.0).exited_at.is_none());
}

/// One unreadable member is enough: the others are read, the one not read
/// is carried, and nothing exits.
#[test]
fn one_unreadable_member_makes_the_tick_incomplete_and_is_carried() {
    let rig = rig(false, false);
    let child = rig.host.world().fork(rig.root.0).expect("the root runs");
    let mut watch = rig.watch();
    watch.tick(&rig.engine, &no_exits());
    rig.host.world().unreadable = Some(HashSet::from([child.0]));
    let r = watch.tick(&rig.engine, &no_exits());
    assert!(r.incomplete.is_some());
    let mut carried = pids(&r);
    carried.sort_unstable();
    assert_eq!(carried, [rig.root.0, child.0]);
    assert_eq!(r.exited, 0);
}

/// An escaped member exits and another user's process
/// takes its pid within the same clock tick (same pid, same start time).
/// The watch holds the escapee from the tick that first found it loose, so
/// the newcomer is not a member: not reported, not recorded as an escape,
/// and the member's own exit is recorded.
#[test]
fn a_pid_recycled_within_the_tick_is_not_the_member_the_watch_holds() {
    let rig = rig(false, false);
    let esc = {
        let mut w = rig.host.world();
        let e = w.fork(rig.root.0).expect("the root runs");
        w.setsid(e.0);
        e
    };
    let mut watch = rig.watch();
    let first = watch.tick(&rig.engine, &no_exits());
    assert_eq!(pids(&first), [rig.root.0, esc.0]);
    assert_eq!(rig.events(EventKind::EscapeObserved.as_str()).len(), 1);

    let same = rig
        .host
        .world()
        .recycle_same_tick(esc.0, 1000)
        .expect("the pid is free");
    assert_eq!(same, esc, "the newcomer has the member's identity");
    let after = watch.tick(&rig.engine, &no_exits());
    assert_eq!(pids(&after), [rig.root.0], "the newcomer is not a member");
    assert_eq!(after.exited, 1, "the member's exit is recorded");
    assert_eq!(
        rig.events(EventKind::EscapeObserved.as_str()).len(),
        1,
        "no second escape"
    );
    assert!(rig.row(esc.0).exited_at.is_some());
}

/// The same, found by a watch that never held the member (a restarted
/// service, a teardown, a sweep): the newcomer is a member only by its
/// identity, and its uid is not the one the member was recorded with.
#[test]
fn a_stranger_with_a_members_identity_but_not_its_uid_is_not_a_member() {
    let rig = rig(false, false);
    let esc = {
        let mut w = rig.host.world();
        let e = w.fork(rig.root.0).expect("the root runs");
        w.setsid(e.0);
        e
    };
    rig.watch().tick(&rig.engine, &no_exits());
    assert_eq!(rig.row(esc.0).uid, Some(0));
    rig.host
        .world()
        .recycle_same_tick(esc.0, 1000)
        .expect("the pid is free");
    let mut fresh = rig.watch();
    let r = fresh.tick(&rig.engine, &no_exits());
    assert_eq!(pids(&r), [rig.root.0], "the stranger is not a member");
    // The real member, with its uid, still is: nothing else changed.
    rig.host.world().procs.get_mut(&esc.0).expect("the pid").uid = 0;
    let r = rig.watch().tick(&rig.engine, &no_exits());
    assert_eq!(pids(&r), [rig.root.0, esc.0]);
}

/// A member recorded without a uid (its details could not be read: it was
/// gone), whose pid a process of another user took within the clock tick
/// of its start: nothing but the identity says it is the member, so it is
/// not taken for it (never held, never signalled), and that is recorded
/// once, as a `kill.skipped` naming it.
#[test]
fn a_stranger_on_the_identity_of_a_member_never_read_is_never_taken_for_it() {
    let rig = rig(false, false);
    let esc = {
        let mut w = rig.host.world();
        let e = w.fork(rig.root.0).expect("the root runs");
        w.setsid(e.0);
        e
    };
    rig.ledger
        .observe_members(
            rig.tree,
            &[crate::ledger::MemberRecord {
                identity: IdentityRecord {
                    pid: esc.0,
                    start_ticks: esc.1,
                    boot_id: BOOT.into(),
                },
                ppid: rig.root.0,
                pgid: esc.0,
                sid: esc.0,
                cgroup: None,
                uid: None,
                exe: None,
                cmdline: Vec::new(),
                cwd: None,
            }],
        )
        .expect("the member's row, without a uid");
    let same = rig
        .host
        .world()
        .recycle_same_tick(esc.0, 1000)
        .expect("the pid is free");
    assert_eq!(same, esc, "the newcomer has the member's identity");
    let mut watch = rig.watch();
    for _ in 0..2 {
        let r = watch.tick(&rig.engine, &no_exits());
        assert_eq!(pids(&r), [rig.root.0], "the stranger is not a member");
        assert!(
            watch.held(&ProcKey::new(esc.0, esc.1)).is_none(),
            "not held"
        );
    }
    let skipped = rig.events(EventKind::KillSkipped.as_str());
    assert_eq!(skipped.len(), 1, "recorded once: {skipped:?}");
    assert!(
        skipped[0]
            .data
            .to_string()
            .contains(&format!("pid {}", esc.0)),
        "{:?}",
        skipped[0].data
    );
    assert!(
        rig.events(EventKind::EscapeObserved.as_str()).is_empty(),
        "not recorded as an escape"
    );
}

/// What a watch says of the tree it watches, as the ledger recorded it:
/// the tree, its root (pid and start), group, session and cgroup, and a
/// scanned member's identity in the ledger's terms (this boot's id).
#[test]
fn a_watch_reports_the_recorded_root_group_session_and_cgroup() {
    let rig = rig(false, false);
    let child = rig.host.world().fork(rig.root.0).expect("the root runs");
    let mut watch = rig.watch();
    assert_eq!(watch.tree(), rig.tree);
    assert_eq!(watch.root_pid(), Some(rig.root.0));
    assert_eq!(watch.root_start_ticks(), rig.root.1);
    assert_eq!((watch.pgid(), watch.sid()), (rig.root.0, rig.root.0));
    assert_eq!(watch.cgroup(), None);
    assert!(watch.is_root(rig.root.0, rig.root.1));
    assert!(!watch.is_root(rig.root.0, rig.root.1 + 1), "another start");
    assert!(!watch.is_root(child.0, rig.root.1), "another pid");
    assert!(!watch.is_root(child.0, child.1));
    let report = watch.tick(&rig.engine, &no_exits());
    let ids: Vec<IdentityRecord> = report.members.iter().map(|m| watch.identity(m)).collect();
    assert_eq!(ids, [identity(rig.root), identity(child)]);

    let cg = self::rig(false, true);
    let watch = cg.watch();
    assert_eq!(watch.cgroup(), cg.cgroup.as_deref());
    assert!(watch.cgroup().is_some());
}

/// The recorded group and session leader's pid, now another process's:
/// the watch says which id was recycled; while the root leads them, or
/// once the pid is free, it says nothing.
#[test]
fn a_recycled_leader_pid_is_named_and_a_live_or_gone_root_is_not() {
    let rig = rig(false, false);
    let watch = rig.watch();
    assert_eq!(watch.recycled_leader(&rig.engine), None, "the root leads");
    rig.host.world().exit(rig.root.0, ExitStatus::Exited(0));
    assert_eq!(watch.recycled_leader(&rig.engine), None, "gone, not reused");
    let (pid, start) = rig.host.world().recycle(rig.root.0).expect("recycled");
    assert_eq!(pid, rig.root.0);
    let why = watch.recycled_leader(&rig.engine).expect("recycled");
    assert_eq!(
        why,
        format!(
            "pgid {pid} now belongs to a process started at tick {start} (recorded root started at tick {}): recycled",
            rig.root.1
        )
    );
}

#[test]
fn only_a_member_outside_both_the_group_and_the_cgroup_is_held() {
    // `vet` holds a member by a handle only when the group signal and the
    // cgroup both miss it (it is signalled by itself): one that changed
    // its group inside the cgroup, or left the cgroup inside the group, is
    // reached by cgroup.kill or killpg and is not held; one outside both is.
    let rig = rig(false, true);
    let (pgid_changed, left_cgroup, outside_both) = {
        let mut w = rig.host.world();
        let a = w.fork(rig.root.0).expect("the root runs");
        let b = w.fork(rig.root.0).expect("the root runs");
        let c = w.fork(rig.root.0).expect("the root runs");
        // Its own group, same session, still in the cgroup.
        w.procs.get_mut(&a.0).expect("forked").pgid = a.0;
        // The tree's group, moved out of the cgroup.
        w.procs.get_mut(&b.0).expect("forked").cgroup = None;
        // Its own group and session (an escape), out of the cgroup.
        let p = w.procs.get_mut(&c.0).expect("forked");
        (p.pgid, p.sid, p.cgroup) = (c.0, c.0, None);
        (a, b, c)
    };
    rig.write_cgroup_procs();
    let mut watch = rig.watch();
    let report = watch.tick(&rig.engine, &no_exits());
    let found = pids(&report);
    for (name, m) in [
        ("group changed in the cgroup", pgid_changed),
        ("left the cgroup in the group", left_cgroup),
        ("outside both", outside_both),
    ] {
        assert!(
            found.contains(&m.0),
            "{name}: {m:?} not a member: {found:?}"
        );
    }
    assert!(
        watch
            .held(&ProcKey::new(pgid_changed.0, pgid_changed.1))
            .is_none(),
        "a member the cgroup reaches is not held"
    );
    assert!(
        watch
            .held(&ProcKey::new(left_cgroup.0, left_cgroup.1))
            .is_none(),
        "a member the group signal reaches is not held"
    );
    assert!(
        watch
            .held(&ProcKey::new(outside_both.0, outside_both.1))
            .is_some(),
        "a member only its own signal reaches is held"
    );
}

#[test]
fn one_last_seen_bump_moves_only_the_named_live_members() {
    // The service's full scan bumps `last_seen` of every watched tree in one
    // ledger write (`Ledger::bump_last_seen`): a member that exited keeps
    // the time it was last seen, and an identity that is no member row
    // adds nothing.
    let rig = rig(false, false);
    let child = rig.host.world().fork(rig.root.0).expect("the root runs");
    let mut watch = rig.watch();
    watch.tick(&rig.engine, &no_exits());
    rig.host.world().exit(child.0, ExitStatus::Exited(0));
    watch.tick(&rig.engine, &no_exits());
    assert!(rig.row(child.0).exited_at.is_some());
    let (root_before, child_before) = (rig.row(rig.root.0).last_seen, rig.row(child.0).last_seen);
    let stranger = (PID_BASE + 999, 5);
    let named = vec![identity(rig.root), identity(child), identity(stranger)];
    // The ledger's clock has millisecond steps: bumped until it moved
    // (bounded), each bump naming the same three.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let bumped = loop {
        let n = rig
            .ledger
            .bump_last_seen(vec![(rig.tree, named.clone())])
            .expect("the ledger takes writes");
        if rig.row(rig.root.0).last_seen != root_before {
            break n;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the root's last_seen never moved"
        );
        std::thread::yield_now();
    };
    assert_eq!(bumped, 1, "only the live member's row");
    assert_eq!(rig.row(child.0).last_seen, child_before, "an exited member");
    assert!(
        rig.members().iter().all(|m| m.pid != stranger.0),
        "no row for an identity that was none"
    );
}
