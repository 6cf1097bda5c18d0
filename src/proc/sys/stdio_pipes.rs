//! The pipes of a tree's streamed stdio (`"stdio": "stream"`), where the
//! service runs (Linux and Windows): std's pipes, the same on both.

use super::GivenStdio;

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
