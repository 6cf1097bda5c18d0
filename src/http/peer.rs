//! Who is on the other end of a connection, as the kernel says: the TCP
//! peer's address, or the Unix-socket peer's credentials (`SO_PEERCRED`:
//! pid, uid, gid, taken when it connected). Made once per connection by
//! the serving loop ([`super::conn`], as axum's connect info) and read by
//! [`super::auth`] for every request on it. Never from anything the client
//! sends. On loopback TCP the peer's uid is found too, from the kernel's
//! socket table ([`loopback_tcp_uid`]), for the serving loop's per-peer cap.

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

/// The uid owning the loopback TCP socket at the other end of a
/// connection this service accepted (`peer` -> `local`): the socket in
/// `/proc/net/tcp` (or `tcp6`) whose local address is `peer` and whose
/// remote one is `local`. `None` where there is none (the peer is gone,
/// or lives in another network namespace) or the table cannot be read.
/// Blocking (reads `/proc`): call it off the async workers.
pub fn loopback_tcp_uid(peer: SocketAddr, local: SocketAddr) -> Option<u32> {
    let (table, want_local, want_remote) = match (peer, local) {
        (SocketAddr::V4(p), SocketAddr::V4(l)) => ("/proc/net/tcp", hex_v4(p), hex_v4(l)),
        (SocketAddr::V6(p), SocketAddr::V6(l)) => ("/proc/net/tcp6", hex_v6(p), hex_v6(l)),
        _ => return None,
    };
    let text = std::fs::read_to_string(table).ok()?;
    tcp_table_uid(&text, &want_local, &want_remote)
}

/// The uid column of the row of a `/proc/net/tcp{,6}` table whose
/// addresses are `local` and `remote` (as the table prints them).
fn tcp_table_uid(text: &str, local: &str, remote: &str) -> Option<u32> {
    text.lines().skip(1).find_map(|line| {
        // sl local_address rem_address st tx:rx tr:when retrnsmt uid ...
        let mut f = line.split_whitespace();
        let (_, l, r) = (f.next()?, f.next()?, f.next()?);
        if !l.eq_ignore_ascii_case(local) || !r.eq_ignore_ascii_case(remote) {
            return None;
        }
        f.nth(4)?.parse().ok()
    })
}

/// An IPv4 address as `/proc/net/tcp` prints it: the address's four bytes
/// as one native-endian word in hex, a colon, the port in hex.
fn hex_v4(a: std::net::SocketAddrV4) -> String {
    format!(
        "{:08X}:{:04X}",
        u32::from_ne_bytes(a.ip().octets()),
        a.port()
    )
}

/// An IPv6 address as `/proc/net/tcp6` prints it: four native-endian
/// words in hex, a colon, the port in hex.
fn hex_v6(a: std::net::SocketAddrV6) -> String {
    let o = a.ip().octets();
    let mut s = String::with_capacity(37);
    for w in o.chunks_exact(4) {
        s.push_str(&format!(
            "{:08X}",
            u32::from_ne_bytes([w[0], w[1], w[2], w[3]])
        ));
    }
    format!("{s}:{:04X}", a.port())
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn a_loopback_connections_peer_is_found_with_its_uid() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let client =
            std::net::TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
        let (server, peer) = listener.accept().expect("accept");
        let local = server.local_addr().expect("local");
        assert_eq!(peer, client.local_addr().expect("client addr"));
        assert_eq!(
            loopback_tcp_uid(peer, local),
            Some(crate::service::users::own_uid())
        );
        // Not the server's own row (its addresses are the other way round).
        let other: SocketAddr = "127.0.0.1:1".parse().expect("addr");
        assert_eq!(loopback_tcp_uid(other, local), None);
    }
}
