//! `serve --retain DURATION`: a background thread that prunes, every
//! `--retain-every`, the trees that ended more than DURATION ago (the same
//! [`Ledger::prune`] as `treewarden prune`, archive included when
//! `--retain-archive DIR` is given). It opens a ledger handle of its own, so
//! a prune never queues the service's custody writes behind its archive
//! writing; only its one delete transaction takes the write lock. A failed
//! prune is logged and retried at the next tick; it deletes nothing.
//! Off by default: without `--retain` nothing is ever pruned.

use std::path::PathBuf;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

use crate::ledger::{Ledger, PruneRequest, TreeId};

/// What `--retain` asks for.
#[derive(Clone, Debug)]
pub struct RetainConfig {
    pub data_dir: PathBuf,
    /// Trees ended longer ago than this are pruned.
    pub retain: Duration,
    /// How often to look.
    pub every: Duration,
    /// Where to write each prune's archive (`archive-<unix secs>.ndjson`).
    pub archive_dir: Option<PathBuf>,
}

/// The running retention thread; [`Retention::stop`] ends it (bounded by
/// the prune in progress, if any).
pub struct Retention {
    stop: mpsc::Sender<()>,
    thread: JoinHandle<()>,
}

impl Retention {
    pub fn start(ledger: Ledger, config: RetainConfig) -> std::io::Result<Retention> {
        let (stop, stopped) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("retention".into())
            .spawn(move || {
                loop {
                    match stopped.recv_timeout(config.every) {
                        Err(mpsc::RecvTimeoutError::Timeout) => {}
                        _ => return,
                    }
                    prune_once(&ledger, &config);
                }
            })?;
        Ok(Retention { stop, thread })
    }

    pub fn stop(self) {
        drop(self.stop);
        super::join(self.thread, "retention thread");
    }
}

fn prune_once(ledger: &Ledger, config: &RetainConfig) {
    let Some(before) = SystemTime::now().checked_sub(config.retain) else {
        return;
    };
    let archive = config.archive_dir.as_ref().map(|dir| {
        let secs = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        dir.join(format!("archive-{secs}.ndjson"))
    });
    let keep: Vec<TreeId> = crate::custody::markers::all(&config.data_dir)
        .into_iter()
        .map(|(tree, _)| tree)
        .collect();
    match ledger.prune(&PruneRequest {
        before,
        archive,
        keep,
    }) {
        Ok(report) if report.checkpoint.is_some() => {
            let logs = crate::custody::remove_logs(&config.data_dir, &report.pruned_trees);
            tracing::info!(
                events = report.events,
                trees = report.trees,
                logs,
                checkpoint = report.checkpoint,
                archive = ?report.archive,
                "retention: pruned"
            )
        }
        Ok(_) => tracing::debug!("retention: nothing to prune"),
        Err(e) => tracing::warn!("retention: prune failed, nothing deleted: {e}"),
    }
}
