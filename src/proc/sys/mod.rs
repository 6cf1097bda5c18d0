//! The platform switch: one folder per OS, each the same interface, and
//! the one place a platform `cfg` chooses between them (rust-lang/rust's
//! `library/std/src/sys/mod.rs` is the model). `unix/` is what Linux and
//! macOS share; everything above `sys` is written once, for every OS, against
//! the names `crate::proc` re-exports from here.
//!
//! - `linux/`: cgroup v2, pidfds, the proc connector, `/proc`.
//! - `windows/`: Job Objects, process handles, toolhelp, the console.
//! - `macos/`: libproc, kqueue, kill/killpg; compile-checked only.

#[cfg(unix)]
mod unix;
#[cfg(unix)]
pub use unix::*;

#[cfg(target_os = "linux")]
mod linux;
#[cfg(target_os = "linux")]
pub use linux::*;

#[cfg(windows)]
mod windows;
#[cfg(windows)]
pub use windows::*;

#[cfg(target_os = "macos")]
mod macos;
#[cfg(target_os = "macos")]
pub use macos::*;

// A tree's stdio (and its streamed stdio's pipes), one file for every OS.
mod stdio_pipes;
pub use stdio_pipes::*;

// The local end of `serve` (its socket, its shutdown signals, a secret
// file's mode), one file per family beside the folders above.
#[cfg(unix)]
#[path = "unix/local.rs"]
mod local;
#[cfg(windows)]
#[path = "windows/local.rs"]
mod local;
pub use local::*;
