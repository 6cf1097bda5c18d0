//! Unit tests of the orphan sweep through the kernel seam: a real ledger in
//! a temporary directory, trees whose processes are a [`FakeHost`]'s, owners
//! alive or gone on that host. What each test asserts is what the ledger
//! and the fake's record of signals hold, not the sweep's report alone.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use super::fake::{BOOT, FakeHost, PID_BASE, member, record_spawned_tree, stranger};
use super::{Engine, SweepCounts, SweepOptions, SweepProgress};
use crate::ledger::{
    EventFilter, IdentityRecord, Ledger, LedgerOptions, OwnerId, OwnerKind, OwnerRecord, TreeId,
    TreeState,
};
use crate::proc::Sig;

const BUSY: Duration = Duration::from_millis(40);

/// A ledger and a fake host holding any number of trees, each of its own
/// owner (pid `PID_BASE - 1 - k`, start tick 1), none of them alive until a
/// test brings one to life.
struct Sweep {
    _dir: tempfile::TempDir,
    ledger: Ledger,
    engine: Engine,
    host: Arc<FakeHost>,
    trees: Vec<TreeId>,
}

fn sweep_rig() -> Sweep {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = crate::config::Config {
        data_dir: dir.path().to_path_buf(),
        boundary: crate::config::BoundaryChoice::Session,
        cgroup_root: None,
        busy_timeout: BUSY,
        ledger_reserve: 0,
        observer: crate::config::ObserverMode::Off,
        observer_rcvbuf: 0,
    };
    let ledger = Ledger::open(
        &config.ledger_path(),
        LedgerOptions {
            busy_timeout: BUSY,
            reserve: 0,
        },
    )
    .expect("ledger opens");
    let host = Arc::new(FakeHost::new(false));
    let engine = Engine::signal_only(&config, ledger.clone(), None).with_host(host.clone());
    Sweep {
        _dir: dir,
        ledger,
        engine,
        host,
        trees: Vec::new(),
    }
}

impl Sweep {
    fn owner_pid(k: usize) -> i32 {
        PID_BASE - 1 - k as i32
    }

    /// A running tree of one root (pid `PID_BASE + 100 k`) with `grace_ms`
    /// recorded; returns it.
    fn tree(&mut self, grace_ms: u64) -> TreeId {
        let k = self.trees.len();
        let owner = self.owner(k);
        let pid = PID_BASE + 100 * k as i32;
        let root = self.host.world().spawn(member(pid, 1, pid, None));
        let tree = record_spawned_tree(&self.ledger, owner, root, None, "worker", grace_ms);
        self.trees.push(tree);
        tree
    }

    fn owner(&self, k: usize) -> OwnerId {
        self.ledger
            .register_owner(&OwnerRecord {
                identity: IdentityRecord {
                    pid: Self::owner_pid(k),
                    start_ticks: 1,
                    boot_id: BOOT.into(),
                },
                kind: OwnerKind::Run,
            })
            .expect("owner")
    }

    /// Tree `k`'s owner lives on the fake host.
    fn owner_lives(&self, k: usize) {
        let mut w = self.host.world();
        w.spawn(stranger(Self::owner_pid(k)));
        w.procs
            .get_mut(&Self::owner_pid(k))
            .expect("just spawned")
            .start_ticks = 1;
    }

    fn state(&self, tree: TreeId) -> TreeState {
        self.ledger
            .tree(tree)
            .expect("readable")
            .expect("recorded")
            .state
    }

    /// The data of the events of `kind` (of every tree when `tree` is None).
    fn events(&self, tree: Option<TreeId>, kind: &str) -> Vec<serde_json::Value> {
        self.ledger
            .events(&EventFilter {
                tree,
                kind_prefix: Some(kind.into()),
                ..EventFilter::default()
            })
            .expect("events")
            .into_iter()
            .filter(|e| e.kind.to_string() == kind)
            .map(|e| e.data)
            .collect()
    }

    /// Every event of the tree, as text: where a teardown's reason shows.
    fn story(&self, tree: TreeId) -> String {
        self.ledger
            .events(&EventFilter {
                tree: Some(tree),
                ..EventFilter::default()
            })
            .expect("events")
            .into_iter()
            .map(|e| format!("{} {}\n", e.kind, e.data))
            .collect()
    }

    /// The first signals the fake host was asked to send to tree `k`'s group.
    fn signalled(&self, k: usize) -> Vec<Sig> {
        let pgid = PID_BASE + 100 * k as i32;
        self.host
            .sent()
            .into_iter()
            .filter(|s| s.target == super::fake::Target::Group(pgid))
            .map(|s| s.sig)
            .collect()
    }
}

#[test]
fn an_orphan_is_torn_down_with_its_recorded_grace_and_an_owned_tree_is_left() {
    let mut s = sweep_rig();
    let orphan = s.tree(1_500);
    let owned = s.tree(700);
    s.owner_lives(1);
    let report = s
        .engine
        .sweeper()
        .sweep(Duration::from_secs(9))
        .expect("sweep");
    assert_eq!(report.examined, 2);
    assert_eq!(report.owned, 1);
    assert_eq!(report.orphans.len(), 1, "{:?}", report.orphans);
    let o = &report.orphans[0];
    assert_eq!(
        (o.tree.0, o.from, o.to, o.grace_ms, o.error.as_deref()),
        (
            orphan.0,
            TreeState::Running,
            Some(TreeState::Ended),
            1_500,
            None
        )
    );
    assert!(report.settled());
    assert_eq!(s.state(orphan), TreeState::Ended);
    assert_eq!(s.state(owned), TreeState::Running);
    assert_eq!(s.signalled(0), [Sig::Term]);
    assert_eq!(s.signalled(1), []);
    assert!(s.host.world().procs.contains_key(&(PID_BASE + 100)));
    assert!(!s.host.world().procs.contains_key(&PID_BASE));
    // The ledger says why: the sweep, the gone owner, the grace.
    assert_eq!(
        s.events(None, "sweep.started"),
        [serde_json::json!({"candidates": 2, "pid": std::process::id()})]
    );
    assert_eq!(
        s.events(Some(orphan), "sweep.orphan_found"),
        [serde_json::json!({
            "owner": {"pid": Sweep::owner_pid(0), "start": 1},
            "state": "running",
            "grace_ms": 1_500
        })]
    );
    assert!(
        s.story(orphan).contains("owner gone (orphan sweep)"),
        "{}",
        s.story(orphan)
    );
    assert!(s.events(Some(owned), "sweep.orphan_found").is_empty());
}

#[test]
fn skipped_trees_count_as_owned_and_a_sweep_without_orphans_records_only_when_asked() {
    let mut s = sweep_rig();
    let tree = s.tree(0);
    let mut opts = SweepOptions::new(Duration::ZERO);
    opts.skip.insert(tree);
    let report = s.engine.sweeper().sweep_with(&opts).expect("sweep");
    assert_eq!((report.examined, report.owned), (1, 1));
    assert!(report.orphans.is_empty());
    assert_eq!(s.state(tree), TreeState::Running);
    assert_eq!(
        s.events(None, "sweep.started").len(),
        1,
        "recorded when none"
    );
    // The opportunistic sweep writes nothing when it finds nothing.
    let mut quiet = SweepOptions::opportunistic(Duration::ZERO, 4);
    quiet.skip.insert(tree);
    let report = s.engine.sweeper().sweep_with(&quiet).expect("sweep");
    assert_eq!((report.examined, report.owned), (1, 1));
    assert_eq!(s.events(None, "sweep.started").len(), 1, "nothing written");
    assert!(
        s.engine
            .sweeper()
            .settle_orphans(4, Duration::ZERO)
            .is_some()
    );
    assert_eq!(s.state(tree), TreeState::Ended, "not skipped: settled");
    assert_eq!(s.events(None, "sweep.started").len(), 2);
    // Nothing left: the settles say so, and write nothing.
    assert!(
        s.engine
            .sweeper()
            .settle_orphans(4, Duration::ZERO)
            .is_none()
    );
    assert!(s.engine.sweeper().settle_failed_closed(4).is_none());
    assert_eq!(s.events(None, "sweep.started").len(), 2);
}

#[test]
fn the_opportunistic_sweep_takes_at_most_its_limit_the_rest_wait() {
    let opts = SweepOptions::opportunistic(Duration::from_secs(3), 2);
    assert_eq!(
        (
            opts.limit,
            opts.concurrency,
            opts.record_when_none,
            opts.default_grace
        ),
        (Some(2), 2, false, Duration::from_secs(3))
    );
    assert_eq!(
        SweepOptions::opportunistic(Duration::ZERO, 0).concurrency,
        1
    );
    let mut s = sweep_rig();
    for _ in 0..3 {
        s.tree(0);
    }
    let report = s.engine.sweeper().sweep_with(&opts).expect("sweep");
    assert_eq!(report.examined, 3);
    assert_eq!(report.owned, 0, "the one left over is neither");
    let swept: Vec<i64> = report.orphans.iter().map(|o| o.tree.0).collect();
    assert_eq!(swept, [s.trees[0].0, s.trees[1].0]);
    assert_eq!(s.state(s.trees[2]), TreeState::Running);
    let report = s.engine.sweeper().sweep_with(&opts).expect("sweep");
    assert_eq!(report.examined, 1);
    assert_eq!(report.orphans.len(), 1);
    assert_eq!(s.state(s.trees[2]), TreeState::Ended);
}

#[test]
fn an_orphan_without_a_recorded_grace_gets_the_default_and_its_first_signal() {
    let mut s = sweep_rig();
    let owner = s.owner(0);
    let pid = PID_BASE;
    let root = s.host.world().spawn(member(pid, 1, pid, None));
    let tree = s
        .ledger
        .create_tree(&crate::ledger::NewTree {
            label: None,
            boundary: crate::proc::BoundaryKind::Session,
            owner,
            argv: vec!["worker".into()],
            cwd: None,
            grace_ms: None,
            timeout_ms: None,
            limits: Default::default(),
            first_signal: Some("SIGINT".into()),
        })
        .expect("tree");
    s.ledger
        .tree_spawned(
            tree,
            &crate::ledger::SpawnRecord {
                root: IdentityRecord {
                    pid: root.0,
                    start_ticks: root.1,
                    boot_id: BOOT.into(),
                },
                pgid: pid,
                sid: pid,
                cgroup: None,
            },
        )
        .expect("spawned");
    s.trees.push(tree);
    let report = s
        .engine
        .sweeper()
        .sweep(Duration::from_millis(2_250))
        .expect("sweep");
    assert_eq!(report.orphans.len(), 1);
    assert_eq!(report.orphans[0].grace_ms, 2_250);
    assert_eq!(s.signalled(0), [Sig::Int]);
    assert_eq!(s.state(tree), TreeState::Ended);
}

#[test]
fn a_failed_closed_orphan_is_finished_without_a_second_grace_and_first() {
    let mut s = sweep_rig();
    let ambiguous = s.tree(4_000);
    let marked = s.tree(4_000);
    let plain = s.tree(4_000);
    s.ledger
        .set_state(ambiguous, TreeState::Ambiguous, Some("survivors left"))
        .expect("ambiguous");
    // The ledger refused the ambiguity: only a marker says it.
    s.engine
        .ambiguity()
        .mark_ambiguous(marked, "ledger refused", &[], &[]);
    let row = |t: TreeId| s.ledger.tree(t).expect("readable").expect("recorded");
    assert!(s.engine.sweeper().failed_closed(&row(ambiguous)));
    assert!(s.engine.sweeper().failed_closed(&row(marked)));
    assert!(!s.engine.sweeper().failed_closed(&row(plain)));

    let report = s
        .engine
        .sweeper()
        .settle_failed_closed(8)
        .expect("some settled");
    let swept: Vec<(i64, u64)> = report
        .orphans
        .iter()
        .map(|o| (o.tree.0, o.grace_ms))
        .collect();
    assert_eq!(swept, [(ambiguous.0, 0), (marked.0, 0)]);
    // Only the trees that can have failed closed are examined (not every
    // live tree: the service asks every 2 s); the plain orphan waits for
    // a sweep.
    assert_eq!((report.examined, report.owned), (2, 0));
    assert_eq!(s.state(plain), TreeState::Running);
    assert!(
        s.story(ambiguous)
            .contains("owner gone: finishing a teardown that could not be authorized"),
        "{}",
        s.story(ambiguous)
    );
    // The plain orphan's sweep gives it its recorded grace.
    let report = s
        .engine
        .sweeper()
        .settle_orphans(8, Duration::ZERO)
        .expect("some settled");
    let swept: Vec<(i64, u64)> = report
        .orphans
        .iter()
        .map(|o| (o.tree.0, o.grace_ms))
        .collect();
    assert_eq!(swept, [(plain.0, 4_000)]);
}

#[test]
fn the_failed_closed_check_reads_a_force_resolved_tree_marked_again_and_no_ended_one() {
    let mut s = sweep_rig();
    let ambiguous = s.tree(4_000);
    let resolved = s.tree(4_000);
    let ended = s.tree(4_000);
    // Ambiguous in the ledger and named by a marker: examined once.
    s.ledger
        .set_state(ambiguous, TreeState::Ambiguous, Some("survivors left"))
        .expect("ambiguous");
    s.engine
        .ambiguity()
        .mark_ambiguous(ambiguous, "ledger refused", &[], &[]);
    // Force-resolved with its root alive (`survivors_left`), then failed
    // closed again: its marker names a terminal tree that still has work.
    s.ledger
        .set_state(resolved, TreeState::Ambiguous, Some("ledger refused"))
        .expect("ambiguous");
    let root = PID_BASE + 100;
    let start = s.host.world().procs[&root].start_ticks;
    let survivor = IdentityRecord {
        pid: root,
        start_ticks: start,
        boot_id: BOOT.into(),
    };
    s.engine
        .ambiguity()
        .mark_ambiguous(resolved, "ledger refused", &[survivor], &[]);
    s.engine
        .ambiguity()
        .resolve(resolved, "operator looked", true)
        .expect("forced resolution");
    let row = s
        .ledger
        .tree(resolved)
        .expect("readable")
        .expect("recorded");
    assert!(row.has_survivors_left(), "{:?}", row.flags);
    s.engine
        .ambiguity()
        .mark_ambiguous(resolved, "ledger refused again", &[], &[]);
    // A stale marker of an ended tree: nothing left to settle.
    s.ledger
        .set_state(ended, TreeState::Ended, None)
        .expect("ended");
    s.engine
        .ambiguity()
        .mark_ambiguous(ended, "stale", &[], &[]);

    let report = s
        .engine
        .sweeper()
        .settle_failed_closed(8)
        .expect("some settled");
    assert_eq!((report.examined, report.owned), (2, 0));
    let swept: Vec<i64> = report.orphans.iter().map(|o| o.tree.0).collect();
    assert_eq!(swept, [ambiguous.0, resolved.0]);
    let row = s
        .ledger
        .tree(resolved)
        .expect("readable")
        .expect("recorded");
    assert_eq!(row.state, TreeState::Resolved, "terminal states are final");
    assert!(
        row.flags.iter().any(|f| f == "survivors_ended"),
        "the survivor is ended: {:?}",
        row.flags
    );
    assert_eq!(s.state(ended), TreeState::Ended);
    assert!(s.signalled(2).is_empty(), "{:?}", s.signalled(2));
}

#[test]
fn a_stopped_sweep_starts_no_teardown_and_its_progress_counts_every_orphan() {
    let mut s = sweep_rig();
    let a = s.tree(0);
    let b = s.tree(0);
    let progress = Arc::new(SweepProgress::default());
    let mut opts = SweepOptions::new(Duration::ZERO);
    opts.progress = Some(progress.clone());
    opts.stop = Some(Arc::new(AtomicBool::new(true)));
    let report = s.engine.sweeper().sweep_with(&opts).expect("sweep");
    assert_eq!(report.orphans.len(), 2);
    for o in &report.orphans {
        assert_eq!(o.to, None);
        assert_eq!(
            o.error.as_deref(),
            Some("not started: the sweep was stopped (the next sweep takes it)")
        );
    }
    assert!(!report.settled());
    assert_eq!(s.state(a), TreeState::Running);
    assert_eq!(s.state(b), TreeState::Running);
    assert!(s.host.sent().is_empty());
    assert_eq!(
        progress.counts(),
        SweepCounts {
            found: 2,
            in_flight: 0,
            settled: 0,
            unsettled: 0,
            not_started: 2,
        }
    );
    assert_eq!(progress.counts().pending(), 0);
    // The next sweep, not stopped, settles them; the counters add up.
    opts.stop = None;
    let report = s.engine.sweeper().sweep_with(&opts).expect("sweep");
    assert!(report.settled());
    assert_eq!(
        progress.counts(),
        SweepCounts {
            found: 4,
            in_flight: 0,
            settled: 2,
            unsettled: 0,
            not_started: 2,
        }
    );
    assert_eq!(s.state(a), TreeState::Ended);
}

#[test]
fn pending_is_found_less_every_finished_orphan() {
    let counts = SweepCounts {
        found: 10,
        in_flight: 3,
        settled: 4,
        unsettled: 2,
        not_started: 1,
    };
    assert_eq!(counts.pending(), 3);
    let over = SweepCounts {
        found: 1,
        settled: 2,
        ..SweepCounts::default()
    };
    assert_eq!(over.pending(), 0);
}

#[test]
fn an_orphan_its_teardown_cannot_settle_counts_as_unsettled() {
    let mut s = sweep_rig();
    let tree = s.tree(0);
    // The root survives SIGKILL (a task stuck in the kernel).
    {
        let mut w = s.host.world();
        let root = w.procs.get_mut(&PID_BASE).expect("root");
        root.ignores_term = true;
        root.unkillable = true;
    }
    let progress = Arc::new(SweepProgress::default());
    let mut opts = SweepOptions::new(Duration::ZERO);
    opts.progress = Some(progress.clone());
    let report = s.engine.sweeper().sweep_with(&opts).expect("sweep");
    assert_eq!(report.orphans.len(), 1);
    let o = &report.orphans[0];
    assert_ne!(o.to, Some(TreeState::Ended), "{o:?}");
    assert_ne!(s.state(tree), TreeState::Ended);
    let c = progress.counts();
    assert_eq!(
        (c.found, c.settled, c.unsettled, c.in_flight),
        (1, 0, 1, 0),
        "{o:?}"
    );
    assert_eq!(c.pending(), 0);
}

/// The operator's one line per sweep that tears orphans down, with how
/// many and how many at once; none when there is nothing to tear down.
#[test]
fn a_sweep_logs_its_orphans_and_concurrency_only_when_it_has_some() {
    const LINE: &str = "sweep: tearing orphans down";
    let mut s = sweep_rig();
    let log = super::tests::warnings_of(|| {
        s.engine.sweeper().sweep(Duration::ZERO).expect("sweep");
    });
    assert!(!log.contains(LINE), "no orphan, no line: {log}");
    s.tree(0);
    s.tree(0);
    let mut opts = SweepOptions::new(Duration::ZERO);
    opts.concurrency = 1;
    let log = super::tests::warnings_of(|| {
        s.engine.sweeper().sweep_with(&opts).expect("sweep");
    });
    let lines: Vec<&str> = log.lines().filter(|l| l.contains(LINE)).collect();
    assert_eq!(lines.len(), 1, "{log}");
    assert!(
        lines[0].contains("orphans=2") && lines[0].contains("concurrency=1"),
        "{log}"
    );
}
