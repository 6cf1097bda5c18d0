//! The spawn interface on macOS: its types, and a refusal. No tree is
//! spawned on macOS yet (`run` and `serve` refuse before they get here):
//! the held spawn (fork, new session and group, held on a pipe until
//! recorded) is Linux's `boundary/` and has not been run on macOS.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::Spawned;
use crate::config::BoundaryChoice;
use crate::proc::{BoundaryKind, ExecFailure, ExecFailureKind, Identity, ProcError, SpawnSpec};

/// The kinds a tree can be given here, and the OS a refusal names.
pub const BOUNDARY_KINDS: (&str, &[BoundaryKind]) = (" on macOS", &[BoundaryKind::Session]);

/// No cgroup root on macOS.
pub fn cgroup_root(_override: Option<&Path>) -> Result<Option<PathBuf>, ProcError> {
    Ok(None)
}

/// `auto` and `session` are the session boundary; `cgroup` is refused.
pub fn resolve_boundary(
    choice: BoundaryChoice,
    _root: Option<&Path>,
) -> Result<BoundaryKind, ProcError> {
    match choice {
        BoundaryChoice::Auto | BoundaryChoice::Session => Ok(BoundaryKind::Session),
        BoundaryChoice::Cgroup => Err(ProcError::NoCgroup(
            "macOS has no cgroups (use --boundary session or auto)".into(),
        )),
    }
}

/// How a failed spawn reads here: `spawn failed`, without errno's words.
pub const EXEC_OTHER_FAILURE: &str = "spawn failed";
pub const EXEC_ERRNO_IS_THE_OS: bool = false;

/// A held root: never made on macOS ([`spawn_held`] refuses).
#[derive(Debug)]
pub struct HeldChild {
    pub pid: i32,
    pub pgid: i32,
    pub sid: i32,
    pub cgroup: Option<PathBuf>,
    pub born_in_container: bool,
    pub identity: Identity,
}

/// Refused: no tree is spawned on macOS yet.
pub fn spawn_held(_spec: &SpawnSpec) -> Result<HeldChild, ProcError> {
    Err(super::exits::unsupported(
        "held spawn in treewarden yet (macOS is compile-checked only)",
    ))
}

impl HeldChild {
    pub fn release(self) -> Result<Spawned, ExecFailure> {
        Err(ExecFailure {
            program: String::new(),
            errno: 0,
            kind: ExecFailureKind::Other,
        })
    }

    pub fn cancel(self) -> Result<(), ProcError> {
        Ok(())
    }
}

/// No cgroup to remove: done.
pub fn remove_cgroup_if_empty(_path: &Path) -> Result<bool, ProcError> {
    Ok(true)
}

pub fn remove_cgroup_when_empty(_path: &Path, _wait: Duration) -> Result<bool, ProcError> {
    Ok(true)
}
