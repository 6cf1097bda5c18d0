//! The write operations, each run inside one [`Writer`] transaction. Each
//! that records an audit fact appends its event(s) in that same transaction;
//! the bookkeeping ones (`register_owner`, `add_flag`, `record_scan`,
//! `last_seen` bumps, `refresh_members`) append none.

use rusqlite::{OptionalExtension, params};
use serde_json::json;

use super::db::Writer;
use super::error::{Fail, LedgerError};
use super::event::{self as ev, Event};
use super::read;
use super::types::{
    AuthorizationId, Deferred, ExitRecord, IdentityRecord, KillTarget, MemberRecord, NewTree,
    OnBehalfRecord, OwnerId, OwnerKind, OwnerRecord, Requester, SignalRecord, SpawnRecord,
    SurvivorRecord, TokenScope, TreeFlag, TreeId, TreeState,
};

/// Clock ticks as SQLite stores them (an i64; ticks never come near its limit).
fn ticks(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

fn invariant(msg: impl Into<String>) -> Fail {
    LedgerError::Invariant(msg.into()).into()
}

fn current_state(w: &Writer<'_>, id: TreeId) -> Result<TreeState, Fail> {
    let state: Option<String> = w
        .row("SELECT state FROM trees WHERE id = ?1", [id.0], |r| {
            r.get(0)
        })
        .optional()?;
    let state = state.ok_or_else(|| LedgerError::NotFound(format!("tree {id}")))?;
    state
        .parse()
        .map_err(|e: String| LedgerError::Corrupt(e).into())
}

pub(crate) fn register_owner(w: &mut Writer<'_>, owner: &OwnerRecord) -> Result<OwnerId, Fail> {
    let id = &owner.identity;
    let existing: Option<i64> = w.row(
            "SELECT id FROM owners WHERE pid = ?1 AND start_ticks = ?2 AND boot_id = ?3 AND kind = ?4",
            params![id.pid, ticks(id.start_ticks), id.boot_id, owner.kind.as_str()],
            |r| r.get(0),
        )
        .optional()?;
    if let Some(existing) = existing {
        return Ok(OwnerId(existing));
    }
    w.exec(
        "INSERT INTO owners (pid, start_ticks, boot_id, kind, created_at) VALUES (?1, ?2, ?3, ?4, ?5)",
        params![id.pid, ticks(id.start_ticks), id.boot_id, owner.kind.as_str(), w.now],
    )?;
    Ok(OwnerId(w.tx.last_insert_rowid()))
}

pub(crate) fn create_tree(
    w: &mut Writer<'_>,
    tree: &NewTree,
    on_behalf: Option<&OnBehalfRecord>,
) -> Result<TreeId, Fail> {
    // Bounded evidence: a request's argv and label are kept up to
    // FIELD_MAX each, past it cut with their length and digest.
    let (argv_kept, argv_cut) = super::bound::argv(&tree.argv);
    let (label_kept, label_cut) = match tree.label.as_deref() {
        Some(l) => {
            let (t, c) = super::bound::text(l);
            (Some(t.into_owned()), c)
        }
        None => (None, None),
    };
    let argv = serde_json::to_string(&argv_kept)?;
    w.exec(
        "INSERT INTO trees (label, state, boundary, owner_id, argv, cwd, created_at, grace_ms, timeout_ms,
                            first_signal)
         VALUES (?1, 'spawning', ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
        params![
            label_kept,
            tree.boundary,
            tree.owner.0,
            argv,
            tree.cwd,
            w.now,
            tree.grace_ms.map(ticks),
            tree.timeout_ms.map(ticks),
            tree.first_signal
        ],
    )?;
    let id = TreeId(w.tx.last_insert_rowid());
    if let Some(b) = on_behalf {
        w.exec(
            "UPDATE trees SET requester_uid = ?2, requested_by = ?3, run_uid = ?4, run_gid = ?5
             WHERE id = ?1",
            params![
                id.0,
                b.requester.uid,
                serde_json::to_string(&b.requester)?,
                b.run_uid,
                b.run_gid
            ],
        )?;
    }
    let owner: (i32, i64, OwnerKind) = w.row(
        "SELECT pid, start_ticks, kind FROM owners WHERE id = ?1",
        [tree.owner.0],
        |r| Ok((r.get(0)?, r.get::<_, i64>(1)?, r.get(2)?)),
    )?;
    let data = ev::TreeCreated {
        label: label_kept,
        boundary: tree.boundary,
        owner: ev::CreatedOwner {
            id: tree.owner,
            pid: owner.0,
            start: owner.1,
            kind: owner.2,
        },
        argv: argv_kept.into_owned(),
        cwd: tree.cwd.clone(),
        grace_ms: tree.grace_ms,
        timeout_ms: tree.timeout_ms,
        limits: tree.limits,
        first_signal: tree.first_signal.clone(),
        by: on_behalf.map(|b| b.requester.clone()),
        run_uid: on_behalf.and_then(|b| b.run_uid),
        run_gid: on_behalf.and_then(|b| b.run_gid),
        // Only where something was cut: every other event keeps its shape.
        argv_truncated: argv_cut,
        label_truncated: label_cut,
    };
    w.event(Some(id), &Event::TreeCreated(Box::new(data)))?;
    Ok(id)
}

pub(crate) fn tree_spawned(
    w: &mut Writer<'_>,
    id: TreeId,
    spawn: &SpawnRecord,
) -> Result<(), Fail> {
    let from = current_state(w, id)?;
    if from != TreeState::Spawning {
        return Err(invariant(format!(
            "tree {id} is {from}, not spawning: its spawn cannot be recorded"
        )));
    }
    w.exec(
        "UPDATE trees SET state = 'running', root_pid = ?2, root_start_ticks = ?3, boot_id = ?4,
                pgid = ?5, sid = ?6, cgroup = ?7
         WHERE id = ?1",
        params![
            id.0,
            spawn.root.pid,
            ticks(spawn.root.start_ticks),
            spawn.root.boot_id,
            spawn.pgid,
            spawn.sid,
            spawn.cgroup
        ],
    )?;
    w.event(
        Some(id),
        &Event::TreeSpawned(ev::TreeSpawned {
            root: spawn.root.clone(),
            pgid: spawn.pgid,
            sid: spawn.sid,
            cgroup: spawn.cgroup.clone(),
        }),
    )?;
    Ok(())
}

pub(crate) fn tree_spawn_failed(
    w: &mut Writer<'_>,
    id: TreeId,
    reason: &str,
    exit_code: i32,
) -> Result<(), Fail> {
    let from = current_state(w, id)?;
    w.exec(
        "UPDATE trees SET state = 'spawn_failed', ended_at = ?2, exit_code = ?3, note = ?4 WHERE id = ?1",
        params![id.0, w.now, exit_code, reason],
    )?;
    w.event(
        Some(id),
        &Event::TreeSpawnFailed(ev::TreeSpawnFailed {
            from,
            reason: reason.to_string(),
            exit_code,
        }),
    )?;
    Ok(())
}

/// A member's record as the tree's evidence budget lets it be stored (see
/// `evidence.rs`), and what was cut: bounded to the field cap while the
/// tree's spent bytes plus this record's fit `budget` (spent, in the
/// `trees` row, in this transaction), else its argv by digest; the first
/// digest flags the tree and leaves its counter one past the budget, so
/// later members are digested without recounting.
fn spend<'m>(
    w: &mut Writer<'_>,
    id: TreeId,
    m: &'m MemberRecord,
    budget: u64,
) -> Result<
    (
        std::borrow::Cow<'m, MemberRecord>,
        Option<serde_json::Value>,
    ),
    Fail,
> {
    let (bounded, cut) = super::bound::member(m);
    let len = |s: &Option<String>| s.as_ref().map_or(0, String::len);
    let argv: usize = bounded.cmdline.iter().map(String::len).sum();
    // Stored twice: in the member's row and in its event.
    let cost = 2 * (argv + len(&bounded.exe) + len(&bounded.cwd)) as u64;
    let spent: i64 = w.row(
        "SELECT evidence_bytes FROM trees WHERE id = ?1",
        [id.0],
        |r| r.get(0),
    )?;
    let spent = u64::try_from(spent).unwrap_or(0);
    if spent.saturating_add(cost) <= budget {
        w.exec(
            "UPDATE trees SET evidence_bytes = evidence_bytes + ?2 WHERE id = ?1",
            params![id.0, i64::try_from(cost).unwrap_or(i64::MAX)],
        )?;
        return Ok((bounded, cut));
    }
    if spent <= budget {
        add_flag(w, id, &TreeFlag::EvidenceOverBudget)?;
        w.exec(
            "UPDATE trees SET evidence_bytes = ?2 WHERE id = ?1",
            params![
                id.0,
                i64::try_from(budget.saturating_add(1)).unwrap_or(i64::MAX)
            ],
        )?;
    }
    let (cmdline, cut) = super::bound::digested(&m.cmdline, budget);
    Ok((
        std::borrow::Cow::Owned(MemberRecord {
            cmdline,
            ..m.clone()
        }),
        Some(cut),
    ))
}

/// The `member.observed` payload of a record as stored, with what was cut.
fn member_seen(m: &MemberRecord, cut: Option<serde_json::Value>) -> ev::MemberSeen {
    ev::MemberSeen {
        identity: m.identity.clone(),
        ppid: m.ppid,
        pgid: m.pgid,
        sid: m.sid,
        cgroup: m.cgroup.clone(),
        uid: m.uid,
        exe: m.exe.clone(),
        cmdline: m.cmdline.clone(),
        cwd: m.cwd.clone(),
        cmdline_truncated: cut,
    }
}

/// Inserts the member row (as [`spend`] made it) if this identity is new
/// to the tree; returns whether it was.
fn insert_member(w: &Writer<'_>, id: TreeId, m: &MemberRecord) -> Result<bool, Fail> {
    let cmdline = serde_json::to_string(&m.cmdline)?;
    let inserted = w.exec(
        "INSERT INTO members (tree_id, pid, start_ticks, boot_id, ppid, pgid, sid, cgroup, uid, exe,
                              cmdline, cwd, first_seen, last_seen)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?13)
         ON CONFLICT (tree_id, pid, start_ticks, boot_id) DO NOTHING",
        params![
            id.0,
            m.identity.pid,
            ticks(m.identity.start_ticks),
            m.identity.boot_id,
            m.ppid,
            m.pgid,
            m.sid,
            m.cgroup,
            m.uid,
            m.exe,
            cmdline,
            m.cwd,
            w.now
        ],
    )?;
    Ok(inserted == 1)
}

/// Appends one observation row; returns whether it was new. Escapes and
/// exits are once per identity (unique indexes: a repeat inserts nothing);
/// survivor snapshots have no such index and always insert.
fn insert_observation(
    w: &Writer<'_>,
    id: TreeId,
    kind: &str,
    identity: &IdentityRecord,
    at: &str,
    detail: &serde_json::Value,
) -> Result<bool, Fail> {
    let inserted = w.exec(
        "INSERT INTO observations (tree_id, kind, pid, start_ticks, boot_id, at, detail)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)
         ON CONFLICT DO NOTHING",
        params![
            id.0,
            kind,
            identity.pid,
            ticks(identity.start_ticks),
            identity.boot_id,
            at,
            detail.to_string()
        ],
    )?;
    Ok(inserted == 1)
}

pub(crate) fn observe_members(
    w: &mut Writer<'_>,
    id: TreeId,
    members: &[MemberRecord],
    budget: u64,
) -> Result<Vec<IdentityRecord>, Fail> {
    current_state(w, id)?;
    let mut new = Vec::new();
    for m in members {
        // Most sightings on every tick are of known members: one UPDATE
        // finds them (an INSERT attempt first cost a second statement per
        // member per tick). Same outcome either way inside the write lock.
        let known = w.exec(
            "UPDATE members SET last_seen = ?5
             WHERE tree_id = ?1 AND pid = ?2 AND start_ticks = ?3 AND boot_id = ?4",
            params![
                id.0,
                m.identity.pid,
                ticks(m.identity.start_ticks),
                m.identity.boot_id,
                w.now
            ],
        )? == 1;
        if !known {
            // Not known under the write lock: the insert below makes it.
            let (stored, cut) = spend(w, id, m, budget)?;
            if insert_member(w, id, &stored)? {
                w.event(
                    Some(id),
                    &Event::MemberObserved(Box::new(member_seen(&stored, cut))),
                )?;
                new.push(m.identity.clone());
            }
        } else {
            // A sighting with details of a member already recorded (by the
            // observer at its fork, by an earlier owner): it may have exec'd
            // since.
            note_exec(w, id, m, budget)?;
        }
    }
    Ok(new)
}

pub(crate) fn record_escape(
    w: &mut Writer<'_>,
    id: TreeId,
    m: &MemberRecord,
    reason: &str,
    budget: u64,
) -> Result<bool, Fail> {
    current_state(w, id)?;
    // The row as first recorded: the escape keeps where the member was
    // (`before`) and where it went (`member`); the row shows where it is.
    let before: Option<(Option<i32>, Option<i32>)> = w
        .row(
            "SELECT pgid, sid FROM members
             WHERE tree_id = ?1 AND pid = ?2 AND start_ticks = ?3 AND boot_id = ?4",
            params![
                id.0,
                m.identity.pid,
                ticks(m.identity.start_ticks),
                m.identity.boot_id
            ],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .optional()?;
    let (stored, cut) = spend(w, id, m, budget)?;
    let escape = Event::EscapeObserved(Box::new(ev::EscapeObserved {
        member: member_seen(&stored, cut),
        reason: reason.to_string(),
        before: before.map(|(pgid, sid)| ev::EscapedFrom { pgid, sid }),
    }));
    let detail = escape.to_data()?;
    if !insert_observation(w, id, "escape", &m.identity, &w.now, &detail)? {
        return Ok(false);
    }
    insert_member(w, id, &stored)?;
    w.exec(
        "UPDATE members SET escaped_at = coalesce(escaped_at, ?5), last_seen = ?5,
                            ppid = ?6, pgid = ?7, sid = ?8
         WHERE tree_id = ?1 AND pid = ?2 AND start_ticks = ?3 AND boot_id = ?4",
        params![
            id.0,
            m.identity.pid,
            ticks(m.identity.start_ticks),
            m.identity.boot_id,
            w.now,
            m.ppid,
            m.pgid,
            m.sid
        ],
    )?;
    // An escape read with details may also show an exec since the row.
    note_exec(w, id, m, budget)?;
    w.event(Some(id), &escape)?;
    Ok(true)
}

pub(crate) fn record_exits(
    w: &mut Writer<'_>,
    id: TreeId,
    exits: &[(IdentityRecord, Option<ExitRecord>)],
    unknown_reaper: &str,
) -> Result<(), Fail> {
    current_state(w, id)?;
    for (identity, exit) in exits {
        let reaped_by = if exit.is_some() {
            "treewarden"
        } else {
            unknown_reaper
        };
        let exited = Event::MemberExited(ev::MemberExited {
            identity: identity.clone(),
            exit: *exit,
            reaped_by: reaped_by.to_string(),
        });
        let detail = exited.to_data()?;
        if !insert_observation(w, id, "exit", identity, &w.now, &detail)? {
            continue;
        }
        w.exec(
            "UPDATE members SET exited_at = ?5, exit_code = ?6, exit_signal = ?7
             WHERE tree_id = ?1 AND pid = ?2 AND start_ticks = ?3 AND boot_id = ?4",
            params![
                id.0,
                identity.pid,
                ticks(identity.start_ticks),
                identity.boot_id,
                w.now,
                exit.and_then(|e| e.code),
                exit.and_then(|e| e.signal)
            ],
        )?;
        w.event(Some(id), &exited)?;
    }
    Ok(())
}

/// Records the exit of every member of the tree not yet recorded as exited
/// (the teardown verified the tree empty); `statuses` attaches what the
/// reaper collected, by pid. Returns how many were recorded.
pub(crate) fn record_remaining_exits(
    w: &mut Writer<'_>,
    id: TreeId,
    statuses: &[(i32, ExitRecord)],
    unknown_reaper: &str,
) -> Result<usize, Fail> {
    let remaining: Vec<IdentityRecord> = {
        let mut stmt = w.tx.prepare_cached(
            "SELECT pid, start_ticks, boot_id FROM members WHERE tree_id = ?1 AND exited_at IS NULL",
        )?;
        let rows = stmt.query_map([id.0], |r| {
            Ok(IdentityRecord {
                pid: r.get(0)?,
                start_ticks: read::ticks(r, 1)?,
                boot_id: r.get(2)?,
            })
        })?;
        rows.collect::<Result<_, _>>()?
    };
    if remaining.is_empty() {
        return Ok(0);
    }
    let by_pid: std::collections::HashMap<i32, ExitRecord> = statuses.iter().copied().collect();
    let exits: Vec<(IdentityRecord, Option<ExitRecord>)> = remaining
        .into_iter()
        .map(|identity| {
            let exit = by_pid.get(&identity.pid).copied();
            (identity, exit)
        })
        .collect();
    record_exits(w, id, &exits, unknown_reaper)?;
    Ok(exits.len())
}

/// Several signal records in one transaction (one teardown step): the tree
/// is checked once, not once per signal.
pub(crate) fn record_signals(
    w: &mut Writer<'_>,
    id: TreeId,
    signals: &[SignalRecord],
) -> Result<(), Fail> {
    if signals.is_empty() {
        return Ok(());
    }
    current_state(w, id)?;
    for s in signals {
        insert_signal(w, id, s)?;
    }
    Ok(())
}

pub(crate) fn set_state(
    w: &mut Writer<'_>,
    id: TreeId,
    to: TreeState,
    reason: Option<&str>,
) -> Result<TreeState, Fail> {
    let from = current_state(w, id)?;
    if from == to {
        return Ok(from);
    }
    if from.is_terminal() {
        return Err(invariant(format!(
            "invariant: tree {id} is {from}, a terminal state; it cannot become {to}"
        )));
    }
    // An ambiguous tree keeps its reason on the row: the dispatch gate and
    // `ls` name it without reading the trail.
    if to == TreeState::Ambiguous {
        w.exec(
            "UPDATE trees SET state = ?2, note = coalesce(?3, note) WHERE id = ?1",
            params![id.0, to.as_str(), reason],
        )?;
    } else {
        w.exec(
            "UPDATE trees SET state = ?2 WHERE id = ?1",
            params![id.0, to.as_str()],
        )?;
    }
    w.event(
        Some(id),
        &Event::TreeState(ev::StateChanged {
            from,
            to,
            reason: reason.map(str::to_string),
        }),
    )?;
    Ok(from)
}

pub(crate) fn record_survivors(
    w: &mut Writer<'_>,
    id: TreeId,
    survivors: &[SurvivorRecord],
    taken_at: &str,
) -> Result<(), Fail> {
    current_state(w, id)?;
    if survivors.is_empty() {
        return Ok(());
    }
    // Bounded evidence: a survivor's command line past FIELD_MAX is cut
    // (copied only when one is that long).
    let cut: Vec<SurvivorRecord>;
    let survivors = if survivors
        .iter()
        .any(|s| super::bound::argv(&s.cmdline).1.is_some())
    {
        cut = survivors
            .iter()
            .map(|s| SurvivorRecord {
                cmdline: super::bound::argv(&s.cmdline).0.into_owned(),
                ..s.clone()
            })
            .collect();
        &cut[..]
    } else {
        survivors
    };
    for s in survivors {
        let detail = json!({"state": s.state, "rss_bytes": s.rss_bytes, "cmdline": s.cmdline});
        insert_observation(w, id, "survivor", &s.identity, taken_at, &detail)?;
    }
    w.event(
        Some(id),
        &Event::SurvivorsRecorded(ev::SurvivorsRecorded {
            survivors: survivors.to_vec(),
            taken_at: taken_at.to_string(),
        }),
    )?;
    Ok(())
}

pub(crate) fn authorize_kill(
    w: &mut Writer<'_>,
    id: TreeId,
    targets: &[KillTarget],
    reason: &str,
) -> Result<AuthorizationId, Fail> {
    current_state(w, id)?;
    if targets.is_empty() {
        return Err(invariant("a kill authorization must name its targets"));
    }
    let targets_json = serde_json::to_string(targets)?;
    w.exec(
        "INSERT INTO kill_authorizations (tree_id, reason, targets, at) VALUES (?1, ?2, ?3, ?4)",
        params![id.0, reason, targets_json, w.now],
    )?;
    let auth = AuthorizationId(w.tx.last_insert_rowid());
    w.event(
        Some(id),
        &Event::KillAuthorized(ev::KillAuthorized {
            authorization: auth,
            targets: targets.to_vec(),
            reason: reason.to_string(),
        }),
    )?;
    Ok(auth)
}

pub(crate) fn record_signal(w: &mut Writer<'_>, id: TreeId, s: &SignalRecord) -> Result<i64, Fail> {
    current_state(w, id)?;
    insert_signal(w, id, s)
}

/// The signal row and its `signal.sent` event, for a tree already checked.
fn insert_signal(w: &mut Writer<'_>, id: TreeId, s: &SignalRecord) -> Result<i64, Fail> {
    // No pre-check for SIGKILL authority here on purpose: the database
    // trigger is the one rule, and its refusal surfaces as `Invariant`.
    w.exec(
        "INSERT INTO signals (tree_id, signal, target_kind, target, result, authorization_id, at)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
        params![
            id.0,
            s.signal,
            s.target_kind,
            s.target,
            s.result,
            s.authorization,
            w.now
        ],
    )?;
    let signal_id = w.tx.last_insert_rowid();
    w.event(
        Some(id),
        &Event::SignalSent(ev::SignalSent {
            id: signal_id,
            signal: s.signal.clone(),
            target_kind: s.target_kind,
            target: s.target.clone(),
            result: s.result.clone(),
            authorization: s.authorization,
        }),
    )?;
    Ok(signal_id)
}

pub(crate) fn kill_skipped(w: &mut Writer<'_>, id: TreeId, reason: &str) -> Result<(), Fail> {
    current_state(w, id)?;
    w.event(
        Some(id),
        &Event::KillSkipped(ev::Reason {
            reason: reason.to_string(),
        }),
    )?;
    Ok(())
}

pub(crate) fn end_tree(
    w: &mut Writer<'_>,
    id: TreeId,
    state: TreeState,
    exit: Option<ExitRecord>,
    resources: Option<super::types::Resources>,
) -> Result<(), Fail> {
    if !matches!(state, TreeState::Ended | TreeState::Vanished) {
        return Err(invariant(format!(
            "a tree ends as ended or vanished, not {state}"
        )));
    }
    let from = current_state(w, id)?;
    if from.is_terminal() {
        return Err(invariant(format!(
            "invariant: tree {id} is already {from}; it cannot end again"
        )));
    }
    w.exec(
        "UPDATE trees SET state = ?2, ended_at = ?3, exit_code = ?4, exit_signal = ?5 WHERE id = ?1",
        params![
            id.0,
            state.as_str(),
            w.now,
            exit.and_then(|e| e.code),
            exit.and_then(|e| e.signal)
        ],
    )?;
    w.event(
        Some(id),
        &Event::TreeEnded(ev::TreeEnded {
            from,
            to: state,
            exit,
            resources,
        }),
    )?;
    Ok(())
}

/// `left_alive`: survivors an operator chose to leave running (`resolve
/// --force`), named in the event.
pub(crate) fn resolve(
    w: &mut Writer<'_>,
    id: TreeId,
    note: &str,
    left_alive: &[IdentityRecord],
    by: Option<&Requester>,
) -> Result<(), Fail> {
    let from = current_state(w, id)?;
    if from != TreeState::Ambiguous {
        return Err(invariant(format!(
            "invariant: tree {id} is {from}; only an ambiguous tree can be resolved"
        )));
    }
    w.exec(
        "UPDATE trees SET state = 'resolved', note = ?2, ended_at = coalesce(ended_at, ?3) WHERE id = ?1",
        params![id.0, note, w.now],
    )?;
    let forced = !left_alive.is_empty();
    w.event(
        Some(id),
        &Event::TreeResolved(ev::TreeResolved {
            note: note.to_string(),
            forced: forced.then_some(true),
            survivors_left: forced.then(|| left_alive.to_vec()),
            by: by.cloned(),
        }),
    )?;
    Ok(())
}

pub(crate) fn add_flag(w: &mut Writer<'_>, id: TreeId, flag: &TreeFlag) -> Result<bool, Fail> {
    current_state(w, id)?;
    let changed = w.exec(
        "UPDATE trees SET flags = json_insert(flags, '$[#]', ?2)
         WHERE id = ?1 AND NOT EXISTS (SELECT 1 FROM json_each(trees.flags) WHERE value = ?2)",
        params![id.0, flag],
    )?;
    Ok(changed == 1)
}

/// The tree's holds were capped: the flag [`TreeFlag::HoldsCapped`]
/// and, only when the flag is new, one `tree.holds_capped` event, in one
/// transaction. Whether it was new.
pub(crate) fn holds_capped(
    w: &mut Writer<'_>,
    id: TreeId,
    data: &super::event::HoldsCapped,
) -> Result<bool, Fail> {
    if !add_flag(w, id, &TreeFlag::HoldsCapped)? {
        return Ok(false);
    }
    w.event(Some(id), &Event::TreeHoldsCapped(data.clone()))?;
    Ok(true)
}

pub(crate) fn append_event(
    w: &mut Writer<'_>,
    tree: Option<TreeId>,
    event: &Event,
) -> Result<i64, Fail> {
    match event.kind() {
        Some(kind) if kind.is_free_standing() => {}
        Some(kind) => {
            return Err(invariant(format!(
                "{kind} is written by its typed ledger method, not append_event"
            )));
        }
        None => {
            return Err(invariant(
                "an event of a kind this build does not know is never written",
            ));
        }
    }
    if let Some(id) = tree {
        current_state(w, id)?;
    }
    w.event(tree, event)
}

pub(crate) fn record_scan(
    w: &mut Writer<'_>,
    tree: Option<TreeId>,
    duration: std::time::Duration,
    processes: usize,
    members: usize,
    escapes: usize,
) -> Result<(), Fail> {
    let micros = i64::try_from(duration.as_micros()).unwrap_or(i64::MAX);
    w.exec(
        "INSERT INTO scans (tree_id, at, duration_us, processes, members, escapes)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        params![
            tree.map(|t| t.0),
            w.now,
            micros,
            processes as i64,
            members as i64,
            escapes as i64
        ],
    )?;
    Ok(())
}

/// `last_seen` of each named live member set to now, every tree in this one
/// transaction (the service's full scan: one write for all its trees, not
/// one each). An identity that is no member row, or one already exited,
/// is left alone. Returns how many rows were bumped.
pub(crate) fn bump_last_seen(
    w: &mut Writer<'_>,
    seen: &[(TreeId, Vec<IdentityRecord>)],
) -> Result<usize, Fail> {
    let mut bumped = 0;
    for (id, members) in seen {
        for m in members {
            bumped += w.exec(
                "UPDATE members SET last_seen = ?5
                 WHERE tree_id = ?1 AND pid = ?2 AND start_ticks = ?3 AND boot_id = ?4
                   AND exited_at IS NULL",
                params![id.0, m.pid, ticks(m.start_ticks), m.boot_id, w.now],
            )?;
        }
    }
    Ok(bumped)
}

/// Members whose `comm` changed (an exec) since the watch last saw them:
/// each is compared with its row and, where it runs something new, the row
/// is updated and `member.exec` appended (see [`note_exec`]).
pub(crate) fn refresh_members(
    w: &mut Writer<'_>,
    id: TreeId,
    members: &[MemberRecord],
    budget: u64,
) -> Result<(), Fail> {
    for m in members {
        note_exec(w, id, m, budget)?;
    }
    Ok(())
}

/// If `m` (read with its details) runs another program than its row says,
/// the row takes the new exe and argv and a `member.exec` event keeps both.
/// A record without details (no exe and no argv: a sighting by stat alone,
/// or a process that exited before its details were read) says nothing.
fn note_exec(w: &mut Writer<'_>, id: TreeId, m: &MemberRecord, budget: u64) -> Result<(), Fail> {
    if m.exe.is_none() && m.cmdline.is_empty() {
        return Ok(());
    }
    // Compared and stored as bounded: a long command line is not a new
    // program on every tick.
    let whole = m;
    let (m, _) = super::bound::member(whole);
    let m = m.as_ref();
    let key = params![
        id.0,
        m.identity.pid,
        ticks(m.identity.start_ticks),
        m.identity.boot_id
    ];
    let row: Option<(Option<String>, Option<String>)> = w
        .row(
            "SELECT exe, cmdline FROM members
             WHERE tree_id = ?1 AND pid = ?2 AND start_ticks = ?3 AND boot_id = ?4",
            key,
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .optional()?;
    let Some((old_exe, old_cmdline)) = row else {
        return Ok(());
    };
    let old_argv: Vec<String> = old_cmdline
        .as_deref()
        .and_then(|c| serde_json::from_str(c).ok())
        .unwrap_or_default();
    if old_exe == m.exe && old_argv == m.cmdline {
        return Ok(());
    }
    // A new program: spent from the tree's budget (past it, by digest,
    // which a member already digested compares equal to on every tick).
    let (m, _) = spend(w, id, whole, budget)?;
    let m = m.as_ref();
    if old_exe == m.exe && old_argv == m.cmdline {
        return Ok(());
    }
    let cmdline = serde_json::to_string(&m.cmdline)?;
    w.exec(
        "UPDATE members SET exe = ?5, cmdline = ?6, last_seen = ?7
         WHERE tree_id = ?1 AND pid = ?2 AND start_ticks = ?3 AND boot_id = ?4",
        params![
            id.0,
            m.identity.pid,
            ticks(m.identity.start_ticks),
            m.identity.boot_id,
            m.exe,
            cmdline,
            w.now
        ],
    )?;
    w.event(
        Some(id),
        &Event::MemberExec(Box::new(ev::MemberExec {
            identity: m.identity.clone(),
            from: ev::Program {
                exe: old_exe,
                argv: old_argv,
            },
            to: ev::Program {
                exe: m.exe.clone(),
                argv: m.cmdline.clone(),
            },
        })),
    )?;
    Ok(())
}

/// Writes one deferred evidence write now (see [`Deferred`]).
pub(crate) fn apply_deferred(w: &mut Writer<'_>, id: TreeId, d: &Deferred) -> Result<(), Fail> {
    match d {
        Deferred::State { to, reason, .. } => {
            // A state the tree cannot take any more (it ended meanwhile) is
            // history, not an error: the later state stands.
            if !current_state(w, id)?.is_terminal() {
                set_state(w, id, *to, reason.as_deref())?;
            }
        }
        Deferred::Signals { signals, .. } => record_signals(w, id, signals)?,
        Deferred::KillSkipped { reason, .. } => kill_skipped(w, id, reason)?,
        Deferred::Flag { flag, .. } => {
            add_flag(w, id, flag)?;
        }
        Deferred::Survivors {
            survivors,
            taken_at,
        } => record_survivors(w, id, survivors, taken_at)?,
    }
    Ok(())
}

/// Writes deferred evidence in the order it happened, in one transaction;
/// each event carries `deferred_from` (when it happened).
pub(crate) fn replay_deferred(
    w: &mut Writer<'_>,
    id: TreeId,
    list: &[Deferred],
    batch: &str,
) -> Result<(), Fail> {
    let done: Option<i64> = w
        .row(
            "SELECT seq FROM events WHERE tree = ?1 AND json_extract(data, '$.deferred_batch') = ?2 LIMIT 1",
            params![id.0, batch],
            |r| r.get(0),
        )
        .optional()?;
    if done.is_some() {
        return Ok(()); // written before; its marker could not be rewritten then
    }
    for d in list {
        w.late = Some((d.at().to_string(), batch.to_string()));
        apply_deferred(w, id, d)?;
    }
    w.late = None;
    Ok(())
}

/// A token row (its hash only) and its `token.created` event.
pub(crate) fn create_token(
    w: &mut Writer<'_>,
    name: &str,
    scope: TokenScope,
    sha256: &str,
    by: &Requester,
) -> Result<i64, Fail> {
    w.exec(
        "INSERT INTO api_tokens (name, scope, sha256, created_at) VALUES (?1, ?2, ?3, ?4)",
        params![name, scope.as_str(), sha256, w.now],
    )?;
    let id = w.tx.last_insert_rowid();
    w.event(
        None,
        &Event::TokenCreated(ev::TokenCreated {
            token: id,
            name: name.to_string(),
            scope,
            by: by.clone(),
        }),
    )?;
    Ok(id)
}

/// The token file's secret as a token named `name` (admin): added once
/// (by its hash); any other live token of that name, a file since replaced,
/// is revoked in the same transaction. Returns the token's id.
pub(crate) fn import_token(
    w: &mut Writer<'_>,
    name: &str,
    sha256: &str,
    by: &Requester,
) -> Result<i64, Fail> {
    let existing: Option<(i64, Option<String>)> =
        w.tx.query_row(
            "SELECT id, revoked_at FROM api_tokens WHERE sha256 = ?1",
            [sha256],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .optional()?;
    let id = match existing {
        Some((id, _)) => id,
        None => create_token(w, name, TokenScope::Admin, sha256, by)?,
    };
    let stale: Vec<i64> = {
        let mut stmt = w.tx.prepare(
            "SELECT id FROM api_tokens WHERE name = ?1 AND id != ?2 AND revoked_at IS NULL",
        )?;
        let rows = stmt.query_map(params![name, id], |r| r.get(0))?;
        rows.collect::<Result<_, _>>()?
    };
    for old in stale {
        revoke_token(w, old, by)?;
    }
    Ok(id)
}

/// Revokes a token (once); `Ok(false)` when it was already revoked.
pub(crate) fn revoke_token(w: &mut Writer<'_>, id: i64, by: &Requester) -> Result<bool, Fail> {
    let revoked: Option<Option<String>> =
        w.tx.query_row(
            "SELECT revoked_at FROM api_tokens WHERE id = ?1",
            [id],
            |r| r.get(0),
        )
        .optional()?;
    match revoked {
        None => Err(LedgerError::NotFound(format!("token {id}")).into()),
        Some(Some(_)) => Ok(false),
        Some(None) => {
            w.exec(
                "UPDATE api_tokens SET revoked_at = ?2 WHERE id = ?1",
                params![id, w.now],
            )?;
            w.event(
                None,
                &Event::TokenRevoked(ev::TokenRevoked {
                    token: id,
                    by: by.clone(),
                }),
            )?;
            Ok(true)
        }
    }
}
