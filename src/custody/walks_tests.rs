//! The walk coalescer ([`super::walks`]): callers asking at once share a
//! walk, and no caller is given a walk that started before it asked. The
//! first tests gate a counting walk by hand (deterministic); the last ones
//! walk the real `/proc` with real processes, through [`KernelHost`].

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, mpsc};
use std::time::{Duration, Instant};

use super::walks::Walks;
use super::{Host, KernelHost};

/// Polls `cond` every millisecond until it holds or `limit` passed.
fn until(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    cond()
}

/// A result that counts its copies.
#[derive(Debug)]
struct Counted {
    walk: u64,
    copies: Arc<AtomicUsize>,
}

impl Clone for Counted {
    fn clone(&self) -> Self {
        self.copies.fetch_add(1, Ordering::SeqCst);
        Self {
            walk: self.walk,
            copies: self.copies.clone(),
        }
    }
}

/// A walk numbered by a shared counter, so each caller can tell which walk
/// it was given.
fn numbered(serial: &AtomicU64, copies: &Arc<AtomicUsize>) -> Counted {
    Counted {
        walk: serial.fetch_add(1, Ordering::SeqCst) + 1,
        copies: copies.clone(),
    }
}

#[test]
fn a_lone_caller_walks_once_and_copies_nothing() {
    let walks = Walks::new();
    let serial = AtomicU64::new(0);
    let copies = Arc::new(AtomicUsize::new(0));
    for i in 1..=3 {
        let got = walks.get(|| numbered(&serial, &copies));
        assert_eq!(got.walk, i, "each call after the last one ended walks anew");
    }
    assert_eq!(walks.walks(), 3);
    assert_eq!(
        copies.load(Ordering::SeqCst),
        0,
        "a lone caller's walk is moved, not copied"
    );
}

/// The callers that arrive while walk 1 runs all get walk 2: one walk for
/// all of them, and none gets walk 1, which began before they asked.
#[test]
fn callers_during_a_walk_share_the_next_one_and_never_the_running_one() {
    const WAITERS: usize = 8;
    let walks = Arc::new(Walks::new());
    let serial = Arc::new(AtomicU64::new(0));
    let copies = Arc::new(AtomicUsize::new(0));
    let (release, gate) = mpsc::channel::<()>();
    let first = {
        let (walks, serial, copies) = (walks.clone(), serial.clone(), copies.clone());
        std::thread::spawn(move || {
            walks.get(|| {
                let w = numbered(&serial, &copies);
                gate.recv().expect("the test releases walk 1");
                w
            })
        })
    };
    assert!(
        until(Duration::from_secs(10), || walks.walks() == 1),
        "walk 1 started"
    );
    let waiters: Vec<_> = (0..WAITERS)
        .map(|_| {
            let (walks, serial, copies) = (walks.clone(), serial.clone(), copies.clone());
            std::thread::spawn(move || walks.get(|| numbered(&serial, &copies)).walk)
        })
        .collect();
    assert!(
        until(Duration::from_secs(10), || walks.waiting() == WAITERS),
        "every waiter registered for the next walk (waiting: {})",
        walks.waiting()
    );
    release.send(()).expect("walk 1 waits for it");
    assert_eq!(first.join().expect("walk 1's caller").walk, 1);
    for w in waiters {
        assert_eq!(w.join().expect("a waiter"), 2, "a waiter got walk 2");
    }
    assert_eq!(walks.walks(), 2, "one walk served every waiter");
    assert!(
        copies.load(Ordering::SeqCst) < WAITERS,
        "a shared walk is copied at most once per taker but its walker"
    );
}

/// A walk that panics does not strand its waiters: one of them walks.
#[test]
fn the_waiters_of_a_walk_that_panicked_get_the_next_walk() {
    let walks = Arc::new(Walks::new());
    let serial = Arc::new(AtomicU64::new(0));
    let copies = Arc::new(AtomicUsize::new(0));
    let (release, gate) = mpsc::channel::<()>();
    let first = {
        let (walks, serial) = (walks.clone(), serial.clone());
        std::thread::spawn(move || {
            walks.get(|| -> Counted {
                serial.fetch_add(1, Ordering::SeqCst);
                gate.recv().expect("the test releases walk 1");
                panic!("walk 1 fails");
            })
        })
    };
    assert!(
        until(Duration::from_secs(10), || walks.walks() == 1),
        "walk 1 started"
    );
    // Registered for walk 2 (walk 1 runs), then walk 1 panics: still served.
    let waiter = {
        let (walks, serial, copies) = (walks.clone(), serial.clone(), copies.clone());
        std::thread::spawn(move || walks.get(|| numbered(&serial, &copies)).walk)
    };
    assert!(
        until(Duration::from_secs(10), || walks.waiting() == 1),
        "the waiter registered"
    );
    release.send(()).expect("walk 1 waits for it");
    assert!(first.join().is_err(), "walk 1's own caller sees its panic");
    assert_eq!(
        waiter.join().expect("the waiter"),
        2,
        "the waiter walked anew"
    );
    assert_eq!(walks.walks(), 2);
}

/// Many threads asking while a real `/proc` walk runs: the first walk
/// (real, then held until every other caller has asked: on a fast host a
/// 70-process walk ended before the next thread woke, and each caller made
/// its own) serves its own caller; one more walk, begun after they all
/// asked, serves the other fifteen. Each caller's snapshot holds a process
/// started before it asked.
#[test]
fn real_walks_asked_at_once_are_shared() {
    const CALLERS: usize = 16;
    let child = Sleeper::start();
    let walks = Arc::new(Walks::new());
    let start = Arc::new(Barrier::new(CALLERS));
    let first = Arc::new(AtomicBool::new(true));
    let all_asked = Arc::new(AtomicBool::new(false));
    let callers: Vec<_> = (0..CALLERS)
        .map(|_| {
            let (walks, start) = (walks.clone(), start.clone());
            let (first, all_asked) = (first.clone(), all_asked.clone());
            std::thread::spawn(move || {
                start.wait();
                let held = walks.clone();
                walks.get(move || {
                    let snap = crate::scan::snapshot();
                    if first.swap(false, Ordering::SeqCst) {
                        let asked =
                            until(Duration::from_secs(10), || held.waiting() == CALLERS - 1);
                        all_asked.store(asked, Ordering::SeqCst);
                    }
                    snap
                })
            })
        })
        .collect();
    for c in callers {
        let snap = c.join().expect("a caller");
        assert!(
            snap.entries.contains_key(&child.pid()),
            "the sleeper is in every snapshot"
        );
    }
    assert!(
        all_asked.load(Ordering::SeqCst),
        "every other caller asked while the first walk ran"
    );
    assert_eq!(
        walks.walks(),
        2,
        "{CALLERS} callers: the first walk and one begun after the rest asked"
    );
}

/// Through [`KernelHost::snapshot`], while other threads keep walks running
/// all the time: a process started just before the call is in its
/// snapshot, and one killed and reaped just before it is not (a walk begun
/// before the call would say otherwise).
#[test]
fn a_kernel_snapshot_is_as_fresh_as_a_walk_of_ones_own() {
    let stop = Arc::new(AtomicBool::new(false));
    let busy: Vec<_> = (0..3)
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    KernelHost::default().snapshot();
                }
            })
        })
        .collect();
    let before = KernelHost::walks();
    let host = KernelHost::default();
    for _ in 0..10 {
        let mut child = Sleeper::start();
        let pid = child.pid();
        let snap = host.snapshot();
        assert!(snap.is_complete(), "{:?}", snap.incomplete);
        assert!(
            snap.entries.contains_key(&pid),
            "a process started before the call is in it"
        );
        child.end();
        let snap = host.snapshot();
        assert!(
            !snap.entries.contains_key(&pid),
            "a process reaped before the call is not in it"
        );
    }
    stop.store(true, Ordering::Relaxed);
    for b in busy {
        b.join().expect("a busy walker");
    }
    assert!(
        KernelHost::walks() > before,
        "the kernel host's walks are counted"
    );
}

/// A `sleep` child, ended by its pid (and reaped) when done or dropped.
struct Sleeper(Option<Child>);

impl Sleeper {
    fn start() -> Self {
        let child = Command::new("sleep")
            .arg("60")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("sleep starts");
        Self(Some(child))
    }

    fn pid(&self) -> i32 {
        self.0.as_ref().map_or(0, |c| c.id() as i32)
    }

    /// Kills it by its pid and reaps it: gone from `/proc` on return.
    fn end(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Sleeper {
    fn drop(&mut self) {
        self.end();
    }
}
