//! Linux's listing of processes: `/proc`'s names, each `stat` read with one
//! buffer reused across the walk ([`StatReader`]), large reads split over
//! idle cores ([`crate::proc::read_in_parallel`]); and how
//! [`crate::proc::HostView`] keeps itself current from it.

use std::collections::HashSet;

use super::stat::StatReader;
use crate::proc::{ProcEntry, Snapshot};

/// Every process in `/proc` (`only`: `None`), or only the pids `only`
/// names, and why the read is incomplete, if it is (see
/// [`crate::proc::snapshot`]).
pub fn snapshot_entries(only: Option<&[i32]>) -> (Vec<ProcEntry>, Option<String>) {
    if let Some(pids) = only {
        return read_stats(pids);
    }
    let pids: Vec<i32> = match std::fs::read_dir("/proc") {
        Ok(dir) => {
            let mut pids = Vec::new();
            for e in dir {
                match e {
                    Ok(e) => {
                        if let Some(pid) = e.file_name().to_str().and_then(|n| n.parse().ok()) {
                            pids.push(pid);
                        }
                    }
                    Err(e) => {
                        let (entries, _) = read_stats(&pids);
                        return (entries, Some(format!("listing /proc: {e}")));
                    }
                }
            }
            pids
        }
        Err(e) => return (Vec::new(), Some(format!("listing /proc: {e}"))),
    };
    read_stats(&pids)
}

/// The `stat` of each of `pids` (the gone skipped), and the first failed
/// read's reason.
fn read_stats(pids: &[i32]) -> (Vec<ProcEntry>, Option<String>) {
    let reads = crate::proc::read_in_parallel(pids, |chunk| {
        let mut reader = StatReader::new();
        chunk
            .iter()
            .filter_map(|&pid| reader.read(pid).transpose())
            .collect()
    });
    let mut entries = Vec::with_capacity(reads.len());
    let mut incomplete = None;
    for read in reads {
        match read {
            Ok(e) => entries.push(e),
            Err(why) => {
                incomplete.get_or_insert(why);
            }
        }
    }
    (entries, incomplete)
}

/// [`crate::proc::HostView::reread`] on Linux: each of `wanted` (sorted,
/// distinct) read by its `stat`, without listing `/proc`.
pub(crate) fn view_reread(snap: &mut Snapshot, wanted: &[i32]) {
    let mut reader = StatReader::new();
    snap.incomplete = None;
    for &pid in wanted {
        take(snap, pid, reader.read(pid));
    }
}

/// [`crate::proc::HostView::refresh`] on Linux: reads new pids, forgets
/// gone ones, and re-reads `reread`. Returns how many `stat` files were read.
pub(crate) fn view_refresh(snap: &mut Snapshot, reread: impl IntoIterator<Item = i32>) -> usize {
    let mut reader = StatReader::new();
    let listed: HashSet<i32> =
        match std::fs::read_dir("/proc").and_then(|dir| dir.collect::<Result<Vec<_>, _>>()) {
            Ok(dir) => dir
                .iter()
                .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse().ok()))
                .collect(),
            Err(e) => {
                // Nothing is forgotten on a failed listing: the view keeps
                // what it had and says it is incomplete.
                snap.incomplete = Some(format!("listing /proc: {e}"));
                return 0;
            }
        };
    snap.incomplete = None;
    snap.entries.retain(|pid, _| listed.contains(pid));
    let mut wanted: HashSet<i32> = reread.into_iter().filter(|p| listed.contains(p)).collect();
    wanted.extend(
        listed
            .iter()
            .filter(|p| !snap.entries.contains_key(p))
            .copied(),
    );
    let reads = wanted.len();
    for pid in wanted {
        take(snap, pid, reader.read(pid));
    }
    reads
}

/// One re-read's outcome: an entry replaces the old one, a gone process
/// is forgotten, and a failed read keeps the old entry and marks the
/// view incomplete (unknown is not gone).
fn take(snap: &mut Snapshot, pid: i32, read: Result<Option<ProcEntry>, String>) {
    match read {
        Ok(Some(entry)) => {
            snap.entries.insert(pid, entry);
        }
        Ok(None) => {
            snap.entries.remove(&pid);
        }
        Err(why) => {
            snap.incomplete.get_or_insert(why);
        }
    }
}
