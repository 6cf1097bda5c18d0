//! Reading `/proc/<pid>/stat` on Linux: the one reader (relative to one
//! held `/proc` descriptor) that `proc`'s [`crate::proc::parse_stat`] parses for.

use crate::proc::stat::{ProcEntry, parse_stat};

/// Reads `/proc/<pid>/stat` files into one reused buffer, each opened
/// relative to the process's one held descriptor of `/proc`
/// (`openat(proc, "<pid>/stat")`: two path components where the full path
/// walks four; a fifth less kernel time per read in a profile of the
/// idle service, where the full scan reads every host process every 30 s).
pub(crate) struct StatReader {
    page: u64,
    path: String,
    buf: Vec<u8>,
}

/// `/proc`, opened once for the process (one descriptor, close-on-exec,
/// kept from the first open that succeeds); `None` while it cannot be
/// opened (out of descriptors): each read then walks the full path, and
/// fails or succeeds as that open does.
fn proc_dir() -> Option<&'static rustix::fd::OwnedFd> {
    use rustix::fs::{Mode, OFlags};
    static PROC: std::sync::OnceLock<rustix::fd::OwnedFd> = std::sync::OnceLock::new();
    if let Some(fd) = PROC.get() {
        return Some(fd);
    }
    let fd = rustix::fs::open(
        "/proc",
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .ok()?;
    // A racing first open loses: its descriptor is closed here.
    Some(PROC.get_or_init(|| fd))
}

impl StatReader {
    pub(crate) fn new() -> Self {
        Self {
            page: procfs::page_size(),
            path: String::with_capacity(24),
            buf: Vec::with_capacity(512),
        }
    }

    /// `Ok(None)`: the process is gone (ENOENT, ESRCH). `Err`: the read
    /// failed for another reason (out of descriptors, I/O, a malformed or
    /// short read), so whether the process lives is unknown.
    pub(crate) fn read(&mut self, pid: i32) -> Result<Option<ProcEntry>, String> {
        use std::fmt::Write as _;
        let gone = |e: &std::io::Error| {
            matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ESRCH))
                || e.kind() == std::io::ErrorKind::NotFound
        };
        self.path.clear();
        let opened = match proc_dir() {
            Some(proc) => {
                let _ = write!(self.path, "{pid}/stat");
                rustix::fs::openat(
                    proc,
                    self.path.as_str(),
                    rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
                    rustix::fs::Mode::empty(),
                )
                .map(std::fs::File::from)
                .map_err(std::io::Error::from)
            }
            None => {
                let _ = write!(self.path, "/proc/{pid}/stat");
                std::fs::File::open(&self.path)
            }
        };
        let what = || format!("/proc/{pid}/stat");
        let mut file = match opened {
            Ok(f) => f,
            Err(e) if gone(&e) => return Ok(None),
            Err(e) => return Err(format!("{}: {e}", what())),
        };
        match super::pseudo::read_file(&mut file, &mut self.buf) {
            Ok(_) => {}
            Err(e) if gone(&e) => return Ok(None),
            Err(e) => return Err(format!("{}: {e}", what())),
        }
        parse_stat(&self.buf, self.page)
            .map(Some)
            .ok_or_else(|| format!("{}: malformed or short read", what()))
    }
}

/// The time since boot now, in the clock ticks of a stat's `starttime`
/// (`CLOCK_BOOTTIME`, which the kernel's start times count in, rounded
/// down). A process whose `start_ticks` is below it started before this
/// call. `None` if the clock cannot be read.
pub fn boot_ticks_now() -> Option<u64> {
    let now = rustix::time::clock_gettime(rustix::time::ClockId::Boottime);
    let hz = rustix::param::clock_ticks_per_second();
    let ns = u128::try_from(now.tv_sec).ok()? * 1_000_000_000 + u128::try_from(now.tv_nsec).ok()?;
    u64::try_from(ns * u128::from(hz) / 1_000_000_000).ok()
}

/// One process's `/proc/<pid>/stat`, read lean (`None`: gone, or not
/// readable).
pub fn read_entry(pid: i32) -> Option<ProcEntry> {
    StatReader::new().read(pid).ok().flatten()
}

/// The first of `pids` that is alive (not a zombie) and in process group
/// `pgid`, read now; stops reading at the first one found.
pub fn first_live_in_group(pids: impl IntoIterator<Item = i32>, pgid: i32) -> Option<ProcEntry> {
    let mut reader = StatReader::new();
    pids.into_iter()
        .filter_map(|pid| reader.read(pid).ok().flatten())
        .find(|e| e.pgid == pgid && e.is_live())
}
