//! Reads of many processes split across idle cores: a teardown's reads of
//! a large tree (the walk, the frozen re-read, the survivors' command
//! lines) come before its SIGKILL, and each `/proc` read is kernel work
//! that splits across cores. Only onto idle cores (`/proc/loadavg`; where
//! it cannot be read the read stays on the calling thread) and one split
//! read at a time in this process.

/// Below this many pids a read stays on the calling thread: a thread costs
/// more to start than it saves.
pub const PARALLEL_MIN: usize = 256;

/// How many threads a large read uses: the cores this process may run on,
/// at most 4 (read once; the kernel's per-file work is what is split).
fn read_threads() -> usize {
    static THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *THREADS.get_or_init(|| {
        std::thread::available_parallelism()
            .map_or(1, std::num::NonZeroUsize::get)
            .clamp(1, 4)
    })
}

/// Whether fewer tasks are runnable on the host than `cores` (the fourth
/// field of `/proc/loadavg`, `running/total`, counts this thread too).
fn cores_idle(cores: usize) -> bool {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| runnable(&l))
        .is_some_and(|running| running < cores)
}

/// The runnable tasks in a `/proc/loadavg` line (`0.52 0.61 0.70 2/345 6789`).
fn runnable(loadavg: &str) -> Option<usize> {
    loadavg
        .split_whitespace()
        .nth(3)?
        .split_once('/')?
        .0
        .parse()
        .ok()
}

/// The one split read a process may run at a time (see
/// [`read_in_parallel`]); released on drop.
struct SplitRead;

static SPLIT_READ_BUSY: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

impl SplitRead {
    fn claim() -> Option<Self> {
        use std::sync::atomic::Ordering;
        SPLIT_READ_BUSY
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .ok()
            .map(|_| SplitRead)
    }
}

impl Drop for SplitRead {
    fn drop(&mut self) {
        SPLIT_READ_BUSY.store(false, std::sync::atomic::Ordering::Release);
    }
}

/// `read(chunk)` over `pids` split across [`read_threads`] threads (one
/// chunk on the calling thread), results in the order of `pids`. A
/// teardown's reads of a large tree (the walk, the frozen re-read, the
/// survivors' command lines) come before its SIGKILL, on an otherwise idle
/// machine: each `/proc` read is kernel work that splits across cores.
pub fn read_in_parallel<T: Send>(pids: &[i32], read: impl Fn(&[i32]) -> Vec<T> + Sync) -> Vec<T> {
    let threads = read_threads();
    if threads < 2 || pids.len() < PARALLEL_MIN {
        return read(pids);
    }
    // Only onto idle cores, and one split read at a time in this process:
    // when the cores are busy already (many teardowns at once, a sweep
    // after a crash, other work on the host), a helper thread waits for a
    // core while the caller waits for it, and the reads take longer, not
    // less (measured: 50 concurrent orphan teardowns took 2.2 s sequential
    // and 5.6–12 s split).
    if !cores_idle(threads) {
        return read(pids);
    }
    let Some(_slot) = SplitRead::claim() else {
        return read(pids);
    };
    split_read(pids, threads, &read)
}

/// `read` over `pids` in `threads` chunks, one on the calling thread.
fn split_read<T: Send>(
    pids: &[i32],
    threads: usize,
    read: &(impl Fn(&[i32]) -> Vec<T> + Sync),
) -> Vec<T> {
    std::thread::scope(|s| {
        let mut chunks = pids.chunks(pids.len().div_ceil(threads).max(1));
        let first = chunks.next().unwrap_or_default();
        let others: Vec<_> = chunks.map(|c| s.spawn(move || read(c))).collect();
        let mut out = read(first);
        for handle in others {
            match handle.join() {
                Ok(part) => out.extend(part),
                // A read that panicked is not an empty read.
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
        out
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// `read` that doubles each pid and notes the threads it ran on.
    fn doubling(
        threads: &std::sync::Mutex<HashSet<std::thread::ThreadId>>,
        chunk: &[i32],
    ) -> Vec<i32> {
        threads
            .lock()
            .expect("no test thread panics")
            .insert(std::thread::current().id());
        chunk.iter().map(|p| p * 2).collect()
    }

    #[test]
    fn a_split_read_keeps_every_pid_and_their_order() {
        for (n, split) in [(0, 3), (1, 3), (2, 3), (3, 3), (1001, 3), (1001, 2), (7, 4)] {
            let pids: Vec<i32> = (0..n).map(|i| 7 * i + 3).collect();
            let threads = std::sync::Mutex::new(HashSet::new());
            let out = split_read(&pids, split, &|chunk: &[i32]| doubling(&threads, chunk));
            let want: Vec<i32> = pids.iter().map(|p| p * 2).collect();
            assert_eq!(out, want, "{n} pids in {split}");
            let used = threads.lock().expect("no test thread panics").len();
            assert_eq!(used, split.min(n.max(1) as usize), "{n} pids in {split}");
        }
        // Below the threshold, or with one core, a read stays where it is.
        let pids: Vec<i32> = (0..PARALLEL_MIN as i32 - 1).collect();
        let threads = std::sync::Mutex::new(HashSet::new());
        let out = read_in_parallel(&pids, |chunk| doubling(&threads, chunk));
        assert_eq!(out.len(), pids.len());
        assert_eq!(threads.lock().expect("no test thread panics").len(), 1);
    }

    #[test]
    fn the_runnable_count_is_the_fourth_field_of_loadavg() {
        assert_eq!(runnable("0.52 0.61 0.70 2/345 6789\n"), Some(2));
        assert_eq!(runnable("13.06 24.29 20.74 9/158 24414"), Some(9));
        assert_eq!(runnable("0.52 0.61 0.70"), None);
        assert_eq!(runnable("0.52 0.61 0.70 x/345 1"), None);
        assert!(
            runnable(&std::fs::read_to_string("/proc/loadavg").expect("loadavg"))
                .is_some_and(|n| n >= 1)
        );
    }

    #[test]
    fn one_split_read_at_a_time() {
        // Another test may hold the slot for a moment: wait for it.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let slot = loop {
            if let Some(slot) = SplitRead::claim() {
                break slot;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the slot was never free"
            );
            std::thread::yield_now();
        };
        assert!(SplitRead::claim().is_none(), "a second split read");
        let pids: Vec<i32> = (0..2 * PARALLEL_MIN as i32).collect();
        let threads = std::sync::Mutex::new(HashSet::new());
        let out = read_in_parallel(&pids, |chunk| doubling(&threads, chunk));
        assert_eq!(out, pids.iter().map(|p| p * 2).collect::<Vec<_>>());
        assert_eq!(
            threads.lock().expect("no test thread panics").len(),
            1,
            "read on the calling thread while another split read runs"
        );
        drop(slot);
    }
}
