//! The held spawn on Windows: suspended, in its own console group, put into
//! its own Job Object before its first instruction, then resumed.

use std::os::windows::io::{AsRawHandle, FromRawHandle, IntoRawHandle};
use std::os::windows::process::CommandExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use windows_sys::Win32::Foundation::INVALID_HANDLE_VALUE;
use windows_sys::Win32::System::Diagnostics::ToolHelp::{
    CreateToolhelp32Snapshot, TH32CS_SNAPTHREAD, THREADENTRY32, Thread32First, Thread32Next,
};
use windows_sys::Win32::System::Threading::{
    CREATE_NEW_PROCESS_GROUP, CREATE_SUSPENDED, OpenThread, ResumeThread, THREAD_SUSPEND_RESUME,
    TerminateProcess, WaitForSingleObject,
};

use super::identity::{boot_id, times_of};
use super::job::{self, JobLimits};
use super::{Owned, Reaper, Spawned};
use crate::config::BoundaryChoice;
use crate::proc::{
    BoundaryKind, CgroupSetting, ExecFailure, ExecFailureKind, GivenStdio, Identity, ProcError,
    SpawnSpec, SpawnStdio,
};

/// The kinds a tree can be given here, and the OS a refusal names.
pub const BOUNDARY_KINDS: (&str, &[BoundaryKind]) = (" on Windows", &[BoundaryKind::Job]);

/// Where tree jobs are named: the `job:` namespace (`job:<name>` per tree).
pub fn cgroup_root(_override: Option<&Path>) -> Result<Option<PathBuf>, ProcError> {
    Ok(Some(PathBuf::from(job::JOB_PREFIX)))
}

/// Every Windows tree gets a job; `--boundary session` is refused (a
/// console group alone cannot end a tree whose root is gone).
pub fn resolve_boundary(
    choice: BoundaryChoice,
    _root: Option<&Path>,
) -> Result<BoundaryKind, ProcError> {
    match choice {
        BoundaryChoice::Auto | BoundaryChoice::Cgroup => Ok(BoundaryKind::Job),
        BoundaryChoice::Session => Err(ProcError::NoCgroup(
            "Windows has no session boundary: every tree gets a Job Object (use --boundary auto)"
                .into(),
        )),
    }
}

impl GivenStdio {
    /// Slot `i` as the child's handle (its own duplicate).
    fn stdio(&self, i: usize) -> std::io::Result<Option<std::process::Stdio>> {
        match self.0.get(i).and_then(Option::as_ref) {
            Some(h) => Ok(Some(std::process::Stdio::from(h.try_clone()?))),
            None => Ok(None),
        }
    }
}

/// How a failed spawn reads here: `CreateProcess failed`, without errno's words.
pub const EXEC_OTHER_FAILURE: &str = "CreateProcess failed";
pub const EXEC_ERRNO_IS_THE_OS: bool = false;

/// A root created suspended and already in its job: it has run no
/// instruction. Dropping it terminates it (it ran nothing).
#[derive(Debug)]
pub struct HeldChild {
    pub pid: i32,
    /// Its console group (its own pid).
    pub pgid: i32,
    pub sid: i32,
    /// `job:<name>`.
    pub cgroup: Option<PathBuf>,
    /// Always true: assigned to its job before its first instruction.
    pub born_in_container: bool,
    pub identity: Identity,
    process: Arc<Owned>,
    finished: bool,
}

fn limits_of(settings: &[CgroupSetting]) -> Result<JobLimits, ProcError> {
    let mut l = JobLimits::default();
    let bad = |s: &CgroupSetting| ProcError::Proc(format!("bad limit {}={}", s.file, s.value));
    for s in settings {
        match s.file {
            "memory.max" => l.memory_bytes = Some(s.value.parse().map_err(|_| bad(s))?),
            "pids.max" => l.active_processes = Some(s.value.parse().map_err(|_| bad(s))?),
            "cpu.max" => {
                // "<quota> 100000": a percent of one CPU; CpuRate is in
                // 1/100 % of all processors.
                let quota: u64 = s
                    .value
                    .split_whitespace()
                    .next()
                    .and_then(|q| q.parse().ok())
                    .ok_or_else(|| bad(s))?;
                let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
                let rate = (quota / 10 / cpus).clamp(1, 10_000);
                l.cpu_rate = Some(rate as u32);
            }
            other => {
                return Err(ProcError::Proc(format!(
                    "{other} has no Job Object limit on Windows"
                )));
            }
        }
    }
    Ok(l)
}

/// Creates the tree's job (with `KILL_ON_JOB_CLOSE` and its limits), then
/// the root suspended in a new console group, puts it into the job, and
/// returns it held (its first instruction waits for [`HeldChild::release`]).
// Over 100 lines on purpose: the held spawn in its order (the checks, the job, the suspended root,
// its assignment to the job, its identity); a failure to assign it or read its creation time ends
// the root unstarted through the `kill_unstarted` closure over this frame's handle and job path.
pub fn spawn_held(spec: &SpawnSpec) -> Result<HeldChild, ProcError> {
    let unsupported = |what: &str| {
        ProcError::Io(std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            what.to_string(),
        ))
    };
    if spec.tty.is_some() {
        return Err(unsupported("run --tty is not supported on Windows"));
    }
    if spec.credentials.is_some() {
        return Err(unsupported(
            "running as another user is not supported on Windows",
        ));
    }
    let Some(path) = spec.container.clone() else {
        return Err(ProcError::NoCgroup("a Windows tree needs its job".into()));
    };
    let Some(name) = job::job_name_of(&path) else {
        return Err(ProcError::NoCgroup(format!(
            "{} names no job",
            path.display()
        )));
    };
    let Some((program, args)) = spec.argv.split_first() else {
        return Err(ProcError::Proc("empty command".into()));
    };
    let job = job::create(&name, limits_of(&spec.cgroup_settings)?)?;
    let mut cmd = std::process::Command::new(program);
    cmd.args(args)
        .creation_flags(CREATE_SUSPENDED | CREATE_NEW_PROCESS_GROUP);
    if let Some(cwd) = &spec.cwd {
        cmd.current_dir(cwd);
    }
    if let Some(env) = &spec.env {
        cmd.env_clear();
        cmd.envs(env.iter().map(|(k, v)| (k, v)));
    }
    match &spec.stdio {
        SpawnStdio::Inherit => {}
        SpawnStdio::Null => {
            cmd.stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null());
        }
        SpawnStdio::Log => {
            let Some(log) = &spec.log_file else {
                return Err(ProcError::Proc("no log file for a logged tree".into()));
            };
            let out = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(log)?;
            let err = out.try_clone()?;
            cmd.stdin(std::process::Stdio::null())
                .stdout(out)
                .stderr(err);
        }
        SpawnStdio::Given(given) => {
            let log = || -> Result<std::fs::File, ProcError> {
                let Some(log) = &spec.log_file else {
                    return Err(ProcError::Proc("no log file for a logged tree".into()));
                };
                Ok(std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(log)?)
            };
            let stdin = given.stdio(0)?.unwrap_or_else(std::process::Stdio::null);
            let stdout = match given.stdio(1)? {
                Some(s) => s,
                None => log()?.into(),
            };
            let stderr = match given.stdio(2)? {
                Some(s) => s,
                None => log()?.into(),
            };
            cmd.stdin(stdin).stdout(stdout).stderr(stderr);
        }
    }
    let child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            job::forget(&path);
            let kind = match e.kind() {
                std::io::ErrorKind::NotFound => ExecFailureKind::NotFound,
                std::io::ErrorKind::PermissionDenied => ExecFailureKind::NotExecutable,
                _ => ExecFailureKind::Other,
            };
            return Err(ProcError::Exec(ExecFailure {
                program: program.to_string_lossy().into_owned(),
                errno: e.raw_os_error().unwrap_or(0),
                kind,
            }));
        }
    };
    let pid = child.id() as i32;
    // SAFETY: the raw handle comes from `into_raw_handle`, which gives up
    // std's ownership of it; nothing else closes it.
    let process = Arc::new(unsafe { Owned::from_raw_handle(child.into_raw_handle()) });
    let kill_unstarted = |why: ProcError| {
        // SAFETY: `process` is a valid handle; the child is suspended and
        // has run no instruction of the command.
        unsafe { TerminateProcess(process.as_raw_handle(), 1) };
        job::forget(&path);
        why
    };
    if let Err(e) = job::assign(&job, process.as_raw_handle()) {
        return Err(kill_unstarted(e));
    }
    let created = match times_of(&process) {
        Ok(t) => t.created,
        Err(e) => return Err(kill_unstarted(e)),
    };
    let reaper = Reaper::install()?;
    reaper.keep(pid, process.clone());
    Ok(HeldChild {
        pid,
        pgid: pid,
        sid: pid,
        cgroup: Some(path),
        born_in_container: true,
        identity: Identity {
            pid,
            start_ticks: created,
            boot_id: boot_id()?.to_owned(),
        },
        process,
        finished: false,
    })
}

impl HeldChild {
    /// Resumes the root: it runs the command from its first instruction.
    pub fn release(mut self) -> Result<Spawned, ExecFailure> {
        self.finished = true;
        if let Err(e) = resume_threads(self.pid) {
            self.terminate();
            return Err(ExecFailure {
                program: String::new(),
                errno: e.raw_os_error().unwrap_or(0),
                kind: ExecFailureKind::Other,
            });
        }
        Ok(Spawned {
            pid: self.pid,
            pgid: self.pgid,
            sid: self.sid,
            cgroup: self.cgroup.clone(),
            identity: self.identity.clone(),
        })
    }

    /// Ends the held root (it ran nothing) and lets go of its job.
    pub fn cancel(mut self) -> Result<(), ProcError> {
        self.finished = true;
        self.terminate();
        Ok(())
    }

    fn terminate(&self) {
        // SAFETY: `process` is a valid handle; the child is suspended and
        // has run nothing of the command.
        unsafe {
            TerminateProcess(self.process.as_raw_handle(), 1);
            WaitForSingleObject(self.process.as_raw_handle(), 5000);
        }
        if let Some(p) = &self.cgroup {
            job::forget(p);
        }
    }
}

impl Drop for HeldChild {
    fn drop(&mut self) {
        if !self.finished {
            self.terminate();
        }
    }
}

/// Resumes every thread of the (suspended) process `pid`.
fn resume_threads(pid: i32) -> std::io::Result<()> {
    // SAFETY: plain flags; returns a new snapshot handle or INVALID_HANDLE_VALUE.
    let snap = unsafe { CreateToolhelp32Snapshot(TH32CS_SNAPTHREAD, 0) };
    if snap == INVALID_HANDLE_VALUE {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `snap` is the valid handle just returned, owned here.
    let snap = unsafe { Owned::from_raw_handle(snap) };
    // SAFETY: a plain C struct of integers; all-zero is valid.
    let mut te: THREADENTRY32 = unsafe { std::mem::zeroed() };
    te.dwSize = std::mem::size_of::<THREADENTRY32>() as u32;
    let mut resumed = 0;
    // SAFETY: `snap` is a valid snapshot; `te` has its dwSize set.
    let mut ok = unsafe { Thread32First(snap.as_raw_handle(), &mut te) };
    while ok != 0 {
        if te.th32OwnerProcessID == pid as u32 {
            // SAFETY: plain values; returns a new thread handle or null.
            let t = unsafe { OpenThread(THREAD_SUSPEND_RESUME, 0, te.th32ThreadID) };
            if !t.is_null() {
                // SAFETY: `t` is the valid handle just returned, owned here.
                let t = unsafe { Owned::from_raw_handle(t) };
                // SAFETY: `t` has THREAD_SUSPEND_RESUME.
                if unsafe { ResumeThread(t.as_raw_handle()) } != u32::MAX {
                    resumed += 1;
                }
            }
        }
        // SAFETY: as for Thread32First.
        ok = unsafe { Thread32Next(snap.as_raw_handle(), &mut te) };
    }
    if resumed == 0 {
        return Err(std::io::Error::other(
            "no thread of the held root to resume",
        ));
    }
    Ok(())
}

/// Lets go of the job once it is empty (`true`); `false` while it has an
/// active process (the handle is kept: closing it would end them).
pub fn remove_cgroup_if_empty(path: &Path) -> Result<bool, ProcError> {
    match job::open(path)? {
        None => Ok(true),
        Some(j) if job::accounting(&j)?.active == 0 => {
            job::forget(path);
            Ok(true)
        }
        Some(_) => Ok(false),
    }
}

/// [`remove_cgroup_if_empty`], waiting up to `wait` for the job to empty.
pub fn remove_cgroup_when_empty(path: &Path, wait: Duration) -> Result<bool, ProcError> {
    let deadline = Instant::now() + wait;
    loop {
        if remove_cgroup_if_empty(path)? {
            return Ok(true);
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}
