//! The only code in treewarden that makes process syscalls or reads `/proc`
//! for process lifecycle: identities, ownership boundaries, signals, the
//! subreaper and reaper, and the host capability probe.
//!
//! Why it exists: DESIGN rules 1 and 4. Ownership is formed at spawn
//! ([`boundary::spawn_held`]: new session and process group, optionally a
//! cgroup, joined before exec while the child waits on a pipe), and nothing is
//! signalled on a guess: a process only through a pidfd verified against its
//! recorded [`Identity`], a group only while it provably is the recorded one.
//!
//! What it must never do:
//! - signal pid <= 1, the caller itself, its own process group or session
//!   (every entry point checks; see [`signal`]);
//! - re-resolve a process group from a leader pid (the pgid is recorded once);
//! - leak a `rustix`, `procfs` or `libc` type through a public signature;
//! - wait for children outside [`reaper`] in a process that installed it.
//!
//! `unsafe` is allowed in this module tree only (crate-wide it is denied); it
//! is confined to `fork`/`execve` and the async-signal-safe child path in
//! [`boundary`], and to registering a pidfd with tokio's reactor in
//! [`pidfd`], and to taking a descriptor the caller handed over by number
//! in [`fds`], each block with a `// SAFETY:` line. Each OS's code is a
//! folder of `sys/` (`linux/`, `windows/`, `macos/`, and `unix/` for what
//! Linux and macOS share) behind one switch, `sys/mod.rs`; on Windows the
//! Win32 calls (Job Objects, processes, toolhelp, the console) are the
//! `unsafe` blocks, each with a `// SAFETY:` line too.

#![allow(unsafe_code)]

mod parallel;
mod snapshot;
pub mod stat;
mod sys;
mod types;

pub use parallel::{PARALLEL_MIN, read_in_parallel};
pub use snapshot::{HostView, Snapshot, snapshot, snapshot_pids};
pub use stat::{ProcEntry, parse_stat};
pub use sys::*;
pub use types::*;

use std::path::PathBuf;

/// Errors of the process layer. A variant exists only where a caller branches
/// on it; everything else is [`ProcError::Io`] or [`ProcError::Proc`].
#[derive(Debug, thiserror::Error)]
pub enum ProcError {
    /// A sentinel guard refused the target: pid <= 1, ourselves, our own
    /// process group or session, or a cgroup that contains us. Nothing was sent.
    #[error("refused to signal {pid}: {reason}")]
    Refused { pid: i32, reason: String },
    /// No usable (mounted, writable) cgroup v2 hierarchy for a cgroup boundary.
    #[error("no usable cgroup v2 hierarchy: {0}")]
    NoCgroup(String),
    /// A cgroup control file or directory could not be used.
    #[error("cgroup {}: {source}", path.display())]
    Cgroup {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The forked child failed while preparing itself (setsid, stdio, chdir)
    /// before it was held; it never ran the command and has been reaped.
    #[error("child setup failed at {step}: {source}")]
    ChildSetup {
        step: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// The command could not be started at all, before anything ran (on
    /// Windows `CreateProcess` finds no such program: 127, as exec's
    /// failure after release is on Linux).
    #[error("{0}")]
    Exec(ExecFailure),
    /// `/proc` could not be read or parsed (other than "no such process").
    #[error("reading /proc: {0}")]
    Proc(String),
    /// Any other system call failure.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}
