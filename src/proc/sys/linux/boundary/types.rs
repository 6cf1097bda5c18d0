//! What a held spawn is asked for and what it answers: the boundary kind,
//! the spec (argv, env, stdio, cgroup and its settings, credentials, tty),
//! and an exec's failure as the shell reports it. Plain data: no syscall.

use std::ffi::OsString;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;

/// The boundary a tree was actually given (recorded on every tree row).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BoundaryKind {
    /// Its own cgroup v2 (`<root>/tw-<ledger>-<id>`, or
    /// `<root>/tw-<ledger>-p-<principal>/tw-<ledger>-<id>` under
    /// `serve --principal-*`) plus its own session and group.
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
    /// `<root>/tw-<ledger>-<id>`, or below a shared parent: see
    /// `parent_settings`); `None` = session and process group only.
    pub cgroup: Option<PathBuf>,
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
    pub(super) fn new(program: &str, errno: i32) -> Self {
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

#[cfg(test)]
mod tests {
    use super::*;

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
