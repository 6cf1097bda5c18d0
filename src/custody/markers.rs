//! Unsettled markers: `<data-dir>/unsettled/tree-<id>`, one small JSON file
//! per tree whose teardown turned ambiguous.
//!
//! The marker is the channel that still works when the ledger does not (a
//! held write lock, a full disk: an empty file needs no data blocks). Every
//! treewarden process on the host reads the markers in its dispatch gate, so
//! new work is refused host-wide even when the ledger never learned of the
//! ambiguity. It names the survivors the teardown left alive, so a later
//! teardown (a sweep) that has only the ledger to go by still knows them.
//! It is not evidence — the ledger is — it only holds the door shut.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::ledger::{Deferred, IdentityRecord, TreeId};

/// What a marker says. A marker whose content could not be written (a full
/// disk) is still a marker: the file's existence is the fact.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Marker {
    pub reason: String,
    /// The survivors left alive as evidence, by identity.
    pub survivors: Vec<IdentityRecord>,
    /// Evidence the teardown could not write (the ledger refused writes),
    /// in the order it happened: written to the ledger by whichever process
    /// next finds the ledger writable (`Ambiguity::replay_deferred`), then
    /// dropped from the marker.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pending: Vec<Deferred>,
    /// Names the pending writes as one batch: the replay writes it into
    /// each event (`deferred_batch`) in the same transaction, so a replay
    /// whose marker could not be rewritten afterwards (a crash, a full disk)
    /// is recognised and never written twice.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub batch: String,
}

/// A fresh batch name ([`crate::ledger::new_batch`]: the ledger names the
/// batches of deferred writes it replays).
pub use crate::ledger::new_batch;

fn dir(data_dir: &Path) -> PathBuf {
    data_dir.join("unsettled")
}

fn path(data_dir: &Path, tree: TreeId) -> PathBuf {
    dir(data_dir).join(format!("tree-{tree}"))
}

/// Creates (or rewrites) the marker. A first marker: creation is what
/// matters, the content is best effort (an empty file still closes
/// dispatch). A rewrite goes through a temporary file and a rename, so a
/// full disk or a crash keeps the old marker whole instead of truncating it.
pub fn write(data_dir: &Path, tree: TreeId, marker: &Marker) {
    let target = path(data_dir, tree);
    let text = serde_json::to_string(marker).unwrap_or_default();
    if target.exists() {
        let tmp = dir(data_dir).join(format!(".tree-{tree}.tmp"));
        let written = private_file(&tmp)
            .and_then(|mut f| f.write_all(text.as_bytes()).and_then(|()| f.sync_all()))
            .and_then(|()| std::fs::rename(&tmp, &target));
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            tracing::error!(tree = tree.0, error = %e, "unsettled marker not rewritten; the old one stays");
        }
        return;
    }
    let made = private_dir(&dir(data_dir)).and_then(|()| private_file(&target));
    match made {
        Ok(mut file) => {
            if let Err(e) = file.write_all(text.as_bytes()) {
                tracing::error!(tree = tree.0, error = %e, "unsettled marker written without its content");
            }
        }
        Err(e) => tracing::error!(tree = tree.0, error = %e, "unsettled marker not written"),
    }
}

/// The markers' folder, made 0700 (it names survivors and their argv).
/// (On Windows the data dir's ACL, the user's own, is what keeps it private.)
pub(crate) fn private_dir(dir: &Path) -> std::io::Result<()> {
    let mut b = std::fs::DirBuilder::new();
    b.recursive(true);
    crate::ledger::fsmode::Mode::mode(&mut b, 0o700);
    b.create(dir)
}

/// A file only its owner reads (0600), created or truncated.
fn private_file(path: &Path) -> std::io::Result<std::fs::File> {
    let mut o = std::fs::OpenOptions::new();
    o.create(true).truncate(true).write(true);
    crate::ledger::fsmode::Mode::mode(&mut o, 0o600);
    o.open(path)
}

/// Removes the marker (the tree is settled).
pub fn remove(data_dir: &Path, tree: TreeId) {
    match std::fs::remove_file(path(data_dir, tree)) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::error!(tree = tree.0, error = %e, "unsettled marker not removed"),
    }
}

/// Reads one marker; `None` when there is none. Unreadable or empty content
/// reads as a marker with no reason and no survivors.
pub fn read(data_dir: &Path, tree: TreeId) -> Option<Marker> {
    let text = match std::fs::read_to_string(path(data_dir, tree)) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(_) => String::new(),
    };
    Some(serde_json::from_str(&text).unwrap_or(Marker {
        reason: text.trim().to_string(),
        survivors: Vec::new(),
        pending: Vec::new(),
        batch: String::new(),
    }))
}

/// Every marker on the host, by tree id.
pub fn all(data_dir: &Path) -> Vec<(TreeId, Marker)> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir(data_dir)) else {
        return out;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(tree) = name
            .to_str()
            .and_then(|n| n.strip_prefix("tree-"))
            .and_then(|n| n.parse::<i64>().ok().map(TreeId))
        else {
            continue;
        };
        if let Some(marker) = read(data_dir, tree) {
            out.push((tree, marker));
        }
    }
    out.sort_by_key(|(t, _)| *t);
    out
}

#[cfg(all(test, unix))]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    /// Markers name survivors and their argv; their
    /// folder is 0700 and each marker (first write and rewrite) 0600.
    #[test]
    fn markers_and_their_folder_are_private() {
        let data = tempfile::tempdir().expect("tempdir");
        let mode = |p: &std::path::Path| {
            std::fs::metadata(p).expect("exists").permissions().mode() & 0o777
        };
        super::write(
            data.path(),
            crate::ledger::TreeId(7),
            &super::Marker::default(),
        );
        assert_eq!(mode(&super::dir(data.path())), 0o700);
        assert_eq!(
            mode(&super::path(data.path(), crate::ledger::TreeId(7))),
            0o600
        );
        super::write(
            data.path(),
            crate::ledger::TreeId(7),
            &super::Marker {
                reason: "rewritten".into(),
                ..super::Marker::default()
            },
        );
        assert_eq!(
            mode(&super::path(data.path(), crate::ledger::TreeId(7))),
            0o600
        );
        assert_eq!(
            super::read(data.path(), crate::ledger::TreeId(7))
                .map(|m| m.reason)
                .as_deref(),
            Some("rewritten")
        );
    }
}
