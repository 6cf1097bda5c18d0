//! A member no signal ends: what the teardown records when a member
//! outlives every SIGKILL sent to it under a committed authorization (a
//! pid namespace's init that waits, in the kernel, for a zombie some
//! process outside the tree never reaps; a process in uninterruptible
//! sleep). Such a tree cannot settle while the member lives; the finding
//! makes that a typed fact with the kernel's evidence — never a reason to
//! signal anything else — and the tree's outcome (`unkillable` flag, its
//! ambiguous reason) says so. What it may close is its own principal's
//! dispatch only (see `custody::dispatch`).

use std::collections::HashSet;

use super::Teardown;
use crate::scan::Member;

impl Teardown<'_> {
    /// The members of `members` that outlived a SIGKILL sent under a
    /// committed authorization: each is recorded once per tree as a
    /// `member.unkillable` finding with the kernel's evidence (its state
    /// letter from the last read of `/proc/<pid>/stat`, its wait channel)
    /// and described for the tree's ambiguous reason. Best effort: the
    /// finding is evidence, and a ledger that refuses it leaves the reason.
    pub(super) fn record_unkillable(&mut self, members: &[Member]) -> Vec<String> {
        let recorded: HashSet<(i32, u64)> = self
            .engine
            .ledger
            .events(&crate::ledger::EventFilter {
                tree: Some(self.tree),
                kind_prefix: Some(crate::ledger::EventKind::MemberUnkillable.as_str().into()),
                ..Default::default()
            })
            .unwrap_or_default()
            .iter()
            .filter_map(|e| match e.event() {
                crate::ledger::Event::MemberUnkillable(u) => {
                    Some((u.identity.pid, u.identity.start_ticks))
                }
                _ => None,
            })
            .collect();
        let mut described = Vec::new();
        for m in members {
            let Some(&(kills, auth)) = self.killed.get(&m.entry.key()) else {
                continue;
            };
            let wchan = self.engine.host.wchan(m.entry.pid);
            described.push(format!(
                "pid {} (state {}{}, {kills} SIGKILLs)",
                m.entry.pid,
                m.entry.state,
                wchan
                    .as_deref()
                    .map(|w| format!(", wchan {w}"))
                    .unwrap_or_default()
            ));
            if recorded.contains(&(m.entry.pid, m.entry.start_ticks)) {
                continue;
            }
            tracing::error!(
                tree = self.tree.0,
                pid = m.entry.pid,
                state = %m.entry.state,
                wchan = wchan.as_deref().unwrap_or(""),
                kills,
                "a member outlived every SIGKILL sent under authorization: unkillable"
            );
            let finding =
                crate::ledger::Event::MemberUnkillable(crate::ledger::event::MemberUnkillable {
                    identity: self.watch.identity(m),
                    state: m.entry.state.to_string(),
                    wchan,
                    kills,
                    authorization: auth,
                });
            if let Err(e) = self.engine.ledger.append_event(Some(self.tree), finding) {
                tracing::warn!(tree = self.tree.0, error = %e, "member.unkillable not recorded");
            }
        }
        described
    }
}
