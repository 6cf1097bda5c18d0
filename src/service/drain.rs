//! The shutdown drain: every owned tree torn down concurrently within
//! `drain_timeout`, a live client owner's tree left for the next start.

use super::*;

impl Service {
    /// The shutdown drain: close the spawn gate, tear down every owned tree
    /// (graces capped), stop the loops. Returns whether every owned tree
    /// reached a terminal state within the bound.
    // Over 100 lines on purpose: the whole drain is one future under one bound (`drain_timeout`,
    // and its `deadline` for the loops): the gate closed, the owned trees torn down, the loops
    // waited on, the observer stopped; split, the bound would cover pieces instead of the drain.
    pub async fn drain(self: &Arc<Self>) -> bool {
        // Sweeps (recovery included) start no further teardown.
        self.sweep_stop.store(true, Ordering::SeqCst);
        let deadline = Instant::now() + self.config.drain_timeout;
        let work = async {
            *self.draining.write().await = true;
            // A client's tree whose owner process lives is not the
            // service's to end: it is left running (its owner still holds
            // it: its pipes, its work), and the next start adopts it and
            // watches its owner again. Only the trees the service owns
            // itself, and those of owners gone, are torn down, each with its
            // recorded grace, capped once by the policy inside the teardown.
            let mut left = Vec::new();
            let owned: Vec<TreeId> = self
                .lock_owned()
                .iter()
                .filter(|(id, o)| match &o.client_owner {
                    Some(owner) if self.engine.host().still_alive(owner) => {
                        left.push((**id, owner.pid));
                        false
                    }
                    _ => true,
                })
                .map(|(id, _)| *id)
                .collect();
            let cap = Some(self.config.shutdown_grace);
            left.sort_unstable();
            for (tree, owner) in &left {
                tracing::info!(
                    tree = tree.0,
                    owner,
                    "shutdown: left running (its owner process lives); the next start adopts it"
                );
            }
            tracing::info!(
                trees = owned.len(),
                left_running = left.len(),
                left = ?left.iter().map(|(t, _)| *t).collect::<Vec<_>>(),
                "shutdown: tearing down owned trees"
            );
            let mut set = tokio::task::JoinSet::new();
            for tree in owned {
                let this = self.clone();
                set.spawn(async move {
                    let r = this
                        .teardown(
                            tree,
                            None,
                            cap,
                            EndCause::Shutdown,
                            EndCause::Shutdown.reason(),
                        )
                        .await;
                    (tree, r)
                });
            }
            let mut all_ok = true;
            while let Some(joined) = set.join_next().await {
                match joined {
                    Ok((_, Ok(r))) if r.state.is_terminal() => {}
                    Ok((tree, Ok(r))) => {
                        all_ok = false;
                        tracing::error!(tree = tree.0, state = %r.state, "tree not settled at shutdown");
                    }
                    Ok((tree, Err(e))) => {
                        all_ok = false;
                        tracing::error!(tree = tree.0, error = %e, "teardown at shutdown failed");
                    }
                    Err(e) => {
                        all_ok = false;
                        tracing::error!(error = %e, "teardown task failed");
                    }
                }
            }
            self.tasks.close();
            // The loops end at once; a sweep's teardowns in flight finish
            // within the bound, or are handed off to the next start.
            let left = deadline.saturating_duration_since(Instant::now());
            if tokio::time::timeout(left, self.tasks.wait()).await.is_err() {
                let counts = self.sweeps.counts();
                tracing::warn!(
                    in_flight = counts.in_flight,
                    pending = counts.pending(),
                    "shutdown: orphan teardowns still running at the drain bound are handed off to the next start (their trees stay terminating in the ledger)"
                );
                return all_ok;
            }
            let counts = self.sweeps.counts();
            if counts.not_started > 0 {
                tracing::info!(
                    left = counts.not_started,
                    "shutdown: orphans not yet torn down are left to the next sweep"
                );
            }
            let observer = self
                .observer
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take();
            if let Some(o) = observer
                && let Ok(stats) = blocking(move || o.stop()).await
            {
                tracing::info!(
                    events = stats.events,
                    overflows = stats.overflows,
                    escapes = stats.escapes_recorded,
                    "observer stopped"
                );
            }
            all_ok
        };
        match tokio::time::timeout(self.config.drain_timeout, work).await {
            Ok(ok) => ok,
            Err(_) => {
                tracing::error!(
                    timeout = %humantime::format_duration(self.config.drain_timeout),
                    "shutdown drain timed out"
                );
                false
            }
        }
    }
}
