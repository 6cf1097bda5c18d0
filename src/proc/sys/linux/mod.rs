//! The Linux process layer: a held spawn into a cgroup v2 boundary, pidfds,
//! the proc connector, `/proc` reads, the subreaper; with `unix/` (the
//! sentinel guard, signal names, the user database, inherited descriptors,
//! the descriptor limit) the interface `crate::proc` exports on Linux.

pub mod boundary;
pub mod connector;
pub mod delegation;
#[doc(hidden)]
pub mod floor;
pub mod held;
pub mod identity;
mod listing;
pub mod pidfd;
pub mod probe;
pub mod pseudo;
mod readers;
pub mod reaper;
mod reserve;
mod resources;
pub mod signal;
mod stat;
pub mod tty;
pub mod users;

use crate::proc::ProcError;

pub use boundary::{
    BOUNDARY_KINDS, EXEC_ERRNO_IS_THE_OS, EXEC_OTHER_FAILURE, HeldChild, SHARED_PARENT_MARK,
    Spawned, cgroup_root, cgroup2_mount, check_cgroup_writable, deny_clone3_in_this_thread,
    is_shared_parent, own_cgroup_dir, remove_cgroup_if_empty, remove_cgroup_when_empty,
    remove_shared_parent_if_empty, resolve_boundary, spawn_held,
};
pub use connector::{Connector, ConnectorWaker, monotonic_ns};
pub use delegation::{SUPERVISOR_LEAF, check_limits_possible, layout, take_delegation};
pub use held::{pidfd_exited, signal_pidfd};
pub use identity::{boot_id, identity_of, read_stat, self_identity};
pub use listing::snapshot_entries;
pub(crate) use listing::{view_refresh, view_reread};
pub use pidfd::{ExitWatch, open_exit_watch, wait_exits};
pub use probe::probe;
pub use readers::{cmdline, details, member_pids, uid_of, wchan};
pub use reaper::{Reaper, has_no_children, parent_pid, reap_child, set_subreaper};
pub use reserve::{RESERVES_PAST_END, reserve_past_end};
pub use resources::{cap_log, cgroup_controllers, container_usage, oom_kills};
pub use signal::{
    GroupPath, cgroup_freeze, cgroup_kill, cgroup_pids, cgroup_populated, cgroup_thaw,
    cgroup_wait_event, default_sigpipe, group_members, may_signal, pidfd_group_signals_supported,
    signal_group, signal_group_known, signal_group_via, signal_process,
};
// The container vocabulary every OS exports (on Windows a Job Object's):
// on Linux the container is the tree's cgroup.
pub use signal::{
    cgroup_freeze as container_freeze, cgroup_kill as container_kill,
    cgroup_pids as container_pids, cgroup_populated as container_populated,
    cgroup_thaw as container_thaw, cgroup_wait_event as container_wait_event,
};
pub use stat::{boot_ticks_now, first_live_in_group, read_entry};
pub use users::{
    Credentials, credentials_for, credentials_of_peer, current_uid, effective_uid, group_by_name,
    groups_of, login_uid, user_by_name, user_by_uid,
};

/// How the teardown records its container kill (`cgroup.kill`).
pub const CONTAINER_KILL: (&str, crate::proc::BoundaryKind) =
    ("SIGKILL", crate::proc::BoundaryKind::Cgroup);
/// A tree flag recorded before the root runs for a container that kills on
/// its owner's exit: none on Linux (a cgroup outlives its owner).
pub const STANDING_KILL_FLAG: Option<&str> = None;
/// Clears the standing kill of a tree's container before the teardown's
/// forced-kill round: nothing to clear on Linux (a cgroup kills nothing on
/// its own).
pub fn disarm_standing_kill(_dir: &std::path::Path) -> Result<(), ProcError> {
    Ok(())
}
/// Whether a shared parent container can hold several trees' containers
/// under limits of its own (a principal's): yes, a cgroup can.
pub const SHARED_PARENT_LIMITS: bool = true;
/// The handle an exit watch holds (a pidfd).
pub type ExitHandle = std::os::fd::OwnedFd;

impl ProcError {
    /// A cgroup control file or directory that could not be used.
    pub(crate) fn cgroup(path: impl Into<std::path::PathBuf>, source: std::io::Error) -> Self {
        ProcError::Cgroup {
            path: path.into(),
            source,
        }
    }
}

/// Whether a process's group and session can be read from outside: yes
/// (`/proc/<pid>/stat`).
pub const GROUPS_READABLE: bool = true;
/// Whether a member's details carry the lineage they were read with: yes
/// (its stat, in the same `/proc/<pid>` read).
pub const LINEAGE_IN_DETAILS: bool = true;
/// Whether `run` and `serve` spawn trees here: yes.
pub const SPAWNS_TREES: bool = true;
