//! Evidence is budgeted, and it never spends the reserve kept for
//! authority.
//!
//! The ledger records two kinds of facts. *Authority and final records*
//! (`kill.authorized`, `signal.sent`, `tree.state`, `tree.ended`, the
//! survivors' snapshot, spawns) stand between a frozen tree and its
//! SIGKILL or close a tree's record; *evidence* (members seen, their
//! execs and exits, `last_seen` bumps, scan rows) is what a tree's own
//! behaviour makes the ledger write, at the tree's pace. A tree churning
//! members with long command lines grew the ledger by 110 MiB in 7 s, and
//! on a full disk spent the WAL's reserve on its own evidence: the next
//! kill of anyone's tree could not be authorized.
//!
//! Two bounds, both here:
//!
//! - **A budget per tree** (`serve --evidence-max`, [`DEFAULT_EVIDENCE_MAX`]):
//!   bytes of command lines, exe and cwd the ledger stored for the tree's
//!   members, in rows and events (`trees.evidence_bytes`, counted by the
//!   writer in the member's own transaction). Past it, a member's argv is
//!   recorded by digest (`sha256:<hex> bytes:<n> args:<k>`, and the same in
//!   its event's `cmdline_truncated` with `over_budget`), and the tree gets
//!   the flag [`FLAG_EVIDENCE_OVER_BUDGET`] once, in the transaction that
//!   first digests. Identities, groups and exits are still recorded: what
//!   the teardown needs is never budgeted away.
//!
//! - **The reserve is authority's alone.** The WAL's reserve
//!   (`db::reserve_wal`, `--ledger-reserve`) is blocks allocated past the
//!   WAL's end; they are spent only when checkpoints cannot grow the
//!   database file, i.e. when the filesystem is full. An evidence write
//!   first looks at the free space of the ledger's filesystem (`statvfs`)
//!   and is refused ([`LedgerError::Full`]) below the floor,
//!   `reserve + EVIDENCE_MARGIN`, and the tree is flagged
//!   [`FLAG_EVIDENCE_DROPPED`] (once per tree and process, a one-row
//!   update). So at most what evidence committed *before* the disk filled
//!   and no checkpoint moved yet (one auto-checkpoint's worth of WAL, about
//!   4 MiB, while no reader pins it) can sit in the reserve; nothing written
//!   after. The margin is the room a checkpoint needs to move that much into
//!   the database file; the `reserve` part keeps the same room free where
//!   the preallocation itself failed (a filesystem without `fallocate`).
//!   Authority writes never look: they commit on the reserve. With
//!   `--ledger-reserve 0` there is no reserve to keep and no floor.
//!
//! Which writes are evidence is decided per `Ledger` method, not per caller:
//! `observe_members`, `bump_last_seen`, `refresh_members`, `record_exits`,
//! `record_scan`. Escapes (`record_escape`) are not refused: an escapee is a
//! target of the next teardown's signals; they are budgeted like members.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use super::error::LedgerError;
use super::types::TreeId;

/// The default evidence budget of one tree: room for hundreds of members
/// with command lines at the 64 KiB field cap, and far more of ordinary ones.
pub const DEFAULT_EVIDENCE_MAX: u64 = 16 << 20;

/// Free space kept above the reserve before an evidence write is refused:
/// room for a checkpoint to move a full auto-checkpoint of WAL (1,000
/// pages) into the database file.
pub const EVIDENCE_MARGIN: u64 = 4 << 20;

/// The tree's members past its evidence budget are recorded by digest.
pub const FLAG_EVIDENCE_OVER_BUDGET: &str = "evidence_over_budget";

/// Evidence of the tree was not recorded: the ledger's filesystem was
/// under the floor that keeps the reserve for authority.
pub const FLAG_EVIDENCE_DROPPED: &str = "evidence_dropped";

/// The ledger's evidence bounds, shared by every clone of one `Ledger`.
#[derive(Debug)]
pub(crate) struct Gate {
    /// The ledger's directory (its filesystem's free space is looked at).
    dir: PathBuf,
    /// Free bytes under which evidence writes are refused (0: never).
    floor: u64,
    /// The per-tree budget, in bytes.
    budget: AtomicU64,
    /// Trees flagged [`FLAG_EVIDENCE_DROPPED`] by this process.
    dropped: Mutex<HashSet<i64>>,
}

/// What one refused evidence write tells its caller.
pub(crate) struct Refused {
    pub(crate) error: LedgerError,
    /// The tree to flag [`FLAG_EVIDENCE_DROPPED`] (first refusal for it here).
    pub(crate) flag: Option<TreeId>,
}

impl Gate {
    pub(crate) fn new(dir: PathBuf, reserve: u64) -> Gate {
        Gate {
            dir,
            floor: if reserve == 0 {
                0
            } else {
                reserve.saturating_add(EVIDENCE_MARGIN)
            },
            budget: AtomicU64::new(DEFAULT_EVIDENCE_MAX),
            dropped: Mutex::new(HashSet::new()),
        }
    }

    pub(crate) fn budget(&self) -> u64 {
        self.budget.load(Ordering::Relaxed)
    }

    pub(crate) fn set_budget(&self, bytes: u64) {
        self.budget.store(bytes, Ordering::Relaxed);
    }

    /// `Ok` when an evidence write of `tree` may go ahead: the filesystem
    /// has at least the floor free (or its free space cannot be read: a
    /// write is not refused on a guess; the reserve still stands behind it).
    pub(crate) fn admit(&self, tree: Option<TreeId>) -> Result<(), Refused> {
        if self.floor == 0 {
            return Ok(());
        }
        let Some(free) = free_bytes(&self.dir) else {
            return Ok(());
        };
        if free >= self.floor {
            return Ok(());
        }
        let flag = tree.filter(|t| {
            self.dropped
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert(t.0)
        });
        Err(Refused {
            error: LedgerError::Full(format!(
                "evidence not recorded: {} has {} KiB free, under the {} KiB kept for authorizations (the ledger's reserve and margin)",
                self.dir.display(),
                free >> 10,
                self.floor >> 10
            )),
            flag,
        })
    }
}

/// Bytes free to an unprivileged writer on the filesystem of `dir`.
fn free_bytes(dir: &std::path::Path) -> Option<u64> {
    #[cfg(unix)]
    {
        let st = rustix::fs::statvfs(dir).ok()?;
        Some(st.f_bavail.saturating_mul(st.f_frsize))
    }
    #[cfg(windows)]
    {
        crate::proc::free_bytes(dir)
    }
}
