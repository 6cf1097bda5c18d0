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
//! This module never reads the ledger and never signals; it only decides
//! which connections are served.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
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
}

impl Accept for tokio::net::TcpListener {
    type Io = tokio::net::TcpStream;
    async fn accept_peer(&mut self) -> std::io::Result<(Self::Io, Peer)> {
        let (io, addr) = self.accept().await?;
        Ok((io, Peer::Tcp(addr)))
    }
}

impl Accept for tokio::net::UnixListener {
    type Io = tokio::net::UnixStream;
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
        Ok((io, peer))
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
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return true;
    };
    let open = dir.count() as u64;
    limit.saturating_sub(open) > reserve
}

/// Serves `router` on `listener` until `shutdown` is cancelled, then lets
/// the connections in flight finish (each asked to close once its request
/// is answered). Every request sees its connection's [`Peer`] as axum's
/// `ConnectInfo`, which the auth layer turns into its principal.
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
        let service =
            hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
                req.extensions_mut().insert(ConnectInfo(peer));
                router.clone().oneshot(req.map(axum::body::Body::new))
            });
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
