//! What only Linux has, answered the same way where it is missing (Windows,
//! macOS): the proc connector, a pseudo-terminal for `run --tty`, parents
//! shared by trees, cgroup delegation, OOM counts, a log's punched holes,
//! a wait channel, a boot clock, credentials with no limits of their own;
//! and the released root, which holds no pidfd there. Those two OS folders take this file as their `linux_only` module
//! (`#[path]`), as they take `listed.rs`.

use std::path::Path;
use std::time::{Duration, Instant};

use super::unsupported;
use crate::proc::{GroupRecord, Identity, LayoutReport, ProcError, ProcEvent};

/// A released tree root.
#[derive(Debug)]
pub struct Spawned {
    pub pid: i32,
    pub pgid: i32,
    pub sid: i32,
    pub cgroup: Option<std::path::PathBuf>,
    pub identity: Identity,
}

impl Spawned {
    pub fn group_record(&self) -> GroupRecord {
        GroupRecord {
            pgid: self.pgid,
            sid: self.sid,
            leader: self.identity.clone(),
        }
    }
}

/// The credentials a tree's child would take (a tree as another user is
/// not spawned here: refused on Windows, not yet on macOS).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Credentials {
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
}

/// How a shared parent's name marks it (Linux's, for the shared code).
pub const SHARED_PARENT_MARK: &str = "-p-";

/// No parent is shared by trees here (`serve --principal-*` is refused at
/// start): none is named as one.
pub fn is_shared_parent(_dir: &Path) -> bool {
    false
}

/// Nothing to remove (see [`is_shared_parent`]).
pub fn remove_shared_parent_if_empty(_dir: &Path) -> Result<bool, ProcError> {
    Ok(false)
}

/// Whether a shared parent container can hold several trees' containers
/// under limits of its own (a principal's): no, no shared parent is made here.
pub const SHARED_PARENT_LIMITS: bool = false;

/// Nothing to take over: the layout as it is.
pub fn take_delegation(root: &Path) -> Result<LayoutReport, ProcError> {
    Ok(super::layout(root))
}

/// No OOM killer counts a tree's kills here.
pub fn oom_kills(_dir: &Path) -> Option<u64> {
    None
}

/// The log cap: the oldest bytes cannot be punched out of a file here;
/// the file is left as it is (0 bytes dropped).
pub fn cap_log(_path: &Path, _cap: u64) -> std::io::Result<u64> {
    Ok(0)
}

/// No wait channel is read here.
pub fn wchan(_pid: i32) -> Option<String> {
    None
}

/// No start-time clock counts from boot here.
pub fn boot_ticks_now() -> Option<u64> {
    None
}

/// The uid as [`super::details`] reads it.
pub fn uid_of(pid: i32) -> Option<u32> {
    super::details(pid).uid
}

/// Whether [`reserve_past_end`] can hold room here: no (no `fallocate`
/// with `KEEP_SIZE`).
pub const RESERVES_PAST_END: bool = false;

/// Never called where [`RESERVES_PAST_END`] is false: says so.
pub fn reserve_past_end(_file: &std::fs::File, _bytes: u64) -> std::io::Result<()> {
    Err(std::io::ErrorKind::Unsupported.into())
}

/// The proc connector: Linux only. [`Connector::open`] is refused, so the
/// observer never starts (`--observer auto` goes on with scans).
#[derive(Debug)]
pub struct Connector(());

#[derive(Clone, Debug)]
pub struct ConnectorWaker(());

impl ConnectorWaker {
    pub fn wake(&self) {}
}

impl Connector {
    pub fn open(_rcvbuf: usize) -> Result<Connector, ProcError> {
        Err(unsupported("proc connector (it is Linux's)"))
    }
    pub fn recv(&mut self, _timeout: Duration) -> Result<Vec<ProcEvent>, ProcError> {
        Ok(Vec::new())
    }
    pub fn waker(&self) -> ConnectorWaker {
        ConnectorWaker(())
    }
    pub fn filter_to(&self, _interest: &[i32]) -> Result<(), ProcError> {
        Ok(())
    }
    pub fn rcvbuf(&self) -> Result<usize, ProcError> {
        Ok(0)
    }
}

/// A monotonic clock in ns (this process's; only compared with itself).
pub fn monotonic_ns() -> u64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// `run --tty`: no pseudo-terminal is offered here (why: the OS folder's
/// `PTY_MISSING`); stdin is never taken as a terminal, so `run` never asks
/// for one.
pub mod tty {
    use crate::proc::ProcError;
    use std::fs::File;

    pub struct Pty {
        master: File,
        slave: std::path::PathBuf,
    }

    impl Pty {
        pub fn open() -> Result<Self, ProcError> {
            Err(super::unsupported(super::super::PTY_MISSING))
        }
        pub fn slave(&self) -> &std::path::Path {
            &self.slave
        }
        pub fn master(&self) -> &File {
            &self.master
        }
        pub fn copy_size_from_stdin(&self) {}
    }

    pub fn copy_stdin_size_to(_master: &File) {}

    pub fn stdin_is_tty() -> bool {
        false
    }

    pub struct RawTerminal(());

    impl RawTerminal {
        pub fn enter() -> Result<Option<Self>, ProcError> {
            Ok(None)
        }
    }

    /// Restores the caller's terminal on Linux; never made here.
    impl Drop for RawTerminal {
        fn drop(&mut self) {}
    }
}
