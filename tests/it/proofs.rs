//! A filtered export proves itself: `export --tree/--kind/--since/--until`
//! writes the events its filter takes, the ledger's seals, an inclusion
//! proof after each run of consecutive seqs and a sealed trailer naming the
//! Merkle root of the whole ledger, the head, the filter and the count.
//! `verify --export FILE --seal-key KEY` checks it with no ledger at hand.
//! Each forgery is done for real on a real export of a real sealed ledger:
//! an in-range event dropped (with its proof line, so that only the count
//! can tell), one edited and rehashed, the tail cut, the trailer forged;
//! each fails naming what. Untouched exports of each filter kind pass, and
//! hold exactly the events the whole export's filter would take. A pruned
//! ledger's filtered export proves itself too, across the checkpoint.

use std::path::{Path, PathBuf};

use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::custody::Env;
use crate::seal::{sealed_ledger, text, tw, verify, work};
use crate::util::wait_child;

/// `treewarden export ARGS` on stdout.
fn export(data: &Path, args: &[&str]) -> String {
    let out = tw(data, &[&["export"], args].concat());
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    text(&out.stdout)
}

fn lines(body: &str) -> Vec<Value> {
    body.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

fn write(path: &Path, lines: &[Value]) {
    let mut body = String::new();
    for l in lines {
        body.push_str(&serde_json::to_string(l).expect("json"));
        body.push('\n');
    }
    std::fs::write(path, body).expect("write the export");
}

fn is_event(l: &Value) -> bool {
    l.get("seq").is_some()
}

fn is_proof(l: &Value) -> bool {
    l.get("proof").is_some()
}

/// `verify --export FILE [--seal-key KEY]` with no data dir.
fn check(scratch: &Path, file: &Path, key: Option<&str>) -> (Option<i32>, String, String) {
    let mut args = vec!["--export", file.to_str().expect("utf-8")];
    if let Some(key) = key {
        args.extend(["--seal-key", key]);
    }
    verify(&scratch.join("none"), &args)
}

/// The forged export fails with one line naming `what`.
fn assert_named(scratch: &Path, file: &Path, key: Option<&str>, what: &str) {
    let (code, out, err) = check(scratch, file, key);
    assert_eq!(code, Some(1), "{} fails: {out} {err}", file.display());
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    assert!(
        err.contains(what),
        "{}: expected {what:?} in {err}",
        file.display()
    );
}

/// The event's hash made again after an edit, as a forger with the
/// documented recipe would: sha256(prev_hash || [seq,at,tree,kind,data]).
fn rehash(e: &mut Value) {
    let canonical = serde_json::to_string(&serde_json::json!([
        e["seq"], e["at"], e["tree"], e["kind"], e["data"]
    ]))
    .expect("json");
    let mut h = Sha256::new();
    h.update(e["prev_hash"].as_str().expect("prev_hash").as_bytes());
    h.update(canonical.as_bytes());
    e["hash"] = hex::encode(h.finalize()).into();
}

/// The seqs of the events a filtered export took (its seals aside, unless
/// the filter takes them).
fn taken(lines: &[Value], takes: &dyn Fn(&Value) -> bool) -> Vec<i64> {
    lines
        .iter()
        .filter(|l| is_event(l) && takes(l))
        .filter_map(|e| e["seq"].as_i64())
        .collect()
}

#[test]
fn each_filter_kind_proves_itself_and_holds_exactly_what_it_takes() {
    let env = Env::new("session").expect("the session boundary always forms");
    let (data, key) = sealed_ledger(&env);
    let scratch = tempfile::tempdir().expect("temp dir");
    let whole = lines(&export(&data, &[]));
    let events: Vec<&Value> = whole.iter().filter(|l| is_event(l)).collect();
    let mut trees: Vec<i64> = events.iter().filter_map(|e| e["tree"].as_i64()).collect();
    trees.dedup();
    assert!(trees.len() >= 3, "several trees: {trees:?}");
    let tree = trees[1];
    let mid = events[events.len() / 2]["at"]
        .as_str()
        .expect("at")
        .to_string();
    let tree_s = tree.to_string();
    type Takes = Box<dyn Fn(&Value) -> bool>;
    let cases: Vec<(&str, Vec<&str>, Takes)> = vec![
        (
            "tree",
            vec!["--tree", &tree_s],
            Box::new(move |e: &Value| e["tree"].as_i64() == Some(tree)),
        ),
        (
            "kind",
            vec!["--kind", "tree.end"],
            Box::new(|e: &Value| {
                e["kind"]
                    .as_str()
                    .is_some_and(|k| k.starts_with("tree.end"))
            }),
        ),
        (
            "since",
            vec!["--since", &mid],
            Box::new({
                let mid = mid.clone();
                move |e: &Value| e["at"].as_str().is_some_and(|a| a >= mid.as_str())
            }),
        ),
        (
            "until",
            vec!["--until", &mid],
            Box::new({
                let mid = mid.clone();
                move |e: &Value| e["at"].as_str().is_some_and(|a| a < mid.as_str())
            }),
        ),
        (
            "tree-and-kind",
            vec!["--tree", &tree_s, "--kind", "tree.s"],
            Box::new(move |e: &Value| {
                e["tree"].as_i64() == Some(tree)
                    && e["kind"].as_str().is_some_and(|k| k.starts_with("tree.s"))
            }),
        ),
    ];
    for (name, args, takes) in cases {
        let body = export(&data, &args);
        let got = lines(&body);
        let want: Vec<i64> = events
            .iter()
            .filter(|e| takes(e))
            .filter_map(|e| e["seq"].as_i64())
            .collect();
        assert!(!want.is_empty(), "{name}: the filter takes something");
        assert_eq!(taken(&got, &*takes), want, "{name}: exactly what it takes");
        let trailer = &got.last().expect("lines")["exported"];
        assert_eq!(trailer["events"], want.len(), "{name}: {trailer}");
        assert_eq!(trailer["tree_size"], events.len(), "{name}: {trailer}");
        assert!(trailer["mac"].is_string(), "{name}: sealed: {trailer}");
        // Every event not taken is one of the ledger's seals.
        assert!(
            got.iter()
                .filter(|l| is_event(l) && !takes(l))
                .all(|l| l["kind"] == "ledger.seal"),
            "{name}"
        );
        let file = env.dir().join(format!("{name}.ndjson"));
        write(&file, &got);
        let (code, out, err) = check(scratch.path(), &file, Some(&key));
        assert_eq!(code, Some(0), "{name}: {out} {err}");
        assert!(out.contains("a filtered export"), "{name}: {out}");
        assert!(out.contains("sealed with epoch"), "{name}: {out}");
        // Fewer events than the whole ledger's export.
        assert!(
            got.iter().filter(|l| is_event(l)).count() < events.len(),
            "{name}"
        );
    }
}

#[test]
fn a_filtered_exports_forgeries_each_fail_naming_what() {
    let env = Env::new("session").expect("the session boundary always forms");
    let (data, key) = sealed_ledger(&env);
    let scratch = tempfile::tempdir().expect("temp dir");
    let got = lines(&export(&data, &["--kind", "tree.ended"]));
    let forged = |name: &str| -> PathBuf { env.dir().join(format!("{name}.ndjson")) };
    let n = got.len();
    let trailer = got[n - 1].clone();

    // 1. One in-range event dropped at the start of its run (with the
    //    proof line after it when it is a run of its own): every line left
    //    proves itself; the count names the gap.
    let alone = (0..n - 2)
        .find(|&i| {
            is_event(&got[i])
                && got[i]["kind"] != "ledger.seal"
                && (i == 0 || is_proof(&got[i - 1]))
        })
        .expect("an event that starts a run");
    let run_of_its_own = is_proof(&got[alone + 1]);
    let mut dropped = got.clone();
    dropped.drain(alone..=alone + usize::from(run_of_its_own));
    let file = forged("dropped");
    write(&file, &dropped);
    assert_named(scratch.path(), &file, Some(&key), "an event left out");
    // Dropped inside a run (the proof kept): the run no longer links.
    if let Some(i) = (0..n - 1).find(|&i| is_event(&got[i]) && is_event(&got[i + 1])) {
        let mut dropped = got.clone();
        dropped.remove(i + 1);
        let file = forged("dropped-in-run");
        write(&file, &dropped);
        let (code, out, err) = check(scratch.path(), &file, Some(&key));
        assert_eq!(code, Some(1), "{out} {err}");
        assert!(
            err.contains("left out") || err.contains("not the event before it"),
            "{err}"
        );
    }

    // 2. One event edited: as it was, its hash names it; rehashed, its
    //    inclusion proof no longer leads to the root (or the next event of
    //    its run no longer links to it).
    let mut edited = got.clone();
    edited[alone]["data"]["forged"] = true.into();
    let file = forged("edited");
    write(&file, &edited);
    let seq = &got[alone]["seq"];
    assert_named(
        scratch.path(),
        &file,
        Some(&key),
        &format!("seq {seq}: hash does not match the recomputed hash (content edited)"),
    );
    rehash(&mut edited[alone]);
    write(&file, &edited);
    let what = if run_of_its_own {
        format!(
            "seq {seq}: line {}: the inclusion proof does not lead to the trailer's Merkle root",
            alone + 2
        )
    } else {
        format!("seq {seq}: not proven the ledger's")
    };
    assert_named(scratch.path(), &file, Some(&key), &what);

    // 3. The tail cut: without the trailer, the last proofs have nothing
    //    to prove against; with it kept, the count.
    let file = forged("cut");
    write(&file, &got[..n - 1]);
    assert_named(scratch.path(), &file, Some(&key), "its end was cut");
    write(&file, &got[..n - 3]);
    assert_named(scratch.path(), &file, Some(&key), "its end was cut");
    let last_event = (0..n)
        .rev()
        .find(|&i| is_event(&got[i]) && got[i]["kind"] != "ledger.seal");
    let last_event = last_event.expect("an event");
    let mut cut = got[..last_event].to_vec();
    if !is_proof(cut.last().expect("lines")) {
        // The event before it then needs its own proof: cut at a run's end.
        cut.truncate(
            (0..last_event)
                .rev()
                .find(|&i| is_proof(&got[i]))
                .expect("a proof")
                + 1,
        );
    }
    cut.push(trailer.clone());
    write(&file, &cut);
    assert_named(scratch.path(), &file, Some(&key), "an event left out");

    // 4. The trailer forged: its count fitted to the cut (the MAC cannot
    //    be made); its filter widened; its seal stripped.
    let kept = cut
        .iter()
        .filter(|l| is_event(l) && l["kind"] != "ledger.seal")
        .count();
    let mut hand = cut.clone();
    hand.last_mut().expect("trailer")["exported"]["events"] = kept.into();
    write(&file, &hand);
    let (code, out, err) = check(scratch.path(), &file, Some(&key));
    assert_eq!(code, Some(1), "{out} {err}");
    // (Cut before its newest seals, the seals' own check may name it first.)
    assert!(
        err.contains("the trailer's MAC does not match epoch")
            || err.contains("the export was cut before its newest seals")
            || err.contains("not sealed")
            || err.contains("holds no seal"),
        "{err}"
    );
    // Its host or root edited on the whole export: the MAC.
    let mut hand = got.clone();
    hand[n - 1]["exported"]["host"] = "elsewhere".into();
    write(&file, &hand);
    assert_named(
        scratch.path(),
        &file,
        Some(&key),
        "the trailer's MAC does not match epoch",
    );
    let mut widened = got.clone();
    widened[n - 1]["exported"]["filter"]["kind"] = "tree.e".into();
    write(&file, &widened);
    let (code, out, err) = check(scratch.path(), &file, Some(&key));
    assert_eq!(code, Some(1), "{out} {err}");
    assert!(
        err.contains("outside the export's filter") || err.contains("MAC does not match"),
        "{err}"
    );
    let mut stripped = got.clone();
    let t = stripped[n - 1]["exported"]
        .as_object_mut()
        .expect("trailer object");
    t.remove("mac");
    t.remove("epoch");
    write(&file, &stripped);
    assert_named(
        scratch.path(),
        &file,
        Some(&key),
        "the trailer carries no seal",
    );

    // Untouched, it passes.
    let file = forged("untouched");
    write(&file, &got);
    let (code, out, err) = check(scratch.path(), &file, Some(&key));
    assert_eq!(code, Some(0), "{out} {err}");
}

#[test]
fn an_unsealed_ledgers_filtered_export_proves_its_events_and_count() {
    let env = Env::new("session").expect("the session boundary always forms");
    let data = env.data_dir();
    for code in 0..3 {
        work(&data, code);
    }
    let scratch = tempfile::tempdir().expect("temp dir");
    let got = lines(&export(&data, &["--tree", "2"]));
    assert!(got.iter().filter(|l| is_event(l)).count() > 1);
    let file = env.dir().join("tree.ndjson");
    write(&file, &got);
    let (code, out, err) = check(scratch.path(), &file, None);
    assert_eq!(code, Some(0), "{out} {err}");
    assert!(out.contains("a filtered export"), "{out}");
    // An event of the tree dropped (with the proof of the run it ended):
    // the run before it has no proof.
    let last = (0..got.len())
        .rev()
        .find(|&i| is_event(&got[i]))
        .expect("an event");
    let mut dropped = got.clone();
    dropped.remove(last);
    write(&file, &dropped);
    let (code, _, err) = check(scratch.path(), &file, None);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("not the event before it"), "{err}");
}

#[test]
fn a_pruned_ledgers_filtered_export_of_a_tree_proves_itself_and_names_a_forged_seq() {
    let env = Env::new("session").expect("the session boundary always forms");
    let data = env.data_dir();
    // A tree live across the prune, its events interleaved with those of
    // ended trees the prune takes: the export's seqs have gaps below the
    // checkpoint, and its teardown comes after it.
    work(&data, 3);
    let mut live = env.spawn_run(&[], "sleep 600");
    assert!(env.wait_marked(1), "the live tree runs");
    let root = env.marked()[0];
    work(&data, 4);
    let whole = lines(&export(&data, &[]));
    let tree = whole
        .iter()
        .find(|e| e["kind"] == "tree.spawned" && e["data"]["root"]["pid"] == root)
        .and_then(|e| e["tree"].as_i64())
        .expect("the live tree's tree.spawned names its root pid");
    let out = tw(&data, &["prune", "--before", "now"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let out = env.output(&["kill", &tree.to_string(), "--grace", "2s"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    wait_child(&mut live, std::time::Duration::from_secs(20)).expect("run ends");
    work(&data, 5);

    let events: Vec<Value> = lines(&export(&data, &[]))
        .into_iter()
        .filter(is_event)
        .collect();
    let checkpoint = events
        .iter()
        .find(|e| e["kind"] == "ledger.checkpoint")
        .and_then(|e| e["seq"].as_i64())
        .expect("the prune's checkpoint");
    assert!(
        events.iter().all(|e| e["tree"].as_i64() != Some(1)),
        "the first tree was pruned"
    );
    let tree_s = tree.to_string();
    let got = lines(&export(&data, &["--tree", &tree_s]));
    let ours = |e: &Value| e["tree"].as_i64() == Some(tree);
    let want: Vec<i64> = events
        .iter()
        .filter(|e| ours(e))
        .filter_map(|e| e["seq"].as_i64())
        .collect();
    assert_eq!(taken(&got, &ours), want, "exactly the tree's events");
    assert!(got.iter().filter(|l| is_event(l)).all(ours), "nothing else");
    assert!(
        want.first() < Some(&checkpoint) && want.last() > Some(&checkpoint),
        "the tree's events span the checkpoint at {checkpoint}: {want:?}"
    );
    let scratch = tempfile::tempdir().expect("temp dir");
    let file = env.dir().join("pruned-tree.ndjson");
    write(&file, &got);
    let (code, out, err) = check(scratch.path(), &file, None);
    assert_eq!(code, Some(0), "{out} {err}");
    assert!(out.contains("a filtered export"), "{out}");

    // One line forged: the tree's exit edited, as it was and rehashed.
    let i = got
        .iter()
        .position(|l| l["kind"] == "tree.ended")
        .expect("the tree's end");
    let seq = &got[i]["seq"];
    let mut forged = got.clone();
    forged[i]["data"]["forged"] = true.into();
    write(&file, &forged);
    assert_named(
        scratch.path(),
        &file,
        None,
        &format!("seq {seq}: hash does not match the recomputed hash (content edited)"),
    );
    rehash(&mut forged[i]);
    write(&file, &forged);
    let (code, out, err) = check(scratch.path(), &file, None);
    assert_eq!(code, Some(1), "{out} {err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    assert!(
        err.contains(&format!("seq {seq}")),
        "names seq {seq}: {err}"
    );
}
