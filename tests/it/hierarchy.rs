//! The hierarchy (`show --tree`, the tree page) from a real ledger with
//! synthetic rows: a chain deeper than any stack would take drawn without
//! recursion and capped, twenty thousand members in linear time, and the
//! force-killed mark only where the record shows a forced signal reaching
//! the member. (The real-process shape is fidelity's
//! `show_tree_is_the_hierarchy_the_workload_printed`; the real kill marks,
//! fidelity's `show_tree_marks_force_killed_only_what_the_kill_reached`.)

use std::time::{Duration, Instant, SystemTime};

use treewarden::ledger::hierarchy::{self, MAX_DEPTH, ProcessNode};
use treewarden::ledger::{
    ExitRecord, IdentityRecord, KillTarget, Ledger, LedgerOptions, MemberRecord, NewTree,
    OwnerKind, OwnerRecord, SignalRecord, SpawnRecord, TreeDetail, TreeId,
};

use crate::util;

fn ident(pid: i32) -> IdentityRecord {
    IdentityRecord {
        pid,
        start_ticks: 10_000 + pid as u64,
        boot_id: "b0a7-1d".into(),
    }
}

fn member(pid: i32, ppid: i32, pgid: i32) -> MemberRecord {
    MemberRecord {
        identity: ident(pid),
        ppid,
        pgid,
        sid: pgid,
        cgroup: None,
        uid: Some(1000),
        exe: Some("/bin/sh".into()),
        cmdline: vec!["sh".into(), format!("member-{pid}")],
        cwd: Some("/tmp".into()),
    }
}

/// A ledger with one spawned tree whose root is pid `root`.
fn tree_with_root(root: i32) -> (tempfile::TempDir, Ledger, TreeId) {
    let dir = tempfile::tempdir().expect("temp dir");
    let ledger =
        Ledger::open(&dir.path().join("ledger.db"), LedgerOptions::default()).expect("ledger");
    let owner = ledger
        .register_owner(&OwnerRecord {
            identity: ident(1),
            kind: OwnerKind::Run,
        })
        .expect("owner");
    let tree = ledger
        .create_tree(&NewTree {
            label: None,
            boundary: treewarden::proc::BoundaryKind::Session,
            owner,
            argv: vec!["sh".into(), "-c".into(), "chain".into()],
            cwd: Some("/tmp".into()),
            grace_ms: None,
            timeout_ms: None,
            limits: Default::default(),
            first_signal: None,
        })
        .expect("create");
    ledger
        .tree_spawned(
            tree,
            &SpawnRecord {
                root: ident(root),
                pgid: root,
                sid: root,
                cgroup: None,
            },
        )
        .expect("spawned");
    (dir, ledger, tree)
}

fn detail(ledger: &Ledger, tree: TreeId) -> TreeDetail {
    ledger.tree_detail(tree).expect("read").expect("the tree")
}

/// Nodes in the forest, and its deepest nesting (iteratively).
fn shape(forest: &[ProcessNode]) -> (usize, usize) {
    let (mut count, mut deepest) = (0, 0);
    let mut stack: Vec<(&ProcessNode, usize)> = forest.iter().map(|n| (n, 0)).collect();
    while let Some((n, d)) = stack.pop() {
        count += 1;
        deepest = deepest.max(d);
        stack.extend(n.children.iter().map(|c| (c, d + 1)));
    }
    (count, deepest)
}

/// A chain of 5,000 nested members (each the child of the one before), as
/// a tree that forks in a loop leaves it: built and drawn on a small
/// thread stack (a recursive build would need one frame per level), the
/// nesting stopping at the cap with every deeper member drawn flat under
/// the member at the cap, which says so.
#[test]
fn a_chain_of_five_thousand_is_capped_not_recursed() {
    const N: i32 = 5_000;
    let base = 100;
    let (_dir, ledger, tree) = tree_with_root(base);
    let seen: Vec<MemberRecord> = (0..N)
        .map(|k| member(base + k, if k == 0 { 1 } else { base + k - 1 }, base))
        .collect();
    ledger.observe_members(tree, &seen).expect("members");
    let d = detail(&ledger, tree);
    // 256 KiB: far below what 5,000 recursive frames need.
    let (forest, text) = std::thread::Builder::new()
        .stack_size(256 * 1024)
        .spawn(move || {
            let forest = d.hierarchy();
            let text = hierarchy::draw(&forest);
            let json = serde_json::to_string(&forest).expect("json");
            assert!(json.len() > 1000);
            (forest, text)
        })
        .expect("thread")
        .join()
        .expect("no overflow");
    assert_eq!(forest.len(), 1, "one root");
    assert_eq!(forest[0].pid, base);
    let (count, deepest) = shape(&forest);
    assert_eq!(count, N as usize, "every member drawn once");
    assert_eq!(deepest, MAX_DEPTH + 1, "nesting stops at the cap");
    // The member at the cap holds the rest, flat, in the order they started.
    let mut at_cap = &forest[0];
    for _ in 0..MAX_DEPTH {
        assert_eq!(at_cap.children.len(), 1);
        at_cap = &at_cap.children[0];
    }
    assert_eq!(at_cap.pid, base + MAX_DEPTH as i32);
    let below = N as usize - MAX_DEPTH - 1;
    assert_eq!(at_cap.flattened, below);
    let pids: Vec<i32> = at_cap.children.iter().map(|c| c.pid).collect();
    let expect: Vec<i32> = (MAX_DEPTH as i32 + 1..N).map(|k| base + k).collect();
    assert_eq!(pids, expect);
    // Each keeps its real parent, which the reader can follow.
    assert_eq!(at_cap.children[1].ppid, Some(at_cap.children[0].pid));
    let mark = format!("{below} deeper members drawn flat (depth cap {MAX_DEPTH})");
    assert!(at_cap.marks().contains(&mark), "{:?}", at_cap.marks());
    assert_eq!(text.lines().count(), N as usize);
    assert!(text.contains(&mark), "the text says so too");
    // The walk the dashboard and the tests use is iterative too.
    assert_eq!(forest[0].walk().len(), N as usize);
}

/// Twenty thousand members (a root with 10,000 children, each with one
/// child) are arranged in well under what a per-member scan of all
/// members costs: the old O(n²) lookups made 8·10⁸ comparisons for this
/// (seconds in a debug build; this build takes about 0.3 s here, its
/// reads of the 20,000 `member.observed` events included).
/// The bound is scaled (`util::scaled`) for a loaded or emulated host.
#[test]
fn twenty_thousand_members_in_linear_time() {
    const HALF: i32 = 10_000;
    let base = 100;
    let (_dir, ledger, tree) = tree_with_root(base);
    let mut seen = vec![member(base, 1, base)];
    for k in 1..=HALF {
        seen.push(member(base + k, base, base));
    }
    for k in 1..HALF {
        seen.push(member(base + HALF + k, base + k, base));
    }
    ledger.observe_members(tree, &seen).expect("members");
    let d = detail(&ledger, tree);
    assert_eq!(d.members.len(), seen.len());
    let t0 = Instant::now();
    let forest = d.hierarchy();
    let took = t0.elapsed();
    eprintln!("{} members arranged in {took:?}", seen.len());
    let (count, deepest) = shape(&forest);
    assert_eq!(count, seen.len());
    assert_eq!(deepest, 2);
    assert_eq!(forest[0].children.len(), HALF as usize);
    assert_eq!(forest[0].children[0].children[0].pid, base + HALF + 1);
    let bound = util::scaled(Duration::from_millis(1500));
    assert!(
        took < bound,
        "{} members took {took:?} (bound {bound:?})",
        seen.len()
    );
}

fn sigkill(auth: treewarden::ledger::AuthorizationId, kind: &str, target: &str) -> SignalRecord {
    SignalRecord {
        signal: "SIGKILL".into(),
        target_kind: kind.parse().expect("a target kind"),
        target: target.into(),
        result: "sent".into(),
        authorization: Some(auth),
    }
}

/// Waits until the ledger's millisecond clock has moved on, so the next
/// row is written strictly later than the last.
fn next_millisecond() {
    let now = treewarden::ledger::timestamp(SystemTime::now());
    assert!(util::wait_until(Duration::from_secs(1), || {
        treewarden::ledger::timestamp(SystemTime::now()) != now
    }));
}

/// The mark says what the record shows: "force-killed" where a SIGKILL of
/// the authorization was delivered to the target naming the member and
/// nothing says it ended first; "kill authorized" where it was named but
/// the record does not show the signal reaching it (found gone before the
/// signal; its target's signal not sent; an exit of its own).
#[test]
fn the_force_killed_mark_follows_the_signal_not_the_authorization() {
    let base = 300;
    let (_dir, ledger, tree) = tree_with_root(base);
    let (root, reached, gone_first, unsent, own_exit) =
        (base, base + 1, base + 2, base + 3, base + 4);
    let seen: Vec<MemberRecord> = [root, reached, gone_first, unsent, own_exit]
        .iter()
        .map(|&p| member(p, if p == root { 1 } else { root }, root))
        .collect();
    ledger.observe_members(tree, &seen).expect("members");
    // One member is found gone before the kill.
    ledger
        .record_exits(tree, &[(ident(gone_first), None)], "parent")
        .expect("exit");
    next_millisecond();
    let auth = ledger
        .authorize_kill(
            tree,
            &[
                KillTarget {
                    kind: treewarden::ledger::TargetKind::Group,
                    target: root.to_string(),
                    identities: vec![ident(reached), ident(gone_first), ident(own_exit)],
                },
                KillTarget {
                    kind: treewarden::ledger::TargetKind::Pid,
                    target: unsent.to_string(),
                    identities: vec![ident(unsent)],
                },
            ],
            "synthetic",
        )
        .expect("authorize");
    // The group's SIGKILL went out; the loose pid's found nothing.
    ledger
        .record_signals(
            tree,
            &[sigkill(auth, "group", &root.to_string()), {
                let mut s = sigkill(auth, "pid", &unsent.to_string());
                s.result = "gone".into();
                s
            }],
        )
        .expect("signals");
    // Reaped after the kill: one by SIGKILL, one with its own exit code.
    ledger
        .record_exits(
            tree,
            &[
                (
                    ident(reached),
                    Some(ExitRecord {
                        code: None,
                        signal: Some(9),
                        cpu_usec: None,
                    }),
                ),
                (
                    ident(own_exit),
                    Some(ExitRecord {
                        code: Some(3),
                        signal: None,
                        cpu_usec: None,
                    }),
                ),
                (ident(unsent), None),
            ],
            "treewarden",
        )
        .expect("exits");
    let forest = detail(&ledger, tree).hierarchy();
    let node = |pid: i32| {
        forest[0]
            .walk()
            .into_iter()
            .find(|n| n.pid == pid)
            .unwrap_or_else(|| panic!("{pid} drawn"))
            .clone()
    };
    let marks = |pid: i32| node(pid).marks();
    assert!(!node(root).force_killed && !node(root).kill_authorized);
    assert!(node(reached).force_killed, "{:?}", marks(reached));
    for pid in [gone_first, unsent, own_exit] {
        let n = node(pid);
        assert!(!n.force_killed, "{pid}: {:?}", n.marks());
        assert!(n.marks().contains(&"kill authorized".to_string()), "{pid}");
    }
    let text = hierarchy::draw(&forest);
    assert_eq!(text.matches("force-killed").count(), 1, "{text}");
    assert_eq!(text.matches("kill authorized").count(), 3, "{text}");
}
