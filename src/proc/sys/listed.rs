//! How [`crate::proc::HostView`] keeps current where a read is a listing
//! (a toolhelp snapshot on Windows, libproc on macOS): there is no cheaper
//! listing to keep current, as Linux's `/proc` names are. Those two OS
//! folders take this file as their `listed` module (`#[path]`).

use crate::proc::Snapshot;

/// [`crate::proc::HostView::reread`] where a read is a listing (Windows, macOS): `wanted`
/// read in one listing; found ones replaced, gone ones forgotten; a failed
/// listing changes nothing and marks the view incomplete.
pub(crate) fn reread_by_listing(snap: &mut Snapshot, wanted: &[i32]) {
    let mut fresh = crate::proc::snapshot_pids(wanted.iter().copied());
    if let Some(why) = fresh.incomplete {
        snap.incomplete = Some(why);
        return;
    }
    snap.incomplete = None;
    for pid in wanted {
        match fresh.entries.remove(pid) {
            Some(entry) => {
                snap.entries.insert(*pid, entry);
            }
            None => {
                snap.entries.remove(pid);
            }
        }
    }
}

/// [`crate::proc::HostView::refresh`] where there is no cheaper listing than a full one
/// (Windows, macOS): a full re-read; returns how many processes it holds.
pub(crate) fn refresh_by_listing(
    snap: &mut Snapshot,
    _reread: impl IntoIterator<Item = i32>,
) -> usize {
    *snap = crate::proc::snapshot();
    snap.entries.len()
}
