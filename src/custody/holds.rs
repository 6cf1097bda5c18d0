//! The budget of held handles: how many loose members this process keeps a
//! pidfd (a process handle) open on, per tree, per principal and in all.
//!
//! Why it exists: a loose member (outside its tree's group and cgroup) is
//! held by a verified pidfd from the tick that first finds it so
//! ([`super::TreeWatch`]'s `vet`), and a pidfd is a descriptor. Unbounded,
//! one user's tree that forks hundreds of `setsid` children takes the
//! service's descriptors down to the serving loop's reserve, and accept
//! pauses for every user. So every hold takes a
//! [`HoldPermit`] first, granted only while the tree, its principal and the
//! process are all under their caps; the permit lives beside the handle and
//! gives its place back when the handle is dropped.
//!
//! The caps: [`HoldCaps::per_tree`] (`serve --max-held-per-tree`),
//! [`HoldCaps::per_principal`] (`--max-held-per-user`), and, where the
//! host has a descriptor limit, half of what the soft `RLIMIT_NOFILE`
//! leaves above the serving loop's reserve ([`HoldCaps::reserve`]), read
//! at every take: holds alone never bring the free descriptors down to the
//! reserve, and the other half stays for connections, the ledger and
//! `/proc` reads.
//!
//! A member refused a permit is still a member: recorded, escapes and exits
//! written, signalled. It is only not *held*: it is known by its identity
//! and the uid it was recorded with, and a signal to it goes through a
//! handle taken at that moment and dropped after, once the uid read through
//! it shows the member (`TreeWatch::witnessed`). The tree is flagged
//! `holds_capped` once, with a `tree.holds_capped` event.
//!
//! What it must never do: refuse anything but a hold (a refused permit never
//! drops a member, an escape, or a signal), or let a count outlive its
//! handle (the permit is the count: released on drop, never by hand).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::ledger::{TreeId, TreeOwner};

/// The default of `serve --max-held-per-tree`.
pub const DEFAULT_PER_TREE: usize = 256;

/// The default of `serve --max-held-per-user`.
pub const DEFAULT_PER_PRINCIPAL: usize = 1024;

/// Descriptors the serving loop keeps free (its accept pauses under them):
/// holds never count on them.
pub const DEFAULT_RESERVE: u64 = 128;

/// The caps on held handles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HoldCaps {
    /// Handles one tree's loose members may hold at once.
    pub per_tree: usize,
    /// Handles the trees of one principal may hold at once.
    pub per_principal: usize,
    /// Descriptors kept free under the soft `RLIMIT_NOFILE` for the serving
    /// loop; holds take at most half of what is left above them.
    pub reserve: u64,
}

impl Default for HoldCaps {
    fn default() -> Self {
        Self {
            per_tree: DEFAULT_PER_TREE,
            per_principal: DEFAULT_PER_PRINCIPAL,
            reserve: DEFAULT_RESERVE,
        }
    }
}

impl HoldCaps {
    /// The most handles this process holds in all under a soft descriptor
    /// limit of `nofile` (`None`: no limit, no host cap).
    pub fn host_cap(&self, nofile: Option<u64>) -> Option<usize> {
        let n = nofile?.saturating_sub(self.reserve) / 2;
        Some(usize::try_from(n).unwrap_or(usize::MAX))
    }
}

/// Which cap refused a hold (a metric label and the event's `cap`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HoldCap {
    Tree,
    Principal,
    Host,
}

impl HoldCap {
    pub const ALL: [HoldCap; 3] = [HoldCap::Tree, HoldCap::Principal, HoldCap::Host];

    pub fn as_str(self) -> &'static str {
        match self {
            HoldCap::Tree => "tree",
            HoldCap::Principal => "principal",
            HoldCap::Host => "host",
        }
    }
}

/// A refused hold: the cap, its value, and what the tree held then.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub cap: HoldCap,
    pub limit: usize,
    /// Handles the tree held when it was refused.
    pub tree_held: usize,
}

#[derive(Debug, Default)]
struct Counts {
    total: usize,
    by_tree: HashMap<TreeId, usize>,
    by_principal: HashMap<TreeOwner, usize>,
}

/// The process's held handles, counted; shared by every clone of an
/// [`super::Engine`] (the service's scan watches and its teardowns draw
/// on one budget).
#[derive(Debug)]
pub struct Holds {
    caps: Mutex<HoldCaps>,
    counts: Mutex<Counts>,
    /// Refusals by cap, in [`HoldCap::ALL`]'s order.
    refused: [AtomicU64; 3],
}

impl Default for Holds {
    fn default() -> Self {
        Self::new(HoldCaps::default())
    }
}

impl Holds {
    pub fn new(caps: HoldCaps) -> Self {
        Self {
            caps: Mutex::new(caps),
            counts: Mutex::default(),
            refused: Default::default(),
        }
    }

    pub fn set_caps(&self, caps: HoldCaps) {
        *self.caps.lock().unwrap_or_else(|e| e.into_inner()) = caps;
    }

    pub fn caps(&self) -> HoldCaps {
        *self.caps.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A place for one more handle of `tree` (of `principal`), if every
    /// cap has room; `nofile` is the soft descriptor limit now (`None`:
    /// none). The permit gives the place back when dropped.
    pub fn take(
        self: &Arc<Self>,
        tree: TreeId,
        principal: TreeOwner,
        nofile: Option<u64>,
    ) -> Result<HoldPermit, Refusal> {
        let caps = self.caps();
        let mut c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        let tree_held = c.by_tree.get(&tree).copied().unwrap_or(0);
        let principal_held = c.by_principal.get(&principal).copied().unwrap_or(0);
        let refusal = if tree_held >= caps.per_tree {
            Some((HoldCap::Tree, caps.per_tree))
        } else if principal_held >= caps.per_principal {
            Some((HoldCap::Principal, caps.per_principal))
        } else {
            caps.host_cap(nofile)
                .filter(|&cap| c.total >= cap)
                .map(|cap| (HoldCap::Host, cap))
        };
        if let Some((cap, limit)) = refusal {
            return Err(Refusal {
                cap,
                limit,
                tree_held,
            });
        }
        c.total += 1;
        *c.by_tree.entry(tree).or_insert(0) += 1;
        *c.by_principal.entry(principal).or_insert(0) += 1;
        Ok(HoldPermit {
            holds: self.clone(),
            tree,
            principal,
        })
    }

    /// Handles held now, in all.
    pub fn held(&self) -> usize {
        self.counts.lock().unwrap_or_else(|e| e.into_inner()).total
    }

    /// Handles `tree` holds now.
    pub fn held_by_tree(&self, tree: TreeId) -> usize {
        let c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        c.by_tree.get(&tree).copied().unwrap_or(0)
    }

    /// Counts a member refused a hold by `cap` (once per member and watch:
    /// a member kept unheld is offered a place again at every tick).
    pub fn note_refused(&self, cap: HoldCap) {
        self.refused[cap as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Members refused a hold, by `cap`, since start.
    pub fn refused(&self, cap: HoldCap) -> u64 {
        self.refused[cap as usize].load(Ordering::Relaxed)
    }

    fn release(&self, tree: TreeId, principal: TreeOwner) {
        let mut c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        c.total = c.total.saturating_sub(1);
        for_key(&mut c.by_tree, tree);
        for_key(&mut c.by_principal, principal);
    }
}

/// One count down, the entry gone at zero.
fn for_key<K: std::hash::Hash + Eq>(map: &mut HashMap<K, usize>, key: K) {
    if let Some(n) = map.get_mut(&key) {
        *n = n.saturating_sub(1);
        if *n == 0 {
            map.remove(&key);
        }
    }
}

/// One handle's place in [`Holds`]; dropping it gives the place back. Kept
/// beside the handle it was taken for, so the two go together.
#[derive(Debug)]
pub struct HoldPermit {
    holds: Arc<Holds>,
    tree: TreeId,
    principal: TreeOwner,
}

impl Drop for HoldPermit {
    fn drop(&mut self) {
        self.holds.release(self.tree, self.principal);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps(per_tree: usize, per_principal: usize) -> HoldCaps {
        HoldCaps {
            per_tree,
            per_principal,
            reserve: 128,
        }
    }

    #[test]
    fn each_cap_refuses_at_its_value_and_a_dropped_permit_gives_its_place_back() {
        let h = Arc::new(Holds::new(caps(2, 3)));
        let (a, b, c) = (TreeId(1), TreeId(2), TreeId(3));
        let u = TreeOwner::Uid(1000);
        let p1 = h.take(a, u, None).expect("first");
        let _p2 = h.take(a, u, None).expect("second");
        let r = h.take(a, u, None).expect_err("the tree's cap");
        assert_eq!((r.cap, r.limit, r.tree_held), (HoldCap::Tree, 2, 2));
        let _p3 = h.take(b, u, None).expect("another tree of the same user");
        let r = h.take(c, u, None).expect_err("the principal's cap");
        assert_eq!((r.cap, r.limit, r.tree_held), (HoldCap::Principal, 3, 0));
        // Another principal is not refused for this one's holds.
        let _q = h.take(c, TreeOwner::Uid(1001), None).expect("another user");
        assert_eq!(h.held(), 4);
        drop(p1);
        assert_eq!((h.held(), h.held_by_tree(a)), (3, 1));
        let _p4 = h.take(a, u, None).expect("the place given back");
        assert_eq!(h.refused(HoldCap::Tree), 0, "counted by the caller");
        h.note_refused(HoldCap::Principal);
        assert_eq!(h.refused(HoldCap::Principal), 1);
    }

    #[test]
    fn the_host_cap_is_half_of_what_the_descriptor_limit_leaves_above_the_reserve() {
        let c = caps(usize::MAX, usize::MAX);
        assert_eq!(c.host_cap(None), None);
        assert_eq!(c.host_cap(Some(700)), Some(286));
        assert_eq!(c.host_cap(Some(100)), Some(0), "under the reserve: none");
        let h = Arc::new(Holds::new(c));
        let held: Vec<HoldPermit> = (0..286)
            .map(|i| h.take(TreeId(i), TreeOwner::Uid(i as u32), Some(700)))
            .collect::<Result<_, _>>()
            .expect("286 places");
        let r = h
            .take(TreeId(999), TreeOwner::Uid(999), Some(700))
            .expect_err("the host's cap");
        assert_eq!((r.cap, r.limit), (HoldCap::Host, 286));
        // A raised limit makes room at once (read at every take).
        let more = h.take(TreeId(999), TreeOwner::Uid(999), Some(1000));
        assert!(more.is_ok());
        drop((held, more));
        assert_eq!(h.held(), 0, "every place given back");
        assert!(h.counts.lock().expect("lock").by_tree.is_empty());
    }
}
