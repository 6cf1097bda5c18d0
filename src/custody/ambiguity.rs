//! Trees this process or another found ambiguous and the ledger may not
//! hold as such yet: the in-memory set, the `unsettled/` markers
//! ([`super::markers`]) with the survivors and the deferred evidence they
//! keep, the replay of that evidence, and an operator's resolution.

use crate::ledger::TreeId;

use super::teardown;
use super::{CustodyError, Engine, markers};

/// The engine's ambiguity: what closes dispatch before (or without) the
/// ledger holding it, and how it is settled.
pub struct Ambiguity<'a> {
    engine: &'a Engine,
}

impl Engine {
    /// The ambiguity of this engine's trees ([`Ambiguity`]).
    pub fn ambiguity(&self) -> Ambiguity<'_> {
        Ambiguity { engine: self }
    }
}

impl Ambiguity<'_> {
    /// Marks a tree unsettled at once: in memory, and as a marker file that
    /// names its survivors (see [`markers`]). It stays until the tree is
    /// settled.
    pub(super) fn mark_ambiguous(
        &self,
        tree: TreeId,
        reason: &str,
        survivors: &[crate::ledger::IdentityRecord],
        pending: &[crate::ledger::Deferred],
    ) {
        if let Ok(mut set) = self.engine.ambiguous.lock() {
            set.insert(tree);
        }
        // Merged with what an earlier marker of this tree still holds: its
        // survivors and its unreplayed evidence are never dropped (the same
        // teardown passes its growing journal more than once).
        let old = markers::read(&self.engine.data_dir, tree).unwrap_or_default();
        let mut all_survivors = old.survivors;
        for s in survivors {
            if !all_survivors.contains(s) {
                all_survivors.push(s.clone());
            }
        }
        let mut all_pending = old.pending;
        for d in pending {
            if !all_pending.contains(d) {
                all_pending.push(d.clone());
            }
        }
        let batch = if old.batch.is_empty() && !all_pending.is_empty() {
            markers::new_batch()
        } else {
            old.batch
        };
        let marker = markers::Marker {
            reason: reason.to_string(),
            survivors: all_survivors,
            pending: all_pending,
            batch,
        };
        markers::write(&self.engine.data_dir, tree, &marker);
    }

    /// The tree is settled (teardown verified, or resolved by an operator).
    /// Its marker goes only once the evidence it kept is in the ledger: the
    /// marker is that evidence's only copy. Callers hold the tree's lease
    /// (or the replay is skipped when another process holds it).
    pub(super) fn forget_ambiguous(&self, tree: TreeId) {
        if let Ok(mut set) = self.engine.ambiguous.lock() {
            set.remove(&tree);
        }
        if markers::read(&self.engine.data_dir, tree).is_some_and(|m| !m.pending.is_empty()) {
            self.replay_deferred_leased(tree);
            if markers::read(&self.engine.data_dir, tree).is_some_and(|m| !m.pending.is_empty()) {
                tracing::warn!(
                    tree = tree.0,
                    "settled, but its deferred evidence is not in the ledger yet: the marker stays"
                );
                return;
            }
        }
        markers::remove(&self.engine.data_dir, tree);
    }

    pub(super) fn is_ambiguous_in_memory(&self, tree: TreeId) -> bool {
        self.ambiguous_in_memory().iter().any(|(t, _)| *t == tree)
    }

    /// The pids of the survivors an unsettled marker names for this tree
    /// that still live (what `run` tells its caller when it failed closed).
    pub fn survivors_left(&self, tree: TreeId) -> Vec<i32> {
        self.marked_survivors(tree)
            .into_iter()
            .filter(|id| self.engine.host().still_alive(&id.into()))
            .map(|id| id.pid)
            .collect()
    }

    /// Survivors a marker names for this tree: a teardown counts them as
    /// members even when the ledger never recorded them.
    pub(crate) fn marked_survivors(&self, tree: TreeId) -> Vec<crate::ledger::IdentityRecord> {
        markers::read(&self.engine.data_dir, tree)
            .map(|m| m.survivors)
            .unwrap_or_default()
    }

    /// Ambiguous trees not necessarily in the ledger yet: this process's
    /// memory and every process's marker files, with the recorded reason.
    pub fn ambiguous_in_memory(&self) -> Vec<(TreeId, String)> {
        let mut v: Vec<(TreeId, String)> = self
            .engine
            .ambiguous
            .lock()
            .map(|s| s.iter().map(|t| (*t, String::new())).collect())
            .unwrap_or_default();
        for (tree, marker) in markers::all(&self.engine.data_dir) {
            match v.iter_mut().find(|(t, _)| *t == tree) {
                Some(slot) => slot.1 = marker.reason,
                None => v.push((tree, marker.reason)),
            }
        }
        v.sort_unstable();
        v
    }

    /// Writes the evidence an unsettled marker kept for this tree (what a
    /// teardown could not write while the ledger refused writes), in order,
    /// then drops it from the marker, which stays until the tree is settled.
    /// Holds the tree's teardown lease, so two processes never write the
    /// same journal twice; a teardown calls [`Ambiguity::replay_deferred_leased`]
    /// under its own lease.
    pub fn replay_deferred(&self, tree: TreeId) {
        let has_pending =
            markers::read(&self.engine.data_dir, tree).is_some_and(|m| !m.pending.is_empty());
        if !has_pending {
            return;
        }
        // Not waiting for a lease held elsewhere: that teardown replays it.
        match teardown::Lease::take_within(&self.engine.data_dir, tree, std::time::Duration::ZERO) {
            Ok(Some(_lease)) => self.replay_deferred_leased(tree),
            Ok(None) => tracing::warn!(
                tree = tree.0,
                "no lease: deferred evidence not replayed now"
            ),
            Err(_) => {}
        }
    }

    /// For readers (`ls`, `show`): writes the evidence every unsettled
    /// marker kept, if the ledger takes writes now, so what they show is the
    /// whole trail. A tree whose teardown is running (its lease is held) is
    /// skipped: that teardown writes it. Cheap when there is no marker.
    pub fn settle_record(&self) {
        for (tree, marker) in markers::all(&self.engine.data_dir) {
            if !marker.pending.is_empty() {
                self.replay_deferred(tree);
            }
        }
    }

    pub(crate) fn replay_deferred_leased(&self, tree: TreeId) {
        let Some(mut marker) = markers::read(&self.engine.data_dir, tree) else {
            return;
        };
        if marker.pending.is_empty() {
            return;
        }
        if marker.batch.is_empty() {
            // Named (and the name kept) before the replay, so a replay whose
            // marker rewrite is lost is recognised the next time.
            marker.batch = markers::new_batch();
            markers::write(&self.engine.data_dir, tree, &marker);
        }
        let batch = marker.batch.clone();
        match self
            .engine
            .ledger
            .replay_deferred(tree, &marker.pending, &batch)
        {
            Ok(()) => {
                tracing::info!(
                    tree = tree.0,
                    writes = marker.pending.len(),
                    "deferred evidence written to the ledger"
                );
                marker.pending.clear();
                marker.batch.clear();
                markers::write(&self.engine.data_dir, tree, &marker);
            }
            Err(e) => {
                tracing::warn!(tree = tree.0, error = %e, "deferred evidence still not written")
            }
        }
    }

    /// Retries writing pending ambiguity to the ledger (it may have refused
    /// the first time): first the evidence each marker kept, then the state.
    /// Trees the ledger now holds as ambiguous stay in memory until resolved
    /// or settled by a teardown.
    pub fn flush_ambiguous(&self) {
        for (tree, _) in self.ambiguous_in_memory() {
            let id = tree;
            self.replay_deferred(id);
            match self.engine.ledger.tree(id) {
                // A terminal tree's marker is judged by the dispatch gate.
                Ok(Some(row)) if row.state.is_terminal() => {}
                Ok(Some(row)) if row.state == crate::ledger::TreeState::Ambiguous => {}
                Ok(Some(_)) => {
                    if let Err(e) = self.engine.ledger.set_state(
                        id,
                        crate::ledger::TreeState::Ambiguous,
                        Some("recorded late: the ledger refused it earlier"),
                    ) {
                        tracing::warn!(tree = tree.0, error = %e, "ambiguous state still not recorded");
                    }
                }
                Ok(None) | Err(_) => {}
            }
        }
    }

    /// Records an operator's resolution of an ambiguous tree; reopens dispatch
    /// once no other tree is unsettled. A tree the ledger already holds as
    /// ended but whose marker stayed (a teardown raced another) is settled by
    /// removing the marker.
    ///
    /// A resolution never buries a live survivor by accident: the survivors
    /// the marker names and every member the ledger holds as not exited are
    /// re-read (identity checked), and while any lives the resolution is
    /// refused, naming them and `treewarden kill`, which ends them with
    /// authority. With `force` the tree is resolved anyway and the survivors
    /// it leaves are recorded in `tree.resolved` (and flagged
    /// `survivors_left`).
    pub fn resolve(&self, tree: TreeId, note: &str, force: bool) -> Result<(), CustodyError> {
        self.resolve_by(tree, note, force, None)
    }

    /// [`Ambiguity::resolve`], recording who resolved (`by` in `tree.resolved`).
    pub fn resolve_by(
        &self,
        tree: TreeId,
        note: &str,
        force: bool,
        by: Option<&crate::ledger::Requester>,
    ) -> Result<(), CustodyError> {
        if note.trim().is_empty() {
            return Err(CustodyError::Conflict(
                "a resolution needs a non-empty --note".into(),
            ));
        }
        // The whole resolution under the tree's lease: no teardown of it
        // runs meanwhile, and the journal is replayed once.
        let _lease = teardown::Lease::take(&self.engine.data_dir, tree)?;
        // What the teardown could not write, first: the trail then shows
        // what happened before the operator's decision.
        self.replay_deferred_leased(tree);
        let (row, members) = self
            .engine
            .ledger
            .tree_members(tree)?
            .ok_or(CustodyError::UnknownTree(tree))?;
        let marked = self.is_ambiguous_in_memory(tree);
        if row.state != crate::ledger::TreeState::Ambiguous && !marked {
            return Err(CustodyError::Conflict(format!(
                "tree {} is {}, not ambiguous: nothing to resolve",
                tree.0,
                row.state.as_str()
            )));
        }
        let mut candidates = self.marked_survivors(tree);
        for m in members.iter().filter(|m| m.exited_at.is_none()) {
            let id = m.identity();
            if !candidates.contains(&id) {
                candidates.push(id);
            }
        }
        let alive: Vec<crate::ledger::IdentityRecord> = candidates
            .into_iter()
            .filter(|id| self.engine.host().still_alive(&id.into()))
            .collect();
        if !alive.is_empty() && !force {
            let pids: Vec<String> = alive.iter().map(|id| id.pid.to_string()).collect();
            return Err(CustodyError::Conflict(format!(
                "tree {} still has {} live survivor(s) (pid {}): end them with `treewarden kill {}`, or resolve with --force to leave them alive on the record",
                tree.0,
                alive.len(),
                pids.join(", "),
                tree.0
            )));
        }
        if row.state.is_terminal() {
            // Already terminal in the ledger (a teardown raced another, or
            // a force-resolved tree failed closed again): only its marker
            // is left to settle; the survivor check above still applied.
            tracing::warn!(
                tree = tree.0,
                note,
                left_alive = alive.len(),
                "resolve: tree already {}; its marker is removed",
                row.state.as_str()
            );
            self.forget_ambiguous(tree);
            return Ok(());
        }
        if row.state != crate::ledger::TreeState::Ambiguous {
            self.engine.ledger.set_state(
                tree,
                crate::ledger::TreeState::Ambiguous,
                Some("recorded late"),
            )?;
        }
        self.engine.ledger.resolve(tree, note, &alive, by)?;
        if !alive.is_empty() {
            self.engine
                .ledger
                .add_flag(tree, crate::ledger::TreeFlag::SurvivorsLeft)?;
        }
        self.forget_ambiguous(tree);
        if alive.is_empty()
            && let Some(dir) = row.cgroup.as_deref()
        {
            teardown::remove_cgroup(self.engine.host(), std::path::Path::new(dir));
        }
        Ok(())
    }
}
