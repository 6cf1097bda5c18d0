//! What Linux and macOS share: the sentinel guard every signal passes,
//! signal names, the user database, descriptors handed over by number, and
//! the descriptor limit (POSIX all).

pub mod fds;
pub(in crate::proc) mod guard;
mod limits;
pub mod sig;
pub(in crate::proc) mod userdb;

pub use fds::take_inherited_fd;
pub use limits::{nofile_soft_limit, raise_nofile_soft_limit};

use crate::proc::ProcError;

impl From<rustix::io::Errno> for ProcError {
    fn from(e: rustix::io::Errno) -> Self {
        ProcError::Io(e.into())
    }
}

/// Sets the mode `o` creates a file with (`OpenOptionsExt::mode`).
pub fn file_mode(o: &mut std::fs::OpenOptions, mode: u32) -> &mut std::fs::OpenOptions {
    std::os::unix::fs::OpenOptionsExt::mode(o, mode)
}

/// Sets the mode `b` creates a directory with (`DirBuilderExt::mode`).
pub fn dir_mode(b: &mut std::fs::DirBuilder, mode: u32) -> &mut std::fs::DirBuilder {
    std::os::unix::fs::DirBuilderExt::mode(b, mode)
}

/// Whether `held` is still the file at `path` (same device and inode).
pub fn same_file(held: &std::fs::File, path: &std::path::Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (held.metadata(), std::fs::metadata(path)) {
        (Ok(held), Ok(named)) => held.dev() == named.dev() && held.ino() == named.ino(),
        _ => false,
    }
}
