//! Unit tests of the dispatch gate through the kernel seam: a real ledger,
//! owners and survivors that are the fake host's processes (their liveness
//! asked of [`super::Host`]), the tree rig of `watch_tests`.

use super::CustodyError;
use super::fake::{BOOT, PID_BASE, stranger};
use super::watch_tests::{Rig, rig};
use crate::ledger::{IdentityRecord, TreeState};
use crate::proc::ExitStatus;

/// The gate's unsettled trees, as `(tree, reason)`.
fn unsettled(rig: &Rig) -> Vec<(i64, String)> {
    rig.engine
        .unsettled()
        .expect("readable")
        .into_iter()
        .map(|u| (u.tree, u.reason))
        .collect()
}

/// Brings the tree's owner (recorded as pid `PID_BASE - 1`, start tick 1)
/// to life on the fake host.
fn owner_lives(rig: &Rig) {
    let mut w = rig.host.world();
    w.spawn(stranger(PID_BASE - 1));
    w.procs
        .get_mut(&(PID_BASE - 1))
        .expect("just spawned")
        .start_ticks = 1;
}

#[test]
fn an_interrupted_teardown_closes_dispatch_only_once_its_owner_is_gone() {
    for state in [TreeState::Terminating, TreeState::Killing] {
        let rig = rig(false, false);
        owner_lives(&rig);
        if state == TreeState::Killing {
            rig.ledger
                .set_state(rig.tree, TreeState::Terminating, Some("test"))
                .expect("terminating");
        }
        rig.ledger
            .set_state(rig.tree, state, Some("test"))
            .expect("state");
        assert_eq!(unsettled(&rig), [], "{state:?}: its owner runs it");
        rig.engine.check_dispatch().expect("dispatch open");
        rig.host
            .world()
            .exit(PID_BASE - 1, ExitStatus::Signaled(libc::SIGKILL));
        let why = format!(
            "teardown interrupted in state {} and its owner is gone",
            state.as_str()
        );
        assert_eq!(unsettled(&rig), [(rig.tree.0, why)]);
        match rig.engine.check_dispatch() {
            Err(CustodyError::DispatchRefused { tree, .. }) => assert_eq!(tree, rig.tree.0),
            other => panic!("refused naming the tree: {other:?}"),
        }
    }
}

#[test]
fn an_ambiguous_tree_closes_dispatch_from_the_ledger_alone_and_is_listed_once() {
    let rig = rig(false, false);
    rig.ledger
        .set_state(rig.tree, TreeState::Ambiguous, Some("survivors left"))
        .expect("ambiguous");
    // No marker, nothing in this engine's memory: the ledger says it.
    let from_ledger = unsettled(&rig);
    assert_eq!(
        from_ledger.iter().map(|u| u.0).collect::<Vec<_>>(),
        [rig.tree.0],
        "{from_ledger:?}"
    );
    // Held in memory and by a marker as well: still one tree.
    rig.engine
        .mark_ambiguous(rig.tree.0, "marked by the teardown", &[], &[]);
    assert_eq!(
        unsettled(&rig),
        [(rig.tree.0, "marked by the teardown".to_string())]
    );
}

#[test]
fn a_marker_of_an_ended_tree_closes_dispatch_while_a_survivor_it_names_lives() {
    let rig = rig(false, false);
    rig.host.world().exit(rig.root.0, ExitStatus::Exited(0));
    let report = rig
        .engine
        .teardown(
            rig.tree,
            &super::TeardownOptions::new(std::time::Duration::ZERO, "test", super::Origin::Kill),
            &mut |_| {},
        )
        .expect("settled");
    assert_eq!(report.state, TreeState::Ended);
    let survivor = rig.host.world().spawn(stranger(0));
    rig.engine.mark_ambiguous(
        rig.tree.0,
        "raced",
        &[IdentityRecord {
            pid: survivor.0,
            start_ticks: survivor.1,
            boot_id: BOOT.into(),
        }],
        &[],
    );
    assert_eq!(
        unsettled(&rig),
        [(
            rig.tree.0,
            "raced (1 survivors named by its marker still live)".to_string()
        )]
    );
    rig.host.world().exit(survivor.0, ExitStatus::Exited(0));
    assert_eq!(unsettled(&rig), [], "stale once the survivor is gone");
    assert!(
        super::markers::read(rig.engine.data_dir(), rig.tree.0).is_none(),
        "the stale marker is removed"
    );
    rig.engine.check_dispatch().expect("dispatch open");
}
