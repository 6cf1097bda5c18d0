//! The rest of the shared process interface on macOS: the user database
//! (through nix, as on Linux), the host probe (Linux's fields, answered
//! for macOS), and honest answers for what macOS has not: cgroups and
//! their accounting, the proc connector.

use crate::proc::{
    Capability, ContainerUsage, Credentials, Layout, LayoutReport, Probe, ProcError,
};
use std::path::Path;

/// How the teardown would record a container kill. Never recorded on
/// macOS: no boundary there is contained ([`crate::proc::BoundaryKind::contained`]).
pub const CONTAINER_KILL: (&str, crate::proc::BoundaryKind) =
    ("SIGKILL", crate::proc::BoundaryKind::Cgroup);

/// No container kills on its owner's exit on macOS.
pub const STANDING_KILL_FLAG: Option<&str> = None;

pub use crate::proc::userdb::{
    current_uid, effective_uid, group_by_name, groups_of, login_uid, user_by_name, user_by_uid,
};

pub fn credentials_for(uid: u32, gid: u32) -> std::io::Result<Credentials> {
    let groups = match user_by_uid(uid)? {
        Some(user) => groups_of(&user, gid)?,
        None => vec![gid],
    };
    Ok(Credentials { uid, gid, groups })
}

/// Probes the host: an exit watch on this very process is tried; the rest
/// macOS does not have.
pub fn probe(_cgroup_root_override: Option<&Path>) -> Probe {
    let none = || Capability::no("macOS has no cgroups");
    let watch = match super::self_identity().and_then(|me| super::open_exit_watch(&me)) {
        Ok(Some(_)) => Capability::yes("kqueue EVFILT_PROC/NOTE_EXIT (no pidfd on macOS)"),
        Ok(None) => Capability::no("kqueue found no process to watch"),
        Err(e) => Capability::no(format!("kqueue EVFILT_PROC: {e}")),
    };
    let release = nix::sys::utsname::uname()
        .map(|u| u.release().to_string_lossy().into_owned())
        .unwrap_or_default();
    Probe {
        kernel_release: format!("Darwin {release}"),
        boot_id: super::boot_id().ok().map(str::to_owned),
        pid_max: Some(99_998),
        cgroup_v2: none(),
        cgroup2_mount: None,
        cgroup_root: None,
        cgroup_writable: none(),
        cgroup_kill: none(),
        cgroup_freeze: none(),
        pidfd: watch,
        pidfd_group_signal: Capability::no("no pidfd: a group is signalled by the checked killpg"),
        subreaper: Capability::no("macOS has no subreaper"),
        proc_connector: Capability::no("the proc connector is Linux's"),
        cgroup_layout: None,
        cgroup_controllers: Vec::new(),
        auto_boundary: crate::proc::BoundaryKind::Session,
        auto_reason: "macOS has no cgroups: session + process group".into(),
    }
}

pub fn container_usage(_dir: &Path) -> ContainerUsage {
    ContainerUsage::default()
}

pub fn cgroup_controllers(_dir: &Path) -> Result<Vec<String>, ProcError> {
    Ok(Vec::new())
}

impl std::fmt::Display for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("no cgroups")
    }
}

pub fn layout(_root: &Path) -> LayoutReport {
    LayoutReport {
        layout: Layout::NotDelegated,
        limits: false,
        note: "macOS has no cgroups".into(),
        supervisor: None,
    }
}

pub fn check_limits_possible(_root: &Path) -> Result<(), String> {
    Err("limits (--pids-max, --memory-max, --cpu-max) need cgroups, which macOS has not".into())
}

/// No cgroups on macOS: nobody is in one.
pub fn member_pids(_cgroup_dir: &Path) -> Result<std::collections::HashSet<i32>, String> {
    Ok(std::collections::HashSet::new())
}

/// The process's name (its argv, `KERN_PROCARGS2`, is not read yet).
pub fn cmdline(pid: i32) -> Vec<String> {
    super::details_of(pid).1
}

/// The forensic details of one process that can be read here.
pub fn details(pid: i32) -> crate::proc::MemberDetails {
    let (exe, cmdline) = super::details_of(pid);
    let stat = crate::proc::read_stat(pid).ok().flatten();
    crate::proc::MemberDetails {
        uid: stat.as_ref().map(|s| s.uid),
        read_from: stat.as_ref().map(|s| crate::proc::Lineage {
            start_ticks: s.start_ticks,
            ppid: s.ppid,
            pgid: s.pgid,
            sid: s.sid,
        }),
        exe,
        cmdline,
        ..crate::proc::MemberDetails::default()
    }
}

/// Whether a process's group and session can be read from outside: yes
/// (`proc_pidinfo`).
pub const GROUPS_READABLE: bool = true;
/// Whether a member's details carry the lineage they were read with: yes
/// (its `proc_pidinfo`).
pub const LINEAGE_IN_DETAILS: bool = true;
/// Whether `run` and `serve` spawn trees here: not yet (the process layer
/// is compile-checked only; docs/RESIDUALS.md, "macOS").
pub const SPAWNS_TREES: bool = false;
