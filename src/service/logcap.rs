//! The captured logs' cap, as they are written.
//!
//! An API tree writes its stdout and stderr straight into
//! `<data-dir>/logs/tree-<id>.log` (no pipe through the service, so a crash
//! of the service cannot SIGPIPE a tree). The scan tick caps each owned
//! tree's log once a tick; a fast writer (`yes`) overshot that by a tick's
//! output (1.9 GB in 3 s). This thread watches the logs directory with
//! inotify (`IN_MODIFY`, one watch for every log, also those made after it
//! started) and caps a log as soon as it was written to, at most once per
//! [`PACE`] per burst of events: the overshoot is what a writer writes in
//! about one `PACE` (plus the wake-up), and the thread's cost is bounded by
//! the pace, not by the writer's speed.
//!
//! While it runs, the scan tick does not cap (that was one `stat` per
//! owned tree per tick); a queue overflow (`IN_Q_OVERFLOW`) makes it look at
//! every log once. If it stops (an error), the tick caps again.
//!
//! What it does not do: cap while the service is down (nothing runs to cap;
//! the next start's first tick does, and the ledger keeps its own reserve,
//! `--ledger-reserve`, for the authorizations meanwhile).

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rustix::fs::inotify;

/// Between two rounds of capping: bounds both the overshoot (what a writer
/// writes in this long) and the thread's wake-ups.
pub(crate) const PACE: Duration = Duration::from_millis(2);

/// How often a thread with no events looks whether it should stop.
const IDLE_POLL: Duration = Duration::from_millis(500);

/// The running cap; dropping it stops the thread (within [`IDLE_POLL`]).
pub(crate) struct LogCap {
    stop: Arc<AtomicBool>,
    /// Cleared by the thread if it stops on its own (an error).
    running: Arc<AtomicBool>,
}

impl Drop for LogCap {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

impl LogCap {
    /// Starts capping every log in `dir` (made 0700 if missing) at `cap`
    /// bytes. `None` (logged) when inotify is not available: the tick's cap
    /// still applies.
    pub(crate) fn start(dir: &Path, cap: u64) -> Option<LogCap> {
        let started = (|| -> std::io::Result<_> {
            std::os::unix::fs::DirBuilderExt::mode(
                std::fs::DirBuilder::new().recursive(true),
                0o700,
            )
            .create(dir)?;
            let fd = inotify::init(inotify::CreateFlags::CLOEXEC | inotify::CreateFlags::NONBLOCK)?;
            inotify::add_watch(&fd, dir, inotify::WatchFlags::MODIFY)?;
            Ok(fd)
        })();
        let fd = match started {
            Ok(fd) => fd,
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, "captured logs are capped once a tick only (no inotify)");
                return None;
            }
        };
        let stop = Arc::new(AtomicBool::new(false));
        let running = Arc::new(AtomicBool::new(true));
        let (flag, alive) = (stop.clone(), running.clone());
        let dir = dir.to_path_buf();
        let spawned = std::thread::Builder::new()
            .name("log-cap".into())
            .spawn(move || {
                run(&fd, &dir, cap, &flag);
                alive.store(false, Ordering::Relaxed);
            });
        match spawned {
            Ok(_) => Some(LogCap { stop, running }),
            Err(e) => {
                tracing::warn!(error = %e, "captured logs are capped once a tick only (no thread)");
                None
            }
        }
    }
}

impl LogCap {
    /// Whether the thread still caps (the scan tick's cap is then skipped).
    pub(crate) fn running(&self) -> bool {
        self.running.load(Ordering::Relaxed)
    }
}

fn run(fd: &rustix::fd::OwnedFd, dir: &Path, cap: u64, stop: &AtomicBool) {
    let mut buf = [std::mem::MaybeUninit::<u8>::uninit(); 8192];
    while !stop.load(Ordering::Relaxed) {
        let mut pfd = [rustix::event::PollFd::new(fd, rustix::event::PollFlags::IN)];
        let timeout = rustix::event::Timespec::try_from(IDLE_POLL).ok();
        match rustix::event::poll(&mut pfd, timeout.as_ref()) {
            Ok(0) | Err(rustix::io::Errno::INTR) => continue,
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %e, "log cap stopped; the tick's cap still applies");
                return;
            }
        }
        let (mut names, overflowed) = drain(fd, &mut buf);
        if overflowed {
            // The kernel's queue overflowed and dropped events: every log
            // in the directory is looked at once.
            names.extend(
                std::fs::read_dir(dir)
                    .into_iter()
                    .flatten()
                    .flatten()
                    .map(|e| PathBuf::from(e.file_name())),
            );
        }
        for name in names {
            let path = dir.join(&name);
            match crate::proc::cap_log(&path, cap) {
                Ok(0) => {}
                Ok(dropped) => {
                    tracing::debug!(log = %path.display(), dropped, "oldest captured output dropped")
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(log = %path.display(), error = %e, "captured output not capped")
                }
            }
        }
        std::thread::sleep(PACE);
    }
}

/// The distinct file names of every event queued now (non-blocking), and
/// whether the queue overflowed (`IN_Q_OVERFLOW`: events were dropped).
fn drain(
    fd: &rustix::fd::OwnedFd,
    buf: &mut [std::mem::MaybeUninit<u8>],
) -> (HashSet<PathBuf>, bool) {
    let mut names = HashSet::new();
    let mut overflowed = false;
    let mut reader = inotify::Reader::new(fd, buf);
    loop {
        match reader.next() {
            Ok(event) => {
                overflowed |= event.events().contains(inotify::ReadFlags::QUEUE_OVERFLOW);
                if let Some(name) = event.file_name() {
                    use std::os::unix::ffi::OsStrExt;
                    names.insert(PathBuf::from(std::ffi::OsStr::from_bytes(name.to_bytes())));
                }
            }
            Err(_) => return (names, overflowed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::fs::MetadataExt;

    /// A tree may lock its own log (it holds the descriptor) or allocate
    /// past its end: neither stalls the cap nor escapes it.
    #[test]
    fn a_log_locked_or_preallocated_by_its_writer_is_capped_all_the_same() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("tree-2.log");
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .expect("log");
        f.lock().expect("the writer's own exclusive lock");
        f.write_all(&vec![b'y'; 4 << 20]).expect("write");
        let dropped = crate::proc::cap_log(&path, 1 << 20).expect("capped, not blocked");
        assert!(dropped > 0);
        let used = std::fs::metadata(&path).expect("meta").blocks() * 512;
        assert!(used <= 1 << 20, "punched out while locked: {used}");
        rustix::fs::fallocate(&f, rustix::fs::FallocateFlags::KEEP_SIZE, 0, 64 << 20)
            .expect("fallocate past the end");
        crate::proc::cap_log(&path, 1 << 20).expect("capped");
        let used = std::fs::metadata(&path).expect("meta").blocks() * 512;
        assert!(used <= 4 << 20, "the blocks past the end are freed: {used}");
    }

    /// A writer far faster than the tick: the file stays near its cap while
    /// it writes, not a tick's output past it.
    #[test]
    fn a_fast_writer_is_held_near_the_cap_as_it_writes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let logs = dir.path().join("logs");
        let cap = 1 << 20;
        let _cap = LogCap::start(&logs, cap).expect("inotify");
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(logs.join("tree-1.log"))
            .expect("log");
        let chunk = vec![b'y'; 64 << 10];
        let mut most = 0;
        // 256 MiB in 64 KiB writes, as fast as this thread can.
        for _ in 0..4096 {
            f.write_all(&chunk).expect("write");
            let used = std::fs::metadata(logs.join("tree-1.log"))
                .expect("meta")
                .blocks()
                * 512;
            most = most.max(used);
        }
        // The pace lets a writer at memory speed run ahead for about 10 ms;
        // far below the 256 MiB written, and below what the tick allowed.
        assert!(most < 128 << 20, "the log reached {most} bytes");
        let end = std::time::Instant::now() + Duration::from_secs(5);
        while std::fs::metadata(logs.join("tree-1.log"))
            .expect("meta")
            .blocks()
            * 512
            > cap
        {
            assert!(
                std::time::Instant::now() < end,
                "never capped after the last write"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}
