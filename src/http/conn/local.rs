//! The Unix socket's connections: read with `recvmsg`, so descriptors
//! sent with their bytes (`SCM_RIGHTS`) are kept, and each peer named by
//! `SO_PEERCRED`.

use std::os::fd::AsFd;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};

use super::{Accept, MAX_PENDING_FDS, ReceivedFds, Refusal, descriptors_to_spare};
use crate::http::peer::{Peer, PeerCred};

/// A descriptor a peer handed over: a file descriptor (`SCM_RIGHTS`).
pub type Fd = std::os::fd::OwnedFd;

impl ReceivedFds {
    fn push(&self, fd: Fd) {
        let mut h = self.held();
        if h.fds.len() >= MAX_PENDING_FDS {
            tracing::debug!("more descriptors than a request passes: the oldest closed");
            if let Some(old) = h.fds.pop_front() {
                h.discard(old);
            }
        }
        h.fds.push_back(fd);
    }

    /// Closes (off the runtime) every descriptor held now.
    fn discard_all(&self) {
        let mut h = self.held();
        for fd in std::mem::take(&mut h.fds) {
            h.discard(fd);
        }
    }
}

/// A Unix-socket connection read with `recvmsg`, so descriptors sent with
/// its bytes (`SCM_RIGHTS`) are kept ([`ReceivedFds`]) rather than closed
/// by the kernel as a plain `read` would. Its own socket is closed on the
/// [`Closer`](crate::http::closer::Closer) too: closing it releases whatever `SCM_RIGHTS` messages its
/// receive queue still holds, in the closing thread.
pub struct FdStream {
    /// `None` only once dropped.
    io: Option<tokio::net::UnixStream>,
    fds: ReceivedFds,
}

impl FdStream {
    pub fn new(io: tokio::net::UnixStream) -> Self {
        Self {
            io: Some(io),
            fds: ReceivedFds::default(),
        }
    }

    fn io(&self) -> &tokio::net::UnixStream {
        self.io
            .as_ref()
            .expect("an FdStream holds its socket until dropped")
    }

    fn io_mut(&mut self) -> &mut tokio::net::UnixStream {
        self.io
            .as_mut()
            .expect("an FdStream holds its socket until dropped")
    }
}

impl Drop for FdStream {
    fn drop(&mut self) {
        if let Some(io) = self.io.take() {
            // Taken off the reactor here (a plain epoll_ctl), closed there.
            match io.into_std() {
                Ok(std) => self.fds.discard(std),
                Err(e) => tracing::warn!(error = %e, "a connection could not leave the reactor"),
            }
        }
    }
}

/// Descriptors the kernel passes in one message at most (`SCM_MAX_FD`).
/// The control buffer has room for them all, so the kernel never releases
/// what did not fit in the reading thread (a release may block for as long
/// as the peer chose); a message with more than [`MAX_PENDING_FDS`] is
/// refused whole, its descriptors closed on the [`Closer`](crate::http::closer::Closer).
const SCM_MAX_FD: usize = 253;

/// One `recvmsg` into `buf`, keeping what `SCM_RIGHTS` brought
/// (close-on-exec). A message with more descriptors than a request passes
/// is refused, and so is a connection that would hold too many: a request
/// must not run with part of them.
fn recv_with_fds(
    fd: std::os::fd::BorrowedFd<'_>,
    buf: &mut [u8],
    into: &ReceivedFds,
) -> std::io::Result<usize> {
    use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
    let mut space =
        [std::mem::MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(SCM_MAX_FD))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let mut iov = [std::io::IoSliceMut::new(buf)];
    let msg = rustix::net::recvmsg(fd, &mut iov, &mut control, RecvFlags::CMSG_CLOEXEC)?;
    let mut got: Vec<Fd> = Vec::new();
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(fds) = m {
            got.extend(fds);
        }
    }
    if got.is_empty() {
        return Ok(msg.bytes);
    }
    let (reserve, piled_up) = {
        let h = into.held();
        let piled = h.closer.as_ref().is_some_and(|(c, uid)| c.piled_up(*uid));
        (h.reserve, piled)
    };
    let refusal = if piled_up {
        Some(Refusal::PiledUp)
    } else if reserve > 0 && !descriptors_to_spare(reserve) {
        tracing::warn!(
            reserve,
            "descriptors low: those sent with a request are closed and the request refused"
        );
        Some(Refusal::Short)
    } else {
        None
    };
    if let Some(refusal) = refusal {
        for fd in got {
            into.discard(fd);
        }
        into.discard_all();
        into.held().refused = Some(refusal);
        return Ok(msg.bytes);
    }
    let held = into.held().fds.len();
    if held + got.len() > MAX_PENDING_FDS || msg.flags.contains(rustix::net::ReturnFlags::CTRUNC) {
        for fd in got {
            into.discard(fd);
        }
        into.discard_all();
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
            std::task::ready!(this.io().poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            let io = this.io();
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
        Pin::new(self.get_mut().io_mut()).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(self.get_mut().io_mut()).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(self.get_mut().io_mut()).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(self.get_mut().io_mut()).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io().is_write_vectored()
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
