//! A host's processes at one moment: [`Snapshot`], read whole
//! ([`snapshot`]) or for some pids ([`snapshot_pids`]), and [`HostView`],
//! one kept current cheaply. Each OS lists and reads its own way
//! (`snapshot_entries`: Linux's `/proc`, read in parallel over idle cores;
//! a toolhelp snapshot on Windows; libproc on macOS); `scan` classifies
//! what they saw.

use std::collections::HashMap;

use crate::proc::ProcEntry;

/// A full `/proc` snapshot, keyed by pid.
///
/// A snapshot is *complete* when every read it made either succeeded or
/// failed because the process is gone (ENOENT, ESRCH). Any other failure
/// (EMFILE, ENFILE, EAGAIN, EIO, a short or malformed read) makes it
/// incomplete: a process missing from an incomplete snapshot is unknown, not
/// exited, and nothing may be concluded from its absence (else a
/// service out of descriptors would record a live tree as ended).
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    pub entries: HashMap<i32, ProcEntry>,
    /// Why the snapshot is incomplete (the first failed read), if it is.
    pub incomplete: Option<String>,
}

impl Snapshot {
    /// A complete snapshot of `entries`.
    pub fn of(entries: HashMap<i32, ProcEntry>) -> Self {
        Self {
            entries,
            incomplete: None,
        }
    }

    /// Whether every read succeeded or found its process gone.
    pub fn is_complete(&self) -> bool {
        self.incomplete.is_none()
    }
}

/// Reads every process. Processes that vanish while being read are
/// skipped: they are not there any more, which is what a snapshot says. A
/// read that fails for any other reason makes the snapshot incomplete.
pub fn snapshot() -> Snapshot {
    of_entries(super::sys::snapshot_entries(None))
}

/// Re-reads only the given pids (targeted refresh of known members).
pub fn snapshot_pids(pids: impl IntoIterator<Item = i32>) -> Snapshot {
    let pids: Vec<i32> = pids.into_iter().collect();
    of_entries(super::sys::snapshot_entries(Some(&pids)))
}

fn of_entries((entries, incomplete): (Vec<ProcEntry>, Option<String>)) -> Snapshot {
    Snapshot {
        entries: entries.into_iter().map(|e| (e.pid, e)).collect(),
        incomplete,
    }
}

/// A host snapshot kept current cheaply between full scans (the service's
/// scan loop; `run` and the teardown take full snapshots).
///
/// On Linux, [`HostView::refresh`] lists `/proc` by name only, reads `stat`
/// for pids it has not seen, drops pids that are gone, and re-reads the pids
/// the caller names (known members, group and session leaders, cgroup
/// members). Entries of other processes may be stale: a pid that died and
/// was reused between two refreshes keeps its old entry. That is harmless
/// for classification (a process that is not a member cannot become one by
/// staying unread: it can join neither a tree's session nor its group, and a
/// new child is a new pid), and [`HostView::full_refresh`], run at a slower
/// cadence, re-reads everything.
///
/// Elsewhere (a toolhelp snapshot on Windows lists every process in one
/// call: there is no cheaper listing to keep current, as Linux's `/proc`
/// names are) a refresh is a full re-read; only [`HostView::reread`] reads
/// just the pids it is given.
#[derive(Debug, Default)]
pub struct HostView {
    snap: Snapshot,
}

impl HostView {
    /// A view filled by a full snapshot.
    pub fn new() -> Self {
        Self { snap: snapshot() }
    }

    pub fn snapshot(&self) -> &Snapshot {
        &self.snap
    }

    /// Re-reads every process.
    pub fn full_refresh(&mut self) {
        self.snap = snapshot();
    }

    /// Re-reads only `pids` (new ones are added, gone ones forgotten),
    /// without a listing: for a caller that learns of new processes
    /// otherwise (the service, while the proc-connector observer follows
    /// every watched tree). A failed read keeps what the view had and marks
    /// it incomplete. Returns how many pids were asked for.
    pub fn reread(&mut self, pids: impl IntoIterator<Item = i32>) -> usize {
        let mut wanted: Vec<i32> = pids.into_iter().collect();
        wanted.sort_unstable();
        wanted.dedup();
        super::sys::view_reread(&mut self.snap, &wanted);
        wanted.len()
    }

    /// Brings the view up to date and re-reads `reread` (see the type).
    /// Returns how many processes were read.
    pub fn refresh(&mut self, reread: impl IntoIterator<Item = i32>) -> usize {
        super::sys::view_refresh(&mut self.snap, reread)
    }
}
