//! Exits on macOS: kqueue's `EVFILT_PROC`/`NOTE_EXIT` for any process this
//! user may watch, and `waitpid` for this process's own children.
//!
//! An exit watch ([`open_exit_watch`]) registers `NOTE_EXIT` for the pid
//! first and re-checks the identity after: the process registered is the
//! recorded one, since the recorded process existed before the
//! registration and still holds the pid after it (a pid is held without a
//! break from its process's start to its exit). Unlike a Linux pidfd, the
//! watch does not pin the pid for a signal: [`signal_pidfd`] re-checks the
//! identity before its `kill` (the window is [`super::signal`]'s).
//!
//! macOS has no subreaper and no parent-death signal: those are refused.
//! The [`Reaper`] holds no children yet, since `run` and the service do not
//! spawn on macOS (their refusal is the CLI's).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::proc::{ExitStatus, Identity, Liveness, ProcError};

impl ExitStatus {
    fn from_wait(status: i32) -> Option<Self> {
        if libc::WIFEXITED(status) {
            Some(ExitStatus::Exited(libc::WEXITSTATUS(status)))
        } else if libc::WIFSIGNALED(status) {
            Some(ExitStatus::Signaled(libc::WTERMSIG(status)))
        } else {
            None
        }
    }
}

/// The children this process spawned: none on macOS yet (nothing spawns a
/// tree here), so every question is answered "not ours".
pub struct Reaper(());

static REAPER: OnceLock<Reaper> = OnceLock::new();

impl Reaper {
    pub fn install() -> Result<&'static Reaper, ProcError> {
        Ok(REAPER.get_or_init(|| Reaper(())))
    }

    pub fn installed() -> Option<&'static Reaper> {
        REAPER.get()
    }

    pub fn notify_spawned(&self, _pid: i32) {}

    pub fn wait_exit(&self, _pid: i32, _timeout: Option<Duration>) -> Option<ExitStatus> {
        None
    }

    pub fn knows(&self, _pid: i32) -> bool {
        false
    }

    pub fn wait_unclaimed(&self, _pid: i32, _timeout: Duration) -> Option<ExitStatus> {
        None
    }

    pub fn exit_of(&self, _pid: i32) -> Option<ExitStatus> {
        None
    }

    pub fn cpu_usec_of(&self, _pid: i32) -> Option<u64> {
        None
    }

    pub fn unclaimed(&self) -> Vec<(i32, ExitStatus)> {
        Vec::new()
    }
}

/// An exit watch: a kqueue with `NOTE_EXIT` registered for one verified
/// process, and that process's identity (for [`signal_pidfd`]).
#[derive(Debug)]
pub struct ExitHandle {
    kq: OwnedFd,
    id: Identity,
    exited: AtomicBool,
}

fn kqueue() -> Result<OwnedFd, ProcError> {
    // SAFETY: kqueue takes nothing and returns a new descriptor or -1.
    let fd = unsafe { libc::kqueue() };
    if fd < 0 {
        return Err(ProcError::Io(std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` is the descriptor kqueue just returned, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn exit_event(pid: i32) -> libc::kevent {
    libc::kevent {
        ident: pid as libc::uintptr_t,
        filter: libc::EVFILT_PROC,
        flags: libc::EV_ADD | libc::EV_ONESHOT,
        fflags: libc::NOTE_EXIT,
        data: 0,
        udata: std::ptr::null_mut(),
    }
}

/// Registers `NOTE_EXIT` for `pid` on `kq`; `Ok(false)`: no such process.
fn register(kq: &OwnedFd, pid: i32) -> Result<bool, ProcError> {
    let change = exit_event(pid);
    // SAFETY: `kq` is a valid kqueue; one change from a live local, no
    // event list (null with 0), no timeout wait (null: returns at once
    // with no event list to fill).
    let rc = unsafe {
        libc::kevent(
            kq.as_raw_fd(),
            &raw const change,
            1,
            std::ptr::null_mut(),
            0,
            std::ptr::null(),
        )
    };
    if rc == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::ESRCH) => Ok(false),
        _ => Err(ProcError::Io(e)),
    }
}

/// Waits up to `timeout` for events on `kq`; the pids that exited.
fn collect(kq: &OwnedFd, max: usize, timeout: Duration) -> Result<Vec<i32>, ProcError> {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: libc::c_long::from(timeout.subsec_nanos() as i32),
    };
    let mut events: Vec<libc::kevent> = (0..max.max(1)).map(|_| exit_event(0)).collect();
    // SAFETY: `kq` is a valid kqueue; no changes; `events` is writable for
    // its length; `ts` lives across the call.
    let n = unsafe {
        libc::kevent(
            kq.as_raw_fd(),
            std::ptr::null(),
            0,
            events.as_mut_ptr(),
            events.len() as libc::c_int,
            &raw const ts,
        )
    };
    if n < 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EINTR) {
            return Ok(Vec::new());
        }
        return Err(ProcError::Io(e));
    }
    Ok(events[..n as usize]
        .iter()
        .filter(|ev| ev.fflags & libc::NOTE_EXIT != 0 || ev.flags & libc::EV_EOF != 0)
        .map(|ev| ev.ident as i32)
        .collect())
}

/// Watches the process `id` names (`Ok(None)`: gone or recycled).
pub fn open_exit_watch(id: &Identity) -> Result<Option<ExitHandle>, ProcError> {
    if id.pid <= 0 {
        return Ok(None);
    }
    let kq = kqueue()?;
    if !register(&kq, id.pid)? {
        return Ok(None);
    }
    // Checked after the registration: see the module doc.
    match id.check() {
        Liveness::Same => Ok(Some(ExitHandle {
            kq,
            id: id.clone(),
            exited: AtomicBool::new(false),
        })),
        Liveness::Gone | Liveness::Recycled => Ok(None),
        Liveness::Unreadable => Err(ProcError::Proc(format!("{id} cannot be read"))),
    }
}

/// Whether the watched process has exited (its `NOTE_EXIT` arrived).
pub fn pidfd_exited(h: &ExitHandle) -> bool {
    if h.exited.load(Ordering::Relaxed) {
        return true;
    }
    let gone = match collect(&h.kq, 1, Duration::ZERO) {
        Ok(pids) => !pids.is_empty(),
        // The queue cannot be read: ask the pid instead (unknown is alive).
        Err(_) => matches!(h.id.check(), Liveness::Gone | Liveness::Recycled),
    };
    if gone {
        h.exited.store(true, Ordering::Relaxed);
    }
    gone
}

/// Signals the watched process: `Gone` once it exited, else
/// [`super::signal_process`] (its identity re-checked before the `kill`).
pub fn signal_pidfd(
    h: &ExitHandle,
    sig: crate::proc::Sig,
) -> Result<crate::proc::Delivery, ProcError> {
    if pidfd_exited(h) {
        return Ok(crate::proc::Delivery::Gone);
    }
    super::signal_process(&h.id, sig)
}

/// Waits until every process `ids` names has exited, or `deadline`
/// (one kqueue, `NOTE_EXIT` for each still there).
pub fn wait_exits(ids: &[Identity], deadline: Instant) -> Result<bool, ProcError> {
    let kq = kqueue()?;
    let mut left = std::collections::HashSet::new();
    for id in ids {
        if register(&kq, id.pid)? && id.check() == Liveness::Same {
            left.insert(id.pid);
        }
    }
    while !left.is_empty() {
        let now = Instant::now();
        if now >= deadline {
            return Ok(false);
        }
        for pid in collect(&kq, left.len(), deadline - now)? {
            left.remove(&pid);
        }
    }
    Ok(true)
}

pub(crate) fn unsupported(what: &str) -> ProcError {
    ProcError::Io(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        format!("macOS has no {what}"),
    ))
}

/// No subreaper on macOS: orphans go to launchd.
pub fn set_subreaper() -> Result<(), ProcError> {
    Err(unsupported("subreaper"))
}

/// The pid of this process's parent.
pub fn parent_pid() -> i32 {
    // SAFETY: getppid takes nothing and cannot fail.
    unsafe { libc::getppid() }
}

/// Whether this process has no child left (`proc_listchildpids`).
pub fn has_no_children() -> Result<bool, ProcError> {
    // SAFETY: a count query: null buffer and size 0.
    let n = unsafe { libc::proc_listchildpids(std::process::id() as i32, std::ptr::null_mut(), 0) };
    if n < 0 {
        return Err(ProcError::Io(std::io::Error::last_os_error()));
    }
    Ok(n == 0)
}

/// Waits for the exit of this process's child `pid` (`None` timeout:
/// forever): a bounded poll of `waitpid(WNOHANG)`, 1 ms then 10 ms apart.
pub fn reap_child(pid: i32, timeout: Option<Duration>) -> Result<Option<ExitStatus>, ProcError> {
    let started = Instant::now();
    loop {
        let mut status = 0;
        // SAFETY: `status` is a live local the call writes.
        let rc = unsafe { libc::waitpid(pid, &raw mut status, libc::WNOHANG) };
        if rc == pid {
            if let Some(s) = ExitStatus::from_wait(status) {
                return Ok(Some(s));
            }
        } else if rc < 0 {
            let e = std::io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::ECHILD) => Ok(None),
                Some(libc::EINTR) => continue,
                _ => Err(ProcError::Io(e)),
            };
        }
        let waited = started.elapsed();
        if timeout.is_some_and(|t| waited >= t) {
            return Ok(None);
        }
        let step = if waited < Duration::from_millis(50) {
            Duration::from_millis(1)
        } else {
            Duration::from_millis(10)
        };
        let step = timeout.map_or(step, |t| step.min(t.saturating_sub(waited)));
        std::thread::sleep(step);
    }
}
