//! Exit watches on Windows: a process handle waited for by the system's
//! thread pool (`RegisterWaitForSingleObject`), so the service's owner and
//! root watches hold no thread each while they wait.
//!
//! Why it exists: the service's watch tasks select over a client owner's
//! exit and an adopted root's exit (on Linux an identity-checked pidfd in
//! the reactor, `crate::proc::pidfd`). Here the handle from
//! [`super::open_exit_watch`] (opened and then checked against the recorded
//! creation time, so a recycled pid is never watched) is registered for
//! one wait; its callback marks the watch fired and wakes the tasks
//! awaiting it. The same registration calls the [`super::Reaper`]'s
//! per-root callbacks ([`super::Reaper::on_exit`]).
//!
//! What it must never do: free the callback's context while the callback
//! may still run: [`Wait`]'s drop unregisters with `UnregisterWaitEx(…,
//! INVALID_HANDLE_VALUE)`, which returns only once no callback runs, and
//! only then drops the context. A wait is never dropped from inside its
//! own callback (that would deadlock): the callbacks only set a flag, wake
//! waiters and run a caller's `FnOnce` (a channel send).

use std::ffi::c_void;
use std::os::windows::io::AsRawHandle;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use windows_sys::Win32::Foundation::{HANDLE, INVALID_HANDLE_VALUE};
use windows_sys::Win32::System::Threading::{
    INFINITE, RegisterWaitForSingleObject, UnregisterWaitEx, WT_EXECUTEONLYONCE,
};

use super::Owned;

/// What a registered wait's callback reaches.
struct Fired {
    done: AtomicBool,
    notify: tokio::sync::Notify,
    then: Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

/// One registered wait on a process handle (unregistered on drop).
pub(crate) struct Wait {
    wait: HANDLE,
    fired: *const Fired,
    /// The waited-for handle stays open while the wait is registered.
    _process: Arc<Owned>,
}

// SAFETY: `wait` is a registration handle the thread pool accepts from any
// thread; `fired` points into an `Arc<Fired>` (Send + Sync) this value
// owns one count of, released only in drop.
unsafe impl Send for Wait {}
// SAFETY: as above; shared access only reads `Fired` through `&`.
unsafe impl Sync for Wait {}

/// The thread pool's callback: the process exited (no timeout is set).
unsafe extern "system" fn on_signalled(ctx: *mut c_void, _timed_out: bool) {
    // SAFETY: `ctx` is the `Arc<Fired>` pointer registered with this
    // callback; `Wait::drop` frees it only after UnregisterWaitEx has
    // waited for every callback to return.
    let fired = unsafe { &*(ctx as *const Fired) };
    fired.done.store(true, Ordering::SeqCst);
    fired.notify.notify_waiters();
    let then = fired.then.lock().map(|mut t| t.take()).unwrap_or(None);
    if let Some(f) = then {
        f();
    }
}

impl Wait {
    /// Registers one wait on `process` (a handle with SYNCHRONIZE);
    /// `then` runs on a pool thread once it is signalled.
    pub(crate) fn register(
        process: Arc<Owned>,
        then: Option<Box<dyn FnOnce() + Send>>,
    ) -> std::io::Result<Wait> {
        let fired = Arc::into_raw(Arc::new(Fired {
            done: AtomicBool::new(false),
            notify: tokio::sync::Notify::new(),
            then: Mutex::new(then),
        }));
        let mut wait: HANDLE = std::ptr::null_mut();
        // SAFETY: `wait` is an out-pointer on this frame; `process` is a
        // valid process handle kept open by the returned value; `fired`
        // lives until that value's drop (see `Drop`).
        let ok = unsafe {
            RegisterWaitForSingleObject(
                &mut wait,
                process.as_raw_handle(),
                Some(on_signalled),
                fired as *const c_void,
                INFINITE,
                WT_EXECUTEONLYONCE,
            )
        };
        if ok == 0 {
            let e = super::last_error();
            // SAFETY: the registration failed, so no callback holds `fired`:
            // this takes back the count `into_raw` gave away.
            drop(unsafe { Arc::from_raw(fired) });
            return Err(e);
        }
        Ok(Wait {
            wait,
            fired,
            _process: process,
        })
    }

    fn fired(&self) -> &Fired {
        // SAFETY: `self.fired` stays valid until `self` is dropped.
        unsafe { &*self.fired }
    }

    /// Resolves once the process has exited (at once if it did already).
    pub(crate) async fn signalled(&self) {
        let fired = self.fired();
        loop {
            let notified = fired.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if fired.done.load(Ordering::SeqCst) {
                return;
            }
            notified.await;
        }
    }
}

impl Drop for Wait {
    fn drop(&mut self) {
        // SAFETY: `self.wait` is this value's registration; with
        // INVALID_HANDLE_VALUE the call returns once no callback of it runs
        // (and none will), after which `fired` is no longer reachable from
        // the pool and its count can be released.
        unsafe {
            UnregisterWaitEx(self.wait, INVALID_HANDLE_VALUE);
            drop(Arc::from_raw(self.fired));
        }
    }
}

/// An open exit watch: the process's handle, waited for by the thread pool.
pub struct ExitWatch {
    wait: Wait,
}

impl ExitWatch {
    /// Registers `h` (from [`super::open_exit_watch`]). Needs no runtime to
    /// make; [`ExitWatch::exited`] is awaited inside one.
    pub fn new(h: super::ExitHandle) -> std::io::Result<Self> {
        Ok(Self {
            wait: Wait::register(Arc::new(h), None)?,
        })
    }

    /// Resolves when the watched process has exited.
    pub async fn exited(&self) {
        self.wait.signalled().await;
    }
}
