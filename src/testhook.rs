//! Test-only crash points: `TREEWARDEN_TEST_CRASH_AT=<point>` makes the
//! process abort itself (`std::process::abort`, as abrupt as a SIGKILL for
//! everything it holds: no destructor, no thaw, no further ledger write) at
//! that point. Off by default: unset or empty, every point is a no-op
//! costing one read of a cached value. The variable is read once.
//!
//! It exists so that the recovery tests can kill treewarden at an exact step
//! of a teardown instead of racing a timer. The points:
//!
//! - `before-authorize`: the tree is frozen and its survivors read, the
//!   authorization not yet committed;
//! - `after-authorize`: `kill.authorized` is committed (FULL), its SIGKILL
//!   not yet sent;
//! - `seal-committed`: an epoch's seal is committed (FULL), its key not yet
//!   overwritten by the next one (`ledger/seal.rs`);
//! - `ship-acked`: JetStream acknowledged a batch of events, the shipping
//!   cursor not yet written (`service/nats.rs`).
//!
//! It must never be set in production: a process that aborts in a teardown
//! leaves the tree frozen in `terminating` for the next sweep. So it is not
//! in release builds at all: without `debug_assertions` every
//! point is an empty function and the variable is never read. The
//! integration tests run the debug binary, which keeps them.
//!
//! The teardown's points are at the step they name, in
//! `custody/teardown/phases.rs` (`Teardown::authorize`); the seal's in the ledger's
//! sealer (`ledger/seal.rs`), whose step it is.

/// The environment variable that arms a crash point (debug builds only).
pub const CRASH_AT: &str = "TREEWARDEN_TEST_CRASH_AT";

/// Whether this build has the crash points (debug builds only).
pub const ENABLED: bool = cfg!(debug_assertions);

/// Release builds: no crash point, nothing read.
#[cfg(not(debug_assertions))]
#[inline(always)]
pub fn crash_point(_point: &str) {}

/// Aborts the process if `point` is the armed crash point.
#[cfg(debug_assertions)]
pub fn crash_point(point: &str) {
    use std::sync::OnceLock;
    static ARMED: OnceLock<Option<String>> = OnceLock::new();
    let armed = ARMED.get_or_init(|| std::env::var(CRASH_AT).ok().filter(|v| !v.is_empty()));
    if armed.as_deref() == Some(point) {
        eprintln!("treewarden: {CRASH_AT}={point}: aborting here (test hook)");
        std::process::abort();
    }
}
