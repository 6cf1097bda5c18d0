//! The kernel seam of custody: exactly what the teardown and the tree
//! watches ask of the host, and nothing else.
//!
//! Why it exists: the teardown decides (term, wait, freeze, authorize, kill,
//! verify) and the host acts. Behind this trait the decisions can be tested
//! against a scripted host whose processes fork, exec, escape and exit
//! between any two steps (`fake.rs`, tests only), with a real ledger, in
//! milliseconds and without a single real process.
//!
//! [`KernelHost`] is the real implementation: a thin adapter that calls
//! `proc` and `scan` exactly as the teardown did before the seam existed.
//! The guards stay where they were: `proc` still refuses pid <= 1, its own
//! group, a recycled pid, a group that is not provably the recorded one.
//! `proc` knows nothing of this trait (no arrow from `src/proc` to
//! `src/custody`). The one thing it adds: full walks are coalesced across
//! the process ([`super::walks`]), each still as fresh as a walk of the
//! caller's own.
//!
//! What it must never do: grow a method the teardown or the watches do not
//! call, or hand out a raw pid signal (`kill(2)` on a bare pid): single
//! processes are signalled only through the handle they are held by
//! ([`Host::hold`]), groups by their [`GroupRecord`].

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::walks::Walks;
use crate::proc::{
    Delivery, ExitStatus, GroupDelivery, GroupRecord, Identity, Liveness, ProcError, Reaper, Sig,
};
use crate::scan::{MemberDetails, SharedSnapshot, Snapshot};

/// A process held from first sight (see [`Host::hold`]): signals and the
/// exit check reach that process or nothing, however its pid is reused.
#[derive(Debug)]
pub struct Held {
    /// The pid it held when it was taken.
    pid: i32,
    token: HeldToken,
}

#[derive(Debug)]
enum HeldToken {
    /// The kernel's handle: a verified pidfd.
    Pidfd(crate::proc::ExitHandle),
    /// A host's own name for one process (the fake host's serial).
    #[cfg_attr(not(test), allow(dead_code))]
    Serial(u64),
}

impl Held {
    /// A handle a host other than the kernel makes for its own processes.
    #[cfg(test)]
    pub(crate) fn serial(pid: i32, serial: u64) -> Self {
        Self {
            pid,
            token: HeldToken::Serial(serial),
        }
    }

    /// The pid the process had when it was held.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// The serial of a host's own handle (`None` for a pidfd).
    #[cfg(test)]
    pub(crate) fn serial_of(&self) -> Option<u64> {
        match self.token {
            HeldToken::Serial(s) => Some(s),
            HeldToken::Pidfd(_) => None,
        }
    }
}

/// What custody needs of the kernel: reads of `/proc` and cgroup files,
/// guarded signals, cgroup control, the reaper's exit statuses and a clock.
pub trait Host: Send + Sync {
    /// Every process (a full `/proc` walk), shared: the callers a walk
    /// serves at once hold one copy ([`super::walks`]) and one index of it
    /// ([`crate::scan::SharedSnapshot`]).
    fn snapshot(&self) -> Arc<SharedSnapshot>;
    /// Only these pids, re-read now (a targeted refresh).
    fn snapshot_pids(&self, pids: Vec<i32>) -> Snapshot;
    /// The pids in a cgroup's `cgroup.procs` (empty if it is gone).
    fn cgroup_pids(&self, dir: &Path) -> Result<HashSet<i32>, String>;
    /// The time since boot now, in the clock ticks of a start time
    /// ([`crate::proc::boot_ticks_now`]); `None` if unknown (every
    /// `cgroup.procs` listing is then confirmed by a second read).
    fn boot_ticks(&self) -> Option<u64>;
    /// The forensic details of a member seen for the first time (or exec'd).
    fn details(&self, pid: i32) -> MemberDetails;
    /// The argv of one process, for the survivor snapshot.
    fn cmdline(&self, pid: i32) -> Vec<String>;
    /// [`Host::cmdline`] of each pid, in their order.
    fn cmdlines(&self, pids: &[i32]) -> Vec<Vec<String>> {
        pids.iter().map(|&pid| self.cmdline(pid)).collect()
    }
    /// The kernel function `pid` sleeps in, where the kernel shows it (the
    /// evidence of a member no signal ends).
    fn wchan(&self, _pid: i32) -> Option<String> {
        None
    }
    /// The identity of whatever holds `pid` now (`None`: no such process).
    fn identity_of(&self, pid: i32) -> Result<Option<Identity>, ProcError>;
    /// Whether the process an identity names still runs.
    fn liveness(&self, id: &Identity) -> Liveness;
    /// Whether the process an identity names still is that process: the one
    /// liveness check of owners (and of a marker's survivors). One that has
    /// exited, reaped or not (a zombie runs no code), or whose pid now names
    /// a later process, is gone; one that cannot be read counts as alive (a
    /// missed reap is recoverable, a wrong kill is not: never a teardown on
    /// a guess).
    fn still_alive(&self, id: &Identity) -> bool {
        !matches!(self.liveness(id), Liveness::Gone | Liveness::Recycled)
    }
    /// This boot's id.
    fn boot_id(&self) -> Result<String, ProcError>;
    /// `killpg` of the recorded group, only while it provably is the
    /// recorded one ([`crate::proc::signal_group_known`]).
    fn signal_group_known(
        &self,
        rec: &GroupRecord,
        sig: Sig,
        candidates: &[crate::proc::ProcKey],
    ) -> Result<GroupDelivery, ProcError>;
    /// Holds the process `id` names, if it still is that process
    /// (`Ok(None)`: gone or recycled; `Err`: no handle can be had now, e.g.
    /// out of descriptors).
    fn hold(&self, id: &Identity) -> Result<Option<Held>, ProcError>;
    /// The uid `pid` runs as now (the owner of its `/proc` entry), the
    /// witness a member known by its identity is checked against; `None`
    /// when it cannot be read.
    fn uid_of(&self, pid: i32) -> Option<u32> {
        self.details(pid).uid
    }
    /// The soft descriptor limit of this process (`None`: none, or not a
    /// kind of limit this OS has): what the host's cap on held handles is
    /// measured against ([`super::holds`]).
    fn nofile_limit(&self) -> Option<u64> {
        None
    }
    /// Whether the held process has exited (its pid may be another's now).
    fn held_exited(&self, held: &Held) -> bool;
    /// Signals exactly the held process.
    fn signal_held(&self, held: &Held, sig: Sig) -> Result<Delivery, ProcError>;
    /// Kills the container at once: `cgroup.kill` (Windows:
    /// `TerminateJobObject`).
    fn container_kill(&self, dir: &Path) -> Result<(), ProcError>;
    /// Freezes the container (`cgroup.freeze` 1); whether `frozen 1` was
    /// reported within `wait`.
    fn container_freeze(&self, dir: &Path, wait: Duration) -> Result<bool, ProcError>;
    /// Clears the container's standing kill (Windows: the job's
    /// `KILL_ON_JOB_CLOSE`) and checks it is clear; `Ok` where there is
    /// none ([`crate::proc::disarm_standing_kill`]).
    fn disarm_standing_kill(&self, _dir: &Path) -> Result<(), ProcError> {
        Ok(())
    }
    /// Thaws the container (`cgroup.freeze` 0); whether `frozen 0` was
    /// reported within `wait`.
    fn container_thaw(&self, dir: &Path, wait: Duration) -> Result<bool, ProcError>;
    /// Waits for the container to empty (`populated 0` of `cgroup.events`)
    /// until `deadline` (the kernel's change notification, not a timed
    /// poll); whether it came.
    fn container_wait_empty(&self, dir: &Path, deadline: Instant) -> Result<bool, ProcError>;
    /// Waits until every process `ids` names has exited, or `deadline`
    /// (identity-checked pidfds: the kernel's exit notification, not a
    /// timed poll); whether all did.
    fn wait_exits(&self, ids: &[Identity], deadline: Instant) -> Result<bool, ProcError>;
    /// `oom_kill` of the cgroup's `memory.events`: how many processes the
    /// kernel's OOM killer ended in it (`None`: no memory controller). A
    /// plain file read, so a fake host can be given a directory holding one.
    fn oom_kills(&self, dir: &Path) -> Option<u64> {
        crate::proc::oom_kills(dir)
    }
    /// What the tree's cgroup says it consumed ([`crate::proc::container_usage`]):
    /// plain reads of its usage files, so a fake host's cgroup may be a
    /// temporary directory holding them.
    fn container_usage(&self, dir: &Path) -> crate::proc::ContainerUsage {
        crate::proc::container_usage(dir)
    }
    /// Removes an empty cgroup, waiting up to `wait` for the kernel to let
    /// go of it; `false` when it stayed populated.
    fn remove_cgroup_when_empty(&self, dir: &Path, wait: Duration) -> Result<bool, ProcError>;
    /// Whether this process is a subreaper that collects its orphans'
    /// statuses (run, serve).
    fn has_reaper(&self) -> bool;
    /// Whether this process, a subreaper, has no child at all, live or
    /// zombie ([`crate::proc::has_no_children`]); `None` when it is no
    /// subreaper or cannot tell.
    fn has_no_children(&self) -> Option<bool>;
    /// Exit statuses the reaper collected that nobody claimed yet.
    fn unclaimed_exits(&self) -> Vec<(i32, ExitStatus)>;
    /// The exit status of a process this process reaped, or is about to
    /// (see [`crate::custody::Engine`]'s `reaped_exit`): the root's when
    /// `is_root`; an orphan's, waited for until `orphans_until` when it is
    /// already gone from `/proc`.
    fn reaped_exit(
        &self,
        pid: i32,
        start_ticks: u64,
        is_root: bool,
        orphans_until: Option<Instant>,
    ) -> Option<ExitStatus>;
    /// The CPU time (user + system, microseconds, with its waited-for
    /// children's) of the process of `pid` this process reaped last, from
    /// the reaper's rusage; `None` without a reaper or such an exit.
    fn reaped_cpu_usec(&self, pid: i32) -> Option<u64> {
        let _ = pid;
        None
    }
    /// The clock the teardown's deadlines (grace, verify) and the watches'
    /// coarse intervals (the `last_seen` bump, the OOM read) are measured on.
    fn now(&self) -> Instant;
    /// Waits between two polls of the teardown.
    fn sleep(&self, d: Duration);
}

/// A ledger identity as the kernel's (the same three fields).
impl From<&crate::ledger::IdentityRecord> for Identity {
    fn from(id: &crate::ledger::IdentityRecord) -> Self {
        Identity {
            pid: id.pid,
            start_ticks: id.start_ticks,
            boot_id: id.boot_id.clone(),
        }
    }
}

/// The real host: `proc` and `scan`, called as they always were.
#[derive(Clone, Copy, Default)]
pub struct KernelHost {
    /// The reaper, when this process owns children (run, serve).
    reaper: Option<&'static Reaper>,
}

impl KernelHost {
    pub fn new(reaper: Option<&'static Reaper>) -> Self {
        Self { reaper }
    }

    /// How many full `/proc` walks [`Host::snapshot`] has made in this
    /// process: fewer than its callers when they asked at once (see
    /// [`super::walks`]).
    pub fn walks() -> u64 {
        WALKS.walks()
    }
}

/// The process's one coalescer of full `/proc` walks: every
/// [`KernelHost`] shares it, since every caller walks the same `/proc`.
static WALKS: Walks<Arc<SharedSnapshot>> = Walks::new();

impl Host for KernelHost {
    /// A walk that started after this call, shared with every caller
    /// asking meanwhile (a drain's thousands of teardowns).
    fn snapshot(&self) -> Arc<SharedSnapshot> {
        WALKS.get(|| crate::scan::share(crate::scan::snapshot()))
    }

    fn snapshot_pids(&self, pids: Vec<i32>) -> Snapshot {
        crate::scan::snapshot_pids(pids)
    }

    fn cgroup_pids(&self, dir: &Path) -> Result<HashSet<i32>, String> {
        crate::scan::cgroup_pids(dir)
    }

    fn boot_ticks(&self) -> Option<u64> {
        crate::scan::boot_ticks_now()
    }

    fn details(&self, pid: i32) -> MemberDetails {
        crate::scan::details(pid)
    }

    fn cmdline(&self, pid: i32) -> Vec<String> {
        crate::scan::cmdline(pid)
    }

    fn cmdlines(&self, pids: &[i32]) -> Vec<Vec<String>> {
        crate::scan::cmdlines(pids)
    }

    fn wchan(&self, pid: i32) -> Option<String> {
        crate::scan::wchan(pid)
    }

    fn identity_of(&self, pid: i32) -> Result<Option<Identity>, ProcError> {
        crate::proc::identity_of(pid)
    }

    fn liveness(&self, id: &Identity) -> Liveness {
        id.check()
    }

    fn boot_id(&self) -> Result<String, ProcError> {
        crate::proc::boot_id().map(str::to_owned)
    }

    fn signal_group_known(
        &self,
        rec: &GroupRecord,
        sig: Sig,
        candidates: &[crate::proc::ProcKey],
    ) -> Result<GroupDelivery, ProcError> {
        crate::proc::signal_group_known(rec, sig, candidates)
    }

    fn hold(&self, id: &Identity) -> Result<Option<Held>, ProcError> {
        // The guards of every signal: never pid 1 nor this process.
        if id.pid <= 1 || id.pid == std::process::id() as i32 {
            return Ok(None);
        }
        Ok(crate::proc::open_exit_watch(id)?.map(|fd| Held {
            pid: id.pid,
            token: HeldToken::Pidfd(fd),
        }))
    }

    fn uid_of(&self, pid: i32) -> Option<u32> {
        crate::scan::uid_of(pid)
    }

    fn nofile_limit(&self) -> Option<u64> {
        crate::proc::nofile_soft_limit()
    }

    fn held_exited(&self, held: &Held) -> bool {
        match &held.token {
            HeldToken::Pidfd(fd) => crate::proc::pidfd_exited(fd),
            HeldToken::Serial(_) => true,
        }
    }

    fn signal_held(&self, held: &Held, sig: Sig) -> Result<Delivery, ProcError> {
        match &held.token {
            HeldToken::Pidfd(fd) => crate::proc::signal_pidfd(fd, sig),
            HeldToken::Serial(_) => Ok(Delivery::Gone),
        }
    }

    fn container_kill(&self, dir: &Path) -> Result<(), ProcError> {
        crate::proc::container_kill(dir)
    }

    fn container_freeze(&self, dir: &Path, wait: Duration) -> Result<bool, ProcError> {
        crate::proc::container_freeze(dir, wait)
    }

    fn disarm_standing_kill(&self, dir: &Path) -> Result<(), ProcError> {
        crate::proc::disarm_standing_kill(dir)
    }

    fn container_thaw(&self, dir: &Path, wait: Duration) -> Result<bool, ProcError> {
        crate::proc::container_thaw(dir, wait)
    }

    fn container_wait_empty(&self, dir: &Path, deadline: Instant) -> Result<bool, ProcError> {
        crate::proc::container_wait_event(dir, crate::proc::CgroupEvent::Populated, false, deadline)
    }

    fn wait_exits(&self, ids: &[Identity], deadline: Instant) -> Result<bool, ProcError> {
        crate::proc::wait_exits(ids, deadline)
    }

    fn remove_cgroup_when_empty(&self, dir: &Path, wait: Duration) -> Result<bool, ProcError> {
        crate::proc::remove_cgroup_when_empty(dir, wait)
    }

    fn has_reaper(&self) -> bool {
        self.reaper.is_some()
    }

    fn has_no_children(&self) -> Option<bool> {
        self.reaper?;
        crate::proc::has_no_children().ok()
    }

    fn unclaimed_exits(&self) -> Vec<(i32, ExitStatus)> {
        self.reaper.map(|r| r.unclaimed()).unwrap_or_default()
    }

    fn reaped_cpu_usec(&self, pid: i32) -> Option<u64> {
        self.reaper?.cpu_usec_of(pid)
    }

    /// See [`crate::custody::Engine`]'s `reaped_exit`: the root's status
    /// from the spawned-child record (by pid, only when `is_root`), any
    /// other member's only from the orphans' unclaimed statuses.
    fn reaped_exit(
        &self,
        pid: i32,
        start_ticks: u64,
        is_root: bool,
        orphans_until: Option<Instant>,
    ) -> Option<ExitStatus> {
        let reaper = self.reaper?;
        let wait = Duration::from_secs(1);
        if is_root && reaper.knows(pid) {
            return reaper.wait_exit(pid, Some(wait));
        }
        let me = std::process::id() as i32;
        let wait = match crate::proc::read_stat(pid) {
            Ok(Some(stat))
                if stat.start_ticks == start_ticks && stat.ppid == me && stat.is_dead() =>
            {
                wait
            }
            Ok(None) => orphans_until
                .map(|t| t.saturating_duration_since(Instant::now()))
                .unwrap_or_default(),
            _ => Duration::ZERO,
        };
        reaper.wait_unclaimed(pid, wait)
    }

    fn now(&self) -> Instant {
        Instant::now()
    }

    fn sleep(&self, d: Duration) {
        std::thread::sleep(d);
    }
}
