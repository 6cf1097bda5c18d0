//! The dispatch gate: new work is refused while a tree in its scope is
//! unsettled. The scope ([`DispatchScope`]) is the tree's owner by default:
//! work is not launched *into an unclear tree* — for the same owner record,
//! or for API trees the same requester (socket uid, token) — while other
//! owners go on; `--dispatch-scope host` keeps the whole host closed.
//!
//! A tree is unsettled when it is `ambiguous` in the ledger, when this
//! process holds it ambiguous in memory, when an unsettled marker
//! (`<data-dir>/unsettled/tree-<id>`, see [`super::markers`]) names it — the
//! channel that closes dispatch across processes when the ledger refused to
//! record the ambiguity — or when its teardown was interrupted: state
//! `terminating`/`killing` and its owner gone. It stays unsettled until a
//! teardown completes with authority and verification (e.g. a sweep) or an
//! operator resolves it. A marker of a tree the ledger already holds as
//! ended is dropped by the gate once every survivor it names is gone.

use serde::Serialize;

use super::{CustodyError, Engine};
use crate::ledger::{Event, TreeRow, TreeState, event};

/// Whom an unsettled tree refuses new work to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DispatchScope {
    /// Its owner: the same owner record (pid, start time, boot), or for
    /// trees asked for through the API the same requester (the socket
    /// peer's uid, the token).
    #[default]
    Owner,
    /// Every owner on the host (the rule before issue 26).
    Host,
}

impl std::str::FromStr for DispatchScope {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "owner" => Ok(Self::Owner),
            "host" => Ok(Self::Host),
            other => Err(format!(
                "unknown dispatch scope {other:?}: expected owner or host"
            )),
        }
    }
}

/// One reason dispatch is closed.
#[derive(Clone, Debug, Serialize)]
pub struct Unsettled {
    pub tree: i64,
    pub reason: String,
}

impl Engine {
    /// Every unsettled tree, in id order. Reads only: works while another
    /// process holds the write lock.
    pub fn unsettled(&self) -> Result<Vec<Unsettled>, CustodyError> {
        let mut out = Vec::new();
        for (tree, reason) in self.ambiguous_in_memory() {
            let reason = if reason.is_empty() {
                "ambiguous teardown (not yet in the ledger)".to_string()
            } else {
                reason
            };
            // A marker left for a tree the ledger holds as ended (a teardown
            // that raced another) is stale once every survivor it names is
            // gone; while one lives, the tree is not settled.
            if let Some(row) = self.ledger.tree(crate::ledger::TreeId(tree))?
                && row.state.is_terminal()
            {
                let alive = self
                    .marked_survivors(tree)
                    .into_iter()
                    .filter(|id| super::alive_on(self.host(), id))
                    .count();
                if alive == 0 {
                    tracing::info!(
                        tree,
                        "stale unsettled marker of a {} tree removed",
                        row.state.as_str()
                    );
                    // Under the tree's lease (its deferred evidence is
                    // replayed first); a lease held elsewhere leaves it for
                    // that process.
                    if let Ok(Some(_lease)) = self.teardown_lease_within(
                        crate::ledger::TreeId(tree),
                        std::time::Duration::ZERO,
                    ) {
                        self.forget_ambiguous(tree);
                    }
                    continue;
                }
                out.push(Unsettled {
                    tree,
                    reason: format!("{reason} ({alive} survivors named by its marker still live)"),
                });
                continue;
            }
            out.push(Unsettled { tree, reason });
        }
        for row in self.ledger.unsettled_candidates()? {
            if out.iter().any(|u| u.tree == row.id) {
                continue;
            }
            match row.state {
                TreeState::Ambiguous => out.push(Unsettled {
                    tree: row.id,
                    reason: row
                        .note
                        .clone()
                        .unwrap_or_else(|| "ambiguous teardown".into()),
                }),
                TreeState::Terminating | TreeState::Killing if !self.owner_alive(&row) => {
                    out.push(Unsettled {
                        tree: row.id,
                        reason: format!(
                            "teardown interrupted in state {} and its owner is gone",
                            row.state.as_str()
                        ),
                    })
                }
                _ => {}
            }
        }
        out.sort_by_key(|u| u.tree);
        Ok(out)
    }

    /// Refuses with [`CustodyError::DispatchRefused`] naming the first
    /// unsettled tree on the host, and records the refusal (best effort: the
    /// refusal stands even when the ledger cannot take the event).
    pub fn check_dispatch(&self) -> Result<(), CustodyError> {
        self.refuse_if_any(self.unsettled()?)
    }

    /// The gate for one new tree: with [`DispatchScope::Owner`], only the
    /// unsettled trees of the same owner or requester refuse it; with
    /// [`DispatchScope::Host`], every one.
    pub fn check_dispatch_for(
        &self,
        owner: &crate::proc::Identity,
        requester: Option<&crate::ledger::Requester>,
    ) -> Result<(), CustodyError> {
        let mut unsettled = self.unsettled()?;
        if self.dispatch_scope == DispatchScope::Owner {
            unsettled.retain(|u| self.in_scope(u.tree, owner, requester));
        }
        self.refuse_if_any(unsettled)
    }

    /// Whether unsettled tree `tree` is the new work's own scope. A tree
    /// the ledger does not know (a marker the ledger never took) is in
    /// every scope: nothing says whose it is.
    fn in_scope(
        &self,
        tree: i64,
        owner: &crate::proc::Identity,
        requester: Option<&crate::ledger::Requester>,
    ) -> bool {
        let Ok(Some(row)) = self.ledger.tree(crate::ledger::TreeId(tree)) else {
            return true;
        };
        let same_owner = row.owner.pid == owner.pid
            && row.owner.start == owner.start_ticks
            && row.owner.boot_id == owner.boot_id;
        let same_requester = match (requester, row.requested_by.as_ref()) {
            (Some(new), Some(old)) if new.via == old.via => match new.via.as_str() {
                "tcp" => new.token_id.is_some() && new.token_id == old.token_id,
                "socket" => new.uid.is_some() && new.uid == old.uid,
                // A CLI wrapper is its own owner: its uid alone is not a scope.
                _ => false,
            },
            _ => false,
        };
        same_owner || same_requester
    }

    fn refuse_if_any(&self, unsettled: Vec<Unsettled>) -> Result<(), CustodyError> {
        let Some(first) = unsettled.first() else {
            return Ok(());
        };
        let refused = Event::DispatchRefused(event::DispatchRefused {
            tree: first.tree,
            reason: first.reason.clone(),
            unsettled: unsettled.len() as u64,
        });
        if let Err(e) = self.ledger.append_event(None, refused) {
            tracing::warn!(error = %e, "dispatch.refused not recorded");
        }
        Err(CustodyError::DispatchRefused {
            tree: first.tree,
            reason: first.reason.clone(),
        })
    }

    /// Whether a tree's owner still lives. An owner whose start time cannot
    /// be read counts as alive: a missed reap is recoverable, a wrong kill is
    /// not.
    pub(crate) fn owner_alive(&self, row: &TreeRow) -> bool {
        super::alive_on(self.host(), &row.owner_identity())
    }
}
