//! The fleet rows (`--only fleet`): what shipping the audit trail to NATS
//! JetStream costs a host, beside a floor, and how fast `fleet serve`
//! verifies many hosts' streams. docs/FLEET.md reads these figures.
//!
//! 1. shipping at N live trees: two runs of one `serve` holding
//!    `plan.live_trees` live trees of 5 processes (made as the live section
//!    makes them) while short trees are spawned at a fixed rate (each ends by
//!    itself: the events), one run with `--ship nats://…` and one without;
//!    side by side, serve's CPU (utime + stime over the window) by thread
//!    and RSS; what shipping costs is its own threads' CPU (`tw-ship-nats`,
//!    its runtime, and `ledger-ship`, its ledger connection's owner: all of
//!    its work runs there), since the whole serve's moves between two runs
//!    by more than the target with the /proc walks of tree ends; the events
//!    made and shipped a second,
//!    `treewarden_ship_lag_events` sampled every 100 ms, and each event's
//!    seconds from its commit (its `at`) to its delivery by a consumer of
//!    the stream (stored, then delivered: an upper bound of commit → ack);
//! 2. a backlog: `treewarden ship` of a copy of that ledger under another
//!    host id (process start and connection included), beside its floor:
//!    raw async-nats JetStream publishes of the same events' bytes, each
//!    ack awaited before the next publish;
//! 3. verification: H hosts' streams (the ledger's first K real events
//!    under each of H host ids, interleaved as a fleet ships them, published
//!    by a driver here with the shipper's ids), then one `fleet serve` from
//!    an empty index: events a second until every host's verdict covers its
//!    head (read from its `/metrics`), its CPU and peak RSS.
//!
//! `nats-server` comes from PATH: a one-node JetStream on 127.0.0.1 with a
//! port and a store dir of its own, ended by its pid. Without it the rows
//! say "skipped: no nats-server". Every child here is waited for with
//! `std::process`, so the section runs before the teardown section's reaper.

use std::collections::{BTreeMap, VecDeque};
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use async_nats::jetstream::{self, stream};
use futures_util::StreamExt;

use super::{
    BenchCgroup, Marked, Plan, Serve, cpu_ticks, marked, ms, serve_command, stat_ticks, stats,
    status_kib, treewarden_bin, until_healthy, wait_until,
};

/// How big the section runs.
struct Size {
    trees: usize,
    /// Short trees spawned a second during the window.
    churn: f64,
    settle: Duration,
    window: Duration,
    /// Verification: hosts, and events per host.
    hosts: usize,
    per_host: usize,
    /// How long `fleet serve` is given to verify them all.
    verify_limit: Duration,
}

/// The host id the measured serve ships under.
const HOST: &str = "bench-ship";

/// The section: prints its rows (after a header of their own) on stdout.
pub(super) fn run(plan: &Plan, dir: &Path) -> anyhow::Result<()> {
    let smoke = std::env::args().any(|a| a == "--smoke");
    let size = if smoke {
        Size {
            trees: plan.live_trees.min(20),
            churn: 5.0,
            settle: Duration::from_millis(500),
            window: Duration::from_secs(2),
            hosts: 5,
            per_host: 30,
            verify_limit: Duration::from_secs(60),
        }
    } else {
        Size {
            trees: plan.live_trees,
            churn: 10.0,
            settle: Duration::from_secs(5),
            window: plan.idle_window,
            hosts: 500,
            per_host: 200,
            verify_limit: Duration::from_secs(90),
        }
    };
    println!();
    println!("| item | measured | figures | target | ok |");
    println!("|---|---|---|---|---|");
    let Some(exe) = nats_server_exe() else {
        println!(
            "| 40 | fleet: shipping, its floor, verification | skipped: no nats-server on PATH (Debian package nats-server) | — | — |"
        );
        return Ok(());
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let nats = NatsServer::start(&exe, dir, "ship", &rt)?;
    eprintln!(
        "bench: fleet: {} live trees, {} short trees/s for {:?}; nats-server pid {}",
        size.trees,
        size.churn,
        size.window,
        nats.child.id()
    );
    let bare = host_run(&size, dir, "bare", None, &rt)?;
    let shipped = host_run(&size, dir, "ship", Some(&nats.url()), &rt)?;
    println!("{}", shipping_row(&size, &bare, &shipped));
    let (backlog_row, events) = backlog(dir, &shipped.data, &nats, &rt)?;
    println!("{backlog_row}");
    drop(nats);
    let per_host = events.into_iter().take(size.per_host).collect::<Vec<_>>();
    println!("{}", verification(dir, &exe, &size, &per_host, &rt)?);
    Ok(())
}

// ------------------------------------------------------------- nats-server

/// `nats-server` on PATH, if any.
fn nats_server_exe() -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("nats-server"))
            .find(|p| p.is_file())
    })
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// A one-node JetStream on loopback, its store in a dir of its own, ended
/// by its pid when dropped.
struct NatsServer {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl NatsServer {
    fn start(
        exe: &Path,
        parent: &Path,
        tag: &str,
        rt: &tokio::runtime::Runtime,
    ) -> anyhow::Result<NatsServer> {
        let dir = tempfile::Builder::new()
            .prefix(&format!("nats-{tag}-"))
            .tempdir_in(parent)?;
        let port = free_port()?;
        let config = dir.path().join("nats.conf");
        std::fs::write(
            &config,
            format!(
                "server_name: bench-{tag}\nlisten: 127.0.0.1:{port}\nhttp: 0\njetstream {{\n  store_dir: \"{}\"\n}}\n",
                dir.path().join("store").display()
            ),
        )?;
        let log = std::fs::File::create(dir.path().join("nats.log"))?;
        let child = Command::new(exe)
            .arg("-c")
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()?;
        let server = NatsServer {
            child,
            port,
            _dir: dir,
        };
        let url = server.url();
        // Ready once JetStream answers for streams ("not found").
        let ready = wait_until(Duration::from_secs(30), Duration::from_millis(50), || {
            rt.block_on(async {
                let Ok(client) = async_nats::connect(url.as_str()).await else {
                    return false;
                };
                match jetstream::new(client).get_stream("TW_READY_PROBE").await {
                    Ok(_) => true,
                    Err(e) => e.to_string().contains("not found"),
                }
            })
        });
        anyhow::ensure!(ready, "nats-server on port {port} did not become ready");
        Ok(server)
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        // Child::kill signals this child's own pid.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn js(url: &str) -> anyhow::Result<jetstream::Context> {
    Ok(jetstream::new(async_nats::connect(url).await?))
}

// ------------------------------------------------------ shipping at N trees

/// What one run of serve (with or without `--ship`) measured.
struct HostRun {
    data: PathBuf,
    spawn_secs: f64,
    wall: Duration,
    cpu_pct: f64,
    /// Each thread name's share of a core over the window (of the threads
    /// alive at its end: a blocking-pool thread that ended within it is
    /// only in `cpu_pct`): the shipper's
    /// work is all on its own two (`tw-ship-nats`, its runtime; and
    /// `ledger-ship`, its ledger connection's owner thread).
    threads: BTreeMap<String, f64>,
    rss_mib: f64,
    hwm_mib: f64,
    /// Ledger events made, and acknowledged by the stream, over the window.
    made: f64,
    acked: f64,
    lag: Vec<f64>,
    /// Commit → delivered by a consumer of the stream, per event.
    latency: Vec<Duration>,
    /// From the window's end until the lag was 0.
    drained: Option<Duration>,
}

/// serve with its ship and lag gauges, `--ship` or not.
fn start_serve(
    bin: &Path,
    data: &Path,
    ready: &Path,
    cgroup: Option<&BenchCgroup>,
    ship: Option<&str>,
) -> anyhow::Result<Serve> {
    let ship = ship.map_or(Vec::new(), |url| {
        vec!["--ship", url, "--ship-host-id", HOST]
    });
    Ok(Serve(
        serve_command(bin, data, ready, cgroup, &ship).spawn()?,
    ))
}

/// `name value` from a Prometheus text page.
fn gauge(page: &str, name: &str) -> Option<f64> {
    page.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

/// utime + stime of `pid`'s threads, summed by thread name, in ticks.
fn threads_ticks(pid: u32) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for t in std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let Ok(name) = std::fs::read_to_string(t.path().join("comm")) else {
            continue;
        };
        let Some(tid) = t.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if let Ok(ticks) = cpu_ticks_task(pid, tid) {
            *out.entry(name.trim().to_string()).or_default() += ticks;
        }
    }
    out
}

fn cpu_ticks_task(pid: u32, tid: u32) -> anyhow::Result<u64> {
    stat_ticks(&format!("/proc/{pid}/task/{tid}/stat"))
}

/// Every event's commit → delivery, from a consumer of the host's subject
/// made now (new messages only), until `stop`.
fn latency_probe(
    url: &str,
    rt: &tokio::runtime::Runtime,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<tokio::task::JoinHandle<Vec<Duration>>> {
    use async_nats::jetstream::consumer;
    let messages = rt.block_on(async {
        let stream = js(url).await?.get_stream("TREEWARDEN").await?;
        let consumer = stream
            .create_consumer(consumer::pull::OrderedConfig {
                filter_subject: format!("treewarden.{HOST}.events"),
                deliver_policy: consumer::DeliverPolicy::New,
                ..Default::default()
            })
            .await?;
        anyhow::Ok(consumer.messages().await?)
    })?;
    Ok(rt.spawn(async move {
        let mut messages = messages;
        let mut out = Vec::new();
        while !stop.load(Ordering::SeqCst) {
            let next = tokio::time::timeout(Duration::from_millis(100), messages.next()).await;
            let Ok(Some(Ok(m))) = next else { continue };
            let now = SystemTime::now();
            let at = serde_json::from_slice::<serde_json::Value>(&m.payload)
                .ok()
                .and_then(|v| humantime::parse_rfc3339(v["at"].as_str()?).ok());
            if let Some(at) = at {
                out.push(now.duration_since(at).unwrap_or_default());
            }
        }
        out
    }))
}

fn host_run(
    size: &Size,
    dir: &Path,
    tag: &str,
    ship: Option<&str>,
    rt: &tokio::runtime::Runtime,
) -> anyhow::Result<HostRun> {
    let bin = treewarden_bin()?;
    let data = dir.join(format!("fleet-{tag}-data"));
    let ready = dir.join(format!("fleet-{tag}.ready"));
    let cgroup = BenchCgroup::create(&format!("fleet-{tag}"));
    let mark = format!("fleet-{tag}-{}", std::process::id());
    let _marked = Marked(mark.clone());
    let serve = start_serve(&bin, &data, &ready, cgroup.as_ref(), ship)?;
    let pid = serve.0.id();
    let (_, addr) = until_healthy(&ready, Instant::now())?;
    let token = std::fs::read_to_string(data.join("api-token"))?;
    let http = reqwest::blocking::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(30))
        .build()?;
    let spawn = |argv: serde_json::Value| -> anyhow::Result<()> {
        let resp = http
            .post(format!("http://{addr}/api/trees"))
            .bearer_auth(token.trim())
            .json(&serde_json::json!({
                "argv": argv, "env": {"TW_BENCH_MARK": mark}, "label": "bench-fleet",
            }))
            .send()?;
        anyhow::ensure!(resp.status().is_success(), "spawn: {}", resp.status());
        Ok(())
    };
    let live = serde_json::json!([
        "sh",
        "-c",
        "sleep 3600 & sleep 3600 & sleep 3600 & sleep 3600 & exec sleep 3600"
    ]);
    let t = Instant::now();
    for _ in 0..size.trees {
        spawn(live.clone())?;
    }
    let all = size.trees * 5;
    anyhow::ensure!(
        wait_until(Duration::from_secs(120), Duration::from_millis(100), || {
            marked(&mark).len() >= all
        }),
        "{all} processes did not start"
    );
    let spawn_secs = t.elapsed().as_secs_f64();
    let metrics = || -> String {
        http.get(format!("http://{addr}/metrics"))
            .send()
            .and_then(|r| r.text())
            .unwrap_or_default()
    };
    // Caught up with the spawns before the window (the lag is 0).
    if ship.is_some() {
        wait_until(Duration::from_secs(120), Duration::from_millis(100), || {
            gauge(&metrics(), "treewarden_ship_lag_events") == Some(0.0)
        });
    }
    std::thread::sleep(size.settle);
    let stop = Arc::new(AtomicBool::new(false));
    let probe = ship
        .map(|url| latency_probe(url, rt, stop.clone()))
        .transpose()?;
    let hz = rustix::param::clock_ticks_per_second() as f64;
    let page = metrics();
    let head0 = gauge(&page, "treewarden_ledger_head_seq").unwrap_or(0.0);
    let acked0 = gauge(&page, "treewarden_ship_acked_seq").unwrap_or(0.0);
    let (t0, c0) = (Instant::now(), cpu_ticks(pid)?);
    let s0 = threads_ticks(pid);
    let period = Duration::from_secs_f64(1.0 / size.churn);
    let (mut next_spawn, mut next_sample) = (t0, t0);
    let mut lag = Vec::new();
    let short = serde_json::json!(["sh", "-c", "exit 0"]);
    while t0.elapsed() < size.window {
        let now = Instant::now();
        if now >= next_spawn {
            spawn(short.clone())?;
            next_spawn += period;
        }
        if now >= next_sample {
            if let Some(v) = gauge(&metrics(), "treewarden_ship_lag_events") {
                lag.push(v);
            }
            next_sample += Duration::from_millis(100);
        }
        let until = next_spawn.min(next_sample);
        std::thread::sleep(until.saturating_duration_since(Instant::now()));
    }
    let (wall, c1) = (t0.elapsed(), cpu_ticks(pid)?);
    let s1 = threads_ticks(pid);
    let page = metrics();
    let head1 = gauge(&page, "treewarden_ledger_head_seq").unwrap_or(0.0);
    let acked1 = gauge(&page, "treewarden_ship_acked_seq").unwrap_or(0.0);
    let rss_mib = status_kib(pid, "VmRSS")? as f64 / 1024.0;
    let hwm_mib = status_kib(pid, "VmHWM")? as f64 / 1024.0;
    let t_end = Instant::now();
    let drained = if ship.is_some() {
        wait_until(Duration::from_secs(60), Duration::from_millis(20), || {
            gauge(&metrics(), "treewarden_ship_lag_events") == Some(0.0)
        })
        .then(|| t_end.elapsed())
    } else {
        None
    };
    stop.store(true, Ordering::SeqCst);
    let latency = match probe {
        Some(p) => rt.block_on(p)?,
        None => Vec::new(),
    };
    let pct = |ticks: u64| ticks as f64 / hz / wall.as_secs_f64() * 100.0;
    let run = HostRun {
        data,
        spawn_secs,
        wall,
        cpu_pct: pct(c1 - c0),
        threads: s1
            .iter()
            .map(|(name, t)| {
                let t0 = s0.get(name).copied().unwrap_or(0);
                (name.clone(), pct(t.saturating_sub(t0)))
            })
            .collect(),
        rss_mib,
        hwm_mib,
        made: (head1 - head0) / wall.as_secs_f64(),
        acked: (acked1 - acked0) / wall.as_secs_f64(),
        lag,
        latency,
        drained,
    };
    eprintln!(
        "bench:   serve {tag}: {} trees up in {:.1} s; {:.2} % core over {:.1} s (shipping's threads {:.2} %), RSS {:.1} MiB (peak {:.1}); {:.0} events/s made, {:.0} acked; by thread alive at the end (% of a core): {}",
        size.trees,
        run.spawn_secs,
        run.cpu_pct,
        run.wall.as_secs_f64(),
        run.shipping(),
        run.rss_mib,
        run.hwm_mib,
        run.made,
        run.acked,
        run.breakdown()
    );
    drop(serve); // SIGTERM: serve tears its trees down
    Ok(run)
}

/// The threads the shipper's work runs on: its runtime's and its ledger
/// connection's owner thread.
const SHIPPING_THREADS: [&str; 2] = ["tw-ship-nats", "ledger-ship"];

impl HostRun {
    /// `name`'s threads' share of a core (0: no such thread).
    fn share(&self, name: &str) -> f64 {
        self.threads.get(name).copied().unwrap_or(0.0)
    }

    /// The shipper's whole share: the threads it runs on, summed.
    fn shipping(&self) -> f64 {
        SHIPPING_THREADS.iter().map(|n| self.share(n)).sum()
    }

    /// The threads' shares as `name share` text, the largest first.
    fn breakdown(&self) -> String {
        let mut v: Vec<_> = self.threads.iter().filter(|(_, p)| **p >= 0.05).collect();
        v.sort_by(|a, b| b.1.total_cmp(a.1));
        v.iter()
            .map(|(n, p)| format!("{n} {p:.2}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// p50 / p99 / max of plain numbers.
fn spread(mut v: Vec<f64>) -> (f64, f64, f64) {
    if v.is_empty() {
        return (0.0, 0.0, 0.0);
    }
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((v.len() as f64 - 1.0) * q).round() as usize];
    (at(0.5), at(0.99), v[v.len() - 1])
}

fn shipping_row(size: &Size, bare: &HostRun, shipped: &HostRun) -> String {
    let (l50, l99, lmax) = spread(shipped.lag.clone());
    let max = shipped.latency.iter().max().copied().unwrap_or_default();
    let latency = if shipped.latency.is_empty() {
        "no event delivered to the probe".to_string()
    } else {
        let s = stats(shipped.latency.clone());
        format!(
            "commit → stored and delivered p50 {} / p99 {} / max {} ms ({} events)",
            ms(s.p50),
            ms(s.p99),
            ms(max),
            s.n
        )
    };
    // What shipping costs is the CPU of the threads its work runs on; the
    // whole serve's with and without is shown beside it, but between two
    // runs the rest moves by more than the target with the full /proc walks
    // each tree's end makes.
    let cost = shipped.shipping();
    let ok = !shipped.latency.is_empty()
        && max < Duration::from_secs(1)
        && cost <= 1.0
        && shipped.drained.is_some();
    format!(
        "| 40 | fleet: serve --ship at {} live trees × 5 processes, {} short trees/s, {:.0} s | {:.0} events/s made, {:.0} acked/s; lag events p50/p99/max {l50:.0}/{l99:.0}/{lmax:.0} (0 again {} after the window); {latency}; shipping's threads {cost:.2} % of a core (tw-ship-nats {:.2}, ledger-ship {:.2}); custody's ledger thread {:.2} % with vs {:.2} % without; serve in all {:.2} % vs {:.2} %, apart from shipping's threads {:.2} % vs {:.2} %; RSS {:.1} vs {:.1} MiB (peak {:.1} vs {:.1}) | lag < 1 s, shipping ≤ 1 % core | {} |",
        size.trees,
        size.churn,
        shipped.wall.as_secs_f64(),
        shipped.made,
        shipped.acked,
        shipped
            .drained
            .map_or("not".to_string(), |d| format!("{} ms", ms(d))),
        shipped.share("tw-ship-nats"),
        shipped.share("ledger-ship"),
        shipped.share("ledger"),
        bare.share("ledger"),
        shipped.cpu_pct,
        bare.cpu_pct,
        shipped.cpu_pct - cost,
        bare.cpu_pct - bare.shipping(),
        shipped.rss_mib,
        bare.rss_mib,
        shipped.hwm_mib,
        bare.hwm_mib,
        if ok { "yes" } else { "NO" }
    )
}

// -------------------------------------------------------- backlog and floor

/// The ledger's events as the shipper sends them (each one's export line).
fn ledger_events(data: &Path) -> anyhow::Result<Vec<treewarden::ledger::EventRow>> {
    use treewarden::ledger::{EventFilter, Ledger, LedgerOptions};
    let ledger = Ledger::open(&data.join("ledger.db"), LedgerOptions::default())?;
    let mut out: Vec<treewarden::ledger::EventRow> = Vec::new();
    loop {
        let batch = ledger.events(&EventFilter {
            after_seq: Some(out.last().map_or(0, |e| e.seq)),
            limit: Some(10_000),
            ..EventFilter::default()
        })?;
        if batch.is_empty() {
            return Ok(out);
        }
        out.extend(batch);
    }
}

/// `treewarden ship` of a copy of `data` under another host id, then the
/// floor: the same events' bytes published raw, each ack awaited. Returns
/// the row and the events (the verification rows replay them).
fn backlog(
    dir: &Path,
    data: &Path,
    nats: &NatsServer,
    rt: &tokio::runtime::Runtime,
) -> anyhow::Result<(String, Vec<treewarden::ledger::EventRow>)> {
    let bin = treewarden_bin()?;
    let copy = dir.join("fleet-backlog-data");
    std::fs::create_dir_all(&copy)?;
    let status = Command::new(&bin)
        .env("TREEWARDEN_DATA_DIR", data)
        .arg("backup")
        .arg(copy.join("ledger.db"))
        .stdout(Stdio::null())
        .status()?;
    anyhow::ensure!(status.success(), "backup: {status}");
    // The copy's cursor is the shipped serve's: forgotten, so the copy
    // ships from its first event (docs/FLEET.md's way to retire a sink).
    rusqlite::Connection::open(copy.join("ledger.db"))?
        .execute("DELETE FROM ship_cursor WHERE sink = 'nats'", [])?;
    let events = ledger_events(&copy)?;
    let t = Instant::now();
    let out = Command::new(&bin)
        .env("TREEWARDEN_DATA_DIR", &copy)
        .args(["ship", &nats.url(), "--host-id", "bench-backlog"])
        .stdin(Stdio::null())
        .output()?;
    let ship_wall = t.elapsed();
    anyhow::ensure!(
        out.status.success(),
        "ship: {}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let bodies: Vec<Vec<u8>> = events
        .iter()
        .map(serde_json::to_vec)
        .collect::<Result<_, _>>()?;
    let floor_wall = rt.block_on(async {
        let js = js(&nats.url()).await?;
        js.get_or_create_stream(stream::Config {
            name: "BENCH_FLOOR".into(),
            subjects: vec!["bench.floor".into()],
            storage: stream::StorageType::File,
            ..Default::default()
        })
        .await?;
        let t = Instant::now();
        for body in &bodies {
            js.publish("bench.floor", body.clone().into())
                .await?
                .await?;
        }
        anyhow::Ok(t.elapsed())
    })?;
    let n = events.len() as f64;
    let (ours, floor) = (n / ship_wall.as_secs_f64(), n / floor_wall.as_secs_f64());
    eprintln!(
        "bench:   backlog of {n} events: treewarden ship {:.2} s, raw publish {:.2} s",
        ship_wall.as_secs_f64(),
        floor_wall.as_secs_f64()
    );
    Ok((
        format!(
            "| 41 | fleet: treewarden ship of that ledger's {n} events (a backlog; process start and connection included) | {ours:.0} events/s ({:.2} s); floor: raw async-nats publish of the same bytes, each ack awaited, {floor:.0} events/s ({:.2} s); {:.2}× the floor's time | — | — |",
            ship_wall.as_secs_f64(),
            floor_wall.as_secs_f64(),
            ship_wall.as_secs_f64() / floor_wall.as_secs_f64().max(1e-9)
        ),
        events,
    ))
}

// ------------------------------------------------------------ verification

/// `fleet serve`, its pages' address, ended by its pid.
struct FleetServe {
    child: Child,
    addr: String,
}

impl FleetServe {
    fn start(url: &str, data: &Path) -> anyhow::Result<FleetServe> {
        let mut child = Command::new(treewarden_bin()?)
            .args(["fleet", "serve", "--nats", url, "--listen", "127.0.0.1:0"])
            .arg("--data")
            .arg(data)
            .args(["--consumer", "bench"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?;
        let stdout = child.stdout.take();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let Some(stdout) = stdout else { return };
            for line in std::io::BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
            {
                if let Some(addr) = line.strip_prefix("fleet listening on http://") {
                    let _ = tx.send(addr.to_string());
                }
            }
        });
        let mut fleet = FleetServe {
            child,
            addr: String::new(),
        };
        fleet.addr = rx
            .recv_timeout(Duration::from_secs(30))
            .map_err(|_| anyhow::anyhow!("fleet serve did not listen"))?;
        Ok(fleet)
    }
}

impl Drop for FleetServe {
    fn drop(&mut self) {
        if let Some(pid) = rustix::process::Pid::from_raw(self.child.id() as i32) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        if !wait_until(Duration::from_secs(20), Duration::from_millis(20), || {
            matches!(self.child.try_wait(), Ok(Some(_)))
        }) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Publishes `events` under `hosts` host ids, interleaved (event 1 of
/// every host, then event 2, …), with the ids the shipper gives them;
/// up to 512 acks outstanding.
async fn replay(
    js: &jetstream::Context,
    hosts: &[String],
    events: &[treewarden::ledger::EventRow],
) -> anyhow::Result<()> {
    use treewarden::service::nats::{message_id, subject_of};
    js.get_or_create_stream(stream::Config {
        name: "TREEWARDEN".into(),
        subjects: vec!["treewarden.*.events".into()],
        storage: stream::StorageType::File,
        deny_delete: true,
        deny_purge: true,
        ..Default::default()
    })
    .await?;
    let mut pending = VecDeque::new();
    for e in events {
        let body = serde_json::to_vec(e)?;
        for h in hosts {
            let message = jetstream::message::PublishMessage::build()
                .payload(body.clone().into())
                .message_id(message_id(h, e))
                .header("ce-specversion", "1.0")
                .header("ce-id", format!("{h}:{}", e.seq).as_str())
                .header("ce-source", format!("treewarden://{h}").as_str())
                .header("ce-type", e.kind.to_string().as_str())
                .header("ce-time", e.at.as_str())
                .header("content-type", "application/json");
            pending.push_back(js.send_publish(subject_of(h), message).await?);
            if pending.len() >= 512
                && let Some(ack) = pending.pop_front()
            {
                ack.await?;
            }
        }
    }
    for ack in pending {
        ack.await?;
    }
    Ok(())
}

/// Where the fleet stands, from its `/metrics`.
#[derive(Clone, Copy, Default)]
struct FleetState {
    /// Hosts with all `per_host` events indexed.
    full: usize,
    /// Hosts whose verdict covers all of them (lag 0, not broken).
    done: usize,
    /// Events indexed, and events walked (covered by a verdict), all hosts.
    indexed: f64,
    walked: f64,
}

fn fleet_state(page: &str, per_host: usize) -> FleetState {
    let value = |line: &str, name: &str| -> Option<(String, f64)> {
        let rest = line.strip_prefix(&format!("treewarden_fleet_{name}{{host=\""))?;
        let (host, v) = rest.split_once("\"} ")?;
        Some((host.to_string(), v.trim().parse().ok()?))
    };
    let mut indexed = std::collections::BTreeMap::new();
    let mut lag = std::collections::BTreeMap::new();
    let mut broken = std::collections::BTreeMap::new();
    for line in page.lines() {
        if let Some((h, v)) = value(line, "events_indexed") {
            indexed.insert(h, v);
        } else if let Some((h, v)) = value(line, "lag_events") {
            lag.insert(h, v);
        } else if let Some((h, v)) = value(line, "chain_broken") {
            broken.insert(h, v);
        }
    }
    let all = per_host as f64;
    FleetState {
        full: indexed.values().filter(|v| **v >= all).count(),
        done: indexed
            .iter()
            .filter(|(h, v)| {
                **v >= all && lag.get(*h) == Some(&0.0) && broken.get(*h) == Some(&0.0)
            })
            .count(),
        indexed: indexed.values().sum(),
        // The lag is what the stream holds that no walk has covered yet.
        walked: indexed
            .keys()
            .map(|h| (all - lag.get(h).copied().unwrap_or(all)).max(0.0))
            .sum(),
    }
}

fn verification(
    dir: &Path,
    exe: &Path,
    size: &Size,
    events: &[treewarden::ledger::EventRow],
    rt: &tokio::runtime::Runtime,
) -> anyhow::Result<String> {
    let nats = NatsServer::start(exe, dir, "fleet", rt)?;
    let hosts: Vec<String> = (0..size.hosts).map(|i| format!("bench-h{i:04}")).collect();
    let per_host = events.len();
    let total = per_host * hosts.len();
    let t = Instant::now();
    rt.block_on(async { replay(&js(&nats.url()).await?, &hosts, events).await })?;
    eprintln!(
        "bench:   {} hosts × {per_host} events ({total}) published in {:.1} s",
        hosts.len(),
        t.elapsed().as_secs_f64()
    );
    let data = tempfile::Builder::new()
        .prefix("fleet-index-")
        .tempdir_in(dir)?;
    let t0 = Instant::now();
    let fleet = FleetServe::start(&nats.url(), data.path())?;
    let pid = fleet.child.id();
    let http = reqwest::blocking::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(30))
        .build()?;
    let mut all_indexed = None;
    let mut state = FleetState::default();
    let limit = size.verify_limit;
    let done = wait_until(limit, Duration::from_millis(200), || {
        let page = http
            .get(format!("http://{}/metrics", fleet.addr))
            .send()
            .and_then(|r| r.text())
            .unwrap_or_default();
        state = fleet_state(&page, per_host);
        if state.full == hosts.len() && all_indexed.is_none() {
            all_indexed = Some(t0.elapsed());
        }
        state.done == hosts.len()
    });
    let wall = t0.elapsed();
    let hz = rustix::param::clock_ticks_per_second() as f64;
    let cpu = cpu_ticks(pid)? as f64 / hz;
    let hwm = status_kib(pid, "VmHWM")? as f64 / 1024.0;
    drop(fleet);
    eprintln!(
        "bench:   fleet serve: {}/{} hosts verified in {:.1} s (all indexed {}), CPU {cpu:.1} s, peak RSS {hwm:.1} MiB",
        state.done,
        hosts.len(),
        wall.as_secs_f64(),
        all_indexed.map_or("never".into(), |d| format!("{:.1} s", d.as_secs_f64()))
    );
    let outcome = if done {
        format!(
            "{:.0} events/s: every verdict at its host's head in {:.1} s (all indexed at {})",
            total as f64 / wall.as_secs_f64(),
            wall.as_secs_f64(),
            all_indexed.map_or("-".into(), |d| format!("{:.1} s", d.as_secs_f64()))
        )
    } else {
        // Cut off: the rates so far.
        format!(
            "not done when cut off at {:.0} s: {:.0} events indexed ({:.0}/s), {:.0} walked ({:.0}/s), {} of {} hosts verified at their head, {} fully indexed",
            wall.as_secs_f64(),
            state.indexed,
            state.indexed / wall.as_secs_f64(),
            state.walked,
            state.walked / wall.as_secs_f64(),
            state.done,
            hosts.len(),
            state.full
        )
    };
    Ok(format!(
        "| 42 | fleet: fleet serve from an empty index, {} hosts × {per_host} real events ({total}, interleaved) | {outcome}; fleet serve CPU {cpu:.1} s ({:.0} % of a core over the run), peak RSS {hwm:.1} MiB | — | {} |",
        hosts.len(),
        cpu / wall.as_secs_f64() * 100.0,
        if done { "yes" } else { "NO" }
    ))
}
