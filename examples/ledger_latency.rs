//! Measures what a kill authorization costs: the commit latency (p50/p99 of
//! 200 `authorize_kill` calls, `synchronous=FULL`) next to a raw small
//! write + fsync on the same file system (and a NORMAL event write for scale).
//!
//! `cargo run --release --example ledger_latency [DIR]` (DIR defaults to the
//! system temp dir; pass a directory on the file system the ledger will use).

use std::io::Write;
use std::time::{Duration, Instant};

use treewarden::ledger::{
    IdentityRecord, KillTarget, Ledger, LedgerOptions, NewTree, OwnerKind, OwnerRecord,
};

const N: usize = 200;

fn percentiles(mut samples: Vec<Duration>) -> (Duration, Duration) {
    samples.sort_unstable();
    let at = |q: f64| samples[((samples.len() as f64 - 1.0) * q).round() as usize];
    (at(0.50), at(0.99))
}

fn main() -> anyhow::Result<()> {
    let base = std::env::args()
        .nth(1)
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let dir = tempfile::tempdir_in(&base)?;
    let identity = |pid| IdentityRecord {
        pid,
        start_ticks: 1,
        boot_id: "bench".into(),
    };

    let ledger = Ledger::open(&dir.path().join("ledger.db"), LedgerOptions::default())?;
    let owner = ledger.register_owner(&OwnerRecord {
        identity: identity(1),
        kind: OwnerKind::Run,
    })?;
    let tree = ledger.create_tree(&NewTree {
        label: Some("bench".into()),
        boundary: "session".into(),
        owner,
        argv: vec!["true".into()],
        cwd: None,
    })?;
    let targets = [KillTarget {
        kind: "group".into(),
        target: "4242".into(),
        identities: vec![identity(4242), identity(4243)],
    }];
    let mut auth = Vec::with_capacity(N);
    for _ in 0..N {
        let t = Instant::now();
        ledger.authorize_kill(tree, &targets, "bench")?;
        auth.push(t.elapsed());
    }

    let mut normal = Vec::with_capacity(N);
    for _ in 0..N {
        let t = Instant::now();
        ledger.kill_skipped(tree, "bench")?;
        normal.push(t.elapsed());
    }

    let mut raw = Vec::with_capacity(N);
    let mut file = std::fs::File::create(dir.path().join("raw"))?;
    let record = [0x5a_u8; 512];
    for _ in 0..N {
        let t = Instant::now();
        file.write_all(&record)?;
        file.sync_data()?;
        raw.push(t.elapsed());
    }

    let (a50, a99) = percentiles(auth);
    let (n50, n99) = percentiles(normal);
    let (r50, r99) = percentiles(raw);
    println!("file system: {}", base.display());
    println!("authorize_kill (FULL) x{N}: p50 {a50:?}  p99 {a99:?}");
    println!("kill_skipped (NORMAL) x{N}: p50 {n50:?}  p99 {n99:?}");
    println!("raw 512 B write+fdatasync x{N}: p50 {r50:?}  p99 {r99:?}");
    Ok(())
}
