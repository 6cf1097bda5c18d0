//! Who is on the other end of a connection, as the kernel says: the TCP
//! peer's address, or the Unix-socket peer's credentials (`SO_PEERCRED`:
//! pid, uid, gid, taken when it connected). Made once per connection by
//! the serving loop ([`super::conn`], as axum's connect info) and read by
//! [`super::auth`] for every request on it. Never from anything the client
//! sends.

use std::net::SocketAddr;

/// A Unix-socket peer's credentials.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerCred {
    /// Absent where the kernel does not say.
    pub pid: Option<i32>,
    pub uid: u32,
    pub gid: u32,
}

/// One connection's peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Peer {
    Tcp(SocketAddr),
    /// `None`: the credentials could not be read (every request refused).
    Unix(Option<PeerCred>),
}
