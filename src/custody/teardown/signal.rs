//! The signal steps: whom a step reaches ([`Targets`]), the one `send`
//! that signals and records, the freeze and thaw, and the targets the kill
//! authorization names.

use std::collections::HashSet;
use std::time::Duration;

use super::super::CustodyError;
use super::super::watch::TreeWatch;
use super::Teardown;
use super::{Origin, Reach, Targets, TeardownOptions, now};
use crate::custody::Engine;
use crate::ledger::{
    AuthorizationId, Deferred, Event, IdentityRecord, KillTarget, SignalRecord, SignalResult,
    TargetKind, TreeId, event,
};
use crate::proc::{Delivery, GroupDelivery, Identity, Sig};
use crate::scan::Member;

impl Teardown<'_> {
    /// Builds the targets of one signal step from the live members.
    pub(super) fn targets(&self, members: &[Member], reach: Reach) -> Targets {
        let kill = reach == Reach::Kill;
        let cgroup = self.watch.cgroup();
        // The tick that classified `members` read `cgroup.procs` (frozen,
        // for a kill): the same set decides who the cgroup kill reaches.
        let cgroup_pids = if kill && cgroup.is_some() {
            self.watch.cgroup_pids().clone()
        } else {
            HashSet::new()
        };
        let mut loose = Vec::new();
        let mut in_group = 0;
        for m in members {
            if m.entry.pgid == self.group.pgid {
                // With a cgroup kill, only group members outside the cgroup
                // need the group signal.
                if !(kill && cgroup_pids.contains(&m.entry.pid)) {
                    in_group += 1;
                }
                continue;
            }
            if kill && cgroup_pids.contains(&m.entry.pid) {
                continue; // cgroup.kill reaches it
            }
            loose.push(Identity {
                pid: m.entry.pid,
                start_ticks: m.entry.start_ticks,
                boot_id: self.group.leader.boot_id.clone(),
            });
        }
        Targets {
            group: self.group.clone(),
            cgroup: if kill {
                cgroup.map(std::path::Path::to_path_buf)
            } else {
                None
            },
            group_pids: group_pids(members, self.group.pgid),
            loose,
            in_group,
            cgroup_pids,
        }
    }

    /// Sends `sig` to a step's targets and records each signal. Returns
    /// whether the group was provably the recorded one (or empty).
    pub(super) fn send(
        &mut self,
        step: &Targets,
        sig: Sig,
        authorization: Option<AuthorizationId>,
    ) -> Result<bool, CustodyError> {
        let mut group_ok = true;
        // The step's signal records, written in one transaction at the end.
        let mut records: Vec<SignalRecord> = Vec::new();
        let mut record = |signal: &str, kind: TargetKind, target: &str, result: &SignalResult| {
            records.push(SignalRecord {
                signal: signal.into(),
                target_kind: kind,
                target: target.to_string(),
                result: result.clone(),
                authorization,
            })
        };
        if let Some(dir) = step.cgroup.as_deref() {
            let result = match self.engine.host.container_kill(dir) {
                Ok(()) => SignalResult::Delivered,
                Err(e) => SignalResult::Failed(e.to_string()),
            };
            // SIGKILL on the cgroup; TERMINATE_JOB on a Windows job.
            let (signal, kind) = crate::proc::CONTAINER_KILL;
            record(signal, kind.into(), &dir.display().to_string(), &result);
        }
        if step.in_group > 0 || step.cgroup.is_none() {
            let result =
                match self
                    .engine
                    .host
                    .signal_group_known(&step.group, sig, &step.group_pids)
                {
                    Ok(GroupDelivery::Sent { members }) => SignalResult::ToMembers(members),
                    Ok(GroupDelivery::Empty) => SignalResult::GroupEmpty,
                    Ok(GroupDelivery::NotRecorded(why)) => {
                        group_ok = false;
                        if self.watch.degraded().is_none() {
                            refusal_event(self.engine, self.tree, self.opts, &why);
                        }
                        SignalResult::Refused(why)
                    }
                    Err(e) => SignalResult::Failed(e.to_string()),
                };
            if result.was_sent() || sig != Sig::Kill {
                record(
                    sig.name(),
                    TargetKind::Group,
                    &step.group.pgid.to_string(),
                    &result,
                );
            } else if step.cgroup.is_none() {
                // A SIGKILL that was not sent is recorded as skipped, not as a signal.
                let why = format!("group {}: {result}", step.group.pgid);
                let _ = self.watch.record(
                    &self.engine.ledger,
                    "kill skipped",
                    Deferred::KillSkipped {
                        reason: why,
                        at: now(),
                    },
                );
            }
        }
        for id in &step.loose {
            // Only through the handle held since the member was first
            // found loose (taken while it provably was the member, see
            // `TreeWatch::vet`): it reaches that process or none, whoever
            // lists with its identity now. A member not held (its hold
            // refused by the budget of held handles, or none could be had)
            // is signalled through a handle taken now, and only on the
            // witness a member known by its identity needs (its recorded
            // uid, read again through that handle); never by its pid.
            let deliver = |held: &super::super::Held| match self.engine.host.signal_held(held, sig)
            {
                Ok(Delivery::Sent) => SignalResult::Delivered,
                Ok(Delivery::Gone) => SignalResult::Gone,
                Ok(Delivery::Recycled) => SignalResult::Refused("pid recycled".into()),
                Err(e) => SignalResult::Failed(e.to_string()),
            };
            let result = match self.watch.held(&id.key()) {
                Some(held) => deliver(held),
                None => match self.watch.hold_to_signal(self.engine.host(), id) {
                    Ok(Some(held)) => deliver(&held),
                    Ok(None) => SignalResult::Refused(
                        "not held, and no handle now shows it the member (gone, recycled, or never read with its uid)".into(),
                    ),
                    Err(e) => SignalResult::Failed(format!("not held, and no handle now: {e}")),
                },
            };
            if result.was_sent() || sig != Sig::Kill {
                record(sig.name(), TargetKind::Pid, &id.pid.to_string(), &result);
            }
        }
        if !records.is_empty()
            && let Some(Err(e)) = self.watch.record(
                &self.engine.ledger,
                "signals",
                Deferred::Signals {
                    signals: records,
                    at: now(),
                },
            )
        {
            tracing::error!(
                tree = self.tree.0,
                signal = sig.name(),
                error = %e,
                "signals not recorded"
            );
        }
        Ok(group_ok)
    }

    /// Freezes what the next step will kill: the cgroup, or SIGSTOP to the
    /// group and the loose members.
    pub(super) fn freeze(&mut self, members: &[Member]) -> Result<(), String> {
        if let Some(dir) = self.watch.cgroup() {
            // From here on only the authorized kill may end the tree: a
            // standing kill still set would end it, unrecorded, when the
            // container's last handle closes (a `run` that exits 125).
            if let Err(e) = self.engine.host.disarm_standing_kill(dir) {
                return Err(format!(
                    "forced kill skipped: the container's standing kill could not be cleared ({e}); {} members not killed",
                    members.len()
                ));
            }
            if let Err(e) = self
                .engine
                .host
                .container_freeze(dir, Duration::from_secs(1))
            {
                tracing::warn!(tree = self.tree.0, error = %e, "cgroup freeze failed");
            }
            return Ok(());
        }
        self.group_step(members, Sig::Stop);
        Ok(())
    }

    /// On every error exit of a teardown: the container's standing kill is
    /// cleared (again), so the survivors the record calls alive are not
    /// killed behind its back when this process's exit closes the
    /// container (Windows' `KILL_ON_JOB_CLOSE`; nothing on Linux).
    pub(super) fn disarm_again(&self) {
        if let Some(dir) = self.watch.cgroup()
            && let Err(e) = self.engine.host.disarm_standing_kill(dir)
        {
            tracing::error!(tree = self.tree.0, error = %e, "standing kill not cleared on the teardown's error exit: the container's close may end its members");
        }
    }

    /// Undoes [`Teardown::freeze`]: thaws the cgroup, or SIGCONT to the group
    /// and the loose members.
    pub(super) fn thaw(&mut self, members: &[Member]) {
        if let Some(dir) = self.watch.cgroup() {
            if let Err(e) = self.engine.host.container_thaw(dir, Duration::from_secs(1)) {
                tracing::warn!(tree = self.tree.0, error = %e, "cgroup thaw failed");
            }
            return;
        }
        self.group_step(members, Sig::Cont);
    }

    /// SIGSTOP/SIGCONT are signals like the others: sent and recorded by
    /// the same step as SIGTERM (DESIGN: the ledger holds every signal).
    pub(super) fn group_step(&mut self, members: &[Member], sig: Sig) {
        let targets = self.targets(members, Reach::Signal);
        if let Err(e) = self.send(&targets, sig, None) {
            tracing::warn!(tree = self.tree.0, error = %e, signal = sig.name(), "freeze step failed");
        }
    }
}

/// The members in the recorded group, by pid and start (the group check's
/// candidates).
pub(super) fn group_pids(members: &[Member], pgid: i32) -> Vec<crate::proc::ProcKey> {
    members
        .iter()
        .filter(|m| m.entry.pgid == pgid)
        .map(|m| crate::proc::ProcKey::new(m.entry.pid, m.entry.start_ticks))
        .collect()
}

/// The authorization names every target with the identities it will reach.
pub(super) fn kill_targets(
    watch: &TreeWatch,
    step: &Targets,
    survivors: &[Member],
) -> Vec<KillTarget> {
    let ids = |filter: &dyn Fn(&Member) -> bool| -> Vec<IdentityRecord> {
        survivors
            .iter()
            .filter(|m| filter(m))
            .map(|m| watch.identity(m))
            .collect()
    };
    let mut targets = Vec::new();
    if let Some(dir) = step.cgroup.as_deref() {
        targets.push(KillTarget {
            // "cgroup" on Linux, "job" on Windows.
            kind: crate::proc::CONTAINER_KILL.1.into(),
            target: dir.display().to_string(),
            identities: ids(&|m| step.cgroup_pids.contains(&m.entry.pid)),
        });
    }
    if step.in_group > 0 || step.cgroup.is_none() {
        targets.push(KillTarget {
            kind: TargetKind::Group,
            target: step.group.pgid.to_string(),
            identities: ids(&|m| m.entry.pgid == step.group.pgid),
        });
    }
    for id in &step.loose {
        targets.push(KillTarget {
            kind: TargetKind::Pid,
            target: id.pid.to_string(),
            identities: vec![IdentityRecord {
                pid: id.pid,
                start_ticks: id.start_ticks,
                boot_id: id.boot_id.clone(),
            }],
        });
    }
    targets
}

/// Records a refused signal: `sweep.refused` for a sweep, else
/// `kill.skipped`.
pub(super) fn refusal_event(engine: &Engine, tree: TreeId, opts: &TeardownOptions, why: &str) {
    let result = if opts.origin == Origin::Sweep {
        let refused = Event::SweepRefused(event::Reason {
            reason: why.to_string(),
        });
        engine.ledger.append_event(Some(tree), refused)
    } else {
        engine.ledger.kill_skipped(tree, why).map(|_| 0)
    };
    if let Err(e) = result {
        tracing::warn!(tree = tree.0, error = %e, "refusal not recorded");
    }
}
