//! API spawn throughput: `POST /api/trees` of a short-lived tree (`true`)
//! by 1, 50 and 200 concurrent callers against one `serve` (session
//! boundary, the ledger on the bench's dir), each caller on its own
//! keep-alive connection, connected and served once before the level's
//! clock starts. Per level: spawns/s over the window and the POST's
//! p50/p99 (request sent to `201` read, the tree's two FULL commits and its
//! fork inside it). The floor, per level: the same number of spawns by the
//! same number of threads, each `fork`+`exec` `true`+`wait` (std's
//! `Command`) between two journal records made durable by one `fdatasync`
//! per group of whatever is queued (the group commit a ledger could reach:
//! no SQL, no HTTP, no custody).

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::{Plan, Row, Serve, Stats, Target, ms, stats, treewarden_bin, until_healthy};

/// One level's figures: spawns/s and the latencies, ours and the floor's.
struct Level {
    callers: usize,
    rate: f64,
    lat: Stats,
    floor_rate: f64,
    floor: Stats,
}

/// Spawns at each concurrency in `plan.api_callers`; pushes one row per
/// level and returns the throughput lines printed under the table.
pub(super) fn api(plan: &Plan, dir: &Path, rows: &mut Vec<Row>) -> anyhow::Result<Vec<String>> {
    let bin = treewarden_bin()?;
    let data = dir.join("api-data");
    let ready = dir.join("api-ready");
    let most = plan.api_callers.iter().copied().max().unwrap_or(1);
    let mut c = Command::new(&bin);
    c.env("TREEWARDEN_DATA_DIR", &data)
        .env("TREEWARDEN_BOUNDARY", "session")
        .env_remove("TREEWARDEN_CGROUP_ROOT")
        .args(["serve", "--listen", "127.0.0.1:0"])
        // Every caller is one peer (127.0.0.1): room for all of them.
        .args(["--max-connections-per-uid", &(most + 16).to_string()])
        .arg("--ready-file")
        .arg(&ready)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    if let Some(path) = std::env::var_os("TW_BENCH_SERVE_LOG") {
        c.stderr(std::fs::File::create(path)?);
    }
    let serve = Serve(c.spawn()?);
    let (_, addr) = until_healthy(&ready, Instant::now())?;
    let token = std::fs::read_to_string(data.join("api-token"))?
        .trim()
        .to_string();
    let journal = dir.join("api-floor.journal");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut levels = Vec::new();
    for &callers in &plan.api_callers {
        eprintln!(
            "bench: POST /api/trees `true`, {callers} concurrent callers, {:.1} s (serve pid {})",
            plan.api_window.as_secs_f64(),
            serve.0.id()
        );
        let (n, wall, lat) = rt.block_on(posts(&addr, &token, callers, plan.api_window))?;
        let (fwall, flat) = floor(callers, n, &journal)?;
        let level = Level {
            callers,
            rate: n as f64 / wall.as_secs_f64(),
            lat: stats(lat),
            floor_rate: n as f64 / fwall.as_secs_f64(),
            floor: stats(flat),
        };
        eprintln!(
            "bench:   {n} spawns: {:.0}/s, p50 {} ms, p99 {} ms; floor {:.0}/s, p50 {} ms, p99 {} ms",
            level.rate,
            ms(level.lat.p50),
            ms(level.lat.p99),
            level.floor_rate,
            ms(level.floor.p50),
            ms(level.floor.p99)
        );
        levels.push(level);
    }
    drop(serve);
    let mut lines = Vec::new();
    for l in &levels {
        rows.push(Row {
            item: "api".into(),
            what: format!(
                "POST /api/trees `true`, {} callers: {:.0} spawns/s (floor {:.0}/s)",
                l.callers, l.rate, l.floor_rate
            ),
            ours: l.lat,
            floor_name: "fork+exec+wait, grouped fdatasyncs".into(),
            floor: l.floor,
            by_p99: false,
            target: Target::None,
        });
        let ok = l.rate >= 500.0 && l.lat.p99 <= Duration::from_millis(50);
        lines.push(format!(
            "| api spawns | {} callers | {:.0} spawns/s, p50 {} ms, p99 {} ms | floor {:.0} spawns/s, p50 {} ms, p99 {} ms | {} |",
            l.callers,
            l.rate,
            ms(l.lat.p50),
            ms(l.lat.p99),
            l.floor_rate,
            ms(l.floor.p50),
            ms(l.floor.p99),
            match (l.callers, ok) {
                (200, true) => "≥ 500/s, p99 ≤ 50 ms: yes",
                (200, false) => "≥ 500/s, p99 ≤ 50 ms: NO",
                _ => "—",
            }
        ));
    }
    Ok(lines)
}

/// `callers` tasks, each POSTing one tree after another on its own
/// connection until `window` has passed: (spawns, wall time, latencies).
/// Plain HTTP/1.1 over one `TcpStream` per caller: a pooling client opens
/// spare connections while every pooled one is busy, and each accept costs
/// the service a peer lookup that would be counted against the spawns.
async fn posts(
    addr: &str,
    token: &str,
    callers: usize,
    window: Duration,
) -> anyhow::Result<(usize, Duration, Vec<Duration>)> {
    let body = serde_json::json!({"argv": ["true"], "label": "bench-api"}).to_string();
    let request = format!(
        "POST /api/trees HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    // Every caller connected and served once before the clock starts:
    // the level measures spawns, not the service's accepts (each reads the
    // host's socket table for the peer's uid; PERFORMANCE.md).
    let start = Arc::new(tokio::sync::Barrier::new(callers + 1));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..callers {
        let (addr, request, start) = (addr.to_string(), request.clone(), start.clone());
        tasks.spawn(async move {
            let mut conn = tokio::io::BufReader::new(tokio::net::TcpStream::connect(&addr).await?);
            let (status, answer) = exchange(&mut conn, request.as_bytes()).await?;
            anyhow::ensure!(status == 201, "spawn answered {status}: {answer}");
            start.wait().await;
            let until = Instant::now() + window;
            let mut lat = Vec::new();
            loop {
                let t = Instant::now();
                let (status, answer) = exchange(&mut conn, request.as_bytes()).await?;
                anyhow::ensure!(status == 201, "spawn answered {status}: {answer}");
                lat.push(t.elapsed());
                if Instant::now() >= until {
                    return Ok::<_, anyhow::Error>(lat);
                }
            }
        });
    }
    start.wait().await;
    let t0 = Instant::now();
    let mut all = Vec::new();
    while let Some(done) = tasks.join_next().await {
        all.extend(done??);
    }
    Ok((all.len(), t0.elapsed(), all))
}

/// One request on a keep-alive connection: (status, body).
async fn exchange(
    conn: &mut tokio::io::BufReader<tokio::net::TcpStream>,
    request: &[u8],
) -> anyhow::Result<(u16, String)> {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
    conn.get_mut().write_all(request).await?;
    let mut line = String::new();
    conn.read_line(&mut line).await?;
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no status line: {line:?}"))?;
    let mut length = None;
    loop {
        line.clear();
        anyhow::ensure!(conn.read_line(&mut line).await? > 0, "connection closed");
        let header = line.trim_end();
        if header.is_empty() {
            break;
        }
        if let Some((k, v)) = header.split_once(':')
            && k.eq_ignore_ascii_case("content-length")
        {
            length = v.trim().parse::<usize>().ok();
        }
    }
    let length = length.ok_or_else(|| anyhow::anyhow!("an answer without Content-Length"))?;
    let mut body = vec![0; length];
    conn.read_exact(&mut body).await?;
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// Journal records made durable in groups: a caller's record is on disk
/// when `synced` reaches its ticket; whoever finds no sync running syncs
/// everything written so far.
struct Group {
    state: Mutex<(std::fs::File, u64, u64, bool)>,
    cv: Condvar,
}

impl Group {
    fn durable(&self, record: &[u8]) -> anyhow::Result<()> {
        let mut g = self.state.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
        g.0.write_all(record)?;
        g.1 += 1;
        let mine = g.1;
        loop {
            if g.2 >= mine {
                return Ok(());
            }
            if !g.3 {
                g.3 = true;
                let (upto, file) = (g.1, g.0.try_clone()?);
                drop(g);
                let synced = file.sync_data();
                g = self.state.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
                g.3 = false;
                self.cv.notify_all();
                synced?;
                g.2 = g.2.max(upto);
            } else {
                g = self.cv.wait(g).map_err(|_| anyhow::anyhow!("poisoned"))?;
            }
        }
    }
}

/// The floor: `n` spawns of `true` by `callers` threads, each between two
/// grouped-durable journal records: (wall time, latencies).
fn floor(callers: usize, n: usize, journal: &Path) -> anyhow::Result<(Duration, Vec<Duration>)> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(journal)?;
    let group = Arc::new(Group {
        state: Mutex::new((file, 0, 0, false)),
        cv: Condvar::new(),
    });
    let left = Arc::new(std::sync::atomic::AtomicUsize::new(n));
    let t0 = Instant::now();
    let threads: Vec<_> = (0..callers)
        .map(|_| {
            let (group, left) = (group.clone(), left.clone());
            std::thread::spawn(move || -> anyhow::Result<Vec<Duration>> {
                let mut lat = Vec::new();
                while left
                    .fetch_update(
                        std::sync::atomic::Ordering::SeqCst,
                        std::sync::atomic::Ordering::SeqCst,
                        |l| l.checked_sub(1),
                    )
                    .is_ok()
                {
                    let t = Instant::now();
                    group.durable(b"created\n")?;
                    let status = Command::new("true")
                        .stdin(Stdio::null())
                        .stdout(Stdio::null())
                        .stderr(Stdio::null())
                        .status()?;
                    anyhow::ensure!(status.success(), "true failed: {status}");
                    group.durable(b"exited\n")?;
                    lat.push(t.elapsed());
                }
                Ok(lat)
            })
        })
        .collect();
    let mut all = Vec::new();
    for t in threads {
        all.extend(
            t.join()
                .map_err(|_| anyhow::anyhow!("a floor thread panicked"))??,
        );
    }
    Ok((t0.elapsed(), all))
}
