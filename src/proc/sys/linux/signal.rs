//! Signals, aimed only at what we provably own (DESIGN rules 3 and 4).
//!
//! - A single process is signalled through a pidfd opened first and then
//!   checked against the recorded [`Identity`]; once the pidfd is open it
//!   names one process for good, so a pid recycled since is never hit
//!   (within the clock tick of a start time only a handle held from
//!   before tells two processes apart: `held.rs`).
//! - A process group is signalled by the pgid recorded at spawn
//!   ([`GroupRecord`]), never re-resolved from the leader pid (the leader is
//!   often the first to die and be reaped), and only while the group provably
//!   is the recorded one: it has live members, all in the recorded session,
//!   and any live process whose pid is the pgid is the recorded leader.
//! - A cgroup is signalled with `cgroup.kill` (race-free: the kernel kills
//!   every member, including ones forking right now) and frozen with
//!   `cgroup.freeze`.
//!
//! Every entry point refuses pid <= 1, our own pid, our own process group and
//! session, and a cgroup that contains us ([`ProcError::Refused`]).
//!
//! Where the kernel has it (Linux 6.9+), a group whose leader is still
//! there (alive or an unreaped zombie) is signalled with
//! `pidfd_send_signal(PIDFD_SIGNAL_PROCESS_GROUP)` on a pidfd of the
//! recorded leader ([`GroupPath::Pidfd`]): the pidfd pins the leader's
//! `struct pid`, which is the group's, so the signal reaches that group or
//! nobody, never a later group that took the same number.
//!
//! Residual: elsewhere (the leader reaped, or an older kernel:
//! [`GroupPath::Killpg`]), between the group check and `killpg` the whole
//! group could die and its pgid be reused by a new session within
//! microseconds; pid allocation makes this very unlikely (a pgid number is
//! not reused while any process is still in that group). The cgroup
//! boundary has no such window.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rustix::io::Errno;
use rustix::process::{Pid, PidfdFlags, Signal};

use super::identity::{boot_id, read_stat};
use crate::proc::{
    CgroupEvent, Delivery, GroupDelivery, GroupRecord, Identity, ProcEntry, ProcError,
};

pub use crate::proc::sig::Sig;

impl Sig {
    /// The signal number (for `128 + N` exit codes and comparisons).
    pub fn number(self) -> i32 {
        self.raw().as_raw()
    }

    pub(crate) fn raw(self) -> Signal {
        match self {
            Sig::Term => Signal::TERM,
            Sig::Kill => Signal::KILL,
            Sig::Stop => Signal::STOP,
            Sig::Cont => Signal::CONT,
            Sig::Int => Signal::INT,
            Sig::Hup => Signal::HUP,
            Sig::Quit => Signal::QUIT,
            Sig::Usr1 => Signal::USR1,
            Sig::Usr2 => Signal::USR2,
        }
    }
}

fn own_pid() -> i32 {
    rustix::process::getpid().as_raw_nonzero().get()
}

/// The sentinel guard for a pid or pgid about to be signalled
/// ([`crate::proc::guard::check`]).
fn guard(target: i32, what: &str) -> Result<(), ProcError> {
    let own = crate::proc::guard::Own {
        pid: own_pid(),
        pgrp: own_pgrp(),
        sid: own_sid(),
    };
    crate::proc::guard::check(target, what, &own)
}

/// Our own process group, or `None` when it lies outside our pid namespace:
/// a container entered without a new session (`unshare --pid --fork`, some CI
/// sandboxes) reads 0 for it, which names no pid we could ever target. (rustix
/// `getpgrp` asserts a non-zero answer and panics there, so libc is used.)
fn own_pgrp() -> Option<i32> {
    // SAFETY: getpgrp takes no arguments, touches no memory of ours and
    // cannot fail.
    let pgrp = unsafe { libc::getpgrp() };
    (pgrp > 0).then_some(pgrp)
}

/// Our own session, or `None` when it lies outside our pid namespace (see
/// [`own_pgrp`]) or cannot be read.
fn own_sid() -> Option<i32> {
    // SAFETY: getsid(0) asks about the calling process; it takes no pointer
    // and reports failure as -1.
    let sid = unsafe { libc::getsid(0) };
    (sid > 0).then_some(sid)
}

/// Whether the caller may signal `pid` (`kill(pid, 0)`): what `run
/// --owner-pid` requires, so a wrapper cannot bind a tree to a process its
/// caller has no power over. `false` for no such process too.
pub fn may_signal(pid: i32) -> bool {
    rustix::process::Pid::from_raw(pid)
        .is_some_and(|p| rustix::process::test_kill_process(p).is_ok())
}

/// Signals one process, only if it still is `id`: opens a pidfd for the pid,
/// verifies start ticks and boot id (after the open, so the verified process
/// is the one the pidfd names), then sends through the pidfd. The identity
/// is all it checks: two processes can share one within a clock tick, so
/// custody signals a member only through a handle held since it was shown
/// to be the member (`held.rs`), never through this.
pub fn signal_process(id: &Identity, sig: Sig) -> Result<Delivery, ProcError> {
    guard(id.pid, "pid")?;
    let Some(pid) = Pid::from_raw(id.pid) else {
        return Ok(Delivery::Gone);
    };
    let pidfd = match rustix::process::pidfd_open(pid, PidfdFlags::empty()) {
        Ok(fd) => fd,
        Err(Errno::SRCH) => return Ok(Delivery::Gone),
        Err(e) => return Err(e.into()),
    };
    let Some(stat) = read_stat(id.pid)? else {
        return Ok(Delivery::Gone);
    };
    if stat.start_ticks != id.start_ticks || boot_id()? != id.boot_id {
        return Ok(Delivery::Recycled);
    }
    if stat.is_dead() {
        return Ok(Delivery::Gone);
    }
    match rustix::process::pidfd_send_signal(&pidfd, sig.raw()) {
        Ok(()) => Ok(Delivery::Sent),
        Err(Errno::SRCH) => Ok(Delivery::Gone),
        Err(e) => Err(e.into()),
    }
}

/// Live processes whose process group is `pgid`, by a `/proc` walk with the
/// lean stat reader ([`crate::proc::snapshot`]: one open and read per
/// process, not `procfs`'s directory handle and full parse). An incomplete
/// walk is an error, not an empty group: unknown is not gone.
pub fn group_members(pgid: i32) -> Result<Vec<ProcEntry>, ProcError> {
    let snap = crate::proc::snapshot();
    if let Some(why) = snap.incomplete {
        return Err(ProcError::Proc(format!(
            "process group {pgid}: /proc walk incomplete ({why})"
        )));
    }
    Ok(snap
        .entries
        .into_values()
        .filter(|e| e.pgid == pgid && e.is_live())
        .collect())
}

/// Signals the recorded group with `killpg(rec.pgid)`, only while it provably
/// is the recorded one (see the module doc). Call it again before every
/// escalation step: the check is not cached.
pub fn signal_group(rec: &GroupRecord, sig: Sig) -> Result<GroupDelivery, ProcError> {
    signal_group_known(rec, sig, &[])
}

/// [`signal_group`], with the group's live members looked for first among
/// `candidates` (pids the caller classified as members moments ago),
/// re-read from `/proc` now until the first one still alive in the group,
/// so the check is as fresh as a walk's. Only when none of them is (still)
/// in the group is all of `/proc` walked. `Sent { members }` then reports
/// the number of candidates (at least one of them re-read live just now).
///
/// As strong as the walk: every process of a group is in the group's
/// session (the kernel refuses `setpgid` across sessions, and `setsid`
/// leaves the group), so one live member in the recorded session proves the
/// session of all of them, and the leader check below does not depend on
/// which members were read.
pub fn signal_group_known(
    rec: &GroupRecord,
    sig: Sig,
    candidates: &[crate::proc::ProcKey],
) -> Result<GroupDelivery, ProcError> {
    signal_group_via(rec, sig, candidates).map(|(delivery, _)| delivery)
}

/// How a process group was (or would be) signalled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupPath {
    /// `pidfd_send_signal(PIDFD_SIGNAL_PROCESS_GROUP)` on a pidfd of the
    /// recorded leader (Linux 6.9+).
    Pidfd,
    /// `killpg(pgid)` after the check: the leader is gone, or the kernel
    /// predates `PIDFD_SIGNAL_PROCESS_GROUP`.
    Killpg,
}

/// `PIDFD_SIGNAL_PROCESS_GROUP` (linux/pidfd.h, Linux 6.9).
const PIDFD_SIGNAL_PROCESS_GROUP: libc::c_uint = 1 << 2;
/// Set once the kernel answered EINVAL to the flag (it predates it).
static PGRP_FLAG_UNSUPPORTED: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// `pidfd_send_signal(fd, sig, NULL, PIDFD_SIGNAL_PROCESS_GROUP)`.
fn pidfd_signal_pgrp(fd: &rustix::fd::OwnedFd, sig: libc::c_int) -> Result<(), Errno> {
    use std::os::fd::AsRawFd;
    // SAFETY: a plain syscall on a pidfd we own, with a NULL siginfo (the
    // kernel fills it as kill(2) does) and a flag word; no memory is lent.
    let r = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            fd.as_raw_fd(),
            sig,
            std::ptr::null::<libc::siginfo_t>(),
            PIDFD_SIGNAL_PROCESS_GROUP,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(Errno::from_raw_os_error(
            std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EIO),
        ))
    }
}

/// Whether this kernel signals process groups through pidfds: signal 0
/// (which delivers nothing) through our own pidfd to the group our pid
/// leads. An older kernel refuses the flag (EINVAL) before it looks; a
/// newer one answers ESRCH when we lead no group, or sends nothing.
pub fn pidfd_group_signals_supported() -> bool {
    let Ok(fd) = rustix::process::pidfd_open(rustix::process::getpid(), PidfdFlags::empty()) else {
        return false;
    };
    !matches!(
        pidfd_signal_pgrp(&fd, 0),
        Err(Errno::INVAL) | Err(Errno::NOSYS)
    )
}

/// The group signal through a pidfd of the recorded leader, when the
/// kernel has it and the leader is still there. `None`: use `killpg`.
fn signal_group_by_pidfd(rec: &GroupRecord, sig: Sig) -> Option<Result<GroupDelivery, ProcError>> {
    use std::sync::atomic::Ordering;
    if PGRP_FLAG_UNSUPPORTED.load(Ordering::Relaxed) {
        return None;
    }
    let pid = Pid::from_raw(rec.pgid)?;
    let fd = rustix::process::pidfd_open(pid, PidfdFlags::empty()).ok()?;
    // The pidfd names whoever held the pid when it was opened: it is the
    // recorded leader only if that process started when the leader did.
    match read_stat(rec.pgid) {
        Ok(Some(now)) if now.start_ticks == rec.leader.start_ticks => {}
        Ok(_) => return None,
        Err(e) => return Some(Err(e)),
    }
    match pidfd_signal_pgrp(&fd, sig.raw().as_raw()) {
        Ok(()) => Some(Ok(GroupDelivery::Sent { members: 0 })),
        Err(Errno::SRCH) => Some(Ok(GroupDelivery::Empty)),
        Err(Errno::INVAL) => {
            PGRP_FLAG_UNSUPPORTED.store(true, Ordering::Relaxed);
            None
        }
        Err(e) => Some(Err(e.into())),
    }
}

/// [`signal_group_known`], also saying which path sent it.
pub fn signal_group_via(
    rec: &GroupRecord,
    sig: Sig,
    candidates: &[crate::proc::ProcKey],
) -> Result<(GroupDelivery, GroupPath), ProcError> {
    guard(rec.pgid, "process group")?;
    guard(rec.sid, "session")?;
    if rec.leader.pid != rec.pgid {
        return Ok((
            GroupDelivery::NotRecorded(format!(
                "record is inconsistent: leader pid {} is not pgid {}",
                rec.leader.pid, rec.pgid
            )),
            GroupPath::Killpg,
        ));
    }
    // One live member re-read now is proof enough of the group's session
    // (see above); the count reported is the caller's classification.
    let (members, count) =
        match super::stat::first_live_in_group(candidates.iter().map(|k| k.pid), rec.pgid) {
            Some(e) => (vec![e], candidates.len()),
            None => {
                let walked = group_members(rec.pgid)?;
                let n = walked.len();
                (walked, n)
            }
        };
    if members.is_empty() {
        return Ok((GroupDelivery::Empty, GroupPath::Killpg));
    }
    if let Some(stranger) = members.iter().find(|m| m.sid != rec.sid) {
        return Ok((
            GroupDelivery::NotRecorded(format!(
                "member pid {} is in session {}, not the recorded session {}",
                stranger.pid, stranger.sid, rec.sid
            )),
            GroupPath::Killpg,
        ));
    }
    // A live process holding the pgid's number must be the recorded leader.
    if let Some(leader) = read_stat(rec.pgid)?
        && !leader.is_dead()
    {
        if boot_id()? != rec.leader.boot_id {
            return Ok((
                GroupDelivery::NotRecorded("the group record is from another boot".into()),
                GroupPath::Killpg,
            ));
        }
        if leader.start_ticks != rec.leader.start_ticks {
            return Ok((
                GroupDelivery::NotRecorded(format!(
                    "pid {} now belongs to a process started at tick {}, not the recorded leader (tick {})",
                    rec.pgid, leader.start_ticks, rec.leader.start_ticks
                )),
                GroupPath::Killpg,
            ));
        }
    }
    // The leader still there and the kernel able: no window between the
    // check and the signal (the pidfd pins the group's struct pid).
    if let Some(sent) = signal_group_by_pidfd(rec, sig) {
        return sent.map(|d| match d {
            GroupDelivery::Sent { .. } => {
                (GroupDelivery::Sent { members: count }, GroupPath::Pidfd)
            }
            other => (other, GroupPath::Pidfd),
        });
    }
    let Some(pgid) = Pid::from_raw(rec.pgid) else {
        return Ok((GroupDelivery::Empty, GroupPath::Killpg));
    };
    match rustix::process::kill_process_group(pgid, sig.raw()) {
        Ok(()) => Ok((GroupDelivery::Sent { members: count }, GroupPath::Killpg)),
        Err(Errno::SRCH) => Ok((GroupDelivery::Empty, GroupPath::Killpg)),
        Err(e) => Err(e.into()),
    }
}

/// Refuses a cgroup that contains the calling process (killing or freezing
/// it would hit treewarden itself).
fn guard_cgroup(path: &Path) -> Result<(), ProcError> {
    let refuse = || ProcError::Refused {
        pid: own_pid(),
        reason: format!("cgroup {} contains treewarden itself", path.display()),
    };
    if let Ok(Some(own)) = super::boundary::own_cgroup_dir()
        && let (Ok(own), Ok(target)) = (own.canonicalize(), path.canonicalize())
        && own.starts_with(&target)
    {
        return Err(refuse());
    }
    if cgroup_pids(path)?.contains(&own_pid()) {
        return Err(refuse());
    }
    Ok(())
}

fn write_control(path: &Path, file: &str, value: &str) -> Result<(), ProcError> {
    std::fs::write(path.join(file), value).map_err(|e| ProcError::cgroup(path.join(file), e))
}

impl CgroupEvent {
    fn key(self) -> &'static str {
        match self {
            CgroupEvent::Populated => "populated",
            CgroupEvent::Frozen => "frozen",
        }
    }
}

/// Reads one key of `cgroup.events`.
fn cgroup_event(path: &Path, key: CgroupEvent) -> Result<bool, ProcError> {
    let file: PathBuf = path.join("cgroup.events");
    let text = super::pseudo::read_path_string(&file).map_err(|e| ProcError::cgroup(&file, e))?;
    Ok(event_value(&text, key))
}

fn event_value(text: &str, key: CgroupEvent) -> bool {
    text.lines()
        .filter_map(|l| l.split_once(' '))
        .any(|(k, v)| k == key.key() && v.trim() == "1")
}

/// Waits until `key` of `cgroup.events` reads `want`, or `deadline`;
/// whether it did. Event-driven: the kernel notifies every change of
/// `cgroup.events` to a poller (`POLLPRI`), so this sleeps in `poll(2)`
/// until the file changes. kernfs compares the file's event count with the
/// one of this descriptor's last read, so a change between the read and the
/// poll is not lost. But cgroup file notifications are rate-limited to one
/// per 10 ms (`CGROUP_FILE_NOTIFY_MIN_INTV`): a freeze, its thaw and the
/// `populated 0` after a kill come within 10 ms of each other, and waiting
/// for the notification alone cost up to 10 ms per step. So each poll is
/// also capped: 250 µs for the first 50 ms (a state a teardown waits for
/// usually comes within a few ms), then 50 ms.
pub fn cgroup_wait_event(
    path: &Path,
    key: CgroupEvent,
    want: bool,
    deadline: Instant,
) -> Result<bool, ProcError> {
    let name: PathBuf = path.join("cgroup.events");
    let err = |e: std::io::Error| ProcError::cgroup(&name, e);
    let mut file = std::fs::File::open(&name).map_err(err)?;
    let mut text = String::with_capacity(64);
    let started = Instant::now();
    loop {
        super::pseudo::reread_string(&mut file, &mut text).map_err(err)?;
        if event_value(&text, key) == want {
            return Ok(true);
        }
        let now = Instant::now();
        if now >= deadline {
            return Ok(false);
        }
        let cap = if now - started < Duration::from_millis(50) {
            Duration::from_micros(250)
        } else {
            Duration::from_millis(50)
        };
        let left = (deadline - now).min(cap);
        let timeout = rustix::event::Timespec {
            tv_sec: 0,
            tv_nsec: left.as_nanos() as _,
        };
        let mut fds = [rustix::event::PollFd::new(
            &file,
            rustix::event::PollFlags::PRI,
        )];
        match rustix::event::poll(&mut fds, Some(&timeout)) {
            Ok(_) | Err(Errno::INTR) => {}
            Err(e) => return Err(err(e.into())),
        }
    }
}

/// SIGKILLs every process in the cgroup and its descendants (`cgroup.kill`).
pub fn cgroup_kill(path: &Path) -> Result<(), ProcError> {
    guard_cgroup(path)?;
    write_control(path, "cgroup.kill", "1")
}

/// Freezes the cgroup (`cgroup.freeze`) and waits up to `wait` for
/// `cgroup.events` to report it frozen; whether it did.
pub fn cgroup_freeze(path: &Path, wait: Duration) -> Result<bool, ProcError> {
    guard_cgroup(path)?;
    write_control(path, "cgroup.freeze", "1")?;
    cgroup_wait_event(path, CgroupEvent::Frozen, true, Instant::now() + wait)
}

/// Thaws the cgroup and waits up to `wait` for `cgroup.events` to report
/// it no longer frozen; whether it did.
pub fn cgroup_thaw(path: &Path, wait: Duration) -> Result<bool, ProcError> {
    guard_cgroup(path)?;
    write_control(path, "cgroup.freeze", "0")?;
    cgroup_wait_event(path, CgroupEvent::Frozen, false, Instant::now() + wait)
}

/// Pids directly in the cgroup (`cgroup.procs`; not its sub-cgroups).
pub fn cgroup_pids(path: &Path) -> Result<Vec<i32>, ProcError> {
    let file = path.join("cgroup.procs");
    let text = super::pseudo::read_path_string(&file).map_err(|e| ProcError::cgroup(&file, e))?;
    Ok(text.lines().filter_map(|l| l.trim().parse().ok()).collect())
}

/// Whether any live process is in the cgroup or below (`cgroup.events`).
pub fn cgroup_populated(path: &Path) -> Result<bool, ProcError> {
    cgroup_event(path, CgroupEvent::Populated)
}

/// Restores SIGPIPE's default action (the Rust runtime ignores it), so a
/// command whose output goes to a pipe that closes early (`ls | head -1`)
/// ends quietly as the shells expect (status 141) instead of failing a
/// write. Only for commands that print and hold no tree.
pub fn default_sigpipe() {
    // SAFETY: setting a signal's disposition to SIG_DFL installs no handler
    // and touches no memory; it is called before any thread that could
    // depend on the old disposition writes to a pipe.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}
