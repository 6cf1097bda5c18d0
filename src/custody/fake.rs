//! A scripted [`Host`] for the teardown's unit tests (compiled only for
//! tests).
//!
//! Why it exists: the teardown's rules are about races (a member forks,
//! execs, escapes or exits between two steps; a pid or pgid is recycled
//! between the check and the signal). Real processes make those races rare
//! and slow to provoke; here they are a table of fake processes and a script
//! of events that run just before the n-th call of a given kind.
//!
//! The fake keeps the kernel's rules that the teardown relies on, the way
//! `proc` states them: a process is signalled only while the pid still holds
//! the identity (else `Recycled`/`Gone`), a group only while it provably is
//! the recorded one (live members, all in the recorded session, a live
//! process at the pgid is the recorded leader), `cgroup.kill` reaches every
//! process in the cgroup. It records every signal it was asked to send, in
//! order, with the kill authorizations the ledger had committed for the
//! tree at that moment.
//!
//! What it must never do: signal anything real. It touches no process and
//! no file outside the test's own ledger.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::host::{Held, Host};
use crate::ledger::{AuthorizationRow, Ledger, TreeId};
use crate::proc::{
    Delivery, ExitStatus, GroupDelivery, GroupRecord, Identity, Liveness, ProcError, Sig,
};
use crate::scan::{MemberDetails, ProcEntry, Snapshot};

/// The boot id of the fake host.
pub(crate) const BOOT: &str = "fake-boot-0000";

/// Fake pids start above any real `pid_max` (4,194,304), so a fake pid can
/// never be this test process or anything it could reach.
pub(crate) const PID_BASE: i32 = 5_000_000;

/// One fake process.
#[derive(Clone, Debug)]
pub(crate) struct FakeProc {
    pub pid: i32,
    pub ppid: i32,
    pub pgid: i32,
    pub sid: i32,
    pub start_ticks: u64,
    /// `S` running, `T` stopped, `Z` zombie, `D` uninterruptible.
    pub state: char,
    pub comm: String,
    /// The stack's address as `stat` shows it: each exec draws a new one.
    pub start_stack: u64,
    pub argv: Vec<String>,
    pub cgroup: Option<PathBuf>,
    /// SIGTERM (and the other first signals) do nothing.
    pub ignores_term: bool,
    /// SIGKILL does not end it (a task stuck in the kernel): a survivor.
    pub unkillable: bool,
    /// As it dies it forks a child into its group (which does the same):
    /// every kill leaves a new member behind, a fork storm.
    pub respawns: bool,
    /// The user it runs as (what `details` reports).
    pub uid: u32,
    /// This process and no other, for the held handles (a pidfd's
    /// meaning): set at spawn, never reused.
    pub serial: u64,
}

/// What a recorded signal was aimed at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Target {
    Group(i32),
    Pid(i32),
    Cgroup(PathBuf),
}

/// One signal the teardown asked the host to send.
#[derive(Clone, Debug)]
pub(crate) struct Sent {
    pub sig: Sig,
    pub target: Target,
    /// Delivered to these `(pid, start_ticks)` (empty when refused, gone
    /// or empty).
    pub hit: Vec<(i32, u64)>,
    /// `sent`, `gone`, `recycled`, `empty`, `refused: ...`.
    pub outcome: String,
    /// For a SIGKILL: the kill authorizations of the tree the ledger had
    /// committed when it was asked (read through the ledger, not assumed).
    pub authorized: Vec<AuthorizationRow>,
    /// The host clock when it was asked (time since the fake started).
    pub at: Duration,
}

/// The kinds of host calls a script can hook.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Call {
    Snapshot,
    SnapshotPids,
    CgroupPids,
    IdentityOf,
    /// A member's forensic details (read at a first sighting or an exec).
    Details,
    SignalGroup,
    SignalProcess,
    CgroupKill,
    CgroupFreeze,
    CgroupThaw,
    Sleep,
    /// Any SIGKILL request (group, pid or cgroup), counted before the
    /// request's own kind.
    KillAny,
}

type Action = Box<dyn FnOnce(&mut World) + Send>;

/// The fake host's state: processes, cgroups, clock, script, record.
pub(crate) struct World {
    pub procs: BTreeMap<i32, FakeProc>,
    /// Existing cgroups and whether each is frozen.
    pub cgroups: HashMap<PathBuf, bool>,
    /// Cgroups removed by the teardown.
    pub removed: Vec<PathBuf>,
    pub sent: Vec<Sent>,
    /// Whether this host reaps (a subreaper: run, serve).
    pub reaper: bool,
    /// Where orphans are re-parented (the subreaper's pid; init when unset).
    pub subreaper: Option<i32>,
    next_pid: i32,
    next_tick: u64,
    next_serial: u64,
    clock: Duration,
    counts: HashMap<Call, usize>,
    script: Vec<(Call, usize, Action)>,
    unclaimed: Vec<(i32, ExitStatus)>,
    reaped: HashMap<(i32, u64), ExitStatus>,
    /// Pids of children this host spawned (a tree's root under `run` or
    /// `serve`): like the real reaper's spawned-child record, their
    /// statuses are kept by pid for the spawner, not among the orphans'.
    children: HashSet<i32>,
    child_status: HashMap<i32, ExitStatus>,
    /// Statuses still on their way to the reaper: the process has left
    /// `/proc`, its status is not collected yet. Only a caller that waits
    /// for orphans (`orphans_until`) gets one.
    late: HashMap<(i32, u64), ExitStatus>,
    /// The CPU time (µs) the reaper's rusage gives for a reaped pid.
    pub cpu_usec: HashMap<i32, u64>,
    /// Calls of each kind, for tests of bounded work.
    pub calls: HashMap<Call, usize>,
    /// The candidates each group signal was given to prove the group with
    /// (in order).
    pub group_candidates: Vec<Vec<i32>>,
    /// While set, reads fail as a process out of descriptors fails them
    /// (EMFILE): every `/proc` read of these pids (all pids when empty)
    /// and every `cgroup.procs` read. The processes live on regardless.
    pub unreadable: Option<HashSet<i32>>,
    /// Standing-kill disarms asked for, and how many of the next ones fail
    /// (Windows' `KILL_ON_JOB_CLOSE` that cannot be cleared).
    pub disarms: usize,
    pub disarm_fails: usize,
}

impl World {
    /// The stat reads of `pids`: the live ones' entries, and an incomplete
    /// snapshot where [`World::unreadable`] fails a read.
    fn read(&self, pids: Vec<i32>) -> Snapshot {
        let mut snap = Snapshot::default();
        for pid in pids {
            // Out of descriptors, the open fails whether or not the
            // process lives.
            if self
                .unreadable
                .as_ref()
                .is_some_and(|u| u.is_empty() || u.contains(&pid))
            {
                snap.incomplete
                    .get_or_insert_with(|| format!("/proc/{pid}/stat: Too many open files"));
                continue;
            }
            if let Some(p) = self.procs.get(&pid) {
                snap.entries.insert(pid, entry(p));
            }
        }
        snap
    }

    /// A new process, with a fresh pid and start time.
    pub fn spawn(&mut self, mut p: FakeProc) -> (i32, u64) {
        if p.pid == 0 {
            p.pid = self.next_pid;
        }
        self.next_pid = self.next_pid.max(p.pid) + 1;
        self.next_tick += 10;
        p.start_ticks = self.next_tick;
        self.next_serial += 1;
        p.serial = self.next_serial;
        if let Some(dir) = &p.cgroup {
            self.cgroups.entry(dir.clone()).or_insert(false);
        }
        let id = (p.pid, p.start_ticks);
        self.procs.insert(p.pid, p);
        id
    }

    /// `parent` forks: the child shares its group, session and cgroup.
    /// `None` when the parent runs no code (stopped, frozen, dead): as in
    /// the kernel, a process stopped by the group's SIGSTOP or in a frozen
    /// cgroup cannot fork, escape or exec until it is thawed.
    pub fn fork(&mut self, parent: i32) -> Option<(i32, u64)> {
        let p = self.procs.get(&parent).cloned()?;
        if !self.runs(&p) {
            return None;
        }
        Some(self.spawn(FakeProc {
            pid: 0,
            ppid: parent,
            ..p
        }))
    }

    /// `pid` calls `setsid()`: a new session and group of its own.
    pub fn setsid(&mut self, pid: i32) {
        if !self.procs.get(&pid).is_some_and(|p| self.runs(p)) {
            return;
        }
        let p = self.procs.get_mut(&pid).expect("escaping process exists");
        p.pgid = pid;
        p.sid = pid;
    }

    /// `pid` execs `argv`.
    pub fn exec(&mut self, pid: i32, argv: &[&str]) {
        if !self.procs.get(&pid).is_some_and(|p| self.runs(p)) {
            return;
        }
        let p = self.procs.get_mut(&pid).expect("exec'ing process exists");
        p.argv = argv.iter().map(|a| a.to_string()).collect();
        p.comm = argv.first().map(|a| a.to_string()).unwrap_or_default();
        p.start_stack = p.start_stack.wrapping_add(0x1000);
    }

    /// Whether the process can run code now (not stopped, frozen or dead).
    fn runs(&self, p: &FakeProc) -> bool {
        !matches!(p.state, 'T' | 'Z' | 'X') && !self.cgroup_frozen(p)
    }

    /// `pid` exits with `status` and is reaped (by us when this host reaps).
    pub fn exit(&mut self, pid: i32, status: ExitStatus) {
        let Some(p) = self.procs.remove(&pid) else {
            return;
        };
        if p.respawns {
            // It forked as it died (a trap on the signal), if it could run
            // at all; the child is an orphan now.
            self.procs.insert(pid, p.clone());
            let child = self.fork(pid);
            self.procs.remove(&pid);
            let orphan = self.subreaper.unwrap_or(1);
            if let Some(c) = child.and_then(|(c, _)| self.procs.get_mut(&c)) {
                c.ppid = orphan;
            }
        }
        // Its children are orphans too.
        let orphan = self.subreaper.unwrap_or(1);
        for c in self.procs.values_mut().filter(|c| c.ppid == pid) {
            c.ppid = orphan;
        }
        if self.reaper {
            if self.children.remove(&pid) {
                self.child_status.insert(pid, status);
            } else {
                self.unclaimed.push((pid, status));
                self.reaped.insert((pid, p.start_ticks), status);
            }
        }
    }

    /// `pid` exits and is reaped by us, but its status reaches the reaper
    /// only after it has left `/proc` (see `World::late`).
    pub fn exit_reaped_late(&mut self, pid: i32, status: ExitStatus) {
        let Some(start) = self.procs.get(&pid).map(|p| p.start_ticks) else {
            return;
        };
        self.exit(pid, status);
        if self.reaped.remove(&(pid, start)).is_some() {
            self.unclaimed.retain(|(p, _)| *p != pid);
            self.late.insert((pid, start), status);
        }
    }

    /// `pid` is a child this host spawned (the root of a tree `run` or
    /// `serve` started): when it exits, its status is kept by pid for the
    /// spawner and handed out only to a caller that says it asks for the
    /// root, as [`super::KernelHost`]'s reaper does.
    pub fn own_child(&mut self, pid: i32) {
        self.children.insert(pid);
    }

    /// The pid is recycled: whatever held it is gone, and a stranger that
    /// started later (in a session of its own) holds it now.
    ///
    /// As in the kernel, a pid is handed out again only once nothing uses
    /// it: while a live process still has it as its group or session id
    /// (the exited leader's group lives on), the process only exits, and
    /// `None` says no stranger took the pid.
    pub fn recycle(&mut self, pid: i32) -> Option<(i32, u64)> {
        // Its children were re-parented before the pid could be reused.
        self.exit(pid, ExitStatus::Exited(0));
        let pinned = self.procs.values().any(|p| {
            p.pid != pid && !matches!(p.state, 'Z' | 'X') && (p.pgid == pid || p.sid == pid)
        });
        (!pinned).then(|| self.spawn(stranger(pid)))
    }

    /// `pid` exits and is reaped, and another user's process (`uid`, in a
    /// session of its own) takes the pid *within the same clock tick*: the
    /// same `(pid, start ticks)`, a different process. What a start-time
    /// identity cannot see and a held handle can.
    pub fn recycle_same_tick(&mut self, pid: i32, uid: u32) -> Option<(i32, u64)> {
        let start = self.procs.get(&pid)?.start_ticks;
        self.recycle(pid)?;
        let p = self.procs.get_mut(&pid)?;
        p.start_ticks = start;
        p.uid = uid;
        Some((pid, start))
    }

    /// Runs `action` just before the `nth` (1-based) call of `call`.
    pub fn on(&mut self, call: Call, nth: usize, action: impl FnOnce(&mut World) + Send + 'static) {
        self.script.push((call, nth, Box::new(action)));
    }

    pub fn live(&self) -> Vec<i32> {
        self.procs
            .values()
            .filter(|p| !matches!(p.state, 'Z' | 'X'))
            .map(|p| p.pid)
            .collect()
    }

    /// Records a signal request at the current fake time.
    fn push(&mut self, mut s: Sent) {
        s.at = self.clock;
        self.sent.push(s);
    }

    fn cgroup_frozen(&self, p: &FakeProc) -> bool {
        p.cgroup
            .as_ref()
            .is_some_and(|d| self.cgroups.get(d).copied().unwrap_or(false))
    }

    fn step(&mut self, call: Call) {
        *self.calls.entry(call).or_insert(0) += 1;
        let n = {
            let c = self.counts.entry(call).or_insert(0);
            *c += 1;
            *c
        };
        let mut i = 0;
        while i < self.script.len() {
            if self.script[i].0 == call && self.script[i].1 == n {
                let (_, _, action) = self.script.remove(i);
                action(self);
            } else {
                i += 1;
            }
        }
    }

    /// Delivers `sig` to one live process; returns whether it was hit.
    fn deliver(&mut self, pid: i32, sig: Sig) -> bool {
        let Some(p) = self.procs.get_mut(&pid) else {
            return false;
        };
        match sig {
            Sig::Kill => {
                if !p.unkillable {
                    self.exit(pid, ExitStatus::Signaled(Sig::Kill.number()));
                }
            }
            Sig::Stop => p.state = 'T',
            Sig::Cont => {
                if p.state == 'T' {
                    p.state = 'S';
                }
            }
            other => {
                if !p.ignores_term && !p.unkillable {
                    self.exit(pid, ExitStatus::Signaled(other.number()));
                }
            }
        }
        true
    }
}

/// A process of the tree: group and session `pgid`, optionally in `cgroup`.
pub(crate) fn member(pid: i32, ppid: i32, pgid: i32, cgroup: Option<&Path>) -> FakeProc {
    FakeProc {
        pid,
        ppid,
        pgid,
        sid: pgid,
        start_ticks: 0,
        state: 'S',
        comm: "worker".into(),
        start_stack: 0x7ff0_0000,
        argv: vec!["worker".into(), "--fake".into()],
        cgroup: cgroup.map(Path::to_path_buf),
        ignores_term: false,
        unkillable: false,
        respawns: false,
        uid: 0,
        serial: 0,
    }
}

/// A process that is nothing of any tree (its own session).
pub(crate) fn stranger(pid: i32) -> FakeProc {
    FakeProc {
        comm: "stranger".into(),
        argv: vec!["stranger".into()],
        ppid: 1,
        ..member(pid, 1, pid, None)
    }
}

/// The scripted host.
pub(crate) struct FakeHost {
    world: Mutex<World>,
    base: Instant,
    /// The ledger and tree whose authorizations each SIGKILL is checked
    /// against when it is asked for.
    ledger: Mutex<Option<(Ledger, TreeId)>>,
}

impl FakeHost {
    pub fn new(reaper: bool) -> Self {
        Self {
            world: Mutex::new(World {
                procs: BTreeMap::new(),
                cgroups: HashMap::new(),
                removed: Vec::new(),
                sent: Vec::new(),
                reaper,
                subreaper: None,
                next_pid: PID_BASE,
                next_tick: 1_000,
                next_serial: 0,
                clock: Duration::ZERO,
                counts: HashMap::new(),
                script: Vec::new(),
                unclaimed: Vec::new(),
                reaped: HashMap::new(),
                children: HashSet::new(),
                child_status: HashMap::new(),
                late: HashMap::new(),
                cpu_usec: HashMap::new(),
                calls: HashMap::new(),
                group_candidates: Vec::new(),
                unreadable: None,
                disarms: 0,
                disarm_fails: 0,
            }),
            base: Instant::now(),
            ledger: Mutex::new(None),
        }
    }

    /// Every SIGKILL asked for from now on records the tree's committed
    /// authorizations at that moment.
    pub fn watch_authority(&self, ledger: &Ledger, tree: TreeId) {
        *self.ledger.lock().expect("fake ledger slot") = Some((ledger.clone(), tree));
    }

    /// The world, to set up or to inspect.
    pub fn world(&self) -> std::sync::MutexGuard<'_, World> {
        self.world.lock().expect("fake world lock")
    }

    /// Time on the fake clock since the host was made.
    pub fn now_since_start(&self) -> Duration {
        self.world().clock
    }

    /// The signals asked for so far.
    pub fn sent(&self) -> Vec<Sent> {
        self.world().sent.clone()
    }

    fn step(&self, call: Call, sig: Sig) {
        let mut w = self.world();
        if sig == Sig::Kill {
            w.step(Call::KillAny);
        }
        w.step(call);
    }

    fn authority(&self, sig: Sig) -> Vec<AuthorizationRow> {
        if sig != Sig::Kill {
            return Vec::new();
        }
        let slot = self.ledger.lock().expect("fake ledger slot").clone();
        let Some((ledger, tree)) = slot else {
            return Vec::new();
        };
        ledger
            .tree_detail(tree)
            .ok()
            .flatten()
            .map(|d| d.authorizations)
            .unwrap_or_default()
    }
}

/// The fake process as the kernel would show it: its `/proc/<pid>/stat`
/// line, read back through the one parser of it ([`crate::proc::parse_stat`],
/// with 4 KiB pages: one page resident).
fn entry(p: &FakeProc) -> ProcEntry {
    let line = format!(
        "{pid} ({comm}) {state} {ppid} {pgid} {sid} 0 -1 4194304 0 0 0 0 0 0 0 0 20 0 1 0 \
         {start} 0 1 18446744073709551615 0 0 {stack} 0 0 0 0 0 0 0 0 0 17 0 0 0 0 0 0\n",
        pid = p.pid,
        comm = p.comm,
        state = p.state,
        ppid = p.ppid,
        pgid = p.pgid,
        sid = p.sid,
        start = p.start_ticks,
        stack = p.start_stack,
    );
    crate::proc::parse_stat(line.as_bytes(), 4096).expect("a fake process's stat line parses")
}

fn refused(pid: i32, reason: &str) -> ProcError {
    ProcError::Refused {
        pid,
        reason: reason.into(),
    }
}

impl Host for FakeHost {
    fn snapshot(&self) -> std::sync::Arc<crate::scan::SharedSnapshot> {
        let mut w = self.world();
        w.step(Call::Snapshot);
        let pids: Vec<i32> = w.procs.keys().copied().collect();
        crate::scan::share(w.read(pids))
    }

    fn snapshot_pids(&self, pids: Vec<i32>) -> Snapshot {
        let mut w = self.world();
        w.step(Call::SnapshotPids);
        w.read(pids)
    }

    fn cgroup_pids(&self, dir: &Path) -> Result<HashSet<i32>, String> {
        let mut w = self.world();
        w.step(Call::CgroupPids);
        if w.unreadable.is_some() {
            return Err(format!(
                "{}/cgroup.procs: Too many open files",
                dir.display()
            ));
        }
        Ok(w.procs
            .values()
            .filter(|p| p.cgroup.as_deref() == Some(dir) && p.state != 'Z')
            .map(|p| p.pid)
            .collect())
    }

    /// Between the last start time handed out and the next: every process
    /// spawned so far started before now, any spawned later after it.
    fn boot_ticks(&self) -> Option<u64> {
        Some(self.world().next_tick + 1)
    }

    fn details(&self, pid: i32) -> MemberDetails {
        let mut w = self.world();
        w.step(Call::Details);
        let Some(p) = w.procs.get(&pid) else {
            return MemberDetails::default();
        };
        MemberDetails {
            uid: Some(p.uid),
            exe: Some(format!("/fake/bin/{}", p.comm)),
            cmdline: p.argv.clone(),
            cwd: Some("/".into()),
            cgroup: p.cgroup.as_ref().map(|d| d.display().to_string()),
            read_from: Some(crate::scan::Lineage {
                start_ticks: p.start_ticks,
                ppid: p.ppid,
                pgid: p.pgid,
                sid: p.sid,
            }),
        }
    }

    fn cmdline(&self, pid: i32) -> Vec<String> {
        self.world()
            .procs
            .get(&pid)
            .map(|p| p.argv.clone())
            .unwrap_or_default()
    }

    fn identity_of(&self, pid: i32) -> Result<Option<Identity>, ProcError> {
        let mut w = self.world();
        w.step(Call::IdentityOf);
        Ok(w.procs.get(&pid).map(|p| Identity {
            pid,
            start_ticks: p.start_ticks,
            boot_id: BOOT.into(),
        }))
    }

    fn liveness(&self, id: &Identity) -> Liveness {
        let w = self.world();
        match w.procs.get(&id.pid) {
            None => Liveness::Gone,
            Some(p) if p.start_ticks != id.start_ticks || id.boot_id != BOOT => Liveness::Recycled,
            Some(p) if p.state == 'Z' => Liveness::Gone,
            Some(_) => Liveness::Same,
        }
    }

    fn boot_id(&self) -> Result<String, ProcError> {
        Ok(BOOT.into())
    }

    /// As [`crate::proc::signal_group_known`] judges it.
    fn signal_group_known(
        &self,
        rec: &GroupRecord,
        sig: Sig,
        candidates: &[crate::proc::ProcKey],
    ) -> Result<GroupDelivery, ProcError> {
        self.step(Call::SignalGroup, sig);
        let authorized = self.authority(sig);
        let mut w = self.world();
        w.group_candidates
            .push(candidates.iter().map(|k| k.pid).collect());
        let record = |w: &mut World, hit: Vec<(i32, u64)>, outcome: String| {
            w.push(Sent {
                sig,
                target: Target::Group(rec.pgid),
                hit,
                outcome,
                authorized: authorized.clone(),
                at: Duration::ZERO,
            })
        };
        if rec.pgid <= 1 || rec.sid <= 1 {
            record(&mut w, vec![], "refused: sentinel".into());
            return Err(refused(rec.pgid, "sentinel pgid"));
        }
        let verdict = if rec.leader.pid != rec.pgid {
            Some("record is inconsistent".to_string())
        } else {
            None
        };
        let members: Vec<FakeProc> = w
            .procs
            .values()
            .filter(|p| p.pgid == rec.pgid && p.state != 'Z')
            .cloned()
            .collect();
        let verdict = verdict.or_else(|| {
            if let Some(s) = members.iter().find(|p| p.sid != rec.sid) {
                return Some(format!("member pid {} is in session {}", s.pid, s.sid));
            }
            match w.procs.get(&rec.pgid) {
                Some(l) if l.state != 'Z' && rec.leader.boot_id != BOOT => {
                    Some("the group record is from another boot".into())
                }
                Some(l) if l.state != 'Z' && l.start_ticks != rec.leader.start_ticks => {
                    Some(format!("pid {} now belongs to another process", rec.pgid))
                }
                _ => None,
            }
        });
        if let Some(why) = verdict {
            record(&mut w, vec![], format!("refused: {why}"));
            return Ok(GroupDelivery::NotRecorded(why));
        }
        if members.is_empty() {
            record(&mut w, vec![], "empty".into());
            return Ok(GroupDelivery::Empty);
        }
        let mut hit = Vec::new();
        for p in &members {
            if w.deliver(p.pid, sig) {
                hit.push((p.pid, p.start_ticks));
            }
        }
        let n = hit.len();
        record(&mut w, hit, "sent".into());
        Ok(GroupDelivery::Sent { members: n })
    }

    fn hold(&self, id: &Identity) -> Result<Option<Held>, ProcError> {
        let w = self.world();
        if w.unreadable.is_some() {
            return Err(refused(id.pid, "out of descriptors"));
        }
        Ok(w.procs
            .get(&id.pid)
            .filter(|p| p.start_ticks == id.start_ticks && p.state != 'Z' && id.boot_id == BOOT)
            .map(|p| Held::serial(p.pid, p.serial)))
    }

    fn held_exited(&self, held: &Held) -> bool {
        let serial = held.serial_of();
        !self
            .world()
            .procs
            .values()
            .any(|p| Some(p.serial) == serial && p.state != 'Z')
    }

    fn signal_held(&self, held: &Held, sig: Sig) -> Result<Delivery, ProcError> {
        self.step(Call::SignalProcess, sig);
        let authorized = self.authority(sig);
        let mut w = self.world();
        let serial = held.serial_of();
        let found = w
            .procs
            .values()
            .find(|p| Some(p.serial) == serial)
            .map(|p| (p.pid, p.start_ticks, p.state));
        let (delivery, hit, pid) = match found {
            Some((pid, start, state)) if state != 'Z' => {
                w.deliver(pid, sig);
                (Delivery::Sent, vec![(pid, start)], pid)
            }
            Some((pid, _, _)) => (Delivery::Gone, vec![], pid),
            None => (Delivery::Gone, vec![], held.pid()),
        };
        w.push(Sent {
            sig,
            target: Target::Pid(pid),
            hit,
            outcome: format!("{delivery:?}").to_lowercase(),
            authorized,
            at: Duration::ZERO,
        });
        Ok(delivery)
    }

    fn container_kill(&self, dir: &Path) -> Result<(), ProcError> {
        self.step(Call::CgroupKill, Sig::Kill);
        let authorized = self.authority(Sig::Kill);
        let mut w = self.world();
        let inside: Vec<(i32, u64)> = w
            .procs
            .values()
            .filter(|p| p.cgroup.as_deref() == Some(dir) && p.state != 'Z')
            .map(|p| (p.pid, p.start_ticks))
            .collect();
        for (pid, _) in &inside {
            w.deliver(*pid, Sig::Kill);
        }
        w.push(Sent {
            sig: Sig::Kill,
            target: Target::Cgroup(dir.to_path_buf()),
            hit: inside,
            outcome: "sent".into(),
            authorized,
            at: Duration::ZERO,
        });
        Ok(())
    }

    fn container_freeze(&self, dir: &Path, _wait: Duration) -> Result<bool, ProcError> {
        let mut w = self.world();
        w.step(Call::CgroupFreeze);
        w.cgroups.insert(dir.to_path_buf(), true);
        Ok(true)
    }

    fn disarm_standing_kill(&self, _dir: &Path) -> Result<(), ProcError> {
        let mut w = self.world();
        w.disarms += 1;
        if w.disarm_fails > 0 {
            w.disarm_fails -= 1;
            return Err(ProcError::Proc("KILL_ON_JOB_CLOSE still set".into()));
        }
        Ok(())
    }

    fn container_thaw(&self, dir: &Path, _wait: Duration) -> Result<bool, ProcError> {
        let mut w = self.world();
        w.step(Call::CgroupThaw);
        w.cgroups.insert(dir.to_path_buf(), false);
        Ok(true)
    }

    /// Time passes in steps of 1 ms on the fake clock while the cgroup is
    /// populated (a script may end its processes meanwhile).
    fn container_wait_empty(&self, dir: &Path, deadline: Instant) -> Result<bool, ProcError> {
        loop {
            let populated = {
                let w = self.world();
                w.procs
                    .values()
                    .any(|p| p.cgroup.as_deref() == Some(dir) && !matches!(p.state, 'Z' | 'X'))
            };
            if !populated {
                return Ok(true);
            }
            if self.now() >= deadline {
                return Ok(false);
            }
            self.sleep(Duration::from_millis(1));
        }
    }

    /// Time passes in steps of 1 ms on the fake clock while any of `ids`
    /// lives (a script may end its processes meanwhile).
    fn wait_exits(&self, ids: &[Identity], deadline: Instant) -> Result<bool, ProcError> {
        loop {
            let running = {
                let w = self.world();
                ids.iter().any(|id| {
                    w.procs.get(&id.pid).is_some_and(|p| {
                        p.start_ticks == id.start_ticks && !matches!(p.state, 'Z' | 'X')
                    })
                })
            };
            if !running {
                return Ok(true);
            }
            if self.now() >= deadline {
                return Ok(false);
            }
            self.sleep(Duration::from_millis(1));
        }
    }

    fn remove_cgroup_when_empty(&self, dir: &Path, _wait: Duration) -> Result<bool, ProcError> {
        let mut w = self.world();
        if w.procs.values().any(|p| p.cgroup.as_deref() == Some(dir)) {
            return Ok(false);
        }
        w.cgroups.remove(dir);
        w.removed.push(dir.to_path_buf());
        Ok(true)
    }

    fn has_reaper(&self) -> bool {
        self.world().reaper
    }

    /// As the kernel answers a subreaper: no process (zombies included)
    /// has it as its parent.
    fn has_no_children(&self) -> Option<bool> {
        let w = self.world();
        let me = w.subreaper.filter(|_| w.reaper)?;
        Some(!w.procs.values().any(|p| p.ppid == me))
    }

    fn unclaimed_exits(&self) -> Vec<(i32, ExitStatus)> {
        self.world().unclaimed.clone()
    }

    fn reaped_cpu_usec(&self, pid: i32) -> Option<u64> {
        let w = self.world();
        w.cpu_usec.get(&pid).copied().filter(|_| w.reaper)
    }

    fn reaped_exit(
        &self,
        pid: i32,
        start_ticks: u64,
        is_root: bool,
        orphans_until: Option<Instant>,
    ) -> Option<ExitStatus> {
        let w = self.world();
        // As the real reaper: a spawned child's status by pid, only when
        // the caller asks for the root; anything else only as an orphan's.
        if is_root && let Some(status) = w.child_status.get(&pid) {
            return Some(*status);
        }
        let late = || {
            orphans_until
                .and_then(|_| w.late.get(&(pid, start_ticks)))
                .copied()
        };
        w.reaped.get(&(pid, start_ticks)).copied().or_else(late)
    }

    fn now(&self) -> Instant {
        self.base + self.world().clock
    }

    /// Time passes only here: a grace of ten seconds costs no real time.
    fn sleep(&self, d: Duration) {
        let mut w = self.world();
        w.clock += d;
        w.step(Call::Sleep);
    }
}

/// A ledger in `dir` as a test rig starts from: one tree whose root
/// (`root`: pid, start ticks) leads its group and session (and sits in
/// `cgroup`), recorded as spawned, owned by an owner that is dead (not in
/// any fake table), as in a sweep. `busy` is the ledger's busy timeout.
pub(crate) fn recorded_tree(
    dir: &Path,
    root: (i32, u64),
    cgroup: Option<&Path>,
    argv: &str,
    grace_ms: u64,
    busy: Duration,
) -> (crate::config::Config, Ledger, TreeId) {
    use crate::config::{BoundaryChoice, Config, ObserverMode};
    use crate::ledger::{IdentityRecord, LedgerOptions, OwnerKind, OwnerRecord};
    let config = Config {
        data_dir: dir.to_path_buf(),
        boundary: BoundaryChoice::Session,
        cgroup_root: None,
        busy_timeout: busy,
        ledger_reserve: 0,
        observer: ObserverMode::Off,
        observer_rcvbuf: 0,
    };
    let ledger = Ledger::open(
        &config.ledger_path(),
        LedgerOptions {
            busy_timeout: busy,
            reserve: 0,
        },
    )
    .expect("ledger opens");
    let owner = ledger
        .register_owner(&OwnerRecord {
            identity: IdentityRecord {
                pid: PID_BASE - 1,
                start_ticks: 1,
                boot_id: BOOT.into(),
            },
            kind: OwnerKind::Run,
        })
        .expect("owner");
    let tree = record_spawned_tree(&ledger, owner, root, cgroup, argv, grace_ms);
    (config, ledger, tree)
}

/// One tree recorded in `ledger` for `owner`, spawned with `root` leading
/// its group and session (and in `cgroup`).
pub(crate) fn record_spawned_tree(
    ledger: &Ledger,
    owner: crate::ledger::OwnerId,
    root: (i32, u64),
    cgroup: Option<&Path>,
    argv: &str,
    grace_ms: u64,
) -> TreeId {
    use crate::ledger::{IdentityRecord, NewTree, SpawnRecord};
    let tree = ledger
        .create_tree(&NewTree {
            label: None,
            boundary: if cgroup.is_some() {
                crate::proc::BoundaryKind::Cgroup
            } else {
                crate::proc::BoundaryKind::Session
            },
            owner,
            argv: vec![argv.into()],
            cwd: None,
            grace_ms: Some(grace_ms),
            timeout_ms: None,
            limits: Default::default(),
            first_signal: None,
        })
        .expect("tree");
    ledger
        .tree_spawned(
            tree,
            &SpawnRecord {
                root: IdentityRecord {
                    pid: root.0,
                    start_ticks: root.1,
                    boot_id: BOOT.into(),
                },
                pgid: root.0,
                sid: root.0,
                cgroup: cgroup.map(|d| d.display().to_string()),
            },
        )
        .expect("spawned");
    tree
}
