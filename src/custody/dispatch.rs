//! The dispatch gate: new work is refused while a tree in its scope is
//! unsettled. The scope ([`DispatchScope`]) is the tree's principal by
//! default: an API tree closes dispatch only for the principal that asked
//! for it (its token, or its uid on the socket), a `run` tree only for its
//! owner record, while every other principal goes on — one tenant's
//! unsettled tree (a member no signal ends, an authorization the ledger
//! refused) is never a lever on another's work. `--dispatch-scope host`
//! keeps the whole host closed. The gate never keys on the service's own
//! owner record, which every API tree spawned without `owner_pid` shares.
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
use crate::ledger::{Event, TreeId, TreeState, event};

/// Whom an unsettled tree refuses new work to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DispatchScope {
    /// Its principal: for trees asked for through the API the same
    /// requester (the socket peer's uid, the token), for the others the
    /// same owner record (pid, start time, boot).
    #[default]
    Owner,
    /// Every owner on the host: one unsettled tree refuses every spawn.
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
    pub tree: TreeId,
    pub reason: String,
}

/// The dispatch gate over the engine's ledger, markers and ambiguity.
pub struct Gate<'a> {
    engine: &'a Engine,
}

impl Engine {
    /// The dispatch gate ([`Gate`]): whether new work may start.
    pub fn gate(&self) -> Gate<'_> {
        Gate { engine: self }
    }
}

impl Gate<'_> {
    /// Every unsettled tree, in id order. Reads only: works while another
    /// process holds the write lock.
    pub fn unsettled(&self) -> Result<Vec<Unsettled>, CustodyError> {
        let mut out = Vec::new();
        for (tree, reason) in self.engine.ambiguity().ambiguous_in_memory() {
            let reason = if reason.is_empty() {
                "ambiguous teardown (not yet in the ledger)".to_string()
            } else {
                reason
            };
            // A marker left for a tree the ledger holds as ended (a teardown
            // that raced another) is stale once every survivor it names is
            // gone; while one lives, the tree is not settled.
            if let Some(row) = self.engine.ledger.tree(tree)?
                && row.state.is_terminal()
            {
                let alive = self
                    .engine
                    .ambiguity()
                    .marked_survivors(tree)
                    .into_iter()
                    .filter(|id| self.engine.host().still_alive(&id.into()))
                    .count();
                if alive == 0 {
                    tracing::info!(
                        tree = tree.0,
                        "stale unsettled marker of a {} tree removed",
                        row.state.as_str()
                    );
                    // Under the tree's lease (its deferred evidence is
                    // replayed first); a lease held elsewhere leaves it for
                    // that process.
                    if let Ok(Some(_lease)) = super::teardown::Lease::take_within(
                        &self.engine.data_dir,
                        tree,
                        std::time::Duration::ZERO,
                    ) {
                        self.engine.ambiguity().forget_ambiguous(tree);
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
        for row in self.engine.ledger.unsettled_candidates()? {
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
                TreeState::Terminating | TreeState::Killing
                    if !self
                        .engine
                        .host()
                        .still_alive(&(&row.owner_identity()).into()) =>
                {
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

    /// The newest of `unsettled` whose teardown left a member no signal
    /// ends (flagged `unkillable`, see `teardown::unkillable`): what the
    /// operator's alert names. `None`: none.
    pub fn newest_unkillable(&self, unsettled: &[Unsettled]) -> Option<TreeId> {
        unsettled
            .iter()
            .rev()
            .find(|u| {
                self.engine
                    .ledger
                    .tree(u.tree)
                    .ok()
                    .flatten()
                    .is_some_and(|row| row.has_flag(&crate::ledger::TreeFlag::Unkillable))
            })
            .map(|u| u.tree)
    }

    /// Refuses with [`CustodyError::DispatchRefused`] naming the first
    /// unsettled tree on the host, and records the refusal (best effort: the
    /// refusal stands even when the ledger cannot take the event).
    pub fn check_dispatch(&self) -> Result<(), CustodyError> {
        self.refuse_if_any(self.unsettled()?, None)
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
        if self.engine.dispatch_scope == DispatchScope::Owner {
            unsettled.retain(|u| self.in_scope(u.tree, owner, requester));
        }
        self.refuse_if_any(unsettled, requester)
    }

    /// Whether unsettled tree `tree` is the new work's own scope.
    ///
    /// An API tree's scope is the principal that asked for it (its token
    /// over TCP, its uid on the socket): only that principal's spawns are
    /// refused, whoever owns the new tree. Any other tree's scope is its
    /// owner record (a `run` wrapper, a client process), never the
    /// service's own record: every API tree spawned without `owner_pid` is
    /// owned by the service, and keying on it made one principal's tree
    /// close dispatch for every other. A tree the ledger does not know (a
    /// marker the ledger never took), or a service-owned tree that names
    /// no principal (recorded before requesters were), is in every scope:
    /// nothing says whose it is.
    fn in_scope(
        &self,
        tree: TreeId,
        owner: &crate::proc::Identity,
        requester: Option<&crate::ledger::Requester>,
    ) -> bool {
        let Ok(Some(row)) = self.engine.ledger.tree(tree) else {
            return true;
        };
        if let Some(by) = row.requested_by.as_ref().filter(|r| is_api(r)) {
            // A principal without a key (a TCP request without a token)
            // names no scope: it closes nobody's dispatch.
            return principal_key(by).is_some()
                && requester.and_then(principal_key) == principal_key(by);
        }
        if row.owner.kind == crate::ledger::OwnerKind::Service {
            return true;
        }
        row.owner.pid == owner.pid
            && row.owner.start == owner.start_ticks
            && row.owner.boot_id == owner.boot_id
    }

    /// Refuses naming the first of `unsettled`, if any, and records the
    /// refusal with who was refused (`by`: the principal, when known).
    fn refuse_if_any(
        &self,
        unsettled: Vec<Unsettled>,
        by: Option<&crate::ledger::Requester>,
    ) -> Result<(), CustodyError> {
        let Some(first) = unsettled.first() else {
            return Ok(());
        };
        let refused = Event::DispatchRefused(event::DispatchRefused {
            tree: first.tree,
            reason: first.reason.clone(),
            unsettled: unsettled.len() as u64,
            by: by.cloned(),
        });
        if let Err(e) = self.engine.ledger.append_event(None, refused) {
            tracing::warn!(error = %e, "dispatch.refused not recorded");
        }
        Err(CustodyError::DispatchRefused {
            tree: first.tree,
            reason: first.reason.clone(),
        })
    }
}

/// Whether a requester came through the API (the socket or TCP), where the
/// principal, not the owner record, is the scope.
fn is_api(r: &crate::ledger::Requester) -> bool {
    r.via == "socket" || r.via == "tcp"
}

/// A principal as the gate keys it: a token over TCP, a uid on the socket
/// (the same uid over the two faces is two principals). `None`: nothing
/// names one (no token, no uid, a CLI wrapper whose uid is no scope).
fn principal_key(r: &crate::ledger::Requester) -> Option<(bool, i64)> {
    match r.via.as_str() {
        "tcp" => r.token_id.map(|t| (true, t)),
        "socket" => r.uid.map(|u| (false, i64::from(u))),
        _ => None,
    }
}
