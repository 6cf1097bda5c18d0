//! The teardown lease: one teardown of a tree at a time, across processes.

use std::time::{Duration, Instant};

use crate::ledger::TreeId;

use super::super::CustodyError;

impl Lease {
    /// Takes the tree's teardown lease: an advisory `flock` on
    /// `<data-dir>/teardown/tree-<id>.lock`, released when the file closes,
    /// also when the process dies. The file lives only as long as the
    /// teardown: the holder unlinks it before it unlocks (see
    /// [`Lease`]), and a taker whose locked file is no longer the one at the
    /// path (it was unlinked meanwhile) lets go and tries again, so two
    /// processes never hold leases on two different files of one path.
    /// `None` when the lock file cannot be made (logged): the teardown then
    /// runs without a lease rather than not at all.
    pub(in crate::custody) fn take(
        data_dir: &std::path::Path,
        tree: TreeId,
    ) -> Result<Option<Lease>, CustodyError> {
        Self::take_within(data_dir, tree, LEASE_WAIT)
    }

    /// [`Lease::take`], waiting at most `wait` for a holder.
    pub(in crate::custody) fn take_within(
        data_dir: &std::path::Path,
        tree: TreeId,
        wait: Duration,
    ) -> Result<Option<Lease>, CustodyError> {
        let dir = data_dir.join("teardown");
        let path = dir.join(format!("tree-{}.lock", tree.0));
        let deadline = Instant::now() + wait;
        let mut logged = false;
        loop {
            let file = crate::custody::markers::private_dir(&dir).and_then(|()| {
                let mut o = std::fs::OpenOptions::new();
                o.create(true).truncate(false).write(true);
                crate::ledger::fsmode::Mode::mode(&mut o, 0o600);
                o.open(&path)
            });
            let file = match file {
                Ok(f) => f,
                Err(e) => {
                    tracing::warn!(tree = tree.0, path = %path.display(), error = %e, "no teardown lease: running without one");
                    return Ok(None);
                }
            };
            match file.try_lock() {
                Ok(()) if Lease::still_at(&file, &path) => {
                    return Ok(Some(Lease {
                        _locked: file,
                        path,
                    }));
                }
                // Locked a file its holder had already unlinked: try again.
                Ok(()) => continue,
                Err(std::fs::TryLockError::WouldBlock) => {}
                Err(std::fs::TryLockError::Error(e)) => {
                    tracing::warn!(tree = tree.0, error = %e, "teardown lease not taken: running without one");
                    return Ok(None);
                }
            }
            if Instant::now() >= deadline {
                return Err(CustodyError::Conflict(format!(
                    "tree {} is being torn down by another process (its teardown lease {} was held for {}); try again",
                    tree.0,
                    path.display(),
                    humantime::format_duration(wait)
                )));
            }
            if !logged {
                tracing::info!(
                    tree = tree.0,
                    "another teardown of this tree is running: waiting for its lease"
                );
                logged = true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A held teardown lease. Dropping it unlinks the lock file while the lock
/// is still held, then closes (unlocks) it: no file per tree outlives its
/// teardown, and a waiter that locks the unlinked file sees that it is no
/// longer at the path ([`Lease::still_at`]) and starts over.
pub(crate) struct Lease {
    /// Held open for its lock; closing it unlocks.
    _locked: std::fs::File,
    path: std::path::PathBuf,
}

impl Lease {
    /// Whether `file` is still the file at `path` (Unix: same device and
    /// inode; Windows: same volume and file index, not only whether the path
    /// exists, since NTFS with POSIX delete semantics frees the name of a
    /// file removed while open).
    fn still_at(file: &std::fs::File, path: &std::path::Path) -> bool {
        crate::proc::same_file(file, path)
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_file(&self.path)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(path = %self.path.display(), error = %e, "teardown lease file not removed");
        }
        // `_locked` closes after this body: the unlock comes after the unlink.
    }
}

/// How long a teardown waits for another one of the same tree to finish.
pub const LEASE_WAIT: Duration = Duration::from_secs(60);

#[cfg(all(test, unix))]
mod tests {
    use super::Lease;

    /// `Lease::still_at` (mutants: -> true, -> false, its `&&` -> `||`, each
    /// `==` -> `!=`): a file open at its path is still there; once the path
    /// names another file (the holder unlinked it and a taker made a new
    /// one: same device, another inode), or nothing, it is not.
    #[test]
    fn a_lock_file_is_still_at_its_path_only_while_the_path_names_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("tree-1.lock");
        let open = || {
            std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&path)
                .expect("opened")
        };
        let held = open();
        assert!(Lease::still_at(&held, &path), "the file at its path");
        std::fs::remove_file(&path).expect("unlinked");
        assert!(!Lease::still_at(&held, &path), "the path names nothing");
        let other = open();
        assert!(Lease::still_at(&other, &path), "the new file is there");
        assert!(
            !Lease::still_at(&held, &path),
            "the unlinked file is not the one the path names now"
        );
    }
}
