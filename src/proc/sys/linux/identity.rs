//! Process identity: `(pid, start time in clock ticks, boot id)`.
//!
//! A bare pid names whatever process holds that number *now*; an [`Identity`]
//! names one process for the lifetime of the host. Every signal in treewarden
//! is aimed at an identity (or at a group record holding one), never at a pid.
//! This module reads `/proc/<pid>/stat` through the one parser of it
//! ([`super::stat`]) and must never answer "same process" for a pid that
//! was recycled.

use std::sync::OnceLock;

use crate::proc::stat::parse_stat;
use crate::proc::{Identity, Liveness, ProcError, ProcStat};

impl Identity {
    /// Re-reads `/proc` and says whether the pid still holds this process.
    /// Never answers [`Liveness::Same`] for a recycled pid: both the start
    /// ticks and the boot id must match.
    pub fn check(&self) -> Liveness {
        let stat = match read_stat(self.pid) {
            Ok(Some(stat)) => stat,
            Ok(None) => return Liveness::Gone,
            Err(_) => return Liveness::Unreadable,
        };
        let boot = match boot_id() {
            Ok(b) => b,
            Err(_) => return Liveness::Unreadable,
        };
        if boot != self.boot_id || stat.start_ticks != self.start_ticks {
            return Liveness::Recycled;
        }
        if stat.is_dead() {
            Liveness::Gone
        } else {
            Liveness::Same
        }
    }
}

impl std::fmt::Display for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "pid {} (start {})", self.pid, self.start_ticks)
    }
}

static BOOT_ID: OnceLock<String> = OnceLock::new();

/// The current boot id, read once per process.
pub fn boot_id() -> Result<&'static str, ProcError> {
    if let Some(id) = BOOT_ID.get() {
        return Ok(id);
    }
    let id = procfs::sys::kernel::random::boot_id()
        .map_err(|e| ProcError::Proc(format!("boot_id: {e}")))?;
    Ok(BOOT_ID.get_or_init(|| id.trim().to_owned()))
}

/// Reads `/proc/<pid>/stat` and the owner of `/proc/<pid>` through one
/// directory handle (the stat file is opened relative to it, so both are of
/// the process that held the pid at the open). `Ok(None)` means no such
/// process (including pid <= 0).
pub fn read_stat(pid: i32) -> Result<Option<ProcStat>, ProcError> {
    use rustix::fs::{Mode, OFlags};
    use std::os::unix::fs::MetadataExt as _;
    if pid <= 0 {
        return Ok(None);
    }
    let dir = match std::fs::File::open(format!("/proc/{pid}")) {
        Ok(d) => d,
        Err(e) => return not_found_as_none(e, pid),
    };
    let uid = match dir.metadata() {
        Ok(m) => m.uid(),
        Err(e) => return not_found_as_none(e, pid),
    };
    let mut file = match rustix::fs::openat(
        &dir,
        "stat",
        OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    ) {
        Ok(fd) => std::fs::File::from(fd),
        Err(e) => return not_found_as_none(e.into(), pid),
    };
    let mut buf = Vec::with_capacity(1024);
    if let Err(e) = super::pseudo::read_file(&mut file, &mut buf) {
        return not_found_as_none(e, pid);
    }
    match parse_stat(&buf, page_size()) {
        Some(entry) => Ok(Some(ProcStat { entry, uid })),
        None => Err(ProcError::Proc(format!(
            "pid {pid}: /proc/{pid}/stat: malformed or short read"
        ))),
    }
}

/// The page size, read once (the stat file's `rss` is in pages).
fn page_size() -> u64 {
    static PAGE: OnceLock<u64> = OnceLock::new();
    *PAGE.get_or_init(procfs::page_size)
}

/// A vanished process reads as ENOENT (no such directory) or, mid-exit, as
/// ESRCH; both mean "no such process". Any other error is unknown, not gone.
fn not_found_as_none<T>(e: std::io::Error, pid: i32) -> Result<Option<T>, ProcError> {
    match e.raw_os_error() {
        Some(libc::ENOENT | libc::ESRCH) => Ok(None),
        _ if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        _ => Err(ProcError::Proc(format!("pid {pid}: {e}"))),
    }
}

/// The identity of whatever process holds `pid` now (zombies included: a
/// zombie still owns its pid). `Ok(None)` means no such process.
pub fn identity_of(pid: i32) -> Result<Option<Identity>, ProcError> {
    let Some(stat) = read_stat(pid)? else {
        return Ok(None);
    };
    Ok(Some(Identity {
        pid,
        start_ticks: stat.start_ticks,
        boot_id: boot_id()?.to_owned(),
    }))
}

/// The identity of the calling process.
pub fn self_identity() -> Result<Identity, ProcError> {
    let pid = rustix::process::getpid().as_raw_nonzero().get();
    identity_of(pid)?.ok_or_else(|| ProcError::Proc("cannot read /proc/self/stat".into()))
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::process::{Command, Stdio};

    use super::*;

    /// A child that is killed (by its pid) and reaped when dropped.
    struct Child(std::process::Child);

    impl Drop for Child {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    fn sleeper() -> Child {
        Child(
            Command::new("sleep")
                .arg("600")
                .stdin(Stdio::null())
                .spawn()
                .expect("start sleep"),
        )
    }

    #[test]
    fn boot_id_is_the_kernels() {
        let kernel = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .expect("read /proc/sys/kernel/random/boot_id");
        let kernel = kernel.trim();
        assert_eq!(kernel.len(), 36, "a UUID: {kernel:?}");
        assert_eq!(boot_id().expect("boot id"), kernel);
        let me = self_identity().expect("own identity");
        assert_eq!(me.boot_id, kernel);
    }

    /// The stat file of a process that died and was reaped after it was
    /// opened: the read fails with ESRCH, a real answer of the kernel.
    #[test]
    fn an_identity_read_failing_with_esrch_means_no_such_process() {
        let mut child = sleeper();
        let pid = child.0.id() as i32;
        let mut stat = std::fs::File::open(format!("/proc/{pid}/stat")).expect("open stat");
        child.0.kill().expect("kill the child");
        child.0.wait().expect("reap the child");
        let err = stat
            .read_to_end(&mut Vec::new())
            .expect_err("read of a reaped process");
        assert!(
            err.raw_os_error() == Some(libc::ESRCH),
            "precondition: ESRCH as an I/O error, got {err:?}"
        );
        assert!(matches!(not_found_as_none::<ProcStat>(err, pid), Ok(None)));
    }

    /// Any other I/O error is an error ("unreadable"), never "gone": an
    /// owner whose start time cannot be read counts as alive.
    #[test]
    fn an_identity_read_failing_otherwise_is_an_error_not_gone() {
        // Reading a directory: EISDIR, a real I/O error that is not ESRCH.
        let mut dir = std::fs::File::open("/proc/self").expect("open /proc/self");
        let err = dir
            .read_to_end(&mut Vec::new())
            .expect_err("read of a directory");
        assert!(
            err.raw_os_error() == Some(libc::EISDIR),
            "precondition: EISDIR as an I/O error, got {err:?}"
        );
        assert!(not_found_as_none::<ProcStat>(err, 1).is_err());
        let denied = std::io::Error::from_raw_os_error(libc::EACCES);
        assert!(not_found_as_none::<ProcStat>(denied, 1).is_err());
    }

    #[test]
    fn display_names_the_pid_and_its_start() {
        let id = Identity {
            pid: 42,
            start_ticks: 7,
            boot_id: "b".into(),
        };
        assert_eq!(id.to_string(), "pid 42 (start 7)");
    }

    #[test]
    fn a_pid_that_exited_reads_as_no_such_process() {
        let mut child = sleeper();
        let pid = child.0.id() as i32;
        assert!(read_stat(pid).expect("read").is_some());
        child.0.kill().expect("kill");
        child.0.wait().expect("reap");
        assert_eq!(read_stat(pid).expect("read"), None);
        assert_eq!(identity_of(pid).expect("read"), None);
        assert_eq!(read_stat(0).expect("pid 0"), None);
        assert_eq!(read_stat(-1).expect("pid -1"), None);
    }

    #[test]
    fn check_tells_same_recycled_and_gone_apart() {
        let mut child = sleeper();
        let pid = child.0.id() as i32;
        let id = identity_of(pid).expect("read").expect("alive");
        // Field 22 of the stat file, read independently of procfs.
        let mut text = String::new();
        std::fs::File::open(format!("/proc/{pid}/stat"))
            .and_then(|mut f| f.read_to_string(&mut text))
            .expect("read stat");
        let after_comm = text.rsplit_once(')').expect("comm").1;
        let start: u64 = after_comm
            .split_whitespace()
            .nth(19)
            .and_then(|s| s.parse().ok())
            .expect("start ticks");
        assert_eq!(id.start_ticks, start);
        assert_eq!(id.check(), Liveness::Same);

        // The same pid held by a process that started later (or earlier).
        for start_ticks in [id.start_ticks + 1, id.start_ticks - 1] {
            let other = Identity {
                start_ticks,
                ..id.clone()
            };
            assert_eq!(other.check(), Liveness::Recycled);
        }
        // The same pid and ticks in another boot.
        let other_boot = Identity {
            boot_id: "00000000-0000-0000-0000-000000000000".into(),
            ..id.clone()
        };
        assert_eq!(other_boot.check(), Liveness::Recycled);

        // Dead but not reaped: a zombie runs nothing.
        child.0.kill().expect("kill");
        let mut zombie = false;
        for _ in 0..2000 {
            if read_stat(pid).expect("read").is_some_and(|s| s.is_dead()) {
                zombie = true;
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(5)); // bounded poll
        }
        assert!(zombie, "the killed child turns into a zombie");
        assert_eq!(id.check(), Liveness::Gone);
        child.0.wait().expect("reap");
        assert_eq!(id.check(), Liveness::Gone);
    }
}
