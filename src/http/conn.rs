//! The serving loop: what a peer may hold of the service, and for how long.
//!
//! Every connection costs the service a descriptor, and descriptors are what
//! custody reads `/proc`, opens pidfds and writes the ledger with. A local
//! user who may connect to the 0666 socket must not be able to take them
//! (issue 24: 400 idle connections at `nofile 200` made a live tree's
//! `/proc` reads fail). So, on both listeners:
//!
//! - **accept pauses near the descriptor limit**: a connection is accepted
//!   only while more than [`ConnLimits::reserve_fds`] descriptors are free
//!   under the soft `RLIMIT_NOFILE`; the rest wait in the kernel's backlog,
//!   costing the service nothing;
//! - **a cap in all and per peer uid** (Unix socket): past the per-uid cap a
//!   new connection of that uid is closed at once, so one user cannot keep
//!   the others out;
//! - **a header-read timeout** (hyper's, on its own timer): a request whose
//!   head has not arrived in [`ConnLimits::header_read`], and a keep-alive
//!   connection idle that long between requests, is closed (slowloris).
//!
//! On the Unix socket a connection also carries **descriptors** (issue 25):
//! a client may send up to three with the first bytes of a request
//! (`SCM_RIGHTS`), which the spawn handler gives the tree as its 0/1/2
//! (the `Treewarden-Stdio` header names which; docs/ARCHITECTURE.md, "stdio
//! through the socket"). So the socket is read with `recvmsg`
//! ([`FdStream`]); what arrives is kept per connection ([`ReceivedFds`],
//! at most [`MAX_PENDING_FDS`], close-on-exec) until a handler takes it or
//! the response is given: what a request's handler did not take (any
//! request but a spawn) is closed once it is answered, never kept for the
//! connection's life. While the descriptor reserve is short (as accept
//! sees it, [`ConnLimits::reserve_fds`]) descriptors that arrive are closed
//! at once and their request is answered 503 `unavailable` without being
//! served: a peer on a connection accepted earlier cannot spend the reserve
//! by sending them.
//!
//! This module never reads the ledger and never signals; it only decides
//! which connections are served.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::os::fd::{AsFd, OwnedFd};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use axum::response::IntoResponse as _;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::sync::Semaphore;
use tower::ServiceExt as _;

use super::peer::{Peer, PeerCred};

/// What the serving loop allows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnLimits {
    /// Connections served at once, on one listener.
    pub max_total: usize,
    /// Connections one Unix-socket peer uid may hold at once.
    pub max_per_uid: usize,
    /// How long a request's head may take to arrive (and a keep-alive
    /// connection may sit idle between requests).
    pub header_read: Duration,
    /// Descriptors kept free for custody: accept waits while fewer than
    /// this many are free under the soft limit.
    pub reserve_fds: u64,
}

impl Default for ConnLimits {
    fn default() -> Self {
        Self {
            max_total: 1024,
            max_per_uid: 64,
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
}

/// Descriptors held for one connection at most: a request passes 0, 1
/// and 2 at most; one sent past this closes the oldest held.
pub const MAX_PENDING_FDS: usize = 3;

/// The descriptors a Unix-socket peer sent on one connection, in the order
/// they came, until a handler takes them (each request's extension) or the
/// request is answered.
#[derive(Clone, Debug, Default)]
pub struct ReceivedFds(Arc<Mutex<Held>>);

#[derive(Debug, Default)]
struct Held {
    fds: VecDeque<OwnedFd>,
    /// Descriptors came while the reserve was short (closed at once): the
    /// request they came with is refused.
    refused: bool,
    /// [`ConnLimits::reserve_fds`] (0: not checked).
    reserve: u64,
}

impl ReceivedFds {
    fn held(&self) -> std::sync::MutexGuard<'_, Held> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes every descriptor held now.
    pub fn take_all(&self) -> Vec<OwnedFd> {
        self.held().fds.drain(..).collect()
    }

    fn push(&self, fd: OwnedFd) {
        let mut h = self.held();
        if h.fds.len() >= MAX_PENDING_FDS {
            tracing::debug!("more descriptors than a request passes: the oldest closed");
            h.fds.pop_front();
        }
        h.fds.push_back(fd);
    }

    fn set_reserve(&self, reserve: u64) {
        self.held().reserve = reserve;
    }

    /// Whether descriptors were refused since the last answer (and clears it).
    fn take_refused(&self) -> bool {
        std::mem::take(&mut self.held().refused)
    }

    /// After a request is answered: what its handler did not take is closed.
    fn answered(&self) {
        let left = self.take_all();
        if !left.is_empty() {
            tracing::debug!(
                count = left.len(),
                "descriptors the request did not use: closed"
            );
        }
        self.held().refused = false;
    }
}

/// A Unix-socket connection read with `recvmsg`, so descriptors sent with
/// its bytes (`SCM_RIGHTS`) are kept ([`ReceivedFds`]) rather than closed
/// by the kernel as a plain `read` would.
pub struct FdStream {
    io: tokio::net::UnixStream,
    fds: ReceivedFds,
}

impl FdStream {
    pub fn new(io: tokio::net::UnixStream) -> Self {
        Self {
            io,
            fds: ReceivedFds::default(),
        }
    }
}

/// One `recvmsg` into `buf`, keeping what `SCM_RIGHTS` brought
/// (close-on-exec). A message whose descriptors did not fit is refused:
/// the kernel closed some, and a request must not run with part of them.
fn recv_with_fds(
    fd: std::os::fd::BorrowedFd<'_>,
    buf: &mut [u8],
    into: &ReceivedFds,
) -> std::io::Result<usize> {
    use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
    let mut space =
        [std::mem::MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_PENDING_FDS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let mut iov = [std::io::IoSliceMut::new(buf)];
    let msg = rustix::net::recvmsg(fd, &mut iov, &mut control, RecvFlags::CMSG_CLOEXEC)?;
    // The control buffer's alignment lets the kernel pass a few more than
    // MAX_PENDING_FDS without truncating: they are counted, and a message
    // with too many (or a connection holding too many) is refused whole,
    // never cut to its last ones (which would land on the wrong slots).
    let mut got: Vec<OwnedFd> = Vec::new();
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(fds) = m {
            got.extend(fds);
        }
    }
    if !got.is_empty() {
        let reserve = into.held().reserve;
        if reserve > 0 && !descriptors_to_spare(reserve) {
            drop(got);
            into.take_all();
            into.held().refused = true;
            tracing::warn!(
                reserve,
                "descriptors low: those sent with a request are closed and the request refused"
            );
            return Ok(msg.bytes);
        }
    }
    let held = into.held().fds.len();
    if held + got.len() > MAX_PENDING_FDS || msg.flags.contains(rustix::net::ReturnFlags::CTRUNC) {
        drop(got);
        into.take_all();
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("more than {MAX_PENDING_FDS} descriptors sent with one message"),
        ));
    }
    for fd in got {
        into.push(fd);
    }
    Ok(msg.bytes)
}

impl AsyncRead for FdStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        loop {
            std::task::ready!(this.io.poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            let io = &this.io;
            let fds = &this.fds;
            match io.try_io(Interest::READABLE, || {
                recv_with_fds(io.as_fd(), unfilled, fds)
            }) {
                Ok(n) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl AsyncWrite for FdStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

impl Accept for tokio::net::TcpListener {
    type Io = tokio::net::TcpStream;
    async fn accept_peer(&mut self) -> std::io::Result<(Self::Io, Peer)> {
        let (io, addr) = self.accept().await?;
        Ok((io, Peer::Tcp(addr)))
    }
}

impl Accept for tokio::net::UnixListener {
    type Io = FdStream;

    fn received(io: &Self::Io) -> Option<ReceivedFds> {
        Some(io.fds.clone())
    }

    async fn accept_peer(&mut self) -> std::io::Result<(Self::Io, Peer)> {
        let (io, _) = self.accept().await?;
        let peer = match io.peer_cred() {
            Ok(c) => Peer::Unix(Some(PeerCred {
                pid: c.pid(),
                uid: c.uid(),
                gid: c.gid(),
            })),
            Err(e) => {
                tracing::warn!(error = %e, "SO_PEERCRED failed: the connection is refused");
                Peer::Unix(None)
            }
        };
        Ok((FdStream::new(io), peer))
    }
}

/// One uid's hold on its share of [`ConnLimits::max_per_uid`], given back
/// when the connection ends.
struct UidSlot {
    counts: Arc<Mutex<HashMap<u32, usize>>>,
    uid: u32,
}

impl UidSlot {
    fn take(counts: &Arc<Mutex<HashMap<u32, usize>>>, uid: u32, cap: usize) -> Option<Self> {
        let mut map = counts.lock().unwrap_or_else(|e| e.into_inner());
        let n = map.entry(uid).or_insert(0);
        if *n >= cap {
            return None;
        }
        *n += 1;
        Some(Self {
            counts: counts.clone(),
            uid,
        })
    }
}

impl Drop for UidSlot {
    fn drop(&mut self) {
        let mut map = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = map.get_mut(&self.uid) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                map.remove(&self.uid);
            }
        }
    }
}

/// Whether more than `reserve` descriptors are free under the soft
/// `RLIMIT_NOFILE` (`true` where either cannot be read: the accept is not
/// held on a guess).
fn descriptors_to_spare(reserve: u64) -> bool {
    let Some(limit) = crate::proc::nofile_soft_limit() else {
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

/// Serves `router` on `listener` until `shutdown` is cancelled, then lets
/// the connections in flight finish (each asked to close once its request
/// is answered). Every request sees its connection's [`Peer`] as axum's
/// `ConnectInfo`, which the auth layer turns into its principal.
// Over 100 lines on purpose: each accept turn takes a connection's limits in order (a total permit,
// spare descriptors, a per-uid slot), each wait raced against shutdown (`break 'accept`), and hands
// them to the connection's task; split, the labelled breaks and held permits would cross functions.
pub async fn serve<L: Accept>(
    mut listener: L,
    router: Router,
    shutdown: tokio_util::sync::CancellationToken,
    limits: ConnLimits,
) -> std::io::Result<()> {
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let total = Arc::new(Semaphore::new(limits.max_total.max(1)));
    let per_uid: Arc<Mutex<HashMap<u32, usize>>> = Arc::default();
    'accept: loop {
        let permit = tokio::select! {
            p = total.clone().acquire_owned() => match p {
                Ok(p) => p,
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
        let slot = match peer {
            Peer::Unix(Some(cred)) => match UidSlot::take(&per_uid, cred.uid, limits.max_per_uid) {
                Some(slot) => Some(slot),
                None => {
                    tracing::warn!(
                        uid = cred.uid,
                        cap = limits.max_per_uid,
                        "connection refused: this uid holds its cap of connections"
                    );
                    drop(io);
                    continue;
                }
            },
            _ => None,
        };
        let router = router.clone();
        let fds = L::received(&io);
        if let Some(fds) = &fds {
            fds.set_reserve(limits.reserve_fds);
        }
        let service = hyper::service::service_fn(
            move |mut req: hyper::Request<hyper::body::Incoming>| {
                req.extensions_mut().insert(ConnectInfo(peer));
                let fds = fds.clone();
                if let Some(fds) = &fds {
                    req.extensions_mut().insert(fds.clone());
                }
                let router = router.clone();
                async move {
                    if let Some(fds) = fds.as_ref().filter(|f| f.take_refused()) {
                        fds.answered();
                        return Ok(super::error::ApiError::Unavailable(
                            "descriptors are short: descriptors sent with a request are refused for now; retry later".into(),
                        )
                        .into_response());
                    }
                    let answer = router.oneshot(req.map(axum::body::Body::new)).await;
                    if let Some(fds) = &fds {
                        fds.answered();
                    }
                    answer
                }
            },
        );
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_read)
            .serve_connection(TokioIo::new(io), service);
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _held = (permit, slot);
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
        });
    }
    graceful.shutdown().await;
    Ok(())
}
