//! A client of the kernel's process-events connector (`NETLINK_CONNECTOR`,
//! `CN_IDX_PROC`): every fork, exec, setsid and exit on the host, as it
//! happens.
//!
//! Why it exists: snapshot scans see a process only if it is alive at a scan;
//! a process that forks, calls `setsid()` and is orphaned between two scans
//! leaves no trace in them. The connector reports the fork and the setsid the
//! moment they happen.
//!
//! What it must never do: trust the kernel's bytes blindly. Messages are
//! parsed with bounds-checked reads of native-endian integers at the
//! offsets of `<linux/connector.h>` and `<linux/cn_proc.h>`; a short or
//! malformed message is skipped, never transmuted. A lost event is never
//! silent: `ENOBUFS` from the socket becomes [`ProcEvent::Overflow`].
//!
//! There is no "process group changed" event in the kernel (`setpgid` is
//! not reported). It is not needed for escapes: a member is outside the
//! tree only once it is outside both its group *and* its session, and the
//! only way out of a session is `setsid()`, which is reported
//! ([`ProcEvent::Sid`]). A `setpgid` inside the session is not an escape.
//!
//! Who may subscribe depends on the kernel: CAP_NET_ADMIN before Linux 6.6,
//! any process since, but only in the initial user and pid namespaces —
//! elsewhere the kernel ignores the subscription and sends no
//! acknowledgement. [`Connector::open`] therefore waits (1 s) for the
//! kernel's acknowledgement of *its* subscription (a nonce in `ack`; acks
//! are multicast to every listener) and fails on silence or an errno, so
//! the probe and `doctor` report what really works.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use rustix::io::Errno;
use rustix::net::{AddressFamily, RecvFlags, SendFlags, SocketFlags, SocketType, netlink};

use rustix::net::netlink::SocketAddrNetlink;

use crate::proc::{ExitStatus, ProcError};

/// `CN_IDX_PROC` / `CN_VAL_PROC` (`<linux/connector.h>`).
const CN_IDX_PROC: u32 = libc::CN_IDX_PROC;
const CN_VAL_PROC: u32 = libc::CN_VAL_PROC;
/// `PROC_CN_MCAST_LISTEN` (`<linux/cn_proc.h>`).
const PROC_CN_MCAST_LISTEN: u32 = libc::PROC_CN_MCAST_LISTEN;
/// `NLMSG_DONE`: the connector's subscription message type.
const NLMSG_DONE: u16 = libc::NLMSG_DONE as u16;
/// `NLMSG_ERROR` / `NLMSG_NOOP` / `NLMSG_OVERRUN`.
const NLMSG_NOOP: u16 = libc::NLMSG_NOOP as u16;
const NLMSG_ERROR: u16 = libc::NLMSG_ERROR as u16;
const NLMSG_OVERRUN: u16 = libc::NLMSG_OVERRUN as u16;

const NLMSG_HDRLEN: usize = std::mem::size_of::<libc::nlmsghdr>();
/// `struct cn_msg`: id (idx, val), seq, ack, len (u16), flags (u16).
const CN_MSG_LEN: usize = 20;

const PROC_EVENT_NONE: u32 = libc::PROC_EVENT_NONE;
const PROC_EVENT_FORK: u32 = libc::PROC_EVENT_FORK;
const PROC_EVENT_EXEC: u32 = libc::PROC_EVENT_EXEC;
const PROC_EVENT_SID: u32 = libc::PROC_EVENT_SID;
const PROC_EVENT_EXIT: u32 = libc::PROC_EVENT_EXIT;

/// How long [`Connector::open`] waits for the kernel's acknowledgement.
const ACK_TIMEOUT: Duration = Duration::from_secs(1);

/// Receive buffer used when the caller asks for none (1 MiB; the kernel
/// doubles it for bookkeeping).
pub const DEFAULT_RCVBUF: usize = 1 << 20;

pub use crate::proc::types::ProcEvent;

/// A subscribed process-events socket.
pub struct Connector {
    fd: OwnedFd,
    buf: Vec<u8>,
    /// Events read while waiting for the subscription's acknowledgement.
    pending: Vec<ProcEvent>,
    /// seq/ack of our subscription, to recognise its acknowledgement among
    /// those of other processes (acknowledgements are multicast).
    nonce: u32,
    /// An eventfd [`Connector::recv`] also waits on, so that a
    /// [`ConnectorWaker`] ends its wait at once (an owner stopping its
    /// observer waited up to the whole timeout for it).
    wake: Arc<OwnedFd>,
}

/// Ends a [`Connector::recv`] wait early, from another thread.
#[derive(Clone, Debug)]
pub struct ConnectorWaker(Arc<OwnedFd>);

impl ConnectorWaker {
    /// The current or next `recv` returns at once (with what is queued).
    pub fn wake(&self) {
        let _ = rustix::io::write(&*self.0, &1u64.to_ne_bytes());
    }
}

impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connector").finish_non_exhaustive()
    }
}

impl Connector {
    /// Opens a netlink connector socket with a receive buffer of `rcvbuf`
    /// bytes (`0`: [`DEFAULT_RCVBUF`]), joins the proc events group and
    /// subscribes. Fails with the kernel's error (EPERM without
    /// CAP_NET_ADMIN, EPROTONOSUPPORT without `CONFIG_PROC_EVENTS`).
    pub fn open(rcvbuf: usize) -> Result<Connector, ProcError> {
        let fd = rustix::net::socket_with(
            AddressFamily::NETLINK,
            SocketType::DGRAM,
            SocketFlags::CLOEXEC,
            Some(netlink::CONNECTOR),
        )?;
        let size = if rcvbuf == 0 { DEFAULT_RCVBUF } else { rcvbuf };
        // FORCE lifts net.core.rmem_max for a privileged caller; a small
        // size (tests provoking overflow) works either way.
        if rustix::net::sockopt::set_socket_recv_buffer_size_force(&fd, size).is_err() {
            rustix::net::sockopt::set_socket_recv_buffer_size(&fd, size)?;
        }
        // Port id 0: the kernel assigns a unique one (several connectors may
        // live in one process).
        rustix::net::bind(&fd, &SocketAddrNetlink::new(0, CN_IDX_PROC))?;
        static COUNTER: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let nonce = std::process::id().rotate_left(16)
            ^ (monotonic_ns() as u32)
            ^ COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let msg = subscribe_message(PROC_CN_MCAST_LISTEN, nonce);
        rustix::net::sendto(&fd, &msg, SendFlags::empty(), &SocketAddrNetlink::new(0, 0))?;
        let mut conn = Connector::over(fd, nonce)?;
        conn.await_ack(ACK_TIMEOUT)?;
        Ok(conn)
    }

    /// The kernel answers a subscription with an acknowledgement carrying
    /// an errno (EPERM without CAP_NET_ADMIN). It sends none to a caller
    /// outside the initial user and pid namespaces: silence is a failure
    /// too, or the observer would run blind.
    fn await_ack(&mut self, limit: Duration) -> Result<(), ProcError> {
        let deadline = std::time::Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() || !self.wait_readable(left)? {
                return Err(ProcError::Io(std::io::Error::other(
                    "the kernel did not acknowledge the proc events subscription (not in the initial user and pid namespaces?)",
                )));
            }
            let mut raw = Vec::new();
            match rustix::net::recv(&self.fd, &mut self.buf[..], RecvFlags::DONTWAIT) {
                Ok((n, _)) => {
                    let n = n.min(self.buf.len());
                    parse_raw(&self.buf[..n], &mut raw);
                }
                Err(Errno::NOBUFS) => raw.push(Raw::Event(ProcEvent::Overflow)),
                Err(Errno::AGAIN | Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
            for r in raw {
                match r {
                    // Someone else's subscription being acknowledged.
                    Raw::Ack { ack, .. } if ack != self.nonce.wrapping_add(1) => {}
                    Raw::Ack { err: 0, .. } => return Ok(()),
                    Raw::Ack { err, .. } => {
                        return Err(ProcError::Io(std::io::Error::from_raw_os_error(err as i32)));
                    }
                    Raw::Event(ev) => self.pending.push(ev),
                }
            }
        }
    }

    /// Waits up to `timeout` for events, then returns every event already
    /// queued (possibly none). An overflow is reported as
    /// [`ProcEvent::Overflow`] in order, and reading goes on after it.
    pub fn recv(&mut self, timeout: Duration) -> Result<Vec<ProcEvent>, ProcError> {
        let mut out = std::mem::take(&mut self.pending);
        if !out.is_empty() || !self.wait_readable(timeout)? {
            return Ok(out);
        }
        // Drain what is queued, bounded so a flood cannot starve the caller.
        for _ in 0..4096 {
            match rustix::net::recv(&self.fd, &mut self.buf[..], RecvFlags::DONTWAIT) {
                Ok((n, _)) => {
                    let n = n.min(self.buf.len());
                    parse_datagram(&self.buf[..n], &mut out);
                }
                Err(Errno::NOBUFS) => out.push(ProcEvent::Overflow),
                Err(Errno::AGAIN) => break,
                Err(Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Ok(out)
    }

    /// A connector over a socket already made, with its wake-up eventfd.
    fn over(fd: OwnedFd, nonce: u32) -> Result<Connector, ProcError> {
        let wake = rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
        )?;
        Ok(Connector {
            fd,
            buf: vec![0; 64 * 1024],
            pending: Vec::new(),
            nonce,
            wake: Arc::new(wake),
        })
    }

    /// A handle that ends this connector's waits early.
    pub fn waker(&self) -> ConnectorWaker {
        ConnectorWaker(self.wake.clone())
    }

    /// Whether the socket became readable within `timeout`; `false` also
    /// when a [`ConnectorWaker`] woke the wait (the wake is consumed).
    fn wait_readable(&self, timeout: Duration) -> Result<bool, ProcError> {
        use rustix::event::{PollFd, PollFlags, Timespec};
        let ts = Timespec {
            tv_sec: timeout.as_secs() as _,
            tv_nsec: timeout.subsec_nanos() as _,
        };
        let mut fds = [
            PollFd::new(&self.fd, PollFlags::IN),
            PollFd::new(&*self.wake, PollFlags::IN),
        ];
        match rustix::event::poll(&mut fds, Some(&ts)) {
            Ok(_) => {
                if !fds[1].revents().is_empty() {
                    let mut count = [0u8; 8];
                    let _ = rustix::io::read(&*self.wake, &mut count);
                }
                Ok(!fds[0].revents().is_empty())
            }
            Err(Errno::INTR) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Makes the kernel queue on this socket only the events a reader of
    /// `interest` needs (a classic BPF socket filter, replaced on each
    /// call): the fork and the exit of every *process* (a thread's are
    /// dropped), and the exec and setsid of the processes in `interest`
    /// (pids) only; other kinds (uid, gid, ptrace, comm, coredump) are
    /// dropped, and acks and anything the filter does not recognise pass.
    /// With more than [`FILTER_MAX_PIDS`] pids, exec and setsid pass for
    /// every process.
    ///
    /// The filter runs in the context of the process that caused the event,
    /// so host activity that is dropped never wakes the reader or costs it
    /// anything. What it can drop that a reader might want: the exec or
    /// setsid of a process that became interesting after the reader last
    /// called this (a child just forked). The reader must re-read such a
    /// process after the call (see the observer). Forks and exits are not
    /// filtered by pid: a fork's parent may be a child the reader has not
    /// named yet, and an exit must follow every fork of that process in
    /// the stream.
    pub fn filter_to(&self, interest: &[i32]) -> Result<(), ProcError> {
        let mut prog = interest_filter(interest);
        let fprog = libc::sock_fprog {
            len: prog.len() as libc::c_ushort,
            filter: prog.as_mut_ptr(),
        };
        // SAFETY: `fprog` points at `prog` (`len` instructions), both alive
        // for the call; the kernel copies and checks the program before it
        // attaches it, and `self.fd` is an open socket.
        let rc = unsafe {
            libc::setsockopt(
                self.fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_ATTACH_FILTER,
                std::ptr::from_ref(&fprog).cast(),
                std::mem::size_of::<libc::sock_fprog>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(ProcError::Io(std::io::Error::last_os_error()));
        }
        Ok(())
    }

    /// The receive buffer size the kernel actually granted (bytes).
    pub fn rcvbuf(&self) -> Result<usize, ProcError> {
        Ok(rustix::net::sockopt::socket_recv_buffer_size(
            self.fd.as_fd(),
        )?)
    }
}

/// The most pids [`Connector::filter_to`] compares one by one (two
/// instructions each, run for every exec and setsid on the host);
/// above it the filter passes those events for every process.
pub const FILTER_MAX_PIDS: usize = 512;

/// A classic BPF instruction.
fn insn(code: u32, jt: u8, jf: u8, k: u32) -> libc::sock_filter {
    libc::sock_filter {
        code: code as u16,
        jt,
        jf,
        k,
    }
}

/// A word of the message as a classic BPF absolute load sees it: loads
/// are big-endian (network order) and the connector writes native order.
fn as_loaded32(v: u32) -> u32 {
    u32::from_be_bytes(v.to_ne_bytes())
}

fn as_loaded16(v: u16) -> u32 {
    u32::from(u16::from_be_bytes(v.to_ne_bytes()))
}

/// The socket filter of [`Connector::filter_to`]. Offsets are those of
/// [`parse_datagram`]: nlmsghdr (16 bytes), cn_msg (20), then the
/// `proc_event` at 36: what (36), cpu, timestamp, and its union at 52.
fn interest_filter(interest: &[i32]) -> Vec<libc::sock_filter> {
    use libc::{
        BPF_ABS, BPF_H, BPF_JEQ, BPF_JGE, BPF_JMP, BPF_K, BPF_LD, BPF_LEN, BPF_MISC, BPF_RET,
        BPF_TAX, BPF_W, BPF_X,
    };
    const PASS: u32 = u32::MAX;
    const DROP: u32 = 0;
    const EV: u32 = (NLMSG_HDRLEN + CN_MSG_LEN) as u32; // 36
    const DATA: u32 = EV + 16; // 52: the union
    let ld = |off: u32| insn(BPF_LD | BPF_W | BPF_ABS, 0, 0, off);
    let ret = |v: u32| insn(BPF_RET | BPF_K, 0, 0, v);
    // if A == k, skip `t` instructions, else skip `f` (the next
    // instruction is skip 0).
    let jeq = |k: u32, t: u8, f: u8| insn(BPF_JMP | BPF_JEQ | BPF_K, t, f, k);
    let mut p = vec![
        // 0: shorter than a fork event: not ours to judge.
        insn(BPF_LD | BPF_W | BPF_LEN, 0, 0, 0),
        insn(BPF_JMP | BPF_JGE | BPF_K, 1, 0, DATA + 16),
        ret(PASS),
        // 3: a connector message of the proc events, else pass.
        insn(BPF_LD | BPF_H | BPF_ABS, 0, 0, 4),
        jeq(as_loaded16(NLMSG_DONE), 1, 0),
        ret(PASS),
        ld(NLMSG_HDRLEN as u32),
        jeq(as_loaded32(CN_IDX_PROC), 1, 0),
        ret(PASS),
        ld(NLMSG_HDRLEN as u32 + 4),
        jeq(as_loaded32(CN_VAL_PROC), 1, 0),
        ret(PASS),
        // 12: what
        ld(EV),
        jeq(as_loaded32(PROC_EVENT_FORK), 6, 0),  // -> 20
        jeq(as_loaded32(PROC_EVENT_EXIT), 11, 0), // -> 26
        jeq(as_loaded32(PROC_EVENT_EXEC), 16, 0), // -> 32
        jeq(as_loaded32(PROC_EVENT_SID), 15, 0),  // -> 32
        jeq(as_loaded32(PROC_EVENT_NONE), 0, 1),  // an ack
        ret(PASS),
        ret(DROP), // 19: uid, gid, ptrace, comm, coredump, ...
        // 20: fork: a process (child pid == child tgid), not a thread.
        ld(DATA + 12),
        insn(BPF_MISC | BPF_TAX, 0, 0, 0),
        ld(DATA + 8),
        insn(BPF_JMP | BPF_JEQ | BPF_X, 0, 1, 0),
        ret(PASS),
        ret(DROP),
        // 26: exit: of a process (pid == tgid), not of a thread.
        ld(DATA + 4),
        insn(BPF_MISC | BPF_TAX, 0, 0, 0),
        ld(DATA),
        insn(BPF_JMP | BPF_JEQ | BPF_X, 0, 1, 0),
        ret(PASS),
        ret(DROP),
        // 32: exec, setsid: only of the interest.
        ld(DATA + 4),
    ];
    debug_assert_eq!(p.len(), 33);
    if interest.len() > FILTER_MAX_PIDS {
        p.push(ret(PASS));
        return p;
    }
    for &pid in interest {
        p.push(jeq(as_loaded32(pid as u32), 0, 1));
        p.push(ret(PASS));
    }
    p.push(ret(DROP));
    p
}

/// `CLOCK_MONOTONIC` now, in ns: the clock of the events' `at_ns`
/// (`ktime_get_ns`), so `monotonic_ns() - at_ns` is an event's age.
pub fn monotonic_ns() -> u64 {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

/// nlmsghdr + cn_msg + the u32 operation, native endian.
fn subscribe_message(op: u32, nonce: u32) -> Vec<u8> {
    let total = NLMSG_HDRLEN + CN_MSG_LEN + 4;
    let mut m = Vec::with_capacity(total);
    m.extend_from_slice(&(total as u32).to_ne_bytes()); // nlmsg_len
    m.extend_from_slice(&NLMSG_DONE.to_ne_bytes()); // nlmsg_type
    m.extend_from_slice(&0u16.to_ne_bytes()); // nlmsg_flags
    m.extend_from_slice(&0u32.to_ne_bytes()); // nlmsg_seq
    m.extend_from_slice(&std::process::id().to_ne_bytes()); // nlmsg_pid
    m.extend_from_slice(&CN_IDX_PROC.to_ne_bytes());
    m.extend_from_slice(&CN_VAL_PROC.to_ne_bytes());
    // The kernel's acknowledgement is multicast to every listener and
    // carries our ack + 1 (its seq is the kernel's own counter on this
    // kernel): a nonce in ack tells ours from another process's.
    m.extend_from_slice(&nonce.to_ne_bytes()); // seq
    m.extend_from_slice(&nonce.to_ne_bytes()); // ack
    m.extend_from_slice(&4u16.to_ne_bytes()); // len
    m.extend_from_slice(&0u16.to_ne_bytes()); // flags
    m.extend_from_slice(&op.to_ne_bytes());
    m
}

fn u16_at(b: &[u8], off: usize) -> Option<u16> {
    b.get(off..off.checked_add(2)?)
        .and_then(|s| s.try_into().ok())
        .map(u16::from_ne_bytes)
}

fn u32_at(b: &[u8], off: usize) -> Option<u32> {
    b.get(off..off.checked_add(4)?)
        .and_then(|s| s.try_into().ok())
        .map(u32::from_ne_bytes)
}

fn i32_at(b: &[u8], off: usize) -> Option<i32> {
    u32_at(b, off).map(|v| v as i32)
}

fn u64_at(b: &[u8], off: usize) -> Option<u64> {
    b.get(off..off.checked_add(8)?)
        .and_then(|s| s.try_into().ok())
        .map(u64::from_ne_bytes)
}

/// A parsed message: an event, or the acknowledgement of a subscription.
enum Raw {
    Event(ProcEvent),
    /// `PROC_EVENT_NONE`: an acknowledgement, with the cn_msg's ack (the
    /// request's ack + 1) and the errno.
    Ack {
        ack: u32,
        err: u32,
    },
}

/// Parses every netlink message of one datagram; malformed ones and
/// acknowledgements are skipped.
pub(crate) fn parse_datagram(b: &[u8], out: &mut Vec<ProcEvent>) {
    let mut raw = Vec::new();
    parse_raw(b, &mut raw);
    out.extend(raw.into_iter().filter_map(|r| match r {
        Raw::Event(ev) => Some(ev),
        Raw::Ack { .. } => None,
    }));
}

fn parse_raw(mut b: &[u8], out: &mut Vec<Raw>) {
    while b.len() >= NLMSG_HDRLEN {
        let Some(len) = u32_at(b, 0).map(|l| l as usize) else {
            return;
        };
        if len < NLMSG_HDRLEN || len > b.len() {
            return;
        }
        let kind = u16_at(b, 4).unwrap_or(0);
        match kind {
            NLMSG_NOOP | NLMSG_ERROR => {}
            NLMSG_OVERRUN => out.push(Raw::Event(ProcEvent::Overflow)),
            _ => {
                if let Some(r) = parse_cn_msg(&b[NLMSG_HDRLEN..len]) {
                    out.push(r);
                }
            }
        }
        // NLMSG_ALIGN(len)
        let next = (len + 3) & !3;
        if next >= b.len() {
            return;
        }
        b = &b[next..];
    }
}

/// One `cn_msg` carrying a `proc_event`.
fn parse_cn_msg(b: &[u8]) -> Option<Raw> {
    if u32_at(b, 0)? != CN_IDX_PROC || u32_at(b, 4)? != CN_VAL_PROC {
        return None;
    }
    let len = u16_at(b, 16)? as usize;
    let data = b.get(CN_MSG_LEN..CN_MSG_LEN.checked_add(len)?)?;
    if u32_at(data, 0)? == PROC_EVENT_NONE {
        return Some(Raw::Ack {
            ack: u32_at(b, 12)?,
            err: u32_at(data, 16)?,
        });
    }
    parse_proc_event(data).map(Raw::Event)
}

/// `struct proc_event`: what (u32), cpu (u32), timestamp_ns (u64), then the
/// event's union at offset 16.
pub(crate) fn parse_proc_event(d: &[u8]) -> Option<ProcEvent> {
    let what = u32_at(d, 0)?;
    let at_ns = u64_at(d, 8)?;
    const U: usize = 16;
    match what {
        PROC_EVENT_FORK => {
            // parent_pid, parent_tgid, child_pid, child_tgid
            let parent = i32_at(d, U + 4)?;
            let child_pid = i32_at(d, U + 8)?;
            let child = i32_at(d, U + 12)?;
            // A new thread, not a new process.
            (child_pid == child).then_some(ProcEvent::Fork {
                parent,
                child,
                at_ns,
            })
        }
        PROC_EVENT_EXEC => {
            let pid = i32_at(d, U + 4)?;
            Some(ProcEvent::Exec { pid, at_ns })
        }
        PROC_EVENT_SID => {
            let pid = i32_at(d, U + 4)?;
            Some(ProcEvent::Sid { pid, at_ns })
        }
        PROC_EVENT_EXIT => {
            let thread = i32_at(d, U)?;
            let pid = i32_at(d, U + 4)?;
            if thread != pid {
                return None; // a thread ended, the process lives on
            }
            let code = u32_at(d, U + 8)?;
            // exit_code is the wait status: a signal in the low 7 bits, or
            // the exit code in bits 8..16.
            let status = if code & 0x7f == 0 {
                ExitStatus::Exited(((code >> 8) & 0xff) as i32)
            } else {
                ExitStatus::Signaled((code & 0x7f) as i32)
            };
            Some(ProcEvent::Exit { pid, status, at_ns })
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(what: u32, at: u64, words: &[u32]) -> Vec<u8> {
        let mut d = Vec::new();
        d.extend_from_slice(&what.to_ne_bytes());
        d.extend_from_slice(&0u32.to_ne_bytes());
        d.extend_from_slice(&at.to_ne_bytes());
        for w in words {
            d.extend_from_slice(&w.to_ne_bytes());
        }
        d
    }

    fn datagram(events: &[Vec<u8>]) -> Vec<u8> {
        let mut out = Vec::new();
        for data in events {
            let len = NLMSG_HDRLEN + CN_MSG_LEN + data.len();
            let mut m = Vec::new();
            m.extend_from_slice(&(len as u32).to_ne_bytes());
            m.extend_from_slice(&NLMSG_DONE.to_ne_bytes());
            m.extend_from_slice(&[0; 10]);
            m.extend_from_slice(&CN_IDX_PROC.to_ne_bytes());
            m.extend_from_slice(&CN_VAL_PROC.to_ne_bytes());
            m.extend_from_slice(&[0; 8]);
            m.extend_from_slice(&(data.len() as u16).to_ne_bytes());
            m.extend_from_slice(&[0; 2]);
            m.extend_from_slice(data);
            while m.len() % 4 != 0 {
                m.push(0);
            }
            out.extend_from_slice(&m);
        }
        out
    }

    #[test]
    fn parses_fork_exec_sid_exit_and_skips_threads() {
        let d = datagram(&[
            event(PROC_EVENT_FORK, 5, &[10, 10, 11, 11]),
            event(PROC_EVENT_FORK, 6, &[10, 10, 12, 11]), // a thread of 11
            event(PROC_EVENT_EXEC, 7, &[11, 11]),
            event(PROC_EVENT_SID, 8, &[11, 11]),
            event(PROC_EVENT_EXIT, 9, &[11, 11, 3 << 8, 17, 10, 10]),
            event(PROC_EVENT_EXIT, 9, &[12, 11, 9, 17, 10, 10]), // thread exit
            event(PROC_EVENT_EXIT, 9, &[13, 13, 9, 17, 10, 10]),
        ]);
        let mut out = Vec::new();
        parse_datagram(&d, &mut out);
        assert_eq!(
            out,
            vec![
                ProcEvent::Fork {
                    parent: 10,
                    child: 11,
                    at_ns: 5
                },
                ProcEvent::Exec { pid: 11, at_ns: 7 },
                ProcEvent::Sid { pid: 11, at_ns: 8 },
                ProcEvent::Exit {
                    pid: 11,
                    status: ExitStatus::Exited(3),
                    at_ns: 9
                },
                ProcEvent::Exit {
                    pid: 13,
                    status: ExitStatus::Signaled(9),
                    at_ns: 9
                },
            ]
        );
    }

    #[test]
    fn truncated_and_lying_lengths_are_skipped_not_trusted() {
        let d = datagram(&[event(PROC_EVENT_FORK, 5, &[10, 10, 11, 11])]);
        for cut in 0..d.len() {
            let mut out = Vec::new();
            parse_datagram(&d[..cut], &mut out);
            assert!(out.is_empty(), "cut at {cut}: {out:?}");
        }
        // nlmsg_len larger than the datagram.
        let mut bad = d.clone();
        bad[0..4].copy_from_slice(&((d.len() + 100) as u32).to_ne_bytes());
        let mut out = Vec::new();
        parse_datagram(&bad, &mut out);
        assert!(out.is_empty());
        // cn_msg len larger than the message.
        let mut bad = d.clone();
        bad[NLMSG_HDRLEN + 16..NLMSG_HDRLEN + 18].copy_from_slice(&500u16.to_ne_bytes());
        let mut out = Vec::new();
        parse_datagram(&bad, &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn overrun_message_is_an_overflow() {
        let mut m = Vec::new();
        m.extend_from_slice(&16u32.to_ne_bytes());
        m.extend_from_slice(&NLMSG_OVERRUN.to_ne_bytes());
        m.extend_from_slice(&[0; 10]);
        let mut out = Vec::new();
        parse_datagram(&m, &mut out);
        assert_eq!(out, vec![ProcEvent::Overflow]);
    }

    /// Real kernel: a child's fork and exit are reported (skipped where the
    /// connector is unavailable).
    #[test]
    fn sees_a_real_fork_and_exit() {
        let mut conn = match Connector::open(0) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("skipped: proc connector unavailable: {e}");
                return;
            }
        };
        let mut child = std::process::Command::new("true").spawn().expect("spawn");
        let pid = child.id() as i32;
        let _ = child.wait();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let (mut forked, mut exited) = (false, false);
        while !(forked && exited) && std::time::Instant::now() < deadline {
            for ev in conn.recv(Duration::from_millis(100)).expect("recv") {
                match ev {
                    ProcEvent::Fork { child, .. } if child == pid => forked = true,
                    ProcEvent::Exit { pid: p, status, .. } if p == pid => {
                        assert_eq!(status, ExitStatus::Exited(0));
                        exited = true;
                    }
                    _ => {}
                }
            }
        }
        assert!(forked && exited, "fork {forked} exit {exited}");
    }

    /// A wake from another thread ends a long wait at once, and is used up
    /// by it. The socket is subscribed to nothing, so no event can end the
    /// wait instead: without the wake it would last its whole 60 s.
    #[test]
    fn a_waker_ends_a_wait_at_once_and_is_used_up() {
        let fd = rustix::net::socket_with(
            AddressFamily::NETLINK,
            SocketType::DGRAM,
            SocketFlags::CLOEXEC,
            Some(netlink::CONNECTOR),
        )
        .expect("netlink socket");
        rustix::net::bind(&fd, &SocketAddrNetlink::new(0, 0)).expect("bind, no groups");
        let mut conn = Connector::over(fd, 0).expect("connector");
        let waker = conn.waker();
        let waiting = std::thread::spawn(move || {
            let started = std::time::Instant::now();
            let events = conn.recv(Duration::from_secs(60)).expect("recv");
            (started.elapsed(), events, conn)
        });
        waker.wake();
        let (took, events, mut conn) = waiting.join().expect("waiter");
        assert!(events.is_empty(), "{events:?}");
        assert!(
            took < Duration::from_secs(30),
            "the wake ended the wait: {took:?}"
        );
        // Used up: the next wait is not ended by the old wake.
        let started = std::time::Instant::now();
        assert!(
            conn.recv(Duration::from_millis(50))
                .expect("recv")
                .is_empty()
        );
        assert!(started.elapsed() >= Duration::from_millis(50));
    }

    /// The filter's jumps land where its blocks begin.
    #[test]
    fn the_filter_jumps_to_its_blocks() {
        let p = interest_filter(&[7, 8]);
        let target = |pc: usize| pc + 1 + usize::from(p[pc].jt);
        let loads = |pc: usize| p[pc].k;
        let data = (NLMSG_HDRLEN + CN_MSG_LEN + 16) as u32;
        // fork -> child tgid; exit -> process tgid; exec and sid -> the pid list.
        assert_eq!(loads(target(13)), data + 12);
        assert_eq!(loads(target(14)), data + 4);
        assert_eq!(target(15), 32);
        assert_eq!(target(16), 32);
        assert_eq!(loads(32), data + 4);
        assert_eq!(p.len(), 33 + 2 * 2 + 1);
        assert_eq!(p[33].k, as_loaded32(7));
        // Over the cap: everything after the kind checks passes.
        let many: Vec<i32> = (1..=FILTER_MAX_PIDS as i32 + 1).collect();
        let p = interest_filter(&many);
        assert_eq!(p.len(), 34);
        assert_eq!(
            (p[33].code as u32, p[33].k),
            (libc::BPF_RET | libc::BPF_K, u32::MAX)
        );
    }

    /// Real kernel, real processes: with a filter naming `a`, a new
    /// process's fork and exit still arrive but its exec does not; the
    /// setsid and exec of `a` do. A second socket without a filter, open
    /// at the same time, gets the exec the first dropped (so the test can
    /// fail).
    #[test]
    fn the_filter_passes_forks_and_the_interest_and_drops_other_execs() {
        let (mut filtered, mut all) = match (Connector::open(0), Connector::open(0)) {
            (Ok(f), Ok(a)) => (f, a),
            (Err(e), _) | (_, Err(e)) => {
                eprintln!("skipped: proc connector unavailable: {e}");
                return;
            }
        };
        // `a` waits for a line, then setsid(1) calls setsid() (it is not a
        // group leader) and execs sleep.
        let mut a = std::process::Command::new("sh")
            .args(["-c", "read x; exec setsid sleep 30"])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .expect("spawn sh");
        let a_pid = a.id() as i32;
        filtered.filter_to(&[a_pid]).expect("attach the filter");
        // What was queued before the filter was attached passed unfiltered
        // (other tests of this process fork and exec meanwhile): drained.
        while !filtered.recv(Duration::ZERO).expect("recv").is_empty() {}
        let mut b = std::process::Command::new("true")
            .spawn()
            .expect("spawn true");
        let b_pid = b.id() as i32;
        let _ = b.wait();
        {
            use std::io::Write as _;
            let mut stdin = a.stdin.take().expect("piped stdin");
            stdin.write_all(b"go\n").expect("tell a");
        }
        let sid_a = |e: &ProcEvent| matches!(e, ProcEvent::Sid { pid, .. } if *pid == a_pid);
        // An exec of `a` after its setsid: sleep's.
        let done = |evs: &[ProcEvent]| {
            evs.iter().position(sid_a).is_some_and(|i| {
                evs[i..]
                    .iter()
                    .any(|e| matches!(e, ProcEvent::Exec { pid, .. } if *pid == a_pid))
            })
        };
        let (mut got, mut got_all) = (Vec::new(), Vec::new());
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !(done(&got) && done(&got_all)) && std::time::Instant::now() < deadline {
            got.extend(filtered.recv(Duration::from_millis(50)).expect("recv"));
            got_all.extend(all.recv(Duration::from_millis(50)).expect("recv"));
        }
        let _ = a.kill();
        let _ = a.wait();
        assert!(
            done(&got_all),
            "a's setsid and exec never arrived: {got_all:?}"
        );
        assert!(done(&got), "the interest's setsid and exec pass");
        // `b`'s events came before `a`'s setsid: all of them are read by now.
        let has = |evs: &[ProcEvent], f: &dyn Fn(&ProcEvent) -> bool| evs.iter().any(f);
        let fork_b = |e: &ProcEvent| matches!(e, ProcEvent::Fork { child, .. } if *child == b_pid);
        let exec_b = |e: &ProcEvent| matches!(e, ProcEvent::Exec { pid, .. } if *pid == b_pid);
        let exit_b = |e: &ProcEvent| matches!(e, ProcEvent::Exit { pid, .. } if *pid == b_pid);
        assert!(has(&got_all, &exec_b), "the unfiltered socket saw b's exec");
        assert!(has(&got, &fork_b), "a new process's fork passes");
        assert!(has(&got, &exit_b), "a process's exit passes");
        assert!(!has(&got, &exec_b), "b's exec was dropped: {got:?}");
        assert!(
            got.iter().all(|e| match e {
                ProcEvent::Exec { pid, .. } | ProcEvent::Sid { pid, .. } => *pid == a_pid,
                _ => true,
            }),
            "only the interest's exec and setsid pass: {got:?}"
        );
    }

    /// A tiny receive buffer and a burst of forks that nobody reads: the
    /// loss is reported, not silent.
    #[test]
    fn a_small_buffer_overflows_loudly() {
        let mut conn = match Connector::open(1) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("skipped: proc connector unavailable: {e}");
                return;
            }
        };
        for _ in 0..200 {
            if let Ok(mut c) = std::process::Command::new("true").spawn() {
                let _ = c.wait();
            }
        }
        let events = conn.recv(Duration::from_millis(100)).expect("recv");
        assert!(
            events.contains(&ProcEvent::Overflow),
            "{} events, no overflow (rcvbuf {:?})",
            events.len(),
            conn.rcvbuf()
        );
    }
}
