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
//!   the flag [`TreeFlag::EvidenceOverBudget`] once, in the transaction that
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
//!   [`TreeFlag::EvidenceDropped`] (once per tree and process, a one-row
//!   update). So at most what evidence committed *before* the disk filled
//!   and no checkpoint moved yet (one auto-checkpoint's worth of WAL, about
//!   4 MiB, while no reader pins it) can sit in the reserve; nothing written
//!   after. The margin is the room a checkpoint needs to move that much into
//!   the database file; the `reserve` part keeps the same room free where
//!   the preallocation itself failed (a filesystem without `fallocate`).
//!   On a filesystem too small for that (a quarter of its size or less),
//!   the floor is a quarter of its size: evidence is still recorded while
//!   three quarters of it is used, never on the last quarter. Authority
//!   writes never look: they commit on the reserve. With `--ledger-reserve
//!   0` there is no reserve to keep and no floor.
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

/// The ledger's evidence bounds, shared by every clone of one `Ledger`.
#[derive(Debug)]
pub(crate) struct Gate {
    /// The ledger's directory (its filesystem's free space is looked at).
    dir: PathBuf,
    /// Free bytes under which evidence writes are refused (0: never).
    floor: u64,
    /// The per-tree budget, in bytes.
    budget: AtomicU64,
    /// Trees flagged [`TreeFlag::EvidenceDropped`] by this process.
    dropped: Mutex<HashSet<i64>>,
}

/// What one refused evidence write tells its caller.
pub(crate) struct Refused {
    pub(crate) error: LedgerError,
    /// The tree to flag [`TreeFlag::EvidenceDropped`] (first refusal for it here).
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
        let Some((free, size)) = space(&self.dir) else {
            return Ok(());
        };
        let floor = self.floor.min(size / 4);
        if free >= floor {
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
                floor >> 10
            )),
            flag,
        })
    }
}

/// Bytes free to an unprivileged writer on the filesystem of `dir`, and
/// its size.
fn space(dir: &std::path::Path) -> Option<(u64, u64)> {
    crate::proc::disk_space(dir)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::ledger::{
        EventFilter, IdentityRecord, Ledger, LedgerOptions, MemberRecord, NewTree, OwnerKind,
        OwnerRecord, TreeId,
    };

    fn member(pid: i32, arg: &str) -> MemberRecord {
        MemberRecord {
            identity: IdentityRecord {
                pid,
                start_ticks: 1000 + pid as u64,
                boot_id: "b0a7-1d".into(),
            },
            ppid: 1,
            pgid: 10,
            sid: 10,
            cgroup: None,
            uid: Some(1000),
            exe: None,
            cmdline: vec!["sh".into(), arg.into()],
            cwd: None,
        }
    }

    fn tree(ledger: &Ledger) -> TreeId {
        let owner = ledger
            .register_owner(&OwnerRecord {
                identity: member(1, "").identity,
                kind: OwnerKind::Run,
            })
            .expect("owner");
        ledger
            .create_tree(&NewTree {
                label: None,
                boundary: crate::proc::BoundaryKind::Session,
                owner,
                argv: vec!["sh".into()],
                cwd: None,
                grace_ms: None,
                timeout_ms: None,
                limits: Default::default(),
                first_signal: None,
            })
            .expect("tree")
    }

    #[test]
    fn past_its_budget_a_trees_members_are_recorded_by_digest_and_the_tree_flagged_once() {
        let dir = tempfile::tempdir().expect("temp dir");
        let ledger = Ledger::open(
            &dir.path().join("ledger.db"),
            LedgerOptions {
                busy_timeout: Duration::from_secs(2),
                ..LedgerOptions::default()
            },
        )
        .expect("open");
        // Room for two 10,000-byte command lines (each stored twice: row and event).
        ledger.set_evidence_budget(41_000);
        let (t, other) = (tree(&ledger), tree(&ledger));
        let long = "x".repeat(10_000);
        let members: Vec<MemberRecord> = (100..105).map(|p| member(p, &long)).collect();
        ledger.observe_members(t, &members).expect("observe");
        ledger
            .observe_members(other, &members[..1])
            .expect("another tree's budget is its own");
        let (row, rows) = ledger.tree_members(t).expect("read").expect("tree");
        let kept: Vec<usize> = rows.iter().map(|m| m.cmdline.concat().len()).collect();
        assert_eq!(&kept[..2], &[10_002, 10_002], "within the budget: whole");
        let whole = format!("sh\0{long}");
        let digest = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(whole.as_bytes()));
        for m in &rows[2..] {
            assert_eq!(
                m.cmdline,
                vec![format!("sha256:{digest} bytes:{} args:2", whole.len())],
                "past it: by digest"
            );
        }
        let flags = |r: &crate::ledger::TreeRow| {
            r.flags
                .iter()
                .filter(|f| **f == crate::ledger::TreeFlag::EvidenceOverBudget)
                .count()
        };
        assert_eq!(flags(&row), 1, "flagged once: {:?}", row.flags);
        let (other_row, other_rows) = ledger.tree_members(other).expect("read").expect("tree");
        assert_eq!(flags(&other_row), 0);
        assert_eq!(other_rows[0].cmdline.concat().len(), 10_002);
        // The events say the same: the digested members' cut names the budget.
        let events = ledger
            .events(&EventFilter {
                tree: Some(t),
                ..EventFilter::default()
            })
            .expect("events");
        let cuts: Vec<&serde_json::Value> = events
            .iter()
            .filter_map(|e| e.data.get("cmdline_truncated"))
            .filter(|c| !c.is_null())
            .collect();
        assert_eq!(cuts.len(), 3, "{cuts:?}");
        for c in cuts {
            assert_eq!(c["over_budget"], 41_000);
            assert_eq!(c["sha256"], digest.as_str());
            assert_eq!(c["bytes"], whole.len());
        }
        // A later sighting of a digested member is not a new program.
        let before = events.len();
        ledger.refresh_members(t, &members[4..]).expect("refresh");
        let after = ledger
            .events(&EventFilter {
                tree: Some(t),
                ..EventFilter::default()
            })
            .expect("events")
            .len();
        assert_eq!(after, before, "no member.exec for an unchanged argv");
        assert!(ledger.verify(None).expect("verify").is_ok());
    }
}
