//! One tree's Job Object: made, limited, listed, disarmed, terminated.
//!
//! A job is named (`tw-<ledger>-<tree>`, the tree's recorded `cgroup` is
//! `job:<name>`) so that `kill` and `sweep`, other processes, can open it
//! while its owner still holds it. The owner keeps its handle in a registry
//! for its whole life (closing the last handle of a job with
//! `KILL_ON_JOB_CLOSE` ends its processes).
//!
//! `KILL_ON_JOB_CLOSE` is set when the job is made, before the root runs:
//! the backstop for an owner that dies without its teardown (the tree is
//! flagged [`KILL_ON_CLOSE_FLAG`] in the same spawn, before its release).
//! A teardown disarms it ([`disarm`]) before its forced-kill round, so from
//! then on only the authorized `TerminateJobObject` kills, and survivors of a
//! refused authorization outlive their owner as evidence.

use std::collections::HashMap;
use std::os::windows::io::{AsRawHandle, FromRawHandle};
use std::path::Path;
use std::sync::{Arc, Mutex};

use windows_sys::Win32::System::JobObjects::{
    AssignProcessToJobObject, CreateJobObjectW, JOB_OBJECT_CPU_RATE_CONTROL_ENABLE,
    JOB_OBJECT_CPU_RATE_CONTROL_HARD_CAP, JOB_OBJECT_LIMIT_ACTIVE_PROCESS,
    JOB_OBJECT_LIMIT_JOB_MEMORY, JOB_OBJECT_LIMIT_KILL_ON_JOB_CLOSE,
    JOBOBJECT_BASIC_ACCOUNTING_INFORMATION, JOBOBJECT_CPU_RATE_CONTROL_INFORMATION,
    JOBOBJECT_EXTENDED_LIMIT_INFORMATION, JobObjectBasicAccountingInformation,
    JobObjectBasicProcessIdList, JobObjectCpuRateControlInformation,
    JobObjectExtendedLimitInformation, OpenJobObjectW, QueryInformationJobObject,
    SetInformationJobObject, TerminateJobObject,
};

use super::{Owned, last_error, wide};
use crate::proc::ProcError;

/// How a tree's `cgroup` column names its job: `job:<name>`.
pub const JOB_PREFIX: &str = "job:";

/// The tree flag that records the job's standing `KILL_ON_JOB_CLOSE`.
pub const KILL_ON_CLOSE_FLAG: &str = "kill_on_job_close";

/// The exit code `TerminateJobObject` gives every process it ends.
pub(crate) const TERMINATED_CODE: u32 = 1;

// Access rights of a job object (winnt.h).
const JOB_OBJECT_ASSIGN_PROCESS: u32 = 0x1;
const JOB_OBJECT_SET_ATTRIBUTES: u32 = 0x2;
const JOB_OBJECT_QUERY: u32 = 0x4;
const JOB_OBJECT_TERMINATE: u32 = 0x8;

/// The jobs this process made, by name: held until the process exits or
/// the job is found empty ([`forget`]).
static JOBS: Mutex<Option<HashMap<String, Arc<Owned>>>> = Mutex::new(None);

/// The job name in a recorded `cgroup` path (`job:<name>`, the separator
/// `Path::join` puts after the prefix allowed).
pub fn job_name_of(path: &Path) -> Option<String> {
    let s = path.to_string_lossy();
    let rest = s.strip_prefix(JOB_PREFIX)?;
    let name = rest.trim_start_matches(['\\', '/']);
    (!name.is_empty()).then(|| name.to_owned())
}

/// Limits a job is made with (from the tree's `cgroup_settings`).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct JobLimits {
    pub memory_bytes: Option<u64>,
    pub active_processes: Option<u32>,
    /// In 1/100 of a percent of all processors (`CpuRate`).
    pub cpu_rate: Option<u32>,
}

/// Makes the named job with `KILL_ON_JOB_CLOSE` and `limits` (no
/// `BREAKAWAY_OK`), and keeps it in the registry.
pub(crate) fn create(name: &str, limits: JobLimits) -> Result<Arc<Owned>, ProcError> {
    let wname = wide(name);
    // SAFETY: sets this thread's last-error value (so ERROR_ALREADY_EXISTS
    // below is CreateJobObjectW's); then null security attributes and
    // `wname`, NUL-terminated UTF-16 that outlives the call.
    let h = unsafe {
        windows_sys::Win32::Foundation::SetLastError(0);
        CreateJobObjectW(std::ptr::null(), wname.as_ptr())
    };
    if h.is_null() {
        return Err(ProcError::Io(last_error()));
    }
    // ERROR_ALREADY_EXISTS: someone else made a job of this name first.
    if last_error().raw_os_error() == Some(183) {
        // SAFETY: `h` is the handle just returned; closed here.
        drop(unsafe { Owned::from_raw_handle(h) });
        return Err(ProcError::Proc(format!(
            "a job named {name} exists already: refusing to share it"
        )));
    }
    // SAFETY: `h` is the handle just returned, owned by nobody else.
    let job = Arc::new(unsafe { Owned::from_raw_handle(h) });
    let mut info = extended(&job)?;
    info.BasicLimitInformation.LimitFlags |= JOB_OBJECT_LIMIT_KILL_ON_JOB_CLOSE;
    if let Some(m) = limits.memory_bytes {
        info.BasicLimitInformation.LimitFlags |= JOB_OBJECT_LIMIT_JOB_MEMORY;
        info.JobMemoryLimit = m as usize;
    }
    if let Some(n) = limits.active_processes {
        info.BasicLimitInformation.LimitFlags |= JOB_OBJECT_LIMIT_ACTIVE_PROCESS;
        info.BasicLimitInformation.ActiveProcessLimit = n;
    }
    set_extended(&job, &info)?;
    if let Some(rate) = limits.cpu_rate {
        let mut cpu: JOBOBJECT_CPU_RATE_CONTROL_INFORMATION =
            // SAFETY: a plain C struct (flags and a union of integers) for
            // which all-zero is a valid value.
            unsafe { std::mem::zeroed() };
        cpu.ControlFlags =
            JOB_OBJECT_CPU_RATE_CONTROL_ENABLE | JOB_OBJECT_CPU_RATE_CONTROL_HARD_CAP;
        cpu.Anonymous.CpuRate = rate;
        // SAFETY: `job` is a valid job handle; `cpu` is the struct this
        // information class takes, with its exact size.
        let ok = unsafe {
            SetInformationJobObject(
                job.as_raw_handle(),
                JobObjectCpuRateControlInformation,
                (&raw const cpu).cast(),
                std::mem::size_of_val(&cpu) as u32,
            )
        };
        if ok == 0 {
            return Err(ProcError::Proc(format!(
                "the job's CPU rate limit was refused: {}",
                last_error()
            )));
        }
    }
    jobs().insert(name.to_owned(), job.clone());
    Ok(job)
}

fn jobs() -> std::sync::MutexGuard<'static, Option<HashMap<String, Arc<Owned>>>> {
    let mut g = JOBS.lock().unwrap_or_else(|e| e.into_inner());
    g.get_or_insert_with(HashMap::new);
    g
}

trait Registry {
    fn insert(&mut self, name: String, job: Arc<Owned>);
    fn get(&self, name: &str) -> Option<Arc<Owned>>;
    fn remove(&mut self, name: &str);
}

impl Registry for std::sync::MutexGuard<'static, Option<HashMap<String, Arc<Owned>>>> {
    fn insert(&mut self, name: String, job: Arc<Owned>) {
        if let Some(m) = self.as_mut() {
            m.insert(name, job);
        }
    }
    fn get(&self, name: &str) -> Option<Arc<Owned>> {
        self.as_ref().and_then(|m| m.get(name).cloned())
    }
    fn remove(&mut self, name: &str) {
        if let Some(m) = self.as_mut() {
            m.remove(name);
        }
    }
}

/// The job a recorded path names: this process's own handle, or one opened
/// by name. `Ok(None)`: no such job (every handle to it is closed, so it has
/// no process left that a handle could reach).
pub(crate) fn open(path: &Path) -> Result<Option<Arc<Owned>>, ProcError> {
    let Some(name) = job_name_of(path) else {
        return Err(ProcError::Proc(format!(
            "{} names no job object",
            path.display()
        )));
    };
    if let Some(job) = jobs().get(&name) {
        return Ok(Some(job));
    }
    let wname = wide(&name);
    let access = JOB_OBJECT_QUERY
        | JOB_OBJECT_TERMINATE
        | JOB_OBJECT_SET_ATTRIBUTES
        | JOB_OBJECT_ASSIGN_PROCESS;
    // SAFETY: `wname` is NUL-terminated UTF-16 that outlives the call.
    let h = unsafe { OpenJobObjectW(access, 0, wname.as_ptr()) };
    if h.is_null() {
        let e = last_error();
        // ERROR_FILE_NOT_FOUND / ERROR_INVALID_NAME: no job of that name.
        return match e.raw_os_error() {
            Some(2 | 123) => Ok(None),
            _ => Err(ProcError::Io(e)),
        };
    }
    // SAFETY: `h` is the handle just returned, owned by nobody else.
    Ok(Some(Arc::new(unsafe { Owned::from_raw_handle(h) })))
}

/// Lets go of this process's handle of the job named in `path`.
pub(crate) fn forget(path: &Path) {
    if let Some(name) = job_name_of(path) {
        jobs().remove(&name);
    }
}

/// Puts the (suspended) process `process` into `job`.
pub(crate) fn assign(
    job: &Owned,
    process: std::os::windows::io::RawHandle,
) -> Result<(), ProcError> {
    // SAFETY: both are valid handles for the duration of the call.
    let ok = unsafe { AssignProcessToJobObject(job.as_raw_handle(), process) };
    super::check_bool(ok)
}

fn extended(job: &Owned) -> Result<JOBOBJECT_EXTENDED_LIMIT_INFORMATION, ProcError> {
    // SAFETY: a plain C struct of integers for which all-zero is valid.
    let mut info: JOBOBJECT_EXTENDED_LIMIT_INFORMATION = unsafe { std::mem::zeroed() };
    // SAFETY: `job` is a valid job handle; the buffer is the struct this
    // class fills, with its exact size.
    let ok = unsafe {
        QueryInformationJobObject(
            job.as_raw_handle(),
            JobObjectExtendedLimitInformation,
            (&raw mut info).cast(),
            std::mem::size_of_val(&info) as u32,
            std::ptr::null_mut(),
        )
    };
    super::check_bool(ok)?;
    Ok(info)
}

fn set_extended(job: &Owned, info: &JOBOBJECT_EXTENDED_LIMIT_INFORMATION) -> Result<(), ProcError> {
    // SAFETY: `job` is a valid job handle; `info` is the struct this class
    // takes, with its exact size.
    let ok = unsafe {
        SetInformationJobObject(
            job.as_raw_handle(),
            JobObjectExtendedLimitInformation,
            (info as *const JOBOBJECT_EXTENDED_LIMIT_INFORMATION).cast(),
            std::mem::size_of_val(info) as u32,
        )
    };
    super::check_bool(ok)
}

/// Clears `KILL_ON_JOB_CLOSE` (keeps every other limit): closing the job's
/// last handle no longer ends its processes.
///
/// Written whether or not the flag reads back as set: wine 8.0 answers the
/// query with no flags at all (so there it also clears the job's other
/// limits, which it does not enforce either); real Windows reads back what
/// was set, and only the one flag goes.
pub(crate) fn disarm(job: &Owned) -> Result<(), ProcError> {
    let mut info = extended(job)?;
    info.BasicLimitInformation.LimitFlags &= !JOB_OBJECT_LIMIT_KILL_ON_JOB_CLOSE;
    set_extended(job, &info)
}

/// Whether the job still has `KILL_ON_JOB_CLOSE`.
pub(crate) fn armed(job: &Owned) -> Result<bool, ProcError> {
    Ok(extended(job)?.BasicLimitInformation.LimitFlags & JOB_OBJECT_LIMIT_KILL_ON_JOB_CLOSE != 0)
}

/// `TerminateJobObject`: every process in the job, at once.
pub(crate) fn terminate(job: &Owned) -> Result<(), ProcError> {
    // SAFETY: `job` is a valid job handle.
    let ok = unsafe { TerminateJobObject(job.as_raw_handle(), TERMINATED_CODE) };
    super::check_bool(ok)
}

/// The job's accounting: active processes and CPU time (100 ns units).
pub(crate) struct Accounting {
    pub active: u32,
    pub total_processes: u32,
    pub cpu_100ns: u64,
}

pub(crate) fn accounting(job: &Owned) -> Result<Accounting, ProcError> {
    // SAFETY: a plain C struct of integers for which all-zero is valid.
    let mut info: JOBOBJECT_BASIC_ACCOUNTING_INFORMATION = unsafe { std::mem::zeroed() };
    // SAFETY: `job` is a valid job handle; the buffer is the struct this
    // class fills, with its exact size.
    let ok = unsafe {
        QueryInformationJobObject(
            job.as_raw_handle(),
            JobObjectBasicAccountingInformation,
            (&raw mut info).cast(),
            std::mem::size_of_val(&info) as u32,
            std::ptr::null_mut(),
        )
    };
    super::check_bool(ok)?;
    Ok(Accounting {
        active: info.ActiveProcesses,
        total_processes: info.TotalProcesses,
        cpu_100ns: (info.TotalUserTime as u64).saturating_add(info.TotalKernelTime as u64),
    })
}

/// The pids of the job's processes (`JobObjectBasicProcessIdList`).
pub(crate) fn pids(job: &Owned) -> Result<Vec<i32>, ProcError> {
    let mut cap = 64usize;
    loop {
        // JOBOBJECT_BASIC_PROCESS_ID_LIST: two u32 counts, then ULONG_PTRs.
        let mut buf = vec![0usize; 1 + cap];
        // SAFETY: `job` is a valid job handle; `buf` is writable for its
        // whole byte length, which is what is passed.
        let ok = unsafe {
            QueryInformationJobObject(
                job.as_raw_handle(),
                JobObjectBasicProcessIdList,
                buf.as_mut_ptr().cast(),
                (buf.len() * std::mem::size_of::<usize>()) as u32,
                std::ptr::null_mut(),
            )
        };
        let assigned = (buf[0] & 0xffff_ffff) as usize;
        let listed = (buf[0] >> 32) as usize;
        if ok == 0 {
            let e = last_error();
            // ERROR_MORE_DATA: a bigger buffer.
            if e.raw_os_error() == Some(234) && cap < 1 << 20 {
                cap *= 4;
                continue;
            }
            return Err(ProcError::Io(e));
        }
        if listed < assigned && cap < 1 << 20 {
            cap = assigned.max(cap * 2);
            continue;
        }
        return Ok(buf[1..=listed.min(cap)].iter().map(|&p| p as i32).collect());
    }
}
