//! The rest of the shared process interface on Windows: process listings
//! (toolhelp snapshots), exit handles, the host probe, resources from the
//! job's accounting, and honest refusals for what Windows has not (a user
//! database of uids, a pseudo-terminal, the proc connector, descriptors by
//! number).

use std::os::windows::io::{AsRawHandle, FromRawHandle};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use windows_sys::Win32::Foundation::{INVALID_HANDLE_VALUE, WAIT_OBJECT_0};
use windows_sys::Win32::System::Diagnostics::ToolHelp::{
    CreateToolhelp32Snapshot, PROCESSENTRY32W, Process32FirstW, Process32NextW, TH32CS_SNAPPROCESS,
};
use windows_sys::Win32::System::Threading::{
    PROCESS_QUERY_LIMITED_INFORMATION, PROCESS_SYNCHRONIZE, WaitForSingleObject,
};

use super::identity::{boot_id, open, times_of};
use super::reaper::unsupported;
use super::{Credentials, Owned, job};
use crate::proc::ProcEntry;
use crate::proc::{
    Capability, ContainerUsage, Identity, Layout, LayoutReport, ProcError, UserInfo,
};

/// How the teardown records its container kill: `TerminateJobObject` of
/// the tree's job (the database refuses the row without its authorization,
/// migration 0008).
pub const CONTAINER_KILL: (&str, crate::proc::BoundaryKind) =
    ("TERMINATE_JOB", crate::proc::BoundaryKind::Job);

/// The tree flag recorded, before the root runs, for a boundary whose
/// container kills its members when the owner's handle closes.
pub const STANDING_KILL_FLAG: Option<&str> = Some(job::KILL_ON_CLOSE_FLAG);

/// Every process: (pid, parent pid, exe name), one toolhelp snapshot.
pub(crate) fn toolhelp() -> Result<Vec<(i32, i32, String)>, ProcError> {
    // SAFETY: plain flags; returns a new snapshot handle or INVALID_HANDLE_VALUE.
    let snap = unsafe { CreateToolhelp32Snapshot(TH32CS_SNAPPROCESS, 0) };
    if snap == INVALID_HANDLE_VALUE {
        return Err(ProcError::Io(super::last_error()));
    }
    // SAFETY: `snap` is the valid handle just returned, owned here.
    let snap = unsafe { Owned::from_raw_handle(snap) };
    // SAFETY: a plain C struct of integers and a u16 array; all-zero is valid.
    let mut pe: PROCESSENTRY32W = unsafe { std::mem::zeroed() };
    pe.dwSize = std::mem::size_of::<PROCESSENTRY32W>() as u32;
    let mut out = Vec::new();
    // SAFETY: `snap` is a valid snapshot; `pe` has its dwSize set.
    let mut ok = unsafe { Process32FirstW(snap.as_raw_handle(), &mut pe) };
    while ok != 0 {
        let len = pe
            .szExeFile
            .iter()
            .position(|&c| c == 0)
            .unwrap_or(pe.szExeFile.len());
        out.push((
            pe.th32ProcessID as i32,
            pe.th32ParentProcessID as i32,
            String::from_utf16_lossy(&pe.szExeFile[..len]),
        ));
        // SAFETY: as for Process32FirstW.
        ok = unsafe { Process32NextW(snap.as_raw_handle(), &mut pe) };
    }
    Ok(out)
}

/// (parent pid, exe name) of `pid` from a snapshot.
pub(crate) fn toolhelp_entry(pid: i32) -> Option<(i32, String)> {
    toolhelp()
        .ok()?
        .into_iter()
        .find(|(p, _, _)| *p == pid)
        .map(|(_, ppid, name)| (ppid, name))
}

fn entry(pid: i32, ppid: i32, comm: String) -> Result<Option<ProcEntry>, ProcError> {
    let Some(h) = open(pid, PROCESS_QUERY_LIMITED_INFORMATION | PROCESS_SYNCHRONIZE)? else {
        return Ok(None);
    };
    let t = times_of(&h)?;
    let group = super::reaper::group_of(pid).unwrap_or(0);
    Ok(Some(ProcEntry {
        pid,
        ppid,
        pgid: group,
        sid: group,
        start_ticks: t.created,
        state: if t.running { 'R' } else { 'Z' },
        comm,
        rss_bytes: 0,
        // No stack address to read here: an exec is told by the image name.
        start_stack: 0,
    }))
}

/// Every process this user may open (a process that cannot be opened, a
/// system one, is skipped: it is nobody's member). Incomplete when the
/// snapshot itself fails.
pub fn snapshot_entries(only: Option<&[i32]>) -> (Vec<ProcEntry>, Option<String>) {
    let list = match toolhelp() {
        Ok(l) => l,
        Err(e) => return (Vec::new(), Some(format!("process snapshot: {e}"))),
    };
    let mut out = Vec::new();
    for (pid, ppid, comm) in list {
        if only.is_some_and(|o| !o.contains(&pid)) || pid <= 4 {
            continue;
        }
        if let Ok(Some(e)) = entry(pid, ppid, comm) {
            out.push(e);
        }
    }
    (out, None)
}

/// A process's forensic details: its exe name only (Windows keeps no argv
/// that another process can read without its memory).
pub fn details_of(pid: i32) -> (Option<String>, Vec<String>) {
    match toolhelp_entry(pid) {
        Some((_, name)) => (Some(name.clone()), vec![name]),
        None => (None, Vec::new()),
    }
}

/// The handle an exit watch holds: the process itself.
pub type ExitHandle = Owned;

/// Opens the process `id` names (`Ok(None)`: gone or recycled).
pub fn open_exit_watch(id: &Identity) -> Result<Option<ExitHandle>, ProcError> {
    let Some(h) = open(
        id.pid,
        PROCESS_QUERY_LIMITED_INFORMATION | PROCESS_SYNCHRONIZE,
    )?
    else {
        return Ok(None);
    };
    let t = times_of(&h)?;
    if t.created != id.start_ticks || boot_id()? != id.boot_id || !t.running {
        return Ok(None);
    }
    Ok(Some(h))
}

/// Waits until every process `ids` names has exited, or `deadline`.
pub fn wait_exits(ids: &[Identity], deadline: Instant) -> Result<bool, ProcError> {
    for id in ids {
        let Some(h) = open_exit_watch(id)? else {
            continue;
        };
        let left = deadline.saturating_duration_since(Instant::now());
        let ms = left.as_millis().min(u128::from(u32::MAX - 1)) as u32;
        // SAFETY: `h` is a valid process handle with SYNCHRONIZE.
        if unsafe { WaitForSingleObject(h.as_raw_handle(), ms) } != WAIT_OBJECT_0 {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Whether the held process has exited.
pub fn pidfd_exited(h: &ExitHandle) -> bool {
    // SAFETY: `h` is a valid process handle with SYNCHRONIZE.
    unsafe { WaitForSingleObject(h.as_raw_handle(), 0) == WAIT_OBJECT_0 }
}

/// No signal reaches a held process on Windows but through the job.
pub fn signal_pidfd(
    h: &ExitHandle,
    _sig: crate::proc::Sig,
) -> Result<crate::proc::Delivery, ProcError> {
    if pidfd_exited(h) {
        return Ok(crate::proc::Delivery::Gone);
    }
    Err(unsupported(
        "signal for a held process (the job's terminate reaches it)",
    ))
}

pub fn user_by_name(_name: &str) -> std::io::Result<Option<UserInfo>> {
    Ok(None)
}
pub fn user_by_uid(_uid: u32) -> std::io::Result<Option<UserInfo>> {
    Ok(None)
}
pub fn group_by_name(_name: &str) -> std::io::Result<Option<u32>> {
    Ok(None)
}
pub fn groups_of(_user: &UserInfo, gid: u32) -> std::io::Result<Vec<u32>> {
    Ok(vec![gid])
}
pub fn credentials_for(uid: u32, gid: u32) -> std::io::Result<Credentials> {
    Ok(Credentials {
        uid,
        gid,
        groups: vec![gid],
    })
}
pub fn credentials_of_peer(_pid: Option<i32>, uid: u32, gid: u32) -> Credentials {
    Credentials {
        uid,
        gid,
        groups: vec![gid],
    }
}
/// Windows has no uid: 0 stands for "this user" in the shared records.
pub fn current_uid() -> u32 {
    0
}
pub fn effective_uid() -> u32 {
    0
}
/// Windows keeps no audit login uid.
pub fn login_uid() -> Option<u32> {
    None
}

/// What the host offers for custody on Windows.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Probe {
    pub kernel_release: String,
    pub boot_id: Option<String>,
    /// A Job Object can be made, limited and queried here.
    pub job_object: Capability,
    /// A job refuses `CREATE_BREAKAWAY_FROM_JOB` (no `BREAKAWAY_OK` set).
    pub breakaway_refused: Capability,
    pub auto_boundary: crate::proc::BoundaryKind,
    pub auto_reason: String,
}

/// Probes the host by making a job (and closing it at once: it holds no
/// process).
pub fn probe(_cgroup_root_override: Option<&Path>) -> Probe {
    let name = format!("tw-probe-{}", std::process::id());
    let path = PathBuf::from(format!("{}{name}", job::JOB_PREFIX));
    let job_object = match job::create(&name, job::JobLimits::default())
        .and_then(|j| job::armed(&j).map(|a| (j, a)))
    {
        Ok((j, armed)) => {
            let n = job::accounting(&j).map(|a| a.active).unwrap_or(0);
            drop(j);
            job::forget(&path);
            Capability::yes(format!(
                "job object made with KILL_ON_JOB_CLOSE (reads back {}), {n} active",
                if armed {
                    "set"
                } else {
                    "unset: this host does not report job limits"
                }
            ))
        }
        Err(e) => Capability::no(format!("cannot make a job object: {e}")),
    };
    Probe {
        kernel_release: format!("Windows ({})", std::env::consts::ARCH),
        boot_id: boot_id().ok().map(str::to_owned),
        breakaway_refused: Capability::yes(
            "jobs are made without JOB_OBJECT_LIMIT_BREAKAWAY_OK: CREATE_BREAKAWAY_FROM_JOB is refused",
        ),
        job_object,
        auto_boundary: crate::proc::BoundaryKind::Job,
        auto_reason: "every tree gets its own job object".into(),
    }
}

/// The job's CPU time and process count (`None`s when it is gone).
pub fn container_usage(dir: &Path) -> ContainerUsage {
    match job::open(dir)
        .ok()
        .flatten()
        .and_then(|j| job::accounting(&j).ok())
    {
        Some(a) => ContainerUsage {
            cpu_usec: Some(a.cpu_100ns / 10),
            pids_peak: Some(u64::from(a.total_processes)),
            ..ContainerUsage::default()
        },
        None => ContainerUsage::default(),
    }
}

/// What a job can limit, in the shared controller names.
pub fn cgroup_controllers(_dir: &Path) -> Result<Vec<String>, ProcError> {
    Ok(vec!["memory".into(), "pids".into(), "cpu".into()])
}

impl std::fmt::Display for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("job objects")
    }
}

pub fn layout(_root: &Path) -> LayoutReport {
    LayoutReport {
        layout: Layout::Root,
        limits: true,
        note: "each tree's job object carries its limits".into(),
        supervisor: None,
    }
}

pub fn check_limits_possible(_root: &Path) -> Result<(), String> {
    Ok(())
}

/// Descriptors by number do not exist on Windows.
pub fn take_inherited_fd(n: i32) -> Result<std::fs::File, String> {
    Err(format!(
        "descriptor {n}: handing over descriptors by number is not supported on Windows"
    ))
}

/// No descriptor limit to read or raise on Windows.
pub fn nofile_soft_limit() -> Option<u64> {
    None
}
pub fn raise_nofile_soft_limit() -> Option<u64> {
    None
}

type CtrlCallback = Box<dyn Fn(i32) + Send + Sync>;

/// The callback the console control handler calls (one at a time).
static CTRL: std::sync::Mutex<Option<CtrlCallback>> = std::sync::Mutex::new(None);

/// Whether the work the handler's callback started is over ([`CtrlForward::close`]):
/// what a `CTRL_CLOSE_EVENT` waits for.
static DONE: (std::sync::Mutex<bool>, std::sync::Condvar) =
    (std::sync::Mutex::new(false), std::sync::Condvar::new());

/// How long the close handler waits for [`CtrlForward::close`]. Windows
/// ends the process ~5 s after a console closes whatever the handler does;
/// the bound only keeps a handler from waiting for good where it does not.
const CLOSE_WAIT: Duration = Duration::from_secs(30);

unsafe extern "system" fn on_ctrl(kind: u32) -> windows_sys::core::BOOL {
    use windows_sys::Win32::System::Console::{CTRL_BREAK_EVENT, CTRL_C_EVENT, CTRL_CLOSE_EVENT};
    let sig = match kind {
        CTRL_C_EVENT => 2,
        CTRL_BREAK_EVENT => 15,
        CTRL_CLOSE_EVENT => 1,
        _ => return 0,
    };
    let handled = match CTRL.lock() {
        Ok(g) => match g.as_ref() {
            Some(f) => {
                f(sig);
                true
            }
            None => false,
        },
        Err(_) => false,
    };
    // A closed console ends the process as soon as this handler returns:
    // wait (outside the callback's lock) until the teardown the callback
    // started is done, or this process exits under it.
    if handled && kind == CTRL_CLOSE_EVENT {
        wait_done(CLOSE_WAIT);
    }
    handled.into()
}

/// Waits until [`CtrlForward::close`] says the work is over, or `wait`.
fn wait_done(wait: Duration) {
    let (lock, cv) = &DONE;
    if let Ok(g) = lock.lock() {
        let _ = cv.wait_timeout_while(g, wait, |done| !*done);
    }
}

fn set_done(v: bool) {
    let (lock, cv) = &DONE;
    if let Ok(mut g) = lock.lock() {
        *g = v;
    }
    cv.notify_all();
}

/// The console control handler registered by [`forward_console_ctrl`];
/// [`CtrlForward::close`] removes it.
pub struct CtrlForward(());

impl CtrlForward {
    /// Also ends a `CTRL_CLOSE_EVENT` handler's wait: call it once what the
    /// event started (the teardown) is over.
    pub fn close(&self) {
        if let Ok(mut g) = CTRL.lock() {
            *g = None;
        }
        set_done(true);
        // SAFETY: removes the handler this module registered.
        unsafe {
            windows_sys::Win32::System::Console::SetConsoleCtrlHandler(Some(on_ctrl), 0);
        }
    }
}

/// Calls `f` with 2 (Ctrl+C), 15 (Ctrl+Break) or 1 (console closed) when
/// the console sends this process a control event.
///
/// On a console close the handler returns only after [`CtrlForward::close`]
/// (Windows ends the process when it returns, and gives it ~5 s): so `run`
/// tears its tree down first. A handler never closed (`kill`, `sweep`)
/// waits until the process exits under it.
pub fn forward_console_ctrl(f: CtrlCallback) -> Result<CtrlForward, ProcError> {
    if let Ok(mut g) = CTRL.lock() {
        *g = Some(f);
    }
    set_done(false);
    // SAFETY: `on_ctrl` is a plain `extern "system"` function that lives
    // for the whole program.
    let ok =
        unsafe { windows_sys::Win32::System::Console::SetConsoleCtrlHandler(Some(on_ctrl), 1) };
    super::check_bool(ok)?;
    Ok(CtrlForward(()))
}

/// Whether `held` is the file at `path` now: the same volume serial and
/// file index (`GetFileInformationByHandle`), as a device and inode compare
/// on Unix. A path that cannot be opened (gone, or delete-pending) is not.
pub fn same_file(held: &std::fs::File, path: &Path) -> bool {
    fn id(f: &std::fs::File) -> Option<(u32, u64)> {
        use windows_sys::Win32::Storage::FileSystem::{
            BY_HANDLE_FILE_INFORMATION, GetFileInformationByHandle,
        };
        // SAFETY: a plain C struct of integers for which all-zero is valid.
        let mut info: BY_HANDLE_FILE_INFORMATION = unsafe { std::mem::zeroed() };
        // SAFETY: `f` is an open file, its handle valid while it lives; the
        // struct is writable and of the type the call fills.
        let ok = unsafe { GetFileInformationByHandle(f.as_raw_handle(), &raw mut info) };
        (ok != 0).then(|| {
            (
                info.dwVolumeSerialNumber,
                (u64::from(info.nFileIndexHigh) << 32) | u64::from(info.nFileIndexLow),
            )
        })
    }
    let Ok(named) = std::fs::File::open(path) else {
        return false;
    };
    matches!((id(held), id(&named)), (Some(a), Some(b)) if a == b)
}

/// Fills `buf` from the system's preferred random generator
/// (`BCryptGenRandom`): the service's API tokens.
pub fn fill_random(buf: &mut [u8]) -> std::io::Result<()> {
    use windows_sys::Win32::Security::Cryptography::{
        BCRYPT_USE_SYSTEM_PREFERRED_RNG, BCryptGenRandom,
    };
    for chunk in buf.chunks_mut(u32::MAX as usize) {
        // SAFETY: no algorithm handle with the system-preferred flag; the
        // buffer is writable for the length given.
        let status = unsafe {
            BCryptGenRandom(
                std::ptr::null_mut(),
                chunk.as_mut_ptr(),
                chunk.len() as u32,
                BCRYPT_USE_SYSTEM_PREFERRED_RNG,
            )
        };
        if status != 0 {
            return Err(std::io::Error::other(format!(
                "BCryptGenRandom failed: NTSTATUS {status:#x}"
            )));
        }
    }
    Ok(())
}

/// Bytes free to this user on the volume of `dir` (`GetDiskFreeSpaceExW`;
/// `None` where it cannot be read).
pub fn free_bytes(dir: &Path) -> Option<u64> {
    use windows_sys::Win32::Storage::FileSystem::GetDiskFreeSpaceExW;
    let path = super::wide(&dir.to_string_lossy());
    let mut free = 0u64;
    // SAFETY: `path` is NUL-terminated UTF-16 living across the call;
    // `free` is a u64 on this frame; the other outputs may be null.
    let ok = unsafe {
        GetDiskFreeSpaceExW(
            path.as_ptr(),
            &mut free,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
    };
    (ok != 0).then_some(free)
}

/// File modes are Unix's: nothing to set here (the data dir's ACL, the
/// user's own, is what keeps the ledger's files private).
pub fn file_mode(o: &mut std::fs::OpenOptions, _mode: u32) -> &mut std::fs::OpenOptions {
    o
}

/// Directory modes are Unix's: nothing to set here.
pub fn dir_mode(b: &mut std::fs::DirBuilder, _mode: u32) -> &mut std::fs::DirBuilder {
    b
}

/// Bytes free to an unprivileged writer on the volume of `dir`, and its
/// size: none known here (`u64::MAX`: the floor as configured).
pub fn disk_space(dir: &Path) -> Option<(u64, u64)> {
    free_bytes(dir).map(|free| (free, u64::MAX))
}

/// This host's name (`COMPUTERNAME`).
pub fn host_name() -> String {
    std::env::var("COMPUTERNAME").unwrap_or_else(|_| "localhost".into())
}

/// Writes all of `buf` at `offset` of `file`: positioned writes until all
/// is written.
pub fn write_all_at(file: &std::fs::File, buf: &[u8], offset: u64) -> std::io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let n =
            std::os::windows::fs::FileExt::seek_write(file, &buf[done..], offset + done as u64)?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        done += n;
    }
    Ok(())
}

/// Takes `file`'s exclusive lock, waiting for it (`LockFileEx`, std's).
pub fn lock_exclusive(file: &std::fs::File) -> std::io::Result<()> {
    file.lock()
}

/// The pids in the tree's job (empty when it is gone).
pub fn member_pids(job: &Path) -> Result<std::collections::HashSet<i32>, String> {
    super::container_pids(job)
        .map(|p| p.into_iter().collect())
        .map_err(|e| format!("{}: {e}", job.display()))
}

/// What Windows shows of a process's command line from outside: its image
/// name (its argv lives in its own memory).
pub fn cmdline(pid: i32) -> Vec<String> {
    details_of(pid).1
}

/// The forensic details of one process that can be read here.
pub fn details(pid: i32) -> crate::proc::MemberDetails {
    let (exe, cmdline) = super::details_of(pid);
    crate::proc::MemberDetails {
        exe,
        cmdline,
        ..crate::proc::MemberDetails::default()
    }
}

/// One process, read now.
pub fn read_entry(pid: i32) -> Option<crate::proc::ProcEntry> {
    snapshot_entries(Some(&[pid])).0.pop()
}

/// Whether a process's group and session can be read from outside: no, a
/// console process group cannot (an entry says pgid 0 and sid 0; the job,
/// not the group, holds the tree).
pub const GROUPS_READABLE: bool = false;
/// Whether a member's details carry the lineage they were read with: no,
/// they are its image name and nothing more.
pub const LINEAGE_IN_DETAILS: bool = false;
/// Whether `run` and `serve` spawn trees here: yes.
pub const SPAWNS_TREES: bool = true;
