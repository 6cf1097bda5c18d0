//! Signals on Windows: `CTRL_BREAK_EVENT` to a tree's console group, and
//! the forced kill `TerminateJobObject` ([`container_kill`], the teardown's
//! container kill, recorded as `TERMINATE_JOB` on target kind `job`).
//!
//! A single process has no graceful signal on Windows; its forced kill is
//! `TerminateProcess`, after its identity (pid + creation time) was checked
//! on the handle that kills it.

use std::os::windows::io::AsRawHandle;
use std::path::Path;
use std::time::{Duration, Instant};

use windows_sys::Win32::System::Console::{CTRL_BREAK_EVENT, GenerateConsoleCtrlEvent};
use windows_sys::Win32::System::Threading::{
    PROCESS_QUERY_LIMITED_INFORMATION, PROCESS_SYNCHRONIZE, PROCESS_TERMINATE, TerminateProcess,
};

use super::identity::{boot_id, open, times_of};
use super::job;
use crate::proc::{
    CgroupEvent, Delivery, GroupDelivery, GroupRecord, Identity, Liveness, ProcError, Sig,
};

impl Sig {
    /// The first signals a teardown may send on Windows: the break only.
    pub const FIRST: [Sig; 1] = [Sig::Term];

    /// `TERM`, `BREAK`, `CTRL_BREAK` (any case, `SIG` prefix allowed) or 15.
    pub fn parse_first(s: &str) -> Result<Sig, String> {
        let upper = s.trim().to_ascii_uppercase();
        let name = upper.strip_prefix("SIG").unwrap_or(&upper);
        match name {
            "TERM" | "BREAK" | "CTRL_BREAK" | "15" => Ok(Sig::Term),
            _ => Err(format!(
                "unknown or refused signal {s:?}: on Windows the first signal is TERM (CTRL_BREAK_EVENT to the tree's process group); the forced kill comes only with its authorization"
            )),
        }
    }

    /// The ledger's `signal` field. `Term` is the console break; `Kill`
    /// of one process is `TerminateProcess` (the job's kill is recorded by
    /// the teardown as [`crate::proc::CONTAINER_KILL`]).
    pub fn name(self) -> &'static str {
        match self {
            Sig::Term => "CTRL_BREAK",
            Sig::Kill => "TERMINATE_PROCESS",
            Sig::Stop => "SUSPEND",
            Sig::Cont => "RESUME",
            Sig::Int => "CTRL_C",
            Sig::Hup => "SIGHUP",
            Sig::Quit => "SIGQUIT",
            Sig::Usr1 => "SIGUSR1",
            Sig::Usr2 => "SIGUSR2",
        }
    }

    /// The POSIX number the shared code's `128 + N` codes use.
    pub fn number(self) -> i32 {
        match self {
            Sig::Term => 15,
            Sig::Kill => 9,
            Sig::Stop => 19,
            Sig::Cont => 18,
            Sig::Int => 2,
            Sig::Hup => 1,
            Sig::Quit => 3,
            Sig::Usr1 => 10,
            Sig::Usr2 => 12,
        }
    }
}

/// Whether this process may terminate `pid` (opens it with that right).
pub fn may_signal(pid: i32) -> bool {
    matches!(open(pid, PROCESS_TERMINATE), Ok(Some(_)))
}

fn guard(pid: i32) -> Result<(), ProcError> {
    if pid <= 4 || pid == std::process::id() as i32 {
        return Err(ProcError::Refused {
            pid,
            reason: "the system or this process itself".into(),
        });
    }
    Ok(())
}

/// Signals one process only if it still is `id`: the handle is opened
/// first and its creation time checked on that handle, so the process
/// checked is the process signalled. `Kill` is `TerminateProcess`; no other
/// signal reaches a single process on Windows.
pub fn signal_process(id: &Identity, sig: Sig) -> Result<Delivery, ProcError> {
    guard(id.pid)?;
    if sig != Sig::Kill {
        return Err(super::reaper::unsupported(
            "graceful signal for a single process (the break goes to the tree's group)",
        ));
    }
    let Some(h) = open(
        id.pid,
        PROCESS_TERMINATE | PROCESS_QUERY_LIMITED_INFORMATION | PROCESS_SYNCHRONIZE,
    )?
    else {
        return Ok(Delivery::Gone);
    };
    let t = times_of(&h)?;
    if t.created != id.start_ticks || boot_id()? != id.boot_id {
        return Ok(Delivery::Recycled);
    }
    if !t.running {
        return Ok(Delivery::Gone);
    }
    // SAFETY: `h` is a valid process handle with PROCESS_TERMINATE.
    let ok = unsafe { TerminateProcess(h.as_raw_handle(), job::TERMINATED_CODE) };
    super::check_bool(ok)?;
    Ok(Delivery::Sent)
}

/// `CTRL_BREAK_EVENT` to the recorded group, only while it provably is the
/// recorded one: its leader (the root) is still the recorded process, or a
/// candidate member read in the group is live. Only the break: a group has
/// no forced kill (the job has).
pub fn signal_group_known(
    rec: &GroupRecord,
    sig: Sig,
    candidates: &[crate::proc::ProcKey],
) -> Result<GroupDelivery, ProcError> {
    guard(rec.pgid)?;
    if sig != Sig::Term {
        return Ok(GroupDelivery::NotRecorded(format!(
            "{} cannot be sent to a console group on Windows",
            sig.name()
        )));
    }
    // A candidate counts only while its pid still holds the process that
    // was read in the group (same creation time), not any live pid.
    let live = candidates
        .iter()
        .filter(|k| k.pid != rec.leader.pid)
        .filter(|k| {
            matches!(super::identity::identity_of(k.pid), Ok(Some(id)) if id.start_ticks == k.start_ticks)
        })
        .count();
    let members = match rec.leader.check() {
        Liveness::Same => 1 + live,
        Liveness::Unreadable => {
            return Ok(GroupDelivery::NotRecorded(
                "the group's leader cannot be read".into(),
            ));
        }
        Liveness::Gone | Liveness::Recycled if live > 0 => live,
        Liveness::Gone | Liveness::Recycled => return Ok(GroupDelivery::Empty),
    };
    // SAFETY: plain values; the group id is the recorded root's, checked
    // above, and never 0 (which would be this process's whole console).
    let ok = unsafe { GenerateConsoleCtrlEvent(CTRL_BREAK_EVENT, rec.pgid as u32) };
    super::check_bool(ok)?;
    Ok(GroupDelivery::Sent { members })
}

/// `TerminateJobObject` of the tree's job. Reached only from the
/// teardown's Kill phase, with its committed authorization.
pub fn container_kill(path: &Path) -> Result<(), ProcError> {
    match job::open(path)? {
        Some(j) => job::terminate(&j),
        // Every handle of the job closed (its owner died): its processes,
        // if any, are reached one by one as loose members.
        None => Err(ProcError::Proc(format!(
            "{}: no such job left (every handle to it closed)",
            path.display()
        ))),
    }
}

/// Jobs cannot be frozen (`Ok(false)`). The start of the teardown's
/// forced-kill round disarms the job first ([`disarm_standing_kill`]).
pub fn container_freeze(_path: &Path, _wait: Duration) -> Result<bool, ProcError> {
    Ok(false)
}

/// Clears the job's `KILL_ON_JOB_CLOSE` and checks it is clear: from here
/// on only the authorized terminate kills. The teardown calls it at the
/// start of its forced-kill round (and fails closed when it errs) and again
/// on every error exit, so a `run` that ends with survivors left as
/// evidence does not kill them when its exit closes the job. A job whose
/// every handle closed is gone with its flag: nothing to clear.
pub fn disarm_standing_kill(path: &Path) -> Result<(), ProcError> {
    let Some(j) = job::open(path)? else {
        return Ok(());
    };
    job::disarm(&j)?;
    if job::armed(&j)? {
        return Err(ProcError::Proc(format!(
            "{}: KILL_ON_JOB_CLOSE still set after clearing it",
            path.display()
        )));
    }
    Ok(())
}

/// Nothing was frozen: nothing to thaw.
pub fn container_thaw(_path: &Path, _wait: Duration) -> Result<bool, ProcError> {
    Ok(true)
}

/// The pids in the job (empty when the job is gone).
pub fn container_pids(path: &Path) -> Result<Vec<i32>, ProcError> {
    match job::open(path)? {
        Some(j) => job::pids(&j),
        None => Ok(Vec::new()),
    }
}

/// Whether the job has an active process.
pub fn container_populated(path: &Path) -> Result<bool, ProcError> {
    match job::open(path)? {
        Some(j) => Ok(job::accounting(&j)?.active > 0),
        None => Ok(false),
    }
}

/// Waits until the job's active-process count says `want` (populated or
/// not), or `deadline`; whether it did. A bounded poll of the count (1 ms,
/// then 10 ms after the first 50 ms).
pub fn container_wait_event(
    path: &Path,
    key: CgroupEvent,
    want: bool,
    deadline: Instant,
) -> Result<bool, ProcError> {
    if key == CgroupEvent::Frozen {
        return Ok(!want);
    }
    let started = Instant::now();
    loop {
        if container_populated(path)? == want {
            return Ok(true);
        }
        let now = Instant::now();
        if now >= deadline {
            return Ok(false);
        }
        let step = if now - started < Duration::from_millis(50) {
            Duration::from_millis(1)
        } else {
            Duration::from_millis(10)
        };
        std::thread::sleep(step.min(deadline - now));
    }
}

/// No SIGPIPE on Windows.
pub fn default_sigpipe() {}
