//! Unit tests of the dispatch gate through the kernel seam: a real ledger,
//! owners and survivors that are the fake host's processes (their liveness
//! asked of [`super::Host`]), the tree rig of `watch_tests`.

use super::CustodyError;
use super::fake::{BOOT, PID_BASE, stranger};
use super::watch_tests::{Rig, rig};
use crate::ledger::{
    EventFilter, IdentityRecord, NewTree, OnBehalfRecord, OwnerKind, OwnerRecord, Requester,
    SpawnRecord, TreeId, TreeState,
};
use crate::proc::{ExitStatus, Identity};

/// The gate's unsettled trees, as `(tree, reason)`.
fn unsettled(rig: &Rig) -> Vec<(i64, String)> {
    rig.engine
        .gate()
        .unsettled()
        .expect("readable")
        .into_iter()
        .map(|u| (u.tree.0, u.reason))
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
        rig.engine.gate().check_dispatch().expect("dispatch open");
        rig.host
            .world()
            .exit(PID_BASE - 1, ExitStatus::Signaled(libc::SIGKILL));
        let why = format!(
            "teardown interrupted in state {} and its owner is gone",
            state.as_str()
        );
        assert_eq!(unsettled(&rig), [(rig.tree.0, why)]);
        match rig.engine.gate().check_dispatch() {
            Err(CustodyError::DispatchRefused { tree, .. }) => assert_eq!(tree, rig.tree),
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
        .ambiguity()
        .mark_ambiguous(rig.tree, "marked by the teardown", &[], &[]);
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
    rig.engine.ambiguity().mark_ambiguous(
        rig.tree,
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
        super::markers::read(rig.engine.data_dir(), rig.tree).is_none(),
        "the stale marker is removed"
    );
    rig.engine.gate().check_dispatch().expect("dispatch open");
}

#[test]
fn the_dispatch_scope_is_spelled_owner_or_host() {
    use super::DispatchScope;
    assert_eq!("owner".parse::<DispatchScope>(), Ok(DispatchScope::Owner));
    assert_eq!("host".parse::<DispatchScope>(), Ok(DispatchScope::Host));
    assert_eq!(
        "tree".parse::<DispatchScope>(),
        Err("unknown dispatch scope \"tree\": expected owner or host".to_string())
    );
}

/// The identity of the rig's owner record (pid `PID_BASE - 1`, tick 1).
fn rig_owner() -> Identity {
    Identity {
        pid: PID_BASE - 1,
        start_ticks: 1,
        boot_id: BOOT.into(),
    }
}

/// A second tree, of another owner, asked for by `requester`, left
/// ambiguous (the rig's own tree stays running).
fn ambiguous_tree_of(rig: &Rig, requester: Requester) -> TreeId {
    ambiguous_tree_owned(rig, client_owner(), OwnerKind::Client, requester)
}

/// The identity of the client owner [`ambiguous_tree_of`] records.
fn client_owner() -> Identity {
    Identity {
        pid: PID_BASE - 2,
        start_ticks: 2,
        boot_id: BOOT.into(),
    }
}

/// [`ambiguous_tree_of`], owned by `owner` of `kind`.
fn ambiguous_tree_owned(
    rig: &Rig,
    owner: Identity,
    kind: OwnerKind,
    requester: Requester,
) -> TreeId {
    let owner = rig
        .ledger
        .register_owner(&OwnerRecord {
            identity: IdentityRecord {
                pid: owner.pid,
                start_ticks: owner.start_ticks,
                boot_id: owner.boot_id,
            },
            kind,
        })
        .expect("owner");
    let tree = rig
        .ledger
        .create_tree_for(
            &NewTree {
                label: None,
                boundary: crate::proc::BoundaryKind::Session,
                owner,
                argv: vec!["api".into()],
                cwd: None,
                grace_ms: Some(0),
                timeout_ms: None,
                limits: Default::default(),
                first_signal: None,
            },
            Some(&OnBehalfRecord {
                requester,
                run_uid: None,
                run_gid: None,
            }),
        )
        .expect("tree");
    let root = (PID_BASE + 50, 1);
    rig.ledger
        .tree_spawned(
            tree,
            &SpawnRecord {
                root: IdentityRecord {
                    pid: root.0,
                    start_ticks: root.1,
                    boot_id: BOOT.into(),
                },
                pgid: root.0,
                sid: root.0,
                cgroup: None,
            },
        )
        .expect("spawned");
    rig.ledger
        .set_state(tree, TreeState::Ambiguous, Some("api survivors"))
        .expect("ambiguous");
    tree
}

fn requester(via: &str, uid: Option<u32>, token_id: Option<i64>) -> Requester {
    Requester {
        via: via.into(),
        uid,
        pid: None,
        token_id,
        token_name: None,
        ..Default::default()
    }
}

/// `check_dispatch_for`'s verdict: `Some(tree)` refused naming it.
fn refused_for(rig: &Rig, owner: &Identity, by: Option<&Requester>) -> Option<i64> {
    match rig.engine.gate().check_dispatch_for(owner, by) {
        Ok(()) => None,
        Err(CustodyError::DispatchRefused { tree, .. }) => Some(tree.0),
        Err(e) => panic!("refused for another cause: {e}"),
    }
}

#[test]
fn owner_scope_refuses_the_same_owner_record_only_host_scope_everyone() {
    let mut rig = rig(false, false);
    rig.ledger
        .set_state(rig.tree, TreeState::Ambiguous, Some("survivors left"))
        .expect("ambiguous");
    let same = rig_owner();
    assert_eq!(refused_for(&rig, &same, None), Some(rig.tree.0));
    // Each of pid, start and boot makes another owner.
    let other_pid = Identity {
        pid: PID_BASE - 3,
        ..rig_owner()
    };
    let other_start = Identity {
        start_ticks: 7,
        ..rig_owner()
    };
    let other_boot = Identity {
        boot_id: "another-boot".into(),
        ..rig_owner()
    };
    for other in [&other_pid, &other_start, &other_boot] {
        assert_eq!(refused_for(&rig, other, None), None, "{other:?}");
    }
    // The host-wide gate ignores whose the tree is.
    rig.engine.set_dispatch_scope(super::DispatchScope::Host);
    assert_eq!(refused_for(&rig, &other_pid, None), Some(rig.tree.0));
    rig.engine
        .gate()
        .check_dispatch()
        .expect_err("host: closed");
}

#[test]
fn owner_scope_refuses_the_same_token_or_socket_uid_never_a_cli_uid() {
    let rig = rig(false, false);
    let stranger = Identity {
        pid: PID_BASE - 3,
        ..rig_owner()
    };
    let tcp = ambiguous_tree_of(&rig, requester("tcp", Some(5), Some(7)));
    let by = |via, uid, token| Some(requester(via, uid, token));
    assert_eq!(
        refused_for(&rig, &stranger, by("tcp", None, Some(7)).as_ref()),
        Some(tcp.0)
    );
    for other in [
        by("tcp", Some(5), Some(8)),
        by("tcp", Some(5), None),
        // Same uid, through the socket: the via differs.
        by("socket", Some(5), Some(7)),
        None,
    ] {
        assert_eq!(
            refused_for(&rig, &stranger, other.as_ref()),
            None,
            "{other:?}"
        );
    }

    let rig = rig_with_one(requester("socket", Some(5), None));
    assert_eq!(
        refused_for(&rig.0, &stranger, by("socket", Some(5), None).as_ref()),
        Some(rig.1.0)
    );
    for other in [by("socket", Some(6), None), by("tcp", Some(5), None)] {
        assert_eq!(
            refused_for(&rig.0, &stranger, other.as_ref()),
            None,
            "{other:?}"
        );
    }

    // No token on either side (a TCP request without one), no uid on
    // either side: nothing names a scope.
    let rig = rig_with_one(requester("tcp", None, None));
    assert_eq!(
        refused_for(&rig.0, &stranger, by("tcp", None, None).as_ref()),
        None
    );
    let rig = rig_with_one(requester("socket", None, None));
    assert_eq!(
        refused_for(&rig.0, &stranger, by("socket", None, None).as_ref()),
        None
    );
    // A CLI wrapper's uid is no scope.
    let rig = rig_with_one(requester("cli", Some(5), None));
    assert_eq!(
        refused_for(&rig.0, &stranger, by("cli", Some(5), None).as_ref()),
        None
    );
}

/// A fresh rig holding one ambiguous tree asked for by `requester`.
fn rig_with_one(by: Requester) -> (Rig, TreeId) {
    let rig = rig(false, false);
    let tree = ambiguous_tree_of(&rig, by);
    (rig, tree)
}

#[test]
fn a_marker_the_ledger_never_took_closes_every_scope_and_each_refusal_is_recorded() {
    let rig = rig(false, false);
    let unknown = rig.tree.0 + 100;
    // The empty reason of a teardown that had none to give.
    rig.engine
        .ambiguity()
        .mark_ambiguous(TreeId(unknown), "", &[], &[]);
    rig.ledger
        .set_state(rig.tree, TreeState::Ambiguous, None)
        .expect("ambiguous");
    assert_eq!(
        unsettled(&rig),
        [
            (rig.tree.0, "ambiguous teardown".to_string()),
            (
                unknown,
                "ambiguous teardown (not yet in the ledger)".to_string()
            ),
        ]
    );
    let stranger = Identity {
        pid: PID_BASE - 3,
        ..rig_owner()
    };
    assert_eq!(refused_for(&rig, &stranger, None), Some(unknown));
    // Refused twice: by the whole gate (two trees), by the owner's (one).
    assert_eq!(refused_for(&rig, &rig_owner(), None), Some(rig.tree.0));
    let refusals: Vec<_> = rig
        .ledger
        .events(&EventFilter {
            kind_prefix: Some("dispatch.refused".into()),
            ..EventFilter::default()
        })
        .expect("events")
        .into_iter()
        .map(|e| e.data)
        .collect();
    assert_eq!(
        refusals,
        [
            serde_json::json!({"tree": unknown, "reason": "ambiguous teardown (not yet in the ledger)", "unsettled": 1}),
            serde_json::json!({"tree": rig.tree.0, "reason": "ambiguous teardown", "unsettled": 2}),
        ]
    );
}

/// The service's own owner record, which every API tree spawned without
/// `owner_pid` shares.
fn service_owner() -> Identity {
    Identity {
        pid: PID_BASE - 4,
        start_ticks: 4,
        boot_id: BOOT.into(),
    }
}

#[test]
fn an_api_tree_closes_dispatch_for_its_principal_only_never_through_the_services_owner_record() {
    let rig = rig(false, false);
    let me = service_owner();
    let a = requester("socket", Some(5), None);
    let tree = ambiguous_tree_owned(&rig, me.clone(), OwnerKind::Service, a.clone());
    let by = |via, uid, token| Some(requester(via, uid, token));
    // Every other principal spawns, though the new tree's owner record is
    // the unsettled one's (the service itself).
    for other in [
        by("socket", Some(6), None),
        by("socket", Some(0), None),
        by("tcp", None, Some(7)),
        by("cli", Some(5), None),
        None,
    ] {
        assert_eq!(refused_for(&rig, &me, other.as_ref()), None, "{other:?}");
    }
    // Its own principal is refused, whoever owns the new tree, and the
    // refusal records who was refused.
    assert_eq!(refused_for(&rig, &me, Some(&a)), Some(tree.0));
    assert_eq!(refused_for(&rig, &client_owner(), Some(&a)), Some(tree.0));
    let refused: Vec<_> = rig
        .ledger
        .events(&EventFilter {
            kind_prefix: Some("dispatch.refused".into()),
            ..EventFilter::default()
        })
        .expect("events")
        .into_iter()
        .map(|e| e.data["by"].clone())
        .collect();
    let a_json = serde_json::to_value(&a).expect("json");
    assert_eq!(refused, [a_json.clone(), a_json]);
    // The host-wide gate still refuses everyone.
    let mut rig = rig;
    rig.engine.set_dispatch_scope(super::DispatchScope::Host);
    assert_eq!(
        refused_for(&rig, &me, by("socket", Some(6), None).as_ref()),
        Some(tree.0)
    );
}

#[test]
fn a_service_tree_that_names_no_principal_closes_every_scope() {
    // (recorded before requesters were: nothing says whose it is)
    let rig = rig(false, false);
    let tree = ambiguous_tree_owned(
        &rig,
        service_owner(),
        OwnerKind::Service,
        Requester::default(),
    );
    assert_eq!(
        refused_for(
            &rig,
            &service_owner(),
            Some(&requester("socket", Some(6), None))
        ),
        Some(tree.0)
    );
}

#[test]
fn a_member_no_sigkill_ends_is_one_typed_finding_and_the_trees_outcome() {
    let rig = rig(false, false);
    rig.host
        .world()
        .procs
        .get_mut(&rig.root.0)
        .expect("root")
        .unkillable = true;
    let mut opts =
        super::TeardownOptions::new(std::time::Duration::ZERO, "test", super::Origin::Kill);
    opts.rounds = 2;
    opts.verify_timeout = std::time::Duration::from_millis(50);
    for attempt in 1..=2 {
        let err = rig
            .engine
            .teardown(rig.tree, &opts, &mut |_| {})
            .expect_err("unsettled");
        let CustodyError::Ambiguous { reason, .. } = err else {
            panic!("ambiguous: {err}");
        };
        assert!(
            reason.contains(&format!("unkillable: pid {} (state ", rig.root.0))
                && reason.contains(&format!("{} SIGKILLs)", 2)),
            "attempt {attempt}: {reason}"
        );
        // One finding per member and tree, however often the teardown is
        // tried again.
        let found: Vec<serde_json::Value> = rig
            .ledger
            .events(&EventFilter {
                tree: Some(rig.tree),
                kind_prefix: Some("member.unkillable".into()),
                ..EventFilter::default()
            })
            .expect("events")
            .into_iter()
            .map(|e| e.data)
            .collect();
        assert_eq!(found.len(), 1, "attempt {attempt}: {found:?}");
        assert_eq!(found[0]["identity"]["pid"], rig.root.0);
        assert_eq!(found[0]["identity"]["start_ticks"], rig.root.1);
        assert_eq!(found[0]["kills"], 2);
        assert!(found[0]["state"].is_string(), "{}", found[0]);
        let auths = rig
            .ledger
            .tree_detail(rig.tree)
            .expect("detail")
            .expect("tree")
            .authorizations;
        assert_eq!(
            found[0]["authorization"], auths[1].id.0,
            "the last authorization of the first teardown that found it"
        );
    }
    let row = rig.ledger.tree(rig.tree).expect("read").expect("tree");
    assert!(
        row.flags.iter().any(|f| f == "unkillable"),
        "{:?}",
        row.flags
    );
    let unsettled = rig.engine.gate().unsettled().expect("unsettled");
    assert_eq!(
        rig.engine.gate().newest_unkillable(&unsettled),
        Some(rig.tree)
    );
}
