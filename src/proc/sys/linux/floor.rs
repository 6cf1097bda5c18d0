//! The bench's spawn floor (docs/PERFORMANCE.md), kept here because it needs `unsafe`
//! (a raw `clone3`) and only `src/proc/` may have it. Not used by
//! treewarden: the plainest code that does what a spawn into a cgroup
//! boundary must, for `examples/bench/main.rs` to compare `run -- true` against.

use std::ffi::CString;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// One spawn floor: make the cgroup `dir`, write one record to `journal`
/// and `fdatasync` it (the ledger's commit before release), `clone3` a
/// child into the cgroup that execs `program` (no arguments, empty
/// environment), wait for it, write and `fdatasync` a second record (the
/// exit), remove the cgroup. Returns the child's wait status.
#[doc(hidden)]
pub fn spawn_floor(dir: &Path, program: &Path, journal: &Path) -> std::io::Result<i32> {
    let program = CString::new(program.as_os_str().as_bytes())?;
    let argv = [program.as_ptr(), std::ptr::null()];
    let envp = [std::ptr::null::<libc::c_char>()];
    std::fs::create_dir(dir)?;
    let cg = std::fs::File::open(dir)?;
    let mut journal = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(journal)?;
    journal.write_all(b"spawn\n")?;
    journal.sync_data()?;
    use super::boundary::CloneArgs;
    let args = CloneArgs {
        flags: 0x2_0000_0000, // CLONE_INTO_CGROUP
        exit_signal: libc::SIGCHLD as u64,
        cgroup: cg.as_raw_fd() as u64,
        ..Default::default()
    };
    // SAFETY: clone3 without CLONE_VM is a fork; the child calls only
    // execve and _exit (async-signal-safe) on memory prepared above.
    let pid = unsafe {
        libc::syscall(
            libc::SYS_clone3,
            &raw const args,
            std::mem::size_of::<CloneArgs>(),
        )
    };
    if pid == 0 {
        // SAFETY: the child of the clone3 above: execve, else _exit.
        unsafe {
            libc::execve(program.as_ptr(), argv.as_ptr(), envp.as_ptr());
            libc::_exit(127);
        }
    }
    if pid < 0 {
        let e = std::io::Error::last_os_error();
        let _ = std::fs::remove_dir(dir);
        return Err(e);
    }
    let mut status = 0;
    // SAFETY: waits for our own child; `status` is a valid out pointer.
    let waited = unsafe { libc::waitpid(pid as libc::pid_t, &raw mut status, 0) };
    if waited < 0 {
        return Err(std::io::Error::last_os_error());
    }
    journal.write_all(b"exit\n")?;
    journal.sync_data()?;
    drop(cg);
    // Reaped, the child may still be leaving the cgroup (EBUSY): retry.
    loop {
        match std::fs::remove_dir(dir) {
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => std::thread::yield_now(),
            other => break other?,
        }
    }
    Ok(status)
}
