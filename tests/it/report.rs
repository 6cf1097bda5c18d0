//! `treewarden report`: one tree's incident report, checked against what
//! the workload itself knows (the pids it printed, how it ended) and
//! against the ledger's own record (`show --json`'s seqs and hashes).

use std::time::Duration;

use crate::custody::Env;
use crate::util::{printed_pids, signal, wait_child};

/// `report TREE [--format F]`'s output, kept in target/artifacts.
fn report(env: &Env, tree: i64, format: &str) -> String {
    let out = env.output(&["report", &tree.to_string(), "--format", format]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("utf-8");
    let artifacts = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/artifacts");
    std::fs::create_dir_all(&artifacts).expect("artifacts");
    std::fs::write(
        artifacts.join(format!("report-tree-{tree}.{format}")),
        &text,
    )
    .expect("artifact");
    text
}

#[test]
fn a_report_states_a_forced_kill_and_an_owner_death_as_the_workload_knows_them() {
    let Some(env) = Env::new("session") else {
        return;
    };
    // A timeout that needs the forced kill: both processes ignore TERM.
    let mut run = env.spawn_run(
        &["--grace", "200ms", "--timeout", "1s", "--quiet"],
        "trap '' TERM; sleep 300 & echo $! >> forced.pids; echo $$ >> forced.pids; wait",
    );
    let forced = printed_pids(&env.dir().join("forced.pids"), 2);
    let status = wait_child(&mut run, Duration::from_secs(30)).expect("run exits");
    assert_eq!(status.code(), Some(124), "{}", env.stderr_of(&run));
    let md = report(&env, 1, "md");
    assert!(md.contains("Verdict: Timed out (timeout after 1s)"), "{md}");
    assert!(
        md.contains(&format!(
            "{} force-killed under authorization #1",
            forced.len()
        )),
        "{md}"
    );
    for pid in &forced {
        let drawn = md
            .lines()
            .find(|l| l.contains(&format!("({pid})")))
            .unwrap_or_else(|| panic!("pid {pid} is not in the process tree: {md}"));
        assert!(drawn.contains("force-killed"), "{drawn}");
    }
    assert!(
        md.contains("None: every member's exit is recorded."),
        "{md}"
    );
    // The proof names the tree's first and last events as the ledger has them.
    let show = env.show(1);
    let events = show["events"].as_array().expect("events");
    for e in [&events[0], &events[events.len() - 1]] {
        let cited = format!(
            "seq {} (hash {})",
            e["seq"],
            e["hash"].as_str().expect("hash")
        );
        assert!(md.contains(&cited), "{cited} not in {md}");
    }

    // An owner SIGKILLed, its tree found by the sweep.
    let mut run = env.spawn_run(
        &["--quiet"],
        "sleep 300 & echo $! >> gone.pids; echo $$ >> gone.pids; wait",
    );
    let gone = printed_pids(&env.dir().join("gone.pids"), 2);
    let owner = run.id();
    signal(owner, rustix::process::Signal::KILL);
    let _ = wait_child(&mut run, Duration::from_secs(10));
    let out = env.output(&["sweep", "--grace", "300ms"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(env.wait_none_marked(), "{:?}", env.marked());
    let md = report(&env, 2, "md");
    assert!(
        md.contains(&format!(
            "Verdict: Owner gone (run pid {owner}); ended by the orphan sweep"
        )),
        "{md}"
    );
    for pid in &gone {
        assert!(md.contains(&format!("({pid})")), "pid {pid}: {md}");
    }
    let html = report(&env, 2, "html");
    assert!(html.starts_with("<!doctype html>"), "{html}");
    // The command's `&` and `;` are the workload's own text, escaped.
    assert!(html.contains("sleep 300 &amp; echo"), "{html}");
    assert!(html.contains("<h2>Proof</h2>"), "{html}");

    // A tree the ledger does not hold: one line, exit 2.
    let out = env.output(&["report", "99"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(err.trim(), "treewarden: unknown tree 99");
}
