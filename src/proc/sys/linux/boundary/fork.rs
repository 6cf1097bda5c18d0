//! The child's side of a held spawn: `clone3` into the tree's cgroup (or
//! the caller's `fork`), then the async-signal-safe path from the fork to
//! `execve` or `_exit`, reporting on the status pipe; and the test hook
//! that hides `clone3` from a thread.

use std::os::fd::AsRawFd;

use super::prepare::Prepared;
use super::{MSG_LEN, RELEASE_BYTE, TAG_EXEC, TAG_READY, TAG_SETUP};
use crate::proc::ProcError;

/// Enters the tree's working directory, resolved as the caller is now (the
/// tree's user: its credentials are set before this) and without magic
/// links: `/proc/self/cwd`, `/proc/<pid>/fd/N`, `/dev/fd/N` (and a symlink
/// to one) would name a directory of this process's (the service's cwd,
/// an open descriptor of its) without the search checks of the closed
/// folders above it. `openat2(RESOLVE_NO_MAGICLINKS)` refuses them
/// (`ELOOP`); the directory is then entered with `fchdir`, which checks
/// the search permission on it. A kernel without `openat2` (before 5.6)
/// gets a plain `chdir`. `false` with `errno` set on failure.
///
/// # Safety
/// Called in the child between fork and `execve`: only raw syscalls, no
/// allocation.
unsafe fn enter_cwd(cwd: &std::ffi::CStr) -> bool {
    // `struct open_how` (linux/openat2.h): flags, mode, resolve, each 64
    // bits (libc's own type is non-exhaustive, so it cannot be built here).
    let how: [u64; 3] = [
        (libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC) as u64,
        0,
        libc::RESOLVE_NO_MAGICLINKS,
    ];
    // SAFETY: `cwd` is a NUL-terminated path and `how` a live 24-byte
    // `open_how` for the call; openat2 only reads both.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            libc::AT_FDCWD,
            cwd.as_ptr(),
            how.as_ptr(),
            std::mem::size_of_val(&how),
        )
    };
    // SAFETY: errno is this thread's; reading and writing it is a plain
    // memory access.
    let errno = || unsafe { *libc::__errno_location() };
    if fd < 0 {
        if errno() == libc::ENOSYS {
            // SAFETY: as above, `cwd` is NUL-terminated.
            return unsafe { libc::chdir(cwd.as_ptr()) } == 0;
        }
        return false;
    }
    let fd = fd as libc::c_int;
    // SAFETY: `fd` is the descriptor openat2 just returned, closed once.
    let entered = unsafe { libc::fchdir(fd) } == 0;
    let saved = errno();
    // SAFETY: as above.
    unsafe {
        libc::close(fd);
        *libc::__errno_location() = saved;
    }
    entered
}

/// `struct clone_args` (linux/sched.h): every field 64 bits on every
/// architecture, so one definition fits all.
#[repr(C)]
#[derive(Default)]
pub(crate) struct CloneArgs {
    pub(crate) flags: u64,
    pub(crate) pidfd: u64,
    pub(crate) child_tid: u64,
    pub(crate) parent_tid: u64,
    pub(crate) exit_signal: u64,
    pub(crate) stack: u64,
    pub(crate) stack_size: u64,
    pub(crate) tls: u64,
    pub(crate) set_tid: u64,
    pub(crate) set_tid_size: u64,
    pub(crate) cgroup: u64,
}

/// `clone3(CLONE_INTO_CGROUP)` used as `fork`: the child is born in the
/// cgroup `dir` names, so it is never migrated there. Writing a pid to
/// `cgroup.procs` takes the kernel's cgroup threadgroup lock for writing,
/// which waits for an RCU grace period: 6–19 ms measured here for the one
/// migration a `run` makes (docs/DECISIONS.md), against
/// 0.1–0.2 ms for this. Returns -1 where the kernel refuses it (before 5.7,
/// `ENOSYS` under a seccomp filter that hides clone3, a cgroup it will not
/// take): the caller then forks and writes `cgroup.procs`, which reports
/// the real reason if there is one.
///
/// # Safety
/// As for `fork`: in a multi-threaded process the child may make only
/// async-signal-safe calls until `execve` or `_exit`.
pub(super) unsafe fn clone_into_cgroup(dir: libc::c_int) -> libc::pid_t {
    /// CLONE_INTO_CGROUP (linux/sched.h, Linux 5.7).
    const CLONE_INTO_CGROUP: u64 = 0x2_0000_0000;
    let Ok(cgroup) = u64::try_from(dir) else {
        return -1;
    };
    let args = CloneArgs {
        flags: CLONE_INTO_CGROUP,
        exit_signal: libc::SIGCHLD as u64,
        cgroup,
        ..CloneArgs::default()
    };
    // SAFETY: `args` is a valid clone_args of the size passed; no CLONE_VM
    // and no stack, so the child runs on a copy of this address space like
    // a forked one, and the caller keeps to fork's rules in it.
    let pid = unsafe {
        libc::syscall(
            libc::SYS_clone3,
            &args as *const CloneArgs,
            std::mem::size_of::<CloneArgs>(),
        )
    };
    libc::pid_t::try_from(pid).unwrap_or(-1)
}

/// The child side, between `fork` and `execve`/`_exit`. Only async-signal-safe
/// calls on memory prepared before the fork: no allocation, no locks.
///
/// # Safety
/// Must be called only in the child of `fork`, once, with descriptors that
/// are open in the child.
// Over 100 lines on purpose: the child's whole life between fork and exec is one async-signal-
// safe sequence on memory prepared before the fork, under the one SAFETY contract above; split,
// that contract would be spread over functions nothing else may call.
pub(super) unsafe fn child_after_fork(
    p: &Prepared,
    release_r: libc::c_int,
    status_w: libc::c_int,
) -> ! {
    // SAFETY (whole body): every call below is async-signal-safe (signal(7)
    // lists sigaction, sigprocmask, setsid, dup2, chdir, read, write, execve,
    // _exit; close_range, setgroups, setresgid and setresuid are made as
    // plain syscalls), and every pointer refers to
    // memory owned by `p`, which the parent prepared before fork and which is
    // not freed in the child.
    unsafe {
        let report = |tag: u8, step: u8, errno: i32| {
            let e = errno.to_ne_bytes();
            let msg: [u8; MSG_LEN] = [tag, step, e[0], e[1], e[2], e[3]];
            libc::write(status_w, msg.as_ptr().cast(), MSG_LEN);
        };
        let errno = || *libc::__errno_location();

        // Default dispositions (Rust ignores SIGPIPE; ignored signals would
        // survive exec) and an empty mask.
        for sig in 1..=p.sigmax {
            if sig != libc::SIGKILL && sig != libc::SIGSTOP {
                libc::sigaction(sig, &p.default_action, std::ptr::null_mut());
            }
        }
        if libc::sigprocmask(libc::SIG_SETMASK, &p.empty_mask, std::ptr::null_mut()) != 0 {
            report(TAG_SETUP, 4, errno());
            libc::_exit(125);
        }
        if libc::setsid() < 0 {
            report(TAG_SETUP, 1, errno());
            libc::_exit(125);
        }
        if let Some(null) = &p.null_fd {
            let fd = null.as_raw_fd();
            for target in 0..3 {
                if libc::dup2(fd, target) < 0 {
                    report(TAG_SETUP, 2, errno());
                    libc::_exit(125);
                }
            }
        }
        if let Some(log) = &p.log_fd {
            let fd = log.as_raw_fd();
            for target in 1..3 {
                if libc::dup2(fd, target) < 0 {
                    report(TAG_SETUP, 2, errno());
                    libc::_exit(125);
                }
            }
        }
        // Given descriptors last: each on its own slot. A given descriptor
        // numbered 0..2 in this process is never clobbered first: the
        // service's 0, 1 and 2 are open (never closed), so a received one
        // has a number of 3 or more.
        for (target, fd) in p.given.0.iter().enumerate() {
            if let Some(fd) = fd
                && libc::dup2(fd.as_raw_fd(), target as libc::c_int) < 0
            {
                report(TAG_SETUP, 2, errno());
                libc::_exit(125);
            }
        }
        if let Some(tty) = &p.tty_fd {
            // The new session's controlling terminal (ioctl is a plain
            // syscall); the dup2s leave it on 0, 1 and 2 without CLOEXEC.
            let fd = tty.as_raw_fd();
            if libc::ioctl(fd, libc::TIOCSCTTY, 0) < 0 {
                report(TAG_SETUP, 2, errno());
                libc::_exit(125);
            }
            for target in 0..3 {
                if libc::dup2(fd, target) < 0 {
                    report(TAG_SETUP, 2, errno());
                    libc::_exit(125);
                }
            }
        }
        if let Some(mask) = p.umask {
            libc::umask(mask);
        }
        // The requester's cgroup v1 memberships and limits, while we may
        // still join and raise (both need privilege the ids drop).
        for fd in &p.cgroups_v1 {
            if libc::write(fd.as_raw_fd(), b"0".as_ptr().cast(), 1) != 1 {
                report(TAG_SETUP, 6, errno());
                libc::_exit(125);
            }
        }
        for (resource, limit) in &p.rlimits {
            if libc::setrlimit(*resource, limit) != 0 {
                report(TAG_SETUP, 7, errno());
                libc::_exit(125);
            }
        }
        // The requester's credentials: raw syscalls (not glibc's wrappers,
        // which broadcast to every thread of a process; this child has one),
        // groups first, while we still may set them; gid before uid; real,
        // effective and saved ids alike, so none of ours can be regained.
        if let Some((uid, gid, groups)) = &p.creds
            && (libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()) != 0
                || libc::syscall(libc::SYS_setresgid, *gid, *gid, *gid) != 0
                || libc::syscall(libc::SYS_setresuid, *uid, *uid, *uid) != 0)
        {
            report(TAG_SETUP, 5, errno());
            libc::_exit(125);
        }
        if let Some(cwd) = &p.cwd
            && !enter_cwd(cwd)
        {
            report(TAG_SETUP, 3, errno());
            libc::_exit(125);
        }
        // The command inherits stdio only: close every other descriptor now,
        // so no held child keeps another spawn's pipes (or our files) open.
        let (a, b) = if release_r < status_w {
            (release_r, status_w)
        } else {
            (status_w, release_r)
        };
        let close_range = |lo: libc::c_int, hi: libc::c_uint| {
            if lo >= 0 && (lo as libc::c_uint) <= hi {
                libc::syscall(
                    libc::SYS_close_range,
                    lo as libc::c_uint,
                    hi,
                    0 as libc::c_uint,
                );
            }
        };
        if a > 3 {
            close_range(3, (a - 1) as libc::c_uint);
        }
        if b > a + 1 {
            close_range(a + 1, (b - 1) as libc::c_uint);
        }
        close_range(b + 1, libc::c_uint::MAX);

        report(TAG_READY, 0, 0);
        let mut byte = 0u8;
        let n = loop {
            let n = libc::read(release_r, (&raw mut byte).cast(), 1);
            if n < 0 && errno() == libc::EINTR {
                continue;
            }
            break n;
        };
        if n != 1 || byte != RELEASE_BYTE {
            // The parent cancelled (or died): never run the command.
            libc::_exit(125);
        }
        // `execvp`'s search, as the requester: a candidate that does not
        // exist (or whose directory does not, or is not one) is passed over;
        // one that exists but may not be run (EACCES) is remembered and the
        // search goes on; any other error ends it. Nothing is looked up as
        // the service, so 126 vs 127 says only what the requester could see.
        let mut failure = libc::ENOENT;
        for path in &p.candidates {
            libc::execve(path.as_ptr(), p.argv_ptrs.as_ptr(), p.envp_ptrs.as_ptr());
            match errno() {
                libc::ENOENT | libc::ENOTDIR | libc::ESTALE | libc::ENODEV | libc::ETIMEDOUT => {}
                libc::EACCES => failure = libc::EACCES,
                e => {
                    failure = e;
                    break;
                }
            }
        }
        report(TAG_EXEC, 0, failure);
        libc::_exit(127)
    }
}

/// Test hook: from now on `clone3` answers ENOSYS in the calling thread (a
/// seccomp filter, as a container runtime with an older policy installs
/// one), so [`spawn_held`] takes its fork + `cgroup.procs` fallback.
/// Irrevocable for the thread (and sets its no_new_privs): for a test's own
/// re-executed process only, never called by treewarden itself.
#[doc(hidden)]
pub fn deny_clone3_in_this_thread() -> Result<(), ProcError> {
    #[cfg(target_arch = "x86_64")]
    const AUDIT_ARCH: u32 = 0xc000_003e;
    #[cfg(target_arch = "aarch64")]
    const AUDIT_ARCH: u32 = 0xc000_00b7;
    const LD_W_ABS: u16 = 0x20;
    const JEQ_K: u16 = 0x15;
    const RET_K: u16 = 0x06;
    const RET_ERRNO: u32 = 0x0005_0000;
    const RET_ALLOW: u32 = 0x7fff_0000;
    let op = |code: u16, jt: u8, jf: u8, k: u32| libc::sock_filter { code, jt, jf, k };
    let clone3 = u32::try_from(libc::SYS_clone3).unwrap_or(u32::MAX);
    let ops = [
        op(LD_W_ABS, 0, 0, 4), // seccomp_data.arch
        op(JEQ_K, 0, 3, AUDIT_ARCH),
        op(LD_W_ABS, 0, 0, 0), // seccomp_data.nr
        op(JEQ_K, 0, 1, clone3),
        op(RET_K, 0, 0, RET_ERRNO | libc::ENOSYS as u32),
        op(RET_K, 0, 0, RET_ALLOW),
    ];
    let prog = libc::sock_fprog {
        len: ops.len() as u16,
        filter: ops.as_ptr() as *mut libc::sock_filter,
    };
    // SAFETY: prctl with integer arguments, then with a pointer to a
    // sock_fprog that points to `ops`, both alive for the call; the kernel
    // copies the program.
    let r = unsafe {
        if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
            -1
        } else {
            libc::prctl(
                libc::PR_SET_SECCOMP,
                libc::SECCOMP_MODE_FILTER,
                &prog as *const libc::sock_fprog,
            )
        }
    };
    if r != 0 {
        return Err(ProcError::Io(std::io::Error::last_os_error()));
    }
    Ok(())
}
