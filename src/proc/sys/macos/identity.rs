//! Process identity on macOS: `(pid, start time)`, read with libproc's
//! `proc_pidinfo(PROC_PIDTBSDINFO)`, and the process listings
//! (`proc_listallpids`, `proc_listpgrppids`) over the same read.
//!
//! The start time is the kernel's `p_start` (`pbi_start_tvsec` and
//! `pbi_start_tvusec`), taken here in microseconds since the epoch: an
//! absolute time, so two processes that held one pid, in this boot or an
//! earlier one, never share it, and the boot id is a constant (as on
//! Windows). macOS has no `/proc`; nothing here reads one.

use std::ffi::{c_int, c_void};

use crate::proc::stat::ProcEntry;
use crate::proc::{Identity, Liveness, ProcError, ProcStat};

impl Identity {
    /// Re-reads the pid and says whether it still holds this process. Never
    /// answers [`Liveness::Same`] for a recycled pid: the start time must match.
    pub fn check(&self) -> Liveness {
        match read_stat(self.pid) {
            Ok(None) => Liveness::Gone,
            Err(_) => Liveness::Unreadable,
            Ok(Some(s)) if s.start_ticks != self.start_ticks || self.boot_id != BOOT_ID => {
                Liveness::Recycled
            }
            Ok(Some(s)) if s.is_dead() => Liveness::Gone,
            Ok(Some(_)) => Liveness::Same,
        }
    }
}

impl std::fmt::Display for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "pid {} (start {} µs)", self.pid, self.start_ticks)
    }
}

const BOOT_ID: &str = "macos-start-usec";

/// The boot id: a constant, since start times are absolute.
pub fn boot_id() -> Result<&'static str, ProcError> {
    Ok(BOOT_ID)
}

/// The kernel's `proc_bsdinfo` of `pid` (`Ok(None)`: no such process).
/// Zombies are found too (the non-zero `arg`), their status `SZOMB`.
pub(crate) fn bsdinfo(pid: i32) -> Result<Option<libc::proc_bsdinfo>, ProcError> {
    if pid <= 0 {
        return Ok(None);
    }
    // SAFETY: `proc_bsdinfo` is a plain C struct of integers and arrays of
    // integers, for which all-zero is a valid value.
    let mut info: libc::proc_bsdinfo = unsafe { std::mem::zeroed() };
    let size = std::mem::size_of::<libc::proc_bsdinfo>() as c_int;
    // SAFETY: the buffer is `info`, writable and exactly `size` bytes long;
    // the call writes at most `size` bytes into it.
    let n = unsafe {
        libc::proc_pidinfo(
            pid,
            libc::PROC_PIDTBSDINFO,
            1,
            (&raw mut info).cast::<c_void>(),
            size,
        )
    };
    if n == size {
        return Ok(Some(info));
    }
    if n > 0 {
        // Unknown is not gone: a short answer says nothing of the process.
        return Err(ProcError::Proc(format!(
            "pid {pid}: proc_pidinfo returned {n} of {size} bytes"
        )));
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::ESRCH) => Ok(None),
        _ => Err(ProcError::Io(e)),
    }
}

fn start_usec(info: &libc::proc_bsdinfo) -> u64 {
    info.pbi_start_tvsec
        .saturating_mul(1_000_000)
        .saturating_add(info.pbi_start_tvusec)
}

fn cstr(raw: &[libc::c_char]) -> String {
    let bytes: Vec<u8> = raw
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The state letter of a `p_stat` (as Linux's `/proc/<pid>/stat` spells them).
fn state_of(status: u32) -> char {
    match status {
        libc::SZOMB => 'Z',
        libc::SSTOP => 'T',
        libc::SRUN | libc::SIDL => 'R',
        _ => 'S',
    }
}

/// One process as the shared code models it.
pub(crate) fn entry_of(pid: i32, info: &libc::proc_bsdinfo) -> ProcEntry {
    let name = cstr(&info.pbi_name);
    // SAFETY: getsid takes a plain pid and returns -1 (errno) on failure.
    let sid = unsafe { libc::getsid(pid) };
    ProcEntry {
        pid,
        ppid: info.pbi_ppid as i32,
        pgid: info.pbi_pgid as i32,
        sid: sid.max(0),
        start_ticks: start_usec(info),
        state: state_of(info.pbi_status),
        comm: if name.is_empty() {
            cstr(&info.pbi_comm)
        } else {
            name
        },
        rss_bytes: 0,
        // Not read on macOS: an exec is told by its name only.
        start_stack: 0,
    }
}

/// The process holding `pid` now. `Ok(None)`: no such process.
pub fn read_stat(pid: i32) -> Result<Option<ProcStat>, ProcError> {
    Ok(bsdinfo(pid)?.map(|info| ProcStat {
        entry: entry_of(pid, &info),
        uid: info.pbi_ruid,
    }))
}

/// One process's entry, read now (`None`: gone or unreadable).
pub fn read_entry(pid: i32) -> Option<ProcEntry> {
    bsdinfo(pid).ok().flatten().map(|i| entry_of(pid, &i))
}

/// The identity of whatever holds `pid` now.
pub fn identity_of(pid: i32) -> Result<Option<Identity>, ProcError> {
    Ok(bsdinfo(pid)?.map(|info| Identity {
        pid,
        start_ticks: start_usec(&info),
        boot_id: BOOT_ID.to_owned(),
    }))
}

/// The identity of the calling process.
pub fn self_identity() -> Result<Identity, ProcError> {
    identity_of(std::process::id() as i32)?
        .ok_or_else(|| ProcError::Proc("cannot read this process".into()))
}

/// Which pids a listing asks libproc for.
#[derive(Clone, Copy)]
pub(crate) enum Listing {
    All,
    Group(i32),
}

/// The pids libproc lists (every process, or one process group's), grown
/// until the answer fits (a full buffer may have cut the list short).
pub(crate) fn list_pids(which: Listing) -> Result<Vec<i32>, ProcError> {
    let call = |buf: *mut c_void, bytes: c_int| match which {
        // SAFETY: `buf` is null with `bytes` 0 (a count query) or a
        // writable buffer of `bytes` bytes; the call writes within it.
        Listing::All => unsafe { libc::proc_listallpids(buf, bytes) },
        // SAFETY: as above.
        Listing::Group(pgid) => unsafe { libc::proc_listpgrppids(pgid, buf, bytes) },
    };
    let mut cap = call(std::ptr::null_mut(), 0).max(0) as usize + 64;
    for _ in 0..8 {
        let mut pids = vec![0i32; cap];
        let bytes = c_int::try_from(cap * std::mem::size_of::<i32>())
            .map_err(|_| ProcError::Proc("process list too long".into()))?;
        let n = call(pids.as_mut_ptr().cast::<c_void>(), bytes);
        if n < 0 {
            return Err(ProcError::Io(std::io::Error::last_os_error()));
        }
        let n = n as usize;
        if n < cap {
            pids.truncate(n);
            pids.retain(|&p| p > 0);
            return Ok(pids);
        }
        cap *= 2;
    }
    Err(ProcError::Proc("the process list kept growing".into()))
}

/// Every process (or only `only`), read now; incomplete when the listing
/// or a read failed for another reason than the process's absence.
pub fn snapshot_entries(only: Option<&[i32]>) -> (Vec<ProcEntry>, Option<String>) {
    let pids = match only {
        Some(p) => p.to_vec(),
        None => match list_pids(Listing::All) {
            Ok(p) => p,
            Err(e) => return (Vec::new(), Some(format!("listing processes: {e}"))),
        },
    };
    let mut out = Vec::with_capacity(pids.len());
    let mut incomplete = None;
    for pid in pids {
        match bsdinfo(pid) {
            Ok(Some(info)) => out.push(entry_of(pid, &info)),
            Ok(None) => {}
            // EPERM: another user's process is not ours to read; it is
            // nobody's member here (a tree's members are its owner's).
            Err(ProcError::Io(e)) if e.raw_os_error() == Some(libc::EPERM) => {}
            Err(e) => {
                incomplete.get_or_insert(format!("pid {pid}: {e}"));
            }
        }
    }
    (out, incomplete)
}

/// The live processes whose process group is `pgid` (`proc_listpgrppids`).
pub fn group_members(pgid: i32) -> Result<Vec<ProcEntry>, ProcError> {
    let mut out = Vec::new();
    for pid in list_pids(Listing::Group(pgid))? {
        if let Some(info) = bsdinfo(pid)? {
            let e = entry_of(pid, &info);
            if e.pgid == pgid && e.is_live() {
                out.push(e);
            }
        }
    }
    Ok(out)
}

/// The first of `pids` alive and in process group `pgid`, read now.
pub fn first_live_in_group(pids: impl IntoIterator<Item = i32>, pgid: i32) -> Option<ProcEntry> {
    pids.into_iter()
        .filter_map(read_entry)
        .find(|e| e.pgid == pgid && e.is_live())
}

/// A process's path and name (`proc_pidpath`, and its name): its argv lives
/// in `KERN_PROCARGS2`, not read here.
pub fn details_of(pid: i32) -> (Option<String>, Vec<String>) {
    let mut buf = vec![0u8; libc::PROC_PIDPATHINFO_MAXSIZE as usize];
    // SAFETY: `buf` is writable and exactly as long as the size passed.
    let n = unsafe { libc::proc_pidpath(pid, buf.as_mut_ptr().cast::<c_void>(), buf.len() as u32) };
    let exe = (n > 0).then(|| String::from_utf8_lossy(&buf[..n as usize]).into_owned());
    let name = read_entry(pid).map(|e| e.comm);
    (exe, name.into_iter().collect())
}
