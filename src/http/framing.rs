//! A connection's request heads as its bytes arrive, followed beside
//! hyper for one question: does a head carry both `Transfer-Encoding` and
//! `Content-Length`?
//!
//! Such a request has two framings. hyper takes the chunked one (as RFC
//! 9112 says) and drops `Content-Length` before a handler could see it;
//! something in front of the service may have taken the other, and the
//! bytes one reads as a body the other reads as a request (smuggling).
//! The serving loop refuses such a request (400) rather than pick, so it
//! must know which request had both: [`Framing`] reads the same bytes
//! hyper reads, finds each head the way hyper frames bodies (chunked with
//! `Transfer-Encoding`, else `Content-Length`, else none) and keeps one
//! flag per head, in order, which the loop takes as hyper hands it each
//! request.
//!
//! A stream it cannot follow (a head over [`MAX_HEAD`], a malformed chunk
//! size) stops it: later requests of that connection are not flagged, and
//! hyper's own handling (chunked, and the connection closed after the
//! answer) stands. It never changes a byte.

use std::collections::VecDeque;

/// The longest head followed (hyper's own limit is larger: past this the
/// connection is no longer followed, never refused for it).
pub const MAX_HEAD: usize = 64 * 1024;

/// Where the stream stands between two reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// In a request head (or before one).
    Head,
    /// In a `Content-Length` body: this many bytes left.
    Body(u64),
    /// A chunk-size line.
    ChunkSize,
    /// A chunk's data and its CRLF: this many bytes left.
    ChunkData(u64),
    /// The trailer section after the last chunk.
    Trailers,
    /// Not followed any more.
    Lost,
}

/// One connection's heads, followed ([`Framing::feed`]), and for each one
/// seen whether it had both framings ([`Framing::next_has_both`]).
#[derive(Debug)]
pub struct Framing {
    state: State,
    /// The current head, or the current line of a chunked body.
    buf: Vec<u8>,
    flags: VecDeque<bool>,
}

impl Default for Framing {
    fn default() -> Self {
        Self {
            state: State::Head,
            buf: Vec::new(),
            flags: VecDeque::new(),
        }
    }
}

impl Framing {
    /// Follows the bytes just read.
    pub fn feed(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            match self.state {
                State::Lost => return,
                State::Body(n) | State::ChunkData(n) => {
                    let k = n.min(bytes.len() as u64);
                    bytes = &bytes[k as usize..];
                    let left = n - k;
                    self.state = match (self.state, left) {
                        (State::Body(_), 0) => State::Head,
                        (State::Body(_), l) => State::Body(l),
                        (_, 0) => State::ChunkSize,
                        (_, l) => State::ChunkData(l),
                    };
                }
                State::Head | State::ChunkSize | State::Trailers => {
                    match bytes.iter().position(|b| *b == b'\n') {
                        Some(i) => {
                            self.buf.extend_from_slice(&bytes[..=i]);
                            bytes = &bytes[i + 1..];
                            self.line();
                        }
                        None => {
                            self.buf.extend_from_slice(bytes);
                            bytes = &[];
                        }
                    }
                    if self.buf.len() > MAX_HEAD {
                        self.lose();
                    }
                }
            }
        }
    }

    /// Whether the next request hyper hands over (in order) had both
    /// `Transfer-Encoding` and `Content-Length`; `false` where its head was
    /// not followed.
    pub fn next_has_both(&mut self) -> bool {
        self.flags.pop_front().unwrap_or(false)
    }

    fn lose(&mut self) {
        self.state = State::Lost;
        self.buf = Vec::new();
    }

    /// `buf` ends with a line feed.
    fn line(&mut self) {
        let blank = |l: &[u8]| l == b"\r\n" || l == b"\n";
        match self.state {
            State::Head => {
                if blank(&self.buf) {
                    // Empty lines before a request line are skipped.
                    self.buf.clear();
                } else if self.buf.ends_with(b"\r\n\r\n") || self.buf.ends_with(b"\n\n") {
                    self.head_done();
                }
            }
            State::ChunkSize => {
                let line = String::from_utf8_lossy(&self.buf).to_string();
                self.buf.clear();
                let hex = line.split(';').next().unwrap_or("").trim();
                match u64::from_str_radix(hex, 16) {
                    Ok(0) => self.state = State::Trailers,
                    Ok(n) => self.state = State::ChunkData(n.saturating_add(2)),
                    Err(_) => self.lose(),
                }
            }
            State::Trailers => {
                if blank(&self.buf) {
                    self.state = State::Head;
                }
                self.buf.clear();
            }
            State::Body(_) | State::ChunkData(_) | State::Lost => {}
        }
    }

    fn head_done(&mut self) {
        let head = String::from_utf8_lossy(&self.buf).to_string();
        self.buf.clear();
        let (mut te, mut cl) = (false, None);
        for line in head.lines().skip(1) {
            let Some((name, value)) = line.split_once(':') else {
                continue;
            };
            let name = name.trim();
            if name.eq_ignore_ascii_case("transfer-encoding") {
                te = true;
            } else if name.eq_ignore_ascii_case("content-length") {
                cl = Some(value.trim().parse::<u64>().unwrap_or(0));
            }
        }
        self.flags.push_back(te && cl.is_some());
        self.state = match (te, cl) {
            (true, _) => State::ChunkSize,
            (false, Some(n)) if n > 0 => State::Body(n),
            _ => State::Head,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_pipelined_head_is_flagged_in_order_across_bodies_and_splits() {
        let stream = b"POST /a HTTP/1.1\r\nContent-Length: 5\r\n\r\nGET /POST /b HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n3;x=1\r\nGET\r\n0\r\nT: v\r\n\r\n\r\nGET /c HTTP/1.1\r\nhost: x\r\n\r\nPOST /d HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n";
        // Whole, and fed one byte at a time: the same flags.
        for step in [stream.len(), 1, 7] {
            let mut f = Framing::default();
            for chunk in stream.chunks(step) {
                f.feed(chunk);
            }
            let flags: Vec<bool> = (0..5).map(|_| f.next_has_both()).collect();
            assert_eq!(flags, [false, true, false, false, false], "step {step}");
        }
    }

    #[test]
    fn a_stream_it_cannot_follow_flags_nothing_more() {
        let mut f = Framing::default();
        f.feed(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n");
        f.feed(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 1\r\n\r\n");
        assert!(!f.next_has_both());
        assert!(!f.next_has_both());
    }
}
