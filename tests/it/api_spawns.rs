//! Concurrent spawns over the API: 200 callers at once, each tree's record
//! checked field by field against what its root printed (its pid and its
//! argv's marker), the chain verified. Concurrent writes share commits
//! (the ledger's group commit), so this is where a row given to the wrong
//! caller, or a write answered before its own commit, would show.

use std::process::Command;
use std::time::Duration;

use serde_json::Value;

use crate::serve::Server;
use crate::util::{bin, wait_until};

const CALLERS: usize = 200;

#[test]
fn two_hundred_concurrent_spawns_each_get_their_own_record_and_the_chain_verifies() {
    let s = Server::start(&["--max-connections-per-uid", "256"]);
    let answers: Vec<(usize, Value, Value)> = std::thread::scope(|scope| {
        let calls: Vec<_> = (0..CALLERS)
            .map(|i| {
                let s = &s;
                scope.spawn(move || {
                    let mut body = s.body(&format!("echo \"$$ marker-{i}\""));
                    body["label"] = Value::String(format!("caller-{i}"));
                    let (status, row) = s.post("/api/trees", Some(&body));
                    assert_eq!(status, 201, "caller {i}: {row}; log: {}", s.stderr());
                    (i, body, row)
                })
            })
            .collect();
        calls
            .into_iter()
            .map(|c| c.join().expect("a caller panicked"))
            .collect()
    });
    let mut ids = std::collections::HashSet::new();
    for (i, body, row) in &answers {
        let id = row["id"].as_i64().expect("tree id");
        assert!(ids.insert(id), "tree {id} answered to two callers");
        assert_eq!(row["argv"], body["argv"], "caller {i}: tree {id}'s argv");
        assert_eq!(row["label"], body["label"], "caller {i}: tree {id}'s label");
        let pid = row["root_pid"].as_i64().expect("root pid");
        let log = s.data_dir().join("logs").join(format!("tree-{id}.log"));
        let mut printed = String::new();
        let up = wait_until(Duration::from_secs(60), || {
            printed = std::fs::read_to_string(&log).unwrap_or_default();
            printed.ends_with('\n')
        });
        assert!(
            up,
            "caller {i}: tree {id} printed nothing in {}",
            log.display()
        );
        assert_eq!(
            printed,
            format!("{pid} marker-{i}\n"),
            "caller {i}: tree {id}'s root printed another pid or marker"
        );
        // The record as read back is the record answered.
        let read = &s.tree(id)["tree"];
        for field in [
            "argv",
            "label",
            "root_pid",
            "pgid",
            "sid",
            "root_start_ticks",
            "boot_id",
        ] {
            assert_eq!(read[field], row[field], "caller {i}: tree {id}'s {field}");
        }
        assert_eq!(
            read["pgid"].as_i64(),
            Some(pid),
            "tree {id}: its root leads its group"
        );
    }
    // Every tree ends (its root printed and exited), then the export holds
    // one tree.created and one tree.spawned per tree, the latter with the
    // root the caller was told.
    let ended = wait_until(Duration::from_secs(120), || {
        answers.iter().all(|(_, _, row)| {
            let id = row["id"].as_i64().unwrap_or_default();
            !s.tree(id)["tree"]["ended_at"].is_null()
        })
    });
    assert!(ended, "not every tree ended; log: {}", s.stderr());
    let r = s.get("/api/export?format=ndjson");
    assert_eq!(r.status(), 200);
    let events = crate::util::parse_ndjson(&r.text().expect("export"));
    for (i, _, row) in &answers {
        let id = row["id"].as_i64().expect("tree id");
        let of = |kind: &str| -> Vec<&Value> {
            events
                .iter()
                .filter(|e| e["tree"].as_i64() == Some(id) && e["kind"] == kind)
                .collect()
        };
        assert_eq!(of("tree.created").len(), 1, "caller {i}: tree {id}");
        let spawned = of("tree.spawned");
        assert_eq!(spawned.len(), 1, "caller {i}: tree {id}");
        assert_eq!(
            spawned[0]["data"]["root"]["pid"], row["root_pid"],
            "caller {i}: tree {id}"
        );
        assert_eq!(
            spawned[0]["data"]["pgid"], row["pgid"],
            "caller {i}: tree {id}"
        );
    }
    let out = Command::new(bin())
        .env("TREEWARDEN_DATA_DIR", s.data_dir())
        .arg("verify")
        .output()
        .expect("verify");
    assert!(
        out.status.success(),
        "verify: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
