//! Streamed stdio: a spawn's stdin, stdout and stderr carried by the
//! spawn request's own connection, for clients that cannot pass
//! descriptors (TCP, Windows, Node).
//!
//! The spawn asks for it (`"stdio": "stream"` with `Connection: Upgrade`,
//! `Upgrade: treewarden-stdio/1`) and is answered `101 Switching
//! Protocols`; from then on the connection is a raw stream of frames, each
//! `[stream u8][length u32 big-endian][payload]`:
//!
//! - `0` stdin (client to service), `1` stdout and `2` stderr (service to
//!   client): a frame of length 0 is that stream's end (stdin's: the
//!   tree's stdin is closed, a half-close);
//! - `3` exit (service to client, last): the tree's end as
//!   `GET /api/trees/{id}/wait` answers it (`{...tree, "outcome"}`),
//!   after stdout's and stderr's ends (or [`EOF_AFTER_END`] after the
//!   tree settled, if something it left still holds them).
//!
//! The pipes are made before the spawn, so nothing the tree writes before
//! the upgrade completes is lost (the kernel's pipe buffer holds it, then
//! the tree waits), and a refused request creates no tree.
//!
//! What it must never do: hold custody (a dropped connection closes the
//! tree's stdin, and what it writes after is read and dropped: the tree
//! lives by its lifetime rules, never by its connection); read more of the
//! tree's output than the peer takes (one chunk in flight per stream, the
//! rest waits in the pipe); buffer more of the peer's stdin than one frame
//! ([`MAX_IN_FRAME`]).

use std::io::Write as _;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::bodies::WaitAnswer;
use crate::http::AppState;
use crate::ledger::TreeId;

/// The `Upgrade` protocol of streamed stdio.
pub const PROTOCOL: &str = "treewarden-stdio/1";

/// The header of the `101` naming the tree spawned (as `Location` does).
pub const TREE_HEADER: &str = "treewarden-tree";
/// The header of the `101` naming the tree's root pid.
pub const ROOT_PID_HEADER: &str = "treewarden-root-pid";

/// Frame kinds.
pub const STDIN: u8 = 0;
pub const STDOUT: u8 = 1;
pub const STDERR: u8 = 2;
pub const EXIT: u8 = 3;

/// The most of the tree's output one frame carries.
const CHUNK: usize = 32 * 1024;
/// The longest stdin frame accepted; a longer one ends the stream.
pub const MAX_IN_FRAME: usize = 1 << 20;
/// How long stdout and stderr may stay open after the tree settled before
/// the exit frame goes anyway.
pub const EOF_AFTER_END: Duration = Duration::from_secs(2);

/// Whether a request asks to be upgraded to streamed stdio.
pub fn asks_upgrade(headers: &axum::http::HeaderMap) -> bool {
    let has = |name: axum::http::HeaderName, want: &str| {
        headers.get_all(name).iter().any(|v| {
            v.to_str()
                .is_ok_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case(want)))
        })
    };
    has(axum::http::header::CONNECTION, "upgrade") && has(axum::http::header::UPGRADE, PROTOCOL)
}

/// The service's ends of a streamed tree's stdio, each served by a thread
/// of its own (blocking pipe I/O, the same on Linux and Windows): stdin's
/// chunks go in through `stdin`, stdout's and stderr's come out of `out`.
pub struct Pumps {
    stdin: mpsc::Sender<Vec<u8>>,
    out: mpsc::Receiver<(u8, Vec<u8>)>,
}

impl Pumps {
    /// Starts the threads on the service's ends.
    pub fn start(
        stdin: std::io::PipeWriter,
        stdout: std::io::PipeReader,
        stderr: std::io::PipeReader,
    ) -> std::io::Result<Self> {
        let (in_tx, in_rx) = mpsc::channel(1);
        let (out_tx, out) = mpsc::channel(2);
        let thread = |name: &str| {
            std::thread::Builder::new()
                .name(name.into())
                .stack_size(64 * 1024)
        };
        let err_tx = out_tx.clone();
        thread("tw-stdout").spawn(move || read_pipe(STDOUT, stdout, &out_tx))?;
        thread("tw-stderr").spawn(move || read_pipe(STDERR, stderr, &err_tx))?;
        thread("tw-stdin").spawn(move || write_pipe(stdin, in_rx))?;
        Ok(Self { stdin: in_tx, out })
    }
}

/// Reads one of the tree's outputs into `tx` until its end, one chunk at a
/// time (the channel's bound is the back-pressure); once nobody takes
/// them, what follows is read and dropped, so the tree never blocks on a
/// peer that left.
fn read_pipe(stream: u8, mut pipe: std::io::PipeReader, tx: &mpsc::Sender<(u8, Vec<u8>)>) {
    let mut buf = vec![0; CHUNK];
    let mut taken = true;
    loop {
        let n = match std::io::Read::read(&mut pipe, &mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        if taken {
            taken = tx.blocking_send((stream, buf[..n].to_vec())).is_ok();
        }
    }
    if taken {
        let _ = tx.blocking_send((stream, Vec::new()));
    }
}

/// Writes stdin's chunks to the tree until the peer ends stdin (the
/// sender dropped: the pipe is closed) or the tree closed its end.
fn write_pipe(mut pipe: std::io::PipeWriter, mut rx: mpsc::Receiver<Vec<u8>>) {
    while let Some(chunk) = rx.blocking_recv() {
        if pipe.write_all(&chunk).is_err() {
            break;
        }
    }
}

/// Serves the streamed stdio of tree `id` once the connection is upgraded,
/// until the exit frame is written or the peer is gone.
pub async fn serve(upgrade: hyper::upgrade::OnUpgrade, pumps: Pumps, state: AppState, id: TreeId) {
    let io = match upgrade.await {
        Ok(io) => hyper_util::rt::TokioIo::new(io),
        Err(e) => {
            tracing::debug!(tree = id.0, error = %e, "the stdio upgrade failed: its stdin is closed");
            return;
        }
    };
    let (rd, wr) = tokio::io::split(io);
    let Pumps { stdin, out } = pumps;
    let gone = CancellationToken::new();
    let inbound = tokio::spawn(inbound(rd, stdin, gone.clone()));
    outbound(wr, out, settled(state, id), gone).await;
    inbound.abort();
}

/// The peer's frames to the tree's stdin. A clean end of the connection's
/// read side ends stdin only (the peer may still read); a broken one, or
/// a frame that is not stdin's, hangs up (`gone`).
async fn inbound<R: AsyncRead + Unpin>(
    mut rd: R,
    stdin: mpsc::Sender<Vec<u8>>,
    gone: CancellationToken,
) {
    let mut stdin = Some(stdin);
    loop {
        let mut head = [0u8; 5];
        match rd.read_exact(&mut head).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return,
            Err(_) => return gone.cancel(),
        }
        let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
        if head[0] != STDIN || len > MAX_IN_FRAME {
            tracing::debug!(
                kind = head[0],
                len,
                "a stdio frame the service does not take: hung up"
            );
            return gone.cancel();
        }
        if len == 0 {
            stdin = None;
            continue;
        }
        let mut buf = vec![0; len];
        if rd.read_exact(&mut buf).await.is_err() {
            return gone.cancel();
        }
        if let Some(tx) = &stdin
            && tx.send(buf).await.is_err()
        {
            // The tree closed its stdin: the rest is dropped.
            stdin = None;
        }
    }
}

/// The tree's output to the peer, then the exit frame.
async fn outbound<W: AsyncWrite + Unpin>(
    mut wr: W,
    mut out: mpsc::Receiver<(u8, Vec<u8>)>,
    settled: impl std::future::Future<Output = Vec<u8>>,
    gone: CancellationToken,
) {
    let mut open = 2;
    let mut settled = std::pin::pin!(settled);
    let mut end: Option<Vec<u8>> = None;
    let mut deadline: Option<tokio::time::Instant> = None;
    while open > 0 || end.is_none() {
        let late = async {
            match deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            m = out.recv(), if open > 0 => match m {
                Some((stream, chunk)) => {
                    if chunk.is_empty() {
                        open -= 1;
                    }
                    if write_frame(&mut wr, stream, &chunk).await.is_err() {
                        return;
                    }
                }
                None => open = 0,
            },
            e = &mut settled, if end.is_none() => {
                end = Some(e);
                deadline = Some(tokio::time::Instant::now() + EOF_AFTER_END);
            }
            () = late => break,
            () = gone.cancelled() => return,
        }
    }
    let _ = write_frame(&mut wr, EXIT, &end.unwrap_or_default()).await;
    let _ = wr.shutdown().await;
}

async fn write_frame<W: AsyncWrite + Unpin>(
    wr: &mut W,
    stream: u8,
    payload: &[u8],
) -> std::io::Result<()> {
    let len = u32::try_from(payload.len()).map_err(|_| std::io::ErrorKind::InvalidInput)?;
    let mut frame = Vec::with_capacity(5 + payload.len());
    frame.push(stream);
    frame.extend_from_slice(&len.to_be_bytes());
    frame.extend_from_slice(payload);
    wr.write_all(&frame).await?;
    wr.flush().await
}

/// The tree's end as `GET /api/trees/{id}/wait` answers it, once it is
/// settled (or as it stands when the service shuts down).
async fn settled(s: AppState, id: TreeId) -> Vec<u8> {
    let mut ends = s.service.ends();
    let stop = s.service.shutdown_token();
    let mut last = false;
    loop {
        ends.borrow_and_update();
        match s.service.door().tree(id).await {
            Ok(Some(row)) if last || super::trees::wait_over(row.state) => {
                let outcome = s
                    .service
                    .door()
                    .settled_outcome(row.clone())
                    .await
                    .ok()
                    .flatten();
                let answer = WaitAnswer { tree: row, outcome };
                return serde_json::to_vec(&answer).unwrap_or_default();
            }
            Ok(Some(_)) => {}
            Ok(None) => return b"{}".to_vec(),
            Err(e) if last => {
                tracing::warn!(tree = id.0, error = %e, "the streamed tree's end could not be read");
                return b"{}".to_vec();
            }
            Err(e) => tracing::warn!(tree = id.0, error = %e, "the streamed tree's end: retrying"),
        }
        tokio::select! {
            changed = ends.changed() => last = changed.is_err(),
            () = stop.cancelled() => last = true,
            // A ledger that refused the read is asked again.
            () = tokio::time::sleep(Duration::from_secs(5)) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn read_frame<R: AsyncRead + Unpin>(r: &mut R) -> (u8, Vec<u8>) {
        let mut head = [0u8; 5];
        r.read_exact(&mut head).await.expect("a frame head");
        let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
        let mut payload = vec![0; len];
        r.read_exact(&mut payload).await.expect("a frame payload");
        (head[0], payload)
    }

    #[tokio::test]
    async fn output_then_its_ends_then_the_exit_frame() {
        let (ours, mut peer) = tokio::io::duplex(1024);
        let (tx, rx) = mpsc::channel(2);
        let gone = CancellationToken::new();
        let task = tokio::spawn(outbound(
            ours,
            rx,
            async { b"{\"state\":\"ended\"}".to_vec() },
            gone,
        ));
        tx.send((STDOUT, b"out".to_vec())).await.expect("taken");
        tx.send((STDERR, b"err".to_vec())).await.expect("taken");
        tx.send((STDOUT, Vec::new())).await.expect("taken");
        tx.send((STDERR, Vec::new())).await.expect("taken");
        assert_eq!(read_frame(&mut peer).await, (STDOUT, b"out".to_vec()));
        assert_eq!(read_frame(&mut peer).await, (STDERR, b"err".to_vec()));
        assert_eq!(read_frame(&mut peer).await, (STDOUT, Vec::new()));
        assert_eq!(read_frame(&mut peer).await, (STDERR, Vec::new()));
        assert_eq!(
            read_frame(&mut peer).await,
            (EXIT, b"{\"state\":\"ended\"}".to_vec())
        );
        task.await.expect("outbound ends after the exit frame");
    }

    #[tokio::test]
    async fn a_peer_that_does_not_read_holds_the_output_back() {
        // The connection takes 64 bytes; then nothing more is taken from
        // the tree's side than the channel's two chunks.
        let (ours, _peer) = tokio::io::duplex(64);
        let (tx, rx) = mpsc::channel(2);
        let gone = CancellationToken::new();
        let _task = tokio::spawn(outbound(ours, rx, std::future::pending(), gone));
        let mut sent = 0;
        while tokio::time::timeout(Duration::from_millis(200), tx.send((STDOUT, vec![7; 100])))
            .await
            .is_ok()
        {
            sent += 1;
            assert!(sent < 10, "the output is read past what the peer takes");
        }
        assert!(sent <= 3, "{sent} chunks taken");
    }

    #[tokio::test]
    async fn stdin_frames_reach_the_tree_and_an_empty_one_closes_its_stdin() {
        let (mut peer, ours) = tokio::io::duplex(1024);
        let (tx, mut rx) = mpsc::channel(1);
        let gone = CancellationToken::new();
        let task = tokio::spawn(inbound(ours, tx, gone.clone()));
        peer.write_all(&[STDIN, 0, 0, 0, 2, b'h', b'i'])
            .await
            .expect("written");
        assert_eq!(rx.recv().await, Some(b"hi".to_vec()));
        peer.write_all(&[STDIN, 0, 0, 0, 0]).await.expect("written");
        assert_eq!(rx.recv().await, None, "stdin is closed");
        // A frame the service does not take hangs up.
        peer.write_all(&[EXIT, 0, 0, 0, 0]).await.expect("written");
        task.await.expect("inbound ends");
        assert!(gone.is_cancelled());
    }

    #[tokio::test]
    async fn a_half_close_ends_stdin_but_not_the_stream() {
        let (peer, ours) = tokio::io::duplex(1024);
        let (tx, mut rx) = mpsc::channel(1);
        let gone = CancellationToken::new();
        let task = tokio::spawn(inbound(ours, tx, gone.clone()));
        drop(peer);
        assert_eq!(rx.recv().await, None);
        task.await.expect("inbound ends");
        assert!(!gone.is_cancelled());
    }

    #[test]
    fn the_upgrade_is_asked_for_by_both_headers() {
        let mut h = axum::http::HeaderMap::new();
        assert!(!asks_upgrade(&h));
        h.insert(
            axum::http::header::UPGRADE,
            PROTOCOL.parse().expect("a value"),
        );
        assert!(!asks_upgrade(&h));
        h.insert(
            axum::http::header::CONNECTION,
            "keep-alive, Upgrade".parse().expect("a value"),
        );
        assert!(asks_upgrade(&h));
    }
}
