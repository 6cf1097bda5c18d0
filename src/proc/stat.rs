//! The one model and parser of `/proc/<pid>/stat` ([`ProcEntry`],
//! [`parse_stat`]); the lean reader over them is Linux's
//! (`sys/linux/stat.rs`).
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
