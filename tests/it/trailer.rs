//! The export's trailer is evidence too: a whole NDJSON export of a sealed
//! ledger ends with a line naming its time, host, machine, boot, head,
//! filter and count, sealed with the key of the epoch after the newest seal.
//! Each forgery is done for real on a real export of a real ledger (made by
//! the binary, 1 s epochs): the export cut and a trailer written by hand,
//! the trailer's time, host or head edited. `verify --export --seal-key`
//! fails each with one line naming it; the untouched export passes, and
//! the default file name names the host and the time.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::custody::Env;
use crate::seal::{
    Ev, all_events, key0, next_key, recipe_mac, sealed_ledger, text, tw, verify, work,
};

/// The export's lines: the events, then the trailer's object.
fn split(body: &str) -> (Vec<Value>, Value) {
    let mut lines: Vec<Value> = body
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    let last = lines.pop().expect("lines");
    let trailer = last
        .get("exported")
        .cloned()
        .unwrap_or_else(|| panic!("the last line is the trailer: {last}"));
    (lines, trailer)
}

/// Writes `events` and then `trailer` (as the `exported` line) to a file.
fn write_export(path: &Path, events: &[Value], trailer: &Value) {
    let mut body = String::new();
    for e in events {
        body.push_str(&serde_json::to_string(e).expect("json"));
        body.push('\n');
    }
    body.push_str(&serde_json::json!({ "exported": trailer }).to_string());
    body.push('\n');
    std::fs::write(path, body).expect("write the export");
}

/// `verify --export FILE [--seal-key KEY]` with no data dir: (code, out, err).
fn verify_file(scratch: &Path, file: &Path, key: Option<&str>) -> (Option<i32>, String, String) {
    let mut args = vec!["--export", file.to_str().expect("utf-8")];
    if let Some(key) = key {
        args.extend(["--seal-key", key]);
    }
    verify(&scratch.join("none"), &args)
}

/// The forged file fails with one line saying `what`.
fn assert_named(scratch: &Path, file: &Path, key: &str, what: &str) {
    let (code, out, err) = verify_file(scratch, file, Some(key));
    assert_eq!(code, Some(1), "{} fails: {out} {err}", file.display());
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    assert!(
        err.contains(what),
        "{}: expected {what:?} in {err}",
        file.display()
    );
}

fn kernel(path: &str) -> String {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{path}: {e}"))
        .trim()
        .to_string()
}

fn rfc3339(t: std::time::SystemTime) -> String {
    humantime::format_rfc3339_millis(t).to_string()
}

#[test]
fn the_trailer_binds_time_host_and_head_and_each_forgery_is_named() {
    let env = Env::new("session").expect("the session boundary always forms");
    let (data, key) = sealed_ledger(&env);
    let scratch = tempfile::tempdir().expect("temp dir");
    let before = std::time::SystemTime::now();

    // `export --output DIR`: the default name names the host and the time.
    let dir = env.dir().join("exports");
    std::fs::create_dir(&dir).expect("dir");
    let out = tw(&data, &["export", "--output", dir.to_str().expect("utf-8")]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let file = PathBuf::from(text(&out.stdout).trim());
    assert_eq!(file.parent(), Some(dir.as_path()), "{}", file.display());
    let host = kernel("/proc/sys/kernel/hostname");
    let name = file.file_name().and_then(|n| n.to_str()).expect("name");
    let stamp = name
        .strip_prefix(&format!("treewarden-audit-{host}-"))
        .and_then(|r| r.strip_suffix("Z.ndjson"))
        .unwrap_or_else(|| panic!("the name names the host and the time: {name}"));
    let named_at = humantime::parse_rfc3339(&format!(
        "{}-{}-{}T{}:{}:{}Z",
        &stamp[0..4],
        &stamp[4..6],
        &stamp[6..8],
        &stamp[9..11],
        &stamp[11..13],
        &stamp[13..15]
    ))
    .unwrap_or_else(|e| panic!("{stamp}: {e}"));
    assert!(
        named_at + std::time::Duration::from_secs(1) >= before
            && named_at <= std::time::SystemTime::now(),
        "the name's time is the export's: {stamp}"
    );
    // The same bytes as stdout's export, but for the trailer's own time.
    let body = std::fs::read_to_string(&file).expect("the export");
    let (events, trailer) = split(&body);

    // Ground truth: what the host and the ledger know.
    assert_eq!(trailer["host"], host.as_str());
    if let Ok(id) = std::fs::read_to_string("/etc/machine-id") {
        assert_eq!(trailer["machine_id"], id.trim());
    }
    assert_eq!(
        trailer["boot_id"],
        kernel("/proc/sys/kernel/random/boot_id").as_str()
    );
    assert_eq!(trailer["events"], events.len());
    let last = events.last().expect("events");
    assert_eq!(trailer["head"]["seq"], last["seq"]);
    assert_eq!(trailer["head"]["hash"], last["hash"]);
    assert_eq!(trailer["filter"], serde_json::json!({}));
    let newest_epoch = events
        .iter()
        .rev()
        .filter(|e| e["kind"] == "ledger.seal")
        .find_map(|e| e["data"]["epoch"].as_u64())
        .expect("seals");
    assert_eq!(
        trailer["epoch"],
        newest_epoch + 1,
        "sealed with the key after the newest seal's"
    );
    let at = humantime::parse_rfc3339(trailer["at"].as_str().expect("at")).expect("time");
    assert!(at >= before && at <= std::time::SystemTime::now());
    // The MAC is the documented recipe with that epoch's key.
    let mut k = key0(&key);
    for _ in 0..=newest_epoch {
        k = next_key(&k);
    }
    assert_eq!(trailer["mac"], recipe_mac(&k, &trailer).as_str());

    // Untouched: passes, and says what the trailer proves.
    let (code, out, err) = verify_file(scratch.path(), &file, Some(&key));
    assert_eq!(code, Some(0), "{out} {err}");
    assert!(
        out.contains(&format!(
            "the trailer (time, host, head, count) is sealed with epoch {}'s key",
            newest_epoch + 1
        )),
        "{out}"
    );
    let (code, out, _) = verify_file(scratch.path(), &file, None);
    assert_eq!(code, Some(0));
    assert!(
        out.contains("sealed but not checked (no --seal-key or --seal-pub)"),
        "{out}"
    );

    let forged = |name: &str| env.dir().join(format!("{name}.ndjson"));

    // 1. Cut before the newest seal, with a trailer written by hand to fit
    //    the cut: its count, its head, the epoch after its newest seal, a
    //    time at that seal (so the seals look fresh); the MAC cannot be made.
    let last_seal = events
        .iter()
        .rposition(|e| e["kind"] == "ledger.seal")
        .expect("a seal");
    let kept = &events[..last_seal - 1];
    let kept_seal = kept
        .iter()
        .rfind(|e| e["kind"] == "ledger.seal" && e["data"]["op"] == "seal")
        .expect("an earlier seal");
    let mut hand = trailer.clone();
    hand["events"] = kept.len().into();
    hand["head"] = serde_json::json!({
        "seq": kept.last().expect("kept")["seq"],
        "hash": kept.last().expect("kept")["hash"],
    });
    hand["at"] = kept_seal["data"]["made_at"].clone();
    hand["epoch"] = (kept_seal["data"]["epoch"].as_u64().expect("epoch") + 1).into();
    let cut = forged("cut-hand-written");
    write_export(&cut, kept, &hand);
    assert_named(
        scratch.path(),
        &cut,
        &key,
        "the trailer's MAC does not match epoch",
    );
    // The same cut with the original trailer: the count says so.
    let cut_as_is = forged("cut-original-trailer");
    write_export(&cut_as_is, kept, &trailer);
    assert_named(
        scratch.path(),
        &cut_as_is,
        &key,
        &format!(
            "the export says it holds {} events but {} are there",
            events.len(),
            kept.len()
        ),
    );
    // The cut with a trailer of an earlier build's form (no seal at all).
    let old_form = forged("cut-unsealed-trailer");
    write_export(
        &old_form,
        kept,
        &serde_json::json!({"at": hand["at"], "events": kept.len()}),
    );
    assert_named(
        scratch.path(),
        &old_form,
        &key,
        "the trailer carries no seal (epoch and MAC), but this ledger's seals bind every export's trailer",
    );
    // The cut with the original trailer's epoch and MAC: the key is not the
    // one the cut's newest seal handed on.
    let mut stale = hand.clone();
    stale["epoch"] = trailer["epoch"].clone();
    let other_epoch = forged("cut-other-epoch");
    write_export(&other_epoch, kept, &stale);
    assert_named(
        scratch.path(),
        &other_epoch,
        &key,
        "but the export's seals hand on epoch",
    );

    // 2. The trailer's time moved back ten minutes.
    let mut edited = trailer.clone();
    edited["at"] = rfc3339(at - std::time::Duration::from_secs(600)).into();
    let time_edited = forged("time-edited");
    write_export(&time_edited, &events, &edited);
    assert_named(
        scratch.path(),
        &time_edited,
        &key,
        "the trailer's MAC does not match epoch",
    );

    // 3. The host renamed.
    let mut edited = trailer.clone();
    edited["host"] = "elsewhere".into();
    let host_edited = forged("host-edited");
    write_export(&host_edited, &events, &edited);
    assert_named(
        scratch.path(),
        &host_edited,
        &key,
        "its time, host, machine id, boot id, head, filter or event count was edited",
    );

    // 4. The head named in it changed: named before the MAC.
    let mut edited = trailer.clone();
    edited["head"]["hash"] = "0".repeat(64).into();
    let head_edited = forged("head-edited");
    write_export(&head_edited, &events, &edited);
    assert_named(scratch.path(), &head_edited, &key, "the trailer names head");
}

/// Old exports: a sealed ledger whose seals an earlier build made (no
/// `v`) with its trailer of that build (`at` and `events` only) still
/// verifies, saying the trailer is unauthenticated; an unsealed ledger's
/// export says it is not bound as a whole.
#[test]
fn an_earlier_builds_export_verifies_with_a_warning_and_an_unsealed_one_says_so() {
    let env = Env::new("session").expect("the session boundary always forms");
    let (data, key) = sealed_ledger(&env);
    let scratch = tempfile::tempdir().expect("temp dir");

    // The ledger as an earlier build sealed it: each seal without `v`,
    // MACed again with its own epoch's key (the recipe; the key is ours).
    let conn = crate::rules::open(&data.join("ledger.db"));
    let evs: Vec<Ev> = all_events(&conn);
    as_an_earlier_build_sealed(&conn, &evs, &key);
    drop(conn);
    let out = tw(&data, &["export"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let (events, trailer) = split(&text(&out.stdout));
    let old = env.dir().join("old.ndjson");
    write_export(
        &old,
        &events,
        &serde_json::json!({"at": trailer["at"], "events": trailer["events"]}),
    );
    let (code, out, err) = verify_file(scratch.path(), &old, Some(&key));
    assert_eq!(code, Some(0), "{out} {err}");
    assert!(out.contains("the trailer is unauthenticated"), "{out}");

    // An unsealed ledger: no trailer, and verify says what that leaves.
    let plain = env.dir().join("plain");
    work(&plain, 0);
    work(&plain, 1);
    let out = tw(&plain, &["export"]);
    assert_eq!(out.status.code(), Some(0));
    let file = env.dir().join("plain.ndjson");
    std::fs::write(&file, &out.stdout).expect("write");
    let (code, out, err) = verify_file(scratch.path(), &file, None);
    assert_eq!(code, Some(0), "{out} {err}");
    assert!(
        out.contains("no trailer: the export is not bound as a whole"),
        "{out}"
    );
    // A trailer written by hand on it passes, said to be unauthenticated.
    let body = std::fs::read_to_string(&file).expect("read");
    let events: Vec<Value> = body
        .lines()
        .map(|l| serde_json::from_str(l).expect("json"))
        .collect();
    write_export(
        &file,
        &events,
        &serde_json::json!({"at": rfc3339(std::time::SystemTime::now()), "events": events.len()}),
    );
    let (code, out, err) = verify_file(scratch.path(), &file, None);
    assert_eq!(code, Some(0), "{out} {err}");
    assert!(
        out.contains("is unauthenticated: an unsealed ledger's export"),
        "{out}"
    );
}

/// Writes `evs` as the whole chain again (the recipe), each seal as an
/// earlier build made it: no `v`, over the new chain's head, MACed with its
/// own epoch's key.
fn as_an_earlier_build_sealed(conn: &rusqlite::Connection, evs: &[Ev], seed: &str) {
    crate::seal::rewrite(conn, &[], None);
    let mut prev = "0".repeat(64);
    for (i, (at, tree, kind, data)) in evs.iter().enumerate() {
        let seq = i as i64 + 1;
        let mut data = data.clone();
        if kind == "ledger.seal" && data["op"] != "setup" {
            data.as_object_mut().expect("object").remove("v");
            data["head_seq"] = (seq - 1).into();
            data["head_hash"] = prev.clone().into();
            let mut k = key0(seed);
            for _ in 0..data["epoch"].as_u64().expect("epoch") {
                k = next_key(&k);
            }
            data["mac"] = recipe_mac(&k, &data).into();
        }
        let text = serde_json::to_string(&data).expect("json");
        let hash = crate::rules::recipe_hash(&prev, seq, at, *tree, kind, &text);
        conn.execute(
            "INSERT INTO events (seq, at, tree, kind, data, prev_hash, hash) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
            rusqlite::params![seq, at, tree, kind, text, prev, hash],
        )
        .expect("insert");
        prev = hash;
    }
    assert!(crate::rules::chain_consistent(conn), "the recipe's chain");
}

/// A backup carries the seal state of its moment: taken while the sealer
/// ran, checked after the ledger's own seals went stale, it passes and
/// says what it proves up to when; its stamp edited, it fails, named.
#[test]
fn a_backup_verifies_as_of_its_own_time_long_after() {
    let env = Env::new("session").expect("the session boundary always forms");
    let data = env.data_dir();
    work(&data, 0);
    let key = crate::seal::setup(&data);
    for code in 1..=2 {
        work(&data, code);
        crate::seal::seal_next(&data);
    }
    let dest_dir = env.dir().join("backup");
    std::fs::create_dir(&dest_dir).expect("dir");
    let dest = dest_dir.join("ledger.db");
    let out = tw(&data, &["backup", dest.to_str().expect("utf-8")]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let said = text(&out.stdout);
    let head_seq: i64 = said
        .split("head ")
        .nth(1)
        .and_then(|h| h.split(':').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("backup names its head: {said}"));
    // No sealer runs: the live ledger's newest seal goes stale.
    assert!(
        crate::util::wait_until(std::time::Duration::from_secs(20), || {
            let (code, _, err) = verify(&data, &["--seal-key", &key]);
            code == Some(1) && err.contains("overdue")
        }),
        "the live ledger goes stale without a sealer"
    );
    // The backup, checked now: judged at its own time.
    let (code, out, err) = verify(&dest_dir, &["--seal-key", &key]);
    assert_eq!(code, Some(0), "{out} {err}");
    assert!(
        out.contains(&format!("a backup, proven up to seq {head_seq} at ")),
        "{out}"
    );
    // Its stamp's time moved on an hour (to look fresh later): named.
    let conn = crate::rules::open(&dest);
    let stamp: String = conn
        .query_row("SELECT stamp FROM backup_stamp", [], |r| r.get(0))
        .expect("the stamp");
    let mut stamp: Value = serde_json::from_str(&stamp).expect("json");
    let at = humantime::parse_rfc3339(stamp["at"].as_str().expect("at")).expect("time");
    stamp["at"] = rfc3339(at + std::time::Duration::from_secs(3600)).into();
    conn.execute(
        "UPDATE backup_stamp SET stamp = ?1",
        [serde_json::to_string(&stamp).expect("json")],
    )
    .expect("edit");
    drop(conn);
    let (code, out, err) = verify(&dest_dir, &["--seal-key", &key]);
    assert_eq!(code, Some(1), "{out} {err}");
    assert!(
        err.contains("the backup's stamp does not match epoch"),
        "{err}"
    );
}
