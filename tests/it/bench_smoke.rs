//! The benchmark suite (`bench/run`, `examples/bench/main.rs`) at its smoke size:
//! benchmarks are not tests and stay out of the test run's time budget, but
//! this keeps the suite compiling and running. `cargo test` builds the
//! examples next to the test binary; the bench runs as its own process,
//! because it installs a reaper (only its own waiter may then wait).

use std::path::PathBuf;
use std::process::Command;

use crate::util::bin;

/// `target/<profile>/examples/bench`, built by `cargo test` with the tests.
fn bench_bin() -> PathBuf {
    bin()
        .parent()
        .expect("the binary lives in a target dir")
        .join("examples")
        .join("bench")
}

#[test]
fn bench_suite_runs_at_smoke_size() {
    let bench = bench_bin();
    assert!(
        bench.exists(),
        "{} missing: run the whole `cargo test` (it builds the examples)",
        bench.display()
    );
    let dir = tempfile::tempdir().expect("temp dir");
    let out = Command::new(&bench)
        .args(["--smoke", "--dir"])
        .arg(dir.path())
        .output()
        .expect("run the bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "bench --smoke failed: {}\n{stdout}\n{stderr}",
        out.status
    );
    // One table: every section has its row, next to its floor, with a ratio.
    for row in [
        "authority commit",
        "treewarden run -- true",
        "scan + classify",
        "sysinfo full process refresh",
        "teardown, 10 processes, session",
        "start → last orphan gone",
        "idle service: serve, 5 trees",
        "| api spawns | 8 callers",
        "| scaling (item 6)",
        "| ledger scale, ",
        "| 40 | fleet: ",
        "streamed stdio over loopback TCP",
        "growth: ",
    ] {
        assert!(stdout.contains(row), "no {row:?} row in:\n{stdout}");
    }
    assert!(stdout.contains('×'), "no ratios in:\n{stdout}");
}
