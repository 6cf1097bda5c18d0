//! The operator dashboard: server-rendered askama pages, usable without
//! JavaScript; where a script runs, a live page follows the ledger's event
//! stream and reloads once something it shows changed (templates/live.html:
//! no timed refresh, which reloads under a reader and fails WCAG 2.2.1). Each view struct lives beside its
//! handler; the templates are in `templates/`.
//!
//! Pictures where people would rather look than read: each tree page draws
//! its teardown (TERM -> grace -> freeze -> authorize -> KILL -> verified) as an inline
//! SVG timeline built from the tree's own ledger events.

use std::time::{Duration, SystemTime};

use askama::Template;
use axum::extract::State;
use axum::response::Html;
use serde::Deserialize;

use super::AppState;
use super::api::parse_flag;
use super::error::{ApiError, ApiQuery, TreePath};
use crate::ledger::event::TeardownTimeline;
use crate::ledger::hierarchy::ProcessNode;
use crate::ledger::{
    BoundaryKind, EventFilter, EventRow, MemberRow, SignalRow, TreeFlag, TreeId, TreeRow, TreeState,
};
use crate::service::vocab::Unsettled;

use crate::ledger::outcome::{OutcomeFilter, OutcomeKind};
use crate::ledger::{PageAt, TreeFilter, parse_since};

/// Trees shown on the index page at most (newest first).
const MAX_TREES: usize = 100;
/// Events shown on the events page at most (newest).
const MAX_EVENTS: usize = 200;

fn render(t: &impl Template) -> Result<Html<String>, ApiError> {
    t.render()
        .map(Html)
        .map_err(|e| ApiError::Internal(format!("rendering a page: {e}")))
}

fn at(s: &str) -> Option<SystemTime> {
    humantime::parse_rfc3339_weak(s.trim_end_matches('Z')).ok()
}

/// How long a tree has lived: until now, or, once it ended, its lifetime.
fn age(created: &str, ended: Option<&str>) -> String {
    let Some(t) = at(created) else {
        return "-".into();
    };
    let until = ended.and_then(at).unwrap_or_else(SystemTime::now);
    let secs = until.duration_since(t).unwrap_or_default().as_secs();
    match secs {
        0..60 => format!("{secs}s"),
        60..3600 => format!("{}m {}s", secs / 60, secs % 60),
        3600..86400 => format!("{}h {}m", secs / 3600, (secs % 3600) / 60),
        _ => format!("{}d {}h", secs / 86400, (secs % 86400) / 3600),
    }
}

/// One row of the trees table.
pub struct TreeLine {
    pub id: TreeId,
    pub state: String,
    pub label: String,
    pub boundary: BoundaryKind,
    pub age: String,
    pub members: usize,
    pub escapes: usize,
    pub flags: String,
    pub command: String,
    /// Who it runs for: `run 4242`, `client 777`, `service 12`.
    pub owner: String,
    /// Whether that owner still runs (`None` for an ended tree, whose owner
    /// no longer matters).
    pub owner_alive: Option<bool>,
    /// What it consumed (ended: from `tree.ended`; live: from its cgroup).
    pub consumed: String,
    /// Its outcome's spelling (the CSS class and filter value).
    pub outcome: &'static str,
    /// Its outcome in a few words ("failed: exit 3 · 2 force-killed").
    pub outcome_text: String,
    /// Who ended it, where the outcome names someone.
    pub outcome_by: String,
}

impl TreeLine {
    /// The service's reading of one listed tree: its members with no exit
    /// recorded (every member seen, once it is over) and those seen escaped
    /// (exited or not), what it consumed
    /// where known, whether its owner lives.
    fn new(listed: &crate::service::ListedTree) -> Self {
        let t = &listed.tree;
        let counts = listed.members;
        TreeLine {
            owner: format!("{} {}", t.owner.kind, t.owner.pid),
            owner_alive: listed.owner_alive,
            consumed: listed
                .resources
                .as_ref()
                .map(|r| r.summary())
                .unwrap_or_default(),
            id: t.id,
            state: t.state.as_str().into(),
            label: t.label.clone().unwrap_or_default(),
            boundary: t.boundary,
            age: age(&t.created_at, t.ended_at.as_deref()),
            // Live members while the tree lives; once it is over, every
            // member it had (its live count is then 0 by definition).
            members: usize::try_from(if t.state.is_terminal() {
                counts.seen
            } else {
                counts.live
            })
            .unwrap_or(usize::MAX),
            escapes: usize::try_from(counts.escaped).unwrap_or(usize::MAX),
            flags: t
                .flags
                .iter()
                .map(|f| match f {
                    TreeFlag::RootExited if !t.state.is_terminal() => "root exited, members alive",
                    other => other.as_str(),
                })
                .collect::<Vec<_>>()
                .join(", "),
            command: t.argv.join(" "),
            outcome: listed.outcome.kind.as_str(),
            outcome_text: listed.outcome.summary(),
            outcome_by: listed.outcome.by.clone().unwrap_or_default(),
        }
    }
}

#[derive(Template)]
#[template(path = "index.html")]
pub struct IndexPage {
    pub trees: Vec<TreeLine>,
    pub all: bool,
    pub unsettled: Vec<Unsettled>,
    pub owned: usize,
    /// One line on the proc-connector observer's health (or why it is off).
    pub observer: String,
    /// One line on the start-up recovery (orphans pending), while it runs
    /// or when it found anything.
    pub recovery: Option<String>,
    /// Whether the start-up recovery sweep still runs.
    pub recovering: bool,
    /// Trees by state (every state with any), each a link to its filter.
    pub counts: Vec<(String, u64)>,
    /// The state and label filters as given (empty: none).
    pub state: String,
    pub label: String,
    pub since: String,
    pub until: String,
    /// The outcome filter as given (empty: none).
    pub outcome: String,
    /// Every outcome filter value, with its words, for the filter's menu.
    pub outcomes: Vec<(&'static str, &'static str)>,
    /// With an outcome filter that stopped reading: how many trees it read.
    pub examined: Option<usize>,
    /// The query of the next (older) page, when there is one.
    pub older: Option<String>,
    /// The query of the previous (newer) page, when there is one.
    pub newer: Option<String>,
    /// Whether the page refreshes itself (`?refresh=0` pauses it).
    pub refresh: bool,
    /// This page's query with the refresh toggled.
    pub toggle_refresh: String,
    /// The event stream a live page follows, and the kinds it reloads on.
    pub live_stream: String,
    pub live_kinds: String,
    /// This host's name.
    pub host: String,
}

/// Every event kind, space-separated: what a live page listens for (the
/// stream names each event by its kind).
fn live_kinds() -> String {
    crate::ledger::EventKind::ALL
        .iter()
        .map(|k| k.as_str())
        .collect::<Vec<_>>()
        .join(" ")
}

/// The recovery line of the index page: `None` once a recovery that found
/// nothing is over.
fn recovery_line(r: &crate::service::RecoveryStatus) -> Option<String> {
    let c = &r.counts;
    let unsettled = c.unsettled + c.not_started;
    let unsettled = if unsettled > 0 {
        format!(", {unsettled} left unsettled for the next sweep")
    } else {
        String::new()
    };
    if r.running {
        return Some(format!(
            "recovery running: {} orphans pending ({} being torn down now), {} of {} found torn down{unsettled}",
            c.pending(),
            c.in_flight,
            c.settled,
            c.found
        ));
    }
    if let Some(e) = &r.error {
        return Some(format!("recovery failed ({e}): the periodic sweep retries"));
    }
    if c.found == 0 {
        return None;
    }
    let took = r
        .took
        .map(|d| format!(" (start-up sweep took {:.1} s)", d.as_secs_f64()))
        .unwrap_or_default();
    Some(format!(
        "orphans found by this service's sweeps (start-up and periodic): {} pending, {} of {} found torn down{unsettled}{took}",
        c.pending(),
        c.settled,
        c.found
    ))
}

/// The observer line of the index page.
fn observer_line(status: Result<crate::service::vocab::ObserverStats, String>) -> String {
    match status {
        Ok(s) => {
            let latency = s
                .latency_quantile(0.5)
                .map(|d| format!(", detection p50 {:.1} ms", d.as_secs_f64() * 1e3))
                .unwrap_or_default();
            format!(
                "observer on: {} kernel events, {} forks attributed, {} escapes recorded at once, {} overflows ({} forced full scans){latency}",
                s.events, s.forks_attributed, s.escapes_recorded, s.overflows, s.forced_scans
            )
        }
        Err(why) => format!("observer off ({why}): escapes are found by scans only"),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IndexQuery {
    pub all: Option<String>,
    /// Only trees in this state.
    pub state: Option<String>,
    /// Only trees whose label contains this.
    pub label: Option<String>,
    /// Only trees created at or after this (`2h`, or an RFC 3339 time).
    pub since: Option<String>,
    /// Only trees created before this (`10m`, or an RFC 3339 time).
    pub until: Option<String>,
    /// Only trees with this outcome (`exited`, `timed_out`, … or `forced`).
    pub outcome: Option<String>,
    /// Keyset paging: the page of trees right below this id (older).
    pub before: Option<i64>,
    /// Keyset paging: the page of trees right above this id (newer).
    pub after: Option<i64>,
    /// `0` pauses the page's refresh.
    pub refresh: Option<String>,
}

/// The keyset bound of a page from `?before=` / `?after=` (not both).
fn page_at(before: Option<i64>, after: Option<i64>) -> Result<PageAt, ApiError> {
    match (before, after) {
        (None, None) => Ok(PageAt::Newest),
        (Some(b), None) => Ok(PageAt::Before(b)),
        (None, Some(a)) => Ok(PageAt::After(a)),
        (Some(_), Some(_)) => Err(ApiError::BadRequest(
            "give before or after, not both".into(),
        )),
    }
}

/// Which neighbour pages a keyset page links to, as the bound of each:
/// `(older, newer)`. `more` says whether a row lay beyond the page in the
/// direction it was read; the other direction has rows whenever the page
/// was reached from there (it has a bound). `first`/`last` are the page's
/// newest and oldest keys.
fn pager(
    at: PageAt,
    more: bool,
    first: Option<i64>,
    last: Option<i64>,
) -> (Option<i64>, Option<i64>) {
    let (older, newer) = match at {
        PageAt::Newest => (more, false),
        PageAt::Before(_) => (more, true),
        PageAt::After(_) => (true, more),
    };
    match (first, last) {
        (Some(first), Some(last)) => (older.then_some(last), newer.then_some(first)),
        // An empty page (its rows went, or a filter matched none beyond
        // the bound): link back to where it was reached from.
        _ => match at {
            PageAt::Newest => (None, None),
            PageAt::Before(b) => (None, Some(b - 1)),
            PageAt::After(a) => (Some(a + 1), None),
        },
    }
}

/// A query string from its non-empty parts (`?a=1&b=x`), URL-encoded.
fn query_string(parts: &[(&str, String)]) -> String {
    let enc = |s: &str| -> String {
        s.bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                    (b as char).to_string()
                }
                _ => format!("%{b:02X}"),
            })
            .collect()
    };
    let kept: Vec<String> = parts
        .iter()
        .filter(|(_, v)| !v.is_empty())
        .map(|(k, v)| format!("{k}={}", enc(v)))
        .collect();
    if kept.is_empty() {
        "?".into()
    } else {
        format!("?{}", kept.join("&"))
    }
}

/// `GET /`: the trees, with a banner while dispatch is closed.
// Over 100 lines on purpose: one page from one parsed query: the filter, one ledger read for the
// page and its counts, then the pager links, each built by the `base` closure over the same query
// strings the form shows again.
pub async fn index(
    State(s): State<AppState>,
    axum::Extension(principal): axum::Extension<super::auth::Principal>,
    ApiQuery(q): ApiQuery<IndexQuery>,
) -> Result<Html<String>, ApiError> {
    principal.must_see_all("the dashboard")?;
    let all = parse_flag("all", q.all.as_deref())?;
    let refresh = !matches!(q.refresh.as_deref(), Some("0"));
    let state_s = q.state.clone().unwrap_or_default();
    let label_s = q.label.clone().unwrap_or_default();
    let states: Option<Vec<TreeState>> = match state_s.trim() {
        "" if all => None,
        "" => Some(
            TreeState::ALL
                .into_iter()
                .filter(|s| !s.is_terminal())
                .collect(),
        ),
        st => Some(vec![st.parse::<TreeState>().map_err(ApiError::BadRequest)?]),
    };
    let label = Some(label_s.trim().to_string()).filter(|l| !l.is_empty());
    let since_s = q.since.clone().unwrap_or_default();
    let since = match since_s.trim() {
        "" => None,
        t => Some(parse_since(t).map_err(ApiError::BadRequest)?),
    };
    let until_s = q.until.clone().unwrap_or_default();
    let until = match until_s.trim() {
        "" => None,
        t => Some(parse_since(t).map_err(ApiError::BadRequest)?),
    };
    let outcome_s = q.outcome.clone().unwrap_or_default();
    let outcome = match outcome_s.trim() {
        "" => None,
        o => Some(o.parse::<OutcomeFilter>().map_err(ApiError::BadRequest)?),
    };
    // An outcome is what a tree ended as: asked for with no state, it
    // looks through every tree, not only the live ones.
    let states = if outcome.is_some() && state_s.trim().is_empty() {
        None
    } else {
        states
    };
    // The dashboard is for principals that see every tree (must_see_all).
    let filter = TreeFilter {
        states,
        label_contains: label,
        since,
        until,
        ..TreeFilter::default()
    };
    let at = page_at(q.before, q.after)?;
    let crate::service::TreeListView {
        trees,
        more,
        counts,
        unsettled,
        examined,
    } = s
        .service
        .door()
        .tree_list(filter, at, MAX_TREES, outcome)
        .await?;
    let lines: Vec<TreeLine> = trees.iter().map(TreeLine::new).collect();
    let base = |at: PageAt, refresh: bool| {
        let (before, after) = match at {
            PageAt::Newest => (String::new(), String::new()),
            PageAt::Before(id) => (id.to_string(), String::new()),
            PageAt::After(id) => (String::new(), id.to_string()),
        };
        query_string(&[
            ("all", if all { "1".into() } else { String::new() }),
            ("state", state_s.clone()),
            ("label", label_s.clone()),
            ("since", since_s.clone()),
            ("until", until_s.clone()),
            ("outcome", outcome_s.clone()),
            ("before", before),
            ("after", after),
            ("refresh", if refresh { String::new() } else { "0".into() }),
        ])
    };
    let (older, newer) = pager(
        at,
        more,
        lines.first().map(|t| t.id.0),
        lines.last().map(|t| t.id.0),
    );
    render(&IndexPage {
        older: older.map(|id| base(PageAt::Before(id), refresh)),
        newer: newer.map(|id| base(PageAt::After(id), refresh)),
        toggle_refresh: base(at, !refresh),
        refresh,
        live_stream: "/api/events/stream".into(),
        live_kinds: live_kinds(),
        host: s.service.door().host(),
        counts: counts
            .into_iter()
            .map(|(st, n)| (st.as_str().to_string(), n))
            .collect(),
        state: state_s.clone(),
        label: label_s.clone(),
        since: since_s.clone(),
        until: until_s.clone(),
        outcome: outcome_s.clone(),
        outcomes: OutcomeKind::ALL
            .into_iter()
            .map(|k| (k.as_str(), k.words()))
            .chain([("forced", "force-killed")])
            .collect(),
        examined,
        trees: lines,
        all,
        unsettled,
        owned: s.service.owned_trees().len(),
        observer: observer_line(s.service.observer_status()),
        recovery: recovery_line(&s.service.recovery()),
        recovering: s.service.recovery().running,
    })
}

/// One segment of the teardown picture.
pub struct Segment {
    pub name: &'static str,
    pub class: &'static str,
    pub x: u32,
    pub w: u32,
    pub ms: u64,
}

/// A labelled instant on the teardown picture.
pub struct Mark {
    pub label: &'static str,
    pub x: u32,
    pub ms: u64,
}

/// The teardown of one tree, from its events.
pub struct Timeline {
    pub segments: Vec<Segment>,
    pub marks: Vec<Mark>,
    pub total_ms: u64,
    pub summary: String,
}

const SVG_LEFT: f64 = 10.0;
const SVG_WIDTH: f64 = 580.0;

/// Draws the ledger's typed read of a teardown ([`TeardownTimeline`]):
/// TERM -> grace -> (freeze, authorize) -> KILL -> verified.
pub fn timeline(tl: &TeardownTimeline) -> Option<Timeline> {
    let t_term = at(&tl.term)?;
    let t_freeze = tl.freeze.as_deref().and_then(at);
    let t_auth = tl.authorized.as_deref().and_then(at);
    let t_kill = tl.kill.as_deref().and_then(at);
    let t_end = tl.end.as_deref().and_then(at);
    let ms = |a: SystemTime, b: SystemTime| {
        b.duration_since(a).unwrap_or(Duration::ZERO).as_millis() as u64
    };
    let last = t_end.or(t_kill).or(t_auth).or(t_freeze).unwrap_or(t_term);
    let total_ms = ms(t_term, last).max(1);
    let x_of = |t: SystemTime| {
        (SVG_LEFT + SVG_WIDTH * ms(t_term, t) as f64 / total_ms as f64).round() as u32
    };
    let mut segments = Vec::new();
    let mut push = |name, class, a: SystemTime, b: Option<SystemTime>| {
        if let Some(b) = b {
            let (x, x2) = (x_of(a), x_of(b));
            segments.push(Segment {
                name,
                class,
                x,
                w: x2.saturating_sub(x).max(3),
                ms: ms(a, b),
            });
        }
    };
    let grace_end = t_freeze.or(t_auth).or(t_end);
    push("TERM + grace", "grace", t_term, grace_end);
    if let Some(f) = t_freeze {
        push("freeze + snapshot", "freeze", f, t_auth);
    }
    if let Some(a) = t_auth {
        push("authorized -> KILL", "auth", a, t_kill.or(t_end));
    }
    if let Some(k) = t_kill {
        push("verify", "verify", k, t_end);
    }
    let mut marks = vec![Mark {
        label: "TERM",
        x: x_of(t_term),
        ms: 0,
    }];
    // The end is "verified" only where the tree was found empty: an
    // ambiguous one was not (its kill skipped or refused, or processes left).
    let end_label = match tl.end_state {
        Some(TreeState::Ambiguous) if t_kill.is_none() => "kill skipped: ambiguous",
        Some(TreeState::Ambiguous) => "not verified: ambiguous",
        _ => "verified",
    };
    for (label, t) in [("authorized", t_auth), ("KILL", t_kill), (end_label, t_end)] {
        if let Some(t) = t {
            marks.push(Mark {
                label,
                x: x_of(t),
                ms: ms(t_term, t),
            });
        }
    }
    let mut summary = segments
        .iter()
        .map(|s| format!("{} {} ms", s.name, s.ms))
        .collect::<Vec<_>>()
        .join(" → ");
    if tl.end_state == Some(TreeState::Ambiguous) {
        summary.push_str(&format!(" → {end_label}"));
    }
    Some(Timeline {
        segments,
        marks,
        total_ms,
        summary,
    })
}

/// One member in the tree page's process tree, in depth-first order, with
/// what the nested list around it needs: `<li>` opens it, `<ul>` its
/// children when it has some, and `closes` lists end after it.
pub struct ProcessItem {
    pub pid: i32,
    pub name: String,
    pub command: String,
    pub marks: Vec<String>,
    pub escaped: bool,
    pub force_killed: bool,
    pub has_children: bool,
    pub closes: usize,
}

/// The hierarchy ([`crate::ledger::hierarchy`]) flattened for the template
/// (askama has no recursion): nesting is rebuilt from `has_children` and
/// `closes`.
/// `survivors`: the tree's teardown is over or gave up (ambiguous), so a
/// member with no exit recorded is marked as one that may still run.
pub fn process_items(forest: &[ProcessNode], survivors: bool) -> Vec<ProcessItem> {
    // Iterative, depth first: each node is entered (its item pushed) and,
    // once its children are done, left (the item then last closes its
    // `<ul>`).
    enum Step<'a> {
        Enter(&'a ProcessNode),
        Leave,
    }
    let mut out = Vec::new();
    let mut stack: Vec<Step<'_>> = forest.iter().rev().map(Step::Enter).collect();
    while let Some(step) = stack.pop() {
        match step {
            Step::Enter(n) => {
                out.push(ProcessItem {
                    pid: n.pid,
                    name: n.name(),
                    command: n.cmdline.join(" "),
                    marks: {
                        let mut marks = n.marks();
                        if survivors && !n.exited {
                            marks.push("alive at the last look".into());
                        }
                        marks
                    },
                    escaped: n.escaped,
                    force_killed: n.force_killed,
                    has_children: !n.children.is_empty(),
                    closes: 0,
                });
                if !n.children.is_empty() {
                    stack.push(Step::Leave);
                    stack.extend(n.children.iter().rev().map(Step::Enter));
                }
            }
            Step::Leave => {
                if let Some(last) = out.last_mut() {
                    last.closes += 1;
                }
            }
        }
    }
    out
}

#[derive(Template)]
#[template(path = "tree.html")]
pub struct TreePage {
    /// The members as a process tree (parent -> child by first-seen ppid).
    pub processes: Vec<ProcessItem>,
    pub tree: TreeRow,
    pub members: Vec<MemberRow>,
    pub escapes: Vec<MemberRow>,
    /// Signals and authorizations in one list, in time order.
    pub authority: Vec<AuthorityLine>,
    pub timeline: Option<Timeline>,
    pub live: bool,
    /// The event stream a live page follows, and the kinds it reloads on.
    pub live_stream: String,
    pub live_kinds: String,
    /// This host's name.
    pub host: String,
    pub command: String,
    /// The last lines of its captured output (API trees), when it has any.
    pub output: Option<String>,
    /// The first line: outcome, actor, time and counts.
    pub verdict: String,
    /// The outcome's spelling (its colour).
    pub outcome: &'static str,
    /// The tree's events as the events page reads them.
    pub event_lines: Vec<EventLine>,
}

/// One row of the events page: the event and a line a person reads.
pub struct EventLine {
    pub seq: i64,
    pub at: String,
    pub tree: Option<TreeId>,
    pub kind: String,
    pub summary: String,
    pub data: String,
    pub hash: String,
}

impl EventLine {
    /// The line the events page and the tree page show for `e`.
    pub fn of(e: &EventRow) -> EventLine {
        EventLine {
            seq: e.seq,
            at: e.at.clone(),
            tree: e.tree,
            kind: e.kind.to_string(),
            summary: e.sentence(),
            data: e.data.to_string(),
            hash: e.hash.chars().take(12).collect(),
        }
    }
}

/// One row of the tree page's signals-and-authorizations table.
pub struct AuthorityLine {
    pub at: String,
    /// `kill authorized #N`, or the signal's name.
    pub what: String,
    pub target: String,
    pub result: String,
    /// `committed`, `#N` (the authorization a SIGKILL used), or `-`.
    pub authority: String,
    pub authorization: bool,
}

/// Signals and authorizations merged in time order (an authorization
/// before the SIGKILL it allowed when both carry the same millisecond).
fn authority_lines(
    signals: &[SignalRow],
    auths: &[crate::ledger::AuthorizationRow],
) -> Vec<AuthorityLine> {
    let mut v: Vec<(String, u8, AuthorityLine)> = Vec::new();
    for a in auths {
        let pids: Vec<String> = a
            .targets
            .iter()
            .flat_map(|t| t.identities.iter().map(|i| i.pid.to_string()))
            .collect();
        v.push((
            a.at.clone(),
            0,
            AuthorityLine {
                at: a.at.clone(),
                what: format!("kill authorized #{}", a.id),
                target: format!("{} identities: pid {}", pids.len(), pids.join(" ")),
                result: a.reason.clone(),
                authority: "committed".into(),
                authorization: true,
            },
        ));
    }
    for s in signals {
        v.push((
            s.at.clone(),
            1,
            AuthorityLine {
                at: s.at.clone(),
                what: s.signal.to_string(),
                target: format!("{} {}", s.target_kind, s.target),
                result: s.result.to_string(),
                authority: s
                    .authorization
                    .map(|a| format!("#{a}"))
                    .unwrap_or_else(|| "-".into()),
                authorization: false,
            },
        ));
    }
    v.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
    v.into_iter().map(|(_, _, line)| line).collect()
}

/// Lines of captured output the tree page shows.
const OUTPUT_LINES: usize = 50;

/// `GET /trees/{id}`.
pub async fn tree(
    State(s): State<AppState>,
    axum::Extension(principal): axum::Extension<super::auth::Principal>,
    TreePath(id): TreePath,
) -> Result<Html<String>, ApiError> {
    principal.must_see_all("the dashboard")?;
    let crate::service::TreePanelView {
        detail: d,
        output,
        teardown,
        hierarchy,
        outcome,
    } = s
        .service
        .door()
        .tree_panel(id, OUTPUT_LINES)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("unknown tree {id}")))?;
    let survivors = d.tree.state == TreeState::Ambiguous;
    let processes = process_items(&hierarchy, survivors);
    let timeline = teardown.as_ref().and_then(timeline);
    let verdict = outcome.verdict(&d.tree, &d.members);
    render(&TreePage {
        verdict,
        outcome: outcome.kind.as_str(),
        event_lines: d.events.iter().map(EventLine::of).collect(),
        processes,
        output,
        live: !d.tree.state.is_terminal(),
        live_stream: format!(
            "/api/events/stream?tree={}&after={}",
            d.tree.id,
            d.events.last().map_or(0, |e| e.seq)
        ),
        live_kinds: live_kinds(),
        host: s.service.door().host(),
        command: d.tree.argv.join(" "),
        escapes: d
            .members
            .iter()
            .filter(|m| m.escaped_at.is_some())
            .cloned()
            .collect(),
        authority: authority_lines(&d.signals, &d.authorizations),
        tree: d.tree,
        members: d.members,
        timeline,
    })
}

#[derive(Template)]
#[template(path = "events.html")]
pub struct EventsPage {
    pub events: Vec<EventLine>,
    /// The filter as given, each field as typed (empty: none).
    pub q: EventsText,
    pub error: Option<String>,
    /// The query of the next (older) page, when there is one.
    pub older: Option<String>,
    /// The query of the previous (newer) page, when there is one.
    pub newer: Option<String>,
    /// This host's name: a trail read among many hosts names its own.
    pub host: String,
    /// Whether the page follows new events (the newest page, unless
    /// `live=0`), and this page's query with that toggled.
    pub live: bool,
    pub toggle_live: String,
    pub live_stream: String,
    pub live_kinds: String,
    /// The export's downloads of what this page's filter takes (`tree`,
    /// `kind`, `since`, `until` as the page read them): NDJSON, with its
    /// inclusion proofs, and CSV.
    pub export_ndjson: String,
    pub export_csv: String,
    /// The page's filters the export cannot take, when any is set
    /// (`label, text`): the page says the download leaves them out.
    pub export_leaves_out: String,
}

/// The events page's filter, as typed.
#[derive(Clone, Default)]
pub struct EventsText {
    pub tree: String,
    pub kind: String,
    pub since: String,
    pub until: String,
    /// `1`: only the kinds an incident review reads ([`IMPORTANT`]).
    pub important: bool,
    pub text: String,
    pub label: String,
}

impl EventsText {
    /// The query parts that repeat in every link of the page.
    fn parts(&self) -> Vec<(&'static str, String)> {
        vec![
            ("tree", self.tree.clone()),
            ("kind", self.kind.clone()),
            ("since", self.since.clone()),
            ("until", self.until.clone()),
            (
                "important",
                if self.important {
                    "1".into()
                } else {
                    String::new()
                },
            ),
            ("text", self.text.clone()),
            ("label", self.label.clone()),
        ]
    }
}

/// The kinds an incident review reads: kills and their authority, escapes,
/// sweeps, ambiguity and its settling, refusals, seals, the service's own
/// shutdown and tokens. Not the member observe/exec/exit noise.
pub const IMPORTANT: [crate::ledger::EventKind; 18] = {
    use crate::ledger::EventKind as K;
    [
        K::TreeSpawnFailed,
        K::EscapeObserved,
        K::SurvivorsRecorded,
        K::SignalSent,
        K::KillRequested,
        K::KillAuthorized,
        K::KillSkipped,
        K::TreeState,
        K::SweepOrphanFound,
        K::SweepRefused,
        K::DispatchRefused,
        K::TreeResolved,
        K::TreeOomKill,
        K::MemberUnkillable,
        K::TreeHoldsCapped,
        K::TokenRevoked,
        K::ShutdownRequested,
        K::LedgerSeal,
    ]
};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventsQuery {
    pub tree: Option<String>,
    pub kind: Option<String>,
    pub since: Option<String>,
    /// Events before this (`10m`, or an RFC 3339 time).
    pub until: Option<String>,
    /// `1`: the incident preset ([`IMPORTANT`]).
    pub important: Option<String>,
    /// Events whose data contains this text.
    pub text: Option<String>,
    /// Events of trees whose label contains this.
    pub label: Option<String>,
    /// `0`: do not follow new events.
    pub live: Option<String>,
    /// Keyset paging: the page of events right below this seq (older).
    pub before: Option<i64>,
    /// Keyset paging: the page of events right above this seq (newer).
    pub after: Option<i64>,
}

/// `GET /events`: the audit trail, newest first, filterable.
// Over 100 lines on purpose: one page from one parsed query (each bad
// field a banner, not a failure), one ledger read, then the links, each
// repeating the same typed filter.
pub async fn events(
    State(s): State<AppState>,
    axum::Extension(principal): axum::Extension<super::auth::Principal>,
    ApiQuery(q): ApiQuery<EventsQuery>,
) -> Result<Html<String>, ApiError> {
    principal.must_see_all("the dashboard")?;
    let text = EventsText {
        tree: q.tree.clone().unwrap_or_default(),
        kind: q.kind.clone().unwrap_or_default(),
        since: q.since.clone().unwrap_or_default(),
        until: q.until.clone().unwrap_or_default(),
        important: parse_flag("important", q.important.as_deref())?,
        text: q.text.clone().unwrap_or_default(),
        label: q.label.clone().unwrap_or_default(),
    };
    let mut error = None;
    let tree = match text.tree.trim() {
        "" => None,
        t => match t.parse::<i64>() {
            Ok(id) => Some(TreeId(id)),
            Err(_) => {
                error = Some(format!("tree {t:?} is not a tree id"));
                None
            }
        },
    };
    let mut time = |field: &str, value: &str| match value.trim() {
        "" => None,
        t => match parse_since(t) {
            Ok(at) => Some(at),
            Err(e) => {
                error = Some(format!("{field}: {e}"));
                None
            }
        },
    };
    let since = time("since", &text.since);
    let until = time("until", &text.until);
    let some = |v: &str| Some(v.trim().to_string()).filter(|v| !v.is_empty());
    // SQL filters and keeps one page next to the bound (and one more row,
    // to know whether the next page has any); nothing else is read.
    let at = page_at(q.before, q.after)?;
    let filter = EventFilter {
        since,
        tree,
        kind_prefix: some(&text.kind),
        // A newer page is read upwards from its bound, then shown newest first.
        newest_first: !matches!(at, PageAt::After(_)),
        before_seq: q.before,
        after_seq: q.after,
        limit: Some(MAX_EVENTS + 1),
        search: crate::ledger::EventSearch {
            kinds: text
                .important
                .then(|| IMPORTANT.iter().map(|k| k.as_str().to_string()).collect()),
            until,
            text: some(&text.text),
            tree_label: some(&text.label),
        },
    };
    let door = s.service.door();
    let mut rows = door.events(filter).await?;
    let more = rows.len() > MAX_EVENTS;
    rows.truncate(MAX_EVENTS);
    if matches!(at, PageAt::After(_)) {
        rows.reverse();
    }
    let live_asked = !matches!(q.live.as_deref(), Some("0"));
    let link = |bound: Option<(&'static str, i64)>, live: bool| {
        let mut parts = text.parts();
        if let Some((k, v)) = bound {
            parts.push((k, v.to_string()));
        }
        parts.push(("live", if live { String::new() } else { "0".into() }));
        query_string(&parts)
    };
    let (older, newer) = pager(
        at,
        more,
        rows.first().map(|e| e.seq),
        rows.last().map(|e| e.seq),
    );
    // The export takes the filters the page read (a field the page could
    // not read, named in its banner, is left out of the link too).
    let since_read = if since.is_some() {
        text.since.trim()
    } else {
        ""
    };
    let until_read = if until.is_some() {
        text.until.trim()
    } else {
        ""
    };
    let export = |format: &str| {
        let parts = [
            ("format", format.to_string()),
            ("tree", tree.map(|t| t.0.to_string()).unwrap_or_default()),
            ("kind", text.kind.trim().to_string()),
            ("since", since_read.to_string()),
            ("until", until_read.to_string()),
        ];
        format!("/api/export{}", query_string(&parts))
    };
    let export_leaves_out = [
        ("label", !text.label.trim().is_empty()),
        ("text", !text.text.trim().is_empty()),
        ("important", text.important),
    ]
    .iter()
    .filter(|(_, set)| *set)
    .map(|(name, _)| *name)
    .collect::<Vec<_>>()
    .join(", ");
    // Only the newest page follows new events: an older one would reload
    // away from what the reader paged to.
    let live = live_asked && matches!(at, PageAt::Newest);
    render(&EventsPage {
        older: older.map(|seq| link(Some(("before", seq)), live_asked)),
        newer: newer.map(|seq| link(Some(("after", seq)), live_asked)),
        toggle_live: link(None, !live_asked),
        live,
        live_stream: "/api/events/stream".into(),
        live_kinds: if text.important {
            IMPORTANT
                .iter()
                .map(|k| k.as_str())
                .collect::<Vec<_>>()
                .join(" ")
        } else {
            live_kinds()
        },
        export_ndjson: export("ndjson"),
        export_csv: export("csv"),
        export_leaves_out,
        events: rows.iter().map(EventLine::of).collect(),
        host: door.host(),
        q: text,
        error,
    })
}
