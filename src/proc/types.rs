//! The process layer's OS-neutral types: declared once, here, and
//! re-exported by each OS's folder under `sys/` (whose functions fill them).
//! A type whose fields differ per OS (it holds an OS handle, or its
//! serialized form differs) stays in its OS's folder.

use std::ffi::OsString;
use std::path::PathBuf;

use crate::proc::SpawnStdio;

/// The boundary a tree was actually given (recorded on every tree row as
/// its lowercase name): the container vocabulary every OS shares, each OS
/// giving the kinds it has (Linux: `cgroup`, `session`; Windows: `job`;
/// macOS: `session`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BoundaryKind {
    /// Its own cgroup v2 (`<root>/tw-<ledger>-<id>`, or
    /// `<root>/tw-<ledger>-p-<principal>/tw-<ledger>-<id>` under
    /// `serve --principal-*`) plus its own session and group (Linux).
    Cgroup,
    /// Its own session and process group only.
    Session,
    /// Its own named Job Object (`job:<name>`) and console process group
    /// (Windows).
    Job,
}

impl BoundaryKind {
    /// Whether the boundary is a kernel container the teardown kills as one
    /// (a cgroup, a job).
    pub fn contained(self) -> bool {
        matches!(self, BoundaryKind::Cgroup | BoundaryKind::Job)
    }

    /// The kind a recorded name names, whatever this host offers (its
    /// `FromStr` takes only the kinds this OS can give).
    pub fn recorded(name: &str) -> Option<BoundaryKind> {
        [
            BoundaryKind::Cgroup,
            BoundaryKind::Session,
            BoundaryKind::Job,
        ]
        .into_iter()
        .find(|b| b.as_str() == name)
    }

    /// Its recorded name (`cgroup`, `session`, `job`).
    pub fn as_str(self) -> &'static str {
        match self {
            BoundaryKind::Cgroup => "cgroup",
            BoundaryKind::Session => "session",
            BoundaryKind::Job => "job",
        }
    }
}

impl std::str::FromStr for BoundaryKind {
    type Err = String;
    /// Only the kinds this OS can give ([`crate::proc::BOUNDARY_KINDS`]).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (on, kinds) = crate::proc::BOUNDARY_KINDS;
        if let Some(k) = kinds.iter().find(|k| k.as_str() == s) {
            return Ok(*k);
        }
        let names: Vec<&str> = kinds.iter().map(|k| k.as_str()).collect();
        Err(format!(
            "unknown boundary kind {s:?}{on}: expected {}",
            names.join(" or ")
        ))
    }
}

impl std::fmt::Display for BoundaryKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One probed capability.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Capability {
    pub available: bool,
    /// What was found, or why it is unavailable.
    pub note: String,
}

impl Capability {
    pub(crate) fn yes(note: impl Into<String>) -> Self {
        Capability {
            available: true,
            note: note.into(),
        }
    }
    pub(crate) fn no(note: impl Into<String>) -> Self {
        Capability {
            available: false,
            note: note.into(),
        }
    }
}

/// A key of `cgroup.events`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CgroupEvent {
    /// A live process is in the cgroup or below.
    Populated,
    /// The cgroup and its descendants are frozen.
    Frozen,
}

/// One control file to set in a tree's cgroup (`pids.max` = `20`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CgroupSetting {
    pub controller: &'static str,
    pub file: &'static str,
    pub value: String,
}

/// Usage of one container: a cgroup and its descendants, or a job.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ContainerUsage {
    pub cpu_usec: Option<u64>,
    pub memory_peak_bytes: Option<u64>,
    pub pids_peak: Option<u64>,
    pub io_read_bytes: Option<u64>,
    pub io_write_bytes: Option<u64>,
    /// `oom_kill` of `memory.events`: processes the kernel's OOM killer
    /// ended in this cgroup and its descendants.
    pub oom_kills: Option<u64>,
}

/// What happened to a signal aimed at one identity.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Delivery {
    /// Delivered to the recorded process.
    Sent,
    /// The process is dead (no such pid, or a zombie). Nothing sent.
    Gone,
    /// The pid now belongs to another process. Nothing sent.
    Recycled,
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
#[error("cannot execute {program}: {}{}", self.what(), self.os_error())]
pub struct ExecFailure {
    pub program: String,
    pub errno: i32,
    pub kind: ExecFailureKind,
}

impl ExecFailure {
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
            // "exec failed", "CreateProcess failed", "spawn failed".
            ExecFailureKind::Other => super::sys::EXEC_OTHER_FAILURE,
            ExecFailureKind::Died => "the held child died before release",
        }
    }

    /// ` (<the OS's words for errno>)` where the errno is the OS's own
    /// (`EXEC_ERRNO_IS_THE_OS`: Linux's exec), else nothing.
    fn os_error(&self) -> String {
        if super::sys::EXEC_ERRNO_IS_THE_OS {
            format!(" ({})", std::io::Error::from_raw_os_error(self.errno))
        } else {
            String::new()
        }
    }
}

/// What [`Reaper::on_exit`] calls, on the reaper thread: it must not block.
pub type ExitCallback = Box<dyn FnOnce(ExitStatus) + Send>;

/// How a child ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ExitStatus {
    /// `exit(code)`.
    Exited(i32),
    /// Killed by signal N.
    Signaled(i32),
}

impl ExitStatus {
    /// The code a shell would report: the exit code, or 128 + N for signal N.
    pub fn code_for_shell(self) -> i32 {
        match self {
            ExitStatus::Exited(code) => code,
            ExitStatus::Signaled(sig) => 128 + sig,
        }
    }
}

impl std::fmt::Display for ExitStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ExitStatus::Exited(code) => write!(f, "exited with code {code}"),
            ExitStatus::Signaled(sig) => write!(f, "killed by signal {sig}"),
        }
    }
}

/// What happened to a signal aimed at a recorded group.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupDelivery {
    /// `killpg(pgid)` was sent. `members`: the live members a walk found just
    /// before, or, when the caller named candidates and one of them was
    /// re-read live in the group, the number of candidates it named.
    Sent { members: usize },
    /// No live member: nothing to signal, nothing sent.
    Empty,
    /// The group with that pgid is not provably the recorded one. Nothing sent.
    NotRecorded(String),
}

/// A tree's process group, recorded once at spawn.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GroupRecord {
    pub pgid: i32,
    pub sid: i32,
    /// The group leader as spawned (pid == pgid).
    pub leader: Identity,
}

/// One process, named so that a recycled pid can never be mistaken for it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Identity {
    pub pid: i32,
    /// Field 22 of `/proc/<pid>/stat`: start time after boot in clock ticks.
    pub start_ticks: u64,
    /// `/proc/sys/kernel/random/boot_id` when the identity was read; start
    /// ticks are only comparable within one boot.
    pub boot_id: String,
}

/// Where the cgroup root sits, as far as limits are concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Layout {
    /// The hierarchy's root cgroup (no "no internal processes" rule there).
    Root,
    /// A non-root cgroup with no process of its own (after treewarden moved
    /// itself into its leaf, or one it was pointed at): controllers can be
    /// enabled for tree cgroups.
    Delegated,
    /// A non-root cgroup that holds processes other than treewarden: trees
    /// get cgroups, limits are refused.
    Shared,
    /// Tree cgroups cannot be made here (not writable: not delegated to us).
    NotDelegated,
}

/// What [`layout`] found, with the reason in words.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct LayoutReport {
    pub layout: Layout,
    /// Whether a tree's limits can be enforced under this root.
    pub limits: bool,
    pub note: String,
    /// Where this process would live (or lives) when it delegates.
    pub supervisor: Option<PathBuf>,
}

/// What became of the process an [`Identity`] names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Liveness {
    /// The pid is held by this very process, and it is not a zombie.
    Same,
    /// The process is dead: no process has the pid, or it is this process as
    /// a zombie (dead, only its status awaits reaping; it can run no code and
    /// signals to it do nothing), or the identity is from an earlier boot and
    /// nothing holds the pid.
    Gone,
    /// The pid is held by a different process (different start time or boot).
    Recycled,
    /// `/proc` could not be read. Callers treat this as alive for owners (a
    /// missed reap is recoverable) and as "do not signal" for targets.
    Unreadable,
}

/// A process within this boot: its pid and start time. Two processes that
/// held the same pid have different keys (the key of [`Identity`] without
/// the boot, for sets and maps of one boot's processes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ProcKey {
    pub pid: i32,
    /// Field 22 of `/proc/<pid>/stat`.
    pub start_ticks: u64,
}

/// The signals treewarden sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Sig {
    Term,
    Kill,
    Stop,
    Cont,
    Int,
    Hup,
    Quit,
    Usr1,
    Usr2,
}

impl std::fmt::Display for Sig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

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
    /// The tree's container, made and joined before the command runs: on
    /// Linux its cgroup directory (e.g. `<root>/tw-<ledger>-<id>`, or below
    /// a shared parent: see `parent_settings`), on Windows its Job Object
    /// (`job:<name>`); `None` = session and process group only. Recorded in
    /// the tree row's `cgroup` column.
    pub container: Option<PathBuf>,
    /// Control files written in the tree's cgroup right after it is made,
    /// before the child joins it (limits). The controller is enabled in the
    /// parent's `cgroup.subtree_control` first when it is not yet.
    pub cgroup_settings: Vec<CgroupSetting>,
    /// Control files of `cgroup`'s parent when that parent is shared by
    /// several trees (a principal's, `serve --principal-*`; named
    /// `tw-<8 hex>-p-<key>`, [`super::is_shared_parent`]). Non-empty: the
    /// parent is made if absent, its controllers enabled in its own parent
    /// (the cgroup root) and in its `cgroup.subtree_control` (so each tree
    /// in it keeps its own `memory.events` and usage files), and these are
    /// written there before the tree's cgroup is made in it; it is removed
    /// with its last tree ([`super::remove_cgroup_when_empty`]). Empty:
    /// `cgroup`'s parent is the root, left as it is.
    pub parent_settings: Vec<CgroupSetting>,
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

/// One process event. Pids are thread-group ids (process ids) unless named
/// otherwise; events about threads other than a group's leader are dropped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProcEvent {
    /// A new process (not a thread) `child` was forked by process `parent`.
    Fork {
        parent: i32,
        child: i32,
        /// Kernel time of the event (`CLOCK_MONOTONIC` ns, as [`monotonic_ns`]).
        at_ns: u64,
    },
    /// `pid` called execve.
    Exec { pid: i32, at_ns: u64 },
    /// `pid` called setsid(): it leads a new session and group (`sid == pid`).
    Sid { pid: i32, at_ns: u64 },
    /// Process `pid` exited (its last thread did).
    Exit {
        pid: i32,
        status: ExitStatus,
        at_ns: u64,
    },
    /// The socket's receive buffer overflowed: events were lost. The reader
    /// must not trust its incremental view until it has re-scanned.
    Overflow,
}

/// One user as the user database knows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UserInfo {
    pub name: String,
    pub uid: u32,
    /// The primary group.
    pub gid: u32,
    pub home: std::path::PathBuf,
    pub shell: std::path::PathBuf,
}

/// What an incident reviewer needs about a member, read once, the first time
/// it is seen (these reads are too costly for every tick).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemberDetails {
    pub uid: Option<u32>,
    pub exe: Option<String>,
    pub cmdline: Vec<String>,
    pub cwd: Option<String>,
    pub cgroup: Option<String>,
    /// Who these details were read from, as its stat said in the same read
    /// (one `/proc/<pid>` handle): details are read by pid, after a scan
    /// read the process, and the caller checks they are of the process
    /// the scan saw. `None` where it could not be read.
    pub read_from: Option<Lineage>,
}

/// A process's start and the ids it was read with: what tells the process
/// a scan read from another that took its pid within the same clock tick.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Lineage {
    pub start_ticks: u64,
    pub ppid: i32,
    pub pgid: i32,
    pub sid: i32,
}

/// `treewarden doctor`'s answer as this OS words it (`doctor_report`):
/// one JSON text, or a table's rows (name, value, note).
#[derive(Debug)]
pub enum DoctorReport {
    Json(String),
    Table(Vec<(&'static str, String, String)>),
}

impl ProcKey {
    pub fn new(pid: i32, start_ticks: u64) -> Self {
        Self { pid, start_ticks }
    }
}

impl Identity {
    /// The identity within its boot.
    pub fn key(&self) -> ProcKey {
        ProcKey::new(self.pid, self.start_ticks)
    }
}

/// A process's stat ([`crate::proc::ProcEntry`], the one model of it) and
/// its real uid (Linux: the owner of `/proc/<pid>`; 0 on Windows, whose
/// entry has no sizes and its console group only for a root this process
/// spawned). Derefs to its entry (`stat.start_ticks`, `stat.ppid`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ProcStat {
    #[serde(flatten)]
    pub entry: crate::proc::ProcEntry,
    pub uid: u32,
}

impl std::ops::Deref for ProcStat {
    type Target = crate::proc::ProcEntry;

    fn deref(&self) -> &crate::proc::ProcEntry {
        &self.entry
    }
}

impl ProcStat {
    /// A zombie (`Z`) or dead (`X`) process: it runs no code any more
    /// ([`crate::proc::ProcEntry::is_live`]'s letters).
    pub fn is_dead(&self) -> bool {
        !self.entry.is_live()
    }
}
