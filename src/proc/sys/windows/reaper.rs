//! Exits on Windows: the handles of the roots this process spawned.
//!
//! Windows has no reaping and no subreaper: a process's exit code lives in
//! its object for as long as a handle to it is open. The [`Reaper`] keeps
//! the handle of every root this process spawned (from its creation, so the
//! code cannot be lost) and answers the same questions as the Linux reaper:
//! the root's status (waited for), the statuses nobody claimed yet, its CPU.
//! Members that are not our children have no status we can read after they
//! are gone (Windows keeps none): their exits are recorded without one.

use std::collections::HashMap;
use std::os::windows::io::AsRawHandle;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use windows_sys::Win32::Foundation::{STILL_ACTIVE, WAIT_OBJECT_0};
use windows_sys::Win32::System::Threading::{GetExitCodeProcess, WaitForSingleObject};

use super::Owned;
use crate::proc::{ExitCallback, ExitStatus, ProcError};

struct Child {
    handle: std::sync::Arc<Owned>,
    claimed: bool,
    /// The wait that calls [`Reaper::on_exit`]'s callback, while registered.
    on_exit: Option<super::watch::Wait>,
}

/// The roots this process spawned, by pid.
pub struct Reaper {
    children: Mutex<HashMap<i32, Child>>,
}

static REAPER: OnceLock<Reaper> = OnceLock::new();

impl Reaper {
    /// The process-wide table (no thread: exits are read from handles).
    pub fn install() -> Result<&'static Reaper, ProcError> {
        Ok(REAPER.get_or_init(|| Reaper {
            children: Mutex::new(HashMap::new()),
        }))
    }

    pub fn installed() -> Option<&'static Reaper> {
        REAPER.get()
    }

    /// Keeps `handle` of the spawned `pid` (its console group is its pid).
    pub(crate) fn keep(&self, pid: i32, handle: std::sync::Arc<Owned>) {
        self.lock().insert(
            pid,
            Child {
                handle,
                claimed: false,
                on_exit: None,
            },
        );
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<i32, Child>> {
        self.children.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn handle(&self, pid: i32) -> Option<std::sync::Arc<Owned>> {
        self.lock().get(&pid).map(|c| c.handle.clone())
    }

    /// Nothing to do on Windows (kept for the shared interface).
    pub fn notify_spawned(&self, _pid: i32) {}

    /// Calls `f` with the exit of `pid`, a root this process spawned, once
    /// it exits — at once when it has already. The handle kept since its
    /// creation is what is waited for (a thread-pool wait, no thread of its
    /// own), so the pid cannot name another process meanwhile: Windows
    /// does not reuse a pid while a handle to its process is open. The exit
    /// stays available to [`Reaper::wait_exit`] (it is not claimed).
    /// `Err(f)` when `pid` is no root of ours (or the wait cannot be
    /// registered): the caller watches it some other way.
    pub fn on_exit(&self, pid: i32, f: ExitCallback) -> Result<(), ExitCallback> {
        let Some(handle) = self.handle(pid) else {
            return Err(f);
        };
        let slot = std::sync::Arc::new(Mutex::new(Some(f)));
        let (theirs, of) = (slot.clone(), handle.clone());
        let then: Box<dyn FnOnce() + Send> = Box::new(move || {
            // Signalled: the process has exited, so its code is final (a
            // process may exit with STILL_ACTIVE's value itself).
            let status = exit_code(&of).unwrap_or(ExitStatus::Exited(STILL_ACTIVE));
            let f = theirs.lock().map(|mut f| f.take()).unwrap_or(None);
            if let Some(f) = f {
                f(status);
            }
        });
        let taken_back = || {
            slot.lock()
                .map(|mut f| f.take())
                .unwrap_or(None)
                .unwrap_or_else(|| Box::new(|_| {}))
        };
        match super::watch::Wait::register(handle, Some(then)) {
            Ok(wait) => {
                // The old wait (if any) is dropped outside the table's lock.
                let old = self
                    .lock()
                    .get_mut(&pid)
                    .and_then(|c| c.on_exit.replace(wait));
                drop(old);
                Ok(())
            }
            Err(e) => {
                tracing::debug!(pid, error = %e, "no exit wait for the root");
                Err(taken_back())
            }
        }
    }

    /// Waits for the exit of the spawned `pid` (`None` timeout: forever).
    pub fn wait_exit(&self, pid: i32, timeout: Option<Duration>) -> Option<ExitStatus> {
        let h = self.handle(pid)?;
        let ms = timeout.map_or(u32::MAX, |t| {
            t.as_millis().min(u128::from(u32::MAX - 1)) as u32
        });
        // SAFETY: `h` is a valid process handle for the call.
        let rc = unsafe { WaitForSingleObject(h.as_raw_handle(), ms) };
        if rc != WAIT_OBJECT_0 {
            return None;
        }
        let status = exit_code(&h)?;
        if let Some(c) = self.lock().get_mut(&pid) {
            c.claimed = true;
        }
        Some(status)
    }

    /// Whether `pid` is a root this process spawned.
    pub fn knows(&self, pid: i32) -> bool {
        self.lock().contains_key(&pid)
    }

    /// The status of `pid` once it exited, waiting up to `timeout`.
    pub fn wait_unclaimed(&self, pid: i32, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.exit_of(pid) {
                return Some(s);
            }
            if Instant::now() >= deadline || !self.knows(pid) {
                return None;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The status of `pid` if it exited (without waiting).
    pub fn exit_of(&self, pid: i32) -> Option<ExitStatus> {
        let h = self.handle(pid)?;
        exit_code(&h)
    }

    /// The CPU time of `pid` (user + kernel, microseconds).
    pub fn cpu_usec_of(&self, pid: i32) -> Option<u64> {
        let h = self.handle(pid)?;
        let [_, _, kernel, user] = super::identity::process_times(&h).ok()?;
        Some((kernel + user) / 10)
    }

    /// Exits of spawned processes nobody claimed yet.
    pub fn unclaimed(&self) -> Vec<(i32, ExitStatus)> {
        let kids: Vec<(i32, std::sync::Arc<Owned>)> = self
            .lock()
            .iter()
            .filter(|(_, c)| !c.claimed)
            .map(|(p, c)| (*p, c.handle.clone()))
            .collect();
        kids.into_iter()
            .filter_map(|(pid, h)| exit_code(&h).map(|s| (pid, s)))
            .collect()
    }
}

/// The exit code of an exited process (`None` while it runs).
fn exit_code(h: &Owned) -> Option<ExitStatus> {
    let mut code = 0u32;
    // SAFETY: `h` is a valid process handle; `code` is a u32 on this frame.
    let ok = unsafe { GetExitCodeProcess(h.as_raw_handle(), &mut code) };
    if ok == 0 || code == STILL_ACTIVE as u32 {
        // STILL_ACTIVE is also a code a process may exit with; the wait in
        // `wait_exit` tells them apart, this read says "running".
        return None;
    }
    Some(ExitStatus::Exited(code as i32))
}

/// The console process group of `pid` when this process made it (a root
/// spawned with `CREATE_NEW_PROCESS_GROUP` leads a group of its own pid).
pub(crate) fn group_of(pid: i32) -> Option<i32> {
    Reaper::installed().filter(|r| r.knows(pid)).map(|_| pid)
}

/// No subreaper on Windows: orphans are not re-parented to anyone.
pub fn set_subreaper() -> Result<(), ProcError> {
    Err(unsupported("a subreaper"))
}

/// The pid of this process's parent (0 when it is gone or unknown).
pub fn parent_pid() -> i32 {
    super::misc::toolhelp_entry(std::process::id() as i32).map_or(0, |(ppid, _)| ppid)
}

/// Windows cannot say whether a process has no child (no parent links kept).
pub fn has_no_children() -> Result<bool, ProcError> {
    Err(unsupported("a child count"))
}

/// Waits for the exit of a child this process spawned.
pub fn reap_child(pid: i32, timeout: Option<Duration>) -> Result<Option<ExitStatus>, ProcError> {
    Ok(Reaper::installed().and_then(|r| r.wait_exit(pid, timeout)))
}

pub(crate) fn unsupported(what: &str) -> ProcError {
    ProcError::Io(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        format!("Windows has no {what}"),
    ))
}
