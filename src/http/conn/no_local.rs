//! Windows: no local socket (`serve` listens on loopback TCP only), so no
//! descriptor ever comes with a request; the types keep the handlers'
//! signatures one.

use super::Accept;
use crate::http::peer::Peer;

/// A descriptor a peer handed over: none ever comes here.
pub type Fd = std::os::windows::io::OwnedHandle;

/// The local listener is never made here ([`crate::service::vocab::LOCAL_SOCKET`]
/// is false): an `Accept` in name only.
impl Accept for crate::service::vocab::LocalListener {
    type Io = tokio::net::TcpStream;

    async fn accept_peer(&mut self) -> std::io::Result<(Self::Io, Peer)> {
        match *self {}
    }
}
