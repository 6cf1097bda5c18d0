//! One `/proc` walk shared by every caller that asks while it is due:
//! the walk coalescer behind [`super::KernelHost`]'s
//! `snapshot`.
//!
//! Why it exists: a shutdown drain tears thousands of trees down at once,
//! and each teardown walks all of `/proc` at least twice (its first walk,
//! its verifying walk). With 10,000 processes on the host a walk reads
//! 10,000 stat files (about 100 ms here), so 2,000 teardowns walking each
//! on their own did about 30 trees a second. Every one of those walks
//! reads the same files; one walk can answer all who are waiting for one.
//!
//! What it must never do: hand a caller a walk that started before the
//! caller asked. A teardown's verify asks after its kill, and must see the
//! state after it: a walk already under way may have read a killed
//! process's stat before the kill, so it would show a dead member alive
//! (harmless: another round) or, worse, one forked after the caller's last
//! look but read before it as absent (a member missed by the verify that
//! ends the teardown). Nor may it run two walks at once (that is the cost
//! it removes), or make a lone caller pay more than a mutex.
//!
//! The argument, with walks numbered 1, 2, … in the order they start (one
//! at a time, under the mutex):
//!
//! - A caller arriving while no walk runs starts walk `k = started + 1`
//!   at once: it started after the caller asked.
//! - A caller arriving while walk `started` runs is registered for walk
//!   `k = started + 1`, which has not started (it starts only once the
//!   running one ended), so it too starts after the caller asked. The
//!   caller waits until walk `k` has ended; if no walk runs when it
//!   wakes and walk `k` has not started, it starts walk `k` itself (the
//!   first waiter to wake does: whoever comes first).
//! - A caller takes the result of exactly the walk it was given, `k`,
//!   never an older one: the results are kept by walk number until every
//!   caller that walk was given has taken it.
//!
//! So every snapshot handed out began after its caller's request, which is
//! what a walk of the caller's own would have given it (a walk that began
//! later still is only fresher). Nothing about the result depends on who
//! asked: `/proc` is process-wide, so the coalescer is one static for the
//! process. A walk that panics ends its turn (a guard clears `running`
//! and wakes the waiters, one of which starts the next walk) and its
//! callers (the one walking) see the panic; the others get the next walk.
//!
//! The cost for a lone caller: one lock to start, one to publish, no wait
//! and no copy. A walk shared by `n` callers is cloned `n - 1` times (the
//! walker keeps the original, the last taker moves the shared one out when
//! nobody else still holds it), each clone made by its taker outside the
//! lock. The kernel host's `T` is an `Arc<Snapshot>`, so a clone is a
//! count: 500 teardowns sharing a walk of 15,000 processes hold one copy
//! of it, not 500 (about 2 MB each).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// The coalescer of one kind of walk producing `T`.
pub(crate) struct Walks<T> {
    state: Mutex<State<T>>,
    /// Signalled when a walk ends (its result published, or its walker
    /// unwound): a waiter then takes its result or starts its walk.
    ended: Condvar,
    /// Walks started since the process began (the tests' count).
    walks: AtomicU64,
}

struct State<T> {
    /// Walks started so far: the running one, if any, is number `started`.
    started: u64,
    /// Whether walk `started` is running.
    running: bool,
    /// Callers waiting for walk `started + 1`, which has not started.
    next_takers: usize,
    /// How many callers the running walk serves (its walker included).
    running_takers: usize,
    /// Ended walks whose takers have not all taken their result, by walk
    /// number (a few at most: one per walk a waiter has not woken for).
    results: BTreeMap<u64, Published<T>>,
}

struct Published<T> {
    /// The walk's result; `None`: the walk unwound, its takers ask again.
    value: Option<Arc<T>>,
    /// Takers still to come: the last moves `value` out.
    left: usize,
}

impl<T: Clone> Walks<T> {
    pub(crate) const fn new() -> Self {
        Self {
            state: Mutex::new(State {
                started: 0,
                running: false,
                next_takers: 0,
                running_takers: 0,
                results: BTreeMap::new(),
            }),
            ended: Condvar::new(),
            walks: AtomicU64::new(0),
        }
    }

    /// The result of a walk (`walk()`, run by whichever caller starts it)
    /// that started after this call began.
    pub(crate) fn get(&self, walk: impl FnOnce() -> T) -> T {
        let mut st = self.lock();
        loop {
            let mine = st.started + 1;
            if !st.running {
                // No walk runs: start walk `mine` now (with any callers
                // registered for it that have not woken yet).
                return self.walk(st, mine, false, walk);
            }
            // Walk `started` runs: it began before this call. Wait for the
            // next one.
            st.next_takers += 1;
            loop {
                if st.results.contains_key(&mine) {
                    match Self::take(&mut st, mine) {
                        Some(value) => {
                            drop(st);
                            return Arc::unwrap_or_clone(value);
                        }
                        // It unwound: ask again, as a new request (later
                        // than this one, so still fresh enough).
                        None => break,
                    }
                }
                if !st.running && st.started + 1 == mine {
                    return self.walk(st, mine, true, walk);
                }
                st = self.ended.wait(st).unwrap_or_else(|e| e.into_inner());
            }
        }
    }

    /// How many walks have started since the process began.
    pub(crate) fn walks(&self) -> u64 {
        self.walks.load(Ordering::Relaxed)
    }

    /// Starts walk `k` (`registered`: the caller is counted among its
    /// waiting takers), runs it unlocked, publishes it and takes its own.
    fn walk(
        &self,
        mut st: MutexGuard<'_, State<T>>,
        k: u64,
        registered: bool,
        walk: impl FnOnce() -> T,
    ) -> T {
        debug_assert!(!st.running && st.started + 1 == k);
        st.started = k;
        st.running = true;
        st.running_takers = st.next_takers + usize::from(!registered);
        st.next_takers = 0;
        // Fixed from here on: a caller arriving now waits for walk k + 1.
        let left = st.running_takers - 1;
        self.walks.fetch_add(1, Ordering::Relaxed);
        drop(st);
        let turn = Turn { walks: self, k };
        let value = walk();
        std::mem::forget(turn);
        // The walker takes the original; the others share one copy.
        let shared = (left > 0).then(|| Arc::new(value.clone()));
        let mut st = self.lock();
        st.running = false;
        if let Some(shared) = shared {
            st.results.insert(
                k,
                Published {
                    value: Some(shared),
                    left,
                },
            );
        }
        drop(st);
        self.ended.notify_all();
        value
    }

    /// One taker's share of walk `k`'s result (`None`: it unwound); the
    /// last takes it out of the table. Copied by the caller, unlocked.
    fn take(st: &mut State<T>, k: u64) -> Option<Arc<T>> {
        let p = st.results.get_mut(&k)?;
        p.left -= 1;
        if p.left > 0 {
            return p.value.clone();
        }
        st.results.remove(&k)?.value
    }

    /// Callers registered for the walk after the running one (the tests').
    #[cfg(test)]
    pub(crate) fn waiting(&self) -> usize {
        self.lock().next_takers
    }

    fn lock(&self) -> MutexGuard<'_, State<T>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A walker's turn, forgotten when its walk returns: dropped only when the
/// walk unwinds, it ends the turn with no result, so its waiting takers ask
/// again (one of them starting the next walk) instead of waiting for ever.
struct Turn<'a, T: Clone> {
    walks: &'a Walks<T>,
    k: u64,
}

impl<T: Clone> Drop for Turn<'_, T> {
    fn drop(&mut self) {
        let mut st = self.walks.lock();
        st.running = false;
        let left = st.running_takers - 1;
        if left > 0 {
            st.results.insert(self.k, Published { value: None, left });
        }
        drop(st);
        self.walks.ended.notify_all();
    }
}
