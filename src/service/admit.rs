//! The per-principal cap on live trees (`serve --max-trees-per-user`),
//! counted and reserved atomically without serializing a principal's
//! spawns.
//!
//! A count read from the ledger and a spawn that commits later leave a
//! window: 40 spawns sent on 40 connections before any answer all read
//! "0 live" and all ran. Here every spawn of a capped principal enters an
//! in-flight table *before* it reads the ledger's count, and leaves it (a
//! guard's drop) only after its spawn committed or failed. It is admitted
//! only if `live in the ledger + in flight (itself included, as counted at
//! its entry) <= cap`.
//!
//! Why this never over-admits: take the admitted spawns of one principal
//! and the one among them that entered last, `r`. Every other admitted
//! spawn either was still in flight when `r` entered (so `r`'s in-flight
//! count includes it), or had left before: its tree row was then committed
//! (or it failed and holds nothing) before `r` read the ledger, so `r`'s
//! live count includes it while it lives. `r` admitted itself only with
//! that sum at most the cap, so at most `cap` of them live at once.
//!
//! What it may do instead: over-refuse, briefly. A spawn whose tree row is
//! already committed but that has not yet left the table is counted twice
//! by a spawn entering meanwhile (once live, once in flight); that one is
//! refused (503, try again), never a spawn too many run.
//!
//! The guard leaves the table when the spawn's own task ends, not when the
//! request's future is dropped: a client that hangs up mid-spawn does not
//! stop the spawn (see [`super::Service::spawn`]), so neither may it free
//! the reservation before the tree row is there.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::ledger::TreeOwner;

/// Spawns in flight, per principal.
#[derive(Debug, Default)]
pub(crate) struct InFlight {
    counts: Mutex<HashMap<TreeOwner, usize>>,
}

/// One spawn's place in [`InFlight`]; dropping it leaves.
#[derive(Debug)]
pub struct Reservation {
    table: Arc<InFlight>,
    owner: TreeOwner,
    /// In flight for this principal when it entered, itself included.
    at_entry: usize,
}

impl Reservation {
    /// Spawns of this principal in flight at entry, this one included.
    pub fn in_flight(&self) -> usize {
        self.at_entry
    }
}

impl InFlight {
    /// Enters one spawn of `owner`.
    pub(crate) fn enter(self: &Arc<Self>, owner: TreeOwner) -> Reservation {
        let mut counts = self
            .counts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let n = counts.entry(owner).or_insert(0);
        *n += 1;
        Reservation {
            table: self.clone(),
            owner,
            at_entry: *n,
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut counts = self
            .table
            .counts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(n) = counts.get_mut(&self.owner) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                counts.remove(&self.owner);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_entry_counts_itself_and_those_still_in_flight_and_leaving_frees_its_place() {
        let t = Arc::new(InFlight::default());
        let a = t.enter(TreeOwner::Uid(1000));
        let b = t.enter(TreeOwner::Uid(1000));
        let other = t.enter(TreeOwner::Token(7));
        assert_eq!((a.in_flight(), b.in_flight(), other.in_flight()), (1, 2, 1));
        drop(a);
        let c = t.enter(TreeOwner::Uid(1000));
        assert_eq!(c.in_flight(), 2, "b and c");
        drop((b, c, other));
        assert!(
            t.counts.lock().expect("lock").is_empty(),
            "no entry left behind"
        );
    }
}
