//! The parent's side of a held spawn: the tree cgroup made, the fork (or
//! clone3) under the reaper's lock, the child's report read, and the
//! [`HeldChild`] that holds it until it is released to exec (a
//! [`Spawned`]) or cancelled (killed, reaped, its cgroup removed).

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::PathBuf;
use std::time::Duration;

use rustix::io::Errno;

use super::cgroup::{apply_settings, make_tree_cgroups, remove_cgroup_when_empty};
use super::fork::{child_after_fork, clone_into_cgroup};
use super::prepare::{Prepared, prepare};
use super::{MSG_LEN, RELEASE_BYTE, STEP_NAMES, TAG_EXEC, TAG_READY, TAG_SETUP};
use crate::proc::ExecFailure;
use crate::proc::identity::identity_of;
use crate::proc::reaper::{Reaper, reap_child};
use crate::proc::{ExecFailureKind, GroupRecord, Identity, ProcError, SpawnSpec};

/// A forked child in its own session and process group (and cgroup), blocked
/// before exec. Invariant: while a `HeldChild` exists, the child has run no
/// command code and is our unreaped child. Dropping it cancels the child.
#[derive(Debug)]
pub struct HeldChild {
    pub pid: i32,
    /// Recorded once, here: equal to `pid` (the child called `setsid`).
    pub pgid: i32,
    /// Equal to `pid`.
    pub sid: i32,
    /// The cgroup directory the child was joined to, if any.
    pub cgroup: Option<PathBuf>,
    /// Born in its cgroup by `clone3(CLONE_INTO_CGROUP)`; `false` when it
    /// was forked and moved there (`cgroup.procs`), or has no cgroup.
    pub born_in_container: bool,
    pub identity: Identity,
    program: String,
    release_w: Option<OwnedFd>,
    status_r: Option<OwnedFd>,
    pidfd: Option<OwnedFd>,
    finished: bool,
}

/// A released tree root that is running the command.
#[derive(Debug)]
pub struct Spawned {
    pub pid: i32,
    pub pgid: i32,
    pub sid: i32,
    pub cgroup: Option<PathBuf>,
    pub identity: Identity,
    pidfd: Option<OwnedFd>,
}

impl Spawned {
    /// The group record to keep for teardown (never re-resolved later).
    pub fn group_record(&self) -> GroupRecord {
        GroupRecord {
            pgid: self.pgid,
            sid: self.sid,
            leader: self.identity.clone(),
        }
    }

    /// A pidfd for the root (readable once it exits), if the kernel has pidfds.
    pub fn pidfd(&self) -> Option<BorrowedFd<'_>> {
        self.pidfd.as_ref().map(AsFd::as_fd)
    }
}

/// How long cleanup waits for a killed child and its cgroup to empty.
const CLEANUP_WAIT: Duration = Duration::from_secs(5);

/// Reads one status message; `None` on EOF (the write end closed: the child
/// exec'd or died).
fn read_msg(fd: BorrowedFd<'_>) -> Result<Option<[u8; MSG_LEN]>, ProcError> {
    let mut buf = [0u8; MSG_LEN];
    let mut got = 0;
    while got < MSG_LEN {
        match rustix::io::read(fd, &mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok((got == MSG_LEN).then_some(buf))
}

fn msg_errno(msg: &[u8; MSG_LEN]) -> i32 {
    i32::from_ne_bytes([msg[2], msg[3], msg[4], msg[5]])
}

/// Forks `spec` as a held child: in its own session and process group (and
/// cgroup, created here and joined before exec), blocked until
/// [`HeldChild::release`]. When it returns, the child is ready and has run no
/// command code. If a [`Reaper`] is installed the child is announced to it
/// under the same lock as the fork, so its exit is never mistaken for an orphan's.
pub fn spawn_held(spec: &SpawnSpec) -> Result<HeldChild, ProcError> {
    let prepared = prepare(spec)?;
    let program = spec
        .argv
        .first()
        .map(|a| a.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut shared = None;
    if let Some(cg) = &spec.container {
        shared = make_tree_cgroups(cg, &spec.parent_settings, &spec.cgroup_settings)?;
        if let Err(e) = apply_settings(cg, &spec.cgroup_settings) {
            let _ = remove_cgroup_when_empty(cg, CLEANUP_WAIT);
            if let Some(shared) = &shared {
                shared.undo();
            }
            return Err(e);
        }
    }
    let result = fork_held(spec, &prepared, program);
    if result.is_err()
        && let Some(cg) = &spec.container
    {
        let _ = remove_cgroup_when_empty(cg, CLEANUP_WAIT);
        if let Some(shared) = &shared {
            shared.undo();
        }
    }
    result
}

// Over 100 lines on purpose: the parent's side of the held spawn (the two pipes, clone3 or
// fork, the cgroup join, the child's status read) is one sequence in which every failure reaps
// the child it made; one frame keeps every such path in sight.
fn fork_held(spec: &SpawnSpec, p: &Prepared, program: String) -> Result<HeldChild, ProcError> {
    let (release_r, release_w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
    let (status_r, status_w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;

    // The tree's cgroup, for a child born in it (see `clone_into_cgroup`).
    let cgroup_dir = spec.container.as_ref().and_then(|cg| {
        rustix::fs::open(
            cg,
            rustix::fs::OFlags::RDONLY
                | rustix::fs::OFlags::DIRECTORY
                | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )
        .ok()
    });
    let fork_lock = Reaper::installed().map(Reaper::fork_lock);
    let mut born_in_container = false;
    let mut pid = -1;
    if let Some(dir) = &cgroup_dir {
        // SAFETY: as for fork below: clone3 without CLONE_VM is a fork (the
        // child gets a copy of this address space and returns here with 0).
        pid = unsafe { clone_into_cgroup(dir.as_raw_fd()) };
        born_in_container = pid >= 0;
    }
    if pid < 0 {
        // SAFETY: fork is called with all of the child's memory prepared; the
        // child runs only `child_after_fork` (async-signal-safe calls, no
        // allocation, no locks; the reaper lock held here is never touched in
        // the child) and ends in execve or _exit.
        pid = unsafe { libc::fork() };
    }
    if pid == 0 {
        // SAFETY: we are the child of fork (or of clone3 used as one); both
        // descriptors are open here.
        unsafe { child_after_fork(p, release_r.as_raw_fd(), status_w.as_raw_fd()) }
    }
    if pid < 0 {
        return Err(ProcError::Io(std::io::Error::last_os_error()));
    }
    drop(cgroup_dir);
    if let Some(lock) = fork_lock {
        lock.spawned(pid);
    }
    drop(release_r);
    drop(status_w);

    // The child cannot exit before we kill it or close `release_w`, and it is
    // our unreaped child, so the pid is certainly it.
    let pidfd = rustix::process::Pid::from_raw(pid).and_then(|raw| {
        rustix::process::pidfd_open(raw, rustix::process::PidfdFlags::empty()).ok()
    });
    let mut held = HeldChild {
        pid,
        pgid: pid,
        sid: pid,
        cgroup: None,
        born_in_container,
        identity: Identity {
            pid,
            start_ticks: 0,
            boot_id: String::new(),
        },
        program,
        release_w: Some(release_w),
        status_r: Some(status_r),
        pidfd,
        finished: false,
    };
    // From here on, an early return drops `held`, which kills and reaps it.
    let setup_failure = |msg: &[u8; MSG_LEN]| ProcError::ChildSetup {
        step: STEP_NAMES
            .get(usize::from(msg[1]))
            .copied()
            .unwrap_or("unknown"),
        source: std::io::Error::from_raw_os_error(msg_errno(msg)),
    };
    if let Some(cg) = &spec.container {
        // A child clone3 did not start in the cgroup is moved there now.
        if !born_in_container
            && let Err(e) = std::fs::write(cg.join("cgroup.procs"), pid.to_string())
        {
            // The child may have failed its own set-up (a cwd closed to the
            // user it now runs as) and exited before it could be moved
            // (ESRCH): its report is the cause. It always reports (ready or
            // failed) or dies, so this read never waits long.
            if let Some(status_r) = held.status_r.as_ref()
                && let Ok(Some(msg)) = read_msg(status_r.as_fd())
                && msg[0] == TAG_SETUP
            {
                return Err(setup_failure(&msg));
            }
            return Err(ProcError::cgroup(cg, e));
        }
        held.cgroup = Some(cg.clone());
    }
    let status_fd = held.status_r.as_ref().map(AsFd::as_fd);
    let Some(status_fd) = status_fd else {
        unreachable!("status pipe is set above");
    };
    match read_msg(status_fd)? {
        Some(msg) if msg[0] == TAG_READY => {}
        Some(msg) if msg[0] == TAG_SETUP => return Err(setup_failure(&msg)),
        _ => {
            return Err(ProcError::Io(std::io::Error::other(
                "the child died before it was held",
            )));
        }
    }
    held.identity = identity_of(pid)?.ok_or_else(|| {
        ProcError::Io(std::io::Error::other("the held child vanished from /proc"))
    })?;
    Ok(held)
}

impl HeldChild {
    /// Lets the child exec. `Ok` once `execve` succeeded (the status pipe was
    /// closed by exec); `Err` when it failed, after the child was reaped and
    /// its cgroup removed.
    pub fn release(mut self) -> Result<Spawned, ExecFailure> {
        let died = |this: &mut Self, errno: i32| {
            let _ = this.teardown();
            ExecFailure {
                program: this.program.clone(),
                errno,
                kind: ExecFailureKind::Died,
            }
        };
        let Some(release_w) = self.release_w.take() else {
            return Err(died(&mut self, libc::EBADF));
        };
        if let Err(e) = rustix::io::write(&release_w, &[RELEASE_BYTE]) {
            return Err(died(&mut self, e.raw_os_error()));
        }
        drop(release_w);
        let msg = match self.status_r.take() {
            Some(status_r) => read_msg(status_r.as_fd()),
            None => Ok(None),
        };
        match msg {
            Ok(None) => {
                self.finished = true;
                Ok(Spawned {
                    pid: self.pid,
                    pgid: self.pgid,
                    sid: self.sid,
                    cgroup: self.cgroup.take(),
                    identity: self.identity.clone(),
                    pidfd: self.pidfd.take(),
                })
            }
            Ok(Some(msg)) if msg[0] == TAG_EXEC => {
                let failure = ExecFailure::new(&self.program, msg_errno(&msg));
                let _ = self.teardown();
                Err(failure)
            }
            Ok(Some(_)) => Err(died(&mut self, libc::EPROTO)),
            Err(ProcError::Io(e)) => Err(died(&mut self, e.raw_os_error().unwrap_or(libc::EIO))),
            Err(_) => Err(died(&mut self, libc::EIO)),
        }
    }

    /// Kills the held child before it ran anything (SIGKILL to our own
    /// unreaped child, through its pidfd when available), reaps it and removes
    /// its cgroup.
    pub fn cancel(mut self) -> Result<(), ProcError> {
        self.teardown()
    }

    fn teardown(&mut self) -> Result<(), ProcError> {
        if self.finished {
            return Ok(());
        }
        self.finished = true;
        // Safe: the child is our unreaped child (it cannot be reaped before
        // we reap it below), so the pid cannot have been recycled.
        let sent = match &self.pidfd {
            Some(fd) => rustix::process::pidfd_send_signal(fd, rustix::process::Signal::KILL),
            None => match rustix::process::Pid::from_raw(self.pid) {
                Some(pid) => rustix::process::kill_process(pid, rustix::process::Signal::KILL),
                None => Ok(()),
            },
        };
        match sent {
            Ok(()) | Err(Errno::SRCH) => {}
            Err(e) => return Err(e.into()),
        }
        self.release_w = None;
        self.status_r = None;
        reap_child(self.pid, Some(CLEANUP_WAIT))?;
        if let Some(cg) = self.cgroup.take()
            && !remove_cgroup_when_empty(&cg, CLEANUP_WAIT)?
        {
            return Err(ProcError::cgroup(
                cg,
                std::io::Error::other("still populated after the held child was killed"),
            ));
        }
        Ok(())
    }
}

impl Drop for HeldChild {
    /// Last line of defence: a held child nobody released is cancelled.
    fn drop(&mut self) {
        if !self.finished
            && let Err(e) = self.teardown()
        {
            tracing::warn!(pid = self.pid, error = %e, "cancelling a dropped held child failed");
        }
    }
}
