//! The subreaper and the one reaper of a treewarden process.
//!
//! With `PR_SET_CHILD_SUBREAPER` set, descendants whose parent dies are
//! re-parented to us instead of init, so we see (and record) every exit in a
//! tree. Waiting is process-wide: any `wait*(-1)` steals the status of
//! whatever child ends next. So a process that installs [`Reaper`] has exactly
//! one waiter, the reaper thread, which keeps every exit in a map and hands it
//! to whoever asks, including exits that happened before the ask.
//!
//! Architecture Invariant: in a process that called [`Reaper::install`], only
//! the reaper thread calls `wait*` (except [`has_no_children`], a `WNOWAIT`
//! probe that takes no status). Never use `std::process::Command` with
//! `Child::wait`/`output`/`status` there (the reaper would take its status and
//! std's wait would fail with ECHILD); spawn through
//! [`super::boundary::spawn_held`] and ask the reaper.
//!
//! [`reap_child`] is the single entry point for "wait for my child `pid`": it
//! asks the reaper when one is installed, else it calls `waitpid(pid)` for that
//! one pid (never -1), so it cannot steal another part of the program's child.

use std::collections::{HashMap, HashSet};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use rustix::io::Errno;
use rustix::process::{Pid, WaitOptions};

use crate::proc::{ExitCallback, ExitStatus, ProcError};

impl ExitStatus {
    fn from_wait(status: rustix::process::WaitStatus) -> Option<Self> {
        if let Some(code) = status.exit_status() {
            Some(ExitStatus::Exited(code))
        } else {
            status.terminating_signal().map(ExitStatus::Signaled)
        }
    }
}

/// Makes the calling process a child subreaper (process-wide, inherited by
/// nothing: children do not become subreapers).
pub fn set_subreaper() -> Result<(), ProcError> {
    rustix::process::set_child_subreaper(Some(rustix::process::getpid()))?;
    Ok(())
}

/// Upper bound on how long the reaper thread parks after ECHILD before it
/// looks again, in case a fork was not announced with `notify_spawned`.
const IDLE_PARK: Duration = Duration::from_millis(250);

#[derive(Default)]
struct State {
    /// Children announced by a spawner whose exit has not arrived yet.
    expected: HashSet<i32>,
    /// Exits of announced children: (status, claimed by an ask).
    exits: HashMap<i32, (ExitStatus, bool)>,
    /// Exits nobody announced (adopted orphans, stray children), in order.
    unclaimed: std::collections::VecDeque<(i32, ExitStatus)>,
    /// Bumped by every `notify_spawned`, so the thread never parks past a fork.
    spawn_generation: u64,
    /// The CPU time (user + system, microseconds) of the last reaped
    /// process of each pid, from `wait4`'s rusage: its own and that of the
    /// children it waited for. Bounded: the newest [`CPU_KEPT`] are kept.
    cpu: HashMap<i32, u64>,
    cpu_order: std::collections::VecDeque<i32>,
    /// Called once with the exit of an announced child ([`Reaper::on_exit`]).
    on_exit: HashMap<i32, ExitCallback>,
}

/// How many unclaimed exits the reaper keeps for its readers.
const UNCLAIMED_KEPT: usize = 4096;

/// How many exits the reaper records under one lock and one wake-up.
const BATCH_MAX: usize = 256;

/// One reaped child: its pid, how it ended (`None`: a status that is no
/// exit), its CPU time in microseconds.
type Reaped = (i32, Option<ExitStatus>, u64);

/// How many reaped processes' CPU times the reaper keeps for their
/// recorders (who ask within a scan interval or a teardown of the exit).
const CPU_KEPT: usize = 8192;

/// The process-wide reaper: one thread blocked in `wait`, a map of exits.
pub struct Reaper {
    state: Mutex<State>,
    /// Signalled when an exit is recorded (wakes `wait_exit`).
    exited: Condvar,
    /// Signalled when a child is spawned (wakes the thread parked on ECHILD).
    spawned: Condvar,
}

static REAPER: OnceLock<Reaper> = OnceLock::new();

impl Reaper {
    /// Sets `PR_SET_CHILD_SUBREAPER` and starts the reaper thread, once per
    /// process; later calls return the same reaper.
    pub fn install() -> Result<&'static Reaper, ProcError> {
        static INSTALL: Mutex<()> = Mutex::new(());
        let _once = INSTALL.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(r) = REAPER.get() {
            return Ok(r);
        }
        set_subreaper()?;
        let reaper = REAPER.get_or_init(|| Reaper {
            state: Mutex::new(State::default()),
            exited: Condvar::new(),
            spawned: Condvar::new(),
        });
        std::thread::Builder::new()
            .name("treewarden-reaper".into())
            .spawn(move || reaper.run())?;
        Ok(reaper)
    }

    /// The reaper, if this process installed one.
    pub fn installed() -> Option<&'static Reaper> {
        REAPER.get()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A poisoned lock only means a waiter panicked; the map is still valid.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn run(&self) {
        loop {
            let generation = self.lock().spawn_generation;
            match wait_any(false) {
                Ok(Some(first)) => self.record_batch(first),
                Ok(None) | Err(Errno::INTR) => {}
                Err(e) => {
                    if e != Errno::CHILD {
                        tracing::warn!(error = %e, "reaper: wait failed");
                    }
                    // No children: park until a spawn is announced (or a
                    // short bounded time passes), never busy-loop.
                    let state = self.lock();
                    if state.spawn_generation == generation {
                        let _ = self
                            .spawned
                            .wait_timeout(state, IDLE_PARK)
                            .unwrap_or_else(|e| e.into_inner());
                    }
                }
            }
        }
    }

    /// Records `first` and every other child already ended (reaped without
    /// blocking, up to [`BATCH_MAX`]) under one lock, then wakes the waiters
    /// once and runs the exits' callbacks. One wake a batch, not one a
    /// child (with one a child, a drain's 10,000 exits woke each of 512 waiting
    /// teardowns 10,000 times, and the reaper waited for the lock behind
    /// them while the zombies stayed).
    fn record_batch(&self, first: Reaped) {
        let mut reaped = vec![first];
        while reaped.len() < BATCH_MAX {
            match wait_any(true) {
                Ok(Some(r)) => reaped.push(r),
                Ok(None) | Err(_) => break,
            }
        }
        let mut state = self.lock();
        let mut calls = Vec::new();
        for (pid, exit, cpu_usec) in reaped {
            let Some(exit) = exit else { continue };
            if let Some(f) = Self::record(&mut state, pid, exit, cpu_usec) {
                calls.push((f, exit));
            }
        }
        drop(state);
        self.exited.notify_all();
        for (f, exit) in calls {
            f(exit);
        }
    }

    /// Records one exit; the callback an announced child left, to call.
    fn record(
        state: &mut State,
        pid: i32,
        exit: ExitStatus,
        cpu_usec: u64,
    ) -> Option<ExitCallback> {
        if state.cpu.insert(pid, cpu_usec).is_none() {
            state.cpu_order.push_back(pid);
            if state.cpu_order.len() > CPU_KEPT
                && let Some(old) = state.cpu_order.pop_front()
            {
                state.cpu.remove(&old);
            }
        }
        if state.expected.remove(&pid) {
            state.exits.insert(pid, (exit, false));
            state.on_exit.remove(&pid)
        } else {
            Self::keep_unclaimed(state, pid, exit);
            None
        }
    }

    /// Calls `f` with the exit of `pid`, a child a spawner announced, once it
    /// is reaped — at once when it has been already. No descriptor is held
    /// per child (with one, a service with 2,000 live trees would hold 2,000 root
    /// pidfds): an announced child's pid cannot name another process until
    /// this reaper has reaped it, and reaping it is what calls `f`. The exit
    /// stays available to [`Reaper::wait_exit`] and [`Reaper::exit_of`] (it
    /// is not claimed). `Err(f)` when `pid` is no announced child of ours:
    /// the caller watches it some other way (a pidfd).
    pub fn on_exit(&self, pid: i32, f: ExitCallback) -> Result<(), ExitCallback> {
        let mut state = self.lock();
        if let Some((exit, _)) = state.exits.get(&pid).copied() {
            drop(state);
            f(exit);
            return Ok(());
        }
        if !state.expected.contains(&pid) {
            return Err(f);
        }
        state.on_exit.insert(pid, f);
        Ok(())
    }

    /// Announces a new child `pid`. Spawners call this (spawn_held does, under
    /// the lock held across fork: see [`Reaper::fork_lock`]) so the exit is
    /// kept for its owner and not reported by [`Reaper::unclaimed`]. An
    /// older, never-claimed exit recorded under the same (now recycled) pid is
    /// moved to the unclaimed list rather than confused with the new child.
    pub fn notify_spawned(&self, pid: i32) {
        let mut state = self.lock();
        Self::register(&mut state, pid);
        drop(state);
        self.spawned.notify_all();
    }

    fn register(state: &mut State, pid: i32) {
        // A callback left for an earlier child of this pid is stale.
        state.on_exit.remove(&pid);
        if let Some((old, claimed)) = state.exits.remove(&pid)
            && !claimed
        {
            Self::keep_unclaimed(state, pid, old);
        }
        state.expected.insert(pid);
        state.spawn_generation += 1;
    }

    /// Holds the reaper's lock across a fork so the new child is announced
    /// before its exit can be recorded. See `boundary::spawn_held`.
    pub(crate) fn fork_lock(&self) -> ForkLock<'_> {
        ForkLock {
            reaper: self,
            state: self.lock(),
        }
    }

    /// Waits until `pid` has exited and returns its status (`None` on
    /// timeout; `timeout: None` waits forever). Exits recorded before the ask
    /// are returned at once. The status stays available to [`Reaper::exit_of`].
    pub fn wait_exit(&self, pid: i32, timeout: Option<Duration>) -> Option<ExitStatus> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut state = self.lock();
        loop {
            if let Some(exit) = Self::claim(&mut state, pid) {
                return Some(exit);
            }
            state = match deadline {
                None => self.exited.wait(state).unwrap_or_else(|e| e.into_inner()),
                Some(deadline) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return None;
                    }
                    self.exited
                        .wait_timeout(state, deadline - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
            };
        }
    }

    /// Whether `pid` is a child a spawner announced to this reaper (its exit
    /// is coming here, or has come).
    pub fn knows(&self, pid: i32) -> bool {
        let state = self.lock();
        state.expected.contains(&pid) || state.exits.contains_key(&pid)
    }

    /// Waits up to `timeout` for the exit of `pid` among the statuses
    /// nobody announced (an adopted orphan), and takes it. Unlike
    /// [`Reaper::wait_exit`] it never answers with the status of an earlier
    /// child of ours that held the same pid.
    pub fn wait_unclaimed(&self, pid: i32, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        let mut state = self.lock();
        loop {
            if let Some(i) = state.unclaimed.iter().position(|(p, _)| *p == pid)
                && let Some((_, exit)) = state.unclaimed.remove(i)
            {
                return Some(exit);
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            state = self
                .exited
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// The exit of `pid` if it has been reaped already (marks it claimed).
    pub fn exit_of(&self, pid: i32) -> Option<ExitStatus> {
        Self::claim(&mut self.lock(), pid)
    }

    fn claim(state: &mut State, pid: i32) -> Option<ExitStatus> {
        if let Some((exit, claimed)) = state.exits.get_mut(&pid) {
            *claimed = true;
            return Some(*exit);
        }
        let idx = state.unclaimed.iter().position(|(p, _)| *p == pid)?;
        let (_, exit) = state.unclaimed.remove(idx)?;
        state.exits.insert(pid, (exit, true));
        Some(exit)
    }

    /// The CPU time (user + system, microseconds) of the last process of
    /// `pid` this reaper reaped: its own and that of every child it waited
    /// for (`wait4`'s rusage). `None` when it reaped none (recently).
    pub fn cpu_usec_of(&self, pid: i32) -> Option<u64> {
        self.lock().cpu.get(&pid).copied()
    }

    /// The exits nobody announced or asked for yet (adopted orphans and
    /// other strays), in reaping order: the last [`UNCLAIMED_KEPT`], kept
    /// until claimed, so every reader sees them — the owner loop's tick and
    /// the teardown it then starts alike (a drained status the tick had no
    /// use for was lost to the teardown's record).
    pub fn unclaimed(&self) -> Vec<(i32, ExitStatus)> {
        self.lock().unclaimed.iter().copied().collect()
    }

    fn keep_unclaimed(state: &mut State, pid: i32, exit: ExitStatus) {
        state.unclaimed.push_back((pid, exit));
        if state.unclaimed.len() > UNCLAIMED_KEPT {
            state.unclaimed.pop_front();
        }
    }
}

/// `wait4(-1, __WALL)`: the next child to end (also children whose exit
/// signal is not SIGCHLD), how it ended and its CPU time in microseconds
/// (rusage: user + system, its own and its waited-for children's). rustix
/// has no wait with rusage, hence libc.
/// `nohang`: `WNOHANG`, `Ok(None)` when no child has ended yet.
fn wait_any(nohang: bool) -> Result<Option<Reaped>, Errno> {
    let mut status: libc::c_int = 0;
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    let flags = libc::__WALL | if nohang { libc::WNOHANG } else { 0 };
    // SAFETY: wait4 writes only an int and a `struct rusage` through two
    // pointers to live locals of exactly those types.
    let pid = unsafe { libc::wait4(-1, &mut status, flags, usage.as_mut_ptr()) };
    if pid < 0 {
        return Err(Errno::from_io_error(&std::io::Error::last_os_error()).unwrap_or(Errno::IO));
    }
    if pid == 0 {
        return Ok(None);
    }
    // SAFETY: all-zero bytes are a valid `rusage` (integers only), and
    // wait4 succeeded, so the kernel filled it in.
    let usage = unsafe { usage.assume_init() };
    let usec = |t: libc::timeval| {
        u64::try_from(t.tv_sec).unwrap_or(0) * 1_000_000 + u64::try_from(t.tv_usec).unwrap_or(0)
    };
    let cpu = usec(usage.ru_utime) + usec(usage.ru_stime);
    let exit = if libc::WIFEXITED(status) {
        Some(ExitStatus::Exited(libc::WEXITSTATUS(status)))
    } else if libc::WIFSIGNALED(status) {
        Some(ExitStatus::Signaled(libc::WTERMSIG(status)))
    } else {
        None
    };
    Ok(Some((pid, exit, cpu)))
}

/// The reaper's lock, held by a spawner across `fork`.
pub(crate) struct ForkLock<'a> {
    reaper: &'a Reaper,
    state: MutexGuard<'a, State>,
}

impl ForkLock<'_> {
    /// Announces the freshly forked `pid` and releases the lock.
    pub(crate) fn spawned(mut self, pid: i32) {
        Reaper::register(&mut self.state, pid);
        drop(self.state);
        self.reaper.spawned.notify_all();
    }
}

/// Waits for our child `pid` to end: through the reaper when one is
/// installed, else `waitpid(pid)` on that pid only (so it steals nothing).
/// `timeout` bounds the reaper wait; without a reaper the wait polls with
/// `WNOHANG` until the timeout (or blocks when `None`).
pub fn reap_child(pid: i32, timeout: Option<Duration>) -> Result<Option<ExitStatus>, ProcError> {
    if let Some(reaper) = Reaper::installed() {
        return Ok(reaper.wait_exit(pid, timeout));
    }
    let raw = Pid::from_raw(pid).ok_or_else(|| ProcError::Refused {
        pid,
        reason: "not a child pid".into(),
    })?;
    let deadline = timeout.map(|t| Instant::now() + t);
    loop {
        let opts = if deadline.is_some() {
            WaitOptions::NOHANG
        } else {
            WaitOptions::empty()
        };
        match rustix::process::waitpid(Some(raw), opts) {
            Ok(Some((_, status))) => {
                if let Some(exit) = ExitStatus::from_wait(status) {
                    return Ok(Some(exit));
                }
            }
            Ok(None) => {}
            Err(Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
        if let Some(deadline) = deadline {
            if Instant::now() >= deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

/// The pid of this process's parent now (1 or a subreaper once it died).
pub fn parent_pid() -> i32 {
    rustix::process::getppid().map_or(0, |p| p.as_raw_nonzero().get())
}

/// Whether this process has no child at all, live or zombie (`ECHILD` from
/// `waitid(P_ALL, WEXITED | WNOHANG | WNOWAIT | __WALL)`). A probe that takes
/// no status (`WNOWAIT`): the reaper thread stays the only one that reaps.
///
/// For a subreaper that spawned a tree, `true` is proof that nothing of the
/// tree lives outside a cgroup: every live descendant of a dead process is
/// re-parented to its nearest live subreaper ancestor, so the topmost live
/// descendant of a tree whose root is gone is a child of this process.
pub fn has_no_children() -> Result<bool, ProcError> {
    // SAFETY: siginfo_t is a plain C struct for which all-zero is valid; the
    // kernel writes at most one siginfo_t into it, and WNOWAIT reaps nothing.
    let rc = unsafe {
        let mut info: libc::siginfo_t = std::mem::zeroed();
        libc::waitid(
            libc::P_ALL,
            0,
            &mut info,
            libc::WEXITED | libc::WNOHANG | libc::WNOWAIT | libc::__WALL,
        )
    };
    if rc == 0 {
        return Ok(false);
    }
    match std::io::Error::last_os_error() {
        e if e.raw_os_error() == Some(libc::ECHILD) => Ok(true),
        e => Err(ProcError::Io(e)),
    }
}
