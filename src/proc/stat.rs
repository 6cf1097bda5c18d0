//! The one model and parser of `/proc/<pid>/stat` ([`ProcEntry`],
//! [`parse_stat`]), and the lean reader over them ([`StatReader`]).
//!
//! Every read of a process's stat file goes through here: the scan's
//! snapshots (its hot path: one buffer reused across the walk), an
//! identity's re-read ([`super::identity::read_stat`], which adds the owner
//! of `/proc/<pid>`), the group checks and exit watches, and the fake host of
//! the custody tests (which renders its processes as stat lines and parses
//! them here). The model and the parser are plain code, built on every OS
//! (Windows's toolhelp snapshot fills the same [`ProcEntry`]); the readers
//! are Linux's. `comm` may hold spaces, parentheses and newlines; like
//! `procfs`, the parser takes it between the first `(` and the *last* `)`
//! (a property test in `scan.rs` checks it against `procfs`'s parser).

/// One process as its `/proc/<pid>/stat` shows it: the fields treewarden
/// uses (a scan's entry, an identity's re-read, the fake host's processes).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ProcEntry {
    pub pid: i32,
    pub ppid: i32,
    pub pgid: i32,
    pub sid: i32,
    /// Start time in clock ticks since boot: with the pid, the identity.
    pub start_ticks: u64,
    /// The state letter from `/proc/<pid>/stat` (`R`, `S`, `Z`, `T`, ...).
    pub state: char,
    pub comm: String,
    /// Resident set size in bytes.
    pub rss_bytes: u64,
    /// Where the stack starts (`startstack`, field 28): drawn anew by each
    /// exec under ASLR, so with `comm` it tells an exec that kept the name
    /// (`sh` exec'ing `sh -c …`). 0 where the kernel hides it (a process
    /// the reader may not ptrace).
    pub start_stack: u64,
}

impl ProcEntry {
    /// The process's [`ProcKey`](super::ProcKey).
    pub fn key(&self) -> super::ProcKey {
        super::ProcKey::new(self.pid, self.start_ticks)
    }

    /// Zombies and dead tasks are not live members: they run nothing and
    /// cannot be signalled usefully.
    pub fn is_live(&self) -> bool {
        !matches!(self.state, 'Z' | 'X' | 'x')
    }
}

/// Reads `/proc/<pid>/stat` files into one reused buffer, each opened
/// relative to the process's one held descriptor of `/proc`
/// (`openat(proc, "<pid>/stat")`: two path components where the full path
/// walks four; a fifth less kernel time per read in a profile of the
/// idle service, where the full scan reads every host process every 30 s).
#[cfg(target_os = "linux")]
pub(crate) struct StatReader {
    page: u64,
    path: String,
    buf: Vec<u8>,
}

/// `/proc`, opened once for the process (one descriptor, close-on-exec,
/// kept from the first open that succeeds); `None` while it cannot be
/// opened (out of descriptors): each read then walks the full path, and
/// fails or succeeds as that open does.
#[cfg(target_os = "linux")]
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

#[cfg(target_os = "linux")]
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
#[cfg(target_os = "linux")]
pub fn boot_ticks_now() -> Option<u64> {
    let now = rustix::time::clock_gettime(rustix::time::ClockId::Boottime);
    let hz = rustix::param::clock_ticks_per_second();
    let ns = u128::try_from(now.tv_sec).ok()? * 1_000_000_000 + u128::try_from(now.tv_nsec).ok()?;
    u64::try_from(ns * u128::from(hz) / 1_000_000_000).ok()
}

/// Parses the fields a [`ProcEntry`] needs from the bytes of one
/// `/proc/<pid>/stat`: `pid (comm) state ppid pgrp session ... starttime
/// vsize rss ...`. `comm` is what lies between the first `(` and the last
/// `)`, so spaces, parentheses and newlines in it cannot shift the fields
/// (the kernel escapes nothing there). `None` on anything malformed.
pub fn parse_stat(buf: &[u8], page_size: u64) -> Option<ProcEntry> {
    let open = buf.iter().position(|&b| b == b'(')?;
    let close = buf.iter().rposition(|&b| b == b')')?;
    if close < open {
        return None;
    }
    let pid = ascii_num::<i32>(buf[..open].strip_suffix(b" ")?)?;
    let comm = String::from_utf8_lossy(&buf[open + 1..close]).into_owned();
    // Fields after ") ", numbered from 0: state, ppid, pgrp, session, ...,
    // starttime (19), vsize (20), rss (21).
    let rest = buf.get(close + 2..)?;
    let rest = rest.strip_suffix(b"\n").unwrap_or(rest);
    let mut fields = rest.split(|&b| b == b' ');
    let state = *fields.next()?.first()?;
    let ppid = ascii_num::<i32>(fields.next()?)?;
    let pgid = ascii_num::<i32>(fields.next()?)?;
    let sid = ascii_num::<i32>(fields.next()?)?;
    let start_ticks = ascii_num::<u64>(fields.nth(15)?)?;
    let rss_pages = ascii_num::<i64>(fields.nth(1)?)?;
    // rsslim, startcode, endcode, startstack.
    let start_stack = fields.nth(3).and_then(ascii_num::<u64>).unwrap_or(0);
    Some(ProcEntry {
        pid,
        ppid,
        pgid,
        sid,
        start_ticks,
        state: char::from(state),
        comm,
        rss_bytes: u64::try_from(rss_pages)
            .unwrap_or(0)
            .saturating_mul(page_size),
        start_stack,
    })
}

fn ascii_num<T: std::str::FromStr>(field: &[u8]) -> Option<T> {
    std::str::from_utf8(field).ok()?.parse().ok()
}

/// One process's `/proc/<pid>/stat`, read lean (`None`: gone, or not
/// readable).
#[cfg(target_os = "linux")]
pub fn read_entry(pid: i32) -> Option<ProcEntry> {
    StatReader::new().read(pid).ok().flatten()
}

/// The first of `pids` that is alive (not a zombie) and in process group
/// `pgid`, read now; stops reading at the first one found.
#[cfg(target_os = "linux")]
pub fn first_live_in_group(pids: impl IntoIterator<Item = i32>, pgid: i32) -> Option<ProcEntry> {
    let mut reader = StatReader::new();
    pids.into_iter()
        .filter_map(|pid| reader.read(pid).ok().flatten())
        .find(|e| e.pgid == pgid && e.is_live())
}
