//! Counters of what the engine did that the ledger cannot hold: writes it
//! refused. Everything the ledger did record is counted from its events
//! (the service's metrics tail them); these are the rest.

use std::sync::atomic::{AtomicU64, Ordering};

/// Process-local counters, shared by every clone of an [`super::Engine`].
#[derive(Debug, Default)]
pub struct EngineStats {
    /// `kill.authorized` commits that failed (the forced kill was skipped).
    authorizations_failed: AtomicU64,
    /// Ledger writes that failed anywhere in scans and teardowns (evidence
    /// and authority alike).
    ledger_write_errors: AtomicU64,
    /// Members still alive after the last forced-kill round of a teardown.
    survivors_after_kill: AtomicU64,
    /// Ticks whose evidence was incomplete: a read of `/proc` or of
    /// `cgroup.procs` failed for a reason other than the process being gone
    /// (out of descriptors, I/O). Nothing was concluded from them.
    scans_incomplete: AtomicU64,
}

impl EngineStats {
    pub fn authorizations_failed(&self) -> u64 {
        self.authorizations_failed.load(Ordering::Relaxed)
    }
    pub fn ledger_write_errors(&self) -> u64 {
        self.ledger_write_errors.load(Ordering::Relaxed)
    }
    pub fn survivors_after_kill(&self) -> u64 {
        self.survivors_after_kill.load(Ordering::Relaxed)
    }
    pub fn scans_incomplete(&self) -> u64 {
        self.scans_incomplete.load(Ordering::Relaxed)
    }
    pub(crate) fn scan_incomplete(&self) {
        self.scans_incomplete.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn authorization_failed(&self) {
        self.authorizations_failed.fetch_add(1, Ordering::Relaxed);
        self.write_errors(1);
    }
    pub(crate) fn write_errors(&self, n: usize) {
        self.ledger_write_errors
            .fetch_add(n as u64, Ordering::Relaxed);
    }
    pub(crate) fn survivors(&self, n: usize) {
        self.survivors_after_kill
            .fetch_add(n as u64, Ordering::Relaxed);
    }
}
