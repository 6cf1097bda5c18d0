//! Terminal mode (`run --tty`): a pseudo-terminal for the tree, the
//! caller's terminal in raw mode, window sizes passed on — as `script(1)`
//! and `systemd-run --pty` do it.
//!
//! Why it exists: a tree is born in its own session, so it has no
//! controlling terminal of the caller's (prompts of ssh, sudo and git,
//! full-screen tools and resizes break). The tree gets its own terminal
//! instead: the slave of a fresh pty is its controlling terminal and its
//! stdio ([`crate::proc::SpawnSpec::tty`]); the wrapper relays bytes between the
//! master and its own stdin/stdout. With the caller's terminal raw, a typed
//! Ctrl-C is a byte that reaches the tree's terminal, whose line discipline
//! sends SIGINT to the tree's (foreground) process group.
//!
//! What it must never do: leave the caller's terminal raw. [`RawTerminal`]
//! restores it when dropped, on every path that returns.

use std::fs::File;
use std::path::PathBuf;

use rustix::pty::OpenptFlags;
use rustix::termios::OptionalActions;

use crate::proc::ProcError;

/// A fresh pseudo-terminal: the master (ours) and the slave's path (the
/// tree's).
pub struct Pty {
    master: File,
    slave: PathBuf,
}

impl Pty {
    /// Opens one (`posix_openpt`, `grantpt`, `unlockpt`, `ptsname`).
    pub fn open() -> Result<Self, ProcError> {
        let master =
            rustix::pty::openpt(OpenptFlags::RDWR | OpenptFlags::NOCTTY | OpenptFlags::CLOEXEC)?;
        rustix::pty::grantpt(&master)?;
        rustix::pty::unlockpt(&master)?;
        let name = rustix::pty::ptsname(&master, Vec::new())?;
        let slave = PathBuf::from(std::ffi::OsStr::new(&*String::from_utf8_lossy(
            name.as_bytes(),
        )));
        Ok(Self {
            master: File::from(master),
            slave,
        })
    }

    /// The slave's path (`/dev/pts/N`).
    pub fn slave(&self) -> &std::path::Path {
        &self.slave
    }

    /// The master, for the relay (a reader and a writer: clone it).
    pub fn master(&self) -> &File {
        &self.master
    }

    /// Gives the tree's terminal the size of the caller's (stdin's), when
    /// stdin is a terminal; the kernel sends SIGWINCH to the tree's
    /// foreground group when it changes.
    pub fn copy_size_from_stdin(&self) {
        copy_stdin_size_to(&self.master);
    }
}

/// Gives the terminal whose master is `master` the size of stdin's
/// terminal (on SIGWINCH, from the relay's thread). Silent when either is
/// no terminal.
pub fn copy_stdin_size_to(master: &File) {
    if let Ok(size) = rustix::termios::tcgetwinsize(rustix::stdio::stdin()) {
        let _ = rustix::termios::tcsetwinsize(master, size);
    }
}

/// Whether descriptor 0 is a terminal (`run`'s automatic terminal mode).
pub fn stdin_is_tty() -> bool {
    rustix::termios::isatty(rustix::stdio::stdin())
}

/// The caller's terminal (stdin) in raw mode; restored on drop.
pub struct RawTerminal {
    saved: rustix::termios::Termios,
}

impl RawTerminal {
    /// Puts stdin's terminal in raw mode. `None` when stdin is no terminal.
    pub fn enter() -> Result<Option<Self>, ProcError> {
        let stdin = rustix::stdio::stdin();
        if !rustix::termios::isatty(stdin) {
            return Ok(None);
        }
        let saved = rustix::termios::tcgetattr(stdin)?;
        let mut raw = saved.clone();
        raw.make_raw();
        rustix::termios::tcsetattr(stdin, OptionalActions::Flush, &raw)?;
        Ok(Some(Self { saved }))
    }
}

impl Drop for RawTerminal {
    fn drop(&mut self) {
        if let Err(e) =
            rustix::termios::tcsetattr(rustix::stdio::stdin(), OptionalActions::Drain, &self.saved)
        {
            tracing::error!(error = %e, "the terminal's mode was not restored");
        }
    }
}
