//! OOM kills recorded from a cgroup's `memory.events`: once each, counted
//! from what the ledger already holds, and by the teardown.
//! The cgroup is a real directory whose `memory.events` the test writes
//! (the kernel's format); the processes are the fake host's.

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use super::fake::{FakeHost, PID_BASE, member, record_spawned_tree, recorded_tree};
use super::watch::TreeWatch;
use super::{Engine, Origin, TeardownOptions};
use crate::ledger::{EventFilter, Ledger, TreeId, TreeState};

struct Setup {
    _dir: tempfile::TempDir,
    cgroup: std::path::PathBuf,
    ledger: Ledger,
    engine: Engine,
    tree: TreeId,
}

fn setup() -> Setup {
    let dir = tempfile::tempdir().expect("tempdir");
    let cgroup = dir.path().join("tw-oom-1");
    std::fs::create_dir(&cgroup).expect("cgroup dir");
    let host = Arc::new(FakeHost::new(false));
    let root = host
        .world()
        .spawn(member(PID_BASE, 1, PID_BASE, Some(&cgroup)));
    let (config, ledger, tree) = recorded_tree(
        dir.path(),
        root,
        Some(&cgroup),
        "eats-memory",
        0,
        Duration::from_millis(40),
    );
    let engine = Engine::signal_only(&config, ledger.clone(), None).with_host(host);
    Setup {
        _dir: dir,
        cgroup,
        ledger,
        engine,
        tree,
    }
}

/// `memory.events` as the kernel writes it.
fn write_events(cgroup: &Path, oom_kills: u64) {
    let text =
        format!("low 0\nhigh 0\nmax 12\noom {oom_kills}\noom_kill {oom_kills}\noom_group_kill 0\n");
    std::fs::write(cgroup.join("memory.events"), text).expect("memory.events");
}

fn oom_events(s: &Setup) -> Vec<(u64, u64)> {
    s.ledger
        .events(&EventFilter {
            tree: Some(s.tree),
            kind_prefix: Some("tree.oom_kill".into()),
            ..EventFilter::default()
        })
        .expect("events")
        .iter()
        .map(|e| {
            let n = |k: &str| e.data[k].as_u64().expect("a count");
            (n("oom_kills"), n("total"))
        })
        .collect()
}

fn watch(s: &Setup) -> TreeWatch {
    let row = s.ledger.tree(s.tree).expect("read").expect("row");
    TreeWatch::new_on(s.engine.host(), &row, &[], &HashSet::new()).expect("a watch")
}

#[test]
fn an_oom_kill_is_recorded_once_and_a_new_watch_does_not_record_it_again() {
    let s = setup();
    let mut w = watch(&s);
    // No memory controller (no file), then none yet: nothing recorded.
    w.note_oom_kills(&s.engine);
    write_events(&s.cgroup, 0);
    w.note_oom_kills(&s.engine);
    assert!(oom_events(&s).is_empty());
    write_events(&s.cgroup, 1);
    w.note_oom_kills(&s.engine);
    w.note_oom_kills(&s.engine);
    assert_eq!(oom_events(&s), [(1, 1)]);
    // A restarted service (a new watch) finds the total in the ledger.
    let mut again = watch(&s);
    again.note_oom_kills(&s.engine);
    assert_eq!(oom_events(&s), [(1, 1)]);
    write_events(&s.cgroup, 3);
    again.note_oom_kills(&s.engine);
    assert_eq!(oom_events(&s), [(1, 1), (2, 3)]);
    // A third watch, after other events of the tree: the total it starts
    // from is the newest `tree.oom_kill`'s, not the newest event's, nor the
    // oldest kill's.
    s.ledger
        .append_event(
            Some(s.tree),
            // An unrelated later event.
            crate::ledger::Event::SweepStarted(crate::ledger::event::SweepStarted {
                candidates: 0,
                pid: std::process::id(),
            }),
        )
        .expect("event");
    watch(&s).note_oom_kills(&s.engine);
    assert_eq!(oom_events(&s), [(1, 1), (2, 3)]);
}

#[test]
fn a_teardown_records_the_oom_kills_and_ends_the_tree_with_the_total_in_resources() {
    // (The teardown's ticks read `memory.events` at most every 250 ms and
    // its finish reads it once more, for a kill inside that window; this
    // fake host cannot write the file between two steps, so the test
    // holds the recording, not which of the two reads made it.)
    let s = setup();
    write_events(&s.cgroup, 2);
    let report = s
        .engine
        .teardown(
            s.tree,
            &TeardownOptions::new(Duration::ZERO, "test", Origin::Kill),
            &mut |_| {},
        )
        .expect("settled");
    assert_eq!(report.state, TreeState::Ended);
    assert_eq!(oom_events(&s), [(2, 2)]);
    let ended = s
        .ledger
        .events(&EventFilter {
            tree: Some(s.tree),
            kind_prefix: Some("tree.ended".into()),
            ..EventFilter::default()
        })
        .expect("events");
    assert_eq!(
        ended[0].data["resources"]["oom_kills"], 2,
        "{}",
        ended[0].data
    );
}

#[test]
fn each_tree_counts_from_its_own_recorded_total() {
    let s = setup();
    // A second tree of the same ledger, with a cgroup of its own.
    let other_cg = s.cgroup.with_file_name("tw-oom-2");
    std::fs::create_dir(&other_cg).expect("cgroup dir");
    let row = s.ledger.tree(s.tree).expect("read").expect("row");
    let other = record_spawned_tree(
        &s.ledger,
        row.owner.id,
        (PID_BASE + 50, 1),
        Some(&other_cg),
        "eats-memory",
        0,
    );
    write_events(&s.cgroup, 3);
    watch(&s).note_oom_kills(&s.engine);
    assert_eq!(oom_events(&s), [(3, 3)]);
    // The other tree's 2 kills are its own, not below the first tree's 3.
    write_events(&other_cg, 2);
    let other_row = s.ledger.tree(other).expect("read").expect("row");
    TreeWatch::new_on(s.engine.host(), &other_row, &[], &HashSet::new())
        .expect("a watch")
        .note_oom_kills(&s.engine);
    let theirs = Setup { tree: other, ..s };
    assert_eq!(oom_events(&theirs), [(2, 2)]);
}

/// The ledger's total is looked up only once the cgroup reports more kills
/// than this watch knows of (mutant: `note_oom_kills`' guard
/// `n > self.oom_recorded.unwrap_or(0)` -> `true`, which looks it up at
/// `oom_kill 0` and keeps that 0): a kill another watch of the tree (a
/// sweep, a second service) recorded after this watch's first read is not
/// recorded again.
#[test]
fn a_kill_another_watch_recorded_after_this_ones_first_read_is_not_recorded_twice() {
    let s = setup();
    let mut mine = watch(&s);
    write_events(&s.cgroup, 0);
    mine.note_oom_kills(&s.engine);
    // Another watch of the tree records the kill first.
    write_events(&s.cgroup, 1);
    watch(&s).note_oom_kills(&s.engine);
    assert_eq!(oom_events(&s), [(1, 1)]);
    mine.note_oom_kills(&s.engine);
    assert_eq!(oom_events(&s), [(1, 1)], "recorded once");
}
