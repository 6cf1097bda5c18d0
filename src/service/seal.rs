//! The service's sealer: where sealing is set up
//! (`treewarden seal setup`), a thread of its own seals each epoch as it
//! ends ([`Ledger::seal_due`], `ledger/seal.rs`), catches up at start on the
//! epochs no sealer ran in (late seals), and at the service's shutdown makes
//! the clean close ([`Sealing::stop`]), after the drain's last writes. It has
//! a ledger handle of its own, like retention, whose busy timeout is at
//! least [`BUSY_TIMEOUT`] (custody writers in other processes, `run` in a
//! loop, must not starve a seal). A seal that cannot be made (a held write
//! lock, a full disk) is retried at once; it stays due, and is marked late
//! if it is made more than one interval after its epoch ended. Where the
//! ledger has no setup yet the thread looks again every few seconds, so a
//! `seal setup` made while the service runs needs no restart.

use std::path::PathBuf;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

use crate::ledger::Ledger;
use crate::ledger::seal::key_path;

/// The running sealer; [`Sealing::stop`] closes and ends it.
pub struct Sealing {
    stop: mpsc::Sender<()>,
    thread: JoinHandle<()>,
}

/// How long the sealer's own ledger handle waits for the write lock (at
/// least): busy custody writers in other processes must not starve a seal
/// past its epoch (a lost race only costs this thread a wait).
pub const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// After an epoch ends, the seal is made this much later (so the clock
/// has passed the end in every process).
const SLACK: Duration = Duration::from_millis(20);

impl Sealing {
    /// Starts the sealer thread. Where the ledger has no seal setup yet it
    /// looks again every [`IDLE`] (a `seal setup` made while the service
    /// runs is picked up without a restart). A setup without its key file
    /// is logged as an error and not sealed (the epochs stay unsealed and
    /// `verify --seal-key` fails), never guessed around; the service runs on.
    pub fn start(ledger: Ledger, data_dir: PathBuf) -> Result<Sealing, String> {
        let (stop, stopped) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("sealer".into())
            .spawn(move || {
                let mut said = None;
                loop {
                    let wait = match seal_once(&ledger, &data_dir, false, &mut said) {
                        Next::At(due) => {
                            due.duration_since(SystemTime::now())
                                .unwrap_or(Duration::ZERO)
                                + SLACK
                        }
                        Next::Retry(after) => after,
                    };
                    match stopped.recv_timeout(wait) {
                        Err(mpsc::RecvTimeoutError::Timeout) => {}
                        _ => break,
                    }
                }
                seal_once(&ledger, &data_dir, true, &mut said);
            })
            .map_err(|e| format!("sealing: cannot start its thread: {e}"))?;
        Ok(Sealing { stop, thread })
    }

    /// The clean stop: seals what is due and closes the current epoch.
    pub fn stop(self) {
        drop(self.stop);
        super::join(self.thread, "sealer thread");
    }
}

/// How often the sealer looks for a setup it does not have yet.
const IDLE: Duration = Duration::from_secs(5);

enum Next {
    At(SystemTime),
    Retry(Duration),
}

/// One sealer run: when to run again. `said` keeps the last problem
/// logged, so a lasting one is logged once, not every retry.
fn seal_once(
    ledger: &Ledger,
    data_dir: &std::path::Path,
    close: bool,
    said: &mut Option<String>,
) -> Next {
    let key = key_path(data_dir);
    let mut once = |what: String, error: bool| {
        if said.as_deref() != Some(what.as_str()) {
            if error {
                tracing::error!("{what}");
            } else {
                tracing::warn!("{what}");
            }
            *said = Some(what);
        }
    };
    match ledger.seal_setup_of() {
        Ok(None) => return Next::Retry(IDLE),
        Ok(Some(_)) if !key.is_file() => {
            once(
                format!(
                    "sealing is set up but its key file {} is missing: no seal is made, and `verify --seal-key` will fail",
                    key.display()
                ),
                true,
            );
            return Next::Retry(IDLE);
        }
        Ok(Some(_)) => {}
        Err(e) => {
            once(format!("sealing: {e} (retried)"), false);
            return Next::Retry(IDLE);
        }
    }
    match ledger.seal_due(data_dir, close) {
        Ok(Some(run)) => {
            *said = None;
            if run.late > 0 {
                tracing::warn!(
                    epochs = run.sealed.len(),
                    late = run.late,
                    "sealed epochs late: no sealer ran when they ended"
                );
            } else if !run.sealed.is_empty() {
                tracing::debug!(epochs = ?run.sealed, "sealed");
            }
            if run.closed {
                tracing::info!(epoch = run.sealed.last(), "sealing closed cleanly");
            }
            run.next_due.map_or(Next::Retry(IDLE), Next::At)
        }
        Ok(None) => Next::Retry(IDLE),
        Err(e) => {
            once(format!("sealing: {e} (retried)"), false);
            // Within the epoch: a held write lock passes, and the seal is
            // still on time.
            Next::Retry(Duration::from_millis(50))
        }
    }
}
