//! Exit watches: a pidfd, verified against an [`Identity`], that becomes
//! readable when the process it names exits.
//!
//! Why it exists: the service tears a client's tree down within a second of
//! the client's exit, and an owner's exit must be noticed without polling
//! `/proc`. The returned descriptor is a plain [`OwnedFd`] so async code can
//! register it with its reactor (tokio's `AsyncFd`) without seeing rustix.
//!
//! What it must never do: hand out a descriptor for a process other than the
//! one named. The identity is re-read *after* the pidfd is open, so a pid
//! recycled between the caller's read and the open is detected, never watched.

use std::os::fd::OwnedFd;

use rustix::io::Errno;
use rustix::process::{Pid, PidfdFlags};

use super::identity::boot_id;
use crate::proc::{Identity, ProcError};

/// Opens an exit watch on `id`. `Ok(None)` means the process is already gone
/// (no such pid, a zombie, or the pid now names another process): the caller
/// treats that as "has exited".
pub fn open_exit_watch(id: &Identity) -> Result<Option<OwnedFd>, ProcError> {
    let Some(pid) = Pid::from_raw(id.pid) else {
        return Ok(None);
    };
    let fd = match rustix::process::pidfd_open(pid, PidfdFlags::empty()) {
        Ok(fd) => fd,
        Err(Errno::SRCH) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    // Checked after the open: the descriptor names whatever held the pid at
    // the open, and this read proves that was the recorded process. The
    // lean stat read: a teardown opens one watch per killed survivor while
    // the kernel is still killing them, and shares the CPU with it.
    let Some(stat) = super::stat::read_entry(id.pid) else {
        return Ok(None);
    };
    if stat.start_ticks != id.start_ticks || boot_id()? != id.boot_id || !stat.is_live() {
        return Ok(None);
    }
    Ok(Some(fd))
}

/// Waits until every process `ids` names has exited (a zombie counts as
/// exited), or `deadline`; whether all did. Event-driven: one identity-
/// checked pidfd per process ([`open_exit_watch`]), each waited for in
/// `poll(2)` in turn, so the wait wakes once per process that is still
/// running, never on a timer. Only a hint for a teardown, whose verifying
/// scan decides.
pub fn wait_exits(ids: &[Identity], deadline: std::time::Instant) -> Result<bool, ProcError> {
    for id in ids {
        let Some(fd) = open_exit_watch(id)? else {
            continue;
        };
        loop {
            let now = std::time::Instant::now();
            if now >= deadline {
                return Ok(false);
            }
            let left = deadline - now;
            let timeout = rustix::event::Timespec {
                tv_sec: left.as_secs() as _,
                tv_nsec: left.subsec_nanos() as _,
            };
            let mut fds = [rustix::event::PollFd::new(
                &fd,
                rustix::event::PollFlags::IN,
            )];
            match rustix::event::poll(&mut fds, Some(&timeout)) {
                Ok(0) | Err(Errno::INTR) => {}
                Ok(_) => break,
                Err(e) => return Err(e.into()),
            }
        }
    }
    Ok(true)
}

/// An open exit watch, registered with the tokio reactor.
pub struct ExitWatch {
    fd: tokio::io::unix::AsyncFd<OwnedFd>,
}

impl ExitWatch {
    /// Registers `fd` (from [`open_exit_watch`]) with the current tokio
    /// runtime. Must be called inside one.
    pub fn new(fd: OwnedFd) -> std::io::Result<Self> {
        // SAFETY: the AsyncFd owns the OwnedFd, so the descriptor stays open
        // and names the same pidfd for the AsyncFd's whole lifetime, and
        // `OwnedFd::as_raw_fd` always returns that one descriptor.
        let fd = unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE)
        }
        .map_err(|e| std::io::Error::other(e.to_string()))?;
        Ok(Self { fd })
    }

    /// Resolves when the watched process has exited.
    pub async fn exited(&self) {
        // A pidfd polls readable once its process exits, and stays so.
        let _ = self.fd.readable().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_watch_on_ourselves_opens_and_a_wrong_start_time_does_not() {
        let me = crate::proc::self_identity().expect("own identity");
        assert!(open_exit_watch(&me).expect("open").is_some());
        let other = Identity {
            start_ticks: me.start_ticks + 1,
            ..me.clone()
        };
        assert!(open_exit_watch(&other).expect("open").is_none());
        let nobody = Identity {
            pid: i32::MAX,
            ..me
        };
        assert!(open_exit_watch(&nobody).expect("open").is_none());
    }
}
