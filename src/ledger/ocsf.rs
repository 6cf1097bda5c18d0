//! `export --format ocsf`: the audit trail as OCSF 1.5.0 Process Activity
//! (class 1007, category System Activity), one JSON object per line, for
//! the SIEMs reviewers search in. It is a view, never evidence: nothing in
//! it is hashed, chained or sealed, and `verify --export` checks only the
//! NDJSON export. Each record names the event it came from (`metadata.uid`
//! `HOST:SEQ`, `metadata.sequence`, and `unmapped.treewarden.seq`/`hash`),
//! and the other events it read to fill it in (`sources`), so a reviewer
//! goes from any record to the chained, proven line behind it.
//!
//! The mapping (docs/REFERENCE.md "OCSF export" has the table):
//! `tree.created` is a Launch of the tree's root (its pid from the tree's
//! `tree.spawned`, a failure from `tree.spawn_failed`); `member.observed`
//! a Launch of a member; `member.exited`, `tree.ended`, `kill.authorized`
//! and every stopping `signal.sent` a Terminate; `member.exec`,
//! `escape.observed` and the freeze signals (SIGSTOP, SIGCONT) are Other
//! (99). The actor of a teardown's record is the principal behind it: the
//! tree's newest `kill.requested` before it, else the `tree.created`
//! requester, else the owner process; a `tree.ended` no signal came
//! before is the root's own end, and the root its actor. Events of every other kind are left
//! out and counted ([`OcsfCounts::skipped`]); they are not process activity.
//!
//! Memory: what each tree in the export needs to fill in its records
//! (argv, root pid, principals) is read once per tree and kept while the
//! export runs, so it grows with the trees an export touches, not with
//! its events.

use std::collections::HashMap;

use serde_json::{Map, Value, json};

use super::Ledger;
use super::error::LedgerError;
use super::event::{
    Event, KillAuthorized, MemberExec, MemberExited, MemberSeen, SignalSent, TreeCreated, TreeEnded,
};
use super::types::{
    EventFilter, EventKind, EventRow, EventSearch, IdentityRecord, Requester, SignalName,
    SignalResult, TreeId, TreeState,
};

/// The OCSF schema version every record names (`metadata.version`).
pub const OCSF_VERSION: &str = "1.5.0";

const CLASS_UID: u32 = 1007;
const CATEGORY_UID: u32 = 1;

/// What an OCSF export wrote and left out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OcsfCounts {
    /// Records written (one per mapped event).
    pub records: usize,
    /// Events the filter took whose kind is not process activity.
    pub skipped: usize,
}

/// Process Activity's activities (`activity_id`).
#[derive(Clone, Copy)]
enum Activity {
    Launch,
    Terminate,
    Other(&'static str),
}

impl Activity {
    fn id(self) -> u32 {
        match self {
            Activity::Launch => 1,
            Activity::Terminate => 2,
            Activity::Other(_) => 99,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Activity::Launch => "Launch",
            Activity::Terminate => "Terminate",
            Activity::Other(name) => name,
        }
    }
}

/// OCSF `severity_id` with its caption.
#[derive(Clone, Copy)]
enum Severity {
    Informational,
    Low,
    Medium,
}

impl Severity {
    fn id_and_name(self) -> (u32, &'static str) {
        match self {
            Severity::Informational => (1, "Informational"),
            Severity::Low => (2, "Low"),
            Severity::Medium => (3, "Medium"),
        }
    }
}

/// An event another record was filled in from: its seq and hash.
#[derive(Clone)]
struct Source {
    seq: i64,
    hash: String,
    kind: &'static str,
}

impl Source {
    fn of(row: &EventRow, kind: EventKind) -> Source {
        Source {
            seq: row.seq,
            hash: row.hash.clone(),
            kind: kind.as_str(),
        }
    }

    fn json(&self) -> Value {
        json!({ "seq": self.seq, "hash": self.hash, "kind": self.kind })
    }
}

/// What a tree's records borrow from its other events.
#[derive(Default)]
struct TreeContext {
    created: Option<(Source, TreeCreated)>,
    spawned: Option<(Source, IdentityRecord)>,
    spawn_failed: Option<(Source, String)>,
    /// Every `kill.requested`, in seq order.
    requests: Vec<(Source, Requester)>,
    /// The seq of the tree's first `signal.sent`: its teardown began.
    first_signal: Option<i64>,
}

impl TreeContext {
    /// The principal behind what the tree underwent at `seq`: the newest
    /// kill request before it, else the requester of the tree.
    fn principal(&self, seq: i64) -> Option<(&Source, &Requester)> {
        self.requests
            .iter()
            .rev()
            .find(|(s, _)| s.seq < seq)
            .map(|(s, r)| (s, r))
            .or_else(|| {
                self.created
                    .as_ref()
                    .and_then(|(s, c)| c.by.as_ref().map(|by| (s, by)))
            })
    }
}

/// Renders rows as OCSF lines; keeps each tree's context for the export.
pub(crate) struct Renderer<'a> {
    ledger: &'a Ledger,
    host: String,
    machine: Option<String>,
    trees: HashMap<i64, TreeContext>,
    pub(crate) counts: OcsfCounts,
}

impl<'a> Renderer<'a> {
    pub(crate) fn new(ledger: &'a Ledger) -> Renderer<'a> {
        Renderer {
            ledger,
            host: crate::proc::host_name(),
            machine: super::machine_id(),
            trees: HashMap::new(),
            counts: OcsfCounts::default(),
        }
    }

    /// One page of rows as OCSF lines (the rows of other kinds counted).
    pub(crate) fn page(&mut self, rows: &[EventRow]) -> Result<Vec<u8>, LedgerError> {
        let mut out = Vec::new();
        for row in rows {
            match self.record(row)? {
                Some(record) => {
                    serde_json::to_writer(&mut out, &record)
                        .map_err(|e| LedgerError::Other(format!("export: {e}")))?;
                    out.push(b'\n');
                    self.counts.records += 1;
                }
                None => self.counts.skipped += 1,
            }
        }
        Ok(out)
    }

    fn context(&mut self, tree: TreeId) -> Result<&TreeContext, LedgerError> {
        if !self.trees.contains_key(&tree.0) {
            let context = self.read_context(tree)?;
            self.trees.insert(tree.0, context);
        }
        Ok(&self.trees[&tree.0])
    }

    fn read_context(&self, tree: TreeId) -> Result<TreeContext, LedgerError> {
        let kinds = [
            EventKind::TreeCreated,
            EventKind::TreeSpawned,
            EventKind::TreeSpawnFailed,
            EventKind::KillRequested,
            EventKind::SignalSent,
        ];
        let rows = self.ledger.events(&EventFilter {
            tree: Some(tree),
            search: EventSearch {
                kinds: Some(kinds.iter().map(|k| k.as_str().to_string()).collect()),
                ..EventSearch::default()
            },
            ..EventFilter::default()
        })?;
        let mut context = TreeContext::default();
        for row in &rows {
            match row.event() {
                Event::TreeCreated(c) if context.created.is_none() => {
                    context.created = Some((Source::of(row, EventKind::TreeCreated), *c));
                }
                Event::TreeSpawned(s) if context.spawned.is_none() => {
                    context.spawned = Some((Source::of(row, EventKind::TreeSpawned), s.root));
                }
                Event::TreeSpawnFailed(f) if context.spawn_failed.is_none() => {
                    context.spawn_failed =
                        Some((Source::of(row, EventKind::TreeSpawnFailed), f.reason));
                }
                Event::KillRequested(k) => context
                    .requests
                    .push((Source::of(row, EventKind::KillRequested), k.by)),
                Event::SignalSent(_) if context.first_signal.is_none() => {
                    context.first_signal = Some(row.seq);
                }
                _ => {}
            }
        }
        Ok(context)
    }

    /// The record of one event, or `None` for a kind that is not process
    /// activity.
    fn record(&mut self, row: &EventRow) -> Result<Option<Value>, LedgerError> {
        let event = row.event();
        let mapped = match (&event, row.tree) {
            (Event::TreeCreated(c), Some(tree)) => {
                let context = self.context(tree)?;
                Some(launch_of_tree(row, c, context))
            }
            (Event::MemberObserved(m), _) => Some(launch_of_member(m)),
            (Event::MemberExited(m), _) => Some(member_exit(m)),
            (Event::MemberExec(m), _) => Some(member_exec(m)),
            (Event::EscapeObserved(e), _) => Some(Mapped {
                message: format!(
                    "member {} left the tree: {}",
                    e.member.identity.pid, e.reason
                ),
                severity: Severity::Medium,
                extra: json!({ "reason": e.reason, "before": e.before }),
                ..Mapped::new(
                    Activity::Other("Escape"),
                    member_process(&e.member),
                    json!({ "process": parent(&e.member) }),
                )
            }),
            (Event::SignalSent(s), Some(tree)) => {
                let context = self.context(tree)?;
                Some(signal(row, s, context))
            }
            (Event::KillAuthorized(k), Some(tree)) => {
                let context = self.context(tree)?;
                Some(kill_authorized(row, k, context))
            }
            (Event::TreeEnded(e), Some(tree)) => {
                let context = self.context(tree)?;
                Some(tree_ended(row, e, context))
            }
            _ => None,
        };
        match mapped {
            Some(m) => self.finish(row, m).map(Some),
            None => Ok(None),
        }
    }

    /// The fields every record has, around what its kind mapped.
    fn finish(&self, row: &EventRow, m: Mapped) -> Result<Value, LedgerError> {
        let time = humantime::parse_rfc3339(&row.at)
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .ok_or_else(|| {
                LedgerError::Invariant(format!("export: seq {}: time {:?}", row.seq, row.at))
            })?
            .as_millis() as u64;
        let (severity_id, severity) = m.severity.id_and_name();
        let mut treewarden = Map::new();
        treewarden.insert("seq".into(), row.seq.into());
        treewarden.insert("hash".into(), row.hash.clone().into());
        treewarden.insert("kind".into(), row.kind.as_str().into());
        treewarden.insert("tree".into(), row.tree.map(|t| t.0).into());
        if !m.sources.is_empty() {
            treewarden.insert(
                "sources".into(),
                m.sources.iter().map(Source::json).collect(),
            );
        }
        if let Value::Object(extra) = m.extra {
            treewarden.extend(extra);
        }
        let mut metadata = json!({
            "version": OCSF_VERSION,
            "product": {
                "name": "treewarden",
                "vendor_name": "treewarden",
                "version": env!("CARGO_PKG_VERSION"),
            },
            "uid": format!("{}:{}", self.host, row.seq),
            "sequence": row.seq,
            "event_code": row.kind.as_str(),
            "original_time": row.at,
            "log_name": "treewarden ledger",
        });
        if let Some(tree) = row.tree {
            metadata["correlation_uid"] = format!("{}:tree:{}", self.host, tree.0).into();
        }
        let mut device = json!({
            "type_id": 0,
            "type": "Unknown",
            "hostname": self.host,
        });
        if let Some(machine) = &self.machine {
            device["uid"] = machine.clone().into();
        }
        let mut record = json!({
            "activity_id": m.activity.id(),
            "activity_name": m.activity.name(),
            "category_uid": CATEGORY_UID,
            "category_name": "System Activity",
            "class_uid": CLASS_UID,
            "class_name": "Process Activity",
            "type_uid": CLASS_UID * 100 + m.activity.id(),
            "type_name": format!("Process Activity: {}", m.activity.name()),
            "severity_id": severity_id,
            "severity": severity,
            "time": time,
            "message": m.message,
            "metadata": metadata,
            "device": device,
            "process": m.process,
            "actor": m.actor,
            "unmapped": { "treewarden": treewarden },
        });
        if let Some(code) = m.exit_code {
            record["exit_code"] = code.into();
        }
        if let Some((id, status, detail)) = m.status {
            record["status_id"] = id.into();
            record["status"] = status.into();
            if let Some(detail) = detail {
                record["status_detail"] = detail.into();
            }
        }
        Ok(record)
    }
}

/// What one kind maps to, before the common fields.
struct Mapped {
    activity: Activity,
    severity: Severity,
    message: String,
    process: Value,
    actor: Value,
    exit_code: Option<i32>,
    /// `status_id`, its caption and `status_detail`.
    status: Option<(u32, &'static str, Option<String>)>,
    sources: Vec<Source>,
    /// Kept under `unmapped.treewarden` beside the origin.
    extra: Value,
}

impl Mapped {
    fn new(activity: Activity, process: Value, actor: Value) -> Mapped {
        Mapped {
            activity,
            severity: Severity::Informational,
            message: String::new(),
            process,
            actor,
            exit_code: None,
            status: None,
            sources: Vec::new(),
            extra: json!({}),
        }
    }
}

const SUCCESS: u32 = 1;
const FAILURE: u32 = 2;
const OTHER: u32 = 99;

/// A process's unique id across boots: `BOOT:PID:START_TICKS`.
fn process_uid(id: &IdentityRecord) -> String {
    format!("{}:{}:{}", id.boot_id, id.pid, id.start_ticks)
}

/// The last path segment of a program's name.
fn base_name(program: &str) -> &str {
    program.rsplit('/').next().unwrap_or(program)
}

/// An argv as one command line a shell would read back (POSIX quoting
/// where a word needs it).
fn cmd_line(argv: &[String]) -> String {
    let quote = |w: &String| -> String {
        let plain = !w.is_empty()
            && w.chars().all(|c| {
                c.is_ascii_alphanumeric()
                    || matches!(c, '_' | '@' | '%' | '+' | '=' | ':' | ',' | '.' | '/' | '-')
            });
        if plain {
            w.clone()
        } else {
            format!("'{}'", w.replace('\'', r"'\''"))
        }
    };
    argv.iter().map(quote).collect::<Vec<_>>().join(" ")
}

/// The tree's root as a process: its identity where it was spawned, its
/// program and user from `tree.created`.
fn root_process(context: &TreeContext) -> Value {
    let mut p = Map::new();
    if let Some((_, id)) = &context.spawned {
        p.insert("pid".into(), id.pid.into());
        p.insert("uid".into(), process_uid(id).into());
    }
    if let Some((_, c)) = &context.created {
        if let Some(first) = c.argv.first() {
            p.insert("name".into(), base_name(first).into());
        }
        p.insert("cmd_line".into(), cmd_line(&c.argv).into());
        if let Some(uid) = c.run_uid {
            p.insert("user".into(), json!({ "uid": uid.to_string() }));
        }
        if let Some(cwd) = &c.cwd {
            p.insert("working_directory".into(), cwd.clone().into());
        }
    }
    Value::Object(p)
}

/// The sources a root process was filled in from.
fn root_sources(context: &TreeContext) -> Vec<Source> {
    let mut sources = Vec::new();
    if let Some((s, _)) = &context.created {
        sources.push(s.clone());
    }
    if let Some((s, _)) = &context.spawned {
        sources.push(s.clone());
    }
    sources
}

/// A requester as an OCSF actor: the user (a uid, or an API token) and the
/// requesting process; the whole record stays under `unmapped`.
fn requester_actor(by: &Requester) -> Value {
    let mut user = Map::new();
    match (by.token_id, by.uid) {
        (Some(token), _) => {
            user.insert("uid".into(), format!("token:{token}").into());
            if let Some(name) = &by.token_name {
                user.insert("name".into(), name.clone().into());
            }
        }
        (None, Some(uid)) => {
            user.insert("uid".into(), uid.to_string().into());
            if let Some(login) = by.login_uid.filter(|l| Some(*l) != by.uid) {
                user.insert("uid_alt".into(), login.to_string().into());
            }
            if let Some(sudo) = &by.sudo_user {
                user.insert("name".into(), sudo.clone().into());
            }
        }
        (None, None) => {}
    }
    let mut actor = Map::new();
    if !user.is_empty() {
        actor.insert("user".into(), Value::Object(user));
    }
    if let Some(pid) = by.pid {
        actor.insert("process".into(), json!({ "pid": pid }));
    }
    actor.insert("app_name".into(), format!("treewarden {}", by.via).into());
    Value::Object(actor)
}

/// The actor behind a tree's teardown at `seq`, and the event naming it.
fn principal_actor(context: &TreeContext, seq: i64) -> (Value, Option<Source>, Value) {
    if let Some((source, by)) = context.principal(seq) {
        let by_json = serde_json::to_value(by).unwrap_or(Value::Null);
        return (requester_actor(by), Some(source.clone()), by_json);
    }
    match &context.created {
        Some((source, c)) => (
            json!({
                "process": { "pid": c.owner.pid },
                "app_name": format!("treewarden {}", serde_json::to_value(c.owner.kind)
                    .ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default()),
            }),
            Some(source.clone()),
            Value::Null,
        ),
        None => (json!({ "app_name": "treewarden" }), None, Value::Null),
    }
}

fn launch_of_tree(row: &EventRow, c: &TreeCreated, context: &TreeContext) -> Mapped {
    let (actor, _, by) = principal_actor(context, row.seq + 1);
    let mut sources = Vec::new();
    let status = match (&context.spawned, &context.spawn_failed) {
        (Some((s, _)), _) => {
            sources.push(s.clone());
            Some((SUCCESS, "Success", None))
        }
        (None, Some((s, reason))) => {
            sources.push(s.clone());
            Some((FAILURE, "Failure", Some(reason.clone())))
        }
        (None, None) => None,
    };
    let label = c
        .label
        .as_deref()
        .map(|l| format!(" ({l})"))
        .unwrap_or_default();
    let tree = row.tree.map_or(0, |t| t.0);
    Mapped {
        message: format!("tree {tree}{label} launched: {}", cmd_line(&c.argv)),
        status,
        sources,
        extra: json!({ "label": c.label, "by": by, "owner": c.owner }),
        ..Mapped::new(Activity::Launch, root_process(context), actor)
    }
}

/// A member as a process: identity, program, user, parent.
fn member_process(m: &MemberSeen) -> Value {
    let mut p = Map::new();
    p.insert("pid".into(), m.identity.pid.into());
    p.insert("uid".into(), process_uid(&m.identity).into());
    let name = m
        .exe
        .as_deref()
        .or(m.cmdline.first().map(String::as_str))
        .map(base_name);
    if let Some(name) = name {
        p.insert("name".into(), name.into());
    }
    if let Some(exe) = &m.exe {
        p.insert("path".into(), exe.clone().into());
    }
    p.insert("cmd_line".into(), cmd_line(&m.cmdline).into());
    if let Some(uid) = m.uid {
        p.insert("user".into(), json!({ "uid": uid.to_string() }));
    }
    if let Some(cwd) = &m.cwd {
        p.insert("working_directory".into(), cwd.clone().into());
    }
    p.insert("parent_process".into(), parent(m));
    Value::Object(p)
}

fn parent(m: &MemberSeen) -> Value {
    json!({ "pid": m.ppid })
}

fn launch_of_member(m: &MemberSeen) -> Mapped {
    Mapped {
        message: format!(
            "member {} observed: {}",
            m.identity.pid,
            cmd_line(&m.cmdline)
        ),
        ..Mapped::new(
            Activity::Launch,
            member_process(m),
            json!({ "process": parent(m) }),
        )
    }
}

fn identity_process(id: &IdentityRecord) -> Value {
    json!({ "pid": id.pid, "uid": process_uid(id) })
}

fn member_exit(m: &MemberExited) -> Mapped {
    let code = m.exit.as_ref().and_then(|e| e.code);
    let signal = m.exit.as_ref().and_then(|e| e.signal);
    let how = match (code, signal) {
        (Some(c), _) => format!("exited with {c}"),
        (None, Some(s)) => format!("killed by signal {s}"),
        (None, None) => "ended".into(),
    };
    Mapped {
        message: format!(
            "member {} {how} (reaped by {})",
            m.identity.pid, m.reaped_by
        ),
        exit_code: code,
        extra: json!({ "exit": m.exit, "reaped_by": m.reaped_by }),
        ..Mapped::new(
            Activity::Terminate,
            identity_process(&m.identity),
            json!({ "process": identity_process(&m.identity) }),
        )
    }
}

fn member_exec(m: &MemberExec) -> Mapped {
    let mut process = identity_process(&m.identity);
    process["cmd_line"] = cmd_line(&m.to.argv).into();
    if let Some(name) =
        m.to.exe
            .as_deref()
            .or(m.to.argv.first().map(String::as_str))
    {
        process["name"] = base_name(name).into();
    }
    if let Some(exe) = &m.to.exe {
        process["path"] = exe.clone().into();
    }
    Mapped {
        message: format!(
            "member {} ran a new program: {}",
            m.identity.pid,
            cmd_line(&m.to.argv)
        ),
        extra: json!({ "from": m.from }),
        ..Mapped::new(
            Activity::Other("Exec"),
            process,
            json!({ "process": identity_process(&m.identity) }),
        )
    }
}

/// The process a signal went to: the pid it names, else the tree's root
/// (a group's or cgroup's leader).
fn signal_target(s: &SignalSent, context: &TreeContext) -> Value {
    if s.target_kind.as_str() == "pid"
        && let Some(pid) = s
            .target
            .split(':')
            .next()
            .and_then(|p| p.parse::<i32>().ok())
    {
        return json!({ "pid": pid });
    }
    root_process(context)
}

fn signal(row: &EventRow, s: &SignalSent, context: &TreeContext) -> Mapped {
    let activity = match s.signal {
        SignalName::Sigstop | SignalName::Sigcont | SignalName::Suspend | SignalName::Resume => {
            Activity::Other("Signal")
        }
        _ => Activity::Terminate,
    };
    let (status, result) = match &s.result {
        SignalResult::Delivered => ((SUCCESS, "Success", None), "delivered".to_string()),
        SignalResult::ToMembers(n) => (
            (SUCCESS, "Success", None),
            format!("delivered to {n} members"),
        ),
        SignalResult::GroupEmpty => (
            (OTHER, "Other", Some("the group had no live member".into())),
            "nothing sent: the group was empty".into(),
        ),
        SignalResult::Gone => (
            (OTHER, "Other", Some("the process was already gone".into())),
            "nothing sent: already gone".into(),
        ),
        SignalResult::Refused(why) => (
            (FAILURE, "Failure", Some(format!("refused: {why}"))),
            format!("refused: {why}"),
        ),
        SignalResult::Failed(why) | SignalResult::Other(why) => (
            (FAILURE, "Failure", Some(why.clone())),
            format!("failed: {why}"),
        ),
    };
    let (actor, by_source, by) = principal_actor(context, row.seq);
    let mut sources = root_sources(context);
    sources.extend(by_source);
    let authorization = s
        .authorization
        .as_ref()
        .map(|a| format!(" under authorization {}", a.0))
        .unwrap_or_default();
    Mapped {
        severity: if s.signal.is_kill() {
            Severity::Low
        } else {
            Severity::Informational
        },
        message: format!(
            "{} to {} {}{authorization}: {result}",
            s.signal.as_str(),
            s.target_kind.as_str(),
            s.target
        ),
        status: Some(status),
        sources,
        extra: json!({
            "signal": s.signal.as_str(),
            "target_kind": s.target_kind.as_str(),
            "target": s.target,
            "authorization": s.authorization.as_ref().map(|a| a.0),
            "by": by,
        }),
        ..Mapped::new(activity, signal_target(s, context), actor)
    }
}

fn kill_authorized(row: &EventRow, k: &KillAuthorized, context: &TreeContext) -> Mapped {
    let (actor, by_source, by) = principal_actor(context, row.seq);
    let mut sources = root_sources(context);
    sources.extend(by_source);
    let pids: Vec<i32> = k
        .targets
        .iter()
        .flat_map(|t| t.identities.iter().map(|i| i.pid))
        .collect();
    Mapped {
        severity: Severity::Low,
        message: format!(
            "kill authorized (authorization {}) for {} processes: {}",
            k.authorization.0,
            pids.len(),
            k.reason
        ),
        sources,
        extra: json!({
            "authorization": k.authorization.0,
            "reason": k.reason,
            "targets": k.targets,
            "by": by,
        }),
        ..Mapped::new(Activity::Terminate, root_process(context), actor)
    }
}

fn tree_ended(row: &EventRow, e: &TreeEnded, context: &TreeContext) -> Mapped {
    // Signalled before it ended: a teardown ended it (a request, a
    // timeout, the owner's end), and its principal is the actor.
    let torn_down = context.first_signal.is_some_and(|s| s < row.seq);
    let code = e.exit.as_ref().and_then(|x| x.code);
    let signal = e.exit.as_ref().and_then(|x| x.signal);
    let mut sources = root_sources(context);
    let (actor, by) = if torn_down {
        let (actor, by_source, by) = principal_actor(context, row.seq);
        sources.extend(by_source);
        (actor, by)
    } else {
        // It ended on its own: the root is the actor.
        let root = root_process(context);
        let mut actor = json!({ "process": root });
        if let Some(user) = root.get("user") {
            actor["user"] = user.clone();
        }
        (actor, Value::Null)
    };
    let how = match (code, signal) {
        (Some(c), _) => format!("exited with {c}"),
        (None, Some(s)) => format!("killed by signal {s}"),
        (None, None) => "ended".into(),
    };
    let tree = row.tree.map_or(0, |t| t.0);
    Mapped {
        severity: if e.from == TreeState::Killing {
            Severity::Low
        } else {
            Severity::Informational
        },
        message: format!(
            "tree {tree} ended ({} -> {}): root {how}",
            e.from.as_str(),
            e.to.as_str()
        ),
        exit_code: code,
        sources,
        extra: json!({
            "from": e.from.as_str(),
            "to": e.to.as_str(),
            "exit": e.exit,
            "by": by,
        }),
        ..Mapped::new(Activity::Terminate, root_process(context), actor)
    }
}

impl Ledger {
    /// `export --format ocsf`: the events `filter` selects, up to the head
    /// when it starts, as OCSF lines page by page to `sink`.
    pub(crate) fn export_ocsf_with(
        &self,
        filter: &EventFilter,
        sink: &mut dyn FnMut(&[u8]) -> Result<(), LedgerError>,
    ) -> Result<OcsfCounts, LedgerError> {
        let head = self.head()?.map_or(0, |(seq, _)| seq);
        let mut renderer = Renderer::new(self);
        self.pages_to(filter, head, &mut |rows, _first| {
            let bytes = renderer.page(rows)?;
            if bytes.is_empty() {
                return Ok(());
            }
            sink(&bytes)
        })?;
        Ok(renderer.counts)
    }

    /// [`Ledger::export_ocsf_with`] to a writer.
    pub fn export_ocsf(
        &self,
        filter: &EventFilter,
        out: &mut dyn std::io::Write,
    ) -> Result<OcsfCounts, LedgerError> {
        let counts = self.export_ocsf_with(filter, &mut |b| super::export::write_all(b, out))?;
        out.flush()
            .map_err(|e| LedgerError::Other(format!("export: cannot write output: {e}")))?;
        Ok(counts)
    }
}

#[cfg(test)]
mod tests {
    use super::cmd_line;

    #[test]
    fn a_command_line_quotes_only_the_words_that_need_it() {
        let argv: Vec<String> = ["sh", "-c", "echo it's $HOME", "", "a=b,c/d"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(cmd_line(&argv), r#"sh -c 'echo it'\''s $HOME' '' a=b,c/d"#);
    }
}
