//! What a held spawn is asked for and what it answers: the boundary kind,
//! the spec (argv, env, stdio, cgroup and its settings, credentials, tty),
//! and an exec's failure as the shell reports it. Plain data: no syscall.

use crate::proc::{BoundaryKind, ExecFailure, ExecFailureKind};
use std::os::fd::{AsRawFd, OwnedFd};

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
    /// written, to [`crate::proc::SpawnSpec::log_file`] (created 0600).
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

/// How a failed exec reads here: `exec failed`, with errno's own words.
pub const EXEC_OTHER_FAILURE: &str = "exec failed";
pub const EXEC_ERRNO_IS_THE_OS: bool = true;

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
