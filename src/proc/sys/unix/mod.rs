//! What Linux and macOS share: the sentinel guard every signal passes,
//! signal names, the user database, descriptors handed over by number, and
//! the descriptor limit (POSIX all).

mod datadir;
mod doctor;
pub mod fds;
pub(in crate::proc) mod guard;
mod limits;
mod probe;
mod shell;
pub mod sig;
pub(in crate::proc) mod userdb;

pub use datadir::make_dir_private;
pub use doctor::doctor_report;
pub use fds::take_inherited_fd;
pub use limits::{nofile_soft_limit, raise_nofile_soft_limit};
pub use probe::Probe;
pub use shell::{
    CtrlForward, follow_terminal_resizes, forward_console_ctrl, shield_from_interrupts, stdio_pipes,
};

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

/// Bytes free to an unprivileged writer on the filesystem of `dir`, and
/// its size (`statvfs`); `None` where it cannot be read.
pub fn disk_space(dir: &std::path::Path) -> Option<(u64, u64)> {
    let st = rustix::fs::statvfs(dir).ok()?;
    Some((
        st.f_bavail.saturating_mul(st.f_frsize),
        st.f_blocks.saturating_mul(st.f_frsize),
    ))
}

/// Bytes free to an unprivileged writer on the filesystem of `dir`.
pub fn free_bytes(dir: &std::path::Path) -> Option<u64> {
    disk_space(dir).map(|(free, _)| free)
}

/// Fills `buf` from the kernel's random source (`/dev/urandom`): the
/// service's API tokens.
pub fn fill_random(buf: &mut [u8]) -> std::io::Result<()> {
    std::fs::File::open("/dev/urandom").and_then(|mut r| std::io::Read::read_exact(&mut r, buf))
}

/// This host's name (`uname`'s nodename).
pub fn host_name() -> String {
    rustix::system::uname()
        .nodename()
        .to_string_lossy()
        .into_owned()
}

/// Writes all of `buf` at `offset` of `file` (`pwrite` until done).
pub fn write_all_at(file: &std::fs::File, buf: &[u8], offset: u64) -> std::io::Result<()> {
    std::os::unix::fs::FileExt::write_all_at(file, buf, offset)
}

/// Takes `file`'s exclusive lock, waiting for it (`flock`).
pub fn lock_exclusive(file: &std::fs::File) -> std::io::Result<()> {
    rustix::fs::flock(file, rustix::fs::FlockOperation::LockExclusive).map_err(Into::into)
}
