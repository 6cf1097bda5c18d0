//! Process identity on Windows: `(pid, creation time)`.
//!
//! The creation time is `GetProcessTimes`' FILETIME (100 ns intervals since
//! 1601, UTC): absolute, so two processes that held one pid, in this boot or
//! an earlier one, never share it. The boot id is therefore a constant: an
//! identity's start time alone tells a recycled pid, across boots too.

use std::os::windows::io::{AsRawHandle, FromRawHandle};

use windows_sys::Win32::Foundation::{FILETIME, STILL_ACTIVE};
use windows_sys::Win32::System::Threading::{
    GetExitCodeProcess, GetProcessTimes, OpenProcess, PROCESS_QUERY_LIMITED_INFORMATION,
    PROCESS_SYNCHRONIZE,
};

use super::Owned;
use crate::proc::{Identity, Liveness, ProcEntry, ProcError, ProcStat};

impl Identity {
    /// Re-opens the pid and says whether it still holds this process.
    pub fn check(&self) -> Liveness {
        match open_times(self.pid) {
            Ok(None) => Liveness::Gone,
            Err(_) => Liveness::Unreadable,
            Ok(Some(t)) if t.created != self.start_ticks || self.boot_id != BOOT_ID => {
                Liveness::Recycled
            }
            Ok(Some(t)) if !t.running => Liveness::Gone,
            Ok(Some(_)) => Liveness::Same,
        }
    }
}

impl std::fmt::Display for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "pid {} (created {})", self.pid, self.start_ticks)
    }
}

const BOOT_ID: &str = "windows-filetime";

/// The boot id: a constant, since creation times are absolute.
pub fn boot_id() -> Result<&'static str, ProcError> {
    Ok(BOOT_ID)
}

/// Creation time and whether the process still runs.
pub(crate) struct Times {
    pub created: u64,
    pub running: bool,
}

/// Opens `pid` with `access` (`Ok(None)`: no such process).
pub(crate) fn open(pid: i32, access: u32) -> Result<Option<Owned>, ProcError> {
    if pid <= 0 {
        return Ok(None);
    }
    // SAFETY: OpenProcess takes plain values and returns a new handle or null.
    let h = unsafe { OpenProcess(access, 0, pid as u32) };
    if h.is_null() {
        let e = super::last_error();
        // ERROR_INVALID_PARAMETER: no process has this pid.
        return match e.raw_os_error() {
            Some(87) => Ok(None),
            _ => Err(ProcError::Io(e)),
        };
    }
    // SAFETY: `h` is a handle OpenProcess just returned, owned by nobody else.
    Ok(Some(unsafe { Owned::from_raw_handle(h) }))
}

/// `GetProcessTimes` of the process `h` names, in 100 ns units: its
/// creation (FILETIME), exit, kernel and user times.
pub(crate) fn process_times(h: &Owned) -> Result<[u64; 4], ProcError> {
    let zero = FILETIME {
        dwLowDateTime: 0,
        dwHighDateTime: 0,
    };
    let (mut c, mut e, mut k, mut u) = (zero, zero, zero, zero);
    // SAFETY: `h` is a valid process handle; the four out-pointers are
    // FILETIMEs on this stack frame.
    let ok = unsafe { GetProcessTimes(h.as_raw_handle(), &mut c, &mut e, &mut k, &mut u) };
    super::check_bool(ok)?;
    Ok([c, e, k, u].map(filetime))
}

/// The creation time of the process `h` names and whether it still runs.
pub(crate) fn times_of(h: &Owned) -> Result<Times, ProcError> {
    let [created, ..] = process_times(h)?;
    let mut code = 0u32;
    // SAFETY: `h` is a valid process handle; `code` is a u32 on this frame.
    let ok = unsafe { GetExitCodeProcess(h.as_raw_handle(), &mut code) };
    super::check_bool(ok)?;
    Ok(Times {
        created,
        running: code == STILL_ACTIVE as u32,
    })
}

fn filetime(t: FILETIME) -> u64 {
    (u64::from(t.dwHighDateTime) << 32) | u64::from(t.dwLowDateTime)
}

fn open_times(pid: i32) -> Result<Option<Times>, ProcError> {
    match open(pid, PROCESS_QUERY_LIMITED_INFORMATION | PROCESS_SYNCHRONIZE)? {
        Some(h) => times_of(&h).map(Some),
        None => Ok(None),
    }
}

/// The process holding `pid` now. `Ok(None)`: no such process.
pub fn read_stat(pid: i32) -> Result<Option<ProcStat>, ProcError> {
    let Some(t) = open_times(pid)? else {
        return Ok(None);
    };
    let (ppid, comm) = super::misc::toolhelp_entry(pid).unwrap_or((0, String::new()));
    Ok(Some(ProcStat {
        // Windows cannot tell a process's console group: 0, but for a root
        // this process spawned (whose group it made). `R` running, `Z`
        // exited (its object kept alive by a handle).
        entry: ProcEntry {
            pid,
            ppid,
            pgid: super::reaper::group_of(pid).unwrap_or(0),
            sid: 0,
            start_ticks: t.created,
            state: if t.running { 'R' } else { 'Z' },
            comm,
            rss_bytes: 0,
            start_stack: 0,
        },
        uid: 0,
    }))
}

/// The identity of whatever holds `pid` now.
pub fn identity_of(pid: i32) -> Result<Option<Identity>, ProcError> {
    Ok(open_times(pid)?.map(|t| Identity {
        pid,
        start_ticks: t.created,
        boot_id: BOOT_ID.to_owned(),
    }))
}

/// The identity of the calling process.
pub fn self_identity() -> Result<Identity, ProcError> {
    identity_of(std::process::id() as i32)?
        .ok_or_else(|| ProcError::Proc("cannot open this process".into()))
}
