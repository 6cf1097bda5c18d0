//! The serving loop: what a peer may hold of the service, and for how long.
//!
//! Every connection costs the service a descriptor, and descriptors are what
//! custody reads `/proc`, opens pidfds and writes the ledger with; the two
//! async workers that serve connections also run custody's timers. A local
//! user who may connect to the 0666 socket, or to loopback TCP without a
//! token, must not be able to take either. So, on both listeners:
//!
//! - **accept pauses near the descriptor limit**: a connection is accepted
//!   only while more than [`ConnLimits::reserve_fds`] descriptors are free
//!   under the soft `RLIMIT_NOFILE`; the rest wait in the kernel's backlog,
//!   costing the service nothing;
//! - **a cap in all and per peer** ([`Share`]: the peer uid on the socket
//!   and on loopback TCP, the source address beyond loopback); a connection
//!   over a cap is **answered 503 with `Retry-After`** and closed, never
//!   reset (at most [`MAX_REFUSING`] refusals at once; past that, too,
//!   accept waits);
//! - **time bounds on both directions**: hyper's header-read timeout (a
//!   request head that has not arrived in [`ConnLimits::header_read`], and
//!   a keep-alive connection idle that long, is closed: slowloris), and the
//!   same bound on an answer the peer does not read ([`ConnIo`]: a write
//!   that makes no progress fails the connection), each reset on progress;
//! - **one answer per anonymous TCP connection** (no token, no dashboard
//!   cookie): `Connection: close`, so pipelined open reads cannot hold one;
//! - **one framing per request**: a head with both `Transfer-Encoding` and
//!   `Content-Length` is refused 400 and its connection closed
//!   ([`super::framing`]).
//!
//! On the Unix socket a connection also carries **descriptors**: a client
//! may send up to three with the first bytes of a spawn (`SCM_RIGHTS`),
//! which the handler gives the tree as its 0/1/2 (the `Treewarden-Stdio`
//! header names which; docs/INTEGRATION.md, "stdio through the socket").
//! So the socket is read with `recvmsg` ([`FdStream`]); what arrives is
//! kept per connection ([`ReceivedFds`], at most [`MAX_PENDING_FDS`],
//! close-on-exec) until the spawn handler takes it. Any other request that
//! brings descriptors is refused 400 unserved. While the descriptor reserve
//! is short, descriptors that arrive are refused and their request answered
//! 503 `unavailable`: a peer on a connection accepted earlier cannot spend
//! the reserve by sending them. Every descriptor let go of, and every Unix
//! connection itself, is closed on the listener's [`Closer`], never on an
//! async worker: the peer chose how long that close blocks.
//!
//! This module never reads the ledger and never signals; it only decides
//! which connections are served.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use axum::response::IntoResponse as _;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::Semaphore;
use tower::ServiceExt as _;

use super::closer::Closer;
use super::framing::Framing;
use super::peer::Peer;

/// What the serving loop allows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnLimits {
    /// Connections served at once, on one listener.
    pub max_total: usize,
    /// Connections one peer may hold at once: a peer uid on the Unix
    /// socket and on loopback TCP, a source address beyond loopback
    /// ([`Share`]).
    pub max_per_uid: usize,
    /// How long a request's head may take to arrive (and a keep-alive
    /// connection may sit idle between requests), and how long an answer
    /// may wait on a peer that does not read it (a write that makes no
    /// progress; reset on progress).
    pub header_read: Duration,
    /// Descriptors kept free for custody: accept waits while fewer than
    /// this many are free under the soft limit.
    pub reserve_fds: u64,
}

impl Default for ConnLimits {
    fn default() -> Self {
        Self {
            max_total: crate::config::MAX_CONNECTIONS,
            max_per_uid: crate::config::MAX_CONNECTIONS_PER_UID,
            header_read: Duration::from_secs(10),
            reserve_fds: 128,
        }
    }
}

/// A listener the loop accepts from: TCP or the Unix socket, each
/// connection with its [`Peer`] as the kernel says.
pub trait Accept: Send + 'static {
    type Io: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    fn accept_peer(&mut self) -> impl Future<Output = std::io::Result<(Self::Io, Peer)>> + Send;
    /// Where the connection keeps the descriptors its peer sent (the Unix
    /// socket's); `None` where none can come (TCP).
    fn received(_io: &Self::Io) -> Option<ReceivedFds> {
        None
    }
    /// The connection's own address (TCP), to find its peer's uid.
    fn local(_io: &Self::Io) -> Option<std::net::SocketAddr> {
        None
    }
}

/// The local socket's connections: on Unix, read with `recvmsg`
/// (`FdStream`); on Windows there is no local socket.
#[cfg_attr(windows, path = "conn/no_local.rs")]
mod local;
pub use local::Fd;

/// Descriptors held for one connection at most: a request passes 0, 1
/// and 2 at most; one sent past this closes the oldest held.
pub const MAX_PENDING_FDS: usize = 3;

/// The descriptors a Unix-socket peer sent on one connection, in the order
/// they came, until a handler takes them (each request's extension) or the
/// request is answered. Whatever is let go of them is closed on the
/// connection's [`Closer`], never on the runtime.
#[derive(Clone, Debug, Default)]
pub struct ReceivedFds(Arc<Mutex<Held>>);

/// Why the descriptors that came with a request were refused (closed
/// unused) and the request is answered 503 without being served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
// Its variants but `Short` are built by the Unix socket's `recvmsg` only.
#[allow(dead_code)]
enum Refusal {
    /// The descriptor reserve was short.
    Short,
    /// The peer's closes piled up ([`Closer::piled_up`]): the connection
    /// is cut off after the answer.
    PiledUp,
}

#[derive(Default)]
struct Held {
    fds: VecDeque<Fd>,
    refused: Option<Refusal>,
    /// [`ConnLimits::reserve_fds`] (0: not checked).
    reserve: u64,
    /// Where what is let go is closed, and for which peer uid; `None`
    /// only before the serving loop set it (then dropped in place).
    closer: Option<(Closer, u32)>,
}

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Held")
            .field("fds", &self.fds.len())
            .field("refused", &self.refused)
            .finish_non_exhaustive()
    }
}

impl Held {
    fn discard(&self, fd: Fd) {
        match &self.closer {
            Some((c, uid)) => c.drop_later(*uid, fd),
            None => drop(fd),
        }
    }
}

impl Drop for Held {
    /// The connection ended with descriptors still held: closed off the
    /// runtime as well.
    fn drop(&mut self) {
        for fd in std::mem::take(&mut self.fds) {
            self.discard(fd);
        }
    }
}

impl ReceivedFds {
    fn held(&self) -> std::sync::MutexGuard<'_, Held> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes every descriptor held now. What the caller does not keep it
    /// gives back to [`ReceivedFds::discard`], never drops in place.
    pub fn take_all(&self) -> Vec<Fd> {
        self.held().fds.drain(..).collect()
    }

    /// Drops `item` (descriptors of the peer's, or what holds them) on the
    /// connection's [`Closer`]: its last close may block for as long as
    /// the peer chose.
    pub fn discard<T: Send + 'static>(&self, item: T) {
        let closer = self.held().closer.clone();
        match closer {
            Some((c, uid)) => c.drop_later(uid, item),
            None => drop(item),
        }
    }

    fn configure(&self, reserve: u64, closer: Closer, uid: u32) {
        let mut h = self.held();
        h.reserve = reserve;
        h.closer = Some((closer, uid));
    }

    /// Why descriptors were refused since the last answer, if they were
    /// (and clears it).
    fn take_refused(&self) -> Option<Refusal> {
        self.held().refused.take()
    }

    fn holds_any(&self) -> bool {
        !self.held().fds.is_empty()
    }

    /// After a request is answered: what its handler did not take is
    /// closed (off the runtime).
    fn answered(&self) {
        let mut h = self.held();
        if !h.fds.is_empty() {
            tracing::debug!(
                count = h.fds.len(),
                "descriptors the request did not use: closed"
            );
        }
        for fd in std::mem::take(&mut h.fds) {
            h.discard(fd);
        }
        h.refused = None;
    }
}

impl Accept for tokio::net::TcpListener {
    type Io = tokio::net::TcpStream;
    async fn accept_peer(&mut self) -> std::io::Result<(Self::Io, Peer)> {
        let (io, addr) = self.accept().await?;
        Ok((io, Peer::Tcp(addr)))
    }

    fn local(io: &Self::Io) -> Option<std::net::SocketAddr> {
        io.local_addr().ok()
    }
}

/// Whose share of [`ConnLimits::max_per_uid`] a connection takes.
///
/// On the Unix socket the kernel names the peer's uid (`SO_PEERCRED`). On
/// loopback TCP it does too, less directly: the peer's socket is the one
/// whose local and remote addresses are the connection's two ends
/// reversed, and `/proc/net/tcp{,6}` gives its owner's uid
/// ([`super::peer::loopback_tcp_uid`]). A per-address cap would be no cap
/// there (every local user is 127.0.0.1), so the uid it is. Beyond
/// loopback (`--listen` on a public address, every request needing a
/// token) the source address is all there is. A loopback peer whose
/// socket is not found (gone already) shares one bucket with the others
/// not found.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Share {
    Uid(u32),
    Addr(std::net::IpAddr),
    /// A Unix peer whose credentials could not be read (every request of
    /// it refused) or a loopback peer not found.
    Unknown,
}

impl Share {
    /// The peer uid whose closing threads get this connection's
    /// descriptors (`u32::MAX` where none is known).
    fn closer_uid(self) -> u32 {
        match self {
            Share::Uid(u) => u,
            Share::Addr(_) | Share::Unknown => u32::MAX,
        }
    }
}

/// The connection's share, found off the async workers where it reads
/// `/proc` (a read of the kernel's tables, but not one to make a worker
/// wait on under a flood of connections).
async fn share_of(peer: Peer, local: Option<std::net::SocketAddr>) -> Share {
    match peer {
        Peer::Unix(Some(cred)) => Share::Uid(cred.uid),
        Peer::Unix(None) => Share::Unknown,
        Peer::Tcp(addr) if addr.ip().is_loopback() => {
            let Some(local) = local else {
                return Share::Unknown;
            };
            tokio::task::spawn_blocking(move || super::peer::loopback_tcp_uid(addr, local))
                .await
                .ok()
                .flatten()
                .map_or(Share::Unknown, Share::Uid)
        }
        Peer::Tcp(addr) => Share::Addr(addr.ip()),
    }
}

/// One peer's hold on its share of [`ConnLimits::max_per_uid`], given back
/// when the connection ends.
struct ShareSlot {
    counts: Arc<Mutex<HashMap<Share, usize>>>,
    share: Share,
}

impl ShareSlot {
    fn take(counts: &Arc<Mutex<HashMap<Share, usize>>>, share: Share, cap: usize) -> Option<Self> {
        let mut map = counts.lock().unwrap_or_else(|e| e.into_inner());
        let n = map.entry(share).or_insert(0);
        if *n >= cap {
            return None;
        }
        *n += 1;
        Some(Self {
            counts: counts.clone(),
            share,
        })
    }
}

impl Drop for ShareSlot {
    fn drop(&mut self) {
        let mut map = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = map.get_mut(&self.share) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                map.remove(&self.share);
            }
        }
    }
}

/// Whether more than `reserve` descriptors are free under the soft
/// `RLIMIT_NOFILE` (`true` where either cannot be read: the accept is not
/// held on a guess).
fn descriptors_to_spare(reserve: u64) -> bool {
    let Some(limit) = crate::service::vocab::nofile_soft_limit() else {
        return true;
    };
    // Not readable (opening the directory takes a descriptor: EMFILE is
    // the very case): no room to spare.
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return false;
    };
    let open = dir.count() as u64;
    limit.saturating_sub(open) > reserve
}

/// Connections answered 503 at once, over a cap (in all or per peer),
/// beside those served. Past this too, accept waits (the kernel's backlog).
const MAX_REFUSING: usize = 256;

/// How long a connection over a cap may take to send its request before
/// its 503 is written anyway, and how long the whole refusal may take.
const REFUSE_READ: Duration = Duration::from_secs(2);
const REFUSE_WITHIN: Duration = Duration::from_secs(5);

/// Seconds a refused client is told to wait (`Retry-After`).
const RETRY_AFTER_SECS: &str = "1";

/// A 503 that tells the client when to come back (`Retry-After`).
fn unavailable(message: &str) -> axum::response::Response {
    let mut r = super::error::ApiError::Unavailable(message.to_string()).into_response();
    r.headers_mut().insert(
        axum::http::header::RETRY_AFTER,
        axum::http::HeaderValue::from_static(RETRY_AFTER_SECS),
    );
    r
}

/// `r`, with `Connection: close` (hyper ends the connection after it).
fn closes(mut r: axum::response::Response) -> axum::response::Response {
    r.headers_mut().insert(
        axum::http::header::CONNECTION,
        axum::http::HeaderValue::from_static("close"),
    );
    r
}

/// Answers every request of a connection over a cap 503 (`Retry-After`,
/// `Connection: close`) and closes it: read first (head and a bounded
/// body), so the close after the answer is an orderly one, not a reset
/// that could reach the client before the answer does.
async fn refuse<I>(io: I, why: &'static str, header_read: Duration)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(
        move |req: hyper::Request<hyper::body::Incoming>| async move {
            let body = axum::body::Body::new(req.into_body());
            let _ = axum::body::to_bytes(body, 64 * 1024).await;
            Ok::<_, std::convert::Infallible>(closes(unavailable(why)))
        },
    );
    let read = header_read.min(REFUSE_READ);
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(read)
        .keep_alive(false)
        .serve_connection(TokioIo::new(ConnIo::new(io, read)), service);
    if let Ok(Err(e)) = tokio::time::timeout(REFUSE_WITHIN, conn).await {
        tracing::debug!(error = %e, "a refused connection ended with an error");
    }
}

/// A connection's bytes as the serving loop watches them.
///
/// An answer the peer does not read is not waited on for ever: a write
/// (or flush) that has made no progress for `after` fails the connection
/// (`TimedOut`), as hyper's header timeout ends one that sends nothing.
/// The clock starts when a write first has to wait and stops at the next
/// byte written. What is read is followed by [`Framing`] (which request
/// heads carry two framings).
struct ConnIo<T> {
    io: T,
    after: Duration,
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
    framing: Arc<Mutex<Framing>>,
    /// Set once the connection carries streamed stdio ([`Streamed`]): a
    /// peer that does not read then only holds its tree's output back.
    patient: Arc<std::sync::atomic::AtomicBool>,
}

impl<T> ConnIo<T> {
    fn new(io: T, after: Duration) -> Self {
        Self {
            io,
            after,
            stalled: None,
            framing: Arc::default(),
            patient: Arc::default(),
        }
    }

    fn watch<R>(
        &mut self,
        cx: &mut std::task::Context<'_>,
        r: std::task::Poll<std::io::Result<R>>,
        progressed: impl FnOnce(&R) -> bool,
    ) -> std::task::Poll<std::io::Result<R>> {
        use std::task::Poll;
        match r {
            Poll::Ready(Ok(v)) => {
                if progressed(&v) {
                    self.stalled = None;
                }
                Poll::Ready(Ok(v))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending if self.patient.load(std::sync::atomic::Ordering::Relaxed) => {
                self.stalled = None;
                Poll::Pending
            }
            Poll::Pending => {
                let after = self.after;
                let stall = self
                    .stalled
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(after)));
                if stall.as_mut().poll(cx).is_ready() {
                    tracing::debug!(
                        after = ?after,
                        "the peer has not read its answer: the connection is closed"
                    );
                    Poll::Ready(Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "the peer did not read its answer in time",
                    )))
                } else {
                    Poll::Pending
                }
            }
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for ConnIo<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let r = Pin::new(&mut this.io).poll_read(cx, buf);
        if let std::task::Poll::Ready(Ok(())) = r {
            this.framing
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .feed(&buf.filled()[before..]);
        }
        r
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for ConnIo<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.io).poll_write(cx, buf);
        this.watch(cx, r, |n| *n > 0)
    }

    fn poll_flush(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.io).poll_flush(cx);
        this.watch(cx, r, |()| true)
    }

    fn poll_shutdown(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.io).poll_shutdown(cx);
        this.watch(cx, r, |()| true)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        this.watch(cx, r, |n| *n > 0)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

/// Every request's handle on its connection's write bound: a spawn whose
/// connection becomes streamed stdio lifts it ([`Streamed::lift`]), since
/// there a write waits on the peer by design (back-pressure), for as long
/// as the peer likes; the tree's custody never waits on it.
#[derive(Clone, Debug)]
pub struct Streamed(Arc<std::sync::atomic::AtomicBool>);

impl Streamed {
    pub fn lift(&self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Why a request is answered before the router sees it, if it is
/// (`both_framings`: its head had `Transfer-Encoding` and
/// `Content-Length`, as [`Framing`] saw it).
fn answer_first(
    req: &hyper::Request<hyper::body::Incoming>,
    both_framings: bool,
    fds: Option<&ReceivedFds>,
) -> Option<axum::response::Response> {
    use super::error::ApiError;
    // Two framings of one body: something in front may have taken the
    // other one (request smuggling). Refused, and the connection ends.
    if both_framings {
        return Some(closes(
            ApiError::BadRequest(
                "both Transfer-Encoding and Content-Length: send one framing".into(),
            )
            .into_response(),
        ));
    }
    let fds = fds?;
    match fds.take_refused() {
        Some(Refusal::Short) => {
            return Some(unavailable(
                "descriptors are short: descriptors sent with a request are refused for now; retry later",
            ));
        }
        Some(Refusal::PiledUp) => {
            let uid = fds.held().closer.as_ref().map_or(u32::MAX, |(_, u)| *u);
            Closer::cut_off(uid);
            return Some(closes(unavailable(
                "your descriptors' closes are piling up: descriptors you send are refused until they are closed; retry later",
            )));
        }
        None => {}
    }
    // Only a spawn passes descriptors; any other request that brings some
    // is refused unserved, and they are closed off the runtime.
    if fds.holds_any()
        && !(req.method() == axum::http::Method::POST && req.uri().path() == "/api/trees")
    {
        return Some(
            ApiError::BadRequest(
                "descriptors pass only with a spawn (POST /api/trees, Treewarden-Stdio): those sent are closed unused".into(),
            )
            .into_response(),
        );
    }
    None
}

/// Serves `router` on `listener` until `shutdown` is cancelled, then lets
/// the connections in flight finish (each asked to close once its request
/// is answered). Every request sees its connection's [`Peer`] as axum's
/// `ConnectInfo`, which the auth layer turns into its principal.
// Over 100 lines on purpose: each accept turn takes a connection's limits in order (a total permit
// or a refusal's, spare descriptors), each wait raced against shutdown (`break 'accept`), and hands
// them to the connection's task; split, the labelled breaks and held permits would cross functions.
pub async fn serve<L: Accept>(
    mut listener: L,
    router: Router,
    shutdown: tokio_util::sync::CancellationToken,
    limits: ConnLimits,
) -> std::io::Result<()> {
    // Each connection's task, so the shutdown waits for those in flight
    // (hyper-util's `GracefulShutdown` does not take a connection that may
    // upgrade).
    let tracker = tokio_util::task::TaskTracker::new();
    let total = Arc::new(Semaphore::new(limits.max_total.max(1)));
    let refusing = Arc::new(Semaphore::new(MAX_REFUSING));
    let per_peer: Arc<Mutex<HashMap<Share, usize>>> = Arc::default();
    let closer = Closer::default();
    'accept: loop {
        // A served slot if one is free, else a refusal's (answered 503).
        let permit = tokio::select! {
            biased;
            p = total.clone().acquire_owned() => match p {
                Ok(p) => Ok(p),
                Err(_) => break,
            },
            p = refusing.clone().acquire_owned() => match p {
                Ok(p) => Err(p),
                Err(_) => break,
            },
            () = shutdown.cancelled() => break,
        };
        let mut waited = false;
        while !descriptors_to_spare(limits.reserve_fds) {
            if !waited {
                tracing::warn!(
                    reserve = limits.reserve_fds,
                    "descriptors low: accept paused until connections close"
                );
                waited = true;
            }
            tokio::select! {
                () = tokio::time::sleep(Duration::from_millis(50)) => {}
                () = shutdown.cancelled() => break 'accept,
            }
        }
        let accepted = tokio::select! {
            r = listener.accept_peer() => r,
            () = shutdown.cancelled() => break,
        };
        let (io, peer) = match accepted {
            Ok(x) => x,
            Err(e) => {
                // EMFILE/ENFILE and the like: the backlog keeps the peer
                // waiting; try again shortly rather than spin.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        // A served slot may have come free while the refusal waited.
        let permit =
            permit.or_else(|refusal| total.clone().try_acquire_owned().map_err(|_| refusal));
        let fds = L::received(&io);
        // Known before the connection is served or refused, in accept
        // order: a later connection never takes an earlier one's slot.
        let share = share_of(peer, L::local(&io)).await;
        if let Some(fds) = &fds {
            fds.configure(limits.reserve_fds, closer.clone(), share.closer_uid());
        }
        let admitted = match permit {
            Err(refusal) => {
                tracing::warn!(
                    cap = limits.max_total,
                    "connection answered 503: the listener serves its cap of connections"
                );
                Err((
                    "the service holds its cap of connections; retry later",
                    Some(refusal),
                ))
            }
            Ok(permit) => match share {
                Share::Uid(uid) if fds.is_some() && closer.piled_up(uid) => {
                    Closer::cut_off(uid);
                    drop(permit);
                    Err((
                        "your descriptors' closes are piling up: retry later",
                        refusing.clone().try_acquire_owned().ok(),
                    ))
                }
                _ => match ShareSlot::take(&per_peer, share, limits.max_per_uid) {
                    Some(slot) => Ok((permit, slot)),
                    None => {
                        tracing::warn!(
                            ?share,
                            cap = limits.max_per_uid,
                            "connection answered 503: this peer holds its cap of connections"
                        );
                        drop(permit);
                        Err((
                            "you hold your cap of connections; retry later",
                            refusing.clone().try_acquire_owned().ok(),
                        ))
                    }
                },
            },
        };
        let (permit, slot) = match admitted {
            Ok(x) => x,
            Err((why, Some(refusal))) => {
                tokio::spawn(async move {
                    let _held = refusal;
                    refuse(io, why, limits.header_read).await;
                });
                continue;
            }
            Err((why, None)) => {
                // Every refusal's room is taken: closed unanswered (a Unix
                // connection on the closer, as always).
                tracing::warn!(
                    why,
                    "connection closed unanswered: {MAX_REFUSING} refusals under way"
                );
                drop(io);
                continue;
            }
        };
        let router = router.clone();
        let shutdown = shutdown.clone();
        tracker.spawn(async move {
            let io = ConnIo::new(io, limits.header_read);
            let framing = io.framing.clone();
            let streamed = Streamed(io.patient.clone());
            let service = hyper::service::service_fn(
                move |mut req: hyper::Request<hyper::body::Incoming>| {
                    // hyper hands requests over in the order their heads came.
                    let both = framing
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .next_has_both();
                    let first = answer_first(&req, both, fds.as_ref());
                    // Anonymous over TCP (no token, no dashboard cookie):
                    // one answer per connection, so the open reads cannot
                    // hold a connection with pipelined requests.
                    let anonymous = matches!(peer, Peer::Tcp(_))
                        && !req
                            .headers()
                            .contains_key(axum::http::header::AUTHORIZATION)
                        && !req.headers().contains_key(axum::http::header::COOKIE);
                    req.extensions_mut().insert(ConnectInfo(peer));
                    req.extensions_mut().insert(streamed.clone());
                    let fds = fds.clone();
                    if let Some(fds) = &fds {
                        req.extensions_mut().insert(fds.clone());
                    }
                    let router = router.clone();
                    async move {
                        if let Some(answer) = first {
                            if let Some(fds) = &fds {
                                fds.answered();
                            }
                            return Ok(answer);
                        }
                        let answer = router.oneshot(req.map(axum::body::Body::new)).await;
                        if let Some(fds) = &fds {
                            fds.answered();
                        }
                        answer.map(|a| if anonymous { closes(a) } else { a })
                    }
                },
            );
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_read)
                .serve_connection(TokioIo::new(io), service)
                .with_upgrades();
            // Given back when `conn` ends: after its last answer, or at an
            // upgrade, which hands the connection to its handler (streamed
            // stdio) and out of both caps. Such a connection is its tree's
            // stdio, bounded by the cap on live trees, not a request slot: a
            // caller's long-lived stdio trees never starve its requests.
            let _held = (permit, slot);
            let mut conn = std::pin::pin!(conn);
            // At shutdown a connection finishes the request it serves and
            // closes; an upgraded one is its handler's (streamed stdio).
            let ended = tokio::select! {
                r = conn.as_mut() => r,
                () = shutdown.cancelled() => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            };
            if let Err(e) = ended {
                tracing::debug!(error = %e, "connection ended with an error");
            }
        });
    }
    tracker.close();
    tracker.wait().await;
    Ok(())
}
