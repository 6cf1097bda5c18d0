//! Users and groups, for trees that run as their requester: the
//! user database (NSS, through nix: `getpwnam_r`, `getpwuid_r`,
//! `getgrnam_r`, `getgrouplist`) and the credentials a tree's root is given
//! in the child before exec ([`super::boundary`]).
//!
//! What it must never do: guess. A uid the user database does not know
//! runs with its peer's gid and no supplementary groups, never with the
//! service's.

/// The credentials set in a tree's child before exec: supplementary groups
/// first, then the gid, then the uid (real, effective and saved alike), so
/// nothing of the service's identity is left to regain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Credentials {
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups (`setgroups`); may be empty.
    pub groups: Vec<u32>,
    /// Resource limits set before the ids (a socket requester's own, read
    /// from its process). Empty: the service's are inherited.
    pub rlimits: Vec<Rlimit>,
    /// `cgroup.procs` of the requester's cgroup in each cgroup v1 hierarchy
    /// with a controller (`pids`, `memory`, …), joined before the ids, so the
    /// requester's v1 limits bind its tree too. Empty on a pure v2 host.
    pub cgroups_v1: Vec<std::path::PathBuf>,
}

/// One resource limit (`setrlimit`); `u64::MAX` is `RLIM_INFINITY`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rlimit {
    /// The `RLIMIT_*` number.
    pub resource: u32,
    pub soft: u64,
    pub hard: u64,
}

pub use crate::proc::userdb::{
    UserInfo, current_uid, effective_uid, group_by_name, groups_of, login_uid, user_by_name,
    user_by_uid,
};

/// The credentials a tree asked for by a principal with `uid` (and, from
/// its peer credentials, `gid`) runs with: the user database's groups of
/// that uid when it has one, else only `gid`.
pub fn credentials_for(uid: u32, gid: u32) -> std::io::Result<Credentials> {
    let groups = match user_by_uid(uid)? {
        Some(user) => groups_of(&user, gid)?,
        None => vec![gid],
    };
    Ok(Credentials {
        uid,
        gid,
        groups,
        rlimits: Vec::new(),
        cgroups_v1: Vec::new(),
    })
}

/// The credentials a tree asked for over the socket runs with: the peer's
/// uid and gid, and what the kernel holds *for the peer process*,
/// not what the user database lists, so a tree gains nothing its requester
/// lacks:
/// - its supplementary groups (`Groups:` of `/proc/<pid>/status`): a
///   requester that dropped a group does not get it back;
/// - its resource limits (`/proc/<pid>/limits`), soft and hard: a requester
///   at hard `nofile` 64 gets a tree at 64, not the service's;
/// - its cgroup v1 memberships (`/proc/<pid>/cgroup`): its tree joins the
///   same v1 cgroups, so a v1 `pids.max` binds the tree too.
///
/// All three are read through one `/proc/<pid>` directory descriptor, so
/// they describe one process even if the pid is reused meanwhile. `Err`
/// (one line) when that process is gone or is not uid `uid`'s (a pid
/// reused since it connected): the tree is refused rather than given
/// another process's limits.
pub fn credentials_of_peer(pid: Option<i32>, uid: u32, gid: u32) -> Result<Credentials, String> {
    let Some(pid) = pid else {
        return Err("the requester's process id is unknown (no peer credentials)".into());
    };
    let gone = |what: &str, e: procfs::ProcError| {
        format!(
            "cannot read the requester's {what} (pid {pid}): {e}; connect from the process that asks"
        )
    };
    let process = procfs::process::Process::new(pid).map_err(|e| gone("process", e))?;
    let status = process.status().map_err(|e| gone("status", e))?;
    // All four uids: a setuid program the requester ran (ruid kept, euid
    // root) may have raised its own limits, which the tree must not get.
    if [status.ruid, status.euid, status.suid, status.fuid] != [uid; 4] {
        return Err(format!(
            "pid {pid} is not (or no longer) the requester's alone (uid {uid}): its limits cannot be read"
        ));
    }
    let limits = process.limits().map_err(|e| gone("limits", e))?;
    let cgroups = process.cgroups().map_err(|e| gone("cgroups", e))?;
    Ok(Credentials {
        uid,
        gid,
        groups: status.groups,
        rlimits: rlimits_of(&limits),
        cgroups_v1: v1_procs_files(&cgroups),
    })
}

/// Every limit of `/proc/<pid>/limits` as `setrlimit` takes it.
fn rlimits_of(l: &procfs::process::Limits) -> Vec<Rlimit> {
    use procfs::process::LimitValue;
    let v = |x: LimitValue| match x {
        LimitValue::Unlimited => u64::MAX,
        LimitValue::Value(n) => n,
    };
    [
        (libc::RLIMIT_CPU, &l.max_cpu_time),
        (libc::RLIMIT_FSIZE, &l.max_file_size),
        (libc::RLIMIT_DATA, &l.max_data_size),
        (libc::RLIMIT_STACK, &l.max_stack_size),
        (libc::RLIMIT_CORE, &l.max_core_file_size),
        (libc::RLIMIT_RSS, &l.max_resident_set),
        (libc::RLIMIT_NPROC, &l.max_processes),
        (libc::RLIMIT_NOFILE, &l.max_open_files),
        (libc::RLIMIT_MEMLOCK, &l.max_locked_memory),
        (libc::RLIMIT_AS, &l.max_address_space),
        (libc::RLIMIT_LOCKS, &l.max_file_locks),
        (libc::RLIMIT_SIGPENDING, &l.max_pending_signals),
        (libc::RLIMIT_MSGQUEUE, &l.max_msgqueue_size),
        (libc::RLIMIT_NICE, &l.max_nice_priority),
        (libc::RLIMIT_RTPRIO, &l.max_realtime_priority),
        (libc::RLIMIT_RTTIME, &l.max_realtime_timeout),
    ]
    .into_iter()
    .map(|(resource, limit)| Rlimit {
        resource,
        soft: v(limit.soft_limit),
        hard: v(limit.hard_limit),
    })
    .collect()
}

/// The `cgroup.procs` files of the v1 cgroups in `groups` that this
/// process can reach (a v1 mount of the same controllers; a bind-mounted
/// hierarchy's root is stripped). Named hierarchies (`name=systemd`) carry
/// no limit and are left out; so is the v2 entry (hierarchy 0).
fn v1_procs_files(groups: &procfs::ProcessCGroups) -> Vec<std::path::PathBuf> {
    let Ok(mounts) = procfs::process::Process::myself().and_then(|me| me.mountinfo()) else {
        return Vec::new();
    };
    let mut files = Vec::new();
    for g in &groups.0 {
        let controllers: Vec<&str> = g
            .controllers
            .iter()
            .map(String::as_str)
            .filter(|c| !c.is_empty() && !c.starts_with("name="))
            .collect();
        if g.hierarchy == 0 || controllers.is_empty() {
            continue;
        }
        let mount = mounts.0.iter().find(|m| {
            m.fs_type == "cgroup" && controllers.iter().all(|c| m.super_options.contains_key(*c))
        });
        let Some(mount) = mount else { continue };
        let root = mount.root.trim_end_matches('/');
        let Some(rel) = g.pathname.strip_prefix(root) else {
            continue;
        };
        let file = mount
            .mount_point
            .join(rel.trim_start_matches('/'))
            .join("cgroup.procs");
        if file.exists() {
            files.push(file);
        }
    }
    files
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peers_groups_limits_and_v1_cgroups_are_the_kernels_and_only_for_its_own_uid() {
        // This process, read for real.
        let me = credentials_of_peer(
            Some(std::process::id() as i32),
            current_uid(),
            rustix::process::getgid().as_raw(),
        )
        .expect("own credentials");
        let mut kernel: Vec<u32> = rustix::process::getgroups()
            .expect("getgroups")
            .into_iter()
            .map(|g| g.as_raw())
            .collect();
        let mut got = me.groups.clone();
        kernel.sort_unstable();
        got.sort_unstable();
        assert_eq!(got, kernel);
        let nofile = me
            .rlimits
            .iter()
            .find(|r| r.resource == libc::RLIMIT_NOFILE)
            .expect("nofile is read");
        let own = rustix::process::getrlimit(rustix::process::Resource::Nofile);
        assert_eq!(Some(nofile.soft), own.current);
        assert_eq!(Some(nofile.hard), own.maximum);
        assert_eq!(me.rlimits.len(), 16, "every limit of /proc/<pid>/limits");
        for f in &me.cgroups_v1 {
            assert!(f.ends_with("cgroup.procs") && f.exists(), "{f:?}");
        }
        // Another uid's pid (or a gone one) is refused, not read.
        let err = credentials_of_peer(Some(std::process::id() as i32), 4_000_000_001, 0)
            .expect_err("not this uid's process");
        assert!(err.contains("no longer) the requester's"), "{err}");
        assert!(credentials_of_peer(None, 0, 0).is_err());
    }

    #[test]
    fn root_is_known_and_its_groups_include_its_gid() {
        let root = user_by_uid(0).expect("lookup").expect("root exists");
        assert_eq!(root.name, "root");
        assert_eq!(user_by_name("root").expect("lookup"), Some(root.clone()));
        let c = credentials_for(0, 0).expect("credentials");
        assert!(c.groups.contains(&0), "{c:?}");
        assert_eq!(
            user_by_name("no-such-user-tw17").expect("lookup"),
            None,
            "an unknown name is None, not an error"
        );
    }

    #[test]
    fn an_unknown_uid_gets_only_its_own_gid() {
        let c = credentials_for(3_999_999_999, 3_999_999_998).expect("credentials");
        assert_eq!(c.groups, vec![3_999_999_998]);
    }
}
