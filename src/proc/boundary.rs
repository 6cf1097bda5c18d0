//! Ownership boundaries, formed at spawn (DESIGN rule 1).
//!
//! [`spawn_held`] forks a child that, before it runs anything of the command,
//! makes itself a session and process-group leader (`setsid`: pgid = sid =
//! pid), sets up stdio and cwd, closes every other inherited descriptor, and
//! then blocks on a pipe. When the tree has a cgroup the child is born in it
//! (`clone3` with `CLONE_INTO_CGROUP`), or, where the kernel refuses that,
//! the parent moves it there meanwhile. The caller can now record the tree durably and then
//! [`HeldChild::release`] it to `execve`, or [`HeldChild::cancel`] it: work
//! that cannot be recorded is never started.
//!
//! Why not `std::process::Command`: `spawn` returns only after exec, so it
//! cannot hold a child, and its `pre_exec` hook cannot wait for the parent to
//! join the child to a cgroup. The fork/exec path here follows the same
//! discipline as std: everything the child needs is allocated before `fork`,
//! and the child makes only async-signal-safe calls until `execve` or `_exit`.
//!
//! It must never: run command code before release; leave a held child behind
//! (dropping a [`HeldChild`] cancels it); remove a cgroup that still has
//! processes (the kernel refuses, and so do we).

use std::ffi::{CString, OsStr, OsString};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rustix::io::Errno;

use super::ProcError;
use super::identity::{Identity, identity_of};
use super::reaper::{Reaper, reap_child};
use super::signal::{GroupRecord, cgroup_populated};
use crate::config::BoundaryChoice;

/// The boundary a tree was actually given (recorded on every tree row).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BoundaryKind {
    /// Its own cgroup v2 (`<root>/tw-<ledger>-<id>`) plus its own session and group.
    Cgroup,
    /// Its own session and process group only.
    Session,
}

impl std::fmt::Display for BoundaryKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BoundaryKind::Cgroup => "cgroup",
            BoundaryKind::Session => "session",
        })
    }
}

impl std::str::FromStr for BoundaryKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "cgroup" => Ok(BoundaryKind::Cgroup),
            "session" => Ok(BoundaryKind::Session),
            other => Err(format!(
                "unknown boundary kind {other:?}: expected cgroup or session"
            )),
        }
    }
}

/// The cgroup2 mount point (from `/proc/self/mountinfo`), if any.
pub fn cgroup2_mount() -> Result<Option<PathBuf>, ProcError> {
    Ok(cgroup2_mount_entry()?.map(|(mount, _)| mount))
}

/// (mount point, root of the mount inside the hierarchy) of the first cgroup2 mount.
fn cgroup2_mount_entry() -> Result<Option<(PathBuf, String)>, ProcError> {
    let me = procfs::process::Process::myself().map_err(|e| ProcError::Proc(e.to_string()))?;
    let mounts = me
        .mountinfo()
        .map_err(|e| ProcError::Proc(format!("mountinfo: {e}")))?;
    Ok(mounts
        .into_iter()
        .find(|m| m.fs_type == "cgroup2")
        .map(|m| (m.mount_point, m.root)))
}

/// The cgroup v2 directory the calling process lives in: the cgroup2 mount
/// joined with our `0::` path from `/proc/self/cgroup`. `None` when there is
/// no cgroup2 mount or our cgroup lies outside it.
pub fn own_cgroup_dir() -> Result<Option<PathBuf>, ProcError> {
    let Some((mount, mount_root)) = cgroup2_mount_entry()? else {
        return Ok(None);
    };
    let me = procfs::process::Process::myself().map_err(|e| ProcError::Proc(e.to_string()))?;
    let groups = me
        .cgroups()
        .map_err(|e| ProcError::Proc(format!("/proc/self/cgroup: {e}")))?;
    let Some(v2) = groups.0.into_iter().find(|g| g.hierarchy == 0) else {
        return Ok(None);
    };
    // Inside a cgroup namespace or a bind mount the mount's root is not "/";
    // our path must lie below it to be reachable through this mount.
    let Some(rel) = Path::new(&v2.pathname)
        .strip_prefix(&mount_root)
        .ok()
        .map(Path::to_path_buf)
    else {
        return Ok(None);
    };
    let dir = if rel.as_os_str().is_empty() {
        mount
    } else {
        mount.join(rel)
    };
    Ok(dir.join("cgroup.procs").exists().then_some(dir))
}

/// Where tree cgroups go: the override (`TREEWARDEN_CGROUP_ROOT`,
/// `Config::cgroup_root`) if given, else the cgroup v2 directory of our own
/// process. `Ok(None)` when no cgroup v2 hierarchy is mounted.
///
/// Tree cgroups are made next to our own processes. cgroup v2's "no internal
/// processes" rule does not stop this: it applies only to a cgroup with
/// controllers enabled in `cgroup.subtree_control`, and treewarden enables
/// none (it needs only `cgroup.procs`, `cgroup.kill`, `cgroup.freeze`,
/// `cgroup.events`, which every non-root cgroup has). Under systemd the
/// owning unit needs `Delegate=yes`, or systemd may move or remove them.
pub fn cgroup_root(override_: Option<&Path>) -> Result<Option<PathBuf>, ProcError> {
    match override_ {
        Some(root) if root.join("cgroup.procs").exists() => Ok(Some(root.to_path_buf())),
        Some(root) => Err(ProcError::NoCgroup(format!(
            "{} is not a cgroup v2 directory (no cgroup.procs)",
            root.display()
        ))),
        None => own_cgroup_dir(),
    }
}

/// Whether tree cgroups can be made under `root`: `cgroup.procs` is
/// writable and a probe cgroup is created (and removed again). `Err` is the
/// reason.
pub fn check_cgroup_writable(root: &Path) -> Result<(), String> {
    probe_child_cgroup(root).map(|_| ())
}

/// Which control files a tree cgroup under `root` gets (the root cgroup
/// itself has neither `cgroup.kill` nor `cgroup.freeze`, so a child is
/// created to look). Returns `(cgroup.kill, cgroup.freeze)` present.
pub(crate) fn probe_child_cgroup(root: &Path) -> Result<(bool, bool), String> {
    rustix::fs::access(root.join("cgroup.procs"), rustix::fs::Access::WRITE_OK)
        .map_err(|e| format!("{}/cgroup.procs not writable: {e}", root.display()))?;
    let probe = root.join(format!("treewarden-probe-{}", std::process::id()));
    std::fs::create_dir(&probe)
        .map_err(|e| format!("cannot create a cgroup under {}: {e}", root.display()))?;
    let files = (
        probe.join("cgroup.kill").exists(),
        probe.join("cgroup.freeze").exists(),
    );
    std::fs::remove_dir(&probe)
        .map_err(|e| format!("cannot remove probe cgroup {}: {e}", probe.display()))?;
    Ok(files)
}

/// Resolves the configured choice to the boundary a new tree gets. `Cgroup`
/// without a writable root is an error; `Auto` falls back to `Session`.
pub fn resolve_boundary(
    choice: BoundaryChoice,
    root: Option<&Path>,
) -> Result<BoundaryKind, ProcError> {
    match choice {
        BoundaryChoice::Session => Ok(BoundaryKind::Session),
        BoundaryChoice::Auto => Ok(match root.map(check_cgroup_writable) {
            Some(Ok(())) => BoundaryKind::Cgroup,
            _ => BoundaryKind::Session,
        }),
        BoundaryChoice::Cgroup => match root {
            None => Err(ProcError::NoCgroup(
                "no cgroup v2 hierarchy is mounted".into(),
            )),
            Some(root) => check_cgroup_writable(root)
                .map(|()| BoundaryKind::Cgroup)
                .map_err(ProcError::NoCgroup),
        },
    }
}

/// What the child's stdin/stdout/stderr are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SpawnStdio {
    /// The caller's descriptors 0, 1 and 2.
    Inherit,
    /// `/dev/null` for all three.
    Null,
    /// stdin from `/dev/null`; stdout and stderr appended, interleaved as
    /// written, to [`SpawnSpec::log_file`] (created 0600).
    Log,
    /// Descriptors a client handed over (SCM_RIGHTS on the API's socket)
    /// for 0, 1 and 2; a slot left `None` is as with [`SpawnStdio::Log`]
    /// (stdin `/dev/null`, stdout and stderr the log file).
    Given(GivenStdio),
}

impl SpawnStdio {
    /// Whether the tree needs its log file (`Log`, or given descriptors
    /// that leave stdout or stderr to it).
    pub fn needs_log(&self) -> bool {
        match self {
            SpawnStdio::Log => true,
            SpawnStdio::Given(g) => g.needs_log(),
            SpawnStdio::Inherit | SpawnStdio::Null => false,
        }
    }
}

/// The descriptors of [`SpawnStdio::Given`], in the order 0, 1, 2. Shared
/// (`Arc`) so a spec stays `Clone`; the child gets its own copy by `dup2`.
#[derive(Clone, Debug, Default)]
pub struct GivenStdio(pub [Option<std::sync::Arc<OwnedFd>>; 3]);

impl GivenStdio {
    /// Whether slot `i` (0, 1, 2) is given.
    pub fn has(&self, i: usize) -> bool {
        self.0.get(i).is_some_and(Option::is_some)
    }

    /// Whether the log file is needed (stdout or stderr not given).
    pub fn needs_log(&self) -> bool {
        !(self.has(1) && self.has(2))
    }
}

impl PartialEq for GivenStdio {
    /// The same descriptors, by number.
    fn eq(&self, other: &Self) -> bool {
        let raw = |g: &Self| g.0.each_ref().map(|f| f.as_ref().map(|f| f.as_raw_fd()));
        raw(self) == raw(other)
    }
}

impl Eq for GivenStdio {}

/// Everything needed to spawn one tree root.
#[derive(Clone, Debug)]
pub struct SpawnSpec {
    /// Program and arguments; `argv[0]` is searched in `PATH` like `execvp`.
    pub argv: Vec<OsString>,
    /// Working directory of the child (default: ours).
    pub cwd: Option<PathBuf>,
    /// The complete environment; `None` inherits ours (snapshotted at spawn).
    pub env: Option<Vec<(OsString, OsString)>>,
    pub stdio: SpawnStdio,
    /// The tree's cgroup directory to create and join before exec (e.g.
    /// `<root>/tw-<ledger>-<id>`); `None` = session and process group only.
    pub cgroup: Option<PathBuf>,
    /// Control files written in the tree's cgroup right after it is made,
    /// before the child joins it (limits). The controller is enabled in the
    /// parent's `cgroup.subtree_control` first when it is not yet.
    pub cgroup_settings: Vec<CgroupSetting>,
    /// Where stdout and stderr go with [`SpawnStdio::Log`].
    pub log_file: Option<PathBuf>,
    /// The child's file mode creation mask, when it must not inherit ours
    /// (the service runs with `UMask=0077`; its trees get the usual 022).
    pub umask: Option<u32>,
    /// The credentials the child takes before exec (supplementary groups,
    /// gid, uid), after its cgroup was joined and its stdio set up (the log
    /// file is opened by us, as ourselves), before `chdir` (so the working
    /// directory is checked as the new user). `None`: ours.
    pub credentials: Option<super::Credentials>,
    /// A pseudo-terminal's slave (`/dev/pts/N`) the child makes its
    /// controlling terminal (its own session's: `TIOCSCTTY` right after
    /// `setsid`, so its process group is the terminal's foreground) and its
    /// descriptors 0, 1 and 2 (`run --tty`). Overrides `stdio`.
    pub tty: Option<PathBuf>,
}

/// One control file to set in a tree's cgroup (`pids.max` = `20`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CgroupSetting {
    pub controller: &'static str,
    pub file: &'static str,
    pub value: String,
}

/// Why `execve` (or the last step before it) failed after release.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ExecFailureKind {
    /// No such program (ENOENT, ENOTDIR): exit code 127.
    NotFound,
    /// Found but not executable (EACCES, EPERM, ENOEXEC, EISDIR): 126.
    NotExecutable,
    /// Any other exec error: 125.
    Other,
    /// The held child died (was killed) before it could be released: 125.
    Died,
}

/// A released child that never became the command.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("cannot execute {program}: {} ({})", self.what(), std::io::Error::from_raw_os_error(*errno))]
pub struct ExecFailure {
    pub program: String,
    pub errno: i32,
    pub kind: ExecFailureKind,
}

impl ExecFailure {
    fn new(program: &str, errno: i32) -> Self {
        let kind = match errno {
            libc::ENOENT | libc::ENOTDIR => ExecFailureKind::NotFound,
            libc::EACCES | libc::EPERM | libc::ENOEXEC | libc::EISDIR => {
                ExecFailureKind::NotExecutable
            }
            _ => ExecFailureKind::Other,
        };
        ExecFailure {
            program: program.to_owned(),
            errno,
            kind,
        }
    }

    /// The shell convention: 127 not found, 126 not executable, else 125.
    pub fn exit_code(&self) -> u8 {
        match self.kind {
            ExecFailureKind::NotFound => 127,
            ExecFailureKind::NotExecutable => 126,
            ExecFailureKind::Other | ExecFailureKind::Died => 125,
        }
    }

    fn what(&self) -> &'static str {
        match self.kind {
            ExecFailureKind::NotFound => "command not found",
            ExecFailureKind::NotExecutable => "not executable",
            ExecFailureKind::Other => "exec failed",
            ExecFailureKind::Died => "the held child died before release",
        }
    }
}

/// A forked child in its own session and process group (and cgroup), blocked
/// before exec. Invariant: while a `HeldChild` exists, the child has run no
/// command code and is our unreaped child. Dropping it cancels the child.
#[derive(Debug)]
pub struct HeldChild {
    pub pid: i32,
    /// Recorded once, here: equal to `pid` (the child called `setsid`).
    pub pgid: i32,
    /// Equal to `pid`.
    pub sid: i32,
    /// The cgroup directory the child was joined to, if any.
    pub cgroup: Option<PathBuf>,
    /// Born in its cgroup by `clone3(CLONE_INTO_CGROUP)`; `false` when it
    /// was forked and moved there (`cgroup.procs`), or has no cgroup.
    pub born_in_cgroup: bool,
    pub identity: Identity,
    program: String,
    release_w: Option<OwnedFd>,
    status_r: Option<OwnedFd>,
    pidfd: Option<OwnedFd>,
    finished: bool,
}

/// A released tree root that is running the command.
#[derive(Debug)]
pub struct Spawned {
    pub pid: i32,
    pub pgid: i32,
    pub sid: i32,
    pub cgroup: Option<PathBuf>,
    pub identity: Identity,
    pidfd: Option<OwnedFd>,
}

impl Spawned {
    /// The group record to keep for teardown (never re-resolved later).
    pub fn group_record(&self) -> GroupRecord {
        GroupRecord {
            pgid: self.pgid,
            sid: self.sid,
            leader: self.identity.clone(),
        }
    }

    /// A pidfd for the root (readable once it exits), if the kernel has pidfds.
    pub fn pidfd(&self) -> Option<BorrowedFd<'_>> {
        self.pidfd.as_ref().map(AsFd::as_fd)
    }
}

/// Messages on the status pipe: `[tag, step, errno (4 bytes, native endian)]`.
const MSG_LEN: usize = 6;
const TAG_READY: u8 = b'R';
const TAG_SETUP: u8 = b'S';
const TAG_EXEC: u8 = b'E';
const RELEASE_BYTE: u8 = b'G';
const STEP_NAMES: [&str; 8] = [
    "unknown",
    "setsid",
    "stdio",
    "chdir",
    "signal mask",
    "credentials",
    "the requester's cgroup v1",
    "the requester's limits",
];

/// How long cleanup waits for a killed child and its cgroup to empty.
const CLEANUP_WAIT: Duration = Duration::from_secs(5);

/// Everything the child touches after fork, allocated before it.
struct Prepared {
    _argv: Vec<CString>,
    argv_ptrs: Vec<*const libc::c_char>,
    _envp: Vec<CString>,
    envp_ptrs: Vec<*const libc::c_char>,
    /// Where `execve` is tried, in order (`execvp`'s search, made in the
    /// child after it took the requester's ids and working directory, so
    /// the search sees only what the requester may see: issue 24).
    candidates: Vec<CString>,
    cwd: Option<CString>,
    null_fd: Option<OwnedFd>,
    /// With [`SpawnStdio::Log`]: the log file, for descriptors 1 and 2.
    log_fd: Option<OwnedFd>,
    /// With [`SpawnStdio::Given`]: the given descriptors, put on 0, 1, 2
    /// after the null and log ones.
    given: GivenStdio,
    /// With [`SpawnSpec::tty`]: the terminal's slave, opened without
    /// becoming our controlling terminal.
    tty_fd: Option<OwnedFd>,
    umask: Option<libc::mode_t>,
    /// uid, gid and supplementary groups to take before exec.
    creds: Option<(libc::uid_t, libc::gid_t, Vec<libc::gid_t>)>,
    /// The requester's limits, set before the ids.
    rlimits: Vec<(libc::__rlimit_resource_t, libc::rlimit)>,
    /// The requester's v1 `cgroup.procs`, opened here; the child writes
    /// "0" (itself) to each before the ids.
    cgroups_v1: Vec<OwnedFd>,
    empty_mask: libc::sigset_t,
    default_action: libc::sigaction,
    sigmax: libc::c_int,
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
fn prepare(spec: &SpawnSpec) -> Result<Prepared, ProcError> {
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
    let logged = match &spec.stdio {
        SpawnStdio::Log => true,
        SpawnStdio::Given(g) => g.needs_log(),
        SpawnStdio::Inherit | SpawnStdio::Null => false,
    };
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

/// `clone3(CLONE_INTO_CGROUP)` used as `fork`: the child is born in the
/// cgroup `dir` names, so it is never migrated there. Writing a pid to
/// `cgroup.procs` takes the kernel's cgroup threadgroup lock for writing,
/// which waits for an RCU grace period: 6–19 ms measured here for the one
/// migration a `run` makes (docs/PERFORMANCE.md, session 5), against
/// 0.1–0.2 ms for this. Returns -1 where the kernel refuses it (before 5.7,
/// `ENOSYS` under a seccomp filter that hides clone3, a cgroup it will not
/// take): the caller then forks and writes `cgroup.procs`, which reports
/// the real reason if there is one.
///
/// # Safety
/// As for `fork`: in a multi-threaded process the child may make only
/// async-signal-safe calls until `execve` or `_exit`.
unsafe fn clone_into_cgroup(dir: libc::c_int) -> libc::pid_t {
    /// `struct clone_args` (linux/sched.h): every field 64 bits on every
    /// architecture, so one definition fits all.
    #[repr(C)]
    #[derive(Default)]
    struct CloneArgs {
        flags: u64,
        pidfd: u64,
        child_tid: u64,
        parent_tid: u64,
        exit_signal: u64,
        stack: u64,
        stack_size: u64,
        tls: u64,
        set_tid: u64,
        set_tid_size: u64,
        cgroup: u64,
    }
    /// CLONE_INTO_CGROUP (linux/sched.h, Linux 5.7).
    const CLONE_INTO_CGROUP: u64 = 0x2_0000_0000;
    let Ok(cgroup) = u64::try_from(dir) else {
        return -1;
    };
    let args = CloneArgs {
        flags: CLONE_INTO_CGROUP,
        exit_signal: libc::SIGCHLD as u64,
        cgroup,
        ..CloneArgs::default()
    };
    // SAFETY: `args` is a valid clone_args of the size passed; no CLONE_VM
    // and no stack, so the child runs on a copy of this address space like
    // a forked one, and the caller keeps to fork's rules in it.
    let pid = unsafe {
        libc::syscall(
            libc::SYS_clone3,
            &args as *const CloneArgs,
            std::mem::size_of::<CloneArgs>(),
        )
    };
    libc::pid_t::try_from(pid).unwrap_or(-1)
}

/// The child side, between `fork` and `execve`/`_exit`. Only async-signal-safe
/// calls on memory prepared before the fork: no allocation, no locks.
///
/// # Safety
/// Must be called only in the child of `fork`, once, with descriptors that
/// are open in the child.
// Over 100 lines on purpose: the child's whole life between fork and exec is one async-signal-
// safe sequence on memory prepared before the fork, under the one SAFETY contract above; split,
// that contract would be spread over functions nothing else may call.
unsafe fn child_after_fork(p: &Prepared, release_r: libc::c_int, status_w: libc::c_int) -> ! {
    // SAFETY (whole body): every call below is async-signal-safe (signal(7)
    // lists sigaction, sigprocmask, setsid, dup2, chdir, read, write, execve,
    // _exit; close_range, setgroups, setresgid and setresuid are made as
    // plain syscalls), and every pointer refers to
    // memory owned by `p`, which the parent prepared before fork and which is
    // not freed in the child.
    unsafe {
        let report = |tag: u8, step: u8, errno: i32| {
            let e = errno.to_ne_bytes();
            let msg: [u8; MSG_LEN] = [tag, step, e[0], e[1], e[2], e[3]];
            libc::write(status_w, msg.as_ptr().cast(), MSG_LEN);
        };
        let errno = || *libc::__errno_location();

        // Default dispositions (Rust ignores SIGPIPE; ignored signals would
        // survive exec) and an empty mask.
        for sig in 1..=p.sigmax {
            if sig != libc::SIGKILL && sig != libc::SIGSTOP {
                libc::sigaction(sig, &p.default_action, std::ptr::null_mut());
            }
        }
        if libc::sigprocmask(libc::SIG_SETMASK, &p.empty_mask, std::ptr::null_mut()) != 0 {
            report(TAG_SETUP, 4, errno());
            libc::_exit(125);
        }
        if libc::setsid() < 0 {
            report(TAG_SETUP, 1, errno());
            libc::_exit(125);
        }
        if let Some(null) = &p.null_fd {
            let fd = null.as_raw_fd();
            for target in 0..3 {
                if libc::dup2(fd, target) < 0 {
                    report(TAG_SETUP, 2, errno());
                    libc::_exit(125);
                }
            }
        }
        if let Some(log) = &p.log_fd {
            let fd = log.as_raw_fd();
            for target in 1..3 {
                if libc::dup2(fd, target) < 0 {
                    report(TAG_SETUP, 2, errno());
                    libc::_exit(125);
                }
            }
        }
        // Given descriptors last: each on its own slot. A given descriptor
        // numbered 0..2 in this process is never clobbered first: the
        // service's 0, 1 and 2 are open (never closed), so a received one
        // has a number of 3 or more.
        for (target, fd) in p.given.0.iter().enumerate() {
            if let Some(fd) = fd
                && libc::dup2(fd.as_raw_fd(), target as libc::c_int) < 0
            {
                report(TAG_SETUP, 2, errno());
                libc::_exit(125);
            }
        }
        if let Some(tty) = &p.tty_fd {
            // The new session's controlling terminal (ioctl is a plain
            // syscall); the dup2s leave it on 0, 1 and 2 without CLOEXEC.
            let fd = tty.as_raw_fd();
            if libc::ioctl(fd, libc::TIOCSCTTY, 0) < 0 {
                report(TAG_SETUP, 2, errno());
                libc::_exit(125);
            }
            for target in 0..3 {
                if libc::dup2(fd, target) < 0 {
                    report(TAG_SETUP, 2, errno());
                    libc::_exit(125);
                }
            }
        }
        if let Some(mask) = p.umask {
            libc::umask(mask);
        }
        // The requester's cgroup v1 memberships and limits, while we may
        // still join and raise (both need privilege the ids drop).
        for fd in &p.cgroups_v1 {
            if libc::write(fd.as_raw_fd(), b"0".as_ptr().cast(), 1) != 1 {
                report(TAG_SETUP, 6, errno());
                libc::_exit(125);
            }
        }
        for (resource, limit) in &p.rlimits {
            if libc::setrlimit(*resource, limit) != 0 {
                report(TAG_SETUP, 7, errno());
                libc::_exit(125);
            }
        }
        // The requester's credentials: raw syscalls (not glibc's wrappers,
        // which broadcast to every thread of a process; this child has one),
        // groups first, while we still may set them; gid before uid; real,
        // effective and saved ids alike, so none of ours can be regained.
        if let Some((uid, gid, groups)) = &p.creds
            && (libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()) != 0
                || libc::syscall(libc::SYS_setresgid, *gid, *gid, *gid) != 0
                || libc::syscall(libc::SYS_setresuid, *uid, *uid, *uid) != 0)
        {
            report(TAG_SETUP, 5, errno());
            libc::_exit(125);
        }
        if let Some(cwd) = &p.cwd
            && libc::chdir(cwd.as_ptr()) != 0
        {
            report(TAG_SETUP, 3, errno());
            libc::_exit(125);
        }
        // The command inherits stdio only: close every other descriptor now,
        // so no held child keeps another spawn's pipes (or our files) open.
        let (a, b) = if release_r < status_w {
            (release_r, status_w)
        } else {
            (status_w, release_r)
        };
        let close_range = |lo: libc::c_int, hi: libc::c_uint| {
            if lo >= 0 && (lo as libc::c_uint) <= hi {
                libc::syscall(
                    libc::SYS_close_range,
                    lo as libc::c_uint,
                    hi,
                    0 as libc::c_uint,
                );
            }
        };
        if a > 3 {
            close_range(3, (a - 1) as libc::c_uint);
        }
        if b > a + 1 {
            close_range(a + 1, (b - 1) as libc::c_uint);
        }
        close_range(b + 1, libc::c_uint::MAX);

        report(TAG_READY, 0, 0);
        let mut byte = 0u8;
        let n = loop {
            let n = libc::read(release_r, (&raw mut byte).cast(), 1);
            if n < 0 && errno() == libc::EINTR {
                continue;
            }
            break n;
        };
        if n != 1 || byte != RELEASE_BYTE {
            // The parent cancelled (or died): never run the command.
            libc::_exit(125);
        }
        // `execvp`'s search, as the requester: a candidate that does not
        // exist (or whose directory does not, or is not one) is passed over;
        // one that exists but may not be run (EACCES) is remembered and the
        // search goes on; any other error ends it. Nothing is looked up as
        // the service, so 126 vs 127 says only what the requester could see.
        let mut failure = libc::ENOENT;
        for path in &p.candidates {
            libc::execve(path.as_ptr(), p.argv_ptrs.as_ptr(), p.envp_ptrs.as_ptr());
            match errno() {
                libc::ENOENT | libc::ENOTDIR | libc::ESTALE | libc::ENODEV | libc::ETIMEDOUT => {}
                libc::EACCES => failure = libc::EACCES,
                e => {
                    failure = e;
                    break;
                }
            }
        }
        report(TAG_EXEC, 0, failure);
        libc::_exit(127)
    }
}

/// Reads one status message; `None` on EOF (the write end closed: the child
/// exec'd or died).
fn read_msg(fd: BorrowedFd<'_>) -> Result<Option<[u8; MSG_LEN]>, ProcError> {
    let mut buf = [0u8; MSG_LEN];
    let mut got = 0;
    while got < MSG_LEN {
        match rustix::io::read(fd, &mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok((got == MSG_LEN).then_some(buf))
}

fn msg_errno(msg: &[u8; MSG_LEN]) -> i32 {
    i32::from_ne_bytes([msg[2], msg[3], msg[4], msg[5]])
}

/// Forks `spec` as a held child: in its own session and process group (and
/// cgroup, created here and joined before exec), blocked until
/// [`HeldChild::release`]. When it returns, the child is ready and has run no
/// command code. If a [`Reaper`] is installed the child is announced to it
/// under the same lock as the fork, so its exit is never mistaken for an orphan's.
pub fn spawn_held(spec: &SpawnSpec) -> Result<HeldChild, ProcError> {
    let prepared = prepare(spec)?;
    let program = spec
        .argv
        .first()
        .map(|a| a.to_string_lossy().into_owned())
        .unwrap_or_default();
    if let Some(cg) = &spec.cgroup {
        make_tree_cgroup(cg)?;
        if let Err(e) = apply_settings(cg, &spec.cgroup_settings) {
            let _ = remove_cgroup_when_empty(cg, CLEANUP_WAIT);
            return Err(e);
        }
    }
    let result = fork_held(spec, &prepared, program);
    if result.is_err()
        && let Some(cg) = &spec.cgroup
    {
        let _ = remove_cgroup_when_empty(cg, CLEANUP_WAIT);
    }
    result
}

// Over 100 lines on purpose: the parent's side of the held spawn (the two pipes, clone3 or
// fork, the cgroup join, the child's status read) is one sequence in which every failure reaps
// the child it made; one frame keeps every such path in sight.
fn fork_held(spec: &SpawnSpec, p: &Prepared, program: String) -> Result<HeldChild, ProcError> {
    let (release_r, release_w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
    let (status_r, status_w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;

    // The tree's cgroup, for a child born in it (see `clone_into_cgroup`).
    let cgroup_dir = spec.cgroup.as_ref().and_then(|cg| {
        rustix::fs::open(
            cg,
            rustix::fs::OFlags::RDONLY
                | rustix::fs::OFlags::DIRECTORY
                | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )
        .ok()
    });
    let fork_lock = Reaper::installed().map(Reaper::fork_lock);
    let mut born_in_cgroup = false;
    let mut pid = -1;
    if let Some(dir) = &cgroup_dir {
        // SAFETY: as for fork below: clone3 without CLONE_VM is a fork (the
        // child gets a copy of this address space and returns here with 0).
        pid = unsafe { clone_into_cgroup(dir.as_raw_fd()) };
        born_in_cgroup = pid >= 0;
    }
    if pid < 0 {
        // SAFETY: fork is called with all of the child's memory prepared; the
        // child runs only `child_after_fork` (async-signal-safe calls, no
        // allocation, no locks; the reaper lock held here is never touched in
        // the child) and ends in execve or _exit.
        pid = unsafe { libc::fork() };
    }
    if pid == 0 {
        // SAFETY: we are the child of fork (or of clone3 used as one); both
        // descriptors are open here.
        unsafe { child_after_fork(p, release_r.as_raw_fd(), status_w.as_raw_fd()) }
    }
    if pid < 0 {
        return Err(ProcError::Io(std::io::Error::last_os_error()));
    }
    drop(cgroup_dir);
    if let Some(lock) = fork_lock {
        lock.spawned(pid);
    }
    drop(release_r);
    drop(status_w);

    // The child cannot exit before we kill it or close `release_w`, and it is
    // our unreaped child, so the pid is certainly it.
    let pidfd = rustix::process::Pid::from_raw(pid).and_then(|raw| {
        rustix::process::pidfd_open(raw, rustix::process::PidfdFlags::empty()).ok()
    });
    let mut held = HeldChild {
        pid,
        pgid: pid,
        sid: pid,
        cgroup: None,
        born_in_cgroup,
        identity: Identity {
            pid,
            start_ticks: 0,
            boot_id: String::new(),
        },
        program,
        release_w: Some(release_w),
        status_r: Some(status_r),
        pidfd,
        finished: false,
    };
    // From here on, an early return drops `held`, which kills and reaps it.
    let setup_failure = |msg: &[u8; MSG_LEN]| ProcError::ChildSetup {
        step: STEP_NAMES
            .get(usize::from(msg[1]))
            .copied()
            .unwrap_or("unknown"),
        source: std::io::Error::from_raw_os_error(msg_errno(msg)),
    };
    if let Some(cg) = &spec.cgroup {
        // A child clone3 did not start in the cgroup is moved there now.
        if !born_in_cgroup && let Err(e) = std::fs::write(cg.join("cgroup.procs"), pid.to_string())
        {
            // The child may have failed its own set-up (a cwd closed to the
            // user it now runs as) and exited before it could be moved
            // (ESRCH): its report is the cause. It always reports (ready or
            // failed) or dies, so this read never waits long.
            if let Some(status_r) = held.status_r.as_ref()
                && let Ok(Some(msg)) = read_msg(status_r.as_fd())
                && msg[0] == TAG_SETUP
            {
                return Err(setup_failure(&msg));
            }
            return Err(ProcError::cgroup(cg, e));
        }
        held.cgroup = Some(cg.clone());
    }
    let status_fd = held.status_r.as_ref().map(AsFd::as_fd);
    let Some(status_fd) = status_fd else {
        unreachable!("status pipe is set above");
    };
    match read_msg(status_fd)? {
        Some(msg) if msg[0] == TAG_READY => {}
        Some(msg) if msg[0] == TAG_SETUP => return Err(setup_failure(&msg)),
        _ => {
            return Err(ProcError::Io(std::io::Error::other(
                "the child died before it was held",
            )));
        }
    }
    held.identity = identity_of(pid)?.ok_or_else(|| {
        ProcError::Io(std::io::Error::other("the held child vanished from /proc"))
    })?;
    Ok(held)
}

impl HeldChild {
    /// Lets the child exec. `Ok` once `execve` succeeded (the status pipe was
    /// closed by exec); `Err` when it failed, after the child was reaped and
    /// its cgroup removed.
    pub fn release(mut self) -> Result<Spawned, ExecFailure> {
        let died = |this: &mut Self, errno: i32| {
            let _ = this.teardown();
            ExecFailure {
                program: this.program.clone(),
                errno,
                kind: ExecFailureKind::Died,
            }
        };
        let Some(release_w) = self.release_w.take() else {
            return Err(died(&mut self, libc::EBADF));
        };
        if let Err(e) = rustix::io::write(&release_w, &[RELEASE_BYTE]) {
            return Err(died(&mut self, e.raw_os_error()));
        }
        drop(release_w);
        let msg = match self.status_r.take() {
            Some(status_r) => read_msg(status_r.as_fd()),
            None => Ok(None),
        };
        match msg {
            Ok(None) => {
                self.finished = true;
                Ok(Spawned {
                    pid: self.pid,
                    pgid: self.pgid,
                    sid: self.sid,
                    cgroup: self.cgroup.take(),
                    identity: self.identity.clone(),
                    pidfd: self.pidfd.take(),
                })
            }
            Ok(Some(msg)) if msg[0] == TAG_EXEC => {
                let failure = ExecFailure::new(&self.program, msg_errno(&msg));
                let _ = self.teardown();
                Err(failure)
            }
            Ok(Some(_)) => Err(died(&mut self, libc::EPROTO)),
            Err(ProcError::Io(e)) => Err(died(&mut self, e.raw_os_error().unwrap_or(libc::EIO))),
            Err(_) => Err(died(&mut self, libc::EIO)),
        }
    }

    /// Kills the held child before it ran anything (SIGKILL to our own
    /// unreaped child, through its pidfd when available), reaps it and removes
    /// its cgroup.
    pub fn cancel(mut self) -> Result<(), ProcError> {
        self.teardown()
    }

    fn teardown(&mut self) -> Result<(), ProcError> {
        if self.finished {
            return Ok(());
        }
        self.finished = true;
        // Safe: the child is our unreaped child (it cannot be reaped before
        // we reap it below), so the pid cannot have been recycled.
        let sent = match &self.pidfd {
            Some(fd) => rustix::process::pidfd_send_signal(fd, rustix::process::Signal::KILL),
            None => match rustix::process::Pid::from_raw(self.pid) {
                Some(pid) => rustix::process::kill_process(pid, rustix::process::Signal::KILL),
                None => Ok(()),
            },
        };
        match sent {
            Ok(()) | Err(Errno::SRCH) => {}
            Err(e) => return Err(e.into()),
        }
        self.release_w = None;
        self.status_r = None;
        reap_child(self.pid, Some(CLEANUP_WAIT))?;
        if let Some(cg) = self.cgroup.take()
            && !remove_cgroup_when_empty(&cg, CLEANUP_WAIT)?
        {
            return Err(ProcError::cgroup(
                cg,
                std::io::Error::other("still populated after the held child was killed"),
            ));
        }
        Ok(())
    }
}

impl Drop for HeldChild {
    /// Last line of defence: a held child nobody released is cancelled.
    fn drop(&mut self) {
        if !self.finished
            && let Err(e) = self.teardown()
        {
            tracing::warn!(pid = self.pid, error = %e, "cancelling a dropped held child failed");
        }
    }
}

/// Test hook: from now on `clone3` answers ENOSYS in the calling thread (a
/// seccomp filter, as a container runtime with an older policy installs
/// one), so [`spawn_held`] takes its fork + `cgroup.procs` fallback.
/// Irrevocable for the thread (and sets its no_new_privs): for a test's own
/// re-executed process only, never called by treewarden itself.
#[doc(hidden)]
pub fn deny_clone3_in_this_thread() -> Result<(), ProcError> {
    #[cfg(target_arch = "x86_64")]
    const AUDIT_ARCH: u32 = 0xc000_003e;
    #[cfg(target_arch = "aarch64")]
    const AUDIT_ARCH: u32 = 0xc000_00b7;
    const LD_W_ABS: u16 = 0x20;
    const JEQ_K: u16 = 0x15;
    const RET_K: u16 = 0x06;
    const RET_ERRNO: u32 = 0x0005_0000;
    const RET_ALLOW: u32 = 0x7fff_0000;
    let op = |code: u16, jt: u8, jf: u8, k: u32| libc::sock_filter { code, jt, jf, k };
    let clone3 = u32::try_from(libc::SYS_clone3).unwrap_or(u32::MAX);
    let ops = [
        op(LD_W_ABS, 0, 0, 4), // seccomp_data.arch
        op(JEQ_K, 0, 3, AUDIT_ARCH),
        op(LD_W_ABS, 0, 0, 0), // seccomp_data.nr
        op(JEQ_K, 0, 1, clone3),
        op(RET_K, 0, 0, RET_ERRNO | libc::ENOSYS as u32),
        op(RET_K, 0, 0, RET_ALLOW),
    ];
    let prog = libc::sock_fprog {
        len: ops.len() as u16,
        filter: ops.as_ptr() as *mut libc::sock_filter,
    };
    // SAFETY: prctl with integer arguments, then with a pointer to a
    // sock_fprog that points to `ops`, both alive for the call; the kernel
    // copies the program.
    let r = unsafe {
        if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
            -1
        } else {
            libc::prctl(
                libc::PR_SET_SECCOMP,
                libc::SECCOMP_MODE_FILTER,
                &prog as *const libc::sock_fprog,
            )
        }
    };
    if r != 0 {
        return Err(ProcError::Io(std::io::Error::last_os_error()));
    }
    Ok(())
}

/// Removes a tree's cgroup directory (and any empty sub-cgroups the tree
/// made) if nothing lives in it. `Ok(true)`: the directory is gone (removed
/// now, or already absent). `Ok(false)`: still populated, left in place.
pub fn remove_cgroup_if_empty(path: &Path) -> Result<bool, ProcError> {
    if !path.join("cgroup.procs").exists() {
        return if path.exists() {
            Err(ProcError::cgroup(
                path,
                std::io::Error::other("not a cgroup directory"),
            ))
        } else {
            Ok(true)
        };
    }
    let entries = std::fs::read_dir(path).map_err(|e| ProcError::cgroup(path, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| ProcError::cgroup(path, e))?;
        if entry.file_type().map(|t| t.is_dir()).unwrap_or(false)
            && !remove_cgroup_if_empty(&entry.path())?
        {
            return Ok(false);
        }
    }
    match std::fs::remove_dir(path) {
        Ok(()) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => Ok(false),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(true),
        Err(e) => Err(ProcError::cgroup(path, e)),
    }
}

/// Writes the settings (limits) into a fresh tree cgroup, enabling each
/// controller in the parent's `cgroup.subtree_control` where it is not yet.
/// On failure the controllers this call enabled are disabled again, so a
/// refused spawn leaves the parent as it found it (the caller removes the
/// tree cgroup).
fn apply_settings(cg: &Path, settings: &[CgroupSetting]) -> Result<(), ProcError> {
    let mut enabled: Vec<&str> = Vec::new();
    let result = (|| {
        for s in settings {
            if let Some(parent) = cg.parent()
                && super::delegation::enable_controller(parent, s.controller)?
            {
                enabled.push(s.controller);
            }
            let file = cg.join(s.file);
            std::fs::write(&file, &s.value).map_err(|e| ProcError::cgroup(&file, e))?;
        }
        Ok(())
    })();
    if result.is_err()
        && let Some(parent) = cg.parent()
        && !enabled.is_empty()
    {
        // The tree cgroup goes first, then the controllers it was to use.
        let _ = remove_cgroup_if_empty(cg);
        super::delegation::disable_controllers(parent, &enabled);
    }
    result
}

/// Creates a tree's cgroup. The name is new to the caller's ledger, so a
/// directory already there is a leftover it does not know (another ledger's
/// crash, or a ledger restored from a backup): an *empty* one is removed and
/// made again; a populated one is refused, never joined.
fn make_tree_cgroup(cg: &Path) -> Result<(), ProcError> {
    match std::fs::create_dir(cg) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            if cgroup_populated(cg)? {
                return Err(ProcError::cgroup(
                    cg,
                    std::io::Error::other(
                        "exists and holds processes this ledger does not know; refusing to join it (remove it, or end what it holds)",
                    ),
                ));
            }
            tracing::warn!(cgroup = %cg.display(), "an empty leftover cgroup of this name was removed");
            if !remove_cgroup_if_empty(cg)? {
                return Err(ProcError::cgroup(
                    cg,
                    std::io::Error::other("an empty leftover of this name could not be removed"),
                ));
            }
            std::fs::create_dir(cg).map_err(|e| ProcError::cgroup(cg, e))
        }
        Err(e) => Err(ProcError::cgroup(cg, e)),
    }
}

/// Removes an empty cgroup once the kernel lets go of it, waiting up to
/// `wait` for `populated 0` (the kernel's notification, not a timed poll;
/// [`super::cgroup_wait_event`]); `false` when it stayed populated.
pub fn remove_cgroup_when_empty(path: &Path, wait: Duration) -> Result<bool, ProcError> {
    let deadline = Instant::now() + wait;
    loop {
        if !path.exists() {
            return Ok(true);
        }
        if !super::cgroup_wait_event(path, super::CgroupEvent::Populated, false, deadline)? {
            return Ok(false);
        }
        if remove_cgroup_if_empty(path)? {
            return Ok(true);
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
        // Empty by `cgroup.events` but rmdir still busy: the kernel is
        // finishing the last exit.
        std::thread::sleep(Duration::from_millis(1));
    }
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

    #[test]
    fn exec_failure_kinds_follow_the_shell() {
        let f = |errno| ExecFailure::new("x", errno);
        assert_eq!(f(libc::ENOENT).exit_code(), 127);
        assert_eq!(f(libc::EACCES).exit_code(), 126);
        assert_eq!(f(libc::E2BIG).exit_code(), 125);
        assert_eq!(
            f(libc::ENOENT).to_string(),
            "cannot execute x: command not found (No such file or directory (os error 2))"
        );
    }
}
