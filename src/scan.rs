//! Snapshot scans of `/proc`, and the pure classification of what they saw.
//!
//! A scan is two steps kept apart on purpose: [`snapshot`] reads the kernel's
//! view, and [`classify`] is a pure function of that snapshot and the trees we
//! know. Tests feed `classify` crafted snapshots; the engine feeds it real ones.
//!
//! The snapshot is the hot path of every tick (its budget: within 1.3x of plain
//! reads of every `/proc/<pid>/stat`), so it does not go through `procfs`'s
//! per-process directory handle and full field parse: [`parse_stat`] reads
//! only the fields classification needs from one buffer reused across the
//! walk. `comm` may hold spaces, parentheses and newlines; like `procfs`, the
//! parser takes it between the first `(` and the *last* `)`. A property test
//! checks it against `procfs`'s parser on the same bytes, for every live
//! process and for crafted names.
//!
//! Membership is monotonic by construction: a process once seen as a member is
//! remembered by its identity (pid + start ticks) in [`KnownTree::seen`], so a
//! member re-parented to the subreaper (or to init) after its parent died stays
//! a member. Escapes are findings the caller records once and never erases; a
//! later scan that would no longer derive them changes nothing.
//!
//! This module never signals anything and never writes the ledger.

use std::collections::{HashMap, HashSet};
use std::path::Path;

pub use crate::proc::read_entry;
use crate::proc::read_in_parallel;
/// The snapshot and its reads live in `proc` ([`crate::proc::snapshot`]):
/// this module classifies what they saw.
pub use crate::proc::{HostView, Snapshot, snapshot, snapshot_pids};
/// The one model and parser of `/proc/<pid>/stat` live in `proc` ([`crate::proc::stat`]).
pub use crate::proc::{ProcEntry, parse_stat};

/// A full walk handed to many callers at once (the custody host's coalesced
/// walks): immutable, and indexed once for all of them.
///
/// Why it exists: each of a drain's teardowns classifies the same walk for
/// its own tree, and [`classify`] of one tree costs the whole host (every
/// process hashed into its maps: 15,000 of them for each of 2,000 trees).
/// Shared, the walk is indexed once ([`SnapshotIndex`], at its second
/// classification: a walk one caller had alone is classified as before)
/// and each further tree then costs its own members
/// ([`classify_tree`], held equal to `classify` by a property test).
///
/// A caller classifies its tree of a shared walk with
/// [`SharedSnapshot::classify_one`]; the snapshot cannot change once
/// shared (its `Snapshot` is private and reached only through `Deref`), so
/// one index serves every caller.
#[derive(Debug)]
pub struct SharedSnapshot {
    snap: Snapshot,
    index: std::sync::OnceLock<SnapshotIndex>,
    /// Classifications asked of it so far: the first is the full pass (a
    /// walk nobody else shares, a lone teardown's, costs what it did
    /// before); the index is built for the second and serves the rest.
    classified: std::sync::atomic::AtomicUsize,
}

impl std::ops::Deref for SharedSnapshot {
    type Target = Snapshot;

    fn deref(&self) -> &Snapshot {
        &self.snap
    }
}

/// Makes `snap` a [`SharedSnapshot`]: immutable from here on.
pub fn share(snap: Snapshot) -> std::sync::Arc<SharedSnapshot> {
    std::sync::Arc::new(SharedSnapshot {
        snap,
        index: std::sync::OnceLock::new(),
        classified: std::sync::atomic::AtomicUsize::new(0),
    })
}

impl SharedSnapshot {
    /// One tree of this walk, as [`classify`] finds it: its first
    /// classification is the plain pass (a walk with one taker is never
    /// indexed); from the second on, through the walk's index (built once,
    /// by the first caller that needs it), at the cost of the tree's
    /// members ([`classify_tree`]: the same findings).
    pub fn classify_one(&self, tree: &KnownTree, exclude: &HashSet<i32>) -> TreeFindings {
        let n = self
            .classified
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if n == 0 {
            return classify(&self.snap, std::slice::from_ref(tree), exclude)
                .pop()
                .unwrap_or_default();
        }
        let index = self.index.get_or_init(|| SnapshotIndex::new(&self.snap));
        classify_tree(&self.snap, index, tree, exclude)
    }
}

/// The time since boot in start-time clock ticks, where a start time
/// counts from boot (Linux: [`crate::proc::boot_ticks_now`]); `None`
/// elsewhere (a Windows job's listing is always confirmed by a second read).
pub fn boot_ticks_now() -> Option<u64> {
    crate::proc::boot_ticks_now()
}

/// The pids in a tree's container (a cgroup's `cgroup.procs`, a job's
/// process list; empty if it is gone): [`crate::proc::member_pids`]. `Err`
/// when the read failed for another reason: the members are then unknown,
/// not none.
pub fn cgroup_pids(dir: &Path) -> Result<HashSet<i32>, String> {
    crate::proc::member_pids(dir)
}

pub use crate::proc::{Lineage, MemberDetails, cmdline, details, uid_of, wchan};

/// [`cmdline`] of each pid, in their order (read in parallel when many).
pub fn cmdlines(pids: &[i32]) -> Vec<Vec<String>> {
    read_in_parallel(pids, |chunk| {
        chunk.iter().map(|&pid| cmdline(pid)).collect()
    })
}

/// Outside the tree's group and session. A Windows process's console group
/// cannot be read (its entry says pgid 0 and sid 0): the job, not the
/// group, holds the tree there, so it is never judged an escape.
fn escaped_from(entry: &ProcEntry, tree: &KnownTree) -> bool {
    if !crate::proc::GROUPS_READABLE && entry.pgid == 0 && entry.sid == 0 {
        return false;
    }
    entry.pgid != tree.pgid && entry.sid != tree.sid
}

/// A tree as the classifier needs to know it: its recorded boundary and the
/// members already seen (by identity), which keeps membership monotonic.
#[derive(Clone, Debug, Default)]
pub struct KnownTree {
    pub id: crate::ledger::TreeId,
    /// Recorded at spawn, never re-resolved from the leader.
    pub pgid: i32,
    pub sid: i32,
    /// Pids read from the tree's `cgroup.procs` for this scan (cgroup boundary).
    pub cgroup_pids: HashSet<i32>,
    /// `(pid, start_ticks)` of every member seen before.
    pub seen: HashSet<crate::proc::ProcKey>,
    /// `(pid, start_ticks)` of members the proc-connector observer
    /// attributed to the tree (a fork from a member), whether or not a scan
    /// ever saw them.
    pub observed: HashSet<crate::proc::ProcKey>,
    /// Start ticks of the recorded root (0 = unknown). A session or group
    /// whose leader pid now belongs to another process, or a process that
    /// started before the root, is not ours: pids of sessions and groups are
    /// reused once they are empty.
    pub root_start_ticks: u64,
    /// A subreaper that owns only this tree (`run`): every process it adopted
    /// came from the tree, so its children are members (a daemonizing double
    /// fork lands here, in a session of its own). The subreaper itself stays
    /// excluded.
    pub adopted_by: Option<i32>,
}

impl KnownTree {
    /// Whether session/group matches can be trusted in this snapshot: the
    /// leader (pid == sid, pid == pgid) is either gone or is the recorded root.
    ///
    /// A leaderless session or group is trusted only while a member seen
    /// before (by identity) still lives in it: once all of a tree's known
    /// processes are gone its ids can be reused by a stranger's `setsid()`,
    /// and the stranger's children would otherwise look like ours.
    fn ids_are_ours(&self, snap: &Snapshot) -> bool {
        match self.leaders(snap) {
            Leaders::Ours => true,
            Leaders::Stranger => false,
            Leaders::Gone => snap.entries.values().any(|e| {
                e.is_live()
                    && (e.sid == self.sid || e.pgid == self.pgid)
                    && self.seen.contains(&e.key())
            }),
        }
    }

    /// What holds the pids of the tree's session and group leaders now.
    fn leaders(&self, snap: &Snapshot) -> Leaders {
        if self.root_start_ticks == 0 {
            return Leaders::Ours;
        }
        let mut gone = false;
        for leader in [self.sid, self.pgid] {
            match snap.entries.get(&leader) {
                Some(e) if e.start_ticks != self.root_start_ticks => return Leaders::Stranger,
                Some(_) => {}
                None => gone = true,
            }
        }
        if gone { Leaders::Gone } else { Leaders::Ours }
    }
}

impl KnownTree {
    /// Why a live, not excluded process is a member without descent (its
    /// cgroup, session, group, an earlier sighting, the observer, or its
    /// adoption), if it is one; `trusted` is [`KnownTree::ids_are_ours`].
    fn direct(&self, entry: &ProcEntry, trusted: bool) -> Option<Because> {
        let ids_match = trusted && entry.start_ticks >= self.root_start_ticks;
        if self.cgroup_pids.contains(&entry.pid) {
            Some(Because::Cgroup)
        } else if ids_match && entry.sid == self.sid {
            Some(Because::Session)
        } else if ids_match && entry.pgid == self.pgid {
            Some(Because::Group)
        } else if self.seen.contains(&entry.key()) {
            Some(Because::Seen)
        } else if self.observed.contains(&entry.key()) {
            Some(Because::Observed)
        } else if self.adopted_by == Some(entry.ppid) {
            Some(Because::Adopted)
        } else {
            None
        }
    }
}

/// What holds the pids of a tree's session and group leaders
/// ([`KnownTree::ids_are_ours`]).
enum Leaders {
    /// The recorded root (or no root start time to compare with).
    Ours,
    /// A process that is not the recorded root: the ids were reused.
    Stranger,
    /// Nobody: the ids are ours only while a member seen before lives.
    Gone,
}

/// Why a process counts as a member.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Because {
    Cgroup,
    Session,
    Group,
    /// Seen as a member before (e.g. re-parented since).
    Seen,
    /// Forked by a member, as the proc connector reported it.
    Observed,
    /// A descendant of a member.
    Descent,
    /// A child of the tree's own subreaper (see [`KnownTree::adopted_by`]).
    Adopted,
}

/// One member found by a scan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    pub entry: ProcEntry,
    pub because: Because,
    /// Outside both the tree's process group and its session.
    pub escaped: bool,
}

/// What one scan found for one tree.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TreeFindings {
    pub tree: crate::ledger::TreeId,
    /// Live members (zombies excluded).
    pub members: Vec<Member>,
}

impl TreeFindings {
    pub fn escapes(&self) -> impl Iterator<Item = &Member> {
        self.members.iter().filter(|m| m.escaped)
    }
}

/// Classifies a snapshot against the known trees.
///
/// A live process is a member of a tree if it is in the tree's cgroup, its
/// session, or its process group, was seen as a member before, or descends
/// (by parent links in this snapshot) from a member. A member outside both the
/// tree's group and session has escaped. `exclude` holds the scanner, the
/// owner and their helpers: never members, and never a link of descent (a
/// subreaper's adopted children are not its descendants in the tree sense).
/// When a process matches several trees, the first direct match wins, in the
/// order of `trees`. (One tree of a shared walk:
/// [`SharedSnapshot::classify_one`].)
pub fn classify(snap: &Snapshot, trees: &[KnownTree], exclude: &HashSet<i32>) -> Vec<TreeFindings> {
    // Direct matches first.
    let mut owner_of: HashMap<i32, (usize, Because)> = HashMap::new();
    let trusted: Vec<bool> = trees.iter().map(|t| t.ids_are_ours(snap)).collect();
    for entry in snap.entries.values() {
        if !entry.is_live() || exclude.contains(&entry.pid) {
            continue;
        }
        for (i, tree) in trees.iter().enumerate() {
            if let Some(because) = tree.direct(entry, trusted[i]) {
                owner_of.insert(entry.pid, (i, because));
                break;
            }
        }
    }
    // Then descent: walk each unowned process's parent chain to the first
    // member (or to a root / excluded process). Memoised so the whole pass is
    // linear in the number of processes.
    let mut descent: HashMap<i32, Option<usize>> = HashMap::new();
    let pids: Vec<i32> = snap.entries.keys().copied().collect();
    for pid in pids {
        if owner_of.contains_key(&pid) || descent.contains_key(&pid) {
            continue;
        }
        let mut chain = Vec::new();
        let mut cur = pid;
        let found = loop {
            if let Some((i, _)) = owner_of.get(&cur) {
                break Some(*i);
            }
            if let Some(known) = descent.get(&cur) {
                break *known;
            }
            if exclude.contains(&cur) || chain.len() > snap.entries.len() {
                break None;
            }
            let Some(entry) = snap.entries.get(&cur) else {
                break None;
            };
            chain.push(cur);
            if entry.ppid <= 0 || entry.ppid == cur {
                break None;
            }
            cur = entry.ppid;
        };
        for p in chain {
            descent.insert(p, found);
        }
    }
    let mut out: Vec<TreeFindings> = trees
        .iter()
        .map(|t| TreeFindings {
            tree: t.id,
            members: Vec::new(),
        })
        .collect();
    for entry in snap.entries.values() {
        if !entry.is_live() || exclude.contains(&entry.pid) {
            continue;
        }
        let hit = match owner_of.get(&entry.pid) {
            Some((i, because)) => Some((*i, *because)),
            None => descent
                .get(&entry.pid)
                .copied()
                .flatten()
                .map(|i| (i, Because::Descent)),
        };
        if let Some((i, because)) = hit {
            let tree = &trees[i];
            let escaped = escaped_from(entry, tree);
            out[i].members.push(Member {
                entry: entry.clone(),
                because,
                escaped,
            });
        }
    }
    for findings in &mut out {
        findings.members.sort_by_key(|m| m.entry.pid);
    }
    out
}

/// A snapshot's processes indexed by parent, session and group, built once
/// and shared by the classification of every tree ([`classify_tree`]): the
/// service ticks all its watched trees against one index instead of walking
/// the whole host once per tree.
#[derive(Debug, Default)]
pub struct SnapshotIndex {
    children: HashMap<i32, Vec<i32>>,
    by_sid: HashMap<i32, Vec<i32>>,
    by_pgid: HashMap<i32, Vec<i32>>,
    len: usize,
}

impl SnapshotIndex {
    pub fn new(snap: &Snapshot) -> Self {
        let n = snap.entries.len();
        let mut index = Self {
            children: HashMap::with_capacity(n),
            by_sid: HashMap::new(),
            by_pgid: HashMap::new(),
            len: n,
        };
        for e in snap.entries.values() {
            // Every parent, even none (0) or itself (a torn read): a
            // subreaper's children are looked up here too.
            index.children.entry(e.ppid).or_default().push(e.pid);
            index.by_sid.entry(e.sid).or_default().push(e.pid);
            index.by_pgid.entry(e.pgid).or_default().push(e.pid);
        }
        index
    }

    fn listed(map: &HashMap<i32, Vec<i32>>, key: i32) -> &[i32] {
        map.get(&key).map(Vec::as_slice).unwrap_or_default()
    }
}

impl KnownTree {
    /// [`KnownTree::ids_are_ours`] through the index: only the processes
    /// of the tree's session and group are looked at.
    fn ids_are_ours_indexed(&self, snap: &Snapshot, index: &SnapshotIndex) -> bool {
        match self.leaders(snap) {
            Leaders::Ours => true,
            Leaders::Stranger => false,
            Leaders::Gone => SnapshotIndex::listed(&index.by_sid, self.sid)
                .iter()
                .chain(SnapshotIndex::listed(&index.by_pgid, self.pgid))
                .filter_map(|pid| snap.entries.get(pid))
                .any(|e| e.is_live() && self.seen.contains(&e.key())),
        }
    }
}

/// Classifies a snapshot for one tree, with its own `exclude` set, through
/// an index of the snapshot: exactly `classify(snap, &[tree], exclude)`
/// (a property test holds them equal), at the cost of the tree's members
/// rather than of the whole host.
///
/// The direct matches are looked up (the cgroup's pids, the session's and
/// the group's processes, the members seen or observed before, the
/// subreaper's children) instead of found by testing every process; descent
/// walks down from them through the parent index, never through an excluded
/// process, instead of up from every process. Each tree keeps its own
/// exclusions: the owner of one tree may be a member of another.
pub fn classify_tree(
    snap: &Snapshot,
    index: &SnapshotIndex,
    tree: &KnownTree,
    exclude: &HashSet<i32>,
) -> TreeFindings {
    let trusted = tree.ids_are_ours_indexed(snap, index);
    // Direct matches. A tree that remembers more processes than the host
    // has is cheaper to test process by process.
    let remembered = tree.seen.len() + tree.observed.len() + tree.cgroup_pids.len();
    let candidates: Vec<i32> = if remembered > index.len {
        snap.entries.keys().copied().collect()
    } else {
        let mut c: Vec<i32> = tree.cgroup_pids.iter().copied().collect();
        c.extend_from_slice(SnapshotIndex::listed(&index.by_sid, tree.sid));
        c.extend_from_slice(SnapshotIndex::listed(&index.by_pgid, tree.pgid));
        c.extend(tree.seen.iter().map(|k| k.pid));
        c.extend(tree.observed.iter().map(|k| k.pid));
        if let Some(reaper) = tree.adopted_by {
            c.extend_from_slice(SnapshotIndex::listed(&index.children, reaper));
        }
        c
    };
    let mut hits: HashMap<i32, Because> = HashMap::new();
    for pid in candidates {
        let Some(entry) = snap.entries.get(&pid) else {
            continue;
        };
        if hits.contains_key(&pid) || !entry.is_live() || exclude.contains(&pid) {
            continue;
        }
        if let Some(because) = tree.direct(entry, trusted) {
            hits.insert(pid, because);
        }
    }
    // Descent: down from every direct member, through any process (a
    // zombie too, as a link) that is not excluded.
    let mut stack: Vec<i32> = hits.keys().copied().collect();
    let mut visited: HashSet<i32> = stack.iter().copied().collect();
    while let Some(pid) = stack.pop() {
        for &child in SnapshotIndex::listed(&index.children, pid) {
            // Its own parent only in a torn read: no link.
            if child == pid || exclude.contains(&child) || !visited.insert(child) {
                continue;
            }
            hits.entry(child).or_insert(Because::Descent);
            stack.push(child);
        }
    }
    let mut members: Vec<Member> = hits
        .into_iter()
        .filter_map(|(pid, because)| {
            let entry = snap.entries.get(&pid)?;
            entry.is_live().then(|| Member {
                escaped: escaped_from(entry, tree),
                entry: entry.clone(),
                because,
            })
        })
        .collect();
    members.sort_by_key(|m| m.entry.pid);
    TreeFindings {
        tree: tree.id,
        members,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(pid: i32, ppid: i32, pgid: i32, sid: i32) -> ProcEntry {
        ProcEntry {
            pid,
            ppid,
            pgid,
            sid,
            start_ticks: 1000 + pid as u64,
            state: 'S',
            comm: format!("p{pid}"),
            rss_bytes: 0,
            start_stack: 0,
        }
    }

    fn snap(entries: Vec<ProcEntry>) -> Snapshot {
        Snapshot::of(entries.into_iter().map(|e| (e.pid, e)).collect())
    }

    fn tree(id: i64, pgid: i32) -> KnownTree {
        KnownTree {
            id: crate::ledger::TreeId(id),
            pgid,
            sid: pgid,
            ..Default::default()
        }
    }

    #[test]
    fn a_snapshot_read_in_parallel_holds_what_one_thread_reads() {
        // This process's threads and pid 1 cannot exit meanwhile; with
        // more than proc::PARALLEL_MIN pids the read is split.
        let mut pids: Vec<i32> = (1..=crate::proc::PARALLEL_MIN as i32 * 2).collect();
        pids.push(std::process::id() as i32);
        let parallel = snapshot_pids(pids.clone());
        let me = std::process::id() as i32;
        let key = |e: &ProcEntry| (e.pid, e.start_ticks, e.pgid, e.sid, e.comm.clone());
        assert_eq!(
            parallel.entries.get(&me).map(key),
            read_entry(me).as_ref().map(key)
        );
        assert_eq!(
            parallel.entries.get(&1).map(|e| e.start_ticks),
            read_entry(1).map(|e| e.start_ticks)
        );
        assert!(
            pids.iter()
                .all(|p| parallel.entries.get(p).is_none_or(|e| e.pid == *p))
        );
        let whole = snapshot();
        assert!(whole.entries.contains_key(&me) && whole.entries.contains_key(&1));
    }

    #[test]
    fn members_by_group_session_and_descent() {
        let s = snap(vec![
            p(1, 0, 1, 1),
            p(50, 1, 50, 50),     // the owner
            p(100, 50, 100, 100), // root
            p(101, 100, 100, 100),
            p(102, 101, 102, 100), // own group, same session
            p(103, 102, 103, 103), // setsid: escaped, by descent
            p(104, 103, 103, 103), // its child: escaped too
            p(200, 1, 200, 200),   // unrelated
        ]);
        let exclude = HashSet::from([50]);
        let f = classify(&s, &[tree(7, 100)], &exclude);
        let pids: Vec<i32> = f[0].members.iter().map(|m| m.entry.pid).collect();
        assert_eq!(pids, vec![100, 101, 102, 103, 104]);
        let escaped: Vec<i32> = f[0].escapes().map(|m| m.entry.pid).collect();
        assert_eq!(escaped, vec![103, 104]);
        assert_eq!(f[0].members[2].because, Because::Session);
        assert_eq!(f[0].members[3].because, Because::Descent);
    }

    #[test]
    fn reparented_escapee_stays_a_member_once_seen() {
        // 103 escaped and its parent died: it is now a child of the owner
        // (subreaper), which is excluded, so descent no longer finds it.
        let s = snap(vec![
            p(50, 1, 50, 50),
            p(100, 50, 100, 100),
            p(103, 50, 103, 103),
        ]);
        let exclude = HashSet::from([50]);
        let mut t = tree(7, 100);
        let first = classify(&s, std::slice::from_ref(&t), &exclude);
        assert_eq!(
            first[0].members.len(),
            1,
            "without memory, ancestry is lost"
        );
        t.seen.insert(crate::proc::ProcKey::new(103, 1103));
        let again = classify(&s, std::slice::from_ref(&t), &exclude);
        let m: Vec<(i32, bool)> = again[0]
            .members
            .iter()
            .map(|m| (m.entry.pid, m.escaped))
            .collect();
        assert_eq!(m, vec![(100, false), (103, true)]);
    }

    #[test]
    fn children_of_a_dedicated_subreaper_are_adopted_members() {
        // `run` (50) owns only tree 7: the daemon 103 it adopted, and its child, are members.
        let s = snap(vec![
            p(50, 1, 50, 50),
            p(103, 50, 103, 103),
            p(104, 103, 103, 103),
        ]);
        let mut t = tree(7, 100);
        t.adopted_by = Some(50);
        let f = classify(&s, &[t], &HashSet::from([50]));
        let m: Vec<(i32, Because)> = f[0]
            .members
            .iter()
            .map(|m| (m.entry.pid, m.because))
            .collect();
        assert_eq!(m, vec![(103, Because::Adopted), (104, Because::Descent)]);
    }

    #[test]
    fn recycled_pid_is_not_remembered() {
        // Same pid, later start: not the process we saw.
        let mut e = p(103, 1, 103, 103);
        e.start_ticks = 99_999;
        let s = snap(vec![e]);
        let mut t = tree(7, 100);
        t.seen.insert(crate::proc::ProcKey::new(103, 1103));
        assert!(classify(&s, &[t], &HashSet::new())[0].members.is_empty());
    }

    #[test]
    fn zombies_excluded_and_children_of_excluded_are_not_descendants() {
        let mut z = p(101, 100, 100, 100);
        z.state = 'Z';
        let s = snap(vec![
            p(100, 50, 100, 100),
            z,
            p(50, 1, 50, 50),
            p(60, 50, 60, 60),
        ]);
        let f = classify(&s, &[tree(7, 100)], &HashSet::from([50]));
        let pids: Vec<i32> = f[0].members.iter().map(|m| m.entry.pid).collect();
        assert_eq!(pids, vec![100]);
    }

    #[test]
    fn cgroup_members_beat_other_trees() {
        let s = snap(vec![p(300, 1, 300, 300)]);
        let mut a = tree(1, 100);
        a.cgroup_pids.insert(300);
        let f = classify(&s, &[a, tree(2, 300)], &HashSet::new());
        assert_eq!(f[0].members.len(), 1);
        assert_eq!(f[0].members[0].because, Because::Cgroup);
        assert!(f[0].members[0].escaped);
        assert!(f[1].members.is_empty());
    }

    #[test]
    fn recycled_session_id_is_not_ours() {
        // The root (pid 100, start 1100) is gone; pid 100 now leads a new
        // session started later: neither it nor its session are members.
        let mut impostor = p(100, 1, 100, 100);
        impostor.start_ticks = 5000;
        let mut child = p(101, 100, 100, 100);
        child.start_ticks = 5001;
        let s = snap(vec![impostor, child]);
        let mut t = tree(7, 100);
        t.root_start_ticks = 1100;
        assert!(classify(&s, &[t], &HashSet::new())[0].members.is_empty());
    }

    #[test]
    fn a_leaderless_session_is_trusted_only_through_a_known_member() {
        // The root (100) is gone. 101 was seen before; 102 was not.
        let s = snap(vec![p(101, 1, 100, 100), p(102, 101, 100, 100)]);
        let mut t = tree(7, 100);
        t.root_start_ticks = 1100;
        let blind = classify(&s, std::slice::from_ref(&t), &HashSet::new());
        assert!(
            blind[0].members.is_empty(),
            "no known member lives: a reused session is not ours"
        );
        t.seen.insert(crate::proc::ProcKey::new(101, 1101));
        let f = classify(&s, &[t], &HashSet::new());
        let pids: Vec<i32> = f[0].members.iter().map(|m| m.entry.pid).collect();
        assert_eq!(pids, vec![101, 102]);
    }

    #[test]
    fn parent_cycles_terminate() {
        // Not possible in a real kernel snapshot, but a torn read must not hang.
        let s = snap(vec![p(10, 11, 10, 10), p(11, 10, 11, 11)]);
        let f = classify(&s, &[tree(7, 100)], &HashSet::new());
        assert!(f[0].members.is_empty());
    }

    /// `procfs`'s parse of the same bytes, in our terms.
    fn by_procfs(buf: &[u8], page: u64) -> Option<ProcEntry> {
        use procfs::FromRead;
        let stat = procfs::process::Stat::from_read(buf).ok()?;
        Some(ProcEntry {
            pid: stat.pid,
            ppid: stat.ppid,
            pgid: stat.pgrp,
            sid: stat.session,
            start_ticks: stat.starttime,
            state: stat.state,
            comm: stat.comm,
            rss_bytes: stat.rss.saturating_mul(page),
            start_stack: stat.startstack,
        })
    }

    #[test]
    fn lean_parser_agrees_with_procfs_on_every_live_process() {
        let page = procfs::page_size();
        let mut checked = 0;
        for dirent in std::fs::read_dir("/proc").expect("read /proc").flatten() {
            let Some(pid) = dirent
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<i32>().ok())
            else {
                continue;
            };
            // One read, both parsers: the comparison is exact.
            let Ok(bytes) = std::fs::read(format!("/proc/{pid}/stat")) else {
                continue; // exited meanwhile
            };
            let ours = parse_stat(&bytes, page);
            assert!(
                ours.is_some(),
                "lean parser refused {:?}",
                String::from_utf8_lossy(&bytes)
            );
            assert_eq!(ours, by_procfs(&bytes, page), "pid {pid}");
            checked += 1;
        }
        assert!(checked > 0, "no process checked");
    }

    /// A stat line as the kernel writes it (52 fields), with a given comm.
    fn stat_line(pid: i32, comm: &[u8], state: u8, start: u64, rss: u64) -> Vec<u8> {
        let mut line = format!("{pid} (").into_bytes();
        line.extend_from_slice(comm);
        line.extend_from_slice(b") ");
        line.push(state);
        let mut rest = format!(" {} {} {}", pid - 1, pid - 2, pid - 3);
        for f in 7..=21 {
            rest.push_str(&format!(" {}", f * 3));
        }
        rest.push_str(&format!(" {start} 123456789 {rss}"));
        for f in 25..=52 {
            rest.push_str(&format!(" {f}"));
        }
        rest.push('\n');
        line.extend_from_slice(rest.as_bytes());
        line
    }

    #[test]
    fn lean_parser_agrees_with_procfs_on_crafted_names() {
        let page = 4096;
        let mut names: Vec<Vec<u8>> = [
            "sleep",
            "",
            " ",
            "a b",
            "(",
            ")",
            "()",
            ")(",
            "a) S 1 2 3",
            "x (y) z",
            "((()))",
            ") R 9 9 9 (",
            "new\nline",
            "\n) Z 1 1 1\n",
            "tab\there",
            "ünï",
        ]
        .iter()
        .map(|s| s.as_bytes().to_vec())
        .collect();
        // Deterministic pseudo-random names over the awkward alphabet (up to
        // 15 bytes, the kernel's limit for comm).
        let alphabet = b"ab (). )\n(S 1Z";
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..2000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let len = (x % 16) as usize;
            names.push(
                (0..len)
                    .map(|i| alphabet[((x >> (i * 4)) as usize + i) % alphabet.len()])
                    .collect(),
            );
        }
        for (i, name) in names.iter().enumerate() {
            let line = stat_line(1000 + i as i32, name, b"RSZTDX"[i % 6], 77 + i as u64, 5);
            let ours = parse_stat(&line, page);
            assert_eq!(
                ours,
                by_procfs(&line, page),
                "comm {:?}",
                String::from_utf8_lossy(name)
            );
            let ours = ours.expect("crafted line parses");
            assert_eq!(ours.comm.as_bytes(), name.as_slice());
            assert_eq!(
                (ours.ppid, ours.start_ticks, ours.rss_bytes),
                (999 + i as i32, 77 + i as u64, 5 * page)
            );
        }
        assert_eq!(parse_stat(b"12 (no close paren S 1 2 3", page), None);
        assert_eq!(parse_stat(b"", page), None);
    }

    #[test]
    fn lean_parser_reads_live_processes_with_crafted_names() {
        // Real kernel output for names set with prctl(PR_SET_NAME).
        let names = ["a) S 1 (b", "x\ny (z)", " ) ( "];
        let script = "import ctypes, sys, time\n\
            ctypes.CDLL(None).prctl(15, sys.argv[1].encode(), 0, 0, 0)\n\
            print('ready', flush=True)\n\
            time.sleep(30)\n";
        let mut children = Vec::new();
        for name in names {
            let child = std::process::Command::new("python3")
                .args(["-c", script, name])
                .stdout(std::process::Stdio::piped())
                .spawn();
            let Ok(mut child) = child else {
                eprintln!("skipped: python3 not available");
                return;
            };
            let mut line = String::new();
            use std::io::BufRead as _;
            let stdout = child.stdout.take().expect("piped stdout");
            std::io::BufReader::new(stdout)
                .read_line(&mut line)
                .expect("ready line");
            children.push((child, name));
        }
        let page = procfs::page_size();
        for (child, name) in &children {
            let bytes = std::fs::read(format!("/proc/{}/stat", child.id())).expect("stat");
            let ours = parse_stat(&bytes, page).expect("parses");
            assert_eq!(ours.comm, *name);
            assert_eq!(ours.pid, child.id() as i32);
            assert_eq!(Some(ours), by_procfs(&bytes, page));
        }
        for (mut child, _) in children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    #[test]
    fn real_snapshot_sees_this_process() {
        let s = snapshot();
        let me = std::process::id() as i32;
        let entry = s.entries.get(&me).expect("own process is in /proc");
        assert!(entry.start_ticks > 0);
        assert!(entry.is_live());
    }

    /// A shared walk (the custody host's coalesced walks): one tree is
    /// classified through the walk's index, built once and kept, with the
    /// findings of the full pass; a copy of it is no shared walk.
    #[test]
    fn a_shared_walk_is_classified_through_its_one_index_with_the_same_findings() {
        let s = snap(vec![
            p(1, 0, 1, 1),
            p(50, 1, 50, 50),
            p(100, 50, 100, 100),
            p(101, 100, 100, 100),
            p(102, 101, 102, 102), // escaped by its own session
            p(103, 102, 103, 103), // found by descent only
            p(300, 1, 300, 300),
        ]);
        let t = tree(7, 100);
        let x = HashSet::from([50]);
        let full = classify(&s, std::slice::from_ref(&t), &x);
        let shared = share(s.clone());
        assert_eq!(vec![shared.classify_one(&t, &x)], full);
        assert!(
            shared.index.get().is_none(),
            "the first classification is the plain pass"
        );
        assert_eq!(vec![shared.classify_one(&t, &x)], full);
        assert!(
            shared.index.get().is_some(),
            "the second built the walk's index"
        );
        assert_eq!(vec![shared.classify_one(&t, &x)], full);
        let copy: Snapshot = (*shared).clone();
        assert_eq!(classify(&copy, std::slice::from_ref(&t), &x), full);
        let pids: Vec<i32> = full[0].members.iter().map(|m| m.entry.pid).collect();
        assert_eq!(pids, vec![100, 101, 102, 103]);
    }

    /// The service's case: two trees, the owner of the second a member of
    /// the first, each tree with its own exclusions. One index, one walk
    /// per tree, the same findings as a full classification per tree.
    #[test]
    fn one_index_for_all_trees_finds_what_one_pass_per_tree_finds() {
        let s = snap(vec![
            p(1, 0, 1, 1),
            p(50, 1, 50, 50),     // the service
            p(100, 50, 100, 100), // tree 7's root
            p(101, 100, 100, 100),
            p(102, 101, 102, 102), // escaped from 7; owner of tree 8
            p(200, 102, 200, 200), // tree 8's root (spawned by 102)
            p(201, 200, 200, 200),
            p(202, 201, 202, 202), // escaped from 8 (and from 7)
            p(300, 1, 300, 300),   // a stranger
        ]);
        let t7 = tree(7, 100);
        let t8 = tree(8, 200);
        let x7 = HashSet::from([50]);
        let x8 = HashSet::from([50, 102]);
        let index = SnapshotIndex::new(&s);
        let f7 = classify_tree(&s, &index, &t7, &x7);
        let f8 = classify_tree(&s, &index, &t8, &x8);
        assert_eq!(f7, classify(&s, std::slice::from_ref(&t7), &x7).remove(0));
        assert_eq!(f8, classify(&s, std::slice::from_ref(&t8), &x8).remove(0));
        let pids = |f: &TreeFindings| f.members.iter().map(|m| m.entry.pid).collect::<Vec<_>>();
        assert_eq!(pids(&f7), vec![100, 101, 102, 200, 201, 202]);
        assert_eq!(pids(&f8), vec![200, 201, 202]);
        let escaped = |f: &TreeFindings| f.escapes().map(|m| m.entry.pid).collect::<Vec<_>>();
        assert_eq!(escaped(&f7), vec![102, 200, 201, 202]);
        assert_eq!(escaped(&f8), vec![202]);
    }

    mod indexed {
        use super::*;
        use proptest::prelude::*;

        fn entry() -> impl Strategy<Value = ProcEntry> {
            (
                1i32..40,
                0i32..42,
                1i32..8,
                1i32..8,
                0u64..4,
                prop::bool::weighted(0.15),
            )
                .prop_map(|(pid, ppid, pgid, sid, start, zombie)| ProcEntry {
                    pid,
                    ppid,
                    pgid,
                    sid,
                    start_ticks: start,
                    state: if zombie { 'Z' } else { 'S' },
                    comm: String::new(),
                    rss_bytes: 0,
                    start_stack: 0,
                })
        }

        fn keys() -> impl Strategy<Value = HashSet<crate::proc::ProcKey>> {
            prop::collection::hash_set(
                (1i32..40, 0u64..4).prop_map(|(p, s)| crate::proc::ProcKey::new(p, s)),
                0..6,
            )
        }

        fn known() -> impl Strategy<Value = KnownTree> {
            (
                1i32..8,
                1i32..8,
                prop_oneof![Just(0u64), 1u64..4],
                prop::collection::hash_set(1i32..40, 0..4),
                keys(),
                keys(),
                prop::option::weighted(0.2, 1i32..40),
            )
                .prop_map(
                    |(pgid, sid, root_start_ticks, cgroup_pids, seen, observed, adopted_by)| {
                        KnownTree {
                            id: crate::ledger::TreeId(1),
                            pgid,
                            sid,
                            cgroup_pids,
                            seen,
                            observed,
                            root_start_ticks,
                            adopted_by,
                        }
                    },
                )
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]
            /// Random hosts (missing parents, self-parents, cycles from
            /// torn reads, zombies, recycled ids) and random trees: the
            /// indexed walk and the full pass agree exactly, members,
            /// reasons and escapes.
            #[test]
            fn the_indexed_walk_is_the_full_pass(
                entries in prop::collection::vec(entry(), 0..40),
                trees in prop::collection::vec(known(), 1..4),
                excludes in prop::collection::vec(prop::collection::hash_set(1i32..40, 0..4), 4),
            ) {
                let s = snap(entries);
                let index = SnapshotIndex::new(&s);
                for (tree, exclude) in trees.iter().zip(&excludes) {
                    let full = classify(&s, std::slice::from_ref(tree), exclude).remove(0);
                    prop_assert_eq!(classify_tree(&s, &index, tree, exclude), full);
                }
            }
        }
    }
}
