//! Everything the held child touches after the fork, allocated before it
//! (DESIGN: the child may not allocate): argv, env, the `execvp` search,
//! stdio and tty descriptors, credentials, limits, the signal defaults.

use std::ffi::{CString, OsStr, OsString};
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

#[cfg(doc)]
use super::fork::child_after_fork;
use crate::proc::{GivenStdio, SpawnStdio};
use crate::proc::{ProcError, SpawnSpec};

/// Everything the child touches after fork, allocated before it.
pub(super) struct Prepared {
    _argv: Vec<CString>,
    pub(super) argv_ptrs: Vec<*const libc::c_char>,
    _envp: Vec<CString>,
    pub(super) envp_ptrs: Vec<*const libc::c_char>,
    /// Where `execve` is tried, in order (`execvp`'s search, made in the
    /// child after it took the requester's ids and working directory, so
    /// the search sees only what the requester may see).
    pub(super) candidates: Vec<CString>,
    pub(super) cwd: Option<CString>,
    pub(super) null_fd: Option<OwnedFd>,
    /// With [`SpawnStdio::Log`]: the log file, for descriptors 1 and 2.
    pub(super) log_fd: Option<OwnedFd>,
    /// With [`SpawnStdio::Given`]: the given descriptors, put on 0, 1, 2
    /// after the null and log ones.
    pub(super) given: GivenStdio,
    /// With [`SpawnSpec::tty`]: the terminal's slave, opened without
    /// becoming our controlling terminal.
    pub(super) tty_fd: Option<OwnedFd>,
    pub(super) umask: Option<libc::mode_t>,
    /// uid, gid and supplementary groups to take before exec.
    pub(super) creds: Option<(libc::uid_t, libc::gid_t, Vec<libc::gid_t>)>,
    /// The requester's limits, set before the ids.
    pub(super) rlimits: Vec<(libc::__rlimit_resource_t, libc::rlimit)>,
    /// The requester's v1 `cgroup.procs`, opened here; the child writes
    /// "0" (itself) to each before the ids.
    pub(super) cgroups_v1: Vec<OwnedFd>,
    pub(super) empty_mask: libc::sigset_t,
    pub(super) default_action: libc::sigaction,
    pub(super) sigmax: libc::c_int,
}

fn cstring(s: &OsStr) -> Result<CString, ProcError> {
    CString::new(s.as_bytes()).map_err(|_| {
        ProcError::Io(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("argument or environment contains a NUL byte: {s:?}"),
        ))
    })
}

/// The paths `execvp` would try for `name`, in order: `name` itself when it
/// has a slash, else each `PATH` entry joined with it (an empty entry is the
/// working directory). The child tries them (see [`child_after_fork`]).
fn exec_candidates(name: &OsStr, path_var: Option<&OsStr>) -> Result<Vec<CString>, ProcError> {
    if name.as_bytes().contains(&b'/') {
        return Ok(vec![cstring(name)?]);
    }
    let path_var = path_var.unwrap_or(OsStr::new("/usr/local/bin:/usr/bin:/bin"));
    std::env::split_paths(path_var)
        .map(|dir| {
            let dir = if dir.as_os_str().is_empty() {
                PathBuf::from(".")
            } else {
                dir
            };
            cstring(dir.join(name).as_os_str())
        })
        .collect()
}

// Over 100 lines on purpose: every allocation the held child needs (program paths, argv, env,
// credentials, descriptors, cgroup) is made here, before the fork, as a flat list of
// independent steps of a few lines each; split, they would pass one half-filled `Prepared`
// around.
pub(super) fn prepare(spec: &SpawnSpec) -> Result<Prepared, ProcError> {
    let Some(argv0) = spec.argv.first() else {
        return Err(ProcError::Io(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "empty command",
        )));
    };
    let argv = spec
        .argv
        .iter()
        .map(|a| cstring(a))
        .collect::<Result<Vec<_>, _>>()?;
    let env: Vec<(OsString, OsString)> = match &spec.env {
        Some(env) => env.clone(),
        None => std::env::vars_os().collect(),
    };
    let path_var = env
        .iter()
        .find(|(k, _)| k == "PATH")
        .map(|(_, v)| v.as_os_str());
    let candidates = exec_candidates(argv0, path_var)?;
    let envp = env
        .iter()
        .map(|(k, v)| {
            let mut kv = k.clone();
            kv.push("=");
            kv.push(v);
            cstring(&kv)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let cwd = spec
        .cwd
        .as_deref()
        .map(|p| cstring(p.as_os_str()))
        .transpose()?;
    let null_fd = match &spec.stdio {
        SpawnStdio::Inherit => None,
        SpawnStdio::Null | SpawnStdio::Log | SpawnStdio::Given(_) => Some(rustix::fs::open(
            "/dev/null",
            rustix::fs::OFlags::RDWR | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )?),
    };
    let logged = spec.stdio.needs_log();
    let given = match &spec.stdio {
        SpawnStdio::Given(g) => g.clone(),
        _ => GivenStdio::default(),
    };
    let log_fd = match (logged, &spec.log_file) {
        (true, Some(path)) => Some(rustix::fs::open(
            path,
            rustix::fs::OFlags::WRONLY
                | rustix::fs::OFlags::APPEND
                | rustix::fs::OFlags::CREATE
                | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::from_raw_mode(0o600),
        )?),
        (true, None) => {
            return Err(ProcError::Io(std::io::Error::other(
                "stdio Log needs a log file",
            )));
        }
        (false, _) => None,
    };
    let tty_fd = spec
        .tty
        .as_deref()
        .map(|path| {
            rustix::fs::open(
                path,
                rustix::fs::OFlags::RDWR | rustix::fs::OFlags::NOCTTY | rustix::fs::OFlags::CLOEXEC,
                rustix::fs::Mode::empty(),
            )
        })
        .transpose()?;
    let mut argv_ptrs: Vec<*const libc::c_char> = argv.iter().map(|a| a.as_ptr()).collect();
    argv_ptrs.push(std::ptr::null());
    let mut envp_ptrs: Vec<*const libc::c_char> = envp.iter().map(|e| e.as_ptr()).collect();
    envp_ptrs.push(std::ptr::null());

    // SAFETY: sigset_t and sigaction are plain C structs for which all-zero is
    // a valid value; sigemptyset initialises the set it is given.
    let (empty_mask, default_action) = unsafe {
        let mut mask: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut mask);
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = libc::SIG_DFL;
        libc::sigemptyset(&mut action.sa_mask);
        (mask, action)
    };
    Ok(Prepared {
        _argv: argv,
        argv_ptrs,
        _envp: envp,
        envp_ptrs,
        candidates,
        cwd,
        null_fd,
        log_fd,
        given,
        tty_fd,
        umask: spec.umask.map(|m| m as libc::mode_t),
        creds: spec
            .credentials
            .as_ref()
            .map(|c| (c.uid, c.gid, c.groups.clone())),
        rlimits: spec
            .credentials
            .iter()
            .flat_map(|c| &c.rlimits)
            .map(|r| {
                let v = |x: u64| {
                    if x == u64::MAX {
                        libc::RLIM_INFINITY
                    } else {
                        x
                    }
                };
                (
                    r.resource,
                    libc::rlimit {
                        rlim_cur: v(r.soft),
                        rlim_max: v(r.hard),
                    },
                )
            })
            .collect(),
        cgroups_v1: spec
            .credentials
            .iter()
            .flat_map(|c| &c.cgroups_v1)
            .map(|f| {
                rustix::fs::open(
                    f,
                    rustix::fs::OFlags::WRONLY | rustix::fs::OFlags::CLOEXEC,
                    rustix::fs::Mode::empty(),
                )
                .map_err(|e| ProcError::cgroup(f, e.into()))
            })
            .collect::<Result<_, _>>()?,
        empty_mask,
        default_action,
        sigmax: libc::SIGRTMAX(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exec_candidates_are_execvps_in_path_order() {
        let c = |name: &str, path: &str| {
            exec_candidates(OsStr::new(name), Some(OsStr::new(path)))
                .expect("candidates")
                .into_iter()
                .map(|c| c.into_string().expect("utf-8"))
                .collect::<Vec<_>>()
        };
        assert_eq!(c("tool", "/a:/b"), ["/a/tool", "/b/tool"]);
        assert_eq!(c("tool", "/a::/b"), ["/a/tool", "./tool", "/b/tool"]);
        assert_eq!(c("./x/tool", "/a"), ["./x/tool"], "a slash: no search");
        assert!(exec_candidates(OsStr::new("a\0b"), None).is_err());
    }
}
