//! The benchmark suite: every cost measured next to its floor in
//! the same run, printed as one table with ratios.
//!
//! `bench/run` builds it with `--release` and runs it; `--smoke` runs every
//! section at a tiny size (the integration test `bench_smoke` does that, so
//! the suite keeps compiling and running in CI). Sections, in run order:
//!
//! 1. authority commit: `authorize_kill` (synchronous=FULL) p50/p99 vs a raw
//!    512-byte write + fdatasync on the same file system;
//! 2. spawn: `treewarden run -- true` end to end vs `sh -c true`;
//! 3. scan: `scan::snapshot` + `scan::classify` vs plain reads of every
//!    `/proc/<pid>/stat` (no parsing) vs a sysinfo full process refresh, at
//!    the base process count and with extra idle `sleep` children;
//! 4. recovery: N SIGTERM-ignoring orphans (grace 1 s) left by a
//!    SIGKILLed `treewarden serve`; a new `serve` on the same ledger, from its
//!    start to `/healthz` (floor: the same start on an empty ledger) and to
//!    the last orphan gone (floor: the grace itself, which every orphan must
//!    be given). Flat in N up to the sweep's concurrency bound (64); then
//!    auth: a TCP read with a bearer token (hashed, looked up in
//!    the ledger on every request) vs the same read under `--open-reads`;
//! 5. teardown: `Engine::teardown` of a SIGTERM-ignoring tree at grace 0, from
//!    the call to verified-empty, vs `cgroup.kill` + wait for `populated 0`
//!    (cgroup boundary) and `killpg(SIGKILL)` + wait until no live member is
//!    left (session boundary);
//! 6. ledger scale (`--only ledger`): one ledger grown through the
//!    ledger API (trees of 20 members) to 10k, 100k and 1M events; at each,
//!    `ls`, the dashboard index, a tree page, `/api/events` (medians of 30)
//!    and a whole export (throughput, peak RSS); targets: pages at 1M ≤ 1.5×
//!    those at 10k, export peak RSS ≤ 1.3×; then bytes per tree and per member.
//! 7. proofs (`--only proofs`): `verify` of a ledger of 1M events (trees of
//!    48 members: one `tree.created` in about 100 events), and of two
//!    1 %-filtered exports of it, which prove themselves: `--kind
//!    tree.created` (every event a run of its own, the proofs' worst case)
//!    and `--since` the newest 1 % (one run); each export's bytes over its
//!    plain events' (the proofs' overhead).
//!
//! The order matters: sections 2 to 4 and 6 wait for their children with
//! `std::process`, so they run before section 5 installs the reaper (this
//! process becomes the trees' subreaper; from then on only the reaper waits,
//! and every zombie a kill leaves behind is reaped by it, not counted).
//! Idle children are ended by their own pid at the end of their section.

mod api;

use std::collections::HashSet;
use std::ffi::OsString;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use treewarden::config::{BoundaryChoice, Config};
use treewarden::custody::{Engine, Origin, SpawnRequest, TeardownOptions, TreeWatch};
use treewarden::ledger::{
    IdentityRecord, KillTarget, Ledger, LedgerOptions, NewTree, OwnerKind, OwnerRecord,
};
use treewarden::proc::{Reaper, SpawnStdio};
use treewarden::scan;

mod fleet;
mod stdio;

/// How big each section runs.
struct Plan {
    commits: usize,
    spawns: usize,
    scan_iters: usize,
    /// Extra idle processes for the scan rows (item 1 uses 2,000).
    scan_extra: Vec<usize>,
    /// Tree sizes for the teardown rows (item 2 uses 1,000).
    tree_sizes: Vec<usize>,
    /// Teardowns (and floors) per size and boundary.
    teardown_reps: usize,
    /// Where the ledger and the raw fsync file live.
    dir: PathBuf,
    /// Orphan counts for the recovery rows, and the orphans' grace.
    recovery_sizes: Vec<usize>,
    recovery_grace: Duration,
    recovery_reps: usize,
    /// Reads per kind in the auth section.
    auth_reads: usize,
    /// Concurrent callers of the api section's levels, and each level's window.
    api_callers: Vec<usize>,
    api_window: Duration,
    /// Run only this section (`authority`, `spawn`, `scan`, `recovery`, `auth`, `api`, `teardown`, `idle`, `ledger`, `proofs`).
    only: Option<String>,
    /// Print each teardown's phase durations on stderr.
    phases: bool,
    /// Idle service: extra host processes, settle time, measured window.
    idle_extra: usize,
    idle_settle: Duration,
    idle_window: Duration,
    /// Ledger scale: sizes in events, members per tree,
    /// requests per page, trees for the growth measurement.
    scale_sizes: Vec<usize>,
    /// Live trees of 5 processes under one serve.
    live_trees: usize,
    scale_members: usize,
    scale_reps: usize,
    scale_growth_trees: usize,
}

impl Plan {
    fn from_args() -> anyhow::Result<Plan> {
        let mut smoke = false;
        let mut dir = std::env::temp_dir();
        let (mut only, mut phases, mut sizes, mut live) = (None, false, None, None);
        let mut args = std::env::args().skip(1);
        while let Some(a) = args.next() {
            match a.as_str() {
                "--smoke" => smoke = true,
                "--dir" => dir = args.next().map(PathBuf::from).unwrap_or(dir),
                "--only" => only = args.next(),
                "--phases" => phases = true,
                "--live-trees" => live = args.next().and_then(|n| n.parse::<usize>().ok()),
                "--sizes" => {
                    sizes = args.next().map(|s| {
                        s.split(',')
                            .filter_map(|n| n.trim().parse().ok())
                            .collect::<Vec<usize>>()
                    })
                }
                other => anyhow::bail!(
                    "unknown argument {other:?} (expected --smoke, --dir DIR, --only SECTION, --sizes N,N, --phases, --live-trees N)"
                ),
            }
        }
        let mut plan = if smoke {
            Plan {
                commits: 20,
                spawns: 3,
                scan_iters: 5,
                scan_extra: vec![0, 10],
                tree_sizes: vec![10],
                teardown_reps: 1,
                recovery_sizes: vec![1, 4],
                recovery_grace: Duration::from_millis(200),
                recovery_reps: 1,
                auth_reads: 20,
                api_callers: vec![1, 8],
                api_window: Duration::from_millis(300),
                dir,
                only,
                phases,
                idle_extra: 20,
                idle_settle: Duration::from_millis(500),
                idle_window: Duration::from_secs(2),
                scale_sizes: vec![1_000, 5_000],
                live_trees: 50,
                scale_members: 5,
                scale_reps: 3,
                scale_growth_trees: 20,
            }
        } else {
            Plan {
                commits: 1000,
                spawns: 30,
                scan_iters: 31,
                scan_extra: vec![0, 10, 100, 1000, 2000, 5000],
                tree_sizes: vec![10, 100, 1000, 5000],
                teardown_reps: 5,
                recovery_sizes: vec![1, 16, 64, 128],
                recovery_grace: Duration::from_secs(1),
                recovery_reps: 3,
                auth_reads: 2000,
                api_callers: vec![1, 50, 200],
                api_window: Duration::from_secs(5),
                dir,
                only,
                phases,
                idle_extra: 2000,
                idle_settle: Duration::from_secs(15),
                idle_window: Duration::from_secs(30),
                scale_sizes: vec![10_000, 100_000, 1_000_000],
                live_trees: 2_000,
                scale_members: 20,
                scale_reps: 30,
                scale_growth_trees: 1_000,
            }
        };
        if let Some(n) = live {
            plan.live_trees = n;
        }
        if let Some(sizes) = sizes {
            plan.scan_extra = sizes.clone();
            plan.tree_sizes = sizes;
        }
        Ok(plan)
    }

    fn runs(&self, section: &str) -> bool {
        self.only.as_deref().is_none_or(|o| o == section)
    }
}

/// Medians and p99 of a sample set.
#[derive(Clone, Copy)]
struct Stats {
    n: usize,
    p50: Duration,
    p99: Duration,
}

fn stats(mut samples: Vec<Duration>) -> Stats {
    samples.sort_unstable();
    let at = |q: f64| samples[((samples.len() as f64 - 1.0) * q).round() as usize];
    Stats {
        n: samples.len(),
        p50: at(0.50),
        p99: at(0.99),
    }
}

/// One line of the table: a measurement, its floor, the ratio, the target.
struct Row {
    item: String,
    what: String,
    ours: Stats,
    floor_name: String,
    floor: Stats,
    /// Compare p99 (authority) instead of the median.
    by_p99: bool,
    /// Target ratio (or, for spawn, an absolute overhead in ms).
    target: Target,
}

enum Target {
    Ratio(f64),
    OverheadMs(f64),
    None,
}

fn ms(d: Duration) -> String {
    format!("{:.3}", d.as_secs_f64() * 1e3)
}

fn print_table(rows: &[Row], idle: Option<&str>) {
    println!();
    println!(
        "| item | measured | n | median ms | p99 ms | floor | floor median ms | floor p99 ms | ratio | target | ok |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        let (a, b) = if r.by_p99 {
            (r.ours.p99, r.floor.p99)
        } else {
            (r.ours.p50, r.floor.p50)
        };
        let ratio = a.as_secs_f64() / b.as_secs_f64().max(1e-9);
        let (ratio_s, target_s, ok) = match r.target {
            Target::Ratio(t) => (
                format!("{ratio:.2}×{}", if r.by_p99 { " (p99)" } else { "" }),
                format!("≤ {t}×"),
                if ratio <= t { "yes" } else { "NO" },
            ),
            Target::OverheadMs(t) => {
                let over = (a.as_secs_f64() - b.as_secs_f64()) * 1e3;
                (
                    format!("+{over:.1} ms ({ratio:.2}×)"),
                    format!("≤ +{t} ms"),
                    if over <= t { "yes" } else { "NO" },
                )
            }
            Target::None => (format!("{ratio:.2}×"), "—".into(), "—"),
        };
        let p99 = |s: &Stats| {
            if s.n >= 20 { ms(s.p99) } else { "—".into() }
        };
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            r.item,
            r.what,
            r.ours.n,
            ms(r.ours.p50),
            p99(&r.ours),
            r.floor_name,
            ms(r.floor.p50),
            p99(&r.floor),
            ratio_s,
            target_s,
            ok
        );
    }
    if let Some(line) = idle {
        println!("{line}");
    }
}

fn main() -> anyhow::Result<()> {
    let plan = Plan::from_args()?;
    let mut rows = Vec::new();
    let work = tempfile::tempdir_in(&plan.dir)?;
    eprintln!(
        "bench: {} processes on the host, work dir {}",
        count_procs(),
        work.path().display()
    );

    if plan.runs("authority") {
        authority(&plan, work.path(), &mut rows)?;
    }
    if plan.runs("spawn") {
        spawn(&plan, work.path(), &mut rows)?;
    }
    if plan.runs("scan") {
        scans(&plan, &mut rows)?;
    }
    if plan.runs("recovery") {
        recovery(&plan, work.path(), &mut rows)?;
    }
    if plan.runs("auth") {
        auth(&plan, work.path(), &mut rows)?;
    }
    let api_lines = if plan.runs("api") {
        api::api(&plan, work.path(), &mut rows)?
    } else {
        Vec::new()
    };
    if plan.runs("stdio") {
        stdio::round_trips(&plan, work.path(), &mut rows)?;
    }
    // Before the teardowns: it waits for its children with std::process,
    // which the teardown section's reaper would take from it.
    let scale = if plan.runs("ledger") {
        ledger_scale(&plan, work.path())?
    } else {
        Vec::new()
    };
    let proven = if plan.runs("proofs") {
        proofs(&plan, work.path())?
    } else {
        Vec::new()
    };
    if plan.runs("fleet") {
        fleet::run(&plan, work.path())?;
    }
    if plan.runs("teardown") {
        teardowns(&plan, work.path(), &mut rows)?;
    }
    let idle = if plan.runs("idle") {
        Some(idle_service(&plan, work.path())?)
    } else {
        None
    };
    let live = if plan.runs("live") {
        Some(live_trees(&plan, work.path())?)
    } else {
        None
    };

    print_table(&rows, idle.as_deref());
    if let Some(line) = live {
        println!();
        println!("{line}");
    }
    if !api_lines.is_empty() {
        println!();
        println!("| api spawns | callers | ours | floor | target |");
        println!("|---|---|---|---|---|");
        for line in api_lines {
            println!("{line}");
        }
    }
    scaling(&rows);
    for line in scale {
        println!("{line}");
    }
    for line in proven {
        println!("{line}");
    }
    Ok(())
}

// ---------------------------------------------------------------- auth

/// What a token costs a read. Every TCP read with a token hashes it
/// and looks it up in the ledger (no cache: a revocation is effective on the
/// next request). Measured: `GET /api/trees/1` with the bearer token, on one
/// keep-alive connection; floor: the same read without a token on a service
/// started with `--open-reads` (no lookup). Alternated, so drift hits both.
fn auth(plan: &Plan, dir: &Path, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let bin = treewarden_bin()?;
    let data = dir.join("auth-data");
    let ready = dir.join("auth-ready");
    let _serve = Serve(serve_command(&bin, &data, &ready, None, &["--open-reads"]).spawn()?);
    let (_, addr) = until_healthy(&ready, Instant::now())?;
    let token = std::fs::read_to_string(data.join("api-token"))?;
    let http = reqwest::blocking::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(10))
        .build()?;
    let body = serde_json::json!({"argv": ["sleep", "300"], "grace": "100ms"});
    let r = http
        .post(format!("http://{addr}/api/trees"))
        .bearer_auth(token.trim())
        .json(&body)
        .send()?;
    anyhow::ensure!(r.status().as_u16() == 201, "spawn answered {}", r.status());
    let url = format!("http://{addr}/api/trees/1");
    let (mut ours, mut floor) = (Vec::new(), Vec::new());
    for _ in 0..plan.auth_reads {
        let t = Instant::now();
        let r = http.get(&url).bearer_auth(token.trim()).send()?;
        anyhow::ensure!(r.status().is_success(), "read with token: {}", r.status());
        r.bytes()?;
        ours.push(t.elapsed());
        let t = Instant::now();
        let r = http.get(&url).send()?;
        anyhow::ensure!(r.status().is_success(), "open read: {}", r.status());
        r.bytes()?;
        floor.push(t.elapsed());
    }
    rows.push(Row {
        item: "auth".into(),
        what: "GET /api/trees/1 with a bearer token (hash + ledger lookup)".into(),
        ours: stats(ours),
        floor_name: "the same read, --open-reads".into(),
        floor: stats(floor),
        by_p99: false,
        target: Target::None,
    });
    Ok(())
}

// ---------------------------------------------------------------- authority

fn identity(pid: i32) -> IdentityRecord {
    IdentityRecord {
        pid,
        start_ticks: 1,
        boot_id: "bench".into(),
    }
}

fn authority(plan: &Plan, dir: &Path, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    eprintln!("bench: authority commits x{}", plan.commits);
    let ledger = Ledger::open(&dir.join("authority.db"), LedgerOptions::default())?;
    let owner = ledger.register_owner(&OwnerRecord {
        identity: identity(1),
        kind: OwnerKind::Run,
    })?;
    let tree = ledger.create_tree(&NewTree {
        label: Some("bench".into()),
        boundary: treewarden::proc::BoundaryKind::Session,
        owner,
        argv: vec!["true".into()],
        cwd: None,
        grace_ms: None,
        timeout_ms: None,
        limits: Default::default(),
        first_signal: None,
    })?;
    let targets = [
        KillTarget {
            kind: treewarden::ledger::TargetKind::Group,
            target: "4242".into(),
            identities: vec![identity(4242), identity(4243), identity(4244)],
        },
        KillTarget {
            kind: treewarden::ledger::TargetKind::Pid,
            target: "4300".into(),
            identities: vec![identity(4300)],
        },
    ];
    let mut raw_file = std::fs::File::create(dir.join("raw-fsync"))?;
    let record = [0x5a_u8; 512];
    // Interleaved, so both see the same background load.
    let (mut auth, mut raw) = (Vec::new(), Vec::new());
    for _ in 0..plan.commits {
        let t = Instant::now();
        ledger.authorize_kill(tree, &targets, "bench")?;
        auth.push(t.elapsed());
        let t = Instant::now();
        raw_file.write_all(&record)?;
        raw_file.sync_data()?;
        raw.push(t.elapsed());
    }
    if plan.phases {
        // Which commits were slow: periodic ones point at WAL checkpoints.
        let mut slow: Vec<(usize, Duration)> = auth.iter().copied().enumerate().collect();
        slow.sort_by_key(|(_, d)| std::cmp::Reverse(*d));
        let slow: Vec<String> = slow[..slow.len().min(6)]
            .iter()
            .map(|(i, d)| format!("#{i} {}", ms(*d)))
            .collect();
        eprintln!("bench:   slowest authority commits: {}", slow.join(", "));
    }
    rows.push(Row {
        item: "3".into(),
        what: "authority commit (kill.authorized, 2 targets, FULL)".into(),
        ours: stats(auth),
        floor_name: "512 B write + fdatasync".into(),
        floor: stats(raw),
        by_p99: true,
        target: Target::Ratio(1.5),
    });
    Ok(())
}

// -------------------------------------------------------------------- spawn

/// The release (or debug) `treewarden` next to this example.
fn treewarden_bin() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .ok_or_else(|| anyhow::anyhow!("no target dir above {}", exe.display()))?;
    let bin = dir.join("treewarden");
    anyhow::ensure!(
        bin.exists(),
        "{} not built (bench/run builds it)",
        bin.display()
    );
    Ok(bin)
}

fn spawn(plan: &Plan, dir: &Path, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    eprintln!("bench: run -- true vs sh -c true, x{}", plan.spawns);
    let bin = treewarden_bin()?;
    let data = dir.join("spawn-data");
    let cgroup_root = BenchCgroup::create("spawn");
    let run = |cmd: &mut Command| -> anyhow::Result<Duration> {
        let t = Instant::now();
        let status = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()?;
        let d = t.elapsed();
        anyhow::ensure!(status.success(), "{cmd:?} failed: {status}");
        Ok(d)
    };
    let (mut ours, mut floor) = (Vec::new(), Vec::new());
    // The spawn floor, interleaved with the runs: mkdir a
    // cgroup, fdatasync, clone3 into it, exec `true`, wait, fdatasync,
    // rmdir (src/proc/sys/linux/floor.rs: raw syscalls, none of the custody code).
    // Only where a cgroup can be made.
    let mut spawn_floor = Vec::new();
    let truth = ["/usr/bin/true", "/bin/true"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .ok_or_else(|| anyhow::anyhow!("no true(1)"))?;
    let journal = dir.join("spawn-floor.journal");
    // One ledger for every run, created by an untimed first run: the
    // realistic case is a host whose ledger exists (its creation, the
    // schema's migrations and their fsyncs, happens once per host).
    for n in 0..=plan.spawns {
        let mut c = Command::new(&bin);
        c.env("TREEWARDEN_DATA_DIR", &data)
            .env_remove("TREEWARDEN_CGROUP_ROOT")
            .args(["run", "--", "true"]);
        match &cgroup_root {
            Some(root) => c
                .env("TREEWARDEN_BOUNDARY", "cgroup")
                .env("TREEWARDEN_CGROUP_ROOT", &root.0),
            None => c.env("TREEWARDEN_BOUNDARY", "session"),
        };
        let took = run(&mut c)?;
        if n == 0 {
            continue;
        }
        ours.push(took);
        floor.push(run(Command::new("sh").args(["-c", "true"]))?);
        if let Some(root) = &cgroup_root {
            let cg = root.0.join(format!("floor-{n}"));
            let t = Instant::now();
            let status = treewarden::proc::floor::spawn_floor(&cg, &truth, &journal)?;
            spawn_floor.push(t.elapsed());
            anyhow::ensure!(status == 0, "spawn floor: true exited {status}");
        }
    }
    let boundary = if cgroup_root.is_some() {
        "cgroup"
    } else {
        "session"
    };
    let ours_again = ours.clone();
    rows.push(Row {
        item: "4".into(),
        what: format!("`treewarden run -- true` end to end ({boundary}, ledger exists)"),
        ours: stats(ours),
        floor_name: "`sh -c true`".into(),
        floor: stats(floor),
        by_p99: false,
        // The target (was +30 ms).
        target: Target::OverheadMs(5.0),
    });
    if !spawn_floor.is_empty() {
        rows.push(Row {
            item: "30".into(),
            what: "`treewarden run -- true` end to end (cgroup, ledger exists)".into(),
            ours: stats(ours_again),
            floor_name: "spawn floor".into(),
            floor: stats(spawn_floor),
            by_p99: false,
            target: Target::Ratio(1.25),
        });
    }
    Ok(())
}

// ------------------------------------------------------------- idle service

/// utime + stime of a process, in clock ticks (`/proc/<pid>/stat` 14, 15).
fn cpu_ticks(pid: u32) -> anyhow::Result<u64> {
    stat_ticks(&format!("/proc/{pid}/stat"))
}

/// utime + stime from a `stat` file of `/proc` (a process's or a thread's).
fn stat_ticks(path: &str) -> anyhow::Result<u64> {
    let stat = std::fs::read_to_string(path)?;
    let rest = stat
        .rsplit_once(')')
        .ok_or_else(|| anyhow::anyhow!("bad stat"))?
        .1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After ") ": state is field 3, so utime (14) is index 11, stime index 12.
    Ok(f[11].parse::<u64>()? + f[12].parse::<u64>()?)
}

/// A `/proc/<pid>/status` value in KiB (`VmRSS`, `VmHWM`).
fn status_kib(pid: u32, key: &str) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no {key} in status"))
}

/// The serve process, ended by pid (SIGTERM: it tears its trees down).
struct Serve(Child);

impl Drop for Serve {
    fn drop(&mut self) {
        if let Some(pid) = rustix::process::Pid::from_raw(self.0.id() as i32) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        if !wait_until(Duration::from_secs(30), Duration::from_millis(20), || {
            matches!(self.0.try_wait(), Ok(Some(_)))
        }) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Item 5: the real `treewarden serve` with 5 owned trees and extra idle
/// host processes; its CPU (% of one core) over a window and its RSS.
fn idle_service(plan: &Plan, dir: &Path) -> anyhow::Result<String> {
    let bin = treewarden_bin()?;
    let data = dir.join("serve-data");
    let ready = dir.join("serve.ready");
    let cgroup_root = BenchCgroup::create("serve");
    let mut c = serve_command(&bin, &data, &ready, cgroup_root.as_ref(), &[]);
    let mut serve = Serve(c.spawn()?);
    let pid = serve.0.id();
    anyhow::ensure!(
        wait_until(Duration::from_secs(30), Duration::from_millis(20), || {
            ready.exists() || matches!(serve.0.try_wait(), Ok(Some(_)))
        }) && ready.exists(),
        "serve did not become ready"
    );
    let addr = std::fs::read_to_string(&ready)?;
    let token = std::fs::read_to_string(data.join("api-token"))?;
    let http = reqwest::blocking::Client::new();
    for i in 0..5 {
        let resp = http
            .post(format!("http://{}/api/trees", addr.trim()))
            .bearer_auth(token.trim())
            .json(
                &serde_json::json!({"argv": ["sleep", "3600"], "label": format!("bench-idle-{i}")}),
            )
            .send()?;
        anyhow::ensure!(
            resp.status().is_success(),
            "spawn through serve: {}",
            resp.status()
        );
    }
    let mut idle = Idle(Vec::new());
    idle.grow_to(plan.idle_extra)?;
    eprintln!(
        "bench: idle service (pid {pid}), 5 trees, +{} processes ({} on the host); settle {:?}, measure {:?}",
        plan.idle_extra,
        count_procs(),
        plan.idle_settle,
        plan.idle_window
    );
    std::thread::sleep(plan.idle_settle);
    let hz = rustix::param::clock_ticks_per_second() as f64;
    // The host's load beside the figure: other processes' forks and execs
    // reach serve's observer (those its socket filter passes).
    let load = || {
        std::fs::read_to_string("/proc/loadavg")
            .ok()
            .and_then(|l| l.split_whitespace().next().map(str::to_owned))
            .unwrap_or_default()
    };
    let load0 = load();
    let (t0, c0) = (Instant::now(), cpu_ticks(pid)?);
    std::thread::sleep(plan.idle_window);
    let (wall, c1) = (t0.elapsed(), cpu_ticks(pid)?);
    let cpu_pct = (c1 - c0) as f64 / hz / wall.as_secs_f64() * 100.0;
    let rss = status_kib(pid, "VmRSS")? as f64 / 1024.0;
    let hwm = status_kib(pid, "VmHWM")? as f64 / 1024.0;
    eprintln!(
        "bench:   serve: {:.2} % of a core over {:.1} s ({} ticks), RSS {rss:.1} MiB (peak {hwm:.1} MiB); 1-min load {load0} -> {}",
        cpu_pct,
        wall.as_secs_f64(),
        c1 - c0,
        load()
    );
    drop(serve); // SIGTERM: serve tears its 5 trees down
    drop(idle);
    // The targets (were 1 % and 25 MiB).
    let ok = cpu_pct <= 0.5 && rss <= 20.0;
    Ok(format!(
        "| 5 | idle service: serve, 5 trees, +{} processes, {:.0} s | — | {cpu_pct:.2} % core, RSS {rss:.1} MiB (peak {hwm:.1}) | | | | | | ≤ 0.5 % core, ≤ 20 MiB | {} |",
        plan.idle_extra,
        wall.as_secs_f64(),
        if ok { "yes" } else { "NO" }
    ))
}

// --------------------------------------------------------------- live trees

/// One `serve` holding `plan.live_trees` live trees of 5
/// processes each (spawned through the API as the admin token, so no
/// per-user cap): while they live, its CPU (% of a core) over the idle
/// window, RSS, open descriptors, `/healthz` p99 (200 requests) and spawn
/// p99 (50 more trees); then SIGTERM and the time until serve has exited
/// and no process of any tree is left. Targets: ≤ 1 % core, ≤ 100 MiB,
/// healthz p99 ≤ 10 ms, descriptors not one per tree.
fn live_trees(plan: &Plan, dir: &Path) -> anyhow::Result<String> {
    let bin = treewarden_bin()?;
    let data = dir.join("live-data");
    let ready = dir.join("live.ready");
    let cgroup = BenchCgroup::create("live");
    let mark = format!("live-{}", std::process::id());
    let _marked = Marked(mark.clone());
    let serve = start_serve(&bin, &data, &ready, cgroup.as_ref())?;
    let pid = serve.0.id();
    let (_, addr) = until_healthy(&ready, Instant::now())?;
    let token = std::fs::read_to_string(data.join("api-token"))?;
    let http = reqwest::blocking::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(30))
        .build()?;
    let body = serde_json::json!({
        "argv": ["sh", "-c", "sleep 3600 & sleep 3600 & sleep 3600 & sleep 3600 & exec sleep 3600"],
        "env": {"TW_BENCH_MARK": mark},
        "label": "bench-live",
    });
    let spawn_one = || -> anyhow::Result<Duration> {
        let t = Instant::now();
        let resp = http
            .post(format!("http://{addr}/api/trees"))
            .bearer_auth(token.trim())
            .json(&body)
            .send()?;
        anyhow::ensure!(resp.status().is_success(), "spawn: {}", resp.status());
        Ok(t.elapsed())
    };
    let n = plan.live_trees;
    eprintln!("bench: {n} live trees of 5 processes under one serve");
    let t = Instant::now();
    for _ in 0..n {
        spawn_one()?;
    }
    let all = n * 5;
    let up = wait_until(Duration::from_secs(120), Duration::from_millis(100), || {
        marked(&mark).len() >= all
    });
    anyhow::ensure!(up, "{all} processes did not start");
    eprintln!(
        "bench:   {n} trees spawned and running in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    std::thread::sleep(plan.idle_settle);
    let hz = rustix::param::clock_ticks_per_second() as f64;
    let (t0, c0) = (Instant::now(), cpu_ticks(pid)?);
    std::thread::sleep(plan.idle_window);
    let (wall, c1) = (t0.elapsed(), cpu_ticks(pid)?);
    let cpu_pct = (c1 - c0) as f64 / hz / wall.as_secs_f64() * 100.0;
    let floor = full_scan_floor(cgroup.as_ref());
    let floor_pct = floor.as_secs_f64() / FULL_SCAN_INTERVAL.as_secs_f64() * 100.0;
    let rss = status_kib(pid, "VmRSS")? as f64 / 1024.0;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))?.count();
    let mut healthz = Vec::new();
    for _ in 0..200 {
        let t = Instant::now();
        let ok = http
            .get(format!("http://{addr}/healthz"))
            .send()
            .is_ok_and(|r| r.status().is_success());
        anyhow::ensure!(ok, "/healthz failed");
        healthz.push(t.elapsed());
    }
    let mut spawns = Vec::new();
    for _ in 0..50 {
        spawns.push(spawn_one()?);
    }
    let (healthz, spawns) = (stats(healthz), stats(spawns));
    let total = all + 50 * 5;
    wait_until(Duration::from_secs(60), Duration::from_millis(100), || {
        marked(&mark).len() >= total
    });
    // Shutdown: serve ends every tree it owns, then exits.
    let t = Instant::now();
    if let Some(p) = rustix::process::Pid::from_raw(pid as i32) {
        rustix::process::kill_process(p, rustix::process::Signal::TERM)?;
    }
    // Not `try_wait`: the teardown section's reaper (installed earlier in
    // this process) may have reaped it. Gone from /proc, or a zombie.
    let exited = wait_until(Duration::from_secs(300), Duration::from_millis(20), || {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |s| {
            s.rsplit_once(')')
                .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
        })
    });
    let down = t.elapsed();
    let gone = wait_until(Duration::from_secs(60), Duration::from_millis(20), || {
        marked(&mark).is_empty()
    });
    let cleared = t.elapsed();
    anyhow::ensure!(exited, "shutdown: serve did not exit within 300 s");
    // A drain that left trees running (its bound cut it off: they stay
    // `terminating` for the next start) is a miss of this row, reported
    // with what was left; the bench's marker guard ends them.
    let left = marked(&mark).len();
    let shutdown = if gone {
        format!(
            "SIGTERM → exit {:.2} s, all {} trees gone {:.2} s",
            down.as_secs_f64(),
            n + 50,
            cleared.as_secs_f64()
        )
    } else {
        format!(
            "SIGTERM → exit {:.2} s, {left} of {total} processes still running 60 s later",
            down.as_secs_f64()
        )
    };
    eprintln!(
        "bench:   serve with {} live trees: {cpu_pct:.2} % core over {:.1} s (full-scan floor {floor_pct:.2} %: {:.1} ms each {} s), RSS {rss:.1} MiB, {fds} fds; healthz p99 {} ms, spawn p99 {} ms; SIGTERM → exit {} ms, → no process left {} ms",
        n + 50,
        wall.as_secs_f64(),
        floor.as_secs_f64() * 1e3,
        FULL_SCAN_INTERVAL.as_secs(),
        ms(healthz.p99),
        ms(spawns.p99),
        ms(down),
        ms(cleared)
    );
    let ok = gone
        && cpu_pct <= 1.0
        && rss <= 100.0
        && healthz.p99 <= Duration::from_millis(10)
        && fds < n;
    Ok(format!(
        "| 30 | live trees: serve with {n} trees × 5 processes | {cpu_pct:.2} % core idle (full-scan floor {floor_pct:.2} %, {:.2}×), RSS {rss:.1} MiB, {fds} fds, healthz p99 {} ms, spawn p99 {} ms, {shutdown} | ≤ 1 % core, ≤ 100 MiB, healthz p99 ≤ 10 ms, fds < trees, every tree gone on SIGTERM | {} |",
        cpu_pct / floor_pct.max(f64::MIN_POSITIVE),
        ms(healthz.p99),
        ms(spawns.p99),
        if ok { "yes" } else { "NO" }
    ))
}

// --------------------------------------------------------------------- scan

/// Idle children (`sleep`), ended by pid when dropped.
struct Idle(Vec<Child>);

impl Idle {
    fn grow_to(&mut self, n: usize) -> anyhow::Result<()> {
        while self.0.len() < n {
            let child = Command::new("sleep")
                .arg("3600")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()?;
            self.0.push(child);
        }
        Ok(())
    }
}

impl Drop for Idle {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
        }
        for c in &mut self.0 {
            let _ = c.wait();
        }
    }
}

fn count_procs() -> usize {
    std::fs::read_dir("/proc")
        .map(|d| {
            d.flatten()
                .filter(|e| e.file_name().to_str().is_some_and(is_pid))
                .count()
        })
        .unwrap_or(0)
}

fn is_pid(name: &str) -> bool {
    !name.is_empty() && name.bytes().all(|b| b.is_ascii_digit())
}

/// `serve`'s default `--full-scan-interval` (the live row's serve runs
/// with the defaults).
const FULL_SCAN_INTERVAL: Duration = Duration::from_secs(30);

/// The live row's floor: what one full scan cannot do without, in the
/// plainest code (none of treewarden's), timed on one thread, the least of
/// three: every `/proc/<pid>/stat` read (`raw_stat_walk`) and every tree
/// cgroup's `cgroup.procs` under the serve's cgroup root read, each with
/// plain `read` calls. Over the full-scan interval it is the least
/// average CPU a service that re-reads everything every interval can
/// take; the steady ticks between full scans are on top of it.
fn full_scan_floor(root: Option<&BenchCgroup>) -> Duration {
    let mut buf = Vec::with_capacity(1024);
    let cgroups: Vec<PathBuf> = root
        .and_then(|r| std::fs::read_dir(&r.0).ok())
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_str().is_some_and(|n| n.starts_with("tw-")))
        .map(|e| e.path().join("cgroup.procs"))
        .collect();
    (0..3)
        .map(|_| {
            let t = Instant::now();
            raw_stat_walk(&mut buf);
            for procs in &cgroups {
                if let Ok(mut f) = std::fs::File::open(procs) {
                    read_plain(&mut f, &mut buf);
                }
            }
            t.elapsed()
        })
        .min()
        .unwrap_or_default()
}

/// Reads `f` to its end into `buf` with plain `read` calls (no size probe:
/// `read_to_end` on a `File` asks `statx` and `lseek` first, two system
/// calls a floor does not need). `buf` stays at least 4 KiB long and is
/// not zeroed again (a floor reads; nothing looks at the bytes).
fn read_plain(f: &mut std::fs::File, buf: &mut Vec<u8>) -> bool {
    if buf.len() < 4096 {
        buf.resize(4096, 0);
    }
    let mut len = 0;
    loop {
        if len == buf.len() {
            buf.resize(len * 2, 0);
        }
        match f.read(&mut buf[len..]) {
            Ok(0) => return true,
            Ok(k) => len += k,
            Err(_) => return false,
        }
    }
}

/// The raw floor: every `/proc/<pid>/stat` read into one reused buffer, no parsing.
fn raw_stat_walk(buf: &mut Vec<u8>) -> usize {
    let mut n = 0;
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0;
    };
    let mut path = String::with_capacity(32);
    for entry in dir.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str().filter(|n| is_pid(n)) else {
            continue;
        };
        path.clear();
        path.push_str("/proc/");
        path.push_str(name);
        path.push_str("/stat");
        if let Ok(mut f) = std::fs::File::open(&path)
            && read_plain(&mut f, buf)
        {
            n += 1;
        }
    }
    n
}

fn scans(plan: &Plan, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let mut idle = Idle(Vec::new());
    let me = std::process::id() as i32;
    // A tree the classifier looks for (a group named by our own pid; getpgrp
    // reads 0 inside a pid namespace entered without a new session):
    // classify does the same work whatever it finds.
    let known = scan::KnownTree {
        id: treewarden::ledger::TreeId(1),
        pgid: me,
        sid: 1,
        ..Default::default()
    };
    let exclude = HashSet::from([me]);
    for &extra in &plan.scan_extra {
        idle.grow_to(extra)?;
        let procs = count_procs();
        eprintln!(
            "bench: scan at {procs} processes (+{extra} idle) x{}",
            plan.scan_iters
        );
        let mut sys = sysinfo::System::new()?;
        let (mut ours, mut raw, mut sysi) = (Vec::new(), Vec::new(), Vec::new());
        let mut buf = Vec::with_capacity(1024);
        // Warm-up, then interleave so all three see the same load.
        raw_stat_walk(&mut buf);
        let _ = scan::classify(&scan::snapshot(), std::slice::from_ref(&known), &exclude);
        for _ in 0..plan.scan_iters {
            let t = Instant::now();
            raw_stat_walk(&mut buf);
            raw.push(t.elapsed());

            let t = Instant::now();
            let snap = scan::snapshot();
            let f = scan::classify(&snap, std::slice::from_ref(&known), &exclude);
            ours.push(t.elapsed());
            std::hint::black_box(f);

            // What a user would reach for: a full process refresh from a
            // fresh System (no state carried from the previous iteration).
            let t = Instant::now();
            sys = sysinfo::System::new()?;
            sys.refresh_processes(sysinfo::ProcessesToUpdate::All, true);
            sysi.push(t.elapsed());
        }
        std::hint::black_box(&sys);
        let what = format!("scan + classify, {procs} processes (+{extra} idle)");
        let ours = stats(ours);
        let item = if extra == 0 || extra == 2000 {
            "1"
        } else {
            "6"
        };
        rows.push(Row {
            item: item.into(),
            what: what.clone(),
            ours,
            floor_name: "raw read of every /proc/<pid>/stat".into(),
            floor: stats(raw),
            by_p99: false,
            target: Target::Ratio(1.3),
        });
        if extra == 0 || extra == 2000 || plan.scan_extra.len() <= 2 {
            rows.push(Row {
                item: item.into(),
                what,
                ours,
                floor_name: "sysinfo full process refresh".into(),
                floor: stats(sysi),
                by_p99: false,
                target: Target::None,
            });
        }
    }
    Ok(())
}

// ----------------------------------------------------------------- recovery

/// Live processes whose environment carries `TW_BENCH_MARK=<mark>`.
fn marked(mark: &str) -> Vec<i32> {
    let needle = format!("TW_BENCH_MARK={mark}");
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(env) = std::fs::read(entry.path().join("environ")) else {
            continue;
        };
        let zombie = std::fs::read_to_string(entry.path().join("stat"))
            .ok()
            .and_then(|s| {
                s.rsplit_once(')')
                    .map(|(_, r)| r.trim_start().starts_with('Z'))
            })
            .unwrap_or(true);
        if !zombie && env.split(|b| *b == 0).any(|v| v == needle.as_bytes()) {
            out.push(pid);
        }
    }
    out
}

/// Ends the marked processes by pid (the orphans a failed run leaves).
struct Marked(String);

impl Drop for Marked {
    fn drop(&mut self) {
        for pid in marked(&self.0) {
            if let Some(pid) = rustix::process::Pid::from_raw(pid) {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
            }
        }
        wait_until(Duration::from_secs(10), Duration::from_millis(20), || {
            marked(&self.0).is_empty()
        });
    }
}

/// `treewarden serve` on `data` and loopback, writing `ready` (removed
/// first), with the cgroup boundary under `cgroup` or the session one, and
/// `extra` arguments; quiet. Not started.
fn serve_command(
    bin: &Path,
    data: &Path,
    ready: &Path,
    cgroup: Option<&BenchCgroup>,
    extra: &[&str],
) -> Command {
    let _ = std::fs::remove_file(ready);
    let mut c = Command::new(bin);
    c.env("TREEWARDEN_DATA_DIR", data)
        .env_remove("TREEWARDEN_CGROUP_ROOT")
        .args(["serve", "--listen", "127.0.0.1:0", "--ready-file"])
        .arg(ready)
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    match cgroup {
        Some(root) => c
            .env("TREEWARDEN_BOUNDARY", "cgroup")
            .env("TREEWARDEN_CGROUP_ROOT", &root.0),
        None => c.env("TREEWARDEN_BOUNDARY", "session"),
    };
    c
}

/// A `treewarden serve` on `data`; returns it once its ready file exists.
fn start_serve(
    bin: &Path,
    data: &Path,
    ready: &Path,
    cgroup: Option<&BenchCgroup>,
) -> anyhow::Result<Serve> {
    let mut c = serve_command(bin, data, ready, cgroup, &[]);
    // Serve's log (its per-teardown "teardown done" lines with their
    // phases) kept where `TW_BENCH_SERVE_LOG` says, for a profile.
    if let Some(path) = std::env::var_os("TW_BENCH_SERVE_LOG") {
        c.stderr(std::fs::File::create(path)?);
    }
    Ok(Serve(c.spawn()?))
}

/// From `t0` until `GET /healthz` answers 200 (the ready file gives the address).
fn until_healthy(ready: &Path, t0: Instant) -> anyhow::Result<(Duration, String)> {
    let http = reqwest::blocking::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(10))
        .build()?;
    let mut addr = String::new();
    let ok = wait_until(Duration::from_secs(30), Duration::from_millis(2), || {
        if addr.is_empty() {
            addr = std::fs::read_to_string(ready).unwrap_or_default();
        }
        !addr.is_empty()
            && http
                .get(format!("http://{}/healthz", addr.trim()))
                .send()
                .is_ok_and(|r| r.status().is_success())
    });
    anyhow::ensure!(ok, "serve did not answer /healthz");
    Ok((t0.elapsed(), addr.trim().to_string()))
}

/// One recovery: `n` orphans (grace `grace`) of a SIGKILLed service, then a
/// new service: (start → /healthz, start → last orphan gone).
fn recover_once(
    bin: &Path,
    dir: &Path,
    n: usize,
    grace: Duration,
    cgroup: Option<&BenchCgroup>,
) -> anyhow::Result<(Duration, Duration)> {
    static RUN: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let k = RUN.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let data = dir.join(format!("recovery-{k}"));
    let ready = dir.join(format!("recovery-{k}.ready"));
    let mark = Marked(format!("{}-{k}", std::process::id()));
    let mut first = start_serve(bin, &data, &ready, cgroup)?;
    let (_, addr) = until_healthy(&ready, Instant::now())?;
    let token = std::fs::read_to_string(data.join("api-token"))?;
    let http = reqwest::blocking::Client::builder().no_proxy().build()?;
    let grace_text = humantime::format_duration(grace).to_string();
    for _ in 0..n {
        let resp = http
            .post(format!("http://{addr}/api/trees"))
            .bearer_auth(token.trim())
            .json(&serde_json::json!({
                "argv": ["sh", "-c", "trap '' TERM; sleep 3600 & wait"],
                "env": { "TW_BENCH_MARK": mark.0 },
                "grace": grace_text,
            }))
            .send()?;
        anyhow::ensure!(resp.status().is_success(), "spawn: {}", resp.status());
    }
    anyhow::ensure!(
        wait_until(Duration::from_secs(60), Duration::from_millis(20), || {
            marked(&mark.0).len() >= 2 * n
        }),
        "orphans-to-be did not start"
    );
    // The crash: SIGKILL, reaped (no reaper is installed yet in this process).
    let _ = first.0.kill();
    let _ = first.0.wait();
    let t0 = Instant::now();
    let second = start_serve(bin, &data, &ready, cgroup)?;
    let (healthy, _) = until_healthy(&ready, t0)?;
    anyhow::ensure!(
        wait_until(Duration::from_secs(120), Duration::from_millis(2), || {
            marked(&mark.0).is_empty()
        }),
        "orphans survived the recovery"
    );
    let gone = t0.elapsed();
    drop(second);
    Ok((healthy, gone))
}

/// Recovery time of N orphans vs N, each next to its floor.
fn recovery(plan: &Plan, dir: &Path, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let bin = treewarden_bin()?;
    let cgroup = BenchCgroup::create("recovery");
    let boundary = if cgroup.is_some() {
        "cgroup"
    } else {
        "session"
    };
    let grace = plan.recovery_grace;
    // The floor of /healthz: the same start with nothing to recover.
    let mut empty = Vec::new();
    for _ in 0..plan.recovery_reps {
        empty.push(recover_once(&bin, dir, 0, grace, cgroup.as_ref())?.0);
    }
    let empty = stats(empty);
    for &n in &plan.recovery_sizes {
        eprintln!(
            "bench: recovery of {n} orphans (grace {}) on the {boundary} boundary x{}",
            humantime::format_duration(grace),
            plan.recovery_reps
        );
        let (mut healthy, mut gone) = (Vec::new(), Vec::new());
        for _ in 0..plan.recovery_reps {
            let (h, g) = recover_once(&bin, dir, n, grace, cgroup.as_ref())?;
            healthy.push(h);
            gone.push(g);
        }
        rows.push(Row {
            item: "12".into(),
            what: format!("recovery, {n} orphans, {boundary}, start → /healthz"),
            ours: stats(healthy),
            floor_name: "start → /healthz, empty ledger".into(),
            floor: empty,
            by_p99: false,
            target: Target::OverheadMs(1000.0),
        });
        rows.push(Row {
            item: "12".into(),
            what: format!(
                "recovery, {n} orphans, {boundary}, grace {}, start → last orphan gone",
                humantime::format_duration(grace)
            ),
            ours: stats(gone),
            floor_name: "the grace".into(),
            floor: stats(vec![grace; plan.recovery_reps]),
            by_p99: false,
            target: Target::OverheadMs(3000.0),
        });
    }
    Ok(())
}

// ----------------------------------------------------------------- teardown

/// A cgroup v2 directory for this bench's trees, removed when dropped.
struct BenchCgroup(PathBuf);

impl BenchCgroup {
    fn create(tag: &str) -> Option<BenchCgroup> {
        let own = treewarden::proc::own_cgroup_dir().ok().flatten()?;
        let dir = own.join(format!("tw-bench-{}-{tag}", std::process::id()));
        std::fs::create_dir(&dir).ok()?;
        if treewarden::proc::check_cgroup_writable(&dir).is_err() {
            let _ = std::fs::remove_dir(&dir);
            return None;
        }
        Some(BenchCgroup(dir))
    }
}

impl Drop for BenchCgroup {
    fn drop(&mut self) {
        // Tree cgroups below were removed by their teardowns; the floors' too.
        // Those a cut-off drain left (the live-trees row's miss) hold
        // processes the marker guard has just killed: each is waited for
        // until the kernel lets go of it (bounded), so none outlives the run.
        if let Ok(d) = std::fs::read_dir(&self.0) {
            for e in d.flatten() {
                if e.path().is_dir() {
                    let _ = treewarden::proc::remove_cgroup_when_empty(
                        &e.path(),
                        Duration::from_secs(5),
                    );
                }
            }
        }
        let _ = treewarden::proc::remove_cgroup_when_empty(&self.0, Duration::from_secs(5));
    }
}

/// `sh` that ignores SIGTERM (inherited by its children through exec),
/// starts `n - 1` sleeps and becomes the n-th.
fn tree_argv(n: usize) -> Vec<OsString> {
    let script = format!(
        "trap '' TERM; i=1; while [ $i -lt {n} ]; do sleep 3600 & i=$((i+1)); done; exec sleep 3600"
    );
    ["sh", "-c", &script].iter().map(OsString::from).collect()
}

/// Live (non-zombie) processes whose process group is `pgid`: a walk of
/// `/proc/<pid>/stat` (the state and pgid follow the last ')').
fn live_in_group(pgid: i32) -> usize {
    pids_in_group(pgid).len()
}

/// The pids of [`live_in_group`].
fn pids_in_group(pgid: i32) -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut pids = Vec::new();
    for entry in dir.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|n| is_pid(n))
            .and_then(|n| n.parse().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read(entry.path().join("stat")) else {
            continue;
        };
        let Some(close) = stat.iter().rposition(|&b| b == b')') else {
            continue;
        };
        let mut fields = stat[close + 1..]
            .split(|&b| b == b' ')
            .filter(|f| !f.is_empty());
        let state = fields.next().and_then(|s| s.first().copied());
        let _ppid = fields.next();
        let group = fields
            .next()
            .and_then(|f| std::str::from_utf8(f).ok())
            .and_then(|f| f.parse::<i32>().ok());
        if group == Some(pgid) && !matches!(state, Some(b'Z' | b'X')) {
            pids.push(pid);
        }
    }
    pids
}

fn populated(cgroup: &Path) -> bool {
    std::fs::read_to_string(cgroup.join("cgroup.events"))
        .map(|t| t.lines().any(|l| l == "populated 1"))
        .unwrap_or(false)
}

/// Polls `cond` every `every` until it holds or `limit` passes.
fn wait_until(limit: Duration, every: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while !cond() {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(every);
    }
    true
}

/// The floors poll this often: tight, so the floor is the kernel's time.
const FLOOR_POLL: Duration = Duration::from_micros(200);

struct Bench {
    engine: Engine,
    me: treewarden::proc::Identity,
    phases: bool,
    /// Every tree this bench started: if a measurement fails half-way,
    /// `Drop` tears down whichever is not yet terminal, through the engine
    /// (identity-checked, never a bare pgid that may have been reused).
    started: std::cell::RefCell<Vec<treewarden::ledger::TreeId>>,
}

impl Drop for Bench {
    fn drop(&mut self) {
        for tree in self.started.borrow().iter() {
            let open = matches!(
                self.engine.ledger().tree(*tree),
                Ok(Some(row)) if !row.state.is_terminal()
            );
            if open {
                let opts = TeardownOptions::new(Duration::ZERO, "bench cleanup", Origin::Kill);
                let _ = self.engine.teardown(*tree, &opts, &mut |_| {});
            }
        }
    }
}

impl Bench {
    /// Spawns an `n`-process tree and waits until all of it is running.
    fn tree(&self, n: usize) -> anyhow::Result<treewarden::custody::Spawned> {
        let spawned = self.engine.spawn(&SpawnRequest {
            argv: tree_argv(n),
            label: Some(format!("bench-{n}")),
            cwd: None,
            env: None,
            stdio: SpawnStdio::Null,
            owner: self.me.clone(),
            owner_kind: OwnerKind::Run,
            grace: None,
            timeout: None,
            limits: Default::default(),
            umask: None,
            first_signal: None,
            on_behalf: None,
        })?;
        let pgid = spawned.pgid;
        let cg = spawned.cgroup.clone();
        self.started.borrow_mut().push(spawned.tree);
        let full = wait_until(
            Duration::from_secs(60),
            Duration::from_millis(20),
            || match &cg {
                Some(dir) => scan::cgroup_pids(dir).is_ok_and(|p| p.len() >= n),
                None => live_in_group(pgid) >= n,
            },
        );
        anyhow::ensure!(full, "tree of {n} did not start within 60 s");
        // The owner's last periodic scan: members are known (and their
        // details recorded) before the teardown starts, as under `run`.
        if let Some(row) = self.engine.ledger().tree(spawned.tree)? {
            let exclude = HashSet::from([self.me.pid]);
            if let Some(mut watch) = TreeWatch::new(&row, &[], &exclude) {
                watch.tick(&self.engine, &Default::default());
                if self.phases {
                    // What one steady-state tick costs, next to its scan alone.
                    let t = Instant::now();
                    let snap = scan::snapshot();
                    let scan_only = t.elapsed();
                    std::hint::black_box(snap);
                    let t = Instant::now();
                    watch.tick(&self.engine, &Default::default());
                    eprintln!(
                        "bench:   tick of {n} known members: {} ms (snapshot alone {} ms)",
                        ms(t.elapsed()),
                        ms(scan_only)
                    );
                }
            }
        }
        Ok(spawned)
    }

    /// One teardown: (call → verified empty, call → return).
    fn teardown(&self, n: usize) -> anyhow::Result<(Duration, Duration)> {
        let spawned = self.tree(n)?;
        let mut opts = TeardownOptions::new(Duration::ZERO, "bench", Origin::Kill);
        opts.verify_timeout = Duration::from_secs(30);
        let t = Instant::now();
        let report = self.engine.teardown(spawned.tree, &opts, &mut |_| {})?;
        let d = t.elapsed();
        if self.phases {
            let p: Vec<String> = report
                .phases
                .iter()
                .map(|(p, d)| format!("{} {}", p.as_str(), ms(*d)))
                .collect();
            eprintln!("bench:   {n}: {} ms = {}", ms(d), p.join(", "));
        }
        anyhow::ensure!(
            report.members_at_start >= n && report.force_killed >= n,
            "teardown saw {} members, force-killed {} (expected {n})",
            report.members_at_start,
            report.force_killed
        );
        let verified = report
            .verified
            .ok_or_else(|| anyhow::anyhow!("teardown of {n} never verified the tree empty"))?;
        Ok((verified, d))
    }

    /// The evidence floor: the least work the mission's rules
    /// need for the same tree, in the plainest code, none of treewarden's:
    /// stop the tree (cgroup boundary: `cgroup.freeze` and wait for
    /// `frozen 1`; session: `killpg(SIGSTOP)`), list its members
    /// (`cgroup.procs`; session: a `/proc` walk by pgid), read each member's
    /// `stat` and `cmdline`, write a snapshot of them to a file with one
    /// `fdatasync`, kill (`cgroup.kill`; `killpg(SIGKILL)`), wait until the
    /// tree is empty. It is a floor for the teardown at grace 0: a SIGTERM
    /// round and the ledger's structure are not in it.
    fn evidence_floor(&self, n: usize, file: &Path) -> anyhow::Result<Duration> {
        use std::io::Write as _;
        let spawned = self.tree(n)?;
        let pgid = rustix::process::Pid::from_raw(spawned.pgid)
            .ok_or_else(|| anyhow::anyhow!("bad pgid"))?;
        let t = Instant::now();
        let pids: Vec<i32> = match &spawned.cgroup {
            Some(dir) => {
                std::fs::write(dir.join("cgroup.freeze"), "1")?;
                let frozen = wait_until(Duration::from_secs(30), FLOOR_POLL, || {
                    std::fs::read_to_string(dir.join("cgroup.events"))
                        .is_ok_and(|t| t.lines().any(|l| l == "frozen 1"))
                });
                anyhow::ensure!(frozen, "evidence floor: {n} never froze");
                std::fs::read_to_string(dir.join("cgroup.procs"))?
                    .lines()
                    .filter_map(|l| l.parse().ok())
                    .collect()
            }
            None => {
                rustix::process::kill_process_group(pgid, rustix::process::Signal::STOP)?;
                pids_in_group(spawned.pgid)
            }
        };
        let mut snapshot = Vec::with_capacity(pids.len() * 256);
        for pid in &pids {
            snapshot.extend(std::fs::read(format!("/proc/{pid}/stat")).unwrap_or_default());
            snapshot.extend(std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default());
            snapshot.push(b'\n');
        }
        let listed = t.elapsed();
        let mut f = std::fs::File::create(file)?;
        f.write_all(&snapshot)?;
        f.sync_data()?;
        let synced = t.elapsed();
        let gone = match &spawned.cgroup {
            Some(dir) => {
                std::fs::write(dir.join("cgroup.kill"), "1")?;
                wait_until(Duration::from_secs(30), FLOOR_POLL, || !populated(dir))
            }
            None => {
                rustix::process::kill_process_group(pgid, rustix::process::Signal::KILL)?;
                wait_until(Duration::from_secs(30), FLOOR_POLL, || {
                    live_in_group(spawned.pgid) == 0
                })
            }
        };
        let d = t.elapsed();
        if self.phases {
            eprintln!(
                "bench:   {n} evidence floor: {} ms = stop and list {}, snapshot and fdatasync {}, kill and wait {}",
                ms(d),
                ms(listed),
                ms(synced - listed),
                ms(d - synced)
            );
        }
        anyhow::ensure!(gone, "evidence floor of {n} did not finish");
        anyhow::ensure!(pids.len() >= n, "evidence floor saw {} of {n}", pids.len());
        let _ =
            self.engine
                .ledger()
                .end_tree(spawned.tree, treewarden::ledger::TreeState::Ended, None);
        if let Some(dir) = &spawned.cgroup {
            let _ = treewarden::proc::remove_cgroup_when_empty(dir, Duration::from_secs(5));
        }
        Ok(d)
    }

    /// The floor: the kernel's own kill of the same tree, waited for.
    fn floor(&self, n: usize) -> anyhow::Result<Duration> {
        let spawned = self.tree(n)?;
        let t = Instant::now();
        let gone = match &spawned.cgroup {
            Some(dir) => {
                std::fs::write(dir.join("cgroup.kill"), "1")?;
                wait_until(Duration::from_secs(30), FLOOR_POLL, || !populated(dir))
            }
            None => {
                let pgid = rustix::process::Pid::from_raw(spawned.pgid)
                    .ok_or_else(|| anyhow::anyhow!("bad pgid"))?;
                rustix::process::kill_process_group(pgid, rustix::process::Signal::KILL)?;
                wait_until(Duration::from_secs(30), FLOOR_POLL, || {
                    live_in_group(spawned.pgid) == 0
                })
            }
        };
        let d = t.elapsed();
        anyhow::ensure!(gone, "floor kill of {n} did not finish");
        // Close the tree in the ledger (its cgroup goes with the bench's).
        let _ =
            self.engine
                .ledger()
                .end_tree(spawned.tree, treewarden::ledger::TreeState::Ended, None);
        if let Some(dir) = &spawned.cgroup {
            let _ = treewarden::proc::remove_cgroup_when_empty(dir, Duration::from_secs(5));
        }
        Ok(d)
    }
}

fn teardowns(plan: &Plan, dir: &Path, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let reaper = Reaper::install()?;
    let me = treewarden::proc::self_identity()?;
    let cgroup = BenchCgroup::create("trees");
    let mut boundaries = vec![("session", BoundaryChoice::Session, None)];
    match &cgroup {
        Some(cg) => boundaries.insert(0, ("cgroup", BoundaryChoice::Cgroup, Some(cg.0.clone()))),
        None => eprintln!("bench: no writable cgroup v2 hierarchy: cgroup rows skipped"),
    }
    for (name, choice, root) in boundaries {
        let config = Config {
            data_dir: dir.join(format!("teardown-{name}")),
            boundary: choice,
            cgroup_root: root,
            busy_timeout: Duration::from_secs(5),
            ledger_reserve: treewarden::ledger::DEFAULT_RESERVE,
            // The teardown is measured, not the observer's bookkeeping.
            observer: treewarden::config::ObserverMode::Off,
            observer_rcvbuf: 0,
        };
        let ledger = Ledger::open(&config.ledger_path(), LedgerOptions::from_config(&config))?;
        let bench = Bench {
            engine: Engine::new(&config, ledger, Some(reaper))?,
            me: me.clone(),
            phases: plan.phases,
            started: Default::default(),
        };
        for &n in &plan.tree_sizes {
            let reps = if n >= 5000 {
                plan.teardown_reps.min(2)
            } else {
                plan.teardown_reps
            };
            eprintln!("bench: teardown of {n} processes on the {name} boundary x{reps}");
            let (mut ours, mut total, mut floor) = (Vec::new(), Vec::new(), Vec::new());
            let mut evidence = Vec::new();
            let snapshot_file = dir.join(format!("evidence-floor-{name}"));
            for _ in 0..reps {
                let (verified, returned) = bench.teardown(n)?;
                ours.push(verified);
                total.push(returned);
                floor.push(bench.floor(n)?);
                evidence.push(bench.evidence_floor(n, &snapshot_file)?);
            }
            let (floor_name, target) = if name == "cgroup" {
                ("cgroup.kill + wait populated 0", 1.5)
            } else {
                ("killpg(SIGKILL) + wait no live member", 1.5)
            };
            let floor = stats(floor);
            rows.push(Row {
                item: "30".into(),
                what: format!("teardown, {n} processes, {name}, grace 0, call → verified empty"),
                ours: stats(ours.clone()),
                floor_name: format!("evidence floor, {name}"),
                floor: stats(evidence),
                by_p99: false,
                target: Target::Ratio(1.25),
            });
            rows.push(Row {
                item: if n == 1000 { "2" } else { "6" }.into(),
                what: format!("teardown, {n} processes, {name}, grace 0, call → verified empty"),
                ours: stats(ours),
                floor_name: floor_name.into(),
                floor,
                by_p99: false,
                target: Target::Ratio(target),
            });
            // The same teardowns up to their return: what the verifying scan
            // concluded (every member's exit, the tree's end) written too.
            rows.push(Row {
                item: if n == 1000 { "2" } else { "6" }.into(),
                what: format!("  … call → return (exits and end recorded), {n}, {name}"),
                ours: stats(total),
                floor_name: floor_name.into(),
                floor,
                by_p99: false,
                target: Target::None,
            });
        }
    }
    Ok(())
}

// ------------------------------------------------------------------ scaling

/// Least-squares slope of median time over process count, per series.
fn scaling(rows: &[Row]) {
    let series = |prefix: &str, floor_prefix: &str| -> Vec<(f64, f64, f64)> {
        rows.iter()
            .filter(|r| r.what.starts_with(prefix) && r.floor_name.starts_with(floor_prefix))
            .filter_map(|r| {
                let n: f64 = r
                    .what
                    .split(|c: char| !c.is_ascii_digit() && c != ',')
                    .find(|w| !w.is_empty() && w.chars().any(|c| c.is_ascii_digit()))?
                    .replace(',', "")
                    .parse()
                    .ok()?;
                Some((
                    n,
                    r.ours.p50.as_secs_f64() * 1e3,
                    r.floor.p50.as_secs_f64() * 1e3,
                ))
            })
            .collect()
    };
    let fit = |pts: &[(f64, f64)]| -> Option<(f64, f64)> {
        if pts.len() < 2 {
            return None;
        }
        let n = pts.len() as f64;
        let mx = pts.iter().map(|p| p.0).sum::<f64>() / n;
        let my = pts.iter().map(|p| p.1).sum::<f64>() / n;
        let sxx: f64 = pts.iter().map(|p| (p.0 - mx).powi(2)).sum();
        let sxy: f64 = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
        let syy: f64 = pts.iter().map(|p| (p.1 - my).powi(2)).sum();
        let slope = sxy / sxx.max(1e-12);
        let r2 = if syy > 0.0 {
            (sxy * sxy) / (sxx * syy)
        } else {
            1.0
        };
        Some((slope, r2))
    };
    println!();
    println!("| scaling (item 6) | points | slope ours µs/process | r² | slope floor µs/process |");
    println!("|---|---|---|---|---|");
    for (label, prefix, floor) in [
        ("scan + classify (host processes)", "scan", "raw"),
        ("teardown, cgroup (tree size)", "teardown", "cgroup.kill"),
        ("teardown, session (tree size)", "teardown", "killpg"),
        (
            "teardown vs evidence floor, cgroup (tree size)",
            "teardown",
            "evidence floor, cgroup",
        ),
        (
            "teardown vs evidence floor, session (tree size)",
            "teardown",
            "evidence floor, session",
        ),
        (
            "recovery, start → last orphan gone (orphans)",
            "recovery",
            "the grace",
        ),
    ] {
        let pts = series(prefix, floor);
        let ours: Vec<(f64, f64)> = pts.iter().map(|p| (p.0, p.1)).collect();
        let flo: Vec<(f64, f64)> = pts.iter().map(|p| (p.0, p.2)).collect();
        if let (Some((s, r2)), Some((fs, _))) = (fit(&ours), fit(&flo)) {
            println!(
                "| {label} | {} | {:.2} | {r2:.3} | {:.2} |",
                pts.len(),
                s * 1e3,
                fs * 1e3
            );
        }
    }
}

// ------------------------------------------------------------ ledger scale

/// One size of the ledger-scale section.
struct ScaleRow {
    events: i64,
    trees: usize,
    build: Duration,
    db_bytes: u64,
    ls: Stats,
    index: Stats,
    tree_page: Stats,
    api_events: Stats,
    export_time: Duration,
    export_bytes: u64,
    export_peak_kib: u64,
}

/// Adds ended trees of `members` members (each: created, spawned, members
/// seen, exits, ended — what a real teardown writes) through the ledger
/// API until the head reaches `target` events. Returns the trees added.
fn grow_ledger(
    ledger: &Ledger,
    owner: treewarden::ledger::OwnerId,
    members: usize,
    target: i64,
    next_tree: &mut usize,
) -> anyhow::Result<usize> {
    use treewarden::ledger::{ExitRecord, MemberRecord, SpawnRecord, TreeState};
    let mut added = 0;
    while ledger.head()?.map_or(0, |(s, _)| s) < target {
        let t = *next_tree;
        *next_tree += 1;
        let id = ledger.create_tree(&NewTree {
            label: Some(format!("build-{}", t % 50)),
            boundary: treewarden::proc::BoundaryKind::Session,
            owner,
            argv: vec!["make".into(), "-j8".into(), format!("target-{t}")],
            cwd: Some("/srv/build".into()),
            grace_ms: Some(5_000),
            timeout_ms: Some(3_600_000),
            limits: Default::default(),
            first_signal: None,
        })?;
        let root = 3_000_000 + (t % 1_000_000) as i32;
        ledger.tree_spawned(
            id,
            &SpawnRecord {
                root: IdentityRecord {
                    pid: root,
                    start_ticks: t as u64,
                    boot_id: "bench".into(),
                },
                pgid: root,
                sid: root,
                cgroup: None,
            },
        )?;
        let seen: Vec<MemberRecord> = (0..members)
            .map(|m| MemberRecord {
                identity: IdentityRecord {
                    pid: root + m as i32,
                    start_ticks: (t * 100 + m) as u64,
                    boot_id: "bench".into(),
                },
                ppid: root,
                pgid: root,
                sid: root,
                cgroup: None,
                uid: Some(1000),
                exe: Some("/usr/lib/gcc/x86_64-linux-gnu/12/cc1".into()),
                cmdline: vec![
                    "cc1".into(),
                    "-quiet".into(),
                    "-O2".into(),
                    format!("src/module_{m}.c"),
                    "-o".into(),
                    format!("/tmp/cc{t}_{m}.s"),
                ],
                cwd: Some("/srv/build".into()),
            })
            .collect();
        ledger.observe_members(id, &seen)?;
        let exits: Vec<(IdentityRecord, Option<ExitRecord>)> = seen
            .into_iter()
            .map(|m| {
                (
                    m.identity,
                    Some(ExitRecord {
                        code: Some(0),
                        signal: None,
                        cpu_usec: None,
                    }),
                )
            })
            .collect();
        ledger.record_exits(id, &exits, "parent")?;
        ledger.end_tree(
            id,
            TreeState::Ended,
            Some(ExitRecord {
                code: Some(0),
                signal: None,
                cpu_usec: None,
            }),
        )?;
        added += 1;
    }
    Ok(added)
}

/// The ledger's bytes on disk (the main file and its WAL).
fn ledger_bytes(db: &Path) -> u64 {
    let size = |p: PathBuf| std::fs::metadata(p).map_or(0, |m| m.len());
    size(db.to_path_buf()) + size(db.with_extension("db-wal"))
}

/// Bytes per tree and per member: ledgers of `trees` trees with no members
/// and with `members` each, measured after the last connection closed (the
/// WAL checkpointed into the file).
fn growth(dir: &Path, trees: usize, members: usize) -> anyhow::Result<(f64, f64)> {
    let me = treewarden::proc::self_identity()?;
    let size_of = |m: usize| -> anyhow::Result<(u64, usize)> {
        let db = dir.join(format!("growth-{m}/ledger.db"));
        let ledger = Ledger::open(&db, LedgerOptions::default())?;
        let owner = ledger.register_owner(&OwnerRecord {
            identity: IdentityRecord {
                pid: me.pid,
                start_ticks: me.start_ticks,
                boot_id: me.boot_id.clone(),
            },
            kind: OwnerKind::Run,
        })?;
        let mut next = 0;
        // Events per tree: created, spawned, ended, and a sighting and
        // an exit per member; the loop stops at the first tree past it.
        let per_tree = 3 + 2 * m as i64;
        let made = grow_ledger(&ledger, owner, m, per_tree * trees as i64, &mut next)?;
        // Closing the last connection checkpoints the WAL into the file.
        drop(ledger);
        Ok((ledger_bytes(&db), made))
    };
    let (bare, bare_trees) = size_of(0)?;
    let (full, full_trees) = size_of(members)?;
    let per_tree = bare as f64 / bare_trees as f64;
    let per_member = (full as f64 / full_trees as f64 - per_tree) / members as f64;
    Ok((per_tree, per_member))
}

/// `treewarden export` to a pipe read at full speed: wall time, bytes, and
/// its peak RSS (VmHWM sampled at every read).
fn export_run(bin: &Path, data: &Path) -> anyhow::Result<(Duration, u64, u64)> {
    let t0 = Instant::now();
    let mut child = Command::new(bin)
        .env("TREEWARDEN_DATA_DIR", data)
        .arg("export")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let pid = child.id();
    let mut out = child
        .stdout
        .take()
        .ok_or_else(|| anyhow::anyhow!("no stdout"))?;
    let mut buf = vec![0u8; 256 * 1024];
    let (mut bytes, mut peak) = (0u64, 0u64);
    loop {
        if let Ok(kib) = status_kib(pid, "VmHWM") {
            peak = peak.max(kib);
        }
        match out.read(&mut buf)? {
            0 => break,
            n => bytes += n as u64,
        }
    }
    let status = child.wait()?;
    anyhow::ensure!(status.success(), "export failed: {status}");
    Ok((t0.elapsed(), bytes, peak))
}

/// The ledger's scale row: one ledger grown through the ledger API to each
/// size in turn; at each, `ls`, the dashboard's index, a tree page,
/// `/api/events`, and a whole export (throughput, peak RSS).
fn ledger_scale(plan: &Plan, dir: &Path) -> anyhow::Result<Vec<String>> {
    let bin = treewarden_bin()?;
    let data = dir.join("scale-data");
    let db = data.join("ledger.db");
    let ledger = Ledger::open(&db, LedgerOptions::default())?;
    let me = treewarden::proc::self_identity()?;
    let owner = ledger.register_owner(&OwnerRecord {
        identity: IdentityRecord {
            pid: me.pid,
            start_ticks: me.start_ticks,
            boot_id: me.boot_id.clone(),
        },
        kind: OwnerKind::Run,
    })?;
    // A few live trees (owned by this live process, never spawned, so
    // nothing to signal and no sweep takes them): what `ls` lists.
    for i in 0..5 {
        ledger.create_tree(&NewTree {
            label: Some(format!("live-{i}")),
            boundary: treewarden::proc::BoundaryKind::Session,
            owner,
            argv: vec!["sleep".into(), "infinity".into()],
            cwd: None,
            grace_ms: None,
            timeout_ms: None,
            limits: Default::default(),
            first_signal: None,
        })?;
    }
    let http = reqwest::blocking::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(60))
        .build()?;
    let mut next_tree = 0;
    let mut trees = 0;
    // Each size is kept as an online backup of the growing ledger, so the
    // pages of every size can be timed interleaved, under the same
    // background load (this machine is shared): a page at 1M events is
    // compared with the same page at 10k measured a moment before.
    let mut built: Vec<(i64, usize, Duration, PathBuf)> = Vec::new();
    for (i, &size) in plan.scale_sizes.iter().enumerate() {
        let t0 = Instant::now();
        trees += grow_ledger(
            &ledger,
            owner,
            plan.scale_members,
            size as i64,
            &mut next_tree,
        )?;
        let build = t0.elapsed();
        let events = ledger.head()?.map_or(0, |(s, _)| s);
        eprintln!(
            "bench: ledger grown to {events} events ({trees} trees) in {:.1} s",
            build.as_secs_f64()
        );
        let copy = dir.join(format!("scale-{i}"));
        std::fs::create_dir_all(&copy)?;
        ledger.backup_to(&copy.join("ledger.db"))?;
        built.push((events, trees, build, copy));
    }
    drop(ledger);
    let mut serves = Vec::new();
    for (i, (_, trees, _, data)) in built.iter().enumerate() {
        let ready = dir.join(format!("scale-ready-{i}"));
        let serve = start_serve(&bin, data, &ready, None)?;
        let (_, addr) = until_healthy(&ready, Instant::now())?;
        // Reads over TCP carry a token: the service's own.
        let token = std::fs::read_to_string(data.join("api-token"))?
            .trim()
            .to_string();
        // A tree in the middle of the ledger (ids 1..=5 are the live ones).
        serves.push((serve, addr, 5 + (trees / 2).max(1), token));
    }
    let n = built.len();
    let (mut ls, mut index, mut tree_page, mut api_events) = (
        vec![Vec::new(); n],
        vec![Vec::new(); n],
        vec![Vec::new(); n],
        vec![Vec::new(); n],
    );
    let timed = |url: String, token: &str| -> anyhow::Result<Duration> {
        let t0 = Instant::now();
        let r = http.get(&url).bearer_auth(token).send()?;
        anyhow::ensure!(r.status().is_success(), "GET {url}: {}", r.status());
        let _ = r.bytes()?;
        Ok(t0.elapsed())
    };
    for rep in 0..=plan.scale_reps {
        for (i, (_, _, _, data)) in built.iter().enumerate() {
            let (_, addr, mid, token) = &serves[i];
            let t0 = Instant::now();
            let out = Command::new(&bin)
                .env("TREEWARDEN_DATA_DIR", data)
                .arg("ls")
                .stdin(Stdio::null())
                .output()?;
            anyhow::ensure!(out.status.success(), "ls failed");
            let l = t0.elapsed();
            let ix = timed(format!("http://{addr}/?all=1"), token)?;
            let tp = timed(format!("http://{addr}/trees/{mid}"), token)?;
            let ev = timed(format!("http://{addr}/api/events"), token)?;
            if rep > 0 {
                // The first round warms each service up.
                ls[i].push(l);
                index[i].push(ix);
                tree_page[i].push(tp);
                api_events[i].push(ev);
            }
        }
    }
    drop(serves);
    let mut rows: Vec<ScaleRow> = Vec::new();
    for (i, (events, trees, build, data)) in built.iter().enumerate() {
        let (export_time, export_bytes, export_peak_kib) = export_run(&bin, data)?;
        rows.push(ScaleRow {
            events: *events,
            trees: *trees,
            build: *build,
            db_bytes: ledger_bytes(&data.join("ledger.db")),
            ls: stats(std::mem::take(&mut ls[i])),
            index: stats(std::mem::take(&mut index[i])),
            tree_page: stats(std::mem::take(&mut tree_page[i])),
            api_events: stats(std::mem::take(&mut api_events[i])),
            export_time,
            export_bytes,
            export_peak_kib,
        });
    }
    let (per_tree, per_member) = growth(dir, plan.scale_growth_trees, plan.scale_members)?;

    let mut out = vec![
        String::new(),
        format!(
            "| ledger scale, {} members per tree | events | trees | build s (from the previous size) | ledger MB | ls ms | index ms | tree page ms | /api/events ms | export s | export events/s | export MB/s | export peak RSS MiB |",
            plan.scale_members
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|".into(),
    ];
    for r in &rows {
        out.push(format!(
            "| | {} | {} | {:.1} | {:.1} | {} | {} | {} | {} | {:.2} | {:.0} | {:.1} | {:.1} |",
            r.events,
            r.trees,
            r.build.as_secs_f64(),
            r.db_bytes as f64 / 1e6,
            ms(r.ls.p50),
            ms(r.index.p50),
            ms(r.tree_page.p50),
            ms(r.api_events.p50),
            r.export_time.as_secs_f64(),
            r.events as f64 / r.export_time.as_secs_f64().max(1e-9),
            r.export_bytes as f64 / 1e6 / r.export_time.as_secs_f64().max(1e-9),
            r.export_peak_kib as f64 / 1024.0,
        ));
    }
    if let (Some(a), Some(b)) = (rows.first(), rows.last()) {
        let ratio = |x: Duration, y: Duration| y.as_secs_f64() / x.as_secs_f64().max(1e-9);
        let check = |r: f64, t: f64| if r <= t { "yes" } else { "NO" };
        let pages = [
            ("ls", ratio(a.ls.p50, b.ls.p50)),
            ("index", ratio(a.index.p50, b.index.p50)),
            ("tree page", ratio(a.tree_page.p50, b.tree_page.p50)),
            ("/api/events", ratio(a.api_events.p50, b.api_events.p50)),
        ];
        let rss = b.export_peak_kib as f64 / a.export_peak_kib.max(1) as f64;
        let mut line = format!(
            "{} → {} events (medians, timed interleaved):",
            a.events, b.events
        );
        for (name, r) in pages {
            line.push_str(&format!(" {name} {r:.2}× ({}, ≤ 1.5×);", check(r, 1.5)));
        }
        line.push_str(&format!(
            " export peak RSS {rss:.2}× ({}, ≤ 1.3×)",
            check(rss, 1.3)
        ));
        out.push(String::new());
        out.push(line);
    }
    out.push(format!(
        "growth: {per_tree:.0} bytes per tree (no members) and {per_member:.0} bytes per member ({} trees each way); 10,000 trees × 20 members a day ≈ {:.0} MB a day",
        plan.scale_growth_trees,
        (10_000.0 * per_tree + 200_000.0 * per_member) / 1e6
    ));
    Ok(out)
}

// ---------------------------------------------------------------- proofs

/// Section 7: `verify` of the largest scale size's ledger, and of two
/// 1 %-filtered exports of it (`verify --export`, no ledger at hand), with
/// each export's bytes over those of the plain events it holds.
fn proofs(plan: &Plan, dir: &Path) -> anyhow::Result<Vec<String>> {
    let bin = treewarden_bin()?;
    let data = dir.join("proofs-data");
    let ledger = Ledger::open(&data.join("ledger.db"), LedgerOptions::default())?;
    let me = treewarden::proc::self_identity()?;
    let owner = ledger.register_owner(&OwnerRecord {
        identity: IdentityRecord {
            pid: me.pid,
            start_ticks: me.start_ticks,
            boot_id: me.boot_id.clone(),
        },
        kind: OwnerKind::Run,
    })?;
    let target = plan.scale_sizes.last().copied().unwrap_or(1_000) as i64;
    let t0 = Instant::now();
    grow_ledger(&ledger, owner, 48, target, &mut 0)?;
    let build = t0.elapsed();
    let events = ledger.head()?.map_or(0, |(s, _)| s);
    // The time from which the newest 1 % of the events were written.
    let newest = ledger.events(&treewarden::ledger::EventFilter {
        newest_first: true,
        limit: Some((events as usize / 100).max(1)),
        ..Default::default()
    })?;
    let since = newest.last().map(|e| e.at.clone()).unwrap_or_default();
    drop(ledger);
    let run = |args: &[&str]| -> anyhow::Result<(Duration, Vec<u8>)> {
        let t0 = Instant::now();
        let out = Command::new(&bin)
            .env("TREEWARDEN_DATA_DIR", &data)
            .args(args)
            .stdin(Stdio::null())
            .output()?;
        let took = t0.elapsed();
        anyhow::ensure!(
            out.status.success(),
            "treewarden {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
        Ok((took, out.stdout))
    };
    let (verify, _) = run(&["verify"])?;
    let mut lines = vec![
        String::new(),
        format!(
            "| proofs: {events} events (built in {:.0} s) | events | export s | export bytes | plain event bytes | proof bytes | overhead | verify s |",
            build.as_secs_f64()
        ),
        "|---|---|---|---|---|---|---|---|".to_string(),
        format!(
            "| `verify` of the ledger | {events} | | | | | | {:.2} |",
            verify.as_secs_f64()
        ),
    ];
    let file = dir.join("proofs-export.ndjson");
    let file_s = file.to_string_lossy().into_owned();
    for (name, args) in [
        (
            "`export --kind tree.created` (each its own run), `verify --export`",
            vec!["export", "--kind", "tree.created"],
        ),
        (
            "`export --since` the newest 1 % (one run), `verify --export`",
            vec!["export", "--since", since.as_str()],
        ),
    ] {
        let (took, body) = run(&args)?;
        let (mut taken, mut plain) = (0u64, 0u64);
        for line in body.split(|b| *b == b'\n') {
            if line.starts_with(b"{\"seq\":") {
                taken += 1;
                plain += line.len() as u64 + 1;
            }
        }
        let total = body.len() as u64;
        std::fs::write(&file, &body)?;
        let (checked, _) = run(&["verify", "--export", &file_s])?;
        let proof = total.saturating_sub(plain);
        lines.push(format!(
            "| {name} | {taken} | {:.2} | {total} | {plain} | {proof} | {:.0} % | {:.2} |",
            took.as_secs_f64(),
            100.0 * proof as f64 / plain.max(1) as f64,
            checked.as_secs_f64()
        ));
        let _ = std::fs::remove_file(&file);
    }
    let _ = std::fs::remove_dir_all(&data);
    Ok(lines)
}
