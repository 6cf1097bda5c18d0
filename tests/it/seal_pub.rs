//! Public-key seals: `seal setup --pub FILE` seals with an Ed25519 key per
//! epoch, each certifying the next one's public key and then overwritten;
//! `verify --seal-pub FILE` checks the ledger and its export with no secret
//! at hand. Root's attacks are done for real on copies of a real ledger
//! (the binary's, 1 s epochs): every seal from an edit on signed again with
//! the key root finds on the host (a later epoch's), and an erased epoch's
//! key kept in a file of the data dir. Each fails, named.

use std::path::{Path, PathBuf};

use ed25519_dalek::{Signer as _, SigningKey};
use serde_json::Value;

use crate::custody::Env;
use crate::seal::{Ev, all_events, epochs, seal_next, text, tw, verify, work};

/// `seal setup --interval 1s --pub FILE`: the root public key it printed.
fn setup_pub(data: &Path, file: &Path) -> String {
    let out = tw(
        data,
        &[
            "seal",
            "setup",
            "--interval",
            "1s",
            "--pub",
            file.to_str().expect("utf-8"),
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let printed = text(&out.stdout).trim().to_string();
    assert_eq!(printed.len(), 64, "the root alone on stdout: {printed:?}");
    let written = std::fs::read_to_string(file).expect("the root's file");
    assert_eq!(written.trim(), printed, "the file holds what was printed");
    printed
}

/// The key file's record: (epoch, its private key, the next epoch's).
fn keys_in_file(data: &Path) -> (u64, [u8; 32], [u8; 32]) {
    let text = std::fs::read_to_string(data.join("seal.key")).expect("key file");
    let record: Value = serde_json::from_str(text.trim()).expect("record");
    let key = |field: &str| -> [u8; 32] {
        hex::decode(record[field].as_str().expect("a key"))
            .expect("hex")
            .try_into()
            .expect("32 bytes")
    };
    (
        record["epoch"].as_u64().expect("epoch"),
        key("key"),
        key("next"),
    )
}

fn public_hex(key: &[u8; 32]) -> String {
    hex::encode(SigningKey::from_bytes(key).verifying_key().to_bytes())
}

/// A public-key sealed ledger: work, several sealed epochs, a clean close.
/// Returns (data dir, root file, root, every sealed epoch's private key).
fn signed_ledger(env: &Env) -> (PathBuf, PathBuf, String, Vec<(u64, [u8; 32])>) {
    let data = env.data_dir();
    work(&data, 0);
    let root_file = env.dir().join("root.pub");
    let root = setup_pub(&data, &root_file);
    let (epoch, k0, _) = keys_in_file(&data);
    assert_eq!(epoch, 0);
    assert_eq!(public_hex(&k0), root, "the root is epoch 0's public key");
    let mut held = vec![(0, k0)];
    for code in 1..=3 {
        work(&data, code);
        seal_next(&data);
        let (epoch, key, _) = keys_in_file(&data);
        held.push((epoch, key));
    }
    let out = tw(&data, &["seal", "close"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let sealed = *epochs(&data).last().expect("seals");
    held.retain(|(e, _)| *e <= sealed);
    held.dedup_by_key(|(e, _)| *e);
    (data, root_file, root, held)
}

fn seal_pub(root: &Path) -> [&str; 2] {
    ["--seal-pub", root.to_str().expect("utf-8")]
}

#[test]
fn public_key_seals_verify_with_no_secret_and_erased_keys_are_gone() {
    let env = Env::new("session").expect("the session boundary always forms");
    let (data, root_file, root, held) = signed_ledger(&env);
    let scratch = tempfile::tempdir().expect("temp dir");

    // Each seal certifies the next epoch's public key: the chain of
    // certificates from the root, as the ledger holds it.
    let conn = crate::rules::open(&data.join("ledger.db"));
    let evs = all_events(&conn);
    drop(conn);
    let seals: Vec<&Value> = evs
        .iter()
        .filter(|e| e.2 == "ledger.seal")
        .map(|e| &e.3)
        .collect();
    assert_eq!(seals[0]["scheme"], "ed25519");
    assert_eq!(seals[0]["public"], root.as_str());
    for (e, key) in &held {
        if *e > 0 {
            let certifying = seals
                .iter()
                .find(|s| s["epoch"] == *e - 1)
                .expect("the seal before");
            assert_eq!(certifying["next"], public_hex(key).as_str(), "epoch {e}");
        }
    }

    let (code, out, err) = verify(&data, &seal_pub(&root_file));
    assert_eq!(code, Some(0), "{out} {err}");
    assert!(out.contains("sealed: epochs 0 to"), "{out}");

    // The export, checked where no secret and no data dir is.
    let dir = env.dir().join("exports");
    std::fs::create_dir(&dir).expect("dir");
    let out = tw(&data, &["export", "-o", dir.to_str().expect("utf-8")]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let file = text(&out.stdout).trim().to_string();
    let (code, out, err) = verify(
        &scratch.path().join("none"),
        &[&seal_pub(&root_file)[..], &["--export", &file]].concat(),
    );
    assert_eq!(code, Some(0), "{out} {err}");
    assert!(
        out.contains("the trailer (time, host, head, count) is sealed with epoch"),
        "{out}"
    );
    // Its trailer's time edited: the signature names it.
    let body = std::fs::read_to_string(&file).expect("read");
    let (events, last) = body.trim_end().rsplit_once('\n').expect("lines");
    let last = last.replacen("\"at\":\"20", "\"at\":\"19", 1);
    assert!(
        last.contains("\"at\":\"19"),
        "the trailer's time edited: {last}"
    );
    let edited = format!("{events}\n{last}\n");
    let forged = env.dir().join("time-edited.ndjson");
    std::fs::write(&forged, &edited).expect("write");
    let (code, _, err) = verify(
        &scratch.path().join("none"),
        &[
            &seal_pub(&root_file)[..],
            &["--export", forged.to_str().expect("utf-8")],
        ]
        .concat(),
    );
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("the trailer's signature does not match epoch"),
        "{err}"
    );

    // Every sealed epoch's private key is gone from every file of the data
    // dir (the key file holds only the open epoch's and the next one's).
    let needles: Vec<(u64, String)> = held.iter().map(|(e, k)| (*e, hex::encode(k))).collect();
    let mut stack = vec![data.clone()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).expect("read dir") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            let Ok(bytes) = std::fs::read(&path) else {
                continue;
            };
            let body = String::from_utf8_lossy(&bytes);
            for (e, hex) in &needles {
                assert!(
                    !body.contains(hex.as_str()),
                    "epoch {e}'s private key is in {}",
                    path.display()
                );
            }
            for (e, k) in &held {
                assert!(
                    !bytes.windows(32).any(|w| w == k),
                    "epoch {e}'s private key (raw) is in {}",
                    path.display()
                );
            }
        }
    }

    // A backup, checked with the root alone: proven up to its head.
    let backup = env.dir().join("backup");
    std::fs::create_dir(&backup).expect("dir");
    let out = tw(
        &data,
        &["backup", backup.join("ledger.db").to_str().expect("utf-8")],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let (code, out, err) = verify(&backup, &seal_pub(&root_file));
    assert_eq!(code, Some(0), "{out} {err}");
    assert!(out.contains("a backup, proven up to seq"), "{out}");

    // The wrong tools: the HMAC flag, a root that is not this ledger's.
    let (code, _, err) = verify(&data, &["--seal-key", &"ab".repeat(32)]);
    assert_eq!(code, Some(1));
    assert!(err.contains("check them with --seal-pub FILE"), "{err}");
    let other = env.dir().join("other.pub");
    std::fs::write(&other, public_hex(&[9; 32])).expect("write");
    let (code, _, err) = verify(&data, &seal_pub(&other));
    assert_eq!(code, Some(1));
    assert!(
        err.contains("the public key does not match this ledger's seal setup"),
        "{err}"
    );
    let junk = env.dir().join("junk.pub");
    std::fs::write(&junk, "not a key").expect("write");
    let (code, _, err) = verify(&data, &seal_pub(&junk));
    assert_eq!(code, Some(2), "a bad file is a usage error: {err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}

/// Copies `data`'s ledger (checkpointed) and key file into `parent/name`.
fn copy(data: &Path, parent: &Path, name: &str) -> PathBuf {
    let conn = crate::rules::open(&data.join("ledger.db"));
    conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
        .expect("checkpoint");
    drop(conn);
    let dir = parent.join(name);
    std::fs::create_dir_all(&dir).expect("copy dir");
    for f in ["ledger.db", "seal.key"] {
        std::fs::copy(data.join(f), dir.join(f)).expect("copy");
    }
    dir
}

/// The documented signature recipe: Ed25519 over the canonical JSON of
/// the data without `mac` and `sig`.
fn recipe_sig(key: &[u8; 32], data: &Value) -> String {
    let mut data = data.clone();
    let obj = data.as_object_mut().expect("object");
    obj.remove("mac");
    obj.remove("sig");
    let text = serde_json::to_string(&data).expect("json");
    hex::encode(SigningKey::from_bytes(key).sign(text.as_bytes()).to_bytes())
}

#[test]
fn a_reseal_with_a_later_epochs_key_and_a_kept_erased_key_are_named() {
    let env = Env::new("session").expect("the session boundary always forms");
    let (data, root_file, _, held) = signed_ledger(&env);
    let root = env.dir().join("forged");

    // Root edits a workload event after epoch 0's seal, recomputes the
    // chain, and signs every seal from there on again with the key it
    // finds in the key file (the open epoch's, later than all of them).
    let dir = copy(&data, &root, "resealed");
    let (open_epoch, found_key, _) = keys_in_file(&dir);
    let conn = crate::rules::open(&dir.join("ledger.db"));
    let mut evs: Vec<Ev> = all_events(&conn);
    let first_seal = evs
        .iter()
        .position(|e| e.2 == "ledger.seal" && e.3["op"] == "seal")
        .expect("a seal");
    let edited = evs[first_seal..]
        .iter()
        .position(|e| e.2 == "tree.created")
        .map(|i| i + first_seal)
        .expect("work after the first seal");
    evs[edited].3["label"] = "approved by alice".into();
    let epoch_of_edit = evs[edited..]
        .iter()
        .find(|e| e.2 == "ledger.seal")
        .and_then(|e| e.3["epoch"].as_u64())
        .expect("a seal after the edit");
    crate::seal::rewrite(&conn, &[], None);
    let mut prev = "0".repeat(64);
    for (i, (at, tree, kind, data)) in evs.iter().enumerate() {
        let seq = i as i64 + 1;
        let mut data = data.clone();
        if i > edited && kind == "ledger.seal" {
            data["head_seq"] = (seq - 1).into();
            data["head_hash"] = prev.clone().into();
            data["sig"] = recipe_sig(&found_key, &data).into();
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
    assert!(crate::rules::chain_consistent(&conn));
    drop(conn);
    assert!(
        open_epoch > epoch_of_edit,
        "the key root holds is a later one"
    );
    let (code, out, err) = verify(&dir, &seal_pub(&root_file));
    assert_eq!(code, Some(1), "{out} {err}");
    assert!(
        err.contains(&format!(
            "epoch {epoch_of_edit}: the seal's signature does not match its epoch's public key"
        )),
        "{err}"
    );
    // Its export says the same, with no data dir.
    let out = tw(&dir, &["export"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let file = env.dir().join("resealed.ndjson");
    std::fs::write(&file, &out.stdout).expect("write");
    let scratch = tempfile::tempdir().expect("temp dir");
    let (code, _, export_err) = verify(
        &scratch.path().join("none"),
        &[
            &seal_pub(&root_file)[..],
            &["--export", file.to_str().expect("utf-8")],
        ]
        .concat(),
    );
    assert_eq!(code, Some(1));
    assert_eq!(export_err, err, "the same verdict on the export");

    // An erased key kept: epoch 0's key in a copy of the key file made
    // at setup (here: written back as the setup left it).
    let dir = copy(&data, &root, "kept-key");
    let (_, k0) = held[0];
    std::fs::write(
        dir.join("seal.key.orig"),
        format!("{{\"epoch\":0,\"key\":\"{}\"}}\n", hex::encode(k0)),
    )
    .expect("write");
    let (code, out, err) = verify(&dir, &seal_pub(&root_file));
    assert_eq!(code, Some(1), "{out} {err}");
    assert!(
        err.contains("epoch 0's private key is still on disk, in ")
            && err.contains("seal.key.orig"),
        "{err}"
    );
    // The untouched ledger still passes.
    let (code, out, err) = verify(&data, &seal_pub(&root_file));
    assert_eq!(code, Some(0), "{out} {err}");
}

/// A crash between a seal's commit and the key file's overwrite: the file
/// still holds the sealed epoch's key (verify says so, naming the file),
/// the export in between still verifies (its trailer takes the next key,
/// which the seal certified), and the next sealer mends the file without
/// losing a certified key.
#[test]
fn a_crash_after_a_signed_seal_loses_no_key_and_the_next_sealer_mends_it() {
    if !treewarden::testhook::ENABLED {
        crate::util::skip("crash points exist in debug builds only (cargo test without --release)");
        return;
    }
    let env = Env::new("session").expect("the session boundary always forms");
    let data = env.data_dir();
    work(&data, 0);
    let root_file = env.dir().join("root.pub");
    setup_pub(&data, &root_file);
    seal_next(&data);
    let (epoch, _, _) = keys_in_file(&data);
    let sealed = epochs(&data).len();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let out = std::process::Command::new(crate::util::bin())
            .arg("--data-dir")
            .arg(&data)
            .args(["seal", "now"])
            .env("TREEWARDEN_TEST_CRASH_AT", "seal-committed")
            .env_remove("TREEWARDEN_DATA_DIR")
            .output()
            .expect("seal now");
        if epochs(&data).len() > sealed {
            assert_eq!(out.status.code(), None, "aborted: {}", text(&out.stderr));
            break;
        }
        assert!(std::time::Instant::now() < deadline, "an epoch ended");
        crate::seal::wait_for_due(&text(&out.stdout));
    }
    let (behind, _, _) = keys_in_file(&data);
    assert_eq!(behind, epoch, "the key file was not overwritten");
    assert_eq!(epochs(&data).last().copied(), Some(behind));
    let (code, _, err) = verify(&data, &seal_pub(&root_file));
    assert_eq!(code, Some(1));
    assert!(
        err.contains(&format!(
            "epoch {behind}'s private key is still on disk, in "
        )) && err.contains("seal.key"),
        "{err}"
    );
    // The export in between: sealed with the certified next key.
    let out = tw(&data, &["export"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let file = env.dir().join("between.ndjson");
    std::fs::write(&file, &out.stdout).expect("write");
    let scratch = tempfile::tempdir().expect("temp dir");
    let (code, out, err) = verify(
        &scratch.path().join("none"),
        &[
            &seal_pub(&root_file)[..],
            &["--export", file.to_str().expect("utf-8")],
        ]
        .concat(),
    );
    assert_eq!(code, Some(0), "{out} {err}");
    // The next sealer mends the file, and everything verifies.
    let out = tw(&data, &["seal", "close"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let got = epochs(&data);
    assert_eq!(got, (0..got.len() as u64).collect::<Vec<_>>(), "none twice");
    let (code, out, err) = verify(&data, &seal_pub(&root_file));
    assert_eq!(code, Some(0), "{out} {err}");
}

/// `serve` seals a public-key ledger on its own timer, and the API's export
/// of the live ledger verifies with the root alone.
#[test]
fn serve_seals_a_public_key_ledger_and_its_api_export_verifies() {
    let env = Env::new("session").expect("the session boundary always forms");
    let data = env.data_dir();
    work(&data, 0);
    let root_file = env.dir().join("root.pub");
    setup_pub(&data, &root_file);
    let _server = crate::seal::start_serve(&env);
    assert!(
        crate::util::wait_until(std::time::Duration::from_secs(20), || epochs(&data).len()
            >= 2),
        "the service seals"
    );
    let addr = std::fs::read_to_string(env.dir().join("addr")).expect("ready file");
    let token = std::fs::read_to_string(data.join("api-token")).expect("token");
    let body = reqwest::blocking::Client::new()
        .get(format!("http://{}/api/export", addr.trim()))
        .bearer_auth(token.trim())
        .send()
        .expect("GET /api/export")
        .text()
        .expect("body");
    let file = env.dir().join("api.ndjson");
    std::fs::write(&file, &body).expect("write");
    let scratch = tempfile::tempdir().expect("temp dir");
    let (code, out, err) = verify(
        &scratch.path().join("none"),
        &[
            &seal_pub(&root_file)[..],
            &["--export", file.to_str().expect("utf-8")],
        ]
        .concat(),
    );
    assert_eq!(code, Some(0), "{out} {err}");
    assert!(
        out.contains("the trailer (time, host, head, count) is sealed"),
        "{out}"
    );
    let (code, out, err) = verify(&data, &seal_pub(&root_file));
    assert_eq!(code, Some(0), "the live ledger: {out} {err}");
}
