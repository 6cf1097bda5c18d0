//! Recovery at start-up (the background orphan sweep, its progress for
//! `/readyz` and the dashboard) and the periodic sweep loop.

use super::*;

impl Service {
    /// The start-up sweep: orphans of a previous instance (or of `run`
    /// processes that died) torn down concurrently, each with its recorded
    /// grace, while the service answers requests.
    pub(super) async fn recover(self: &Arc<Self>) {
        let t0 = Instant::now();
        if self.shutdown.is_cancelled() {
            // A signal before the recovery began: the next start does it.
            let mut r = self.recovery.lock().unwrap_or_else(|e| e.into_inner());
            r.running = false;
            r.error = Some("not started: the service is shutting down".into());
            return;
        }
        let engine = self.engine.clone();
        let opts = self.sweep_options();
        let result = blocking(move || engine.sweeper().sweep_with(&opts)).await;
        let error = match result {
            Ok(Ok(report)) => {
                let settled = report.orphans.iter().filter(|o| o.error.is_none()).count();
                tracing::info!(
                    examined = report.examined,
                    orphans = report.orphans.len(),
                    settled,
                    took_ms = t0.elapsed().as_millis() as u64,
                    "start-up recovery sweep done"
                );
                None
            }
            Ok(Err(e)) => Some(e.to_string()),
            Err(e) => Some(e.to_string()),
        };
        if let Some(e) = &error {
            tracing::error!(error = %e, "start-up recovery sweep failed; the periodic sweep retries");
        }
        let mut r = self.recovery.lock().unwrap_or_else(|e| e.into_inner());
        r.running = false;
        r.took = Some(t0.elapsed());
        r.error = error;
    }

    pub(super) async fn sweep_loop(self: Arc<Self>) {
        let mut every = tokio::time::interval(self.config.sweep_interval);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        every.tick().await; // the first tick is now; start-up already swept
        // Teardowns that failed closed (their authorization could not be
        // written) are finished soon after the ledger takes writes again,
        // not a whole sweep interval later: a cheap check every few seconds.
        let mut settle = tokio::time::interval(FAILED_CLOSED_CHECK);
        settle.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = self.shutdown.cancelled() => return,
                _ = every.tick() => {}
                _ = settle.tick() => {
                    let engine = self.engine.clone();
                    if let Err(e) = blocking(move || engine.sweeper().settle_failed_closed(8)).await {
                        tracing::error!(error = %e, "settle task failed");
                    }
                    continue;
                }
            }
            let engine = self.engine.clone();
            let opts = self.sweep_options();
            match blocking(move || engine.sweeper().sweep_with(&opts)).await {
                Ok(Ok(report)) if !report.orphans.is_empty() => {
                    tracing::info!(orphans = report.orphans.len(), "sweep tore orphans down");
                }
                Ok(Ok(_)) => {}
                Ok(Err(e)) => tracing::warn!(error = %e, "sweep failed"),
                Err(e) => tracing::error!(error = %e, "sweep task failed"),
            }
        }
    }
}
