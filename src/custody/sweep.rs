//! The orphan sweep: every non-terminal tree whose owner is gone is torn
//! down with the same teardown and authority rules, resuming from the state
//! the ledger holds (an owner killed half-way through its teardown leaves
//! `terminating` or `killing`).
//!
//! An owner is gone when its pid is dead or now belongs to a process that
//! started later; an owner whose start time cannot be read counts as alive.

use std::time::Duration;

use serde::Serialize;

use super::teardown::{Origin, TeardownOptions};
use super::{CustodyError, Engine};
use crate::ledger::{EventKind, TreeId, TreeState};

/// What happened to one orphan.
#[derive(Clone, Debug, Serialize)]
pub struct SweepOutcome {
    pub tree: i64,
    pub from: TreeState,
    pub to: Option<TreeState>,
    pub error: Option<String>,
}

/// One sweep's findings.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SweepReport {
    /// Non-terminal trees looked at.
    pub examined: usize,
    /// Of those, trees whose owner is alive (left untouched).
    pub owned: usize,
    pub orphans: Vec<SweepOutcome>,
}

impl SweepReport {
    /// Whether every orphan reached a terminal state.
    pub fn settled(&self) -> bool {
        self.orphans.iter().all(|o| o.error.is_none())
    }
}

impl Engine {
    /// Runs one sweep now.
    pub fn sweep(&self, grace: Duration) -> Result<SweepReport, CustodyError> {
        self.sweep_skipping(grace, &std::collections::HashSet::new())
    }

    /// Runs one sweep, leaving alone the trees in `skip`: the service's own,
    /// whose owners it watches itself (so two teardowns never race).
    pub fn sweep_skipping(
        &self,
        grace: Duration,
        skip: &std::collections::HashSet<i64>,
    ) -> Result<SweepReport, CustodyError> {
        let _span = tracing::info_span!("sweep").entered();
        let trees = self.ledger.sweep_candidates()?;
        self.ledger.append_event(
            None,
            EventKind::SweepStarted,
            serde_json::json!({ "candidates": trees.len(), "pid": std::process::id() }),
        )?;
        let mut report = SweepReport {
            examined: trees.len(),
            ..SweepReport::default()
        };
        for row in trees {
            if skip.contains(&row.id) || self.owner_alive(&row) {
                report.owned += 1;
                continue;
            }
            let tree = TreeId(row.id);
            let found = serde_json::json!({
                "owner": { "pid": row.owner.pid, "start": row.owner.start },
                "state": row.state.as_str(),
            });
            if let Err(e) = self
                .ledger
                .append_event(Some(tree), EventKind::SweepOrphanFound, found)
            {
                report.orphans.push(SweepOutcome {
                    tree: row.id,
                    from: row.state,
                    to: None,
                    error: Some(e.to_string()),
                });
                continue;
            }
            let opts = TeardownOptions::new(grace, "owner gone (orphan sweep)", Origin::Sweep);
            let outcome = match self.teardown(tree, &opts, &mut |_| {}) {
                Ok(done) => SweepOutcome {
                    tree: row.id,
                    from: row.state,
                    to: Some(done.state),
                    error: None,
                },
                Err(e) => SweepOutcome {
                    tree: row.id,
                    from: row.state,
                    to: None,
                    error: Some(e.to_string()),
                },
            };
            report.orphans.push(outcome);
        }
        self.flush_ambiguous();
        if let Err(e) = self.remove_leftover_cgroups() {
            tracing::warn!(error = %e, "leftover cgroups not checked");
        }
        Ok(report)
    }
}
