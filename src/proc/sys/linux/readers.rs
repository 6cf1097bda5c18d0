//! Reads of one process or one cgroup that the scan and the teardown's
//! evidence make (`/proc/<pid>/cmdline`, `wchan`, `cgroup.procs`).

use std::collections::HashSet;
use std::path::Path;

/// The pids listed in a cgroup's `cgroup.procs` (empty if it is gone):
/// [`super::cgroup_pids`] as a set. `Err` when the read failed for
/// another reason: the members are then unknown, not none.
pub fn member_pids(cgroup_dir: &Path) -> Result<HashSet<i32>, String> {
    let file = cgroup_dir.join("cgroup.procs");
    match super::pseudo::read_path_string(&file) {
        Ok(text) => Ok(text.lines().filter_map(|l| l.trim().parse().ok()).collect()),
        // The cgroup is gone (removed, or never made): nobody is in it.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(HashSet::new()),
        Err(e) => Err(format!("{}: {e}", file.display())),
    }
}

/// The argv of one process (empty if it exited or is a kernel thread).
/// Only this one read, for the survivor snapshot of every forced kill:
/// `scan::details` costs five reads per process.
pub fn cmdline(pid: i32) -> Vec<String> {
    super::pseudo::read_path(Path::new(&format!("/proc/{pid}/cmdline")))
        .map(|raw| {
            raw.split(|&b| b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// The kernel function a process sleeps in (`/proc/<pid>/wchan`): `None`
/// where it runs, is gone, or the kernel hides it (`0`, or no permission).
/// Evidence for a member no signal ends.
pub fn wchan(pid: i32) -> Option<String> {
    let raw = super::pseudo::read_path(Path::new(&format!("/proc/{pid}/wchan"))).ok()?;
    let w = String::from_utf8_lossy(&raw).trim().to_string();
    (!w.is_empty() && w != "0").then_some(w)
}

/// The uid a process runs as, as [`details`] reads it (the owner of
/// `/proc/<pid>`), alone: one `stat(2)`, where the details cost five reads.
pub fn uid_of(pid: i32) -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(format!("/proc/{pid}"))
        .ok()
        .map(|m| m.uid())
}

/// Reads the forensic details of one process; fields that cannot be read
/// (exited meanwhile, permission) are `None`.
pub fn details(pid: i32) -> crate::proc::MemberDetails {
    let Ok(proc) = procfs::process::Process::new(pid) else {
        return crate::proc::MemberDetails::default();
    };
    crate::proc::MemberDetails {
        uid: proc.uid().ok(),
        read_from: proc.stat().ok().map(|st| crate::proc::Lineage {
            start_ticks: st.starttime,
            ppid: st.ppid,
            pgid: st.pgrp,
            sid: st.session,
        }),
        exe: proc.exe().ok().map(|p| p.display().to_string()),
        cmdline: proc.cmdline().unwrap_or_default(),
        cwd: proc.cwd().ok().map(|p| p.display().to_string()),
        cgroup: proc.cgroups().ok().and_then(|groups| {
            groups
                .into_iter()
                .find(|g| g.hierarchy == 0)
                .map(|g| g.pathname)
        }),
    }
}
