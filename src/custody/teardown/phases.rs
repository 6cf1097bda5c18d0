//! The phases: term, grace, the freeze round, snapshot, authorize, kill,
//! verify, and the two ends that are not a verified empty tree (fail
//! closed, survived). Each is a function from one [`State`] to the next.

use std::time::{Duration, Instant, SystemTime};

use super::super::CustodyError;
use super::Teardown;
use super::finish::{collect_exits, log_skipped};
use super::signal::kill_targets;
use super::{
    Authorize, FailClosed, Freeze, Grace, Kill, Phase, Progress, Reach, Snapshot, State, Verify,
    now,
};
use crate::ledger::{Deferred, IdentityRecord, SurvivorRecord, TreeState};
use crate::proc::{Identity, Sig};
use crate::scan::Member;

impl Teardown<'_> {
    /// TERM: one full walk (it finds members by descent: escapees in
    /// sessions of their own; later scans re-read what it and
    /// `cgroup.procs` name, until one verifying full walk at the end), then
    /// the first signal to every live member.
    pub(super) fn term(&mut self) -> Result<State, CustodyError> {
        let t0 = Instant::now();
        let _span = tracing::info_span!("teardown.phase", phase = "term").entered();
        // A tree proven empty without a walk (`run -- true` after its root
        // exited) is checked by a targeted tick, which still records the
        // exits of the members seen alive; anything it finds after all
        // gets the full walk.
        let proven = self.proven_empty();
        let mut members = if proven {
            self.watch.tick_targeted(self.engine, &self.exits).members
        } else {
            Vec::new()
        };
        if !proven || !members.is_empty() {
            members = self.full_walk()?;
        }
        self.report.members_at_start = members.len();
        if members.is_empty() {
            return Ok(match self.watch.recycled_leader(self.engine) {
                Some(why) => State::Refuse(why),
                None => State::Finish,
            });
        }
        let targets = self.targets(&members, Reach::Signal);
        let group_ok = self.send(&targets, self.opts.first_signal, None)?;
        self.report.phases.push((Phase::Term, t0.elapsed()));
        Ok(State::Grace(Grace { members, group_ok }))
    }

    /// Whether nothing of the tree can be alive, known without a walk of
    /// `/proc`: this process spawned the root and is the subreaper of the
    /// tree, it has no child at all (live or zombie), and the tree's cgroup,
    /// where it has one, reports `populated 0`. Every member is in the
    /// root's session or group (so descended from the root, which made
    /// both), in its cgroup, or descended from a member; a live descendant
    /// whose ancestors up to the root are dead has been re-parented to its
    /// nearest live subreaper ancestor, this process, so with no child here
    /// no descendant lives; and the one way into the tree that is not
    /// descent, a privileged write to `cgroup.procs`, shows in the cgroup.
    pub(super) fn proven_empty(&self) -> bool {
        self.proven_empty_after(1)
    }

    /// The verify's [`Self::proven_empty`]: the killed members are the
    /// reaper's to reap, so their zombies are given a moment to go
    /// before the `/proc` walk decides instead (the walk costs a
    /// sixth of a 10-process teardown; `run`, and the service's own trees
    /// when it has no other child, end without it).
    fn reaped_empty(&self) -> bool {
        self.proven_empty_after(REAP_TRIES)
    }

    /// [`Self::proven_empty`], asking the reaper up to `tries` times,
    /// [`REAP_PAUSE`] apart, while a child (a zombie not yet reaped, or any
    /// other) is left. No reaper, or the cgroup still populated: no proof.
    fn proven_empty_after(&self, tries: usize) -> bool {
        if !self.engine.reaped().was_spawned_here(self.watch.tree()) {
            return false;
        }
        for i in 0..tries {
            match self.engine.host.has_no_children() {
                Some(true) => {
                    return match self.watch.cgroup() {
                        Some(dir) => {
                            matches!(
                                self.engine
                                    .host
                                    .container_wait_empty(dir, self.engine.host.now()),
                                Ok(true)
                            )
                        }
                        None => true,
                    };
                }
                Some(false) if i + 1 < tries => self.engine.host.sleep(REAP_PAUSE),
                Some(false) | None => return false,
            }
        }
        false
    }

    /// GRACE: targeted re-reads until the members are gone or the grace is
    /// over (none at grace 0: the freeze's scan is the first chance
    /// anything had to exit; an extra scan costs a full walk).
    /// One full walk whose evidence is complete, tried a bounded number of
    /// times: a walk whose reads failed (out of descriptors, I/O) proves
    /// nothing gone, so no phase decides on one. Still incomplete after
    /// the tries: the teardown stops undecided, the tree left as it stands
    /// in the ledger (not ended), to be tried again by its caller.
    pub(super) fn full_walk(&mut self) -> Result<Vec<Member>, CustodyError> {
        let w0 = self.engine.host.now();
        let mut tries = 0;
        loop {
            let report = self.watch.tick_full(self.engine, &self.exits, false);
            let Some(reason) = report.incomplete else {
                return Ok(report.members);
            };
            tries += 1;
            if tries >= INCOMPLETE_TRIES {
                return Err(CustodyError::Incomplete {
                    tree: self.tree,
                    reason,
                });
            }
            self.engine.host.sleep(poll_interval(
                self.engine.host.now().saturating_duration_since(w0),
            ));
        }
    }

    pub(super) fn grace(&mut self, g: Grace) -> Result<State, CustodyError> {
        let t0 = Instant::now();
        let span = tracing::info_span!("teardown.phase", phase = "grace").entered();
        let Grace {
            mut members,
            group_ok,
        } = g;
        let g0 = self.engine.host.now();
        let deadline = g0 + self.opts.grace.duration();
        while !self.opts.grace.is_zero() {
            collect_exits(self.engine.host(), &mut self.exits);
            members = self.watch.tick_targeted(self.engine, &self.exits).members;
            let now = self.engine.host.now();
            if members.is_empty() || now >= deadline {
                break;
            }
            (self.progress)(&Progress {
                phase: Phase::Grace,
                alive: members.len(),
                grace_left: Some(deadline - now),
                elapsed: self.started.elapsed(),
            });
            self.engine.host.sleep(poll_interval(now - g0));
        }
        self.report.phases.push((Phase::Grace, t0.elapsed()));
        drop(span);
        if members.is_empty() {
            // Targeted polls found the known members gone: one full walk
            // says whether anything else of the tree is left.
            members = self.full_walk()?;
        }
        if members.is_empty() {
            return Ok(State::Finish);
        }
        if !group_ok
            && self.watch.cgroup().is_none()
            && members.iter().all(|m| m.entry.pgid == self.group.pgid)
        {
            // Nothing provably ours to signal: refuse, close as vanished.
            return Ok(State::Refuse(
                "process group is not provably the recorded one".into(),
            ));
        }
        Ok(State::Freeze(Freeze { round: 1, members }))
    }

    /// FREEZE (one round of the forced kill): freeze what the kill will
    /// reach and re-read the survivors. A round past the bound ends in
    /// [`State::Survived`].
    pub(super) fn freeze_round(&mut self, f: Freeze) -> State {
        let Freeze { round, members } = f;
        if round > self.opts.rounds.max(1) {
            return State::Survived(members);
        }
        let t0 = Instant::now();
        let span = tracing::info_span!("teardown.phase", phase = "freeze").entered();
        if let Err(why) = self.freeze(&members) {
            return State::Armed(members, why);
        }
        collect_exits(self.engine.host(), &mut self.exits);
        // A frozen cgroup forks nothing: its `cgroup.procs` and the known
        // members are all there is to re-read. Without a cgroup, a process
        // forked since the first walk and gone to a session of its own is
        // found only by descent: walk.
        let survivors = if self.watch.cgroup().is_some() {
            self.watch.tick_targeted(self.engine, &self.exits).members
        } else {
            self.watch
                .tick_full(self.engine, &self.exits, false)
                .members
        };
        let taken_at = SystemTime::now();
        self.report.phases.push((Phase::Freeze, t0.elapsed()));
        drop(span);
        if survivors.is_empty() {
            self.thaw(&members);
            // Only a full walk may end a teardown: the targeted re-read of
            // a frozen cgroup cannot see a member outside it.
            let rest = self
                .watch
                .tick_full(self.engine, &self.exits, false)
                .members;
            if rest.is_empty() {
                return State::Finish;
            }
            return State::Freeze(Freeze {
                round: round + 1,
                members: rest,
            });
        }
        (self.progress)(&Progress {
            phase: Phase::Authorize,
            alive: survivors.len(),
            grace_left: None,
            elapsed: self.started.elapsed(),
        });
        State::Snapshot(Snapshot {
            round,
            survivors,
            taken_at,
        })
    }

    /// SNAPSHOT: the frozen survivors as evidence (their command lines).
    pub(super) fn snapshot(&mut self, s: Snapshot) -> State {
        let t0 = Instant::now();
        let _span = tracing::info_span!("teardown.phase", phase = "snapshot").entered();
        let pids: Vec<i32> = s.survivors.iter().map(|m| m.entry.pid).collect();
        let argvs = self.engine.host.cmdlines(&pids);
        let forensic: Vec<SurvivorRecord> = s
            .survivors
            .iter()
            // (a host that answers for fewer pids leaves the rest empty:
            // their `comm` stands in, below; no survivor is dropped)
            .zip(argvs.into_iter().chain(std::iter::repeat_with(Vec::new)))
            .map(|(m, argv)| SurvivorRecord {
                identity: self.watch.identity(m),
                state: m.entry.state.to_string(),
                rss_bytes: m.entry.rss_bytes,
                cmdline: if argv.is_empty() {
                    vec![m.entry.comm.clone()]
                } else {
                    argv
                },
            })
            .collect();
        self.report.phases.push((Phase::Snapshot, t0.elapsed()));
        State::Authorize(Authorize {
            round: s.round,
            survivors: s.survivors,
            forensic,
            taken_at: s.taken_at,
        })
    }

    /// AUTHORIZE: the snapshot and `kill.authorized` naming every target,
    /// in one FULL transaction. Refused: [`State::FailClosed`].
    pub(super) fn authorize(&mut self, a: Authorize) -> State {
        let since = Instant::now();
        let _span = tracing::info_span!("teardown.phase", phase = "authorize").entered();
        let Authorize {
            round,
            survivors,
            forensic,
            taken_at,
        } = a;
        let targets = self.targets(&survivors, Reach::Kill);
        let named = kill_targets(&self.watch, &targets, &survivors);
        let reason = format!(
            "{} (round {round}: {} survivors after grace)",
            self.opts.reason,
            survivors.len()
        );
        // The first round's authorization also moves the tree to `killing`,
        // in its own transaction: no commit between it and the SIGKILL.
        crate::testhook::crash_point("before-authorize");
        let auth = match self.engine.ledger.authorize_kill_after_snapshot(
            self.tree,
            self.watch.journal(),
            &forensic,
            taken_at,
            &named,
            &reason,
            (round == 1).then_some(TreeState::Killing),
        ) {
            Ok(auth) => {
                // Committed (FULL); its SIGKILL not yet sent.
                crate::testhook::crash_point("after-authorize");
                auth
            }
            Err(e) => {
                return State::FailClosed(FailClosed {
                    survivors,
                    forensic,
                    taken_at,
                    error: e.to_string(),
                });
            }
        };
        self.report.authorizations += 1;
        // The ledger took the authorization, and with it the journal:
        // evidence is written directly again, in order.
        self.watch.ledger_writable_again();
        // Exits found from here on are written once the tree is verified
        // empty, in one transaction, not per scan while it dies.
        self.watch.defer_exits();
        self.report.phases.push((Phase::Authorize, since.elapsed()));
        State::Kill(Kill {
            round,
            survivors,
            targets,
            auth,
        })
    }

    /// KILL: SIGKILL to exactly the authorized targets.
    pub(super) fn kill(&mut self, k: Kill) -> Result<State, CustodyError> {
        let t0 = Instant::now();
        let _span = tracing::info_span!("teardown.phase", phase = "kill").entered();
        let Kill {
            round,
            survivors,
            targets,
            auth,
        } = k;
        self.send(&targets, Sig::Kill, Some(auth))?;
        self.report.force_killed += survivors.len();
        for m in &survivors {
            let sent = self.killed.entry(m.entry.key()).or_insert((0, auth));
            *sent = (sent.0 + 1, auth);
        }
        if let Some(dir) = self.watch.cgroup() {
            // Thaw: one write, not waited for (`cgroup.kill` ends frozen
            // tasks too, and the verify waits for `populated 0`); a member
            // the kill did not reach must not stay frozen.
            if let Err(e) = self.engine.host.container_thaw(dir, Duration::ZERO) {
                tracing::warn!(tree = self.tree.0, error = %e, "cgroup thaw failed");
            }
        }
        // On the session boundary SIGKILL ends stopped processes too: the
        // SIGCONT (a group check and a signal) is sent by the verify only
        // if members outlive the kill.
        self.report.phases.push((Phase::Kill, t0.elapsed()));
        Ok(State::Verify(Verify {
            round,
            survivors,
            targets,
        }))
    }

    /// VERIFY: the kernel's notifications first (`populated 0` of the
    /// cgroup; the survivors' pidfds: scanning `/proc` before that only
    /// finds the dying), then targeted re-reads and one full walk, which
    /// decide. Members left: the next round.
    pub(super) fn verify(&mut self, v: Verify) -> Result<State, CustodyError> {
        let t0 = Instant::now();
        let span = tracing::info_span!("teardown.phase", phase = "verify").entered();
        let Verify {
            round,
            survivors,
            targets,
        } = v;
        let v0 = self.engine.host.now();
        let deadline = v0 + self.opts.verify_timeout;
        if targets.cgroup.is_some() {
            self.wait_cgroup_empty(deadline);
        }
        let outside: Vec<Identity> = survivors
            .iter()
            .filter(|m| !targets.cgroup_pids.contains(&m.entry.pid))
            .map(|m| Identity {
                pid: m.entry.pid,
                start_ticks: m.entry.start_ticks,
                boot_id: self.group.leader.boot_id.clone(),
            })
            .collect();
        if !outside.is_empty()
            && let Err(e) = self.engine.host.wait_exits(&outside, deadline)
        {
            tracing::debug!(tree = self.tree.0, error = %e, "exit watches not opened");
        }
        let mut members;
        loop {
            collect_exits(self.engine.host(), &mut self.exits);
            // Re-read the known members until they are gone, then one full
            // walk verifies that nothing else of the tree lives.
            members = self.watch.tick_targeted(self.engine, &self.exits).members;
            if members.is_empty() && !self.reaped_empty() {
                members = self.full_walk()?;
            }
            let now = self.engine.host.now();
            if members.is_empty() || now >= deadline {
                break;
            }
            (self.progress)(&Progress {
                phase: Phase::Verify,
                alive: members.len(),
                grace_left: None,
                elapsed: self.started.elapsed(),
            });
            self.engine.host.sleep(poll_interval(now - v0));
        }
        self.report.phases.push((Phase::Verify, t0.elapsed()));
        drop(span);
        if members.is_empty() {
            return Ok(State::Finish);
        }
        if self.watch.cgroup().is_none() {
            // Members outlived the kill: none stays stopped.
            self.thaw(&members);
        }
        Ok(State::Freeze(Freeze {
            round: round + 1,
            members,
        }))
    }

    /// FAIL-CLOSED: the authorization was not committed. No SIGKILL; the
    /// survivors are thawed and left as evidence, the tree is ambiguous and
    /// dispatch closes. A kill we cannot prove we were authorized to send is
    /// worse than survivors we can still inspect.
    pub(super) fn fail_closed(&mut self, f: FailClosed) -> CustodyError {
        let tree = self.tree;
        let FailClosed {
            survivors,
            forensic,
            taken_at,
            error,
        } = f;
        self.engine.stats.authorization_failed();
        let why = format!(
            "forced kill skipped: its authority could not be written ({error}); {} survivors left alive as evidence",
            survivors.len()
        );
        let named: Vec<IdentityRecord> = survivors.iter().map(|m| self.watch.identity(m)).collect();
        // In memory at once; the thaw (a recorded SIGCONT on the session
        // boundary) and evidence writes after, each of which may wait out
        // the busy timeout.
        self.engine
            .ambiguity()
            .mark_ambiguous(tree, &why, &named, self.watch.journal());
        self.thaw(&survivors);
        if let Some(Err(e)) = self.watch.record(
            &self.engine.ledger,
            "survivor snapshot",
            Deferred::Survivors {
                survivors: forensic,
                taken_at: crate::ledger::timestamp(taken_at),
            },
        ) {
            tracing::warn!(tree = tree.0, error = %e, "survivor snapshot not recorded");
        }
        let _ = self.flush_deferred_exits();
        // The marker holds the ambiguity for good; these are attempted
        // unless the ledger already refused evidence, and kept in the
        // marker's journal if not written (the next process that finds the
        // ledger writable replays it).
        self.fail_closed_trail(&why, crate::ledger::TreeFlag::AuthorityWriteFailed);
        self.engine
            .ambiguity()
            .mark_ambiguous(tree, &why, &named, self.watch.journal());
        log_skipped(&self.watch);
        CustodyError::Ambiguous { tree, reason: why }
    }

    /// Members outlived every round: the tree is not provably gone.
    /// `armed`: why no forced kill was tried (the standing kill could not
    /// be cleared), flagged `disarm_failed` instead of `survivors`.
    pub(super) fn survived(&mut self, members: Vec<Member>, armed: Option<String>) -> CustodyError {
        let tree = self.tree;
        let flag = if armed.is_some() {
            crate::ledger::TreeFlag::DisarmFailed
        } else {
            crate::ledger::TreeFlag::Survivors
        };
        let unkillable = if armed.is_none() {
            self.record_unkillable(&members)
        } else {
            Vec::new()
        };
        let why = armed.unwrap_or_else(|| {
            let mut why = format!("{} members survived the forced kill", members.len());
            if !unkillable.is_empty() {
                why.push_str(&format!(
                    "; unkillable: {} (outlived every SIGKILL sent under authorization)",
                    unkillable.join(", ")
                ));
            }
            why
        });
        self.engine.stats.survivors(members.len());
        let named: Vec<IdentityRecord> = members.iter().map(|m| self.watch.identity(m)).collect();
        self.engine
            .ambiguity()
            .mark_ambiguous(tree, &why, &named, self.watch.journal());
        let _ = self.flush_deferred_exits();
        let _ = self.watch.record(
            &self.engine.ledger,
            "flag",
            Deferred::Flag { flag, at: now() },
        );
        if !unkillable.is_empty() {
            let _ = self.watch.record(
                &self.engine.ledger,
                "flag",
                Deferred::Flag {
                    flag: crate::ledger::TreeFlag::Unkillable,
                    at: now(),
                },
            );
        }
        if let Some(Err(e)) = self.watch.record(
            &self.engine.ledger,
            "state ambiguous",
            Deferred::State {
                to: TreeState::Ambiguous,
                reason: Some(why.clone()),
                at: now(),
            },
        ) {
            tracing::error!(tree = tree.0, error = %e, "ambiguous state not recorded");
        }
        self.engine
            .ambiguity()
            .mark_ambiguous(tree, &why, &named, self.watch.journal());
        log_skipped(&self.watch);
        CustodyError::Ambiguous { tree, reason: why }
    }

    /// Waits for the kernel's `populated 0` of the tree's cgroup, or
    /// `deadline`. Only a hint: the caller verifies by scan whatever this
    /// says.
    pub(super) fn wait_cgroup_empty(&self, deadline: Instant) {
        let Some(dir) = self.watch.cgroup() else {
            return;
        };
        if let Err(e) = self.engine.host.container_wait_empty(dir, deadline) {
            tracing::debug!(tree = self.watch.tree().0, error = %e, "cgroup.events not readable");
        }
    }
}

/// How many full walks a phase tries before it stops undecided on
/// incomplete evidence ([`Teardown::full_walk`]): reads that failed on
/// descriptors usually succeed once a connection or a pidfd is closed.
const INCOMPLETE_TRIES: u32 = 5;

/// How often, and how long apart, the verify asks whether the reaper has
/// reaped every child ([`Teardown::reaped_empty`]): one pause of 200 µs,
/// all a service with other live trees (always a child left) pays.
const REAP_TRIES: usize = 2;
const REAP_PAUSE: Duration = Duration::from_micros(200);

/// Polls fast at first (most trees die within milliseconds of their
/// signal), then backs off to keep a long grace cheap.
pub(super) fn poll_interval(elapsed: Duration) -> Duration {
    if elapsed < Duration::from_millis(50) {
        Duration::from_millis(2)
    } else if elapsed < Duration::from_secs(1) {
        Duration::from_millis(10)
    } else {
        Duration::from_millis(50)
    }
}
