//! Descriptors a caller hands over by number (`run --id-fd N`,
//! `--status-fd N`), as `flock(1)`, `systemd-notify` and `bwrap --info-fd`
//! take them.
//!
//! Why it exists: a caller learns its tree id and run's own verdict on a
//! descriptor of its choosing, never by parsing stderr. Taking one means
//! owning it (closed when run is done with it) and marking it close-on-exec,
//! so the command never inherits it: a reader waiting for the end of the
//! status pipe waits for run, not for whatever the tree left running.
//!
//! What it must never do: take 0, 1 or 2 (the command's own stdio), or a
//! number that is not open.

use std::os::fd::{BorrowedFd, FromRawFd, OwnedFd};

use rustix::io::FdFlags;

/// Takes descriptor `n` inherited from the caller: checks it is open,
/// marks it close-on-exec and returns it as a `File`. One line on error.
pub fn take_inherited_fd(n: i32) -> Result<std::fs::File, String> {
    if n < 3 {
        return Err(format!(
            "descriptor {n} is the command's own stdin, stdout or stderr: use 3 or above"
        ));
    }
    // SAFETY: the borrow lives only for these two calls, and fcntl on a
    // descriptor that is not open fails with EBADF (checked) instead of
    // touching anything.
    let borrowed = unsafe { BorrowedFd::borrow_raw(n) };
    let flags = rustix::io::fcntl_getfd(borrowed).map_err(|e| format!("descriptor {n}: {e}"))?;
    rustix::io::fcntl_setfd(borrowed, flags | FdFlags::CLOEXEC)
        .map_err(|e| format!("descriptor {n}: {e}"))?;
    // SAFETY: `n` is open (fcntl just succeeded) and was inherited from
    // the caller for this purpose; nothing else in this process owns it (it
    // is above the standard three and treewarden opens none before parsing
    // its arguments), so this is its one owner and it is closed once.
    let owned = unsafe { OwnedFd::from_raw_fd(n) };
    Ok(std::fs::File::from(owned))
}
