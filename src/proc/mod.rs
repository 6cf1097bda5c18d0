//! The only code in treewarden that makes process syscalls or reads `/proc`
//! for process lifecycle: identities, ownership boundaries, signals, the
//! subreaper and reaper, and the host capability probe.
//!
//! Why it exists: DESIGN rules 1 and 4. Ownership is formed at spawn
//! ([`boundary::spawn_held`]: new session and process group, optionally a
//! cgroup, joined before exec while the child waits on a pipe), and nothing is
//! signalled on a guess: a process only through a pidfd verified against its
//! recorded [`Identity`], a group only while it provably is the recorded one.
//!
//! What it must never do:
//! - signal pid <= 1, the caller itself, its own process group or session
//!   (every entry point checks; see [`signal`]);
//! - re-resolve a process group from a leader pid (the pgid is recorded once);
//! - leak a `rustix`, `procfs` or `libc` type through a public signature;
//! - wait for children outside [`reaper`] in a process that installed it.
//!
//! `unsafe` is allowed in this module tree only (crate-wide it is denied); it
//! is confined to `fork`/`execve` and the async-signal-safe child path in
//! [`boundary`], and to registering a pidfd with tokio's reactor in
//! [`pidfd`], and to taking a descriptor the caller handed over by number
//! in [`fds`], each block with a `// SAFETY:` line. On Windows
//! the same interface is `windows/`, whose Win32 calls (Job Objects,
//! processes, toolhelp, the console) are its `unsafe` blocks, each with a
//! `// SAFETY:` line too; the Linux files are declared for Linux only.

#![allow(unsafe_code)]

#[cfg(target_os = "linux")]
pub mod boundary;
#[cfg(target_os = "linux")]
pub mod connector;
#[cfg(target_os = "linux")]
pub mod delegation;
#[cfg(target_os = "linux")]
pub mod fds;
#[cfg(target_os = "linux")]
#[doc(hidden)]
pub mod floor;
#[cfg(unix)]
mod guard;
#[cfg(target_os = "linux")]
pub mod held;
#[cfg(target_os = "linux")]
pub mod identity;
#[cfg(target_os = "linux")]
mod limits;
#[cfg(target_os = "linux")]
pub mod pidfd;
#[cfg(target_os = "linux")]
pub mod probe;
#[cfg(target_os = "linux")]
pub mod pseudo;
#[cfg(target_os = "linux")]
pub mod reaper;
#[cfg(target_os = "linux")]
mod resources;
#[cfg(unix)]
pub mod sig;
#[cfg(target_os = "linux")]
pub mod signal;
pub mod stat;
#[cfg(target_os = "linux")]
pub mod tty;
#[cfg(unix)]
mod userdb;
#[cfg(target_os = "linux")]
pub mod users;
#[cfg(target_os = "linux")]
pub use boundary::{
    BoundaryKind, CgroupSetting, ExecFailure, ExecFailureKind, GivenStdio, HeldChild,
    SHARED_PARENT_MARK, SpawnSpec, SpawnStdio, Spawned, cgroup_root, cgroup2_mount,
    check_cgroup_writable, deny_clone3_in_this_thread, is_shared_parent, own_cgroup_dir,
    remove_cgroup_if_empty, remove_cgroup_when_empty, remove_shared_parent_if_empty,
    resolve_boundary, spawn_held,
};
#[cfg(target_os = "linux")]
pub use connector::{Connector, ConnectorWaker, ProcEvent, monotonic_ns};
#[cfg(target_os = "linux")]
pub use delegation::{
    Layout, LayoutReport, SUPERVISOR_LEAF, check_limits_possible, layout, take_delegation,
};
#[cfg(target_os = "linux")]
pub use fds::take_inherited_fd;
#[cfg(target_os = "linux")]
pub use held::{pidfd_exited, signal_pidfd};
#[cfg(target_os = "linux")]
pub use identity::{
    Identity, Liveness, ProcKey, ProcStat, boot_id, identity_of, read_stat, self_identity,
};
#[cfg(target_os = "linux")]
pub use limits::{nofile_soft_limit, raise_nofile_soft_limit};
#[cfg(target_os = "linux")]
pub use pidfd::{ExitWatch, open_exit_watch, wait_exits};
#[cfg(target_os = "linux")]
pub use probe::{Capability, Probe, probe};
#[cfg(target_os = "linux")]
pub use reaper::{
    ExitCallback, ExitStatus, Reaper, has_no_children, parent_pid, reap_child,
    set_parent_death_signal, set_subreaper,
};
#[cfg(target_os = "linux")]
pub use resources::{CgroupUsage, cap_log, cgroup_controllers, cgroup_usage, oom_kills};
#[cfg(target_os = "linux")]
pub use signal::{
    CgroupEvent, Delivery, GroupDelivery, GroupPath, GroupRecord, Sig, cgroup_freeze, cgroup_kill,
    cgroup_pids, cgroup_populated, cgroup_thaw, cgroup_wait_event, default_sigpipe, group_members,
    may_signal, pidfd_group_signals_supported, signal_group, signal_group_known, signal_group_via,
    signal_process,
};
#[cfg(target_os = "linux")]
pub(crate) use stat::StatReader;
pub use stat::{ProcEntry, parse_stat};
#[cfg(target_os = "linux")]
pub use stat::{boot_ticks_now, first_live_in_group, read_entry};
#[cfg(target_os = "linux")]
pub use users::{
    Credentials, UserInfo, credentials_for, credentials_of_peer, current_uid, effective_uid,
    group_by_name, groups_of, user_by_name, user_by_uid,
};

/// How the teardown records its container kill (`cgroup.kill`).
#[cfg(target_os = "linux")]
pub const CONTAINER_KILL: (&str, &str) = ("SIGKILL", "cgroup");
/// A tree flag recorded before the root runs for a container that kills on
/// its owner's exit: none on Linux (a cgroup outlives its owner).
#[cfg(target_os = "linux")]
pub const STANDING_KILL_FLAG: Option<&str> = None;
/// Clears the standing kill of a tree's container before the teardown's
/// forced-kill round: nothing to clear on Linux (a cgroup kills nothing on
/// its own).
#[cfg(target_os = "linux")]
pub fn disarm_standing_kill(_dir: &std::path::Path) -> Result<(), ProcError> {
    Ok(())
}
/// The handle an exit watch holds (a pidfd).
#[cfg(target_os = "linux")]
pub type ExitHandle = std::os::fd::OwnedFd;

#[cfg(target_os = "linux")]
impl BoundaryKind {
    /// Whether the boundary is a kernel container the teardown kills as one.
    pub fn contained(self) -> bool {
        self == BoundaryKind::Cgroup
    }
}

// The Windows implementation of the same interface: Job Objects.
#[cfg(windows)]
mod windows;
#[cfg(windows)]
pub use windows::*;

// The macOS implementation of the same interface: libproc,
// kqueue, kill/killpg; compile-checked only.
#[cfg(target_os = "macos")]
mod macos;
#[cfg(target_os = "macos")]
pub use macos::*;

use std::path::PathBuf;

/// Errors of the process layer. A variant exists only where a caller branches
/// on it; everything else is [`ProcError::Io`] or [`ProcError::Proc`].
#[derive(Debug, thiserror::Error)]
pub enum ProcError {
    /// A sentinel guard refused the target: pid <= 1, ourselves, our own
    /// process group or session, or a cgroup that contains us. Nothing was sent.
    #[error("refused to signal {pid}: {reason}")]
    Refused { pid: i32, reason: String },
    /// No usable (mounted, writable) cgroup v2 hierarchy for a cgroup boundary.
    #[error("no usable cgroup v2 hierarchy: {0}")]
    NoCgroup(String),
    /// A cgroup control file or directory could not be used.
    #[error("cgroup {}: {source}", path.display())]
    Cgroup {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The forked child failed while preparing itself (setsid, stdio, chdir)
    /// before it was held; it never ran the command and has been reaped.
    #[error("child setup failed at {step}: {source}")]
    ChildSetup {
        step: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// The command could not be started at all, before anything ran (on
    /// Windows `CreateProcess` finds no such program: 127, as exec's
    /// failure after release is on Linux).
    #[error("{0}")]
    Exec(ExecFailure),
    /// `/proc` could not be read or parsed (other than "no such process").
    #[error("reading /proc: {0}")]
    Proc(String),
    /// Any other system call failure.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

#[cfg(unix)]
impl From<rustix::io::Errno> for ProcError {
    fn from(e: rustix::io::Errno) -> Self {
        ProcError::Io(e.into())
    }
}

impl ProcError {
    #[cfg_attr(windows, allow(dead_code))]
    #[cfg_attr(target_os = "macos", allow(dead_code))]
    pub(crate) fn cgroup(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ProcError::Cgroup {
            path: path.into(),
            source,
        }
    }
}
