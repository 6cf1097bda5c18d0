//! The fleet's pages and `/metrics` (`fleet serve --listen`): read-only,
//! on loopback only, no login (as `serve`'s read pages on loopback). Each
//! page reads the index (`ledger::fleet`) and the consumer's progress; no
//! handler writes anything.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use askama::Template;
use axum::extract::{Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::Fleet;
use crate::ledger::fleet::{Notable, NotableFilter};

/// Rows of the notable table at most.
const MAX_NOTABLE: usize = 500;

pub fn router(fleet: Arc<Fleet>) -> axum::Router {
    axum::Router::new()
        .route("/", get(dashboard))
        .route("/hosts/{host}/trees/{tree}", get(tree))
        .route("/metrics", get(metrics))
        .with_state(fleet)
}

fn internal(e: impl std::fmt::Display) -> Response {
    tracing::error!("fleet page: {e}");
    (StatusCode::INTERNAL_SERVER_ERROR, "internal error\n").into_response()
}

fn render(t: &impl Template) -> Response {
    match t.render() {
        Ok(html) => Html(html).into_response(),
        Err(e) => internal(e),
    }
}

fn age_of(at: Option<&str>) -> Option<Duration> {
    let t = humantime::parse_rfc3339_weak(at?.trim_end_matches('Z')).ok()?;
    Some(SystemTime::now().duration_since(t).unwrap_or_default())
}

fn short(d: Option<Duration>) -> String {
    let Some(d) = d else { return "-".into() };
    let s = d.as_secs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m {}s", s / 60, s % 60),
        3600..86400 => format!("{}h {}m", s / 3600, (s % 3600) / 60),
        _ => format!("{}d {}h", s / 86400, (s % 86400) / 3600),
    }
}

/// One host as the dashboard and `/metrics` see it.
pub struct HostLine {
    pub host: String,
    pub events: u64,
    pub last_at: String,
    pub last_age: Option<Duration>,
    /// Messages the stream holds that the index has not walked yet.
    pub lag: u64,
    pub seal_age: Option<Duration>,
    /// `ok`, `broken` or `pending` (not walked yet).
    pub verdict: &'static str,
    pub why: String,
    pub break_seq: Option<i64>,
    pub stale: bool,
    pub material: String,
}

impl HostLine {
    pub fn last_age_text(&self) -> String {
        short(self.last_age)
    }
    pub fn seal_age_text(&self) -> String {
        short(self.seal_age)
    }
    pub fn break_text(&self) -> String {
        self.break_seq.map(|s| s.to_string()).unwrap_or_default()
    }
}

/// Every host, from the index and the consumer's progress.
pub fn host_lines(fleet: &Fleet) -> Result<Vec<HostLine>, crate::ledger::LedgerError> {
    let verdicts = fleet.index.verdicts()?;
    let materials = fleet.index.hosts()?;
    let counts = fleet.index.counts()?;
    let progress = fleet.progress();
    Ok(verdicts
        .into_iter()
        .map(|(host, v)| {
            let (indexed, newest) = counts
                .iter()
                .find(|(h, _, _)| *h == host)
                .map_or((0, None), |(_, n, at)| (*n, at.clone()));
            let walked = v.as_ref().map_or(0, |v| v.events);
            let in_stream = progress.in_stream.get(&host).copied().unwrap_or(indexed);
            let last_age = age_of(newest.as_deref());
            HostLine {
                events: indexed,
                last_at: newest.clone().unwrap_or_else(|| "-".into()),
                last_age,
                lag: in_stream.saturating_sub(walked),
                seal_age: v.as_ref().and_then(|v| age_of(v.seal_made_at.as_deref())),
                verdict: match &v {
                    None => "pending",
                    Some(v) if v.ok => "ok",
                    Some(_) => "broken",
                },
                why: v.as_ref().and_then(|v| v.why.clone()).unwrap_or_default(),
                break_seq: v.as_ref().and_then(|v| v.break_seq),
                stale: last_age.is_none_or(|a| a > fleet.stale),
                material: materials
                    .iter()
                    .find(|m| m.host == host)
                    .map_or("none".into(), |m| m.material.clone()),
                host,
            }
        })
        .collect())
}

#[derive(serde::Deserialize, Default)]
pub struct DashQuery {
    #[serde(default)]
    host: String,
    /// ambiguous | force-kill | orphan | unkillable
    #[serde(default)]
    outcome: String,
    /// `2h` or an RFC 3339 time.
    #[serde(default)]
    since: String,
}

#[derive(Template)]
#[template(path = "fleet.html")]
struct DashboardPage {
    hosts: Vec<HostLine>,
    notables: Vec<Notable>,
    q: DashQuery,
    error: Option<String>,
    pending: u64,
    connected: bool,
}

async fn dashboard(State(fleet): State<Arc<Fleet>>, Query(q): Query<DashQuery>) -> Response {
    let hosts = match host_lines(&fleet) {
        Ok(h) => h,
        Err(e) => return internal(e),
    };
    let mut error = None;
    let since = match q.since.trim() {
        "" => None,
        s => match crate::ledger::parse_since(s) {
            Ok(t) => Some(humantime::format_rfc3339_millis(t).to_string()),
            Err(e) => {
                error = Some(e);
                None
            }
        },
    };
    let filter = NotableFilter {
        host: Some(q.host.trim().to_string()).filter(|h| !h.is_empty()),
        notable: Some(q.outcome.trim().to_string()).filter(|o| !o.is_empty()),
        since,
        limit: MAX_NOTABLE,
    };
    let notables = match fleet.index.notables(&filter) {
        Ok(n) => n,
        Err(e) => return internal(e),
    };
    let (pending, connected) = {
        let p = fleet.progress();
        (p.position.pending + p.position.ack_pending, p.connected)
    };
    let hosts = match &filter.host {
        Some(h) => hosts.into_iter().filter(|l| &l.host == h).collect(),
        None => hosts,
    };
    render(&DashboardPage {
        hosts,
        notables,
        q,
        error,
        pending,
        connected,
    })
}

/// One event of a tree's page.
struct TreeEvent {
    seq: String,
    at: String,
    kind: String,
    data: String,
    hash: String,
    stream_seq: u64,
}

#[derive(Template)]
#[template(path = "fleet_tree.html")]
struct TreePage {
    host: String,
    tree: i64,
    events: Vec<TreeEvent>,
}

async fn tree(
    State(fleet): State<Arc<Fleet>>,
    Path((host, tree)): Path<(String, i64)>,
) -> Response {
    let rows = match fleet.index.tree_events(&host, tree) {
        Ok(r) => r,
        Err(e) => return internal(e),
    };
    if rows.is_empty() {
        return (
            StatusCode::NOT_FOUND,
            format!("no event of tree {tree} from host {host} is indexed\n"),
        )
            .into_response();
    }
    let events = rows
        .into_iter()
        .map(|r| {
            let v: serde_json::Value =
                serde_json::from_slice(&r.body).unwrap_or(serde_json::Value::Null);
            TreeEvent {
                seq: v["seq"].to_string(),
                at: v["at"].as_str().unwrap_or("-").to_string(),
                kind: v["kind"].as_str().unwrap_or("-").to_string(),
                data: v["data"].to_string(),
                hash: v["hash"].as_str().unwrap_or("-").to_string(),
                stream_seq: r.stream_seq,
            }
        })
        .collect();
    render(&TreePage { host, tree, events })
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HostLabel {
    host: String,
}

/// `/metrics`: per host (label `host`), built from the index at each scrape.
async fn metrics(State(fleet): State<Arc<Fleet>>) -> Response {
    let hosts = match host_lines(&fleet) {
        Ok(h) => h,
        Err(e) => return internal(e),
    };
    let mut registry = Registry::with_prefix("treewarden_fleet");
    let family = |registry: &mut Registry, name: &str, help: &str| {
        let f = Family::<HostLabel, Gauge>::default();
        registry.register(name, help, f.clone());
        f
    };
    let broken = family(
        &mut registry,
        "chain_broken",
        "1 while the host's chain, as the stream holds it, is broken",
    );
    let stale = family(
        &mut registry,
        "host_stale",
        "1 while the host's newest event is older than --stale",
    );
    let lag = family(
        &mut registry,
        "lag_events",
        "Messages of the host the stream holds that the fleet has not verified yet",
    );
    let indexed = family(
        &mut registry,
        "events_indexed",
        "Messages of the host in the fleet's index",
    );
    let here = family(
        &mut registry,
        "events_indexed_here",
        "Messages of the host this instance received and stored",
    );
    let age = family(
        &mut registry,
        "last_event_age_seconds",
        "Seconds since the host's newest event",
    );
    let seal_age = family(
        &mut registry,
        "seal_age_seconds",
        "Seconds since the host's newest seal (hosts with registered material)",
    );
    let received = family(
        &mut registry,
        "events_received",
        "Messages of the host this instance received (redeliveries included)",
    );
    let (progress_here, progress_received, position, connected) = {
        let p = fleet.progress();
        let pairs = |m: &std::collections::BTreeMap<String, u64>| -> Vec<(String, u64)> {
            m.iter().map(|(h, n)| (h.clone(), *n)).collect()
        };
        (
            pairs(&p.indexed_here),
            pairs(&p.received),
            p.position,
            p.connected,
        )
    };
    let as_i64 = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
    let consumer = |registry: &mut Registry, name: &str, help: &str, v: u64| {
        let g = Gauge::<i64>::default();
        g.set(as_i64(v));
        registry.register(name, help, g);
    };
    consumer(
        &mut registry,
        "consumer_connected",
        "1 while this instance's consumer is bound",
        u64::from(connected),
    );
    consumer(
        &mut registry,
        "consumer_pending",
        "Messages of the stream the consumer has not delivered yet (as of its last look)",
        position.pending,
    );
    consumer(
        &mut registry,
        "consumer_ack_pending",
        "Messages delivered and not acked yet",
        position.ack_pending,
    );
    consumer(
        &mut registry,
        "consumer_ack_floor",
        "The stream sequence at or below which every message is acked",
        position.ack_floor,
    );
    for h in &hosts {
        let l = HostLabel {
            host: h.host.clone(),
        };
        broken
            .get_or_create(&l)
            .set(i64::from(h.verdict == "broken"));
        stale.get_or_create(&l).set(i64::from(h.stale));
        lag.get_or_create(&l).set(as_i64(h.lag));
        indexed.get_or_create(&l).set(as_i64(h.events));
        if let Some(a) = h.last_age {
            age.get_or_create(&l).set(as_i64(a.as_secs()));
        }
        if let Some(a) = h.seal_age {
            seal_age.get_or_create(&l).set(as_i64(a.as_secs()));
        }
    }
    for (host, n) in progress_here {
        here.get_or_create(&HostLabel { host }).set(as_i64(n));
    }
    for (host, n) in progress_received {
        received.get_or_create(&HostLabel { host }).set(as_i64(n));
    }
    let mut text = String::new();
    if let Err(e) = prometheus_client::encoding::text::encode(&mut text, &registry) {
        return internal(e);
    }
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        text,
    )
        .into_response()
}
