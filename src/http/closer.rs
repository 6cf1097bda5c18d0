//! Closing what a peer handed over, off the runtime.
//!
//! The last close of a descriptor runs the file's release, and a peer
//! chooses what that release does: a TCP socket with `SO_LINGER` set and
//! a full send queue blocks `close()` for as long as its linger (120 s, or
//! years); a Unix-socket connection whose receive queue still holds
//! `SCM_RIGHTS` messages releases those files when it is closed, in the
//! closing thread. Done on one of the runtime's two async workers, two such
//! closes park both and freeze every connection and every timer of the
//! service (a tree due at its timeout was torn down 31 s late).
//!
//! So every descriptor a peer sent, and every Unix-socket connection
//! itself, is dropped here: on short-lived threads of their own, at most
//! [`THREADS_PER_UID`] at once for one peer uid, each draining that uid's
//! queue. A peer's blocking closes park only its own threads; another
//! user's closes never wait behind them, and nothing of custody does.
//! A closing thread holds no descriptor slot (the kernel frees the number
//! before the release blocks); what waits in a uid's queue does, so a uid
//! whose pending closes reach [`MAX_PENDING_PER_UID`] is *piled up*: the
//! serving loop then refuses its descriptors and answers its connections
//! 503 until its closes drain (counted: [`Closer::cut_off`]).
//!
//! This module never reads or writes a peer's bytes; it only drops.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Closing threads one peer uid may keep busy at once.
pub const THREADS_PER_UID: usize = 2;

/// Closes one peer uid may have waiting or under way before it is cut
/// off (its descriptors refused, its connections answered 503).
pub const MAX_PENDING_PER_UID: usize = 16;

/// Something of a peer's whose drop may block (a descriptor, a socket, a
/// spawn's stdio handles).
type Item = Box<dyn Send>;

/// The closing threads, shared by a listener's connections.
#[derive(Clone, Default)]
pub struct Closer {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    uids: Mutex<HashMap<u32, Queue>>,
}

#[derive(Default)]
struct Queue {
    waiting: VecDeque<Item>,
    /// Threads draining this queue now (each dropping one item at a time).
    running: usize,
}

impl Queue {
    fn pending(&self) -> usize {
        self.waiting.len() + self.running
    }
}

/// Connections cut off since start, across every listener: their uid's
/// closes piled up (`treewarden_http_peers_cut_off_total`).
static CUT_OFF: AtomicU64 = AtomicU64::new(0);

/// Connections cut off since start (every listener's [`Closer`]).
pub fn cut_off_total() -> u64 {
    CUT_OFF.load(Ordering::Relaxed)
}

impl Closer {
    fn uids(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Queue>> {
        self.inner.uids.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Drops `item` on a closing thread of `uid`'s, never on the caller's.
    pub fn drop_later<T: Send + 'static>(&self, uid: u32, item: T) {
        let start = {
            let mut uids = self.uids();
            let q = uids.entry(uid).or_default();
            q.waiting.push_back(Box::new(item));
            if q.running < THREADS_PER_UID {
                q.running += 1;
                true
            } else {
                false
            }
        };
        if start {
            let me = self.clone();
            let spawned = std::thread::Builder::new()
                .name("tw-close".into())
                .stack_size(64 * 1024)
                .spawn(move || me.drain(uid));
            if let Err(e) = spawned {
                // Out of threads: the item stays queued for the next
                // thread this uid gets (and the uid piles up meanwhile).
                tracing::warn!(uid, error = %e, "no thread to close a peer's descriptors");
                let mut uids = self.uids();
                if let Some(q) = uids.get_mut(&uid) {
                    q.running = q.running.saturating_sub(1);
                }
            }
        }
    }

    /// One closing thread: drops `uid`'s items one by one until none wait.
    fn drain(&self, uid: u32) {
        loop {
            let item = {
                let mut uids = self.uids();
                let Some(q) = uids.get_mut(&uid) else { return };
                match q.waiting.pop_front() {
                    Some(item) => item,
                    None => {
                        q.running = q.running.saturating_sub(1);
                        if q.pending() == 0 {
                            uids.remove(&uid);
                        }
                        return;
                    }
                }
            };
            drop(item);
        }
    }

    /// Whether `uid`'s closes have piled up to [`MAX_PENDING_PER_UID`]:
    /// its descriptors are refused and its connections answered 503 until
    /// they drain.
    pub fn piled_up(&self, uid: u32) -> bool {
        self.uids()
            .get(&uid)
            .is_some_and(|q| q.pending() >= MAX_PENDING_PER_UID)
    }

    /// Counts one connection cut off because its uid piled up.
    pub fn cut_off(uid: u32) {
        CUT_OFF.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            uid,
            cap = MAX_PENDING_PER_UID,
            "connection cut off: this uid's descriptor closes are piling up (closes that block)"
        );
    }

    /// Closes waiting or under way for `uid` (tests).
    #[cfg(test)]
    fn pending(&self, uid: u32) -> usize {
        self.uids().get(&uid).map_or(0, Queue::pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    /// An item whose drop blocks until released, as a lingering close does.
    struct Blocks(mpsc::Receiver<()>);
    impl Drop for Blocks {
        fn drop(&mut self) {
            let _ = self.0.recv_timeout(Duration::from_secs(30));
        }
    }

    #[test]
    fn one_uids_blocking_closes_never_hold_another_uids() {
        let c = Closer::default();
        let mut release = Vec::new();
        for _ in 0..MAX_PENDING_PER_UID {
            let (tx, rx) = mpsc::channel();
            release.push(tx);
            c.drop_later(1000, Blocks(rx));
        }
        assert!(c.piled_up(1000));
        assert!(!c.piled_up(1001));
        // Another uid's close runs at once, on its own thread.
        let (done_tx, done_rx) = mpsc::channel::<()>();
        struct Tell(mpsc::Sender<()>);
        impl Drop for Tell {
            fn drop(&mut self) {
                let _ = self.0.send(());
            }
        }
        c.drop_later(1001, Tell(done_tx));
        assert!(done_rx.recv_timeout(Duration::from_secs(5)).is_ok());
        for tx in release {
            let _ = tx.send(());
        }
        let t0 = std::time::Instant::now();
        while c.pending(1000) > 0 && t0.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(c.pending(1000), 0);
        assert!(!c.piled_up(1000));
    }
}
