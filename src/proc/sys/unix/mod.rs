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
