//! A tree's stdio, the same on every OS: what the child's 0, 1 and 2 are
//! ([`SpawnStdio`]), and the pipes of its streamed stdio
//! (`"stdio": "stream"`, where the service runs: Linux and Windows), std's.

/// A descriptor (Unix) or handle (Windows) given for a child's 0, 1 or 2.
#[cfg(unix)]
type StdioHandle = std::os::fd::OwnedFd;
#[cfg(windows)]
type StdioHandle = std::os::windows::io::OwnedHandle;

/// A given descriptor's number (or handle's value), to compare by.
fn raw(h: &StdioHandle) -> usize {
    #[cfg(unix)]
    return std::os::fd::AsRawFd::as_raw_fd(h) as usize;
    #[cfg(windows)]
    return std::os::windows::io::AsRawHandle::as_raw_handle(h) as usize;
}

/// What the child's stdin/stdout/stderr are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SpawnStdio {
    /// The caller's descriptors 0, 1 and 2.
    Inherit,
    /// `/dev/null` for all three.
    Null,
    /// stdin from `/dev/null`; stdout and stderr appended, interleaved as
    /// written, to [`crate::proc::SpawnSpec::log_file`] (created 0600).
    Log,
    /// Descriptors (handles) for 0, 1 and 2: a streamed tree's pipes, or
    /// what a client handed over (SCM_RIGHTS on the API's Unix socket); a
    /// slot left `None` is as with [`SpawnStdio::Log`] (stdin `/dev/null`,
    /// stdout and stderr the log file).
    Given(GivenStdio),
}

impl SpawnStdio {
    /// Whether the tree needs its log file (`Log`, or given descriptors
    /// that leave stdout or stderr to it).
    pub fn needs_log(&self) -> bool {
        match self {
            SpawnStdio::Log => true,
            SpawnStdio::Given(g) => g.needs_log(),
            SpawnStdio::Inherit | SpawnStdio::Null => false,
        }
    }
}

/// The descriptors of [`SpawnStdio::Given`], in the order 0, 1, 2. Shared
/// (`Arc`) so a spec stays `Clone`; the child gets its own copy (`dup2`, a
/// duplicated handle).
#[derive(Clone, Debug, Default)]
pub struct GivenStdio(pub [Option<std::sync::Arc<StdioHandle>>; 3]);

impl GivenStdio {
    /// Whether slot `i` (0, 1, 2) is given.
    pub fn has(&self, i: usize) -> bool {
        self.0.get(i).is_some_and(Option::is_some)
    }

    /// Whether the log file is needed (stdout or stderr not given).
    pub fn needs_log(&self) -> bool {
        !(self.has(1) && self.has(2))
    }
}

impl PartialEq for GivenStdio {
    /// The same descriptors, by number (handles, by value).
    fn eq(&self, other: &Self) -> bool {
        let raw = |g: &Self| g.0.each_ref().map(|h| h.as_deref().map(raw));
        raw(self) == raw(other)
    }
}

impl Eq for GivenStdio {}

/// A tree's stdio streamed by the service ([`streamed_stdio`]): the child's
/// ends, to spawn it with, and the service's ends, blocking pipes, read and
/// written on threads of their own.
pub struct StreamedStdio {
    /// The tree's 0, 1 and 2: dropped (closed in the service) once spawned.
    pub child: GivenStdio,
    pub stdin: std::io::PipeWriter,
    pub stdout: std::io::PipeReader,
    pub stderr: std::io::PipeReader,
}

/// Three pipes for a tree's stdin, stdout and stderr, every end
/// close-on-exec (not inheritable) until the spawn puts the child's on 0,
/// 1 and 2.
pub fn streamed_stdio() -> std::io::Result<StreamedStdio> {
    let (stdin_r, stdin) = std::io::pipe()?;
    let (stdout, stdout_w) = std::io::pipe()?;
    let (stderr, stderr_w) = std::io::pipe()?;
    let child = GivenStdio([
        Some(std::sync::Arc::new(stdin_r.into())),
        Some(std::sync::Arc::new(stdout_w.into())),
        Some(std::sync::Arc::new(stderr_w.into())),
    ]);
    Ok(StreamedStdio {
        child,
        stdin,
        stdout,
        stderr,
    })
}
