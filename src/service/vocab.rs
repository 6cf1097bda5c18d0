//! The words of custody and `proc` that the service's callers (the HTTP
//! layer) may name: the few types a request, an answer or a page carries,
//! re-exported here so that `http` speaks only the service's vocabulary and
//! never reaches into `custody` or `proc` itself.

pub use crate::custody::policy::EndCause;
pub use crate::custody::{Lifetime, LogFollower, ObserverStats, Unsettled};
pub use crate::proc::{GivenStdio, Sig, StreamedStdio, streamed_stdio};

/// The soft `RLIMIT_NOFILE` of this process (`None` where it cannot be
/// read, or where the platform has none).
pub fn nofile_soft_limit() -> Option<u64> {
    crate::proc::nofile_soft_limit()
}

/// The local socket `serve` listens on beside TCP, where the platform has
/// one ([`LOCAL_SOCKET`]).
pub use crate::proc::{LOCAL_SOCKET, LocalListener};
