//! Streamed stdio (`--only stdio`): a JSON-RPC round trip through
//! `serve`'s streamed stdio (`"stdio": "stream"`, HTTP/1.1 upgrade to
//! `treewarden-stdio/1`) over loopback TCP with a bearer token, to a `cat`
//! tree: one request line in as a stdin frame, the same line back out of
//! stdout frames, as an ACP or MCP client talks to its stdio server.
//! Floor: the same round trip over a plain pipe to a `cat` this process
//! spawned itself. Alternated, so drift hits both. The target is the
//! round trip's median within 1 ms (the floor's is tens of microseconds:
//! the row's `≤ +1 ms` over it).

use std::io::{BufRead as _, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::{Plan, Row, Serve, Target, serve_command, stats, treewarden_bin, until_healthy};

/// Frame kinds: `[kind u8][length u32 big-endian][payload]`.
const STDIN: u8 = 0;
const STDOUT: u8 = 1;
const STDERR: u8 = 2;
const EXIT: u8 = 3;

/// Round trips measured (and as many floors), and those run first unmeasured.
const ROUND_TRIPS: usize = 2_000;
const SMOKE_ROUND_TRIPS: usize = 20;
const WARM_UP: usize = 20;

fn write_frame(s: &mut impl Write, kind: u8, payload: &[u8]) -> std::io::Result<()> {
    let len = u32::try_from(payload.len()).map_err(|_| std::io::ErrorKind::InvalidInput)?;
    let mut frame = Vec::with_capacity(5 + payload.len());
    frame.push(kind);
    frame.extend_from_slice(&len.to_be_bytes());
    frame.extend_from_slice(payload);
    // One write per frame (a split one would meet Nagle on the way).
    s.write_all(&frame)
}

fn read_frame(r: &mut impl Read) -> std::io::Result<(u8, Vec<u8>)> {
    let mut head = [0u8; 5];
    r.read_exact(&mut head)?;
    let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
    let mut payload = vec![0; len];
    r.read_exact(&mut payload)?;
    Ok((head[0], payload))
}

/// A `cat` tree's stdio over one upgraded connection.
struct Streamed {
    tx: TcpStream,
    rx: BufReader<TcpStream>,
    /// stdout read past the last line returned.
    out: Vec<u8>,
}

impl Streamed {
    fn spawn(addr: &str, token: &str) -> anyhow::Result<Self> {
        let mut tx = TcpStream::connect(addr)?;
        tx.set_nodelay(true)?;
        tx.set_read_timeout(Some(Duration::from_secs(10)))?;
        let body = serde_json::json!({ "argv": ["cat"], "stdio": "stream" }).to_string();
        write!(
            tx,
            "POST /api/trees HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\n\
             Connection: Upgrade\r\nUpgrade: treewarden-stdio/1\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )?;
        let mut rx = BufReader::new(tx.try_clone()?);
        let mut head = String::new();
        while !head.ends_with("\r\n\r\n") {
            anyhow::ensure!(rx.read_line(&mut head)? > 0, "the spawn's answer ended");
        }
        anyhow::ensure!(
            head.starts_with("HTTP/1.1 101"),
            "the spawn was not upgraded: {head}"
        );
        Ok(Self {
            tx,
            rx,
            out: Vec::new(),
        })
    }

    /// Sends `line` to the tree's stdin and returns the next line of its stdout.
    fn round_trip(&mut self, line: &[u8]) -> anyhow::Result<Vec<u8>> {
        write_frame(&mut self.tx, STDIN, line)?;
        loop {
            if let Some(nl) = self.out.iter().position(|&b| b == b'\n') {
                return Ok(self.out.drain(..=nl).collect());
            }
            match read_frame(&mut self.rx)? {
                (STDOUT, chunk) if !chunk.is_empty() => self.out.extend(chunk),
                (STDERR, _) => {}
                (kind, _) => anyhow::bail!("a frame {kind} before the answer"),
            }
        }
    }

    /// Ends stdin (the half-close) and reads up to the exit frame: the
    /// tree's end as `wait` answers it.
    fn close(mut self) -> anyhow::Result<serde_json::Value> {
        write_frame(&mut self.tx, STDIN, &[])?;
        loop {
            if let (EXIT, end) = read_frame(&mut self.rx)? {
                return Ok(serde_json::from_slice(&end)?);
            }
        }
    }
}

pub fn round_trips(plan: &Plan, dir: &Path, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    // The plan's sizes are main.rs's; the smoke size is read off the
    // arguments here.
    let _ = plan;
    let n = if std::env::args().any(|a| a == "--smoke") {
        SMOKE_ROUND_TRIPS
    } else {
        ROUND_TRIPS
    };
    eprintln!("bench: streamed-stdio round trip vs a plain pipe, x{n}");
    let bin = treewarden_bin()?;
    let data = dir.join("stdio-data");
    let ready = dir.join("stdio-ready");
    let _serve = Serve(serve_command(&bin, &data, &ready, None, &[]).spawn()?);
    let (_, addr) = until_healthy(&ready, Instant::now())?;
    let token = std::fs::read_to_string(data.join("api-token"))?;
    let mut streamed = Streamed::spawn(&addr, token.trim())?;

    let mut cat = Command::new("cat")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let mut cat_in = cat
        .stdin
        .take()
        .ok_or_else(|| anyhow::anyhow!("cat's stdin"))?;
    let mut cat_out = BufReader::new(
        cat.stdout
            .take()
            .ok_or_else(|| anyhow::anyhow!("cat's stdout"))?,
    );
    let mut piped = |line: &[u8]| -> anyhow::Result<Vec<u8>> {
        cat_in.write_all(line)?;
        let mut back = Vec::new();
        cat_out.read_until(b'\n', &mut back)?;
        Ok(back)
    };

    let (mut ours, mut floor) = (Vec::new(), Vec::new());
    for i in 0..WARM_UP + n {
        let line = format!(
            "{}\n",
            serde_json::json!({
                "jsonrpc": "2.0", "id": i, "method": "session/prompt",
                "params": { "sessionId": "bench", "prompt": [{ "type": "text", "text": "ping" }] },
            })
        );
        let t = Instant::now();
        let back = streamed.round_trip(line.as_bytes())?;
        let took = t.elapsed();
        anyhow::ensure!(back == line.as_bytes(), "streamed: another line came back");
        let t = Instant::now();
        let back = piped(line.as_bytes())?;
        let took_floor = t.elapsed();
        anyhow::ensure!(back == line.as_bytes(), "piped: another line came back");
        if i >= WARM_UP {
            ours.push(took);
            floor.push(took_floor);
        }
    }
    let end = streamed.close()?;
    anyhow::ensure!(
        end["outcome"]["kind"] == "exited",
        "the streamed cat did not end by its exit: {end}"
    );
    drop(cat_in);
    cat.wait()?;

    rows.push(Row {
        item: "stdio".into(),
        what: "JSON-RPC round trip, streamed stdio over loopback TCP (`serve`, token) to `cat`"
            .into(),
        ours: stats(ours),
        floor_name: "the same over a plain pipe to `cat`".into(),
        floor: stats(floor),
        by_p99: false,
        target: Target::OverheadMs(1.0),
    });
    Ok(())
}
