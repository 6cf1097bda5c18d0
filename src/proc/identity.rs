//! Process identity: `(pid, start time in clock ticks, boot id)`.
//!
//! A bare pid names whatever process holds that number *now*; an [`Identity`]
//! names one process for the lifetime of the host. Every signal in treewarden
//! is aimed at an identity (or at a group record holding one), never at a pid.
//! This module reads `/proc/<pid>/stat` through `procfs` (comm may contain
//! spaces and parentheses; parsing it is procfs's job) and must never answer
//! "same process" for a pid that was recycled.

use std::sync::OnceLock;

use super::ProcError;

/// One process, named so that a recycled pid can never be mistaken for it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Identity {
    pub pid: i32,
    /// Field 22 of `/proc/<pid>/stat`: start time after boot in clock ticks.
    pub start_ticks: u64,
    /// `/proc/sys/kernel/random/boot_id` when the identity was read; start
    /// ticks are only comparable within one boot.
    pub boot_id: String,
}

/// What became of the process an [`Identity`] names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Liveness {
    /// The pid is held by this very process, and it is not a zombie.
    Same,
    /// The process is dead: no process has the pid, or it is this process as
    /// a zombie (dead, only its status awaits reaping; it can run no code and
    /// signals to it do nothing), or the identity is from an earlier boot and
    /// nothing holds the pid.
    Gone,
    /// The pid is held by a different process (different start time or boot).
    Recycled,
    /// `/proc` could not be read. Callers treat this as alive for owners (a
    /// missed reap is recoverable) and as "do not signal" for targets.
    Unreadable,
}

/// The fields of `/proc/<pid>/stat` (and the owner uid) that treewarden uses.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ProcStat {
    pub pid: i32,
    pub ppid: i32,
    pub pgid: i32,
    pub sid: i32,
    pub start_ticks: u64,
    /// `R`, `S`, `D`, `T`, `Z`, `X`, ...
    pub state: char,
    pub comm: String,
    /// Owner of `/proc/<pid>` (the real uid of the process).
    pub uid: u32,
}

impl ProcStat {
    /// A zombie (`Z`) or dead (`X`) process: it runs no code any more.
    pub fn is_dead(&self) -> bool {
        // The same letters as `scan::ProcEntry::is_live` (`x`: dead, on
        // kernels before 4.14).
        matches!(self.state, 'Z' | 'X' | 'x')
    }
}

impl Identity {
    /// Re-reads `/proc` and says whether the pid still holds this process.
    /// Never answers [`Liveness::Same`] for a recycled pid: both the start
    /// ticks and the boot id must match.
    pub fn check(&self) -> Liveness {
        let stat = match read_stat(self.pid) {
            Ok(Some(stat)) => stat,
            Ok(None) => return Liveness::Gone,
            Err(_) => return Liveness::Unreadable,
        };
        let boot = match boot_id() {
            Ok(b) => b,
            Err(_) => return Liveness::Unreadable,
        };
        if boot != self.boot_id || stat.start_ticks != self.start_ticks {
            return Liveness::Recycled;
        }
        if stat.is_dead() {
            Liveness::Gone
        } else {
            Liveness::Same
        }
    }
}

impl std::fmt::Display for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "pid {} (start {})", self.pid, self.start_ticks)
    }
}

static BOOT_ID: OnceLock<String> = OnceLock::new();

/// The current boot id, read once per process.
pub fn boot_id() -> Result<&'static str, ProcError> {
    if let Some(id) = BOOT_ID.get() {
        return Ok(id);
    }
    let id = procfs::sys::kernel::random::boot_id()
        .map_err(|e| ProcError::Proc(format!("boot_id: {e}")))?;
    Ok(BOOT_ID.get_or_init(|| id.trim().to_owned()))
}

/// Reads `/proc/<pid>/stat` and the owner of `/proc/<pid>` through one
/// directory handle. `Ok(None)` means no such process (including pid <= 0).
pub fn read_stat(pid: i32) -> Result<Option<ProcStat>, ProcError> {
    if pid <= 0 {
        return Ok(None);
    }
    let process = match procfs::process::Process::new(pid) {
        Ok(p) => p,
        Err(e) => return not_found_as_none(e, pid),
    };
    let stat = match process.stat() {
        Ok(s) => s,
        Err(e) => return not_found_as_none(e, pid),
    };
    let uid = match process.uid() {
        Ok(u) => u,
        Err(e) => return not_found_as_none(e, pid),
    };
    Ok(Some(ProcStat {
        pid: stat.pid,
        ppid: stat.ppid,
        pgid: stat.pgrp,
        sid: stat.session,
        start_ticks: stat.starttime,
        state: stat.state,
        comm: stat.comm,
        uid,
    }))
}

/// procfs reports a vanished process as NotFound (or, mid-exit, as an I/O
/// error with ESRCH); both mean "no such process".
fn not_found_as_none<T>(e: procfs::ProcError, pid: i32) -> Result<Option<T>, ProcError> {
    match e {
        procfs::ProcError::NotFound(_) => Ok(None),
        procfs::ProcError::Io(ref io, _) if io.raw_os_error() == Some(libc::ESRCH) => Ok(None),
        other => Err(ProcError::Proc(format!("pid {pid}: {other}"))),
    }
}

/// The identity of whatever process holds `pid` now (zombies included: a
/// zombie still owns its pid). `Ok(None)` means no such process.
pub fn identity_of(pid: i32) -> Result<Option<Identity>, ProcError> {
    let Some(stat) = read_stat(pid)? else {
        return Ok(None);
    };
    Ok(Some(Identity {
        pid,
        start_ticks: stat.start_ticks,
        boot_id: boot_id()?.to_owned(),
    }))
}

/// The identity of the calling process.
pub fn self_identity() -> Result<Identity, ProcError> {
    let pid = rustix::process::getpid().as_raw_nonzero().get();
    identity_of(pid)?.ok_or_else(|| ProcError::Proc("cannot read /proc/self/stat".into()))
}
