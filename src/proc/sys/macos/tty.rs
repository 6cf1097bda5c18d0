//! `run --tty` on macOS: not offered yet (Linux's `tty.rs` opens its
//! pseudo-terminal with `O_CLOEXEC`, which macOS's `posix_openpt` lacks,
//! and `run` itself is refused there). stdin is never taken as a
//! terminal, so nothing asks for one.

use std::fs::File;

use crate::proc::ProcError;

pub struct Pty {
    master: File,
    slave: std::path::PathBuf,
}

impl Pty {
    pub fn open() -> Result<Self, ProcError> {
        Err(super::exits::unsupported(
            "pseudo-terminal for run --tty in treewarden yet",
        ))
    }
    pub fn slave(&self) -> &std::path::Path {
        &self.slave
    }
    pub fn master(&self) -> &File {
        &self.master
    }
    pub fn copy_size_from_stdin(&self) {}
}

pub fn copy_stdin_size_to(_master: &File) {}

pub fn stdin_is_tty() -> bool {
    false
}

pub struct RawTerminal(());

impl RawTerminal {
    pub fn enter() -> Result<Option<Self>, ProcError> {
        Ok(None)
    }
}

/// Restores the caller's terminal on Linux; never made on macOS.
impl Drop for RawTerminal {
    fn drop(&mut self) {}
}
