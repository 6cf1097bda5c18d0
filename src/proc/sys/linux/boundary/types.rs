//! What a held spawn is asked for and what it answers: the boundary kind,
//! the spec (argv, env, stdio, cgroup and its settings, credentials, tty),
//! and an exec's failure as the shell reports it. Plain data: no syscall.

use crate::proc::{BoundaryKind, ExecFailure, ExecFailureKind};

/// The kinds a tree can be given here (the OS named in a refusal: none).
pub const BOUNDARY_KINDS: (&str, &[BoundaryKind]) =
    ("", &[BoundaryKind::Cgroup, BoundaryKind::Session]);

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
    fn boundary_kinds_parse_as_linux_gives_them() {
        assert_eq!("session".parse::<BoundaryKind>(), Ok(BoundaryKind::Session));
        assert_eq!(
            "job".parse::<BoundaryKind>(),
            Err("unknown boundary kind \"job\": expected cgroup or session".to_owned())
        );
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
