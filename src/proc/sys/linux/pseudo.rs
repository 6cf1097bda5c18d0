//! Whole reads of the kernel's pseudo-files (`/proc`, cgroupfs) with plain
//! `read` calls.
//!
//! `std`'s `read_to_end` and `read_to_string` on a `File` first ask for the
//! file's size (`statx`) and position (`lseek`) to size the buffer: two
//! system calls that say nothing here (these files report size 0), out of
//! six for one small read. At 2,000 live trees the service's full scan
//! makes about 12,000 such reads (every `/proc/<pid>/stat`, every tree's
//! `cgroup.procs` and `memory.events`), and the teardown makes them for
//! every member (in a profile of the idle service, `statx` and `lseek` were an
//! eighth of a stat read). These read until `read` returns 0, as
//! `read_to_end` does, into a buffer that grows as needed.

use std::fs::File;
use std::io::{self, Read};
use std::path::Path;

/// Below this much room left, the buffer grows before the next read.
const MIN_ROOM: usize = 256;
/// How much it grows by (a stat line is under 1 KiB; a `cgroup.procs` of
/// a few hundred members fits in one growth or two).
const GROW: usize = 1024;

/// Reads `file` from its current position to its end into `buf`, which is
/// cleared first (its capacity is kept for the next read). An interrupted
/// `read` (EINTR) is retried; any other error ends the read.
pub fn read_file(file: &mut impl Read, buf: &mut Vec<u8>) -> io::Result<()> {
    buf.clear();
    loop {
        if buf.capacity() - buf.len() < MIN_ROOM {
            buf.reserve(GROW);
        }
        let start = buf.len();
        buf.resize(buf.capacity(), 0);
        match file.read(&mut buf[start..]) {
            Ok(0) => {
                buf.truncate(start);
                return Ok(());
            }
            Ok(n) => buf.truncate(start + n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => buf.truncate(start),
            Err(e) => {
                buf.truncate(start);
                return Err(e);
            }
        }
    }
}

/// The whole content of the file at `path`.
pub fn read_path(path: &Path) -> io::Result<Vec<u8>> {
    let mut file = File::open(path)?;
    let mut buf = Vec::with_capacity(GROW);
    read_file(&mut file, &mut buf)?;
    Ok(buf)
}

/// The whole content of the file at `path` as text (`InvalidData` if it is
/// not UTF-8, as `std::fs::read_to_string` says).
pub fn read_path_string(path: &Path) -> io::Result<String> {
    String::from_utf8(read_path(path)?).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// Reads `file` from its start again into `text` (cleared first): the
/// repeated read of one held descriptor (`cgroup.events` while waiting).
pub fn reread_string(file: &mut File, text: &mut String) -> io::Result<()> {
    use std::io::{Seek, SeekFrom};
    file.seek(SeekFrom::Start(0))?;
    let mut buf = std::mem::take(text).into_bytes();
    read_file(file, &mut buf)?;
    *text = String::from_utf8(buf).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_proc_file_whole_as_std_does() {
        let path = Path::new("/proc/self/status");
        let ours = read_path_string(path).expect("ours");
        let theirs = std::fs::read_to_string(path).expect("std");
        // The same fields in the same order (a few values move between reads).
        let keys = |t: &str| -> Vec<String> {
            t.lines()
                .filter_map(|l| l.split_once(':').map(|(k, _)| k.to_string()))
                .collect()
        };
        assert_eq!(keys(&ours), keys(&theirs));
        assert!(ours.ends_with('\n'), "read to its end: {ours:?}");
    }

    #[test]
    fn a_file_larger_than_many_growths_is_read_whole() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("big");
        let content: Vec<u8> = (0..20_000u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &content).expect("write");
        assert_eq!(read_path(&path).expect("read"), content);
        assert!(matches!(
            read_path_string(&path).map_err(|e| e.kind()),
            Err(io::ErrorKind::InvalidData)
        ));
    }

    #[test]
    fn a_reread_starts_from_the_beginning_and_reuses_the_buffer() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("events");
        std::fs::write(&path, "populated 1\nfrozen 0\n").expect("write");
        let mut file = File::open(&path).expect("open");
        let mut text = String::new();
        reread_string(&mut file, &mut text).expect("first");
        assert_eq!(text, "populated 1\nfrozen 0\n");
        std::fs::write(&path, "populated 0\n").expect("rewrite");
        reread_string(&mut file, &mut text).expect("second");
        assert_eq!(text, "populated 0\n");
    }

    #[test]
    fn an_error_other_than_an_interruption_ends_the_read() {
        // A directory opens but does not read (EISDIR): the error comes
        // back at once, not retried as an interruption would be.
        let mut dir = File::open("/proc/self").expect("open a directory");
        let mut buf = b"stale".to_vec();
        let err = read_file(&mut dir, &mut buf).expect_err("EISDIR");
        assert_eq!(err.raw_os_error(), Some(libc::EISDIR));
        assert!(buf.is_empty(), "nothing half-read is left: {buf:?}");
    }

    /// Reads `chunks` one a call, an interruption before each.
    struct Interrupting {
        chunks: Vec<&'static [u8]>,
        interrupt: bool,
    }

    impl Read for Interrupting {
        fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
            self.interrupt = !self.interrupt;
            if self.interrupt {
                return Err(io::ErrorKind::Interrupted.into());
            }
            match self.chunks.first() {
                None => Ok(0),
                Some(c) => {
                    let n = c.len().min(out.len());
                    out[..n].copy_from_slice(&c[..n]);
                    self.chunks.remove(0);
                    Ok(n)
                }
            }
        }
    }

    #[test]
    fn an_interrupted_read_is_retried_and_nothing_is_lost() {
        let mut r = Interrupting {
            chunks: vec![b"populated ", b"1\n", b"frozen 0\n"],
            interrupt: false,
        };
        let mut buf = Vec::new();
        read_file(&mut r, &mut buf).expect("read through the interruptions");
        assert_eq!(buf, b"populated 1\nfrozen 0\n");
    }

    #[test]
    fn a_missing_file_is_not_found() {
        let err = read_path(Path::new("/proc/self/no-such-file")).expect_err("missing");
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
    }
}
