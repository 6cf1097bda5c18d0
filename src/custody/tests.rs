//! Unit tests of the teardown through the kernel seam: a real ledger in a
//! temporary directory, a scripted [`FakeHost`] instead of the kernel. No
//! real process is started or signalled; time passes only on the fake clock.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::fake::{
    BOOT, Call, FakeHost, FakeProc, PID_BASE, Sent, Target, World, member, recorded_tree, stranger,
};
use super::{CustodyError, Engine, Origin, TeardownOptions, TeardownReport};
use crate::ledger::{
    EventFilter, EventKind, IdentityRecord, KillTarget, Ledger, NewTree, SpawnRecord, TargetKind,
    TreeDetail, TreeId, TreeState, WriteLock,
};
use crate::proc::{ExitStatus, Sig};

/// How long a refused ledger write waits before it fails: short, so a held
/// write lock costs milliseconds per write.
const BUSY: Duration = Duration::from_millis(40);

/// One tree recorded in a real ledger, torn down on a fake host.
struct Rig {
    dir: tempfile::TempDir,
    ledger: Ledger,
    engine: Engine,
    host: Arc<FakeHost>,
    tree: TreeId,
    /// The root's `(pid, start_ticks)`; it leads the group and the session.
    root: (i32, u64),
    cgroup: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Boundary {
    Session,
    Cgroup,
}

/// Records a tree whose root (pid [`PID_BASE`]) leads its group and
/// session; `setup` adds processes to the world (given the root's pid and
/// the cgroup). The owner is dead, as in a sweep.
fn rig(
    boundary: Boundary,
    reaper: bool,
    setup: impl FnOnce(&mut World, i32, Option<&Path>),
) -> Rig {
    let dir = tempfile::tempdir().expect("tempdir");
    let host = Arc::new(FakeHost::new(reaper));
    let cgroup = (boundary == Boundary::Cgroup).then(|| PathBuf::from("/fake/cgroup/tw-test-1"));
    let root = {
        let mut w = host.world();
        let root = w.spawn(member(PID_BASE, 1, PID_BASE, cgroup.as_deref()));
        setup(&mut w, root.0, cgroup.as_deref());
        root
    };
    let (config, ledger, tree) =
        recorded_tree(dir.path(), root, cgroup.as_deref(), "worker", 1_000, BUSY);
    let engine = Engine::signal_only(&config, ledger.clone(), None).with_host(host.clone());
    host.watch_authority(&ledger, tree);
    Rig {
        dir,
        ledger,
        engine,
        host,
        tree,
        root,
        cgroup,
    }
}

impl Rig {
    /// An earlier scan's sighting of `(pid, start)` in the root's group and
    /// session, child of `ppid`, running `worker`.
    /// As a scan records a member it read: with the uid it runs as.
    fn sighted(&self, (pid, start_ticks): (i32, u64), ppid: i32) {
        let uid = self.host.world().procs.get(&pid).map(|p| p.uid);
        self.ledger
            .observe_members(
                self.tree,
                &[crate::ledger::MemberRecord {
                    identity: IdentityRecord {
                        pid,
                        start_ticks,
                        boot_id: BOOT.into(),
                    },
                    ppid,
                    pgid: self.root.0,
                    sid: self.root.0,
                    cgroup: None,
                    uid,
                    exe: None,
                    cmdline: vec!["worker".into()],
                    cwd: None,
                }],
            )
            .expect("sighting");
    }

    fn teardown(&self, grace: Duration) -> Result<TeardownReport, CustodyError> {
        self.teardown_with(TeardownOptions::new(grace, "test", Origin::Kill))
    }

    fn teardown_with(&self, opts: TeardownOptions) -> Result<TeardownReport, CustodyError> {
        self.engine.teardown(self.tree, &opts, &mut |_| {})
    }

    fn detail(&self) -> TreeDetail {
        self.ledger
            .tree_detail(self.tree)
            .expect("readable")
            .expect("recorded")
    }

    fn kinds(&self) -> Vec<String> {
        self.ledger
            .events(&EventFilter {
                tree: Some(self.tree),
                ..EventFilter::default()
            })
            .expect("events")
            .into_iter()
            .map(|e| e.kind.to_string())
            .collect()
    }

    fn kills(&self) -> Vec<Sent> {
        self.host
            .sent()
            .into_iter()
            .filter(|s| s.sig == Sig::Kill)
            .collect()
    }

    fn hold_write_lock(&self) -> WriteLock {
        WriteLock::hold(&self.dir.path().join("ledger.db"))
    }
}

/// A process of the tree that ignores SIGTERM.
fn stubborn(parent: i32, pgid: i32, cgroup: Option<&Path>) -> FakeProc {
    FakeProc {
        ignores_term: true,
        ..member(0, parent, pgid, cgroup)
    }
}

/// The invariant of the whole design, checked on the fake's record: every
/// SIGKILL that reached anything was asked for while the ledger already
/// held a committed authorization naming that target and every identity it
/// reached.
fn assert_every_kill_authorized(sent: &[Sent]) {
    for s in sent
        .iter()
        .filter(|s| s.sig == Sig::Kill && !s.hit.is_empty())
    {
        let (kind, target) = match &s.target {
            Target::Group(pgid) => ("group", pgid.to_string()),
            Target::Pid(pid) => ("pid", pid.to_string()),
            Target::Cgroup(dir) => ("cgroup", dir.display().to_string()),
        };
        let named = |t: &KillTarget| {
            t.kind.as_str() == kind
                && t.target == target
                && s.hit.iter().all(|(pid, start)| {
                    t.identities
                        .iter()
                        .any(|id| id.pid == *pid && id.start_ticks == *start)
                })
        };
        assert!(
            s.authorized.iter().any(|a| a.targets.iter().any(named)),
            "SIGKILL to {kind} {target} reaching {:?} without a committed authorization naming them: {:?}",
            s.hit,
            s.authorized
        );
    }
}

#[test]
fn a_tree_that_obeys_sigterm_ends_without_any_kill_or_authorization() {
    let rig = rig(Boundary::Session, false, |w, root, _| {
        w.spawn(member(0, root, root, None));
        w.spawn(member(0, root, root, None));
    });
    let report = rig.teardown(Duration::from_secs(5)).expect("settled");
    assert_eq!(report.state, TreeState::Ended);
    assert_eq!(report.members_at_start, 3);
    assert_eq!(report.authorizations, 0);
    assert!(rig.kills().is_empty());
    let sent = rig.host.sent();
    assert_eq!(sent.len(), 1, "one SIGTERM to the group: {sent:?}");
    assert_eq!(sent[0].target, Target::Group(rig.root.0));
    assert_eq!(sent[0].sig, Sig::Term);
    assert!(rig.host.world().live().is_empty());
    assert!(rig.detail().authorizations.is_empty());
}

#[test]
fn every_sigkill_follows_a_committed_authorization_naming_exactly_its_targets() {
    let rig = rig(Boundary::Session, false, |w, root, _| {
        w.procs.get_mut(&root).expect("root").ignores_term = true;
        let child = w.spawn(stubborn(root, root, None));
        // A grandchild that went to a session of its own: found by descent.
        let esc = w.spawn(stubborn(child.0, root, None));
        w.setsid(esc.0);
    });
    let report = rig.teardown(Duration::from_millis(300)).expect("settled");
    assert_eq!(report.state, TreeState::Ended);
    assert_eq!(report.authorizations, 1);
    assert_eq!(report.force_killed, 3);
    let kills = rig.kills();
    assert_eq!(kills.len(), 2, "group and escapee: {kills:?}");
    assert_every_kill_authorized(&kills);
    // Exactly the targets: the authorization names the group's two live
    // members and the escapee, nothing else.
    let auth = &rig.detail().authorizations[0];
    let mut named: Vec<(String, i32)> = auth
        .targets
        .iter()
        .flat_map(|t| t.identities.iter().map(|id| (t.kind.to_string(), id.pid)))
        .collect();
    named.sort();
    let mut hit: Vec<(String, i32)> = kills
        .iter()
        .flat_map(|s| {
            let kind = match s.target {
                Target::Group(_) => "group",
                Target::Pid(_) => "pid",
                Target::Cgroup(_) => "cgroup",
            };
            s.hit.iter().map(move |(pid, _)| (kind.to_string(), *pid))
        })
        .collect();
    hit.sort();
    assert_eq!(named, hit);
    // The grace was waited on the fake clock before the first SIGKILL.
    assert!(
        kills[0].at >= Duration::from_millis(300),
        "{:?}",
        kills[0].at
    );
    assert!(rig.host.world().live().is_empty());
    let killing = rig
        .ledger
        .events(&EventFilter {
            tree: Some(rig.tree),
            ..EventFilter::default()
        })
        .expect("events")
        .into_iter()
        .filter(|e| e.kind.as_str() == "tree.state" && e.data["to"] == "killing")
        .count();
    assert_eq!(killing, 1, "the state killing, recorded in the first round");
}

/// A stubborn tree with one member that SIGKILL does not end at once (a
/// long uninterruptible sleep, or the kernel letting a cgroup member go):
/// it exits on its own 5 ms into the verify.
fn tree_with_a_member_slow_to_die(boundary: Boundary) -> Rig {
    rig(boundary, false, |w, root, cg| {
        w.procs.get_mut(&root).expect("root").ignores_term = true;
        let slow = w.spawn(stubborn(root, root, cg));
        w.procs.get_mut(&slow.0).expect("slow").unkillable = true;
        w.on(Call::Sleep, 5, move |w| {
            w.exit(slow.0, ExitStatus::Signaled(9))
        });
    })
}

#[test]
fn the_verify_waits_for_a_killed_member_that_dies_slowly() {
    let rig = tree_with_a_member_slow_to_die(Boundary::Session);
    let report = rig.teardown(Duration::ZERO).expect("settled");
    assert_eq!(report.state, TreeState::Ended);
    assert_eq!(report.authorizations, 1, "one round: the verify waited");
    let sigs: Vec<Sig> = rig.host.sent().iter().map(|s| s.sig).collect();
    assert_eq!(sigs, [Sig::Term, Sig::Stop, Sig::Kill], "no SIGCONT");
    assert!(rig.host.now_since_start() < Duration::from_secs(1));
    // It waited on the exit (a pidfd), then re-read once: no re-reads of
    // the survivors while the kernel was still killing.
    let w = rig.host.world();
    assert_eq!(w.calls.get(&Call::SnapshotPids), Some(&1), "{:?}", w.calls);
}

#[test]
fn a_cgroup_tree_is_frozen_authorized_killed_by_cgroup_kill_and_thawed() {
    let rig = rig(Boundary::Cgroup, false, |w, root, cg| {
        w.procs.get_mut(&root).expect("root").ignores_term = true;
        w.spawn(stubborn(root, root, cg));
        w.spawn(stubborn(root, root, cg));
    });
    let cg = rig.cgroup.clone().expect("cgroup");
    let report = rig.teardown(Duration::from_millis(100)).expect("settled");
    assert_eq!(report.state, TreeState::Ended);
    let kills = rig.kills();
    assert_eq!(kills.len(), 1, "{kills:?}");
    assert_eq!(kills[0].target, Target::Cgroup(cg.clone()));
    assert_eq!(kills[0].hit.len(), 3);
    assert_every_kill_authorized(&kills);
    // Exactly the target it reached: no group target beside the cgroup
    // when every member is in the cgroup.
    let auths = rig.detail().authorizations;
    assert_eq!(auths.len(), 1);
    let kinds: Vec<&str> = auths[0].targets.iter().map(|t| t.kind.as_str()).collect();
    assert_eq!(kinds, ["cgroup"]);
    let w = rig.host.world();
    assert_eq!(w.calls.get(&Call::CgroupFreeze), Some(&1), "frozen once");
    assert_eq!(w.calls.get(&Call::CgroupThaw), Some(&1), "then thawed");
    assert!(w.removed.contains(&cg), "the empty cgroup is removed");
}

#[test]
fn a_refused_authorization_sends_no_sigkill_thaws_and_closes_dispatch() {
    let rig = rig(Boundary::Cgroup, false, |w, root, cg| {
        w.procs.get_mut(&root).expect("root").ignores_term = true;
        w.spawn(stubborn(root, root, cg));
    });
    let cg = rig.cgroup.clone().expect("cgroup");
    // The ledger stops taking writes as the freeze begins: the survivor
    // snapshot and the authorization are refused.
    let lock: Arc<Mutex<Option<WriteLock>>> = Arc::new(Mutex::new(None));
    {
        let lock = lock.clone();
        let path = rig.dir.path().join("ledger.db");
        rig.host.world().on(Call::CgroupFreeze, 1, move |_| {
            *lock.lock().expect("lock slot") = Some(WriteLock::hold(&path));
        });
    }
    let err = rig
        .teardown(Duration::from_millis(50))
        .expect_err("ambiguous");
    assert!(matches!(err, CustodyError::Ambiguous { .. }), "{err}");
    assert!(rig.kills().is_empty(), "no SIGKILL without authority");
    {
        let w = rig.host.world();
        assert_eq!(w.cgroups.get(&cg), Some(&false), "thawed");
        assert_eq!(w.live().len(), 2, "survivors left alive as evidence");
    }
    assert!(matches!(
        rig.engine.gate().check_dispatch(),
        Err(CustodyError::DispatchRefused { .. })
    ));
    assert_eq!(rig.engine.stats().authorizations_failed(), 1);
    let marked = rig.engine.ambiguity().marked_survivors(rig.tree);
    assert_eq!(marked.len(), 2, "the marker names the survivors");
    // Once the ledger takes writes again the trail is written late.
    drop(lock.lock().expect("lock slot").take());
    rig.engine.ambiguity().flush_ambiguous();
    assert_eq!(rig.detail().tree.state, TreeState::Ambiguous);
    assert!(rig.kinds().iter().any(|k| k == "kill.skipped"));
}

#[test]
fn a_standing_kill_that_cannot_be_cleared_skips_the_forced_kill_and_is_cleared_again_on_the_way_out()
 {
    let rig = rig(Boundary::Cgroup, false, |w, root, cg| {
        w.procs.get_mut(&root).expect("root").ignores_term = true;
        w.spawn(stubborn(root, root, cg));
        w.disarm_fails = 1;
    });
    let err = rig
        .teardown(Duration::from_millis(50))
        .expect_err("ambiguous");
    let CustodyError::Ambiguous { reason, .. } = &err else {
        panic!("not ambiguous: {err}");
    };
    assert!(
        reason.contains("standing kill could not be cleared"),
        "{reason}"
    );
    assert!(rig.kills().is_empty(), "no forced kill while armed");
    assert!(
        rig.detail().authorizations.is_empty(),
        "no authorization either"
    );
    let w = rig.host.world();
    assert_eq!(w.live().len(), 2, "the members are left alive");
    // The freeze round's disarm, then the error exit's.
    assert_eq!(w.disarms, 2);
    drop(w);
    let detail = rig.detail();
    assert_eq!(detail.tree.state, TreeState::Ambiguous);
    assert!(
        detail.tree.flags.iter().any(|f| f == "disarm_failed"),
        "{:?}",
        detail.tree.flags
    );
}

#[test]
fn a_refused_authorization_on_the_session_boundary_is_thawed_by_a_recorded_sigcont() {
    let rig = rig(Boundary::Session, false, |w, root, _| {
        w.procs.get_mut(&root).expect("root").ignores_term = true;
        w.spawn(stubborn(root, root, None));
    });
    let _held = rig.hold_write_lock();
    let err = rig.teardown(Duration::ZERO).expect_err("ambiguous");
    assert!(matches!(err, CustodyError::Ambiguous { .. }), "{err}");
    assert!(rig.kills().is_empty());
    let sigs: Vec<Sig> = rig.host.sent().iter().map(|s| s.sig).collect();
    assert_eq!(sigs, [Sig::Term, Sig::Stop, Sig::Cont]);
    let w = rig.host.world();
    assert_eq!(w.live().len(), 2);
    assert!(
        w.procs.values().all(|p| p.state == 'S'),
        "nobody left stopped"
    );
    drop(w);
    assert!(rig.engine.gate().check_dispatch().is_err());
}

#[test]
fn grace_zero_goes_from_sigterm_straight_to_the_authorized_kill() {
    let rig = rig(Boundary::Session, false, |w, root, _| {
        w.procs.get_mut(&root).expect("root").ignores_term = true;
    });
    let report = rig.teardown(Duration::ZERO).expect("settled");
    assert_eq!(report.state, TreeState::Ended);
    let sent = rig.host.sent();
    let sigs: Vec<Sig> = sent.iter().map(|s| s.sig).collect();
    // No SIGCONT: the SIGKILL ended the stopped tree (a survivor would get one).
    assert_eq!(sigs, [Sig::Term, Sig::Stop, Sig::Kill]);
    assert_eq!(sent[2].at, Duration::ZERO, "no time waited before the kill");
    assert_every_kill_authorized(&sent);
    assert_eq!(rig.host.world().calls.get(&Call::Sleep), None);
}

#[test]
fn a_session_member_that_outlives_the_kill_is_not_left_stopped() {
    let rig = rig(Boundary::Session, false, |w, root, _| {
        w.procs.get_mut(&root).expect("root").ignores_term = true;
        let p = w.spawn(stubborn(root, root, None));
        w.procs.get_mut(&p.0).expect("child").unkillable = true;
    });
    let mut opts = TeardownOptions::new(Duration::ZERO, "test", Origin::Kill);
    opts.rounds = 1;
    let err = rig.teardown_with(opts).expect_err("a survivor: ambiguous");
    assert!(matches!(err, CustodyError::Ambiguous { .. }), "{err}");
    let sigs: Vec<Sig> = rig.host.sent().iter().map(|s| s.sig).collect();
    assert_eq!(sigs, [Sig::Term, Sig::Stop, Sig::Kill, Sig::Cont]);
    let w = rig.host.world();
    assert!(
        w.procs.values().all(|p| p.state != 'T'),
        "nothing left stopped: {:?}",
        w.procs
    );
}

#[test]
fn grace_ends_early_when_the_tree_empties() {
    let rig = rig(Boundary::Session, false, |w, root, _| {
        w.procs.get_mut(&root).expect("root").ignores_term = true;
        // It ignores SIGTERM, but exits on its own during the grace.
        w.on(Call::Sleep, 3, move |w| w.exit(root, ExitStatus::Exited(0)));
    });
    let report = rig.teardown(Duration::from_secs(60)).expect("settled");
    assert_eq!(report.state, TreeState::Ended);
    assert!(rig.kills().is_empty());
    assert!(rig.host.now_since_start() < Duration::from_secs(1));
}

#[test]
fn a_fork_storm_is_fought_for_a_bounded_number_of_rounds_then_ambiguous() {
    let rig = rig(Boundary::Session, true, |w, root, _| {
        w.procs.get_mut(&root).expect("root").ignores_term = true;
        // `run` is the subreaper: the orphans of the storm come to it.
        let me = std::process::id() as i32;
        w.subreaper = Some(me);
        // Just before every SIGKILL, a member that was not stopped yet
        // forked a child that went to a session of its own: outside the
        // group the kill reaches, not in the survivors the authorization
        // named. The verifying walk finds it; the next round must kill it.
        for n in 1..=6 {
            w.on(Call::KillAny, n, move |w| {
                let child = w.spawn(FakeProc {
                    ppid: me,
                    ..stubborn(me, 0, None)
                });
                w.setsid(child.0);
            });
        }
    });
    let mut opts = TeardownOptions::new(Duration::ZERO, "storm", Origin::Run);
    opts.rounds = 3;
    opts.verify_timeout = Duration::from_millis(200);
    let err = rig.teardown_with(opts).expect_err("ambiguous");
    assert!(matches!(err, CustodyError::Ambiguous { .. }), "{err}");
    let kills: Vec<Sent> = rig
        .kills()
        .into_iter()
        .filter(|k| !k.hit.is_empty())
        .collect();
    // (Each SIGKILL request, also the recorded group's empty one, lets
    // one more child out: a round may have to kill two.)
    assert!(
        kills.len() >= 3,
        "at least one SIGKILL per round: {kills:#?}"
    );
    assert_every_kill_authorized(&kills);
    let detail = rig.detail();
    assert_eq!(detail.authorizations.len(), 3, "bounded: three rounds");
    assert_eq!(detail.tree.state, TreeState::Ambiguous);
    assert!(detail.tree.flags.iter().any(|f| f == "survivors"));
    // Each survivor appeared after the SIGKILLs that could have named it:
    // a fork race, not a member no signal ends.
    assert!(!detail.tree.flags.iter().any(|f| f == "unkillable"));
    assert!(!rig.kinds().iter().any(|k| k == "member.unkillable"));
    assert!(rig.engine.gate().check_dispatch().is_err());
    assert!(
        !rig.host.world().live().is_empty(),
        "the last children are left as evidence"
    );
}

#[test]
fn members_that_appear_only_between_the_frozen_read_and_the_walk_cost_bounded_rounds() {
    // Each round's frozen re-read finds nothing (the member the walk before
    // found has exited), and each verifying walk after the thaw finds a new
    // one: no survivor is ever authorized or killed, and the rounds are
    // still bounded.
    let rig = rig(Boundary::Cgroup, false, |w, _root, cg| {
        let cg = cg.expect("cgroup").to_path_buf();
        // The root obeys SIGTERM. Walk 1 is the TERM's; the walk after each
        // round's thaw (2, 3, 4) finds a new member, gone before the next
        // round's frozen re-read (the n-th targeted read).
        for (walk, frozen_read) in [(2, 2), (3, 3), (4, 4)] {
            let cg = cg.clone();
            w.on(Call::Snapshot, walk, move |w| {
                let ghost = w.spawn(member(0, 1, 0, Some(&cg)));
                w.on(Call::SnapshotPids, frozen_read, move |w| {
                    w.exit(ghost.0, ExitStatus::Exited(0))
                });
            });
        }
    });
    let mut opts = TeardownOptions::new(Duration::ZERO, "ghosts", Origin::Kill);
    opts.rounds = 3;
    let err = rig
        .teardown_with(opts)
        .expect_err("ambiguous after the rounds");
    assert!(matches!(err, CustodyError::Ambiguous { .. }), "{err}");
    assert!(rig.kills().is_empty(), "nothing was ever authorized to die");
    assert!(rig.detail().authorizations.is_empty());
    let w = rig.host.world();
    assert_eq!(
        w.calls.get(&Call::Snapshot),
        Some(&4),
        "the TERM's walk and one per round, three rounds"
    );
    assert_eq!(w.calls.get(&Call::CgroupFreeze), Some(&3));
}

#[test]
fn a_group_that_is_not_provably_the_recorded_one_is_refused_not_frozen_or_killed() {
    let rig = rig(Boundary::Session, false, |w, root, _| {
        w.procs.get_mut(&root).expect("root").ignores_term = true;
        // A process in the recorded group but not in its session: the
        // group is not provably the recorded one.
        w.spawn(FakeProc {
            sid: root + 500,
            ..stubborn(root, root, None)
        });
    });
    let report = rig.teardown(Duration::ZERO).expect("refused, closed");
    assert_eq!(report.state, TreeState::Vanished);
    let sent = rig.host.sent();
    assert_eq!(sent.len(), 1, "only the refused SIGTERM: {sent:#?}");
    assert_eq!(sent[0].sig, Sig::Term);
    assert!(sent[0].hit.is_empty());
    assert!(rig.detail().authorizations.is_empty());
}

#[test]
fn an_escapee_is_signalled_only_by_pid_after_its_identity_is_checked() {
    let mut esc = (0, 0);
    let rig = rig(Boundary::Session, false, |w, root, _| {
        let e = w.spawn(stubborn(root, root, None));
        w.setsid(e.0);
        esc = e;
    });
    let report = rig.teardown(Duration::from_millis(100)).expect("settled");
    assert_eq!(report.state, TreeState::Ended);
    let sent = rig.host.sent();
    for s in sent.iter().filter(|s| s.hit.contains(&esc)) {
        assert_eq!(s.target, Target::Pid(esc.0), "{s:?}");
    }
    assert!(
        !sent.iter().any(|s| s.target == Target::Group(esc.0)),
        "its own group is never signalled"
    );
    assert_every_kill_authorized(&sent);
    // The escape is evidence, recorded once.
    assert!(rig.kinds().iter().any(|k| k == "escape.observed"));
}

#[test]
fn a_recycled_pid_is_never_signalled() {
    let mut esc = (0, 0);
    let rig = rig(Boundary::Session, false, |w, root, _| {
        w.procs.get_mut(&root).expect("root").ignores_term = true;
        let e = w.spawn(stubborn(root, root, None));
        w.setsid(e.0);
        esc = e;
        // Between the authorization and its SIGKILL (the group's comes
        // first) the escapee exits and a stranger gets its pid.
        let pid = e.0;
        w.on(Call::KillAny, 2, move |w| {
            w.recycle(pid).expect("the escapee's pid is free for reuse");
        });
    });
    let report = rig.teardown(Duration::ZERO).expect("settled");
    assert_eq!(report.state, TreeState::Ended);
    let w = rig.host.world();
    let stranger = w.procs.get(&esc.0).expect("the stranger lives").start_ticks;
    assert_ne!(stranger, esc.1);
    drop(w);
    let sent = rig.host.sent();
    assert!(
        !sent.iter().any(|s| s.hit.contains(&(esc.0, stranger))),
        "the stranger holding the recycled pid was hit: {sent:?}"
    );
    // The escapee is held from its first sighting: its SIGKILL goes
    // through that handle, which finds its process gone.
    assert!(
        sent.iter()
            .any(|s| s.target == Target::Pid(esc.0) && s.sig == Sig::Kill && s.outcome == "gone"),
        "{sent:?}"
    );
    assert_every_kill_authorized(&sent);
    // The ledger's signal rows: the escapee's SIGTERM and SIGSTOP (sent), no
    // SIGKILL row for a kill that was refused.
    let pid = esc.0.to_string();
    let rows: Vec<(String, String)> = rig
        .detail()
        .signals
        .into_iter()
        .filter(|r| r.target_kind == TargetKind::Pid && r.target == pid)
        .map(|r| (r.signal.to_string(), r.result.to_string()))
        .collect();
    assert_eq!(
        rows,
        [
            ("SIGTERM".to_string(), "sent".to_string()),
            ("SIGSTOP".to_string(), "sent".to_string())
        ]
    );
}

#[test]
fn the_group_check_is_given_the_members_just_classified_into_the_group() {
    let mut ids = Vec::new();
    let rig = rig(Boundary::Session, false, |w, root, _| {
        w.procs.get_mut(&root).expect("root").ignores_term = true;
        ids.push(root);
        ids.push(w.spawn(stubborn(root, root, None)).0);
        // An escapee: not a group member, not a candidate.
        let e = w.spawn(stubborn(root, root, None));
        w.setsid(e.0);
    });
    rig.teardown(Duration::ZERO).expect("settled");
    let w = rig.host.world();
    ids.sort();
    assert!(!w.group_candidates.is_empty());
    for c in &w.group_candidates {
        let mut c = c.clone();
        c.sort();
        assert_eq!(c, ids, "TERM, STOP and KILL: the group's live members");
    }
}

#[test]
fn the_verify_waits_for_the_cgroup_to_empty_instead_of_re_reading_it() {
    let rig = tree_with_a_member_slow_to_die(Boundary::Cgroup);
    let report = rig.teardown(Duration::ZERO).expect("settled");
    assert_eq!(report.state, TreeState::Ended);
    assert_eq!(report.authorizations, 1);
    let w = rig.host.world();
    // One targeted re-read while frozen, one after `populated 0`: none
    // while the kernel was still killing.
    assert_eq!(w.calls.get(&Call::SnapshotPids), Some(&2), "{:?}", w.calls);
}

#[test]
fn a_tree_another_teardown_ended_meanwhile_stays_as_it_ended() {
    let rig = rig(Boundary::Session, false, |_, _, _| {});
    // A concurrent `kill` ends the tree while this teardown walks.
    let (ledger, tree) = (rig.ledger.clone(), rig.tree);
    rig.host.world().on(Call::Snapshot, 1, move |_| {
        ledger
            .end_tree(tree, TreeState::Ended, None)
            .expect("the other teardown's end");
    });
    let report = rig.teardown(Duration::ZERO).expect("no error");
    assert_eq!(report.state, TreeState::Ended);
    let row = rig.ledger.tree(rig.tree).expect("read").expect("row");
    assert_eq!(row.state, TreeState::Ended);
    assert!(
        !row.flags.iter().any(|f| f == "survivors_ended"),
        "{:?}",
        row.flags
    );
}

#[test]
fn a_group_member_outside_the_cgroup_is_killed_by_the_group_signal_with_authority() {
    let mut outside = (0, 0);
    let rig = rig(Boundary::Cgroup, false, |w, root, cg| {
        w.procs.get_mut(&root).expect("root").ignores_term = true;
        w.spawn(stubborn(root, root, cg));
        // In the recorded group and session, but moved out of the cgroup:
        // cgroup.kill does not reach it, the group signal must.
        outside = w.spawn(stubborn(root, root, None));
    });
    let report = rig.teardown(Duration::ZERO).expect("settled");
    assert_eq!(report.state, TreeState::Ended);
    assert_eq!(report.authorizations, 1);
    let kills = rig.kills();
    let by_group: Vec<&Sent> = kills
        .iter()
        .filter(|k| k.target == Target::Group(rig.root.0))
        .collect();
    assert_eq!(by_group.len(), 1, "{kills:#?}");
    assert_eq!(
        by_group[0].hit,
        vec![outside],
        "the group signal reached it"
    );
    assert_every_kill_authorized(&kills);
    assert!(rig.host.world().live().is_empty());
}

#[test]
fn a_sigkill_that_found_the_group_empty_is_recorded_as_skipped_not_as_a_signal() {
    let mut loner = (0, 0);
    let rig = rig(Boundary::Session, false, |w, root, _| {
        // The root is gone; a stubborn escapee of its tree lives on.
        let e = w.spawn(stubborn(root, root, None));
        w.setsid(e.0);
        loner = e;
        w.exit(root, ExitStatus::Exited(0));
    });
    // An earlier scan saw it in the tree (before it left the session).
    rig.sighted(loner, rig.root.0);
    let report = rig.teardown(Duration::ZERO).expect("settled");
    assert_eq!(report.state, TreeState::Ended);
    let detail = rig.detail();
    let group = rig.root.0.to_string();
    let group_rows: Vec<(String, String)> = detail
        .signals
        .iter()
        .filter(|r| r.target_kind == TargetKind::Group && r.target == group)
        .map(|r| (r.signal.to_string(), r.result.to_string()))
        .collect();
    // TERM and STOP to the empty group are recorded as what they found;
    // the SIGKILL that found nobody is not a signal.
    assert_eq!(
        group_rows,
        [
            ("SIGTERM".to_string(), "group empty".to_string()),
            ("SIGSTOP".to_string(), "group empty".to_string())
        ]
    );
    assert!(
        detail
            .events
            .iter()
            .any(|e| e.kind.as_str() == "kill.skipped"
                && e.data["reason"]
                    .as_str()
                    .is_some_and(|r| r.starts_with(&format!("group {group}")))),
        "the group's SIGKILL is recorded as skipped"
    );
    assert!(
        detail
            .signals
            .iter()
            .any(|r| r.signal == "SIGKILL" && r.target == loner.0.to_string())
    );
}

#[test]
fn a_recycled_group_leader_is_refused_and_the_tree_closed_vanished() {
    let rig = rig(Boundary::Session, false, |_, _, _| {});
    // The root is gone and its pid (the pgid and sid) belongs to a stranger.
    rig.host
        .world()
        .recycle(rig.root.0)
        .expect("the root's pid is free for reuse");
    let report = rig.teardown(Duration::from_secs(1)).expect("settled");
    assert_eq!(report.state, TreeState::Vanished);
    assert!(rig.host.sent().is_empty(), "nothing signalled");
    assert_eq!(rig.host.world().live().len(), 1, "the stranger lives");
}

#[test]
fn a_tree_of_another_boot_is_closed_vanished_without_a_signal() {
    let rig = rig(Boundary::Session, false, |_, _, _| {});
    // Same pid, but the row says another boot: write a fresh tree whose
    // root identity is from elsewhere.
    let owner = rig.detail().tree.owner.id;
    let other = rig
        .ledger
        .create_tree(&NewTree {
            label: None,
            boundary: crate::proc::BoundaryKind::Session,
            owner,
            argv: vec!["x".into()],
            cwd: None,
            grace_ms: None,
            timeout_ms: None,
            limits: Default::default(),
            first_signal: None,
        })
        .expect("tree");
    rig.ledger
        .tree_spawned(
            other,
            &SpawnRecord {
                root: IdentityRecord {
                    pid: rig.root.0,
                    start_ticks: rig.root.1,
                    boot_id: "another-boot".into(),
                },
                pgid: rig.root.0,
                sid: rig.root.0,
                cgroup: None,
            },
        )
        .expect("spawned");
    let opts = TeardownOptions::new(Duration::from_secs(1), "test", Origin::Sweep);
    let report = rig
        .engine
        .teardown(other, &opts, &mut |_| {})
        .expect("settled");
    assert_eq!(report.state, TreeState::Vanished);
    assert!(rig.host.sent().is_empty());
}

#[test]
fn resumes_from_terminating_without_a_second_transition() {
    let rig = rig(Boundary::Session, false, |w, root, _| {
        w.spawn(member(0, root, root, None));
    });
    rig.ledger
        .set_state(rig.tree, TreeState::Terminating, Some("earlier teardown"))
        .expect("state");
    let report = rig.teardown(Duration::from_secs(1)).expect("settled");
    assert_eq!(report.state, TreeState::Ended);
    let terminating = rig
        .ledger
        .events(&EventFilter {
            tree: Some(rig.tree),
            ..EventFilter::default()
        })
        .expect("events")
        .into_iter()
        .filter(|e| e.kind.as_str() == "tree.state" && e.data["to"] == "terminating")
        .count();
    assert_eq!(terminating, 1);
    assert_eq!(rig.host.sent()[0].sig, Sig::Term, "SIGTERM sent again");
}

#[test]
fn resumes_from_killing_with_a_fresh_authorization_naming_the_survivors_now() {
    let mut survivor = (0, 0);
    let rig = rig(Boundary::Session, false, |w, root, _| {
        w.procs.get_mut(&root).expect("root").ignores_term = true;
        survivor = w.spawn(stubborn(root, root, None));
    });
    // A crashed teardown authorized a kill of the root and a process that
    // has since died; it never sent it.
    rig.ledger
        .set_state(rig.tree, TreeState::Terminating, None)
        .expect("state");
    rig.ledger
        .authorize_kill(
            rig.tree,
            &[KillTarget {
                kind: crate::ledger::TargetKind::Group,
                target: rig.root.0.to_string(),
                identities: vec![IdentityRecord {
                    pid: PID_BASE + 999,
                    start_ticks: 7,
                    boot_id: BOOT.into(),
                }],
            }],
            "before the crash",
        )
        .expect("old authorization");
    rig.ledger
        .set_state(rig.tree, TreeState::Killing, None)
        .expect("state");
    let report = rig.teardown(Duration::ZERO).expect("settled");
    assert_eq!(report.state, TreeState::Ended);
    assert_eq!(report.authorizations, 1, "a fresh one");
    let detail = rig.detail();
    assert_eq!(detail.authorizations.len(), 2);
    let fresh = detail
        .authorizations
        .iter()
        .max_by_key(|a| a.id)
        .expect("fresh");
    let mut ids: Vec<(i32, u64)> = fresh
        .targets
        .iter()
        .flat_map(|t| t.identities.iter().map(|i| (i.pid, i.start_ticks)))
        .collect();
    ids.sort();
    let mut expect = vec![rig.root, survivor];
    expect.sort();
    assert_eq!(ids, expect);
    assert_every_kill_authorized(&rig.host.sent());
}

#[test]
fn resumes_from_ambiguous_and_kills_the_survivors_the_marker_names() {
    let mut loner = (0, 0);
    let rig = rig(Boundary::Session, false, |w, root, _| {
        // A survivor the ledger never recorded: orphaned to init, in a
        // session of its own; only the marker knows it.
        let e = w.spawn(stubborn(root, root, None));
        w.setsid(e.0);
        w.procs.get_mut(&e.0).expect("loner").ppid = 1;
        loner = e;
        w.exit(root, ExitStatus::Exited(0));
    });
    rig.ledger
        .set_state(rig.tree, TreeState::Ambiguous, Some("ledger refused"))
        .expect("state");
    super::markers::write(
        rig.dir.path(),
        rig.tree,
        &super::markers::Marker {
            reason: "forced kill skipped".into(),
            survivors: vec![IdentityRecord {
                pid: loner.0,
                start_ticks: loner.1,
                boot_id: BOOT.into(),
            }],
            pending: vec![],
            batch: String::new(),
        },
    );
    assert!(rig.engine.gate().check_dispatch().is_err());
    let report = rig.teardown(Duration::ZERO).expect("settled");
    assert_eq!(report.state, TreeState::Ended);
    // (The recorded group is empty: its SIGKILL finds nobody.)
    let kills: Vec<Sent> = rig
        .kills()
        .into_iter()
        .filter(|k| !k.hit.is_empty())
        .collect();
    assert_eq!(kills.len(), 1, "{kills:#?}");
    assert_eq!(kills[0].target, Target::Pid(loner.0));
    assert_eq!(kills[0].hit, vec![loner]);
    assert_every_kill_authorized(&kills);
    assert!(
        rig.engine.gate().check_dispatch().is_ok(),
        "settled: dispatch reopens"
    );
}

#[test]
fn resumes_from_a_terminal_state_without_touching_the_host() {
    for state in [TreeState::Ended, TreeState::Vanished] {
        let rig = rig(Boundary::Cgroup, false, |w, root, cg| {
            // Still running by the host's word: the ledger's end is final.
            w.spawn(member(0, root, root, cg));
        });
        rig.ledger.end_tree(rig.tree, state, None).expect("ended");
        let report = rig.teardown(Duration::ZERO).expect("nothing to do");
        assert_eq!(report.state, state);
        assert_eq!(report.members_at_start, 0);
        assert!(rig.host.sent().is_empty(), "{state:?}: no signal");
        let w = rig.host.world();
        assert_eq!(w.calls.get(&Call::Snapshot), None, "{state:?}: no walk");
        assert_eq!(w.calls.get(&Call::CgroupFreeze), None);
    }
}

#[test]
fn resumes_from_resolved_with_survivors_and_kills_them_with_authority() {
    let mut survivor = (0, 0);
    let rig = rig(Boundary::Session, false, |w, root, _| {
        survivor = w.spawn(stubborn(root, root, None));
        w.procs.get_mut(&root).expect("root").ignores_term = true;
    });
    rig.ledger
        .set_state(rig.tree, TreeState::Ambiguous, Some("ledger refused"))
        .expect("state");
    super::markers::write(
        rig.dir.path(),
        rig.tree,
        &super::markers::Marker {
            reason: "forced kill skipped".into(),
            survivors: vec![IdentityRecord {
                pid: survivor.0,
                start_ticks: survivor.1,
                boot_id: BOOT.into(),
            }],
            pending: vec![],
            batch: String::new(),
        },
    );
    rig.engine
        .ambiguity()
        .resolve(rig.tree, "operator looked", true)
        .expect("forced resolution");
    let row = rig.ledger.tree(rig.tree).expect("read").expect("row");
    assert!(row.has_survivors_left(), "{:?}", row.flags);
    let report = rig.teardown(Duration::ZERO).expect("settled");
    assert_eq!(
        report.state,
        TreeState::Resolved,
        "terminal states are final"
    );
    let kills = rig.kills();
    assert!(
        kills.iter().any(|k| k.hit.contains(&survivor)),
        "the survivor is killed: {kills:#?}"
    );
    assert_every_kill_authorized(&kills);
    let row = rig.ledger.tree(rig.tree).expect("read").expect("row");
    assert!(
        row.flags.iter().any(|f| f == "survivors_ended"),
        "{:?}",
        row.flags
    );
    assert!(!row.has_survivors_left());
}

#[test]
fn with_the_group_leader_recycled_an_escapee_is_still_killed_by_pidfd_and_the_stranger_never() {
    let mut escapee = (0, 0);
    let mut stranger_id = (0, 0);
    let rig = rig(Boundary::Session, false, |w, root, _| {
        let e = w.spawn(stubborn(root, root, None));
        w.setsid(e.0);
        escapee = e;
    });
    // The tree's first walk sees the escapee; then the root dies and its
    // pid (the recorded pgid and sid) goes to a stranger.
    {
        let mut w = rig.host.world();
        let root = rig.root.0;
        w.on(Call::SignalGroup, 1, move |w| {
            w.recycle(root).expect("the root's pid is free for reuse");
        });
    }
    let result = rig.teardown(Duration::ZERO);
    {
        let w = rig.host.world();
        if let Some(p) = w.procs.get(&rig.root.0) {
            stranger_id = (p.pid, p.start_ticks);
        }
    }
    assert_ne!(stranger_id, rig.root, "the pid was recycled");
    let sent = rig.host.sent();
    assert!(
        sent.iter().all(|s| !s.hit.contains(&stranger_id)),
        "the stranger holding the recycled pgid is never hit: {sent:#?}"
    );
    let kills: Vec<Sent> = rig
        .kills()
        .into_iter()
        .filter(|k| !k.hit.is_empty())
        .collect();
    assert_eq!(kills.len(), 1, "{kills:#?} ({result:?})");
    assert_eq!(kills[0].target, Target::Pid(escapee.0));
    assert_eq!(kills[0].hit, vec![escapee]);
    assert_every_kill_authorized(&kills);
    assert!(!rig.host.world().live().contains(&escapee.0));
}

#[test]
fn the_deferred_journal_is_replayed_before_the_resumed_teardown() {
    let rig = rig(Boundary::Session, false, |w, root, _| {
        w.procs.get_mut(&root).expect("root").ignores_term = true;
    });
    // First teardown: the ledger refuses everything; the trail goes to the
    // marker's journal.
    {
        let _held = rig.hold_write_lock();
        rig.teardown(Duration::ZERO).expect_err("ambiguous");
    }
    let marker = super::markers::read(rig.dir.path(), rig.tree).expect("marker");
    assert!(
        !marker.pending.is_empty(),
        "the refused trail is journalled"
    );
    assert!(!rig.kinds().iter().any(|k| k == "kill.skipped"));
    // Second teardown, with a writable ledger: the journal first, then the
    // authorized kill.
    let report = rig.teardown(Duration::ZERO).expect("settled");
    assert_eq!(report.state, TreeState::Ended);
    let kinds = rig.kinds();
    let skipped = kinds
        .iter()
        .position(|k| k == "kill.skipped")
        .expect("replayed");
    let authorized = kinds
        .iter()
        .position(|k| k == "kill.authorized")
        .expect("authorized");
    assert!(skipped < authorized, "{kinds:?}");
    assert_every_kill_authorized(&rig.host.sent());
    assert!(super::markers::read(rig.dir.path(), rig.tree).is_none());
}

#[test]
fn the_root_exit_status_is_recorded() {
    let rig = rig(Boundary::Session, true, |w, root, _| {
        w.procs.get_mut(&root).expect("root").ignores_term = true;
        w.spawn(stubborn(root, root, None));
        // The root exits on its own with status 3 during the grace.
        w.on(Call::Sleep, 1, move |w| w.exit(root, ExitStatus::Exited(3)));
    });
    let report = rig.teardown(Duration::from_millis(100)).expect("settled");
    assert_eq!(report.state, TreeState::Ended);
    let exit = rig.detail().tree.exit.expect("root status recorded");
    assert_eq!(exit.code, Some(3));
    assert_every_kill_authorized(&rig.host.sent());
}

#[test]
fn the_teardown_touches_no_real_process() {
    // Fake pids lie above any pid_max: whatever the teardown did, it went
    // through the host it was given.
    let rig = rig(Boundary::Session, false, |w, root, _| {
        w.procs.get_mut(&root).expect("root").ignores_term = true;
        w.spawn(stranger(0));
    });
    rig.teardown(Duration::ZERO).expect("settled");
    let sent = rig.host.sent();
    assert!(!sent.is_empty());
    assert!(sent.iter().all(|s| match s.target {
        Target::Group(p) | Target::Pid(p) => p >= PID_BASE,
        Target::Cgroup(_) => true,
    }));
    assert_eq!(rig.host.world().live().len(), 1, "the stranger lives");
}

#[test]
fn a_member_that_execs_during_the_grace_is_recorded_with_its_new_command() {
    let rig = rig(Boundary::Session, false, |w, root, _| {
        w.procs.get_mut(&root).expect("root").ignores_term = true;
        w.on(Call::Sleep, 1, move |w| w.exec(root, &["sleeper", "600"]));
    });
    rig.teardown(Duration::from_millis(100)).expect("settled");
    assert!(rig.kinds().iter().any(|k| k == "member.exec"));
    let survivors: Vec<String> = rig
        .detail()
        .observations
        .iter()
        .map(|o| format!("{o:?}"))
        .collect();
    assert!(
        survivors.iter().any(|o| o.contains("sleeper")),
        "the survivor snapshot names what it runs now: {survivors:?}"
    );
}

#[test]
fn a_child_forked_during_the_grace_is_killed_only_with_an_authorization_naming_it() {
    let rig = rig(Boundary::Session, false, |w, root, _| {
        w.procs.get_mut(&root).expect("root").ignores_term = true;
        w.on(Call::Sleep, 2, move |w| {
            w.fork(root).expect("the root runs");
        });
    });
    rig.teardown(Duration::from_millis(200)).expect("settled");
    {
        let w = rig.host.world();
        assert!(w.live().is_empty());
    }
    let kills = rig.kills();
    assert_every_kill_authorized(&kills);
    let hit: Vec<(i32, u64)> = kills.iter().flat_map(|k| k.hit.clone()).collect();
    assert_eq!(hit.len(), 2, "the root and its new child: {hit:?}");
    assert!(
        hit.iter().any(|h| h.0 > rig.root.0),
        "a pid after the root's"
    );
}

/// Random interleavings of host events and ledger refusals: whatever
/// happens, no SIGKILL reaches anything without a committed authorization
/// naming it, no process holding a recycled pid is ever signalled, and a
/// teardown that did not settle leaves dispatch closed.
mod interleavings {
    use super::*;
    use proptest::prelude::*;

    #[derive(Clone, Debug)]
    enum Act {
        Fork(usize),
        Exit(usize),
        Escape(usize),
        Exec(usize),
        Recycle(usize),
        Lock,
        Unlock,
    }

    #[derive(Clone, Debug)]
    struct Proc {
        ignores_term: bool,
        unkillable: bool,
        respawns: bool,
        escaped: bool,
    }

    fn call() -> impl Strategy<Value = Call> {
        prop_oneof![
            Just(Call::Snapshot),
            Just(Call::SnapshotPids),
            Just(Call::CgroupPids),
            Just(Call::SignalGroup),
            Just(Call::SignalProcess),
            Just(Call::CgroupFreeze),
            Just(Call::CgroupThaw),
            Just(Call::Sleep),
            Just(Call::KillAny),
        ]
    }

    fn act() -> impl Strategy<Value = Act> {
        prop_oneof![
            3 => (0usize..8).prop_map(Act::Fork),
            3 => (0usize..8).prop_map(Act::Exit),
            2 => (0usize..8).prop_map(Act::Escape),
            1 => (0usize..8).prop_map(Act::Exec),
            2 => (0usize..8).prop_map(Act::Recycle),
            1 => Just(Act::Lock),
            1 => Just(Act::Unlock),
        ]
    }

    fn proc_() -> impl Strategy<Value = Proc> {
        (
            any::<bool>(),
            prop::bool::weighted(0.1),
            prop::bool::weighted(0.15),
            prop::bool::weighted(0.3),
        )
            .prop_map(|(ignores_term, unkillable, respawns, escaped)| Proc {
                ignores_term,
                unkillable,
                respawns,
                escaped,
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
        #[test]
        fn no_sigkill_without_authority_and_no_stranger_signalled(
            cgroup in any::<bool>(),
            root_stubborn in any::<bool>(),
            procs in prop::collection::vec(proc_(), 0..4),
            script in prop::collection::vec((call(), 1usize..6, act()), 0..8),
            grace_ms in prop_oneof![Just(0u64), Just(30), Just(200)],
            rounds in 1u32..4,
            locked_from_start in prop::bool::weighted(0.15),
        ) {
            let boundary = if cgroup { Boundary::Cgroup } else { Boundary::Session };
            let lock: Arc<Mutex<Option<WriteLock>>> = Arc::new(Mutex::new(None));
            let strangers: Arc<Mutex<Vec<(i32, u64)>>> = Arc::new(Mutex::new(Vec::new()));
            let dir_slot: Arc<Mutex<Option<PathBuf>>> = Arc::new(Mutex::new(None));
            let rig = rig(boundary, true, |w, root, cg| {
                w.subreaper = Some(std::process::id() as i32);
                w.procs.get_mut(&root).expect("root").ignores_term = root_stubborn;
                for p in &procs {
                    let (pid, _) = w.spawn(FakeProc {
                        ignores_term: p.ignores_term,
                        unkillable: p.unkillable,
                        respawns: p.respawns,
                        ..member(0, root, root, cg)
                    });
                    if p.escaped {
                        w.setsid(pid);
                    }
                }
                for (c, nth, a) in script.clone() {
                    let lock = lock.clone();
                    let strangers = strangers.clone();
                    let dir_slot = dir_slot.clone();
                    w.on(c, nth, move |w| {
                        let live = w.live();
                        let pick = |i: usize| (!live.is_empty()).then(|| live[i % live.len()]);
                        match a {
                            Act::Fork(i) => {
                                if let Some(p) = pick(i) {
                                    let _ = w.fork(p);
                                }
                            }
                            Act::Exit(i) => {
                                if let Some(p) = pick(i) {
                                    w.exit(p, ExitStatus::Exited(1));
                                }
                            }
                            Act::Escape(i) => {
                                if let Some(p) = pick(i) {
                                    w.setsid(p);
                                }
                            }
                            Act::Exec(i) => {
                                if let Some(p) = pick(i) {
                                    w.exec(p, &["other", "--argv"]);
                                }
                            }
                            Act::Recycle(i) => {
                                if let Some(p) = pick(i)
                                    && let Some(s) = w.recycle(p)
                                {
                                    strangers.lock().expect("strangers").push(s);
                                }
                            }
                            Act::Lock => {
                                let path = dir_slot.lock().expect("dir").clone();
                                let mut slot = lock.lock().expect("lock slot");
                                if slot.is_none() && let Some(path) = path {
                                    *slot = Some(WriteLock::hold(&path));
                                }
                            }
                            Act::Unlock => {
                                lock.lock().expect("lock slot").take();
                            }
                        }
                    });
                }
            });
            *dir_slot.lock().expect("dir") = Some(rig.dir.path().join("ledger.db"));
            if locked_from_start {
                *lock.lock().expect("lock slot") = Some(rig.hold_write_lock());
            }
            let mut opts = TeardownOptions::new(Duration::from_millis(grace_ms), "prop", Origin::Run);
            opts.rounds = rounds;
            opts.verify_timeout = Duration::from_millis(100);
            let result = rig.teardown_with(opts);
            lock.lock().expect("lock slot").take();

            let sent = rig.host.sent();
            assert_every_kill_authorized(&sent);
            let strangers = strangers.lock().expect("strangers").clone();
            for s in &sent {
                for hit in &s.hit {
                    prop_assert!(!strangers.contains(hit), "stranger {hit:?} hit by {s:?}");
                }
            }
            match result {
                Ok(report) => prop_assert!(report.state.is_terminal(), "{report:?}"),
                Err(CustodyError::Ambiguous { .. }) => {
                    prop_assert!(rig.engine.gate().check_dispatch().is_err(), "ambiguous but dispatch open");
                }
                Err(e) => {
                    // A refused ledger may fail the final write of a settled
                    // tree; never anything else.
                    prop_assert!(matches!(e, CustodyError::Ledger(_)), "{e}");
                }
            }
        }
    }
}

#[test]
fn a_pid_recycled_between_cgroup_procs_and_its_stat_is_not_a_member() {
    // Found by the property: the targeted tick reads `cgroup.procs`, then
    // the stat of each pid. A member that dies in between and whose pid a
    // stranger outside the cgroup takes must not be classified by the
    // stale `cgroup.procs` (and then named by an authorization and killed).
    let mut member_id = (0, 0);
    let recycled: Arc<Mutex<Option<(i32, u64)>>> = Arc::new(Mutex::new(None));
    let slot = recycled.clone();
    let rig = rig(Boundary::Cgroup, false, |w, root, cg| {
        member_id = w.spawn(stubborn(root, root, cg));
        let pid = member_id.0;
        w.on(Call::SnapshotPids, 1, move |w| {
            *slot.lock().expect("slot") = w.recycle(pid);
        });
    });
    let report = rig.teardown(Duration::ZERO).expect("settled");
    assert_eq!(report.state, TreeState::Ended);
    let stranger = recycled.lock().expect("slot").expect("recycled");
    assert_eq!(
        rig.host
            .world()
            .procs
            .get(&stranger.0)
            .map(|p| (p.pid, p.start_ticks)),
        Some(stranger),
        "the stranger lives"
    );
    assert_ne!(stranger, member_id);
    for s in rig.host.sent() {
        assert!(!s.hit.contains(&stranger), "stranger hit: {s:?}");
    }
    for a in rig.detail().authorizations {
        for t in a.targets {
            assert!(
                !t.identities
                    .iter()
                    .any(|i| (i.pid, i.start_ticks) == stranger),
                "an authorization names the stranger: {t:?}"
            );
        }
    }
}

#[test]
fn a_tree_whose_members_all_exited_ends_as_ended_not_vanished() {
    let rig = rig(Boundary::Session, true, |w, root, _| {
        w.exit(root, ExitStatus::Exited(0));
    });
    let report = rig.teardown(Duration::from_secs(1)).expect("settled");
    assert_eq!(
        report.state,
        TreeState::Ended,
        "its leader was not recycled"
    );
    assert!(rig.host.sent().is_empty());
    assert_eq!(
        rig.detail().tree.exit.and_then(|e| e.code),
        Some(0),
        "the reaped status of the root"
    );
}

#[test]
fn a_trail_the_ledger_refused_mid_teardown_is_written_before_the_end() {
    let lock: Arc<Mutex<Option<WriteLock>>> = Arc::new(Mutex::new(None));
    let rig = rig(Boundary::Session, false, |w, root, _| {
        w.procs.get_mut(&root).expect("root").ignores_term = true;
        // The ledger takes writes again just before the freeze: the
        // authorization commits, and what was refused before must follow.
        let lock = lock.clone();
        w.on(Call::Sleep, 1, move |_| {
            lock.lock().expect("lock slot").take();
        });
    });
    *lock.lock().expect("lock slot") = Some(rig.hold_write_lock());
    let report = rig.teardown(Duration::from_millis(50)).expect("settled");
    assert_eq!(report.state, TreeState::Ended);
    assert!(
        report.evidence_skipped > 0,
        "degraded: writes were skipped, not retried"
    );
    assert_every_kill_authorized(&rig.host.sent());
    let detail = rig.detail();
    let terms = detail
        .signals
        .iter()
        .filter(|s| s.signal == "SIGTERM")
        .count();
    assert_eq!(terms, 1, "the refused SIGTERM row is written late");
    let terminating = rig
        .ledger
        .events(&EventFilter {
            tree: Some(rig.tree),
            ..EventFilter::default()
        })
        .expect("events")
        .into_iter()
        .any(|e| e.kind.as_str() == "tree.state" && e.data["to"] == "terminating");
    assert!(terminating, "the refused state change is written late");
}

/// The tree of a `run` whose root exited: this process spawned it and is
/// its subreaper (the root is its child; orphans come to it).
fn run_rig(boundary: Boundary, setup: impl FnOnce(&mut World, i32, i32, Option<&Path>)) -> Rig {
    let me = std::process::id() as i32;
    let rig = rig(boundary, true, |w, root, cg| {
        w.subreaper = Some(me);
        w.procs.get_mut(&root).expect("root").ppid = me;
        setup(w, me, root, cg);
        w.exit(root, ExitStatus::Exited(3));
    });
    rig.engine.reaped().note_spawned_here(rig.tree);
    rig
}

fn full_walks(rig: &Rig) -> usize {
    rig.host
        .world()
        .calls
        .get(&Call::Snapshot)
        .copied()
        .unwrap_or(0)
}

#[test]
fn a_run_tree_proven_empty_is_ended_without_a_walk_and_its_record_is_complete() {
    for boundary in [Boundary::Session, Boundary::Cgroup] {
        let rig = run_rig(boundary, |_, _, _, _| {});
        let opts = TeardownOptions::new(Duration::from_secs(5), "root exited", Origin::Run);
        let report = rig.teardown_with(opts).expect("settled");
        assert_eq!(report.state, TreeState::Ended);
        assert_eq!(report.members_at_start, 0);
        assert_eq!(
            full_walks(&rig),
            0,
            "no child, cgroup empty: no walk of /proc"
        );
        assert!(
            rig.host.sent().is_empty(),
            "nothing signalled: {:?}",
            rig.host.sent()
        );
        let detail = rig.detail();
        assert_eq!(detail.tree.state, TreeState::Ended);
        assert_eq!(
            detail.tree.exit.and_then(|e| e.code),
            Some(3),
            "the root's status, from the reaper"
        );
        let kinds = rig.kinds();
        assert!(kinds.iter().any(|k| k == "tree.spawned"), "{kinds:?}");
        assert_eq!(
            kinds.last().map(String::as_str),
            Some("tree.ended"),
            "{kinds:?}"
        );
        if let Some(dir) = &rig.cgroup {
            assert!(
                rig.host.world().removed.contains(dir),
                "its cgroup is removed"
            );
        }
    }
}

#[test]
fn an_orphan_of_the_tree_alive_under_the_subreaper_denies_the_proof() {
    // The root forked a child that left the session and group; the root
    // exited, so the child is this process's now. No proof: the walk finds
    // it by descent, and the teardown ends it.
    for boundary in [Boundary::Session, Boundary::Cgroup] {
        let rig = run_rig(boundary, |w, _, root, _| {
            let (child, _) = w.spawn(member(0, root, root, None));
            w.setsid(child);
        });
        let opts = TeardownOptions::new(Duration::ZERO, "root exited", Origin::Run);
        let report = rig.teardown_with(opts).expect("settled");
        assert!(full_walks(&rig) >= 1, "the tree is walked");
        assert_eq!(report.members_at_start, 1, "the orphan is found");
        assert_eq!(report.state, TreeState::Ended);
        assert!(rig.host.world().live().is_empty(), "and ended");
    }
}

/// A live tree this process spawned and reaps (a `run` killed at its
/// timeout): the root is this process's child, its members ignore SIGTERM.
fn killed_run_rig(boundary: Boundary, setup: impl FnOnce(&mut World, i32, i32)) -> Rig {
    let me = std::process::id() as i32;
    let rig = rig(boundary, true, |w, root, cg| {
        w.subreaper = Some(me);
        let r = w.procs.get_mut(&root).expect("root");
        r.ppid = me;
        r.ignores_term = true;
        w.spawn(stubborn(root, root, cg));
        w.spawn(stubborn(root, root, cg));
        setup(w, me, root);
    });
    rig.engine.reaped().note_spawned_here(rig.tree);
    rig
}

#[test]
fn a_killed_tree_the_reaper_emptied_is_verified_without_a_second_walk() {
    // After the SIGKILL, "no child of this subreaper and the
    // cgroup empty" proves the tree empty as at the start of a `run`
    // teardown: one walk (the first signal's), not two.
    for boundary in [Boundary::Session, Boundary::Cgroup] {
        let rig = killed_run_rig(boundary, |_, _, _| {});
        let opts = TeardownOptions::new(Duration::ZERO, "timeout", Origin::Run);
        let report = rig.teardown_with(opts).expect("settled");
        assert_eq!(report.state, TreeState::Ended, "{boundary:?}");
        assert_eq!(report.members_at_start, 3);
        assert_eq!(report.authorizations, 1);
        // (On the session boundary the frozen re-read is a walk too.)
        let before_kill = if boundary == Boundary::Session { 2 } else { 1 };
        assert_eq!(
            full_walks(&rig),
            before_kill,
            "{boundary:?}: no verifying walk"
        );
        assert!(
            rig.host.world().live().is_empty(),
            "{boundary:?}: all ended"
        );
        assert_every_kill_authorized(&rig.kills());
    }
}

#[test]
fn another_child_of_the_subreaper_sends_the_verify_to_the_walk() {
    // A child of this process that is no member (another tree's root in
    // the service; `run` adopts its children as members, so a kill): the
    // reaper's answer proves nothing, so the walk decides, and the stranger
    // is left alone.
    for boundary in [Boundary::Session, Boundary::Cgroup] {
        let mut other = (0, 0);
        let rig = killed_run_rig(boundary, |w, me, _| {
            other = w.spawn(FakeProc {
                ppid: me,
                ..stranger(0)
            });
        });
        let opts = TeardownOptions::new(Duration::ZERO, "kill", Origin::Kill);
        let report = rig.teardown_with(opts).expect("settled");
        assert_eq!(report.state, TreeState::Ended, "{boundary:?}");
        let with_verify = if boundary == Boundary::Session { 3 } else { 2 };
        assert_eq!(
            full_walks(&rig),
            with_verify,
            "{boundary:?}: the verify walked"
        );
        let live = rig.host.world().live();
        assert_eq!(live.len(), 1, "{boundary:?}: {live:?}");
        assert!(live.contains(&other.0), "{boundary:?}: the stranger lives");
    }
}

#[test]
fn a_process_moved_into_the_trees_cgroup_denies_the_proof() {
    // Not a descendant, so not this process's child: only the cgroup
    // shows it.
    let rig = run_rig(Boundary::Cgroup, |w, _, _, cg| {
        w.spawn(FakeProc {
            cgroup: cg.map(Path::to_path_buf),
            ..stranger(0)
        });
    });
    let opts = TeardownOptions::new(Duration::ZERO, "root exited", Origin::Run);
    let report = rig.teardown_with(opts).expect("settled");
    assert!(full_walks(&rig) >= 1, "the tree is walked");
    assert_eq!(
        report.members_at_start, 1,
        "the process in the cgroup is a member"
    );
    assert!(rig.host.world().live().is_empty(), "and ended");
}

/// A service out of descriptors reads nothing of a live tree, which must
/// not be recorded ended (nor signalled) on that. Every read failing
/// (EMFILE), the teardown decides nothing: no signal, no exit, no end; the
/// tree stays as the ledger had it and the caller is told to try again.
/// Once reads work again, the same tree is torn down with its authority.
#[test]
fn a_teardown_whose_reads_all_fail_decides_nothing_and_a_later_one_finishes() {
    for boundary in [Boundary::Session, Boundary::Cgroup] {
        let rig = rig(boundary, false, |w, root, cg| {
            w.procs.get_mut(&root).expect("root").ignores_term = true;
            w.spawn(stubborn(root, root, cg));
            w.unreadable = Some(std::collections::HashSet::new());
        });
        let err = rig
            .teardown(Duration::from_millis(100))
            .expect_err("no decision on incomplete evidence");
        assert!(
            matches!(err, CustodyError::Incomplete { tree, .. } if tree == rig.tree),
            "{err}"
        );
        assert!(
            rig.host.sent().is_empty(),
            "nothing signalled: {:?}",
            rig.host.sent()
        );
        assert_eq!(rig.host.world().live().len(), 2, "both members live on");
        let kinds = rig.kinds();
        assert!(
            !kinds.iter().any(
                |k| k == EventKind::MemberExited.as_str() || k == EventKind::TreeEnded.as_str()
            ),
            "nothing concluded: {kinds:?}"
        );
        assert!(!rig.detail().tree.state.is_terminal());

        rig.host.world().unreadable = None;
        let report = rig.teardown(Duration::from_millis(100)).expect("settled");
        assert_eq!(report.state, TreeState::Ended);
        assert_eq!(report.force_killed, 2);
        assert_every_kill_authorized(&rig.kills());
        assert!(rig.host.world().live().is_empty());
    }
}

/// Reads that start failing after the first signal (a burst of connections
/// took the descriptors) leave the members that were seen as they were
/// seen: they are signalled, authorized and killed by what was known, and
/// their exits are recorded only once a read shows them gone.
#[test]
fn reads_failing_mid_teardown_carry_the_members_and_record_exits_only_when_read() {
    let rig = rig(Boundary::Session, false, |w, root, _| {
        w.procs.get_mut(&root).expect("root").ignores_term = true;
        w.spawn(stubborn(root, root, None));
        // The first targeted re-read of the grace fails, and so does
        // everything after it until the tenth one.
        w.on(Call::SnapshotPids, 1, |w| {
            w.unreadable = Some(std::collections::HashSet::new());
        });
        w.on(Call::SnapshotPids, 10, |w| w.unreadable = None);
    });
    let report = rig.teardown(Duration::from_millis(50)).expect("settled");
    assert_eq!(report.state, TreeState::Ended);
    assert_eq!(report.force_killed, 2, "both, as last seen");
    assert_every_kill_authorized(&rig.kills());
    assert!(rig.host.world().live().is_empty());
    let exited = rig
        .ledger
        .events(&EventFilter {
            tree: Some(rig.tree),
            kind_prefix: Some(EventKind::MemberExited.as_str().into()),
            ..EventFilter::default()
        })
        .expect("events");
    let n: usize = exited
        .iter()
        .map(|e| e.data["exits"].as_array().map_or(1, Vec::len))
        .sum();
    assert_eq!(n, 2, "each exit once: {exited:?}");
}

/// A pid recycled within one clock tick, through the teardown: the escapee exits and
/// another user's process takes its pid within the same clock tick, after
/// the first signal. The newcomer is never signalled, and the
/// authorization does not name it.
#[test]
fn a_pid_recycled_within_the_tick_is_never_signalled_nor_authorized() {
    let mut esc = (0, 0);
    let rig = rig(Boundary::Session, false, |w, root, _| {
        w.procs.get_mut(&root).expect("root").ignores_term = true;
        let e = w.spawn(stubborn(root, root, None));
        w.setsid(e.0);
        esc = e;
        let pid = e.0;
        // Right after the first signal to the escapee (SIGTERM, through its
        // held handle), it exits and the newcomer takes the pid.
        w.on(Call::SignalProcess, 1, move |w| {
            w.recycle_same_tick(pid, 1000).expect("the pid is free");
        });
    });
    let report = rig.teardown(Duration::from_millis(50)).expect("settled");
    assert_eq!(report.state, TreeState::Ended);
    let w = rig.host.world();
    let newcomer = w.procs.get(&esc.0).expect("the newcomer lives");
    assert_eq!((newcomer.start_ticks, newcomer.uid), (esc.1, 1000));
    assert!(newcomer.state != 'Z');
    drop(w);
    let sent = rig.host.sent();
    let hit_newcomer = sent
        .iter()
        .filter(|s| s.target == Target::Pid(esc.0))
        .filter(|s| s.outcome == "sent" && s.sig != Sig::Term)
        .count();
    assert_eq!(
        hit_newcomer, 0,
        "nothing but the first SIGTERM (before the reuse) went to that pid: {sent:?}"
    );
    for a in rig.detail().authorizations {
        assert!(
            !a.targets
                .iter()
                .any(|t| t.identities.iter().any(|id| id.pid == esc.0)),
            "the authorization names the newcomer: {a:?}"
        );
    }
    assert_every_kill_authorized(&sent);
}

// The survivors of a whole-file mutation run of teardown.rs, each
// a test that fails on its mutant (applied by hand once; docs/TESTING.md).

/// The teardown lease (mutant: `Lease::take*` -> `Ok(None)`, two
/// teardowns of one tree at once): while one holder has it, a taker that
/// will not wait is refused and one that waits gets it only after the
/// holder lets go.
#[test]
fn the_teardown_lease_is_one_holder_at_a_time() {
    let rig = rig(Boundary::Session, false, |_, _, _| {});
    let held = super::teardown::Lease::take_within(rig.engine.data_dir(), rig.tree, Duration::ZERO)
        .expect("taken")
        .expect("a lease");
    match super::teardown::Lease::take_within(rig.engine.data_dir(), rig.tree, Duration::ZERO) {
        Err(CustodyError::Conflict(why)) => assert!(why.contains("being torn down"), "{why}"),
        other => panic!(
            "a second lease while one is held: {:?}",
            other.map(|l| l.is_some())
        ),
    }
    std::thread::scope(|s| {
        let waiter = s.spawn(|| {
            let lease = super::teardown::Lease::take(rig.engine.data_dir(), rig.tree);
            (std::time::Instant::now(), lease)
        });
        let let_go = std::time::Instant::now();
        drop(held);
        let (got_at, lease) = waiter.join().expect("waiter");
        assert!(
            matches!(lease, Ok(Some(_))),
            "the waiter gets the lease once it is free"
        );
        assert!(got_at >= let_go, "not before the holder let go");
    });
}

/// `refusal_event` (mutant: `()`): a group that is not provably the
/// recorded one is refused, and the refusal is evidence: `kill.skipped`
/// for a kill, `sweep.refused` for a sweep, each with the reason.
#[test]
fn a_refused_group_is_recorded_as_kill_skipped_or_sweep_refused() {
    for (origin, kind) in [
        (Origin::Kill, EventKind::KillSkipped),
        (Origin::Sweep, EventKind::SweepRefused),
    ] {
        let rig = rig(Boundary::Session, false, |w, root, _| {
            w.procs.get_mut(&root).expect("root").ignores_term = true;
            w.spawn(FakeProc {
                sid: root + 500,
                ..stubborn(root, root, None)
            });
        });
        let report = rig
            .teardown_with(TeardownOptions::new(Duration::ZERO, "test", origin))
            .expect("refused, closed");
        assert_eq!(report.state, TreeState::Vanished);
        let reasons: Vec<String> =
            rig.detail()
                .events
                .iter()
                .filter(|e| e.kind == kind)
                .filter_map(|e| match e.event() {
                    crate::ledger::Event::KillSkipped(r)
                    | crate::ledger::Event::SweepRefused(r) => Some(r.reason),
                    _ => None,
                })
                .collect();
        assert!(
            !reasons.is_empty() && reasons.iter().all(|r| !r.is_empty()),
            "[{origin:?}] no {kind} with a reason: {:?}",
            rig.kinds()
        );
    }
}

/// `record_final_exits` (mutant: `()`) and `finish`'s CPU time (mutant:
/// the reaped CPU dropped): a `run` tree proven empty records every member
/// exited, the root with the status and CPU time its reaper collected, and
/// the tree's resources (no cgroup) carry that CPU time.
#[test]
fn a_proven_empty_tree_records_every_member_exited_and_the_reaped_cpu() {
    let rig = run_rig(Boundary::Session, |w, _, root, _| {
        w.cpu_usec.insert(root, 1_234);
    });
    // A scan saw the root while it ran.
    rig.sighted(rig.root, std::process::id() as i32);
    let opts = TeardownOptions::new(Duration::from_secs(5), "root exited", Origin::Run);
    let report = rig.teardown_with(opts).expect("settled");
    assert_eq!(report.state, TreeState::Ended);
    assert_eq!(
        report.resources.and_then(|r| r.cpu_usec),
        Some(1_234),
        "{report:?}"
    );
    let detail = rig.detail();
    for m in &detail.members {
        assert!(
            m.exited_at.is_some(),
            "member {} not recorded exited",
            m.pid
        );
    }
    let root = detail
        .members
        .iter()
        .find(|m| m.pid == rig.root.0)
        .expect("root member");
    assert_eq!(root.exit.and_then(|e| e.code), Some(3));
    let ended = detail
        .events
        .iter()
        .find_map(|e| match e.event() {
            crate::ledger::Event::TreeEnded(t) => Some(t),
            _ => None,
        })
        .expect("tree.ended");
    assert_eq!(ended.resources.and_then(|r| r.cpu_usec), Some(1_234));
}

/// `flush_journal` (mutant: `()`): the ledger refused the teardown's first
/// writes (the SIGTERM row, `terminating`) and took writes again during
/// the grace; the tree emptied without a kill, so no authorization carried
/// the journal: the end writes it, before `tree.ended`.
#[test]
fn a_trail_the_ledger_refused_is_written_at_the_end_of_a_teardown_without_a_kill() {
    let lock: Arc<Mutex<Option<WriteLock>>> = Arc::new(Mutex::new(None));
    let rig = rig(Boundary::Session, false, |w, root, _| {
        w.procs.get_mut(&root).expect("root").ignores_term = true;
        let lock = lock.clone();
        w.on(Call::Sleep, 1, move |_| {
            lock.lock().expect("lock slot").take();
        });
        w.on(Call::Sleep, 2, move |w| w.exit(root, ExitStatus::Exited(0)));
    });
    *lock.lock().expect("lock slot") = Some(rig.hold_write_lock());
    let report = rig.teardown(Duration::from_secs(5)).expect("settled");
    assert_eq!(report.state, TreeState::Ended);
    assert_eq!(report.authorizations, 0, "it emptied in the grace");
    assert!(report.evidence_skipped > 0, "writes were refused at first");
    let detail = rig.detail();
    assert_eq!(
        detail
            .signals
            .iter()
            .filter(|s| s.signal == "SIGTERM")
            .count(),
        1,
        "the refused SIGTERM row is written at the end"
    );
    let kinds = rig.kinds();
    let term = kinds
        .iter()
        .position(|k| k == "tree.state")
        .expect("the refused state change is written at the end");
    let end = kinds.iter().position(|k| k == "tree.ended").expect("ended");
    assert!(term < end, "{kinds:?}");
}

/// `collect_exits` (mutant: `()`): a member of a `run` tree that exited as
/// an orphan of this process (its status among the reaper's unclaimed
/// ones) and that no scan saw go is recorded at the end with that status.
#[test]
fn an_orphans_status_the_reaper_holds_is_recorded_at_the_end() {
    let mut orphan = (0, 0);
    let rig = run_rig(Boundary::Session, |w, _, root, _| {
        orphan = w.spawn(member(0, root, root, None));
        w.exit(orphan.0, ExitStatus::Exited(5));
    });
    rig.sighted(orphan, rig.root.0);
    let opts = TeardownOptions::new(Duration::from_secs(5), "root exited", Origin::Run);
    let report = rig.teardown_with(opts).expect("settled");
    assert_eq!(report.state, TreeState::Ended);
    let detail = rig.detail();
    let m = detail
        .members
        .iter()
        .find(|m| m.pid == orphan.0)
        .expect("the orphan is a member");
    assert!(m.exited_at.is_some());
    assert_eq!(m.exit.and_then(|e| e.code), Some(5), "{m:?}");
}

/// `flush_deferred_exits` (mutant: the body replaced by an empty map): a
/// killed member of a `run` tree whose status reaches the reaper only after
/// it left `/proc` (an orphan reaped late) is recorded with that status,
/// which only the deferred exits' wait for orphans collects.
#[test]
fn a_killed_orphans_late_status_is_recorded_with_its_exit() {
    let mut slow = (0, 0);
    let rig = run_rig(Boundary::Session, |w, me, _, _| {
        slow = w.spawn(FakeProc {
            unkillable: true,
            ..stubborn(me, PID_BASE, None)
        });
        let pid = slow.0;
        w.on(Call::Sleep, 3, move |w| {
            w.exit_reaped_late(pid, ExitStatus::Signaled(9))
        });
    });
    let opts = TeardownOptions::new(Duration::ZERO, "root exited", Origin::Run);
    let report = rig.teardown_with(opts).expect("settled");
    assert_eq!(report.state, TreeState::Ended);
    assert_eq!(report.authorizations, 1);
    let detail = rig.detail();
    let m = detail
        .members
        .iter()
        .find(|m| m.pid == slow.0)
        .expect("the killed member");
    assert_eq!(m.exit.and_then(|e| e.signal), Some(9), "{m:?}");
}

thread_local! {
    /// What the capturing subscriber wrote on this thread while
    /// [`warnings_of`] ran here (`None`: not capturing).
    static CAPTURED: std::cell::RefCell<Option<Vec<u8>>> = const { std::cell::RefCell::new(None) };
}

/// The capturing subscriber's writer: into this thread's [`CAPTURED`].
struct ThreadSink;

impl std::io::Write for ThreadSink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        CAPTURED.with(|c| {
            if let Some(v) = c.borrow_mut().as_mut() {
                v.extend_from_slice(buf);
            }
        });
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Runs `f` with warnings (and the operator's info lines) logged into a
/// sink of this thread; returns the log. One global subscriber for the test
/// binary (set once), writing per thread: a thread-local `with_default`
/// lost lines when another test's thread had cached a callsite's interest
/// as "never" (callsites are global), in full runs only. The sweep's tests
/// (`sweep_tests`) read their info line through it too.
pub(super) fn warnings_of(f: impl FnOnce()) -> String {
    static INIT: std::sync::Once = std::sync::Once::new();
    INIT.call_once(|| {
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::INFO)
            .with_ansi(false)
            .with_writer(|| ThreadSink)
            .finish();
        let _ = tracing::subscriber::set_global_default(subscriber);
    });
    CAPTURED.with(|c| *c.borrow_mut() = Some(Vec::new()));
    f();
    let bytes = CAPTURED.with(|c| c.borrow_mut().take()).unwrap_or_default();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// `log_skipped`'s comparison (mutants: `>` -> `>=`, `<`, `==`): an operator
/// is told once when a teardown skipped evidence writes, and never when it
/// skipped none.
#[test]
fn skipped_evidence_is_logged_once_and_only_when_there_was_some() {
    const LINE: &str = "evidence writes skipped in this teardown";
    let clean = rig(Boundary::Session, false, |_, _, _| {});
    let log = warnings_of(|| {
        clean.teardown(Duration::from_millis(50)).expect("settled");
    });
    assert!(!log.contains(LINE), "a clean teardown: {log}");

    let lock: Arc<Mutex<Option<WriteLock>>> = Arc::new(Mutex::new(None));
    let degraded = rig(Boundary::Session, false, |w, root, _| {
        w.procs.get_mut(&root).expect("root").ignores_term = true;
        let lock = lock.clone();
        w.on(Call::Sleep, 1, move |_| {
            lock.lock().expect("lock slot").take();
        });
    });
    *lock.lock().expect("lock slot") = Some(degraded.hold_write_lock());
    let mut report = None;
    let log = warnings_of(|| {
        report = Some(
            degraded
                .teardown(Duration::from_millis(50))
                .expect("settled"),
        );
    });
    assert!(report.expect("ran").evidence_skipped > 0);
    assert_eq!(log.matches(LINE).count(), 1, "{log}");
}

/// The operator's one line per teardown (mutants: `teardown`'s
/// `r.already_settled` guard -> true, false): a teardown that ends the tree
/// logs "teardown done" once; a second teardown of the ended tree (another
/// ended it first) logs no such line.
#[test]
fn a_teardown_logs_done_once_and_an_already_settled_one_does_not() {
    const LINE: &str = "teardown done";
    let rig = rig(Boundary::Session, false, |_, _, _| {});
    let mut first = None;
    let log = warnings_of(|| first = Some(rig.teardown(Duration::ZERO).expect("settled")));
    let first = first.expect("ran");
    assert!(!first.already_settled);
    assert_eq!(log.matches(LINE).count(), 1, "{log}");
    let mut second = None;
    let log = warnings_of(|| second = Some(rig.teardown(Duration::ZERO).expect("settled")));
    assert!(second.expect("ran").already_settled);
    assert!(!log.contains(LINE), "{log}");
}

/// A taker waits for the holder (mutants: the lease's deadline `now + wait`
/// -> `now - wait`, which gives up at the first try; `!logged` deleted, its
/// waiting line never written): while the holder
/// keeps the lease, the waiter is still waiting; once it lets go, the
/// waiter has it.
#[test]
fn a_teardown_lease_taker_waits_for_the_holder_within_its_wait() {
    let rig = rig(Boundary::Session, false, |_, _, _| {});
    let held = super::teardown::Lease::take_within(rig.engine.data_dir(), rig.tree, Duration::ZERO)
        .expect("taken")
        .expect("a lease");
    std::thread::scope(|s| {
        let (started_tx, started_rx) = std::sync::mpsc::channel();
        let waiter = s.spawn(move || {
            started_tx.send(()).expect("main listens");
            let mut got = None;
            let before = std::time::Instant::now();
            let log = warnings_of(|| {
                got = Some(
                    super::teardown::Lease::take_within(
                        rig.engine.data_dir(),
                        rig.tree,
                        Duration::from_secs(30),
                    )
                    .map(|l| l.is_some()),
                );
            });
            (got.expect("ran"), log, before)
        });
        started_rx.recv().expect("the waiter started");
        // A window in which a taker that gives up at once has given up.
        let window = std::time::Instant::now() + Duration::from_millis(300);
        while std::time::Instant::now() < window {
            assert!(
                !waiter.is_finished(),
                "the waiter gave up while the holder held the lease"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let let_go = std::time::Instant::now();
        drop(held);
        let (got, log, before) = waiter.join().expect("waiter");
        match got {
            Ok(true) => {}
            other => panic!("the waiter gets the lease once it is free: {other:?}"),
        }
        // One line however many 20 ms tries it took (mutant: `!logged`
        // deleted: no line at all). A waiter that began its wait well before
        // the holder let go tried while it was held.
        let waited = log.matches("waiting for its lease").count();
        if before + Duration::from_millis(100) < let_go {
            assert_eq!(waited, 1, "{log}");
        } else {
            assert!(waited <= 1, "{log}");
        }
    });
}

/// `full_walk`'s bound of `INCOMPLETE_TRIES` walks (mutants: `tries >=
/// INCOMPLETE_TRIES` -> `<`, which gives up after the first incomplete walk,
/// and -> `>`, one walk more): a walk whose reads failed is tried again, so
/// four failed walks and a fifth that reads are a teardown that settles;
/// reads that keep failing stop it after exactly five walks.
#[test]
fn an_incomplete_walk_is_tried_again_up_to_five_times() {
    const INCOMPLETE_TRIES: usize = 5;
    // The first four walks fail; the fifth reads.
    let read = rig(Boundary::Session, false, |w, root, _| {
        w.spawn(member(0, root, root, None));
        w.unreadable = Some(std::collections::HashSet::new());
        w.on(Call::Snapshot, INCOMPLETE_TRIES, |w| w.unreadable = None);
    });
    let report = read.teardown(Duration::from_millis(100)).expect("settled");
    assert_eq!(report.state, TreeState::Ended);
    assert_eq!(report.members_at_start, 2, "the fifth walk found both");
    assert!(read.host.world().live().is_empty());

    // Every walk fails: exactly five, then undecided.
    let failing = rig(Boundary::Session, false, |w, root, _| {
        w.spawn(member(0, root, root, None));
        w.unreadable = Some(std::collections::HashSet::new());
    });
    let err = failing
        .teardown(Duration::from_millis(100))
        .expect_err("no decision on incomplete evidence");
    assert!(matches!(err, CustodyError::Incomplete { .. }), "{err}");
    assert_eq!(full_walks(&failing), INCOMPLETE_TRIES, "walks tried");
}

/// The verify asks the reaper again after one pause when a child is left
/// (mutants in `proven_empty_after`: the retry guard `i + 1 < tries` ->
/// `false`, `==`, `>`, which give up at the first answer; -> `true`, `<=`,
/// `i * 1`, one pause more; `i - 1`): a zombie child of this process that
/// is reaped during the pause does not send the verify to a walk; one that
/// stays costs exactly one pause (none at the first signal's proof), then
/// the walk decides.
#[test]
fn the_verify_asks_the_reaper_again_after_one_pause() {
    fn zombie(me: i32) -> FakeProc {
        FakeProc {
            ppid: me,
            state: 'Z',
            ..stranger(0)
        }
    }
    for boundary in [Boundary::Session, Boundary::Cgroup] {
        // A zombie child appears as the verify re-reads the killed members
        // and is reaped at the next pause.
        let rig = killed_run_rig(boundary, |w, me, _| {
            w.on(Call::KillAny, 1, move |w| {
                let next = w.calls.get(&Call::SnapshotPids).copied().unwrap_or(0) + 1;
                w.on(Call::SnapshotPids, next, move |w| {
                    let (z, _) = w.spawn(zombie(me));
                    let pause = w.calls.get(&Call::Sleep).copied().unwrap_or(0) + 1;
                    w.on(Call::Sleep, pause, move |w| {
                        w.procs.remove(&z);
                    });
                });
            });
        });
        let opts = TeardownOptions::new(Duration::ZERO, "kill", Origin::Kill);
        let report = rig.teardown_with(opts).expect("settled");
        assert_eq!(report.state, TreeState::Ended, "{boundary:?}");
        let before_kill = if boundary == Boundary::Session { 2 } else { 1 };
        assert_eq!(
            full_walks(&rig),
            before_kill,
            "{boundary:?}: the second answer proved it empty, no verifying walk"
        );
    }

    // A zombie child that stays: one pause in the verify, none at the
    // first signal's proof, and the walk decides.
    let rig = killed_run_rig(Boundary::Session, |w, me, _| {
        w.spawn(zombie(me));
    });
    let opts = TeardownOptions::new(Duration::ZERO, "kill", Origin::Kill);
    let report = rig.teardown_with(opts).expect("settled");
    assert_eq!(report.state, TreeState::Ended);
    assert_eq!(full_walks(&rig), 3, "the verify walked");
    let sleeps = rig.host.world().calls.get(&Call::Sleep).copied();
    assert_eq!(sleeps, Some(1), "one pause for the reaper");
}

/// A refused write of the trail keeps the time it happened (mutants: the
/// teardown's `now` -> `""`, `"xyzzy"`): the late `tree.state terminating`
/// carries it as `deferred_from`, an RFC 3339 time within the teardown and
/// no later than the event's own.
#[test]
fn a_trail_write_written_late_keeps_the_time_it_happened() {
    let lock: Arc<Mutex<Option<WriteLock>>> = Arc::new(Mutex::new(None));
    let rig = rig(Boundary::Session, false, |w, root, _| {
        w.procs.get_mut(&root).expect("root").ignores_term = true;
        let lock = lock.clone();
        w.on(Call::Sleep, 1, move |_| {
            lock.lock().expect("lock slot").take();
        });
    });
    *lock.lock().expect("lock slot") = Some(rig.hold_write_lock());
    let before = std::time::SystemTime::now() - Duration::from_secs(1);
    rig.teardown(Duration::from_millis(50)).expect("settled");
    let after = std::time::SystemTime::now() + Duration::from_secs(1);
    let late = rig
        .ledger
        .events(&EventFilter {
            tree: Some(rig.tree),
            ..EventFilter::default()
        })
        .expect("events")
        .into_iter()
        .find(|e| e.kind.as_str() == "tree.state" && e.data["to"] == "terminating")
        .expect("the refused state change is written late");
    let from = late.data["deferred_from"]
        .as_str()
        .unwrap_or_else(|| panic!("a late write says when it happened: {:?}", late.data));
    let at =
        |s: &str| humantime::parse_rfc3339(s).unwrap_or_else(|e| panic!("{s:?} is no time: {e}"));
    let (from, written) = (at(from), at(&late.at));
    assert!(
        before <= from && from <= after,
        "{from:?} within the teardown"
    );
    assert!(from <= written, "it happened before it was written");
}

/// The reaper's status kept by pid for a child this process spawned is the
/// root's only in a tree this process spawned (mutant: `flush_deferred_exits`'
/// `is_root && was_spawned_here` -> `||`): in a tree spawned elsewhere, the
/// killed root's exit is recorded without the status the reaper holds for
/// its pid (another child of this process may have had that pid).
#[test]
fn a_killed_roots_exit_takes_the_reapers_child_status_only_in_a_tree_spawned_here() {
    for spawned_here in [false, true] {
        let rig = rig(Boundary::Session, true, |w, root, _| {
            w.procs.get_mut(&root).expect("root").ignores_term = true;
            w.own_child(root);
        });
        if spawned_here {
            rig.engine.reaped().note_spawned_here(rig.tree);
        }
        let report = rig.teardown(Duration::ZERO).expect("settled");
        assert_eq!(report.state, TreeState::Ended);
        assert_eq!(report.authorizations, 1);
        let detail = rig.detail();
        let root = detail
            .members
            .iter()
            .find(|m| m.pid == rig.root.0)
            .expect("the root is a member");
        assert!(root.exited_at.is_some(), "{root:?}");
        let signal = root.exit.and_then(|e| e.signal);
        if spawned_here {
            assert_eq!(signal, Some(9), "{root:?}");
        } else {
            assert_eq!(signal, None, "{root:?}");
        }
    }
}

/// No lock file outlives its teardown (mutant: `Lease::drop` -> `()`): the
/// lease's file is at `<data-dir>/teardown/tree-<id>.lock` while it is held
/// and gone once it is dropped, and after a whole teardown.
#[test]
fn the_teardown_lease_file_lives_only_as_long_as_its_lease() {
    let rig = rig(Boundary::Session, false, |_, _, _| {});
    let path = rig
        .dir
        .path()
        .join("teardown")
        .join(format!("tree-{}.lock", rig.tree.0));
    let lease =
        super::teardown::Lease::take_within(rig.engine.data_dir(), rig.tree, Duration::ZERO)
            .expect("taken")
            .expect("a lease");
    assert!(path.exists(), "{} while held", path.display());
    drop(lease);
    assert!(!path.exists(), "{} after the lease", path.display());
    rig.teardown(Duration::ZERO).expect("settled");
    assert!(!path.exists(), "{} after a teardown", path.display());
}

/// A lease whose file is already gone says nothing when it drops; one whose
/// file cannot be removed says so (mutant: `Lease::drop`'s `!= NotFound` ->
/// `==`).
#[test]
fn a_lease_file_not_removed_is_logged_and_one_already_gone_is_not() {
    const LINE: &str = "teardown lease file not removed";
    let rig = rig(Boundary::Session, false, |_, _, _| {});
    let path = rig
        .dir
        .path()
        .join("teardown")
        .join(format!("tree-{}.lock", rig.tree.0));
    let take = || {
        super::teardown::Lease::take_within(rig.engine.data_dir(), rig.tree, Duration::ZERO)
            .expect("taken")
            .expect("a lease")
    };
    let lease = take();
    std::fs::remove_file(&path).expect("removed under the lease");
    let log = warnings_of(|| drop(lease));
    assert!(!log.contains(LINE), "{log}");
    // The path is a directory now: `remove_file` fails.
    let lease = take();
    std::fs::remove_file(&path).expect("removed under the lease");
    std::fs::create_dir(&path).expect("a directory in its place");
    let log = warnings_of(|| drop(lease));
    assert_eq!(log.matches(LINE).count(), 1, "{log}");
}

/// A cgroup tree with a member there by its cgroup alone (pid
/// `PID_BASE + 50`: a session of its own, child of init), watched afresh.
fn cgroup_only_member(script: impl FnOnce(&mut World, i32) + 'static) -> (Rig, i32) {
    let m = PID_BASE + 50;
    let rig = rig(Boundary::Cgroup, false, move |w, _, cg| {
        w.spawn(member(m, 1, m, cg));
        script(w, m);
    });
    (rig, m)
}

/// A targeted tick's members and how many `cgroup.procs` reads it took.
fn targeted_tick(rig: &Rig) -> (Vec<i32>, usize) {
    let (row, members) = rig
        .ledger
        .tree_members(rig.tree)
        .expect("readable")
        .expect("recorded");
    let mut watch = super::TreeWatch::new_on(rig.engine.host(), &row, &members, &HashSet::new())
        .expect("a watch");
    let reads = |rig: &Rig| {
        let w = rig.host.world();
        w.calls.get(&Call::CgroupPids).copied().unwrap_or(0)
    };
    let before = reads(rig);
    let report = watch.tick_targeted(&rig.engine, &HashMap::new());
    let mut pids: Vec<i32> = report.members.iter().map(|m| m.entry.pid).collect();
    pids.sort_unstable();
    (pids, reads(rig) - before)
}

#[test]
fn a_cgroup_listing_is_confirmed_by_start_times_without_a_second_read() {
    let (rig, m) = cgroup_only_member(|_, _| {});
    let (members, reads) = targeted_tick(&rig);
    assert_eq!(members, [rig.root.0, m]);
    // Every listed process started before the listing: it held its pid
    // through it, so it is the process listed.
    assert_eq!(reads, 1);
}

#[test]
fn a_listed_pid_taken_by_a_stranger_before_its_stat_read_is_not_a_member() {
    // Between the listing and the stat reads the member exits and a
    // stranger outside the cgroup (a session of its own) takes its pid.
    let (rig, m) = cgroup_only_member(|w, _| {
        w.on(Call::SnapshotPids, 1, move |w| {
            w.recycle(PID_BASE + 50).expect("recycled");
        });
    });
    let (members, reads) = targeted_tick(&rig);
    assert!(
        !members.contains(&m),
        "the stranger taken for a member: {members:?}"
    );
    assert_eq!(members, [rig.root.0]);
    // It started after the listing: the listing is read again to tell.
    assert_eq!(reads, 2);
    let w = rig.host.world();
    assert_eq!(w.procs[&m].comm, "stranger", "the pid was recycled");
}

/// Past the tree's cap on held handles, loose members are
/// kept unheld (by identity and the uid they were recorded with). The
/// teardown still ends every one of them, each signalled through a handle
/// taken at the signal and checked against that uid; an unheld escapee
/// whose identity another user's process took within the clock tick is
/// never signalled nor authorized. The tree is flagged once, and every
/// place in the budget is given back when the teardown's watch goes.
#[test]
fn loose_members_past_the_hold_cap_are_ended_through_handles_taken_at_the_signal() {
    let mut escs = Vec::new();
    let rig = rig(Boundary::Session, false, |w, root, _| {
        w.procs.get_mut(&root).expect("root").ignores_term = true;
        for _ in 0..5 {
            let e = w.spawn(stubborn(root, root, None));
            w.setsid(e.0);
            escs.push(e);
        }
        // Once the first tick vetted them (two held, three not), the last
        // unheld one exits and a stranger takes its identity.
        let last = escs[4].0;
        w.on(Call::SignalGroup, 1, move |w| {
            w.recycle_same_tick(last, 1000).expect("the pid is free");
        });
    });
    rig.engine.set_hold_caps(super::HoldCaps {
        per_tree: 2,
        ..super::HoldCaps::default()
    });
    let report = rig.teardown(Duration::from_millis(50)).expect("settled");
    assert_eq!(report.state, TreeState::Ended);
    let w = rig.host.world();
    for e in &escs[..4] {
        assert!(
            w.procs
                .get(&e.0)
                .is_none_or(|p| matches!(p.state, 'Z' | 'X')),
            "escapee {e:?} outlived the teardown"
        );
    }
    let stranger = w.procs.get(&escs[4].0).expect("the stranger lives");
    assert_eq!((stranger.start_ticks, stranger.uid), (escs[4].1, 1000));
    assert!(!matches!(stranger.state, 'Z' | 'X'));
    drop(w);
    let sent = rig.host.sent();
    for e in &escs[..4] {
        assert!(
            sent.iter().any(|s| s.sig == Sig::Kill && s.hit.contains(e)),
            "{e:?} not killed by itself: {sent:?}"
        );
    }
    assert!(
        !sent
            .iter()
            .any(|s| s.target == Target::Pid(escs[4].0) && !s.hit.is_empty()),
        "the stranger was signalled: {sent:?}"
    );
    for a in rig.detail().authorizations {
        assert!(
            !a.targets
                .iter()
                .any(|t| t.identities.iter().any(|id| id.pid == escs[4].0)),
            "the authorization names the stranger: {a:?}"
        );
    }
    assert_every_kill_authorized(&sent);
    let capped: Vec<_> = rig
        .ledger
        .events(&EventFilter {
            tree: Some(rig.tree),
            kind_prefix: Some(EventKind::TreeHoldsCapped.as_str().into()),
            ..EventFilter::default()
        })
        .expect("events");
    assert_eq!(capped.len(), 1, "flagged once: {capped:?}");
    assert_eq!(
        capped[0].data,
        serde_json::json!({"cap": "tree", "limit": 2, "held": 2})
    );
    assert!(rig.detail().tree.flags.iter().any(|f| f == "holds_capped"));
    assert_eq!(rig.engine.holds().held(), 0, "every place given back");
    assert!(rig.engine.holds().refused(super::HoldCap::Tree) >= 3);
}
