//! Watching one tree: scan, classify, and record what is new.
//!
//! A [`TreeWatch`] remembers every member it has seen (by identity) and
//! every escape it has recorded, so each finding is written once and never
//! unwritten. Both the owner's periodic scans and the teardown's scans go
//! through [`TreeWatch::tick`], so they cannot disagree about membership.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use super::Engine;
use super::host::Host;
use crate::ledger::{ExitRecord, IdentityRecord, MemberRecord, TreeId, TreeRow};
use crate::proc::{ExitStatus, ProcKey};
use crate::scan::{self, KnownTree, Member};

/// What one tick saw.
#[derive(Clone, Debug, Default)]
pub struct TickReport {
    /// Live members now.
    pub members: Vec<Member>,
    pub new_members: usize,
    pub new_escapes: usize,
    /// Members alive at the previous tick and gone now.
    pub exited: usize,
    pub duration: Duration,
    /// Ledger writes that failed this tick (logged; evidence is best effort
    /// here, authority is not).
    pub write_errors: usize,
    /// Members this tick found that the observer did not know (0 without
    /// an observer): it missed something, so the next scan lists `/proc`.
    pub unobserved: u64,
    /// Why this tick's evidence was incomplete, if it was: a read failed for
    /// a reason other than the process being gone. Members it could not
    /// read are carried in `members` as last seen (unknown is not exited),
    /// and no exit was recorded.
    pub incomplete: Option<String>,
}

/// The scanning state of one tree.
pub struct TreeWatch {
    tree: TreeId,
    known: KnownTree,
    cgroup: Option<PathBuf>,
    exclude: HashSet<i32>,
    escapes: HashSet<ProcKey>,
    /// Live members at the last tick.
    alive: HashSet<ProcKey>,
    /// Each live member as the last tick that read it saw it: what an
    /// incomplete tick reports for a member it could not read.
    last_read: HashMap<ProcKey, Member>,
    /// Why the reads of the tick under way were incomplete (taken by
    /// [`TreeWatch::record_members`]).
    incomplete: Option<String>,
    /// Members outside the recorded group and cgroup (the ones signalled
    /// one by one), held from the tick that first found them so: their
    /// signals go through the handle, and a held member that has exited
    /// while a process with its identity is listed is someone else's
    /// process on a recycled pid (the same clock tick), not a member.
    held: HashMap<ProcKey, (super::Held, super::holds::HoldPermit)>,
    /// Loose members kept without a hold because the budget refused one
    /// (offered a place again at every tick; counted refused once).
    unheld: HashSet<ProcKey>,
    /// Whose account the tree's held handles count against.
    principal: crate::ledger::TreeOwner,
    /// The first hold the budget refused and the ledger does not have yet.
    capped: Option<super::holds::Refusal>,
    /// Whether the tree carries the `holds_capped` flag (read from its row,
    /// or written by this watch): then it is not written again.
    capped_recorded: bool,
    /// Each member's uid as recorded at its first sighting: the second
    /// witness of a member known only by its identity (see
    /// [`TreeWatch::vet`]).
    uids: HashMap<ProcKey, Option<u32>>,
    /// Identities found loose and known only by identity, with no uid to
    /// witness them (see [`TreeWatch::vet`]): never taken for members;
    /// recorded once each.
    unverified: HashSet<ProcKey>,
    /// The survivors an unsettled marker names ([`TreeWatch::remember`]).
    marked: HashSet<ProcKey>,
    boot_id: String,
    /// The proc-connector observer of this process, when one runs: its
    /// members join each classification and the scan's members go back to
    /// it as the cross-check.
    observer: Option<super::observer::ObserverHandle>,
    /// Degraded evidence mode (a teardown's): once set, evidence writes are
    /// not attempted; see [`TreeWatch::degrade_on_refusal`].
    root_pid: Option<i32>,
    degrade: bool,
    degraded: Option<String>,
    /// Evidence writes not attempted in degraded mode.
    skipped: usize,
    /// The refused or skipped writes of the trail (state changes, signals,
    /// kill-skipped, flags, the survivor snapshot), in order: the teardown
    /// hands them to the unsettled marker, and they are replayed once the
    /// ledger takes writes ([`TreeWatch::record`]).
    journal: Vec<crate::ledger::Deferred>,
    /// When `last_seen` of known members was last bumped (coarse, see
    /// [`LAST_SEEN_EVERY`]), on the host's clock ([`Host::now`]).
    last_bump: Option<Instant>,
    /// The `comm` and stack address each member had when last seen: a
    /// change of either means it exec'd (the address, under ASLR, also when
    /// the name stayed: `sh` exec'ing `sh`), and its recorded command line
    /// is refreshed.
    comms: HashMap<ProcKey, (String, u64)>,
    /// Members whose read found no command line, with the re-reads left:
    /// a process caught inside `execve` already carries the new program's
    /// name but not yet its arguments, and nothing later (no new name, no
    /// new stack) would say so. Each is read again on the next ticks until
    /// its arguments appear (then recorded as an exec) or the tries run out
    /// (a process that really has none: a zombie, one that blanked them).
    argv_unread: HashMap<ProcKey, u8>,
    /// While set (a teardown past its kill authorization), exits found by a
    /// tick are kept here instead of written at once; the teardown writes
    /// them in one go after verifying the tree empty
    /// ([`TreeWatch::take_deferred_exits`]).
    deferred_exits: Option<Vec<(IdentityRecord, Option<ExitRecord>)>>,
    /// The cgroup's `oom_kill` total already in the ledger (the last
    /// `tree.oom_kill`'s `total`); `None` until first looked up.
    oom_recorded: Option<u64>,
    /// When `memory.events` was last read (see [`OOM_CHECK_EVERY`]), on
    /// the host's clock.
    oom_checked: Option<Instant>,
    /// The time since boot, in clock ticks, taken just before the last
    /// `cgroup.procs` read (see [`TreeWatch::confirm_cgroup_pids`]).
    listed_at: Option<u64>,
    /// Set for one tick by [`TreeWatch::expect_unchanged`]: that tick reads
    /// `memory.events` only if it finds the membership changed.
    expect_unchanged: bool,
}

/// How often a tick reads the cgroup's `memory.events` for OOM kills: a
/// teardown ticks every few milliseconds, and an OOM kill needs recording,
/// not a race to be first.
const OOM_CHECK_EVERY: Duration = Duration::from_millis(250);

/// How many ticks re-read a member whose first read found no command line
/// (see [`TreeWatch::argv_unread`]): an `execve` caught halfway completes
/// within one tick; a few more cover a loaded host.
const ARGV_REREADS: u8 = 5;

/// How often a steady tick bumps `last_seen` of known members: one write of
/// every member costs about as much as the scan itself at 1,000 members, and
/// `last_seen` is a liveness hint, not evidence (first sightings, escapes and
/// exits are written on the tick that finds them; a teardown past its kill
/// authorization defers exits, see [`TreeWatch::defer_exits`]).
pub const LAST_SEEN_EVERY: Duration = Duration::from_secs(10);

/// Whether a ledger error means "the ledger takes no writes now" (held lock,
/// full disk, read-only file): retrying within the same teardown would wait
/// out the busy timeout once per write.
pub(crate) fn refuses_writes(e: &crate::ledger::LedgerError) -> bool {
    use crate::ledger::LedgerError as E;
    matches!(e, E::Busy(_) | E::Full(_) | E::ReadOnly(_))
}

impl TreeWatch {
    /// A watch over a recorded tree; `None` when the tree never got a root
    /// (it was never released, so nothing of it can be running).
    pub fn new(
        row: &TreeRow,
        previously: &[crate::ledger::MemberRow],
        exclude: &HashSet<i32>,
    ) -> Option<Self> {
        Self::new_on(&super::KernelHost::default(), row, previously, exclude)
    }

    /// [`TreeWatch::new`], asking `host` whether the owner still lives.
    pub(crate) fn new_on(
        host: &dyn Host,
        row: &TreeRow,
        previously: &[crate::ledger::MemberRow],
        exclude: &HashSet<i32>,
    ) -> Option<Self> {
        let (pgid, sid, root_start) = (row.pgid?, row.sid?, row.root_start_ticks?);
        let mut exclude = exclude.clone();
        // The owner is never a member — while it is the owner. A dead
        // owner's pid may be reused by a member of its own tree.
        if host.still_alive(&(&row.owner_identity()).into()) {
            exclude.insert(row.owner.pid);
        }
        let mut known = KnownTree {
            id: row.id,
            pgid,
            sid,
            root_start_ticks: root_start,
            ..KnownTree::default()
        };
        let mut escapes = HashSet::new();
        let mut uids = HashMap::new();
        for m in previously {
            known.seen.insert(ProcKey::new(m.pid, m.start_ticks));
            uids.insert(ProcKey::new(m.pid, m.start_ticks), m.uid);
            if m.escaped_at.is_some() {
                escapes.insert(ProcKey::new(m.pid, m.start_ticks));
            }
        }
        Some(Self {
            tree: row.id,
            known,
            cgroup: row.cgroup.as_ref().map(PathBuf::from),
            exclude,
            escapes,
            alive: HashSet::new(),
            last_read: HashMap::new(),
            incomplete: None,
            held: HashMap::new(),
            unheld: HashSet::new(),
            principal: row.principal(),
            capped: None,
            capped_recorded: row.has_flag(&crate::ledger::TreeFlag::HoldsCapped),
            uids,
            unverified: HashSet::new(),
            marked: HashSet::new(),
            boot_id: row.boot_id.clone().unwrap_or_default(),
            observer: None,
            root_pid: row.root_pid,
            degrade: false,
            degraded: None,
            skipped: 0,
            journal: Vec::new(),
            last_bump: None,
            comms: HashMap::new(),
            argv_unread: HashMap::new(),
            deferred_exits: None,
            oom_recorded: None,
            oom_checked: None,
            listed_at: None,
            expect_unchanged: false,
        })
    }

    /// Records OOM kills in the tree's cgroup that the ledger does not have
    /// yet: one `tree.oom_kill` event with how many are new and the
    /// cgroup's total. The total already recorded is looked up in the
    /// ledger the first time (a restarted service or a sweep does not
    /// record an old kill twice); a refused write is tried again next time.
    pub fn note_oom_kills(&mut self, engine: &Engine) {
        self.oom_checked = Some(engine.host().now());
        let Some(dir) = &self.cgroup else { return };
        let total = match engine.host().oom_kills(dir) {
            Some(n) if n > self.oom_recorded.unwrap_or(0) => n,
            _ => return,
        };
        let tree = self.tree;
        let ledger = engine.ledger();
        let recorded = match self.oom_recorded {
            Some(n) => n,
            None => {
                let last = ledger.events(&crate::ledger::EventFilter {
                    tree: Some(tree),
                    kind_prefix: Some(crate::ledger::EventKind::TreeOomKill.as_str().into()),
                    newest_first: true,
                    limit: Some(1),
                    ..Default::default()
                });
                let Ok(last) = last else { return };
                let n = match last.first().map(|e| e.event()) {
                    Some(crate::ledger::Event::TreeOomKill(o)) => o.total,
                    _ => 0,
                };
                self.oom_recorded = Some(n);
                n
            }
        };
        if total <= recorded {
            return;
        }
        let oom = crate::ledger::Event::TreeOomKill(crate::ledger::event::OomKill {
            oom_kills: total - recorded,
            total,
        });
        let written = self.evidence("oom kill", || ledger.append_event(Some(tree), oom));
        match written {
            Some(Ok(_)) => {
                tracing::warn!(
                    tree = tree.0,
                    new = total - recorded,
                    total,
                    "the kernel's OOM killer ended processes in the tree"
                );
                self.oom_recorded = Some(total);
            }
            Some(Err(e)) => {
                tracing::warn!(tree = tree.0, error = %e, "tree.oom_kill not recorded (tried again next tick)")
            }
            None => {}
        }
    }

    /// Marks this process as the tree's dedicated subreaper: its children
    /// are members (see [`KnownTree::adopted_by`]). Only `run` may say so.
    pub fn adopt_children_of(&mut self, pid: i32) {
        self.known.adopted_by = Some(pid);
    }

    /// Tells the next tick that the observer saw no fork, exec or exit of
    /// a member since the last complete one (the service's full scan of a
    /// quiet tree): that tick then skips the OOM read unless it finds a
    /// member gone or new. An OOM kill ends a member, so it moves the
    /// observer's generation (the tree is ticked, and read, at once) or,
    /// were the events lost, shows at this tick as a member gone; at 2,000
    /// quiet trees the full scan's 2,000 `memory.events` reads were a
    /// twentieth of its cost. One tick only.
    pub fn expect_unchanged(&mut self) {
        self.expect_unchanged = true;
    }

    /// Joins the observer's view of this tree to every tick.
    pub fn set_observer(&mut self, observer: Option<super::observer::ObserverHandle>) {
        self.observer = observer;
    }

    /// Why the recorded group or session may not be signalled: its leader
    /// pid now belongs to a process other than the recorded root (the id was
    /// recycled). `None` when the leader is gone or is the root.
    pub fn recycled_leader(&self, engine: &Engine) -> Option<String> {
        for (what, id) in [("pgid", self.known.pgid), ("sid", self.known.sid)] {
            if let Ok(Some(now)) = engine.host().identity_of(id)
                && now.start_ticks != self.known.root_start_ticks
            {
                return Some(format!(
                    "{what} {id} now belongs to a process started at tick {} (recorded root started at tick {}): recycled",
                    now.start_ticks, self.known.root_start_ticks
                ));
            }
        }
        None
    }

    /// Counts these identities as members seen before (e.g. the survivors
    /// an unsettled marker names, which the ledger may never have recorded).
    /// They were read as members by the teardown that named them (the
    /// marker is that reading's record, kept in the private data dir), so
    /// one of them found loose is held on its identity without a uid to
    /// witness it ([`TreeWatch::vet`]).
    pub fn remember(&mut self, ids: &[IdentityRecord]) {
        let keys = ids.iter().map(|id| ProcKey::new(id.pid, id.start_ticks));
        self.marked.extend(keys.clone());
        self.known.seen.extend(keys);
    }

    /// Teardown mode: after the first write the ledger refuses with
    /// Busy/Full/ReadOnly, no further evidence write is attempted by this
    /// watch (each would wait out the busy timeout again); what was found
    /// stays in memory (membership, escapes) and the skipped writes are
    /// counted. Authority writes are not evidence and are never gated here.
    pub fn degrade_on_refusal(&mut self) {
        self.degrade = true;
    }

    /// Why evidence writes stopped, when they did.
    pub fn degraded(&self) -> Option<&str> {
        self.degraded.as_deref()
    }

    /// Evidence writes skipped in degraded mode.
    pub fn skipped_writes(&self) -> usize {
        self.skipped
    }

    /// Runs one evidence write unless degraded; `None` when skipped. A
    /// refusal switches a teardown's watch to degraded mode.
    pub fn evidence<T>(
        &mut self,
        what: &str,
        write: impl FnOnce() -> Result<T, crate::ledger::LedgerError>,
    ) -> Option<Result<T, crate::ledger::LedgerError>> {
        if self.degraded.is_some() {
            self.skipped += 1;
            return None;
        }
        let result = write();
        if let Err(e) = &result
            && self.degrade
            && refuses_writes(e)
        {
            tracing::warn!(
                tree = self.tree.0,
                error = %e,
                what,
                "ledger refuses writes: no more evidence writes in this teardown (authority is still attempted)"
            );
            self.degraded = Some(e.to_string());
        }
        Some(result)
    }

    /// Makes one write of the tree's trail unless degraded; what is not
    /// written (skipped, or refused because the ledger takes no writes) is
    /// kept in the journal, in order, for a later replay. `None` when
    /// skipped.
    pub fn record(
        &mut self,
        ledger: &crate::ledger::Ledger,
        what: &str,
        d: crate::ledger::Deferred,
    ) -> Option<Result<(), crate::ledger::LedgerError>> {
        let tree = self.tree;
        let result = self.evidence(what, || ledger.apply_deferred(tree, &d));
        match &result {
            None => self.journal.push(d),
            Some(Err(e)) if refuses_writes(e) => self.journal.push(d),
            Some(_) => {}
        }
        result
    }

    /// The ledger took a write that carried the journal (the
    /// authorization's transaction): the journal is written, and evidence
    /// writes are attempted again.
    pub fn ledger_writable_again(&mut self) {
        self.journal.clear();
        self.degraded = None;
    }

    /// The trail writes kept so far (see [`TreeWatch::record`]).
    pub fn journal(&self) -> &[crate::ledger::Deferred] {
        &self.journal
    }

    /// The trail writes kept so far (see [`TreeWatch::record`]), emptied.
    pub fn take_journal(&mut self) -> Vec<crate::ledger::Deferred> {
        std::mem::take(&mut self.journal)
    }

    /// Whether this identity is the tree's recorded root (pid and start).
    pub fn is_root(&self, pid: i32, start_ticks: u64) -> bool {
        self.root_pid == Some(pid) && self.known.root_start_ticks == start_ticks
    }

    /// The recorded root's start time (clock ticks).
    pub fn root_start_ticks(&self) -> u64 {
        self.known.root_start_ticks
    }

    /// The recorded root's pid (the tree's group and session leader).
    pub fn root_pid(&self) -> Option<i32> {
        self.root_pid
    }

    pub fn tree(&self) -> TreeId {
        self.tree
    }

    pub fn pgid(&self) -> i32 {
        self.known.pgid
    }

    pub fn sid(&self) -> i32 {
        self.known.sid
    }

    pub fn cgroup(&self) -> Option<&std::path::Path> {
        self.cgroup.as_deref()
    }

    /// Identity of a scanned member, in the ledger's terms.
    pub fn identity(&self, m: &Member) -> IdentityRecord {
        IdentityRecord {
            pid: m.entry.pid,
            start_ticks: m.entry.start_ticks,
            boot_id: self.boot_id.clone(),
        }
    }

    /// Scans `/proc`, classifies, records first sightings, escapes and exits.
    /// `exits` holds statuses the reaper collected, to attach to exit records.
    /// Known members' `last_seen` is bumped at most every
    /// [`LAST_SEEN_EVERY`]; new sightings are written at once.
    pub fn tick(&mut self, engine: &Engine, exits: &HashMap<i32, ExitStatus>) -> TickReport {
        let now = engine.host().now();
        let bump = self
            .last_bump
            .is_none_or(|t| now.saturating_duration_since(t) >= LAST_SEEN_EVERY);
        self.tick_full(engine, exits, bump)
    }

    /// A full `/proc` walk (what finds members by descent), classified and
    /// recorded; `bump_last_seen` false writes only what is new.
    pub fn tick_full(
        &mut self,
        engine: &Engine,
        exits: &HashMap<i32, ExitStatus>,
        bump_last_seen: bool,
    ) -> TickReport {
        let started = Instant::now();
        if let Some(obs) = &self.observer {
            self.known.observed = obs.members(self.tree);
        }
        let snap = engine.host().snapshot();
        self.note_incomplete(snap.incomplete.as_deref());
        self.read_cgroup_pids(engine.host());
        // A walk other teardowns may share: classified through its index.
        let members = snap.classify_one(&self.known, &self.exclude).members;
        self.record_members(engine, exits, members, started, bump_last_seen)
    }

    /// A targeted tick: re-reads only the live members, the group and
    /// session leaders, the cgroup's members (`cgroup.procs`) and the
    /// observer's members, not all of `/proc`. It cannot find a process by
    /// descent that it does not read, so a teardown uses it only where
    /// nothing new can appear unseen (a frozen cgroup) or to wait for known
    /// members to die before one verifying full walk. Writes only what is new.
    pub fn tick_targeted(
        &mut self,
        engine: &Engine,
        exits: &HashMap<i32, ExitStatus>,
    ) -> TickReport {
        let started = Instant::now();
        if let Some(obs) = &self.observer {
            self.known.observed = obs.members(self.tree);
        }
        let mut pids = self.pids_to_reread_on(engine.host());
        pids.extend(self.known.observed.iter().map(|k| k.pid));
        // Live members and the cgroup's members are mostly the same pids:
        // each is read once.
        pids.sort_unstable();
        pids.dedup();
        let snap = engine.host().snapshot_pids(pids);
        self.note_incomplete(snap.incomplete.as_deref());
        self.confirm_cgroup_pids(engine.host(), &snap);
        self.classify_and_record(engine, exits, &snap, started, false)
    }

    /// Keeps of the `cgroup.procs` read before the stat reads only the pids
    /// that are the process `snap` read. A member that exited in between
    /// may have left its pid to a process outside the cgroup, whose stat
    /// the snapshot then holds: by the listing alone that stranger would be
    /// a member (and a kill target). A process the snapshot read after the
    /// listing (`snap` complete: every listed pid was read after it) whose
    /// start time is before the listing held its pid through the listing,
    /// so it is the process listed. Only when a listed pid's process
    /// started at or after the listing (or the snapshot is incomplete, or
    /// the clock unread) is `cgroup.procs` read again, keeping the pids
    /// listed both times: the process the snapshot read unless the pid was
    /// reused twice within the reads. A member that joined between the
    /// reads is missed by this tick only (and is found by its session,
    /// group or descent). A listed pid the snapshot does not hold is gone.
    fn confirm_cgroup_pids(&mut self, host: &dyn Host, snap: &scan::Snapshot) {
        let Some(dir) = &self.cgroup else { return };
        let listed_at = self.listed_at.take();
        self.known
            .cgroup_pids
            .retain(|pid| snap.entries.contains_key(pid));
        if let Some(listed_at) = listed_at
            && snap.incomplete.is_none()
            && self
                .known
                .cgroup_pids
                .iter()
                .all(|pid| snap.entries[pid].start_ticks < listed_at)
        {
            return;
        }
        match host.cgroup_pids(dir) {
            Ok(after) => self.known.cgroup_pids.retain(|pid| after.contains(pid)),
            Err(why) => {
                self.known.cgroup_pids.clear();
                self.note_incomplete(Some(&why));
            }
        }
    }

    /// Reads the cgroup's members now (and when: see
    /// [`TreeWatch::confirm_cgroup_pids`]). A failed read leaves none known
    /// by the cgroup (members already seen are carried by the incomplete
    /// tick; a stranger on a stale pid is never taken for one).
    fn read_cgroup_pids(&mut self, host: &dyn Host) {
        if let Some(dir) = &self.cgroup {
            self.listed_at = host.boot_ticks();
            match host.cgroup_pids(dir) {
                Ok(pids) => self.known.cgroup_pids = pids,
                Err(why) => {
                    self.listed_at = None;
                    self.known.cgroup_pids.clear();
                    self.note_incomplete(Some(&why));
                }
            }
        }
    }

    /// Marks the tick under way incomplete (the first reason is kept).
    fn note_incomplete(&mut self, why: Option<&str>) {
        if let Some(why) = why {
            self.incomplete.get_or_insert_with(|| why.to_owned());
        }
    }

    /// The pids a targeted refresh must re-read for this tree: live members,
    /// the group and session leaders, and the cgroup's members (read now and
    /// kept for the next [`TreeWatch::tick_with`]).
    pub fn pids_to_reread(&mut self) -> Vec<i32> {
        self.pids_to_reread_on(&super::KernelHost::default())
    }

    /// [`TreeWatch::pids_to_reread`], reading `cgroup.procs` through `host`.
    fn pids_to_reread_on(&mut self, host: &dyn Host) -> Vec<i32> {
        self.read_cgroup_pids(host);
        let mut pids: Vec<i32> = self.alive.iter().map(|k| k.pid).collect();
        pids.extend([self.known.pgid, self.known.sid]);
        pids.extend(self.known.cgroup_pids.iter().copied());
        pids
    }

    /// Like [`TreeWatch::tick`], over a snapshot the caller keeps current
    /// (see [`scan::HostView`]) and with the cgroup members read by
    /// [`TreeWatch::pids_to_reread`]. With `bump_last_seen` false, sightings
    /// are written only when something is new, so an idle tree costs no
    /// ledger write.
    pub fn tick_with(
        &mut self,
        engine: &Engine,
        exits: &HashMap<i32, ExitStatus>,
        snap: &scan::Snapshot,
        bump_last_seen: bool,
    ) -> TickReport {
        let index = scan::SnapshotIndex::new(snap);
        self.tick_indexed(engine, exits, snap, &index, bump_last_seen)
    }

    /// [`TreeWatch::tick_with`] through an index of `snap` the caller
    /// built once for all its trees (the service's scan loop), with the
    /// observer's members joined as a full tick joins them.
    pub fn tick_indexed(
        &mut self,
        engine: &Engine,
        exits: &HashMap<i32, ExitStatus>,
        snap: &scan::Snapshot,
        index: &scan::SnapshotIndex,
        bump_last_seen: bool,
    ) -> TickReport {
        if let Some(obs) = &self.observer {
            self.known.observed = obs.members(self.tree);
        }
        // The caller read `cgroup.procs` (pids_to_reread) before it
        // refreshed the snapshot: the same race as a targeted tick's.
        self.note_incomplete(snap.incomplete.as_deref());
        self.confirm_cgroup_pids(engine.host(), snap);
        self.classify_indexed(engine, exits, snap, index, Instant::now(), bump_last_seen)
    }

    /// The tree cgroup's members as the last tick read them (empty without
    /// a cgroup).
    pub fn cgroup_pids(&self) -> &HashSet<i32> {
        &self.known.cgroup_pids
    }

    /// From now on, exits found by ticks are kept in memory, not written
    /// (see [`TreeWatch::take_deferred_exits`]).
    pub fn defer_exits(&mut self) {
        self.deferred_exits.get_or_insert_with(Vec::new);
    }

    /// The exits kept since [`TreeWatch::defer_exits`]; they are kept again
    /// from an empty list.
    pub fn take_deferred_exits(&mut self) -> Vec<(IdentityRecord, Option<ExitRecord>)> {
        self.deferred_exits
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Keeps of a classification's members those that are who their
    /// identity says, and holds each loose one (outside the recorded group
    /// and cgroup: signalled by itself) from now on:
    /// - a held member whose handle says it exited is not a member, whatever
    ///   process now lists with its pid and start time (a pid recycled
    ///   within one clock tick);
    /// - a loose member known *only* by its identity (`Because::Seen`: a
    ///   recorded member; `Because::Observed`: a fork the observer
    ///   attributed) and not held yet needs a second witness before it is
    ///   taken for the member: the uid it was read with when it was provably
    ///   the member (the observer's read at the fork, or a sighting's read
    ///   that a re-read confirmed, see [`TreeWatch::sight`]). It is held
    ///   first, then its uid is read, then the handle is asked whether it
    ///   exited: a uid read while the held process still runs is that
    ///   process's. A stranger that took a member's pid within the clock
    ///   tick of its start shares the identity, not (as another user) the
    ///   uid. A member recorded without a uid (never read as the member)
    ///   has no witness but its identity: it is not taken for the member
    ///   and never signalled, and that is recorded once (`kill.skipped`).
    ///   The survivors an unsettled marker names were read as members by
    ///   the teardown that wrote it: they are held on their identity;
    /// - a member that both left its session and changed its uid between
    ///   two looks is not signalled by itself; docs/THREAT-MODEL.md names it;
    /// - a hold takes a place in the engine's budget first ([`super::holds`]:
    ///   per tree, per principal, and under the descriptor limit). A loose
    ///   member refused one is kept unheld: by its classification when
    ///   that read it as a member now, and, known only by its identity, on
    ///   the same witness checked through a handle taken for the check and
    ///   dropped after ([`TreeWatch::witnessed`]). Its signals go through
    ///   such a handle taken at the signal ([`TreeWatch::hold_to_signal`]).
    ///   The first refusal is recorded once per tree (`tree.holds_capped`).
    ///
    /// Returns the members kept, and the identities found unverified for
    /// the first time (to be recorded).
    fn vet(&mut self, engine: &Engine, members: Vec<Member>) -> (Vec<Member>, Vec<ProcKey>) {
        let host = engine.host();
        let pgid = self.known.pgid;
        let boot = host.boot_id().unwrap_or_else(|_| self.boot_id.clone());
        let mut unverified = Vec::new();
        let kept = members
            .into_iter()
            .filter(|m| {
                let key = m.entry.key();
                if let Some((held, _)) = self.held.get(&key) {
                    if host.held_exited(held) && m.entry.is_live() {
                        tracing::warn!(
                            tree = self.tree.0,
                            pid = m.entry.pid,
                            "a member exited and its pid was reused within its clock tick: not a member"
                        );
                        return false;
                    }
                    return true;
                }
                let loose =
                    m.entry.pgid != pgid && !self.known.cgroup_pids.contains(&m.entry.pid);
                if !loose {
                    return true;
                }
                let by_identity = matches!(m.because, scan::Because::Seen | scan::Because::Observed)
                    && !self.marked.contains(&key);
                // The witness: the uid it was read with as the member.
                let witness = if by_identity {
                    let Some(uid) = self.recorded_uid(key) else {
                        if self.unverified.insert(key) {
                            tracing::warn!(
                                tree = self.tree.0,
                                pid = m.entry.pid,
                                "a process with a member's identity, but the member was never read with its uid: not taken for it, not signalled"
                            );
                            unverified.push(key);
                        }
                        return false;
                    };
                    Some(uid)
                } else {
                    None
                };
                let id = crate::proc::Identity {
                    pid: m.entry.pid,
                    start_ticks: m.entry.start_ticks,
                    boot_id: boot.clone(),
                };
                self.hold_loose(engine, &id, witness)
            })
            .collect();
        (kept, unverified)
    }

    /// Holds a loose member found now (`witness`: the uid it must show,
    /// when it is known by its identity alone) in a place of the budget,
    /// or keeps it unheld when the budget refuses one; whether it is kept
    /// as the member.
    fn hold_loose(
        &mut self,
        engine: &Engine,
        id: &crate::proc::Identity,
        witness: Option<u32>,
    ) -> bool {
        let host = engine.host();
        let key = id.key();
        let permit = match engine
            .holds()
            .take(self.tree, self.principal, host.nofile_limit())
        {
            Ok(permit) => Some(permit),
            Err(refusal) => {
                if self.unheld.insert(key) {
                    engine.holds().note_refused(refusal.cap);
                }
                if !self.capped_recorded && self.capped.is_none() {
                    tracing::warn!(
                        tree = self.tree.0,
                        cap = refusal.cap.as_str(),
                        limit = refusal.limit,
                        "held handles capped: further loose members of the tree are kept by identity and uid, and signalled through a handle taken at the signal"
                    );
                }
                self.capped.get_or_insert(refusal);
                // Not held. Read as the member by this very classification:
                // kept. Known by its identity alone: kept only on its
                // witness, checked now through a handle closed after.
                if witness.is_none() {
                    return true;
                }
                None
            }
        };
        match self.witnessed(host, id, witness) {
            Ok(Some(held)) => {
                if let Some(permit) = permit {
                    self.unheld.remove(&key);
                    self.held.insert(key, (held, permit));
                }
                true
            }
            // Gone, the pid another's since the read, or (by identity) not
            // the member's uid.
            Ok(None) => false,
            // No handle now (out of descriptors): kept by its
            // classification (unknown is not exited), but, not held, it is
            // not signalled by itself; the next tick tries again. One known
            // only by its identity is not taken for the member, and the
            // tick concludes no exit from its absence.
            Err(e) => {
                tracing::debug!(tree = self.tree.0, pid = id.pid, error = %e, "member not held");
                if witness.is_some() {
                    self.note_incomplete(Some(&format!(
                        "no handle to check pid {}'s witness: {e}",
                        id.pid
                    )));
                }
                witness.is_none()
            }
        }
    }

    /// The uid a member was recorded with as itself (its first sighting's
    /// confirmed read, or the observer's at the fork): the second witness
    /// of a member known by its identity.
    fn recorded_uid(&self, key: ProcKey) -> Option<u32> {
        self.uids
            .get(&key)
            .copied()
            .flatten()
            .or_else(|| self.observer.as_ref().and_then(|o| o.uid(self.tree, key)))
    }

    /// Holds the process `id` names and, with a `witness`, keeps the handle
    /// only if the uid read through it is the witness: the hold first, then
    /// the uid, then the handle asked whether it exited (a uid read while
    /// the held process still runs is that process's). `Ok(None)`: gone,
    /// recycled, or not the member's uid.
    fn witnessed(
        &self,
        host: &dyn Host,
        id: &crate::proc::Identity,
        witness: Option<u32>,
    ) -> Result<Option<super::Held>, crate::proc::ProcError> {
        let Some(held) = host.hold(id)? else {
            return Ok(None);
        };
        if let Some(recorded) = witness {
            let now = host.uid_of(id.pid);
            if now != Some(recorded) || host.held_exited(&held) {
                tracing::warn!(
                    tree = self.tree.0,
                    pid = id.pid,
                    recorded,
                    ?now,
                    "a process with a member's identity but not its uid: not a member"
                );
                return Ok(None);
            }
        }
        Ok(Some(held))
    }

    /// The handle a loose member is held by, if it is.
    pub(crate) fn held(&self, key: &ProcKey) -> Option<&super::Held> {
        self.held.get(key).map(|(held, _)| held)
    }

    /// A handle for one signal to a loose member the watch does not hold
    /// (its hold was refused by the budget, or no handle could be had at
    /// its tick), taken now and dropped after the signal: only on the
    /// witness [`TreeWatch::vet`] asks of a member known by its identity
    /// (the uid it was recorded with as itself, read again through the
    /// handle), or on its identity alone for a survivor an unsettled
    /// marker names. `Ok(None)`: gone, recycled, or no witness (a member
    /// never read with its uid is never signalled by itself).
    pub(crate) fn hold_to_signal(
        &self,
        host: &dyn Host,
        id: &crate::proc::Identity,
    ) -> Result<Option<super::Held>, crate::proc::ProcError> {
        let key = id.key();
        if self.marked.contains(&key) {
            return self.witnessed(host, id, None);
        }
        match self.recorded_uid(key) {
            Some(uid) => self.witnessed(host, id, Some(uid)),
            None => Ok(None),
        }
    }

    /// Records the first refusal of a hold, once per tree: the flag
    /// `holds_capped` and a `tree.holds_capped` event, in one write (a
    /// refused write is tried again at the next tick).
    fn record_capped(&mut self, engine: &Engine) {
        let Some(refusal) = self.capped else { return };
        if self.capped_recorded {
            self.capped = None;
            return;
        }
        let (tree, ledger) = (self.tree, engine.ledger());
        let data = crate::ledger::event::HoldsCapped {
            cap: refusal.cap.as_str().to_string(),
            limit: refusal.limit as u64,
            held: refusal.tree_held as u64,
        };
        match self.evidence("holds capped", || ledger.holds_capped(tree, data)) {
            Some(Ok(_)) => {
                self.capped_recorded = true;
                self.capped = None;
            }
            Some(Err(e)) => {
                tracing::warn!(tree = tree.0, error = %e, "holds_capped not recorded (tried again next tick)");
            }
            None => {}
        }
    }

    fn classify_and_record(
        &mut self,
        engine: &Engine,
        exits: &HashMap<i32, ExitStatus>,
        snap: &scan::Snapshot,
        started: Instant,
        bump_last_seen: bool,
    ) -> TickReport {
        // One tree: one pass over the snapshot costs less than indexing it.
        let members = scan::classify(snap, std::slice::from_ref(&self.known), &self.exclude)
            .pop()
            .map(|f| f.members)
            .unwrap_or_default();
        self.record_members(engine, exits, members, started, bump_last_seen)
    }

    fn classify_indexed(
        &mut self,
        engine: &Engine,
        exits: &HashMap<i32, ExitStatus>,
        snap: &scan::Snapshot,
        index: &scan::SnapshotIndex,
        started: Instant,
        bump_last_seen: bool,
    ) -> TickReport {
        let members = scan::classify_tree(snap, index, &self.known, &self.exclude).members;
        self.record_members(engine, exits, members, started, bump_last_seen)
    }

    fn record_members(
        &mut self,
        engine: &Engine,
        exits: &HashMap<i32, ExitStatus>,
        members: Vec<Member>,
        started: Instant,
        bump_last_seen: bool,
    ) -> TickReport {
        // Vetted first: a witness that could not be checked makes the tick
        // incomplete.
        let (mut members, unverified) = self.vet(engine, members);
        let incomplete = self.incomplete.take();
        self.record_capped(engine);
        for key in unverified {
            let reason = format!(
                "pid {} (start {}): a process with a recorded member's identity, but that member was never read with its uid: not taken for the member, never signalled",
                key.pid, key.start_ticks
            );
            let (tree, ledger) = (self.tree, engine.ledger());
            if let Some(Err(e)) =
                self.evidence("unverified member", || ledger.kill_skipped(tree, &reason))
            {
                tracing::warn!(tree = tree.0, error = %e, "unverified member not recorded");
            }
        }
        let mut unobserved = 0;
        if let Some(obs) = &self.observer {
            unobserved = obs.scanned(self.tree, members.iter().map(|m| m.entry.key()));
        }
        let now = engine.host().now();
        let unchanged = std::mem::take(&mut self.expect_unchanged)
            && incomplete.is_none()
            && members.len() == self.alive.len()
            && members.iter().all(|m| self.alive.contains(&m.entry.key()));
        if !unchanged
            && self
                .oom_checked
                .is_none_or(|t| now.saturating_duration_since(t) >= OOM_CHECK_EVERY)
        {
            self.note_oom_kills(engine);
        }
        let mut report = TickReport {
            unobserved,
            ..TickReport::default()
        };
        let ledger = engine.ledger();

        let Sighted {
            sightings,
            fresh,
            execd,
        } = self.sight(engine, &members);
        self.write_sightings(engine, &mut report, &sightings, fresh, bump_last_seen);
        self.write_escapes(engine, &mut report, &members, &sightings);
        let now = self.unread_as_seen(engine, &mut report, &mut members, &incomplete);
        self.write_exits(engine, &mut report, exits, &now, &incomplete);
        if !execd.is_empty() {
            let tree = self.tree;
            if let Some(Err(e)) =
                self.evidence("member execs", || ledger.refresh_members(tree, &execd))
            {
                report.write_errors += 1;
                tracing::warn!(tree = self.tree.0, error = %e, "member execs not recorded");
            }
        }
        self.comms.retain(|k, _| now.contains(k));
        self.argv_unread.retain(|k, _| now.contains(k));
        self.held.retain(|k, _| now.contains(k));
        self.unheld.retain(|k| now.contains(k));
        self.last_read.clear();
        self.last_read
            .extend(members.iter().map(|m| (m.entry.key(), m.clone())));
        self.alive = now;
        engine.stats().write_errors(report.write_errors);
        report.members = members;
        report.duration = started.elapsed();
        report
    }

    /// The tick's members as sightings (details read for the first-seen
    /// ones), and the execs among the known: a new `comm`, or a new stack
    /// address (`start_stack` 0 means unknown).
    fn sight(&mut self, engine: &Engine, members: &[Member]) -> Sighted {
        let mut fresh = HashSet::new();
        let mut execd = Vec::new();
        let mut sightings = Vec::with_capacity(members.len());
        for m in members {
            let key = m.entry.key();
            let details = if self.known.seen.contains(&key) {
                None
            } else {
                Some(confirmed(engine.host().details(m.entry.pid), &m.entry))
            };
            let record = MemberRecord {
                identity: self.identity(m),
                ppid: m.entry.ppid,
                pgid: m.entry.pgid,
                sid: m.entry.sid,
                cgroup: details.as_ref().and_then(|d| d.cgroup.clone()),
                uid: details.as_ref().and_then(|d| d.uid),
                exe: details.as_ref().and_then(|d| d.exe.clone()),
                cmdline: details
                    .as_ref()
                    .map(|d| d.cmdline.clone())
                    .unwrap_or_default(),
                cwd: details.as_ref().and_then(|d| d.cwd.clone()),
            };
            if details.is_some() {
                fresh.insert(key);
                self.uids.insert(key, record.uid);
                if record.cmdline.is_empty() {
                    self.argv_unread.insert(key, ARGV_REREADS);
                }
            }
            // The comm is stored once per member and replaced only when it
            // changes (an exec): this runs for every member on every tick.
            match self.comms.get_mut(&key) {
                Some((comm, stack)) => {
                    // A stack address of 0 is hidden (a process we may not
                    // ptrace, or one without memory): no exec is read into
                    // it, and the last one seen is kept.
                    let new_stack = m.entry.start_stack;
                    let execd_now = *comm != m.entry.comm
                        || (*stack != 0 && new_stack != 0 && *stack != new_stack);
                    if new_stack != 0 {
                        *stack = new_stack;
                    }
                    if execd_now {
                        comm.clone_from(&m.entry.comm);
                        if details.is_none() {
                            let d = engine.host().details(m.entry.pid);
                            execd.push(MemberRecord {
                                exe: d.exe,
                                cmdline: d.cmdline,
                                ..record.clone()
                            });
                            self.argv_unread.remove(&key);
                        }
                    } else if details.is_none()
                        && let Some(left) = self.argv_unread.get_mut(&key)
                    {
                        let d = confirmed(engine.host().details(m.entry.pid), &m.entry);
                        *left = left.saturating_sub(1);
                        if !d.cmdline.is_empty() || *left == 0 {
                            self.argv_unread.remove(&key);
                        }
                        if !d.cmdline.is_empty() {
                            execd.push(MemberRecord {
                                exe: d.exe,
                                cmdline: d.cmdline,
                                ..record.clone()
                            });
                        }
                    }
                }
                None => {
                    self.comms
                        .insert(key, (m.entry.comm.clone(), m.entry.start_stack));
                }
            }
            sightings.push(record);
        }
        Sighted {
            sightings,
            fresh,
            execd,
        }
    }

    /// Writes the first sightings (every sighting when `bump_last_seen`).
    fn write_sightings(
        &mut self,
        engine: &Engine,
        report: &mut TickReport,
        sightings: &[MemberRecord],
        fresh: HashSet<ProcKey>,
        bump_last_seen: bool,
    ) {
        let ledger = engine.ledger();
        if !sightings.is_empty() && (bump_last_seen || !fresh.is_empty()) {
            // Without a bump only the new sightings are written: a known
            // member's row is already there.
            let to_write: Vec<MemberRecord> = if bump_last_seen {
                sightings.to_vec()
            } else {
                sightings
                    .iter()
                    .filter(|r| {
                        fresh.contains(&ProcKey::new(r.identity.pid, r.identity.start_ticks))
                    })
                    .cloned()
                    .collect()
            };
            let tree = self.tree;
            match self.evidence("member sightings", || {
                ledger.observe_members(tree, &to_write)
            }) {
                Some(Ok(new)) => {
                    report.new_members = new.len();
                    self.known.seen.extend(fresh);
                    if bump_last_seen {
                        self.last_bump = Some(engine.host().now());
                    }
                }
                Some(Err(e)) => {
                    report.write_errors += 1;
                    tracing::warn!(tree = self.tree.0, error = %e, "member sightings not recorded");
                }
                // Degraded: kept in memory; the next teardown (sweep)
                // records them once the ledger takes writes.
                None => self.known.seen.extend(fresh),
            }
        }
    }

    /// Records each member's escape, once.
    fn write_escapes(
        &mut self,
        engine: &Engine,
        report: &mut TickReport,
        members: &[Member],
        sightings: &[MemberRecord],
    ) {
        let ledger = engine.ledger();
        for (m, record) in members.iter().zip(sightings) {
            let key = m.entry.key();
            if !m.escaped || self.escapes.contains(&key) {
                continue;
            }
            let reason = format!(
                "outside the tree's group {} and session {} (pgid {}, sid {})",
                self.known.pgid, self.known.sid, m.entry.pgid, m.entry.sid
            );
            let tree = self.tree;
            match self.evidence("escape", || ledger.record_escape(tree, record, &reason)) {
                Some(Ok(_)) => {
                    self.escapes.insert(key);
                    report.new_escapes += 1;
                }
                Some(Err(e)) => {
                    report.write_errors += 1;
                    tracing::warn!(tree = self.tree.0, error = %e, "escape not recorded");
                }
                None => {}
            }
        }
    }

    /// The keys alive now. On an incomplete tick the members it could not
    /// read are added as last seen (to `members` too).
    fn unread_as_seen(
        &mut self,
        engine: &Engine,
        report: &mut TickReport,
        members: &mut Vec<Member>,
        incomplete: &Option<String>,
    ) -> HashSet<ProcKey> {
        let mut now: HashSet<ProcKey> = members.iter().map(|m| m.entry.key()).collect();
        if let Some(why) = incomplete {
            // Unknown is not exited: a member this tick could not read is
            // reported as last seen, and no exit is concluded from its
            // absence. The next tick tries again.
            let unread: Vec<Member> = self
                .alive
                .iter()
                .filter(|k| !now.contains(k))
                .filter_map(|k| self.last_read.get(k).cloned())
                .collect();
            now.extend(unread.iter().map(|m| m.entry.key()));
            members.extend(unread);
            engine.stats().scan_incomplete();
            tracing::warn!(tree = self.tree.0, why = %why, "scan incomplete: no exit concluded");
            report.incomplete = incomplete.clone();
        }
        now
    }

    /// The exits of the members alive at the last tick and not now: written
    /// (or, past a kill authorization, deferred). None on an incomplete tick.
    fn write_exits(
        &mut self,
        engine: &Engine,
        report: &mut TickReport,
        exits: &HashMap<i32, ExitStatus>,
        now: &HashSet<ProcKey>,
        incomplete: &Option<String>,
    ) {
        let ledger = engine.ledger();
        // Deferred exits (a teardown past its authorization) take only the
        // statuses already collected: the rest are looked up once, after
        // the tree is verified empty ([`TreeWatch::take_deferred_exits`]),
        // not per member while the kernel is still killing.
        let deferring = self.deferred_exits.is_some();
        let orphans_until = (!deferring)
            .then(|| engine.reaped().orphans_deadline(self.tree))
            .flatten();
        let gone: Vec<(IdentityRecord, Option<ExitRecord>)> = self
            .alive
            .iter()
            .filter(|k| incomplete.is_none() && !now.contains(k))
            .map(|&ProcKey { pid, start_ticks }| {
                // Not among the orphans' statuses yet: the root (a child
                // this process spawned), or an orphan whose status is still
                // on its way to the reaper.
                let exit = exits
                    .get(&pid)
                    .copied()
                    .or_else(|| {
                        if deferring {
                            return None;
                        }
                        let root = self.is_root(pid, start_ticks)
                            && engine.reaped().was_spawned_here(self.tree);
                        engine
                            .reaped()
                            .reaped_exit(pid, start_ticks, root, orphans_until)
                    })
                    .map(|s| engine.reaped().exit_of(pid, s));
                (
                    IdentityRecord {
                        pid,
                        start_ticks,
                        boot_id: self.boot_id.clone(),
                    },
                    exit,
                )
            })
            .collect();
        if let Some(deferred) = &mut self.deferred_exits {
            report.exited = gone.len();
            deferred.extend(gone);
        } else if !gone.is_empty() {
            report.exited = gone.len();
            let tree = self.tree;
            let unknown = engine.reaped().unknown_reaper(self.tree);
            if let Some(Err(e)) =
                self.evidence("member exits", || ledger.record_exits(tree, &gone, unknown))
            {
                report.write_errors += 1;
                tracing::warn!(tree = self.tree.0, error = %e, "member exits not recorded");
            }
        }
    }
}

/// What [`TreeWatch::sight`] made of a tick's members.
struct Sighted {
    sightings: Vec<MemberRecord>,
    /// The members seen for the first time (details read).
    fresh: HashSet<ProcKey>,
    /// Known members that exec'd since the last tick.
    execd: Vec<MemberRecord>,
}

/// A first sighting's details, kept only if they were read from the
/// process the scan classified. They are read by pid after the scan's
/// read: the member may have exited in between and another's process taken
/// its pid within the same clock tick (the same identity). The stat read
/// with them must show the scan's start, and its parent, or a group or
/// session of the scan's that the process does not lead (a stranger can
/// lead a session of its own number, not join another's). Otherwise
/// nothing of them is kept, and the member is recorded without a uid:
/// never read as itself, it is never signalled by its identity alone
/// ([`TreeWatch::vet`]).
fn confirmed(details: scan::MemberDetails, seen: &crate::proc::ProcEntry) -> scan::MemberDetails {
    // Windows reads no uid or lineage with the details (a job, not a
    // session, holds the tree there): nothing to check them against.
    if !crate::proc::LINEAGE_IN_DETAILS && details.read_from.is_none() {
        return details;
    }
    let same = details.read_from.is_some_and(|now| {
        now.start_ticks == seen.start_ticks
            && (now.ppid == seen.ppid
                || (now.pgid == seen.pgid && seen.pgid != seen.pid)
                || (now.sid == seen.sid && seen.sid != seen.pid))
    });
    if same {
        details
    } else {
        scan::MemberDetails::default()
    }
}

pub(crate) fn exit_record(status: ExitStatus) -> ExitRecord {
    match status {
        ExitStatus::Exited(code) => ExitRecord {
            code: Some(code),
            signal: None,
            cpu_usec: None,
        },
        ExitStatus::Signaled(sig) => ExitRecord {
            code: None,
            signal: Some(sig),
            cpu_usec: None,
        },
    }
}
