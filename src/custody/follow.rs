//! Following a tree's captured log while it grows (`treewarden logs
//! --follow`), also across the cap's collapses; and removing the logs of
//! trees the ledger's retention removed.
//!
//! The cap (`proc::cap_log`) drops the oldest whole blocks of a log with
//! `FALLOC_FL_COLLAPSE_RANGE`: every byte moves towards the front by the
//! amount dropped, so a reader's offset no longer names the byte it read
//! last. A follower therefore remembers the last bytes it handed out (its
//! tail) and, before each read, checks that they still end at its offset;
//! where they do not, it finds them again (the last place they occur at or
//! before the old offset) and goes on right after them. Where the filesystem
//! punches holes instead, offsets stay put and the check always passes.
//!
//! Limit, by construction: in a log whose last [`TAIL`] bytes repeat
//! earlier in it (the same lines over and over), a relocation after a
//! collapse may land on a later repetition and skip a few identical lines.

use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;

/// How many times (1 ms apart) a poll tries for the shared lock before it
/// reads without it (a lock held that long is the tree's, not the cap's).
const LOCK_TRIES: usize = 50;

/// How many of the last bytes handed out are remembered to find the place
/// again after a collapse.
const TAIL: usize = 256;

/// A reader of a growing log that hands out each byte once.
pub struct LogFollower {
    path: PathBuf,
    offset: u64,
    tail: Vec<u8>,
}

impl LogFollower {
    /// Follows `path` from right after `printed`, the last bytes of it the
    /// caller handed out already (`read_log`'s answer): found again in the
    /// file, so what was written since that read is not skipped. With
    /// nothing printed, from the start.
    pub fn after(path: PathBuf, printed: &[u8]) -> std::io::Result<Self> {
        let tail = printed[printed.len().saturating_sub(TAIL)..].to_vec();
        let mut f = Self {
            path,
            offset: 0,
            tail,
        };
        match std::fs::File::open(&f.path) {
            Ok(mut file) => {
                let len = file.metadata()?.len();
                f.offset = len;
                if !f.still_in_place(&mut file, len)? {
                    f.offset = f.relocate(&mut file, len)?;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        Ok(f)
    }

    /// What was appended since the last call (empty when nothing was).
    ///
    /// The check that the tail is in place and the read after it are made
    /// under a shared lock on the file (`flock`), which the cap takes
    /// exclusively around each collapse (`proc::cap_log`): the log-cap
    /// thread caps as bytes are written, and a collapse between the check
    /// and the read would hand out a torn line. The tree that writes takes
    /// no lock and is never held up.
    pub fn poll(&mut self) -> std::io::Result<Vec<u8>> {
        let mut file = match std::fs::File::open(&self.path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        // Waited for briefly: the cap holds the lock only for one collapse.
        // A tree may hold an exclusive lock on its own log for good; the
        // cap then cannot collapse either (it punches holes, which move no
        // offsets), so reading without the lock is safe.
        for _ in 0..LOCK_TRIES {
            if file.try_lock_shared().is_ok() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let len = file.metadata()?.len();
        if !self.still_in_place(&mut file, len)? {
            self.offset = self.relocate(&mut file, len)?;
        }
        if len <= self.offset {
            return Ok(Vec::new());
        }
        file.seek(SeekFrom::Start(self.offset))?;
        let mut new = Vec::new();
        file.by_ref()
            .take(len - self.offset)
            .read_to_end(&mut new)?;
        drop(file);
        self.offset += new.len() as u64;
        self.tail.extend_from_slice(&new);
        let keep = self.tail.len().saturating_sub(TAIL);
        self.tail.drain(..keep);
        Ok(new)
    }

    /// Whether the bytes handed out last still end at the offset.
    fn still_in_place(&self, file: &mut std::fs::File, len: u64) -> std::io::Result<bool> {
        let n = self.tail.len() as u64;
        if n == 0 {
            return Ok(len >= self.offset);
        }
        if self.offset > len || self.offset < n {
            return Ok(false);
        }
        file.seek(SeekFrom::Start(self.offset - n))?;
        let mut here = Vec::with_capacity(self.tail.len());
        file.take(n).read_to_end(&mut here)?;
        Ok(here == self.tail)
    }

    /// Where reading goes on after a collapse: right after the last place
    /// the remembered tail occurs at or before the old offset; the start of
    /// what is left when it occurs nowhere (the whole tail was dropped).
    fn relocate(&self, file: &mut std::fs::File, len: u64) -> std::io::Result<u64> {
        let upto = self.offset.min(len);
        file.seek(SeekFrom::Start(0))?;
        let mut all = Vec::new();
        file.take(upto).read_to_end(&mut all)?;
        let at = if self.tail.is_empty() {
            None
        } else {
            all.windows(self.tail.len())
                .rposition(|w| w == self.tail.as_slice())
        };
        Ok(match at {
            Some(at) => (at + self.tail.len()) as u64,
            // Holes (punched blocks) read as zeros: start after them.
            None => all.iter().position(|b| *b != 0).unwrap_or(all.len()) as u64,
        })
    }
}

/// Removes the captured logs of trees the ledger's retention removed
/// (`prune`, `serve --retain`): a log lives as long as its tree's record.
/// Returns how many were removed; one that cannot be is logged and left.
pub fn remove_logs(data_dir: &std::path::Path, trees: &[i64]) -> usize {
    let mut removed = 0;
    for id in trees {
        let path = super::log_path(data_dir, crate::ledger::TreeId(*id));
        match std::fs::remove_file(&path) {
            Ok(()) => removed += 1,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "a pruned tree's log was not removed")
            }
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn append(path: &std::path::Path, bytes: &[u8]) {
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(path)
            .expect("open");
        f.write_all(bytes).expect("append");
    }

    /// The file with its first `n` bytes gone, as a collapse leaves it.
    fn collapse_front(path: &std::path::Path, n: usize) {
        let bytes = std::fs::read(path).expect("read");
        std::fs::write(path, &bytes[n..]).expect("rewrite");
    }

    fn numbered(from: usize, to: usize) -> Vec<u8> {
        (from..to)
            .flat_map(|i| format!("line {i:06}\n").into_bytes())
            .collect()
    }

    #[test]
    fn every_appended_byte_is_handed_out_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("tree-1.log");
        append(&path, &numbered(0, 10));
        let printed = std::fs::read(&path).expect("read");
        // Written between the first read and the follower: not skipped.
        append(&path, &numbered(10, 12));
        let mut f = LogFollower::after(path.clone(), &printed).expect("follower");
        assert_eq!(f.poll().expect("poll"), numbered(10, 12));
        assert!(f.poll().expect("poll").is_empty());
        append(&path, &numbered(12, 20));
        assert_eq!(f.poll().expect("poll"), numbered(12, 20));
        assert!(f.poll().expect("poll").is_empty());
    }

    #[test]
    fn nothing_printed_yet_follows_from_the_start() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("tree-1.log");
        let mut f = LogFollower::after(path.clone(), b"").expect("follower");
        assert!(f.poll().expect("poll").is_empty(), "no file yet");
        append(&path, &numbered(0, 3));
        assert_eq!(f.poll().expect("poll"), numbered(0, 3));
    }

    #[test]
    fn a_collapse_between_two_polls_loses_and_repeats_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("tree-1.log");
        append(&path, &numbered(0, 1000));
        let mut f = LogFollower::after(path.clone(), &numbered(0, 1000)).expect("follower");
        // More is written than the collapse drops, so the file is longer
        // than the follower's offset: a reader by offset alone would skip.
        append(&path, &numbered(1000, 1100));
        collapse_front(&path, 4096);
        append(&path, &numbered(1100, 1500));
        let got = f.poll().expect("poll");
        assert_eq!(
            String::from_utf8_lossy(&got),
            String::from_utf8_lossy(&numbered(1000, 1500))
        );
        append(&path, &numbered(1500, 1501));
        assert_eq!(f.poll().expect("poll"), numbered(1500, 1501));
    }

    #[test]
    fn a_log_collapsed_past_what_was_read_is_followed_from_what_is_left() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("tree-1.log");
        append(&path, &numbered(0, 10));
        let mut f = LogFollower::after(path.clone(), &numbered(0, 10)).expect("follower");
        append(&path, &numbered(10, 2000));
        let len = std::fs::metadata(&path).expect("stat").len() as usize;
        collapse_front(&path, len - 1000);
        let got = f.poll().expect("poll");
        let all = numbered(0, 2000);
        assert_eq!(got, all[all.len() - 1000..]);
    }

    #[test]
    fn a_real_collapse_by_the_cap_is_followed_where_the_filesystem_has_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("tree-1.log");
        append(&path, &numbered(0, 20_000));
        let mut f = LogFollower::after(path.clone(), &numbered(19_000, 20_000)).expect("follower");
        append(&path, &numbered(20_000, 20_100));
        let before = std::fs::metadata(&path).expect("stat").len();
        let dropped = crate::proc::cap_log(&path, 64 * 1024).expect("cap");
        let after = std::fs::metadata(&path).expect("stat").len();
        if after == before {
            eprintln!(
                "skipped: this filesystem punches holes instead of collapsing (offsets stay put)"
            );
        }
        assert!(dropped > 0, "the cap dropped nothing");
        append(&path, &numbered(20_100, 20_200));
        assert_eq!(f.poll().expect("poll"), numbered(20_000, 20_200));
    }
}
