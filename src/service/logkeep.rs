//! Ended trees' captured logs, bounded per principal (by size) and by age.
//!
//! A live tree's log is capped as it is written (`logcap.rs`, `--log-max`);
//! once its tree ended, the log stays in `<data-dir>/logs/` for `treewarden
//! logs` and the API to read. Kept without a bound, one user's thirty ended
//! trees of 12 MB each took the data dir under the free-space floor
//! (`--min-free`), and every user's next logged spawn was refused.
//!
//! This thread looks every [`EVERY`]: each `tree-<id>.log` whose tree has
//! ended (a terminal state in the ledger, or no row any more: pruned) is
//! counted against the principal that asked for the tree (its socket uid or
//! its token; trees nobody named, the service's own and the CLI's, share
//! one account). Per principal, newest first, a log is kept if it fits what
//! is left of `serve --ended-logs-per-user` and is younger (by its last
//! write) than `serve --ended-logs-for`; the rest are removed. So one
//! principal's ended output takes at most its budget of the data dir, and
//! never another principal's.
//!
//! What it does not do: touch a live tree's log (the cap does), or count a
//! live log against anyone's budget; one principal's live trees hold at
//! most `--max-trees-per-user` times `--log-max`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use crate::ledger::{Ledger, TreeId, TreeOwner, TreeRow};

/// How often the logs directory is looked at.
pub(crate) const EVERY: Duration = Duration::from_secs(2);

/// The bounds on ended trees' logs (`serve --ended-logs-per-user`,
/// `--ended-logs-for`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EndedLogs {
    /// Bytes of ended trees' logs one principal keeps (the newest first).
    pub per_principal: u64,
    /// Age past which an ended tree's log is removed (from its last write).
    pub keep_for: Duration,
}

impl Default for EndedLogs {
    fn default() -> Self {
        Self {
            per_principal: DEFAULT_PER_PRINCIPAL,
            keep_for: DEFAULT_KEEP_FOR,
        }
    }
}

/// The default `--ended-logs-per-user`: 64 MiB.
pub const DEFAULT_PER_PRINCIPAL: u64 = 64 << 20;
/// The default `--ended-logs-for`: 7 days.
pub const DEFAULT_KEEP_FOR: Duration = Duration::from_secs(7 * 24 * 3600);

/// One ended tree's log as the directory shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct EndedLog {
    pub(crate) path: PathBuf,
    pub(crate) principal: TreeOwner,
    pub(crate) bytes: u64,
    pub(crate) modified: SystemTime,
}

/// The logs to remove: per principal, newest first, every log past its
/// byte budget or older than the age bound. Pure (the tests drive it).
pub(crate) fn to_remove(
    mut logs: Vec<EndedLog>,
    bounds: EndedLogs,
    now: SystemTime,
) -> Vec<PathBuf> {
    logs.sort_by(|a, b| b.modified.cmp(&a.modified).then(a.path.cmp(&b.path)));
    let mut spent: HashMap<TreeOwner, u64> = HashMap::new();
    let mut out = Vec::new();
    for log in logs {
        let old = now
            .duration_since(log.modified)
            .is_ok_and(|age| age > bounds.keep_for);
        let total = spent.entry(log.principal).or_insert(0);
        if old || total.saturating_add(log.bytes) > bounds.per_principal {
            out.push(log.path);
        } else {
            *total += log.bytes;
        }
    }
    out
}

/// The running thread; dropping it stops it (within [`EVERY`]).
pub(crate) struct LogKeep {
    stop: Arc<AtomicBool>,
}

impl Drop for LogKeep {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

impl LogKeep {
    /// Starts bounding the ended trees' logs in `dir`. `None` (logged)
    /// when the thread cannot start.
    pub(crate) fn start(dir: PathBuf, ledger: Ledger, bounds: EndedLogs) -> Option<LogKeep> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let spawned = std::thread::Builder::new()
            .name("log-keep".into())
            .spawn(move || {
                // Ended trees stay ended: whose each one is, read once.
                let mut ended: HashMap<i64, TreeOwner> = HashMap::new();
                while !flag.load(Ordering::Relaxed) {
                    keep_once(&dir, &ledger, bounds, &mut ended);
                    let mut waited = Duration::ZERO;
                    while waited < EVERY && !flag.load(Ordering::Relaxed) {
                        std::thread::sleep(Duration::from_millis(100));
                        waited += Duration::from_millis(100);
                    }
                }
            });
        match spawned {
            Ok(_) => Some(LogKeep { stop }),
            Err(e) => {
                tracing::warn!(error = %e, "ended trees' logs are not bounded (no thread)");
                None
            }
        }
    }
}

/// The tree id of a log's file name (`tree-<id>.log`).
fn tree_of(name: &std::ffi::OsStr) -> Option<i64> {
    name.to_str()?
        .strip_prefix("tree-")?
        .strip_suffix(".log")?
        .parse()
        .ok()
}

/// One look: the ended trees' logs listed, and the ones past their bounds
/// removed.
fn keep_once(dir: &Path, ledger: &Ledger, bounds: EndedLogs, ended: &mut HashMap<i64, TreeOwner>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut logs = Vec::new();
    let mut present = std::collections::HashSet::new();
    for entry in entries.flatten() {
        let Some(id) = tree_of(&entry.file_name()) else {
            continue;
        };
        present.insert(id);
        let principal = match ended.get(&id) {
            Some(p) => *p,
            None => match ledger.tree(TreeId(id)) {
                Ok(Some(row)) if row.state.is_terminal() => {
                    let p = TreeRow::principal(&row);
                    ended.insert(id, p);
                    p
                }
                // Live: the cap bounds it.
                Ok(Some(_)) => continue,
                // Pruned from the ledger: ended, nobody's to name.
                Ok(None) => {
                    ended.insert(id, TreeOwner::Nobody);
                    TreeOwner::Nobody
                }
                Err(e) => {
                    tracing::debug!(tree = id, error = %e, "ended logs: tree not read");
                    continue;
                }
            },
        };
        let Ok(meta) = entry.metadata() else {
            continue;
        };
        logs.push(EndedLog {
            path: entry.path(),
            principal,
            bytes: meta.len(),
            modified: meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
        });
    }
    // Forget trees whose logs are gone: the cache stays the directory's size.
    ended.retain(|id, _| present.contains(id));
    for path in to_remove(logs, bounds, SystemTime::now()) {
        match std::fs::remove_file(&path) {
            Ok(()) => {
                tracing::debug!(log = %path.display(), "ended tree's log removed (past its principal's bounds)")
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(log = %path.display(), error = %e, "ended tree's log not removed")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log(name: &str, who: TreeOwner, mib: u64, age_s: u64, now: SystemTime) -> EndedLog {
        EndedLog {
            path: PathBuf::from(name),
            principal: who,
            bytes: mib << 20,
            modified: now - Duration::from_secs(age_s),
        }
    }

    #[test]
    fn each_principal_keeps_its_newest_logs_within_its_budget_and_age() {
        let now = SystemTime::now();
        let (a, b) = (TreeOwner::Uid(1000), TreeOwner::Uid(1001));
        let bounds = EndedLogs {
            per_principal: 20 << 20,
            keep_for: Duration::from_secs(3600),
        };
        let logs = vec![
            log("a1", a, 12, 30, now),
            log("a2", a, 12, 20, now),
            log("a3", a, 12, 10, now),
            log("b1", b, 12, 40, now),
            log("b-old", b, 1, 7200, now),
        ];
        let mut gone = to_remove(logs, bounds, now);
        gone.sort();
        // a keeps its newest 12 MiB (a3); a2 would pass 20 MiB, a1 too.
        // b's one flood-free log stays; its old one goes by age.
        assert_eq!(
            gone,
            vec![
                PathBuf::from("a1"),
                PathBuf::from("a2"),
                PathBuf::from("b-old")
            ]
        );
    }

    #[test]
    fn log_names_give_their_tree() {
        assert_eq!(tree_of(std::ffi::OsStr::new("tree-42.log")), Some(42));
        assert_eq!(tree_of(std::ffi::OsStr::new("tree-x.log")), None);
        assert_eq!(tree_of(std::ffi::OsStr::new("other")), None);
    }
}
