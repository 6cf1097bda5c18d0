//! Processes held from first sight: a pidfd opened (and verified) when a
//! member is first attributed, through which its liveness is read and its
//! signals are sent from then on.
//!
//! Why it exists: `(pid, start ticks, boot id)` names a process only to the
//! resolution of a clock tick (10 ms). A member that exits and whose pid is
//! taken by another process *within the same tick* (as root can arrange
//! with `clone3` `set_tid` or `ns_last_pid`) has the same identity, so an
//! identity re-read before a signal cannot tell them apart. A
//! pidfd can: it names the process that held the pid when it was opened,
//! and says so for good.
//!
//! What it must never do: signal anything but the process the descriptor
//! names.

use std::os::fd::{AsFd, OwnedFd};

use rustix::event::{PollFd, PollFlags, poll};
use rustix::io::Errno;

use crate::proc::{Delivery, ProcError, Sig};

/// Whether the process `fd` names has exited (a zombie counts): a pidfd is
/// readable once its process exits.
pub fn pidfd_exited(fd: &OwnedFd) -> bool {
    let mut fds = [PollFd::new(fd, PollFlags::IN)];
    let zero = rustix::time::Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    match poll(&mut fds, Some(&zero)) {
        Ok(n) => n > 0,
        // A poll that fails proves nothing: the process is not taken for gone.
        Err(_) => false,
    }
}

/// Sends `sig` through `fd` to exactly the process it names.
pub fn signal_pidfd(fd: &OwnedFd, sig: Sig) -> Result<Delivery, ProcError> {
    match rustix::process::pidfd_send_signal(fd.as_fd(), sig.raw()) {
        Ok(()) => Ok(Delivery::Sent),
        Err(Errno::SRCH) => Ok(Delivery::Gone),
        Err(e) => Err(e.into()),
    }
}
