//! What a tree's cgroup says it consumed: `cpu.stat` (core, always there),
//! and `memory.peak`, `pids.peak`, `io.stat` where their controllers are
//! enabled for the tree's cgroup. A file the host does not give reads as
//! `None`: absent, never zero.

use std::path::Path;

pub use crate::proc::types::ContainerUsage;

/// How many processes the kernel's OOM killer ended in the cgroup (and its
/// descendants) so far: `oom_kill` of `memory.events`. `None` where the
/// memory controller is not enabled for it (no such file).
pub fn oom_kills(dir: &Path) -> Option<u64> {
    super::pseudo::read_path_string(&dir.join("memory.events"))
        .ok()
        .and_then(|text| keyed(&text, "oom_kill"))
}

/// Reads the cgroup's usage files. Nothing here writes or signals.
pub fn container_usage(dir: &Path) -> ContainerUsage {
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).ok();
    let cpu_usec = read("cpu.stat").and_then(|text| keyed(&text, "usage_usec"));
    let single = |name: &str| read(name).and_then(|t| t.trim().parse::<u64>().ok());
    let (io_read_bytes, io_write_bytes) = match read("io.stat") {
        // One line per device: "8:0 rbytes=.. wbytes=.. rios=.. ...".
        Some(text) => {
            let sum = |key: &str| {
                text.lines()
                    .flat_map(|l| l.split_whitespace())
                    .filter_map(|kv| kv.strip_prefix(key)?.strip_prefix('=')?.parse::<u64>().ok())
                    .sum::<u64>()
            };
            (Some(sum("rbytes")), Some(sum("wbytes")))
        }
        None => (None, None),
    };
    ContainerUsage {
        cpu_usec,
        memory_peak_bytes: single("memory.peak"),
        pids_peak: single("pids.peak"),
        io_read_bytes,
        io_write_bytes,
        oom_kills: oom_kills(dir),
    }
}

/// Keeps a tree's log file under `cap` bytes by dropping its oldest bytes,
/// down to about three quarters of the cap: `FALLOC_FL_COLLAPSE_RANGE`
/// removes whole blocks from the front (ext4, xfs), and the tree, which
/// writes with `O_APPEND`, goes on at the new end. Where the filesystem
/// cannot collapse, the oldest blocks are punched out instead (the space is
/// freed; the file keeps its length, with a hole at the front). Returns how
/// many bytes were dropped.
pub fn cap_log(path: &Path, cap: u64) -> std::io::Result<u64> {
    use std::os::unix::fs::MetadataExt;
    // One stat per call (every scan tick): the file is opened only when
    // there is something to drop.
    let meta = std::fs::metadata(path)?;
    let block = meta.blksize().max(512);
    let used = meta.blocks() * 512;
    // What the file occupies is what the cap bounds: a file whose front was
    // punched out already (length kept, blocks freed) is left alone.
    if used <= cap {
        return Ok(0);
    }
    let file = std::fs::OpenOptions::new().write(true).open(path)?;
    use rustix::fs::FallocateFlags as F;
    // Blocks allocated past the end (the tree called fallocate with
    // KEEP_SIZE on its log) count against the cap too: freed.
    let end = meta.len().div_ceil(block) * block;
    if used > end {
        // A truncate to the length drops every block past it (ext4, xfs,
        // tmpfs), wherever the tree put them.
        file.set_len(meta.len())?;
    }
    let keep = cap / 4 * 3;
    let drop = (meta.len().saturating_sub(keep)) / block * block;
    if drop == 0 {
        return Ok(used.saturating_sub(end));
    }
    // Followers (`logs --follow`) read under a shared lock, so a collapse
    // never moves the bytes between their check and their read. Never
    // waited for: the tree holds its log open and may lock it itself, and
    // the cap must not stall on it; where the lock is not free the front
    // is punched out instead (offsets stay, followers are safe).
    if file.try_lock().is_err() {
        rustix::fs::fallocate(&file, F::PUNCH_HOLE | F::KEEP_SIZE, 0, drop)
            .map_err(std::io::Error::from)?;
        return Ok(drop);
    }
    match rustix::fs::fallocate(&file, F::COLLAPSE_RANGE, 0, drop) {
        Ok(()) => Ok(drop),
        Err(_) => {
            rustix::fs::fallocate(&file, F::PUNCH_HOLE | F::KEEP_SIZE, 0, drop)
                .map_err(std::io::Error::from)?;
            Ok(drop)
        }
    }
}

/// The controllers a cgroup offers its children (`cgroup.controllers`).
pub fn cgroup_controllers(dir: &Path) -> Result<Vec<String>, crate::proc::ProcError> {
    let file = dir.join("cgroup.controllers");
    let text =
        std::fs::read_to_string(&file).map_err(|e| crate::proc::ProcError::cgroup(&file, e))?;
    Ok(text.split_whitespace().map(String::from).collect())
}

/// The value of `key` in a flat-keyed cgroup file (`key value` per line).
fn keyed(text: &str, key: &str) -> Option<u64> {
    text.lines()
        .filter_map(|l| l.split_once(' '))
        .find(|(k, _)| *k == key)
        .and_then(|(_, v)| v.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_what_is_there_and_leaves_the_rest_absent() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(
            dir.path().join("cpu.stat"),
            "usage_usec 1234\nuser_usec 1000\nsystem_usec 234\n",
        )
        .expect("cpu.stat");
        std::fs::write(
            dir.path().join("io.stat"),
            "8:0 rbytes=100 wbytes=7 rios=1 wios=1\n8:16 rbytes=5 wbytes=3 rios=1 wios=1\n",
        )
        .expect("io.stat");
        let u = container_usage(dir.path());
        assert_eq!(u.cpu_usec, Some(1234));
        assert_eq!((u.io_read_bytes, u.io_write_bytes), (Some(105), Some(10)));
        assert_eq!(u.memory_peak_bytes, None);
        assert_eq!(u.pids_peak, None);
    }
}
