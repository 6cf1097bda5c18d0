//! The Windows process layer: the same interface as the Linux files beside
//! this folder (`crate::proc::*`), over Job Objects.
//!
//! Why it exists: everything above `proc` (ledger, custody's teardown state
//! machine, CLI) is shared; what differs per OS is how a tree is contained,
//! listed, identified, signalled and ended. On Windows:
//!
//! - **boundary**: the root is created suspended (`CREATE_SUSPENDED`) in its
//!   own console process group (`CREATE_NEW_PROCESS_GROUP`), assigned to its
//!   own named Job Object before its first instruction, then resumed
//!   ([`spawn_held`], [`HeldChild::release`]). The job has no
//!   `BREAKAWAY_OK`: a child asking `CREATE_BREAKAWAY_FROM_JOB` is refused.
//!   The job plays the part of a Linux tree's cgroup: its name is the tree's
//!   `cgroup` column (`job:<name>`), its process list the members, its
//!   active count the verify, `TerminateJobObject` the forced kill.
//! - **identity**: pid + creation time (a FILETIME, absolute: unique across
//!   boots, so the boot id is a constant).
//! - **signals**: the graceful first signal is `CTRL_BREAK_EVENT` to the
//!   tree's process group; a single process has no graceful signal.
//! - **exits**: the process handles this process holds (its spawned roots),
//!   and for the service's watches a thread-pool wait on a process handle
//!   ([`ExitWatch`], [`Reaper::on_exit`]).
//!
//! What it must never do: terminate a job or a process without the caller
//! having passed the teardown's authorization (the only terminating calls
//! are [`container_kill`], which the teardown reaches only from its Kill phase,
//! and [`HeldChild::cancel`] of a child that ran nothing); signal this
//! process's own group; leak a `windows-sys` type through a signature.

mod doctor;
mod identity;
mod job;
mod misc;
mod reaper;
mod shell;
mod signal;
mod spawn;
mod watch;

pub use doctor::doctor_report;
pub use shell::make_dir_private;
pub use shell::{follow_terminal_resizes, shield_from_interrupts, stdio_pipes};

pub use identity::{boot_id, identity_of, read_stat, self_identity};
pub use job::{JOB_PREFIX, KILL_ON_CLOSE_FLAG, job_name_of};
pub use misc::*;
// What only Linux has, answered as on macOS.
#[path = "../linux_only.rs"]
mod linux_only;
pub use linux_only::*;
use reaper::unsupported;
/// Why `run --tty` has no pseudo-terminal here.
const PTY_MISSING: &str = "pseudo-terminal here (ConPTY is not wired)";
// A read here is a listing: the view re-reads by listing.
#[path = "../listed.rs"]
mod listed;
pub(crate) use listed::{refresh_by_listing as view_refresh, reread_by_listing as view_reread};
pub use reaper::{Reaper, has_no_children, parent_pid, reap_child, set_subreaper};
pub use signal::{
    container_freeze, container_kill, container_pids, container_populated, container_thaw,
    container_wait_event, default_sigpipe, disarm_standing_kill, may_signal, signal_group_known,
    signal_process,
};
pub use spawn::{
    BOUNDARY_KINDS, EXEC_ERRNO_IS_THE_OS, EXEC_OTHER_FAILURE, HeldChild, cgroup_root,
    remove_cgroup_if_empty, remove_cgroup_when_empty, resolve_boundary, spawn_held,
};

pub use watch::ExitWatch;

/// A kernel handle this layer owns (closed on drop).
pub(crate) type Owned = std::os::windows::io::OwnedHandle;

/// A UTF-16, NUL-terminated copy of `s` for the W functions.
pub(crate) fn wide(s: &str) -> Vec<u16> {
    s.encode_utf16().chain(std::iter::once(0)).collect()
}

/// The last Win32 error as an `io::Error`.
pub(crate) fn last_error() -> std::io::Error {
    std::io::Error::last_os_error()
}

/// A Win32 `BOOL` answer: 0 is a failure, the last error its cause.
pub(crate) fn check_bool(ok: i32) -> Result<(), crate::proc::ProcError> {
    if ok == 0 {
        return Err(crate::proc::ProcError::Io(last_error()));
    }
    Ok(())
}
