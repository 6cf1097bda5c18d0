//! The process's own resource limits that custody depends on: descriptors.

use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};

/// The soft `RLIMIT_NOFILE` (`None` when unlimited).
pub fn nofile_soft_limit() -> Option<u64> {
    getrlimit(Resource::Nofile).current
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit (what systemd asks of
/// services that use no `select(2)`): the service's descriptors are what
/// custody reads `/proc` and holds pidfds with. Returns the soft limit in
/// force afterwards; a refusal leaves it as it was.
pub fn raise_nofile_soft_limit() -> Option<u64> {
    let now = getrlimit(Resource::Nofile);
    if now.current != now.maximum {
        let raised = Rlimit {
            current: now.maximum,
            maximum: now.maximum,
        };
        if let Err(e) = setrlimit(Resource::Nofile, raised) {
            tracing::debug!(error = %e, "soft RLIMIT_NOFILE not raised");
        }
    }
    nofile_soft_limit()
}
