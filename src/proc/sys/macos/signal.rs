//! Signals on macOS: `kill` to one process, `killpg` to a tree's recorded
//! process group, each only after the identity check that proves the
//! target is the recorded one (DESIGN rules 3 and 4).
//!
//! Residual: macOS has no pidfd, so between the check and the `kill` a
//! process could exit and its pid be taken by a new process within
//! microseconds (pids are allocated upwards and wrap at 99,999: very
//! unlikely, not impossible). The same window is Linux's `killpg` path's.
//! macOS has no cgroups: the `cgroup_*` calls answer "no container".

use std::path::Path;
use std::time::{Duration, Instant};

use super::identity::{boot_id, first_live_in_group, group_members, read_stat};
use crate::proc::{CgroupEvent, Delivery, GroupDelivery, GroupRecord, Identity, ProcError};

pub use crate::proc::sig::Sig;

impl Sig {
    /// The signal number (macOS's own: SIGUSR1 is 30, SIGSTOP 17).
    pub fn number(self) -> i32 {
        match self {
            Sig::Term => libc::SIGTERM,
            Sig::Kill => libc::SIGKILL,
            Sig::Stop => libc::SIGSTOP,
            Sig::Cont => libc::SIGCONT,
            Sig::Int => libc::SIGINT,
            Sig::Hup => libc::SIGHUP,
            Sig::Quit => libc::SIGQUIT,
            Sig::Usr1 => libc::SIGUSR1,
            Sig::Usr2 => libc::SIGUSR2,
        }
    }
}

fn own_pid() -> i32 {
    std::process::id() as i32
}

/// The sentinel guard ([`crate::proc::guard::check`]): pid <= 1, this
/// process, its own group or session.
fn guard(target: i32, what: &str) -> Result<(), ProcError> {
    // SAFETY: getpgrp and getsid(0) take nothing and cannot fail for the
    // caller itself.
    let (pgrp, sid) = unsafe { (libc::getpgrp(), libc::getsid(0)) };
    let own = crate::proc::guard::Own {
        pid: own_pid(),
        pgrp: (pgrp > 0).then_some(pgrp),
        sid: (sid > 0).then_some(sid),
    };
    crate::proc::guard::check(target, what, &own)
}

/// Whether this process may signal `pid` (`kill(pid, 0)`).
pub fn may_signal(pid: i32) -> bool {
    // SAFETY: signal 0 sends nothing; it only checks existence and permission.
    pid > 1 && unsafe { libc::kill(pid, 0) } == 0
}

/// Signals one process only if it still is `id` (start time re-read just
/// before the `kill`; see the module doc for the window that leaves).
pub fn signal_process(id: &Identity, sig: Sig) -> Result<Delivery, ProcError> {
    guard(id.pid, "pid")?;
    let Some(stat) = read_stat(id.pid)? else {
        return Ok(Delivery::Gone);
    };
    if stat.start_ticks != id.start_ticks || boot_id()? != id.boot_id {
        return Ok(Delivery::Recycled);
    }
    if stat.is_dead() {
        return Ok(Delivery::Gone);
    }
    // SAFETY: plain values; the pid was checked to hold `id` just now.
    if unsafe { libc::kill(id.pid, sig.number()) } == 0 {
        return Ok(Delivery::Sent);
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::ESRCH) => Ok(Delivery::Gone),
        _ => Err(ProcError::Io(e)),
    }
}

/// Signals the recorded group with `killpg(rec.pgid)`, only while it
/// provably is the recorded one: a live member (one of `candidates` re-read
/// now, else every member `proc_listpgrppids` lists) is in the recorded
/// session, and a live process holding the pgid's number is the recorded
/// leader. Call it again before every escalation step: nothing is cached.
pub fn signal_group_known(
    rec: &GroupRecord,
    sig: Sig,
    candidates: &[crate::proc::ProcKey],
) -> Result<GroupDelivery, ProcError> {
    guard(rec.pgid, "process group")?;
    guard(rec.sid, "session")?;
    if rec.leader.pid != rec.pgid {
        return Ok(GroupDelivery::NotRecorded(format!(
            "record is inconsistent: leader pid {} is not pgid {}",
            rec.leader.pid, rec.pgid
        )));
    }
    let (members, count) = match first_live_in_group(candidates.iter().map(|k| k.pid), rec.pgid) {
        Some(e) => (vec![e], candidates.len()),
        None => {
            let listed = group_members(rec.pgid)?;
            let n = listed.len();
            (listed, n)
        }
    };
    if members.is_empty() {
        return Ok(GroupDelivery::Empty);
    }
    if let Some(stranger) = members.iter().find(|m| m.sid != rec.sid) {
        return Ok(GroupDelivery::NotRecorded(format!(
            "member pid {} is in session {}, not the recorded session {}",
            stranger.pid, stranger.sid, rec.sid
        )));
    }
    if let Some(leader) = read_stat(rec.pgid)?
        && !leader.is_dead()
        && leader.start_ticks != rec.leader.start_ticks
    {
        return Ok(GroupDelivery::NotRecorded(format!(
            "pid {} now belongs to a process started at {} µs, not the recorded leader ({} µs)",
            rec.pgid, leader.start_ticks, rec.leader.start_ticks
        )));
    }
    // SAFETY: plain values; the group was proven the recorded one just now.
    if unsafe { libc::killpg(rec.pgid, sig.number()) } == 0 {
        return Ok(GroupDelivery::Sent { members: count });
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::ESRCH) => Ok(GroupDelivery::Empty),
        _ => Err(ProcError::Io(e)),
    }
}

fn no_container(path: &Path) -> ProcError {
    ProcError::NoCgroup(format!(
        "{}: macOS has no cgroups (a tree's boundary is its session and process group)",
        path.display()
    ))
}

/// No container to kill on macOS (no boundary is contained, so the
/// teardown never asks).
pub fn container_kill(path: &Path) -> Result<(), ProcError> {
    Err(no_container(path))
}

/// Nothing can be frozen (`Ok(false)`).
pub fn container_freeze(_path: &Path, _wait: Duration) -> Result<bool, ProcError> {
    Ok(false)
}

/// Nothing was frozen: nothing to thaw.
pub fn container_thaw(_path: &Path, _wait: Duration) -> Result<bool, ProcError> {
    Ok(true)
}

/// No container: no pids in it.
pub fn container_pids(_path: &Path) -> Result<Vec<i32>, ProcError> {
    Ok(Vec::new())
}

/// No container: never populated.
pub fn container_populated(_path: &Path) -> Result<bool, ProcError> {
    Ok(false)
}

/// No container: "populated" is never true, "frozen" never.
pub fn container_wait_event(
    _path: &Path,
    _key: CgroupEvent,
    want: bool,
    _deadline: Instant,
) -> Result<bool, ProcError> {
    Ok(!want)
}

/// Nothing to clear: no container kills on its own.
pub fn disarm_standing_kill(_path: &Path) -> Result<(), ProcError> {
    Ok(())
}

/// Restores SIGPIPE's default action (Rust ignores it at start).
pub fn default_sigpipe() {
    // SAFETY: setting a standard signal's disposition to SIG_DFL.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}
