//! The macOS process layer: the same interface as the Linux files beside
//! this folder (`crate::proc::*`), over libproc, kqueue and kill/killpg.
//! Compile-checked only (`tests/macos/check`): nothing here has
//! run on a Mac, and no tree is spawned on macOS yet (`run` and `serve`
//! refuse there; docs/RESIDUALS.md, "macOS").
//!
//! - **identity**: pid + start time (`proc_pidinfo(PROC_PIDTBSDINFO)`'s
//!   `p_start`, in µs since the epoch: absolute, so the boot id is a constant).
//! - **members**: the tree's process group (`proc_listpgrppids`), each
//!   member read like an identity; the whole table is `proc_listallpids`.
//! - **exits**: kqueue `EVFILT_PROC`/`NOTE_EXIT`, registered before the
//!   identity is re-checked ([`open_exit_watch`]).
//! - **signals**: `kill`/`killpg`, each after the identity check (no pidfd:
//!   a residual window, [`signal`]).
//! - **boundary**: session + process group only (no cgroups, no subreaper).
//!
//! What it must never do: signal pid <= 1, this process, its own group or
//! session; signal without the identity check just before; leak a `libc`
//! type through a public signature. Its `unsafe` blocks (libproc, kqueue,
//! kill, waitpid) each carry a `// SAFETY:` line; `limits` and `fds` are
//! `unix/`'s, shared with Linux.

mod exits;
mod identity;
mod misc;
mod signal;
mod spawn;

pub use exits::{
    ExitHandle, Reaper, has_no_children, open_exit_watch, parent_pid, pidfd_exited, reap_child,
    set_subreaper, signal_pidfd, wait_exits,
};
pub use identity::{
    boot_id, details_of, first_live_in_group, group_members, identity_of, read_entry, read_stat,
    self_identity, snapshot_entries,
};
pub use misc::*;
// What only Linux has, answered as on Windows.
#[path = "../linux_only.rs"]
mod linux_only;
use exits::unsupported;
pub use linux_only::*;
/// Why `run --tty` has no pseudo-terminal here: Linux's `tty.rs` opens it
/// with `O_CLOEXEC`, which macOS's `posix_openpt` lacks (and `run` is refused).
const PTY_MISSING: &str = "pseudo-terminal for run --tty in treewarden yet";
// A read here is a listing: the view re-reads by listing.
#[path = "../listed.rs"]
mod listed;
pub(crate) use listed::{refresh_by_listing as view_refresh, reread_by_listing as view_reread};
pub use signal::{
    container_freeze, container_kill, container_pids, container_populated, container_thaw,
    container_wait_event, default_sigpipe, disarm_standing_kill, may_signal, signal_group_known,
    signal_process,
};
pub use spawn::{
    BOUNDARY_KINDS, EXEC_ERRNO_IS_THE_OS, EXEC_OTHER_FAILURE, HeldChild, cgroup_root,
    remove_cgroup_if_empty, remove_cgroup_when_empty, resolve_boundary, spawn_held,
};
