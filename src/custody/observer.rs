//! The observer: proc-connector events beside the snapshot scans, so an
//! escape is recorded the moment it happens, not at the next scan.
//!
//! Why it exists: a scan sees a process only if it is alive at the scan and
//! linked to the tree then. A member that forks, whose child calls `setsid()`
//! and whose parent then exits, is linked to the tree only through the run
//! owner's adoption rule, which no other process (`kill`, `sweep`, the
//! service) can apply. If no scan caught it in between, the ledger never
//! names it and every teardown but the owner's own misses it. The observer
//! attributes each fork to the tree whose member is the parent, reads the
//! child's identity at once, and records a member that left the tree's group
//! and session as `escape.observed` when the kernel reports the `setsid()`.
//!
//! How it feeds the teardown: through the ledger (an escape row is a member
//! row, so every teardown's [`super::TreeWatch`] starts with it in its
//! `seen` set) and, in this process, through [`ObserverHandle::members`],
//! which a watch merges before each classification (`Because::Observed`),
//! so a ledger that refused the write still does not blind the teardown.
//!
//! What it costs an idle host: almost nothing. The kernel delivers every
//! fork, exec and exit of the host; a socket filter
//! ([`Connector::filter_to`], re-attached whenever the set of member pids
//! changes) lets through only process forks and exits and the members'
//! exec and setsid, so threads and the execs of other processes never wake
//! this thread. The thread waits on the socket and on a waker (no
//! periodic wake-up). A member named to the filter late (a child just
//! forked) may have had its exec or setsid dropped: it is re-read right
//! after the filter names it, and its details are read after that.
//!
//! What it must never do: become a silent gap. An overflow of the socket
//! (events lost) is logged, counted, and answered by a full scan at once
//! (the `on_overflow` callback); scans go on as the fallback and cross-check
//! (members a scan found that the observer did not know are counted and
//! adopted). It never signals anything.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::ledger::{IdentityRecord, Ledger, MemberRecord, TreeId};
use crate::proc::{Connector, ConnectorWaker, ProcError, ProcEvent, ProcKey, monotonic_ns};

/// How many recent forks are remembered for a tree registered late (its
/// root may fork before the owner has told the observer its pid).
const FORK_HISTORY: usize = 16 * 1024;
/// Start ticks of a member that was gone before its identity could be read.
const UNKNOWN_START: u64 = 0;
/// How many detection latencies are kept for percentiles.
const LATENCY_SAMPLES: usize = 4096;
/// The longest the thread sleeps without an event or a wake: a safety net,
/// not a poll (stop, registrations and scans wake it).
const IDLE_WAIT: Duration = Duration::from_secs(1);

/// Observer health, for `run`'s log and the service's metrics.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct ObserverStats {
    /// Events received from the kernel (those the socket filter let
    /// through: process forks and exits, the members' exec and setsid).
    pub events: u64,
    /// Forks attributed to a watched tree.
    pub forks_attributed: u64,
    /// Times the socket overflowed (events were lost).
    pub overflows: u64,
    /// Full scans run because of an overflow.
    pub forced_scans: u64,
    /// Escapes this observer recorded (new `escape.observed` rows).
    pub escapes_recorded: u64,
    /// Member rows this observer wrote first.
    pub members_recorded: u64,
    /// Members a scan found that the observer did not know (cross-check).
    pub scan_found_unobserved: u64,
    /// Ledger writes that failed (logged; the in-memory set still feeds
    /// this process's teardown).
    pub write_errors: u64,
    /// Fork-to-recorded-escape latency of the last escape.
    pub last_detection_latency: Option<Duration>,
    /// Recent fork-to-recorded-escape latencies (bounded), for percentiles.
    #[serde(skip)]
    pub latencies: Vec<Duration>,
}

impl ObserverStats {
    /// The `q` quantile (0.0..=1.0) of the recorded latencies.
    pub fn latency_quantile(&self, q: f64) -> Option<Duration> {
        let mut v = self.latencies.clone();
        if v.is_empty() {
            return None;
        }
        v.sort_unstable();
        let i = ((v.len() - 1) as f64 * q.clamp(0.0, 1.0)).round() as usize;
        v.get(i).copied()
    }
}

/// One watched tree: its recorded ids and its live members by pid.
struct Tracked {
    root: i32,
    pgid: i32,
    sid: i32,
    boot_id: String,
    /// pid -> start ticks of every live member the observer knows.
    members: HashMap<i32, u64>,
    /// pid -> the uid of a member attributed at its fork, read in the same
    /// read of `/proc/<pid>` that proved it the parent's child (one
    /// directory handle: both facts are of one process). With the identity
    /// it names the member to a watch that finds it only by identity: a
    /// process of another user that took the pid within the clock tick of
    /// the member's start shares the identity, not the uid. Kept only while
    /// `members` holds the same pid.
    uids: HashMap<i32, u32>,
    /// Escapes already recorded (or attempted) by identity.
    escaped: HashSet<ProcKey>,
    /// Kernel time of each member's fork, for the latency.
    forked_at: HashMap<i32, u64>,
    /// Moves whenever the observer learns something of this tree's members
    /// (a fork attributed, a member's exec, setsid or exit, a member a
    /// scan handed over, a registration): a scan that read the tree at one
    /// generation has nothing new to find by re-reading the same pids until
    /// it moves. Drawn from [`Shared::generations`], so a tree registered
    /// again never repeats a value an earlier registration had.
    generation: u64,
}

#[derive(Default)]
struct Shared {
    trees: Mutex<HashMap<TreeId, Tracked>>,
    /// Trees registered but not yet replayed against the fork history.
    pending: Mutex<Vec<TreeId>>,
    stats: Mutex<ObserverStats>,
    stop: AtomicBool,
    /// The connector failed: the thread ended, scans carry on alone.
    failed: AtomicBool,
    /// Wakes the thread (stop, a new tree, members a scan added).
    waker: Option<ConnectorWaker>,
    /// The source of every tree's [`Tracked::generation`]; it also moves
    /// when a tree is unwatched, so an unchanged value means no tree's
    /// member pids changed (what [`Worker::refilter`] checks first).
    generations: AtomicU64,
}

impl Shared {
    fn next_generation(&self) -> u64 {
        self.generations.fetch_add(1, Ordering::SeqCst) + 1
    }
}

impl Tracked {
    /// Something of this tree's members changed: its generation moves.
    fn moved(&mut self, shared: &Shared) {
        self.generation = shared.next_generation();
    }
}

/// A cheap handle to a running observer: register trees, read members and
/// health. Clones share the observer.
#[derive(Clone)]
pub struct ObserverHandle {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for ObserverHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObserverHandle").finish_non_exhaustive()
    }
}

/// The observer thread and its handle. Stop it with [`Observer::stop`];
/// dropping it stops it too.
pub struct Observer {
    handle: ObserverHandle,
    thread: Option<JoinHandle<()>>,
}

impl Observer {
    /// Subscribes to proc events (in the caller's thread, so a host without
    /// the capability fails here) and starts the observer thread.
    /// `on_overflow` is called (from that thread) after events were lost:
    /// the caller must run a full scan at once.
    pub fn start(
        ledger: Ledger,
        rcvbuf: usize,
        on_overflow: Box<dyn Fn() + Send>,
    ) -> Result<Observer, ProcError> {
        let conn = Connector::open(rcvbuf)?;
        let shared = Arc::new(Shared {
            waker: Some(conn.waker()),
            ..Shared::default()
        });
        let worker = Worker {
            conn,
            ledger,
            shared: shared.clone(),
            history: VecDeque::new(),
            on_overflow,
            strict: false,
            filtered: None,
            filtered_at: None,
            filter_off: false,
        };
        let thread = std::thread::Builder::new()
            .name("tw-observer".into())
            .spawn(move || worker.run())
            .map_err(ProcError::Io)?;
        Ok(Observer {
            handle: ObserverHandle { shared },
            thread: Some(thread),
        })
    }

    pub fn handle(&self) -> ObserverHandle {
        self.handle.clone()
    }

    /// Stops the thread and returns the final health counters.
    pub fn stop(mut self) -> ObserverStats {
        self.join();
        self.handle.stats()
    }

    fn join(&mut self) {
        self.handle.shared.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            // Ends the thread's wait for events, so a stop is not held up.
            self.handle.wake();
            let _ = t.join();
        }
    }
}

impl Drop for Observer {
    fn drop(&mut self) {
        self.join();
    }
}

impl ObserverHandle {
    /// Watches a released tree: its root is a member now, and so is every
    /// process it forked before this call (replayed from recent forks).
    pub fn watch(&self, tree: TreeId, pgid: i32, sid: i32, root: &crate::proc::Identity) {
        let mut members = HashMap::new();
        members.insert(root.pid, root.start_ticks);
        if let Ok(mut trees) = self.shared.trees.lock() {
            trees.insert(
                tree,
                Tracked {
                    root: root.pid,
                    pgid,
                    sid,
                    boot_id: root.boot_id.clone(),
                    members,
                    uids: HashMap::new(),
                    escaped: HashSet::new(),
                    forked_at: HashMap::new(),
                    generation: self.shared.next_generation(),
                },
            );
        }
        if let Ok(mut p) = self.shared.pending.lock() {
            p.push(tree);
        }
        self.wake();
    }

    /// The tree's generation (`None`: not watched). While it stays the same,
    /// the observer saw no fork, exec, setsid or exit of the tree's members
    /// and no scan handed it a member it did not know; what it cannot see
    /// (a process moved into the tree's cgroup from outside, a lost event:
    /// that forces a full scan) is the scans' to find.
    pub fn generation(&self, tree: TreeId) -> Option<u64> {
        self.generations([tree])?.get(&tree).copied()
    }

    /// The generation of each of `trees`, under one lock, or `None` when
    /// the observer does not watch every one of them (what the scan loop
    /// asks at every tick, for every tree it watches).
    pub fn generations(
        &self,
        trees: impl IntoIterator<Item = TreeId>,
    ) -> Option<HashMap<TreeId, u64>> {
        let tracked = self.shared.trees.lock().ok()?;
        trees
            .into_iter()
            .map(|t| tracked.get(&t).map(|w| (t, w.generation)))
            .collect()
    }

    /// A counter that moves with every tree's generation and whenever a
    /// tree is watched or unwatched: while it stays, no watched tree's
    /// generation moved (the scan loop's idle tick reads it alone, not
    /// every tree's).
    pub fn epoch(&self) -> u64 {
        self.shared.generations.load(Ordering::SeqCst)
    }

    /// Whether the observer still reads the kernel's events (false once
    /// the connector failed; an overflow is not a failure: it forces a
    /// full scan and the observer goes on).
    pub fn healthy(&self) -> bool {
        !self.shared.failed.load(Ordering::SeqCst) && !self.shared.stop.load(Ordering::SeqCst)
    }

    fn wake(&self) {
        if let Some(w) = &self.shared.waker {
            w.wake();
        }
    }

    /// A handle that no proc connector feeds (tests): what it knows of a
    /// tree is what [`ObserverHandle::watch`] and
    /// [`ObserverHandle::scanned`] told it.
    #[cfg(test)]
    pub(crate) fn detached() -> Self {
        Self {
            shared: Arc::default(),
        }
    }

    /// As the observer thread attributes a fork (tests): `key` is a member
    /// of `tree`, read with `uid`.
    #[cfg(test)]
    pub(crate) fn attributed(&self, tree: TreeId, key: ProcKey, uid: u32) {
        if let Ok(mut trees) = self.shared.trees.lock()
            && let Some(t) = trees.get_mut(&tree)
        {
            t.members.insert(key.pid, key.start_ticks);
            t.uids.insert(key.pid, uid);
            t.moved(&self.shared);
        }
    }

    /// Stops watching a tree (it ended).
    pub fn unwatch(&self, tree: TreeId) {
        if let Ok(mut trees) = self.shared.trees.lock()
            && trees.remove(&tree).is_some()
        {
            // The member pids changed: the socket filter is rebuilt.
            self.shared.next_generation();
        }
    }

    /// Live members the observer knows.
    pub fn members(&self, tree: TreeId) -> HashSet<ProcKey> {
        self.shared
            .trees
            .lock()
            .ok()
            .and_then(|t| {
                t.get(&tree).map(|t| {
                    t.members
                        .iter()
                        .filter(|(_, s)| **s != UNKNOWN_START)
                        .map(|(p, s)| ProcKey::new(*p, *s))
                        .collect()
                })
            })
            .unwrap_or_default()
    }

    /// The uid `key` had when its fork was attributed to `tree` (see
    /// [`Tracked::uids`]); `None` when the observer did not read it so (a
    /// member a scan handed over, the root, one gone before its read).
    pub fn uid(&self, tree: TreeId, key: ProcKey) -> Option<u32> {
        let trees = self.shared.trees.lock().ok()?;
        let t = trees.get(&tree)?;
        if t.members.get(&key.pid) != Some(&key.start_ticks) {
            return None;
        }
        t.uids.get(&key.pid).copied()
    }

    /// Cross-check: members a scan found. Ones the observer did not know
    /// (lost events, or forks before the history) are counted and adopted,
    /// so their later forks and setsid are attributed too; returns how
    /// many there were.
    pub fn scanned(&self, tree: TreeId, members: impl IntoIterator<Item = ProcKey>) -> u64 {
        let mut unknown = 0;
        if let Ok(mut trees) = self.shared.trees.lock()
            && let Some(t) = trees.get_mut(&tree)
        {
            for ProcKey { pid, start_ticks } in members {
                if t.members.get(&pid) != Some(&start_ticks) {
                    if t.members.insert(pid, start_ticks).is_some() {
                        // Another process on that pid: not the uid's.
                        t.uids.remove(&pid);
                    }
                    unknown += 1;
                }
            }
            if unknown > 0 {
                t.moved(&self.shared);
            }
        }
        if unknown > 0 {
            self.bump(|s| s.scan_found_unobserved += unknown);
            // The socket filter must name them.
            self.wake();
        }
        unknown
    }

    /// The owner ran the full scan an overflow asked for.
    pub fn forced_scan_done(&self) {
        self.bump(|s| s.forced_scans += 1);
    }

    /// A copy of the health counters.
    pub fn stats(&self) -> ObserverStats {
        self.shared
            .stats
            .lock()
            .map(|s| s.clone())
            .unwrap_or_default()
    }

    fn bump(&self, f: impl FnOnce(&mut ObserverStats)) {
        if let Ok(mut s) = self.shared.stats.lock() {
            f(&mut s);
        }
    }
}

/// A member found by an event, to be written after the batch.
struct Finding {
    tree: TreeId,
    record: MemberRecord,
    escaped: bool,
    forked_at: Option<u64>,
}

struct Worker {
    conn: Connector,
    ledger: Ledger,
    shared: Arc<Shared>,
    /// Recent forks (parent, child, at_ns), oldest first.
    history: VecDeque<(i32, i32, u64)>,
    on_overflow: Box<dyn Fn() + Send>,
    /// This batch lost events: forks are attributed only to parents that
    /// can be verified now.
    strict: bool,
    /// The member pids the socket filter names now (sorted); `None` before
    /// the first filter.
    filtered: Option<Vec<i32>>,
    /// [`Shared::generations`] when `filtered` was computed: while it has
    /// not moved, no member pid changed and the filter stands. Without
    /// it, every batch of events collected and sorted every member pid of
    /// every tree (most of an idle service's CPU on a busy host).
    filtered_at: Option<u64>,
    /// The filter could not be attached: every event arrives, as without.
    filter_off: bool,
}

impl Worker {
    fn run(mut self) {
        let handle = ObserverHandle {
            shared: self.shared.clone(),
        };
        // From the start: no member yet, so no exec or setsid is wanted.
        self.refilter(&mut Vec::new());
        while !self.shared.stop.load(Ordering::SeqCst) {
            let events = match self.conn.recv(IDLE_WAIT) {
                Ok(ev) => ev,
                Err(e) => {
                    // Not silent: the scans carry on alone, and say so.
                    tracing::error!(error = %e, "observer: proc connector failed; scans only from now on");
                    self.shared.failed.store(true, Ordering::SeqCst);
                    handle.bump(|s| s.overflows += 1);
                    (self.on_overflow)();
                    return;
                }
            };
            let mut findings = Vec::new();
            let mut execs: Vec<(TreeId, IdentityRecord)> = Vec::new();
            self.replay_pending(&mut findings);
            handle.bump(|s| s.events += events.len() as u64);
            // Events were lost in this batch (an exit among them, perhaps):
            // prune first, and attribute no fork whose parent cannot be
            // verified now — a stranger may hold a dead member's pid. The
            // forced full scan finds the real members.
            let overflowed = events.iter().any(|e| matches!(e, ProcEvent::Overflow));
            if overflowed {
                self.prune();
            }
            self.strict = overflowed;
            for ev in events {
                match ev {
                    ProcEvent::Overflow => {}
                    ProcEvent::Fork {
                        parent,
                        child,
                        at_ns,
                    } => {
                        self.history.push_back((parent, child, at_ns));
                        if self.history.len() > FORK_HISTORY {
                            self.history.pop_front();
                        }
                        self.on_fork(parent, child, at_ns, &mut findings);
                    }
                    ProcEvent::Sid { pid, .. } => {
                        tracing::trace!(pid, "observer: setsid");
                        self.check(pid, &mut findings)
                    }
                    ProcEvent::Exec { pid, .. } => self.on_exec(pid, &mut execs),
                    ProcEvent::Exit { pid, .. } => self.on_exit(pid),
                }
            }
            if overflowed {
                handle.bump(|s| s.overflows += 1);
                tracing::warn!(
                    "observer: proc connector overflowed, events were lost; forcing a full scan"
                );
                (self.on_overflow)();
            }
            // Before the writes: a new member's details are read after the
            // filter names it, so an exec the filter dropped is in them.
            self.refilter(&mut findings);
            self.flush(findings, &handle);
            self.flush_execs(execs);
        }
    }

    /// Re-attaches the socket filter when the member pids changed, then
    /// re-reads each pid of this batch's forks it names for the first
    /// time: an exec or setsid of it before now was dropped in the kernel
    /// (it was nobody's yet), so a setsid is caught here (an escape, as
    /// [`Worker::check`] finds it) and an exec by the details
    /// [`Worker::flush`] reads afterwards.
    fn refilter(&mut self, findings: &mut Vec<Finding>) {
        if self.filter_off {
            return;
        }
        // Read before the pids: a change while they are collected moves it
        // past this value, and the next batch collects them again.
        let at = self.shared.generations.load(Ordering::SeqCst);
        if self.filtered.is_some() && self.filtered_at == Some(at) {
            return;
        }
        self.filtered_at = Some(at);
        let mut pids: Vec<i32> = self
            .shared
            .trees
            .lock()
            .map(|t| t.values().flat_map(|t| t.members.keys().copied()).collect())
            .unwrap_or_default();
        pids.sort_unstable();
        pids.dedup();
        if self.filtered.as_ref() == Some(&pids) {
            return;
        }
        if let Err(e) = self.conn.filter_to(&pids) {
            // Slower, not blind: every event arrives, as without a filter.
            tracing::warn!(error = %e, "observer: socket filter not attached; filtering in user space");
            self.filter_off = true;
            return;
        }
        let before = self.filtered.replace(pids.clone()).unwrap_or_default();
        // The members this batch attributed (a member a scan handed over
        // is the scan's to classify, escape included, at every tick).
        let attributed: HashSet<i32> = findings.iter().map(|f| f.record.identity.pid).collect();
        for pid in pids {
            if before.binary_search(&pid).is_err() && attributed.contains(&pid) {
                self.check(pid, findings);
            }
        }
    }

    /// A member ran a new program: noted by identity, its details read at
    /// the end of the batch.
    fn on_exec(&mut self, pid: i32, execs: &mut Vec<(TreeId, IdentityRecord)>) {
        let Ok(mut trees) = self.shared.trees.lock() else {
            return;
        };
        for (id, t) in trees.iter_mut() {
            let Some(&start) = t.members.get(&pid) else {
                continue;
            };
            t.moved(&self.shared);
            if start != UNKNOWN_START {
                execs.push((
                    *id,
                    IdentityRecord {
                        pid,
                        start_ticks: start,
                        boot_id: t.boot_id.clone(),
                    },
                ));
            }
        }
    }

    /// Writes what exec'd members run now (`member.exec` where the row said
    /// otherwise), one write per tree.
    fn flush_execs(&self, execs: Vec<(TreeId, IdentityRecord)>) {
        let mut by_tree: HashMap<TreeId, Vec<MemberRecord>> = HashMap::new();
        for (tree, identity) in execs {
            let Ok(Some(stat)) = crate::proc::read_stat(identity.pid) else {
                continue;
            };
            if stat.start_ticks != identity.start_ticks || stat.is_dead() {
                continue;
            }
            let d = crate::scan::details(identity.pid);
            let mut record = record_of(&stat, &identity.boot_id);
            record.exe = d.exe;
            record.cmdline = d.cmdline;
            record.cwd = d.cwd;
            record.cgroup = d.cgroup;
            by_tree.entry(tree).or_default().push(record);
        }
        for (tree, records) in by_tree {
            if let Err(e) = self.ledger.refresh_members(tree, &records) {
                tracing::debug!(tree = tree.0, error = %e, "observer: member execs not recorded");
            }
        }
    }

    /// Trees registered since the last batch: their members' forks that
    /// happened before registration, from the history, then an escape check
    /// of every member.
    fn replay_pending(&mut self, findings: &mut Vec<Finding>) {
        let pending: Vec<TreeId> = self
            .shared
            .pending
            .lock()
            .map(|mut p| std::mem::take(&mut *p))
            .unwrap_or_default();
        for tree in pending {
            let Some(root) = self
                .shared
                .trees
                .lock()
                .ok()
                .and_then(|t| t.get(&tree).map(|t| t.root))
            else {
                continue;
            };
            // Only forks after the root's own: an earlier holder of the
            // root's pid is not the root.
            let from = self.history.iter().rposition(|(_, c, _)| *c == root);
            let forks: Vec<(i32, i32, u64)> = match from {
                Some(i) => self.history.iter().skip(i + 1).copied().collect(),
                None => Vec::new(),
            };
            for (parent, child, at_ns) in forks {
                self.attribute(tree, parent, child, at_ns, findings);
            }
            let pids: Vec<i32> = self
                .shared
                .trees
                .lock()
                .ok()
                .and_then(|t| t.get(&tree).map(|t| t.members.keys().copied().collect()))
                .unwrap_or_default();
            for pid in pids {
                self.check(pid, findings);
            }
        }
    }

    /// Whether `pid` is certainly no tree's member: the socket filter's
    /// pids are exactly the members' while no generation moved since they
    /// were collected. Spares every fork and exit of the host a look at
    /// every tree; after any change (this batch's own attributions too)
    /// the trees are looked at as before.
    fn surely_not_member(&self, pid: i32) -> bool {
        !self.filter_off
            && self.filtered_at == Some(self.shared.generations.load(Ordering::SeqCst))
            && self
                .filtered
                .as_ref()
                .is_some_and(|f| f.binary_search(&pid).is_err())
    }

    fn on_fork(&mut self, parent: i32, child: i32, at_ns: u64, findings: &mut Vec<Finding>) {
        if self.surely_not_member(parent) {
            return;
        }
        let trees: Vec<TreeId> = self
            .shared
            .trees
            .lock()
            .map(|t| {
                t.iter()
                    .filter(|(_, t)| t.members.contains_key(&parent))
                    .map(|(id, _)| *id)
                    .collect()
            })
            .unwrap_or_default();
        for tree in trees {
            self.attribute(tree, parent, child, at_ns, findings);
        }
    }

    /// Makes `child` a member of `tree` if `parent` is one, reading its
    /// identity at once; a child born outside the group and session (its
    /// parent escaped) is an escape too.
    fn attribute(
        &mut self,
        tree: TreeId,
        parent: i32,
        child: i32,
        at_ns: u64,
        findings: &mut Vec<Finding>,
    ) {
        let Ok(mut trees) = self.shared.trees.lock() else {
            return;
        };
        let Some(t) = trees.get_mut(&tree) else {
            return;
        };
        let Some(&parent_start) = t.members.get(&parent) else {
            return;
        };
        if t.members.contains_key(&child) {
            return;
        }
        // The parent must still be the member we know (or gone): a pid
        // recycled after a lost exit event is not our member.
        match crate::proc::read_stat(parent) {
            Ok(Some(p)) if p.start_ticks != parent_start => {
                t.members.remove(&parent);
                t.uids.remove(&parent);
                t.moved(&self.shared);
                return;
            }
            Ok(Some(_)) => {}
            // Gone: normally a short-lived member; after lost events it
            // could have been anyone holding that pid.
            _ if self.strict => return,
            _ => {}
        }
        // Read now: the identity names this process for good, even if it
        // exits and its pid is reused before the batch is written.
        let Ok(Some(stat)) = crate::proc::read_stat(child) else {
            // Already gone (a short-lived intermediate): nothing of it is
            // left to kill, but its own forks, later in this batch, are
            // still ours. It stays a member by pid alone (start unknown,
            // never handed to a teardown) until its exit event.
            t.members.insert(child, UNKNOWN_START);
            t.moved(&self.shared);
            return;
        };
        if stat.start_ticks < parent_start {
            return; // not a child of that parent: a stale fork record
        }
        // The process now at the child's pid must be the parent's child
        // (or, its parent gone, re-parented to this subreaper): a child that
        // exited at once may have left its pid to another user's process
        // within the same clock tick, with the same start time.
        // A real orphan re-parented elsewhere is left to the scans, which
        // find it by its session, group, cgroup or descent.
        if stat.ppid != parent && stat.ppid != std::process::id() as i32 {
            tracing::debug!(
                tree = tree.0,
                parent,
                child,
                ppid = stat.ppid,
                "observer: fork not attributed, the pid's process is not the parent's child"
            );
            return;
        }
        t.members.insert(child, stat.start_ticks);
        t.uids.insert(child, stat.uid);
        t.forked_at.insert(child, at_ns);
        t.moved(&self.shared);
        let escaped = stat.pgid != t.pgid && stat.sid != t.sid;
        tracing::debug!(
            tree = tree.0,
            parent,
            child,
            escaped,
            "observer: fork attributed"
        );
        if escaped {
            t.escaped.insert(ProcKey::new(child, stat.start_ticks));
        }
        findings.push(Finding {
            tree,
            record: record_of(&stat, &t.boot_id),
            escaped,
            forked_at: Some(at_ns),
        });
        drop(trees);
        if let Ok(mut s) = self.shared.stats.lock() {
            s.forks_attributed += 1;
        }
    }

    /// A member changed its session (or was found late): escaped if it is
    /// now outside both the tree's group and session.
    fn check(&mut self, pid: i32, findings: &mut Vec<Finding>) {
        let Ok(mut trees) = self.shared.trees.lock() else {
            return;
        };
        for (id, t) in trees.iter_mut() {
            let Some(&start) = t.members.get(&pid) else {
                continue;
            };
            // A member's setsid (or one found late): its group and session
            // changed, whether or not it escaped.
            t.moved(&self.shared);
            let Ok(Some(stat)) = crate::proc::read_stat(pid) else {
                continue;
            };
            if start == UNKNOWN_START || stat.start_ticks != start || stat.is_dead() {
                continue;
            }
            if stat.pgid == t.pgid
                || stat.sid == t.sid
                || t.escaped.contains(&ProcKey::new(pid, start))
            {
                continue;
            }
            t.escaped.insert(ProcKey::new(pid, start));
            findings.push(Finding {
                tree: *id,
                record: record_of(&stat, &t.boot_id),
                escaped: true,
                forked_at: t.forked_at.get(&pid).copied(),
            });
        }
    }

    /// After lost events: forget members whose pid no longer holds them
    /// (their exit may have been among the lost events).
    fn prune(&mut self) {
        if let Ok(mut trees) = self.shared.trees.lock() {
            for t in trees.values_mut() {
                let before = t.members.len();
                t.members.retain(|pid, start| {
                    matches!(crate::proc::read_stat(*pid), Ok(Some(s)) if s.start_ticks == *start && !s.is_dead())
                });
                if t.members.len() != before {
                    let members = &t.members;
                    t.uids.retain(|pid, _| members.contains_key(pid));
                    t.moved(&self.shared);
                }
            }
        }
    }

    fn on_exit(&mut self, pid: i32) {
        if self.surely_not_member(pid) {
            return;
        }
        if let Ok(mut trees) = self.shared.trees.lock() {
            for t in trees.values_mut() {
                if t.members.remove(&pid).is_some() {
                    t.uids.remove(&pid);
                    t.forked_at.remove(&pid);
                    t.moved(&self.shared);
                }
            }
        }
    }

    /// Writes a batch's findings: new members in one write per tree, then
    /// each escape (its own row and event).
    fn flush(&self, findings: Vec<Finding>, handle: &ObserverHandle) {
        if findings.is_empty() {
            return;
        }
        let mut by_tree: HashMap<TreeId, Vec<&Finding>> = HashMap::new();
        for f in &findings {
            by_tree.entry(f.tree).or_default().push(f);
        }
        for (tree, list) in by_tree {
            let id = tree;
            let mut records: Vec<MemberRecord> = list.iter().map(|f| f.record.clone()).collect();
            // Details (exe, argv, cwd) as of now: usually after the exec.
            // They are read by pid, so they are kept only if a read after
            // them still finds the process the fork's read did (its start
            // and parent, or this subreaper if it was orphaned): the member
            // may have exited since and another's process taken its pid
            // within the same clock tick. The uid
            // stays the one read with the fork's check ([`Tracked::uids`]).
            for r in &mut records {
                let d = crate::scan::details(r.identity.pid);
                let same = crate::proc::read_stat(r.identity.pid).is_ok_and(|s| {
                    s.is_some_and(|s| {
                        s.start_ticks == r.identity.start_ticks
                            && (s.ppid == r.ppid || s.ppid == std::process::id() as i32)
                    })
                });
                if !same {
                    continue;
                }
                r.exe = d.exe;
                r.cmdline = d.cmdline;
                r.cwd = d.cwd;
                r.cgroup = d.cgroup;
            }
            match self.ledger.observe_members(id, &records) {
                Ok(new) => handle.bump(|s| s.members_recorded += new.len() as u64),
                Err(e) => {
                    handle.bump(|s| s.write_errors += 1);
                    tracing::debug!(tree = tree.0, error = %e, "observer: members not recorded");
                }
            }
            for (f, record) in list.iter().zip(&records) {
                if !f.escaped {
                    continue;
                }
                let reason = format!(
                    "observed: left the tree's group and session (pgid {}, sid {}) at once (proc connector)",
                    record.pgid, record.sid
                );
                match self.ledger.record_escape(id, record, &reason) {
                    Ok(new) => {
                        let latency = f
                            .forked_at
                            .map(|at| Duration::from_nanos(monotonic_ns().saturating_sub(at)));
                        handle.bump(|s| {
                            if new {
                                s.escapes_recorded += 1;
                            }
                            if let Some(l) = latency {
                                s.last_detection_latency = Some(l);
                                if s.latencies.len() >= LATENCY_SAMPLES {
                                    s.latencies.remove(0);
                                }
                                s.latencies.push(l);
                            }
                        });
                        tracing::info!(
                            tree = tree.0,
                            pid = record.identity.pid,
                            ?latency,
                            "observer: escape recorded"
                        );
                    }
                    Err(e) => {
                        handle.bump(|s| s.write_errors += 1);
                        tracing::warn!(tree = tree.0, error = %e, "observer: escape not recorded");
                    }
                }
            }
        }
    }
}

fn record_of(stat: &crate::proc::ProcStat, boot_id: &str) -> MemberRecord {
    MemberRecord {
        identity: IdentityRecord {
            pid: stat.pid,
            start_ticks: stat.start_ticks,
            boot_id: boot_id.to_owned(),
        },
        ppid: stat.ppid,
        pgid: stat.pgid,
        sid: stat.sid,
        cgroup: None,
        uid: Some(stat.uid),
        exe: None,
        cmdline: Vec::new(),
        cwd: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proc::Identity;

    fn root(pid: i32) -> Identity {
        Identity {
            pid,
            start_ticks: 100,
            boot_id: "boot".into(),
        }
    }

    /// The scan loop skips a tree while its generation stays: the value
    /// moves for a member the observer did not know, never for one it
    /// knew, and a tree registered again never repeats an earlier value.
    #[test]
    fn a_trees_generation_moves_for_news_only_and_never_repeats() {
        let h = ObserverHandle::detached();
        let tree = TreeId(7);
        assert_eq!(h.generation(tree), None, "not watched");
        h.watch(tree, 40, 40, &root(40));
        let first = h.generation(tree).expect("watched");
        assert_eq!(h.scanned(tree, [ProcKey::new(40, 100)]), 0);
        assert_eq!(h.generation(tree), Some(first), "the root it knew");
        assert_eq!(h.scanned(tree, [ProcKey::new(41, 101)]), 1);
        let second = h.generation(tree).expect("watched");
        assert_ne!(second, first, "a member it did not know");
        // Another tree's news does not move this one.
        h.watch(TreeId(8), 50, 50, &root(50));
        assert_eq!(h.scanned(TreeId(8), [ProcKey::new(51, 1)]), 1);
        assert_eq!(h.generation(tree), Some(second));
        // The same pid with another start time is another process.
        assert_eq!(h.scanned(tree, [ProcKey::new(41, 999)]), 1);
        let third = h.generation(tree).expect("watched");
        assert_ne!(third, second);
        assert_eq!(
            h.generations([tree, TreeId(8)]),
            Some(HashMap::from([
                (tree, third),
                (TreeId(8), h.generation(TreeId(8)).expect("8"))
            ])),
            "every tree's, under one lock"
        );
        assert_eq!(h.generations([tree, TreeId(9)]), None, "9 is not watched");
        h.unwatch(tree);
        assert_eq!(h.generation(tree), None);
        h.watch(tree, 40, 40, &root(40));
        let again = h.generation(tree).expect("watched again");
        assert!(
            ![first, second, third].contains(&again),
            "a registration repeated a value: {again}"
        );
    }
}
