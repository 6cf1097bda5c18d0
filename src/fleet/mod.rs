//! `treewarden fleet serve`: the fleet's consumer of the JetStream stream
//! every host ships to (`service/nats.rs`). For each host subject it walks
//! the host's messages with the ledger's own export walk
//! (`service::nats::verify_host` → `ledger::verify_trail_as_of`: seq
//! continuity, no rewind, every hash and `prev_hash` link, and the seals
//! with the host's registered material), keeps an index of its own in
//! SQLite (`ledger::fleet`), and serves a read-only dashboard and
//! `/metrics` on loopback (`web.rs`).
//!
//! It never coordinates with other instances itself: every `fleet serve`
//! naming the same `--consumer` pulls from one durable JetStream consumer,
//! which hands each message to one of them. They share the `--data` index.
//! A host is walked only up to the consumer's ack floor (a message is acked
//! after it is stored), so a message in flight at another instance is never
//! mistaken for a gap. It never writes to the stream.

pub mod web;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::ledger::fleet::{FleetIndex, HostMaterial, Verdict};
use crate::ledger::seal::{SealKey, SealPub, SealVerifier};
use crate::service::nats::{
    ConsumerPosition, FLEET_MAX_ACK_PENDING, FleetReader, NatsConfig, StoredEvent, verify_host,
};

/// The durable consumer's name where none is given.
pub const CONSUMER: &str = "treewarden-fleet";

/// What `fleet serve` needs.
#[derive(Clone, Debug)]
pub struct FleetOptions {
    pub nats: NatsConfig,
    pub data: PathBuf,
    /// The dashboard's address (loopback only); none: no pages.
    pub listen: Option<SocketAddr>,
    pub consumer: String,
    /// A host whose newest event is older than this is stale.
    pub stale: Duration,
}

/// What the consumer loop tells the pages and `/metrics`.
#[derive(Debug, Default)]
pub struct Progress {
    pub position: ConsumerPosition,
    /// Messages the stream holds per host.
    pub in_stream: BTreeMap<String, u64>,
    /// Messages this instance stored, per host (each stored once, by one
    /// instance).
    pub indexed_here: BTreeMap<String, u64>,
    /// Messages this instance received, per host, redeliveries included.
    pub received: BTreeMap<String, u64>,
    pub connected: bool,
    pub last_error: Option<String>,
}

/// The index and the progress, shared by the loop and the pages.
pub struct Fleet {
    pub index: FleetIndex,
    pub progress: Mutex<Progress>,
    pub stale: Duration,
}

impl Fleet {
    pub fn progress(&self) -> std::sync::MutexGuard<'_, Progress> {
        self.progress
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A host's material as the seal walk takes it.
pub fn verifier(index: &FleetIndex, m: &HostMaterial) -> Result<SealVerifier, String> {
    let value = index.material_value(m).map_err(|e| e.to_string())?;
    match m.material.as_str() {
        "key" => SealKey::parse(&value).map(SealVerifier::Key),
        "pub" => SealPub::parse(&value).map(SealVerifier::Pub),
        other => Err(format!("unknown material {other:?}")),
    }
}

/// The seq a break names (`seq N: …`), where it names one.
pub fn break_seq(why: &str) -> Option<i64> {
    let at = why.find("seq ")?;
    let digits: String = why[at + 4..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

impl From<crate::ledger::fleet::FleetMessage> for StoredEvent {
    fn from(m: crate::ledger::fleet::FleetMessage) -> StoredEvent {
        StoredEvent {
            stream_seq: m.stream_seq,
            msg_id: m.msg_id,
            ce_id: m.ce_id,
            body: m.body,
        }
    }
}

fn now() -> String {
    humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string()
}

/// Walks `host`'s messages up to `floor` and stores the verdict.
pub fn verify_one(index: &FleetIndex, host: &str, floor: u64) -> Result<Verdict, String> {
    let messages = index.messages(host, floor).map_err(|e| e.to_string())?;
    let through = messages.last().map_or(0, |m| m.stream_seq);
    let material = index.host(host).map_err(|e| e.to_string())?;
    let last_at = messages.iter().rev().find_map(|m| {
        serde_json::from_slice::<serde_json::Value>(&m.body)
            .ok()
            .and_then(|v| v["at"].as_str().map(str::to_string))
    });
    let count = messages.len() as u64;
    let stored: Vec<StoredEvent> = messages.into_iter().map(StoredEvent::from).collect();
    let mut verdict = Verdict {
        host: host.to_string(),
        through_stream_seq: through,
        events: count,
        head_seq: None,
        last_at,
        ok: false,
        why: None,
        break_seq: None,
        seal_made_at: None,
        checked_at: now(),
    };
    let seal = match material.as_ref().map(|m| verifier(index, m)).transpose() {
        Ok(s) => s,
        Err(e) => {
            verdict.why = Some(format!("the registered material does not parse: {e}"));
            index.set_verdict(&verdict).map_err(|e| e.to_string())?;
            return Ok(verdict);
        }
    };
    match verify_host(&stored, host, seal).map_err(|e| e.to_string())? {
        Ok(report) => {
            verdict.ok = true;
            verdict.head_seq = report.head.map(|(seq, _)| seq);
            verdict.seal_made_at = report.sealed.map(|s| s.last_made_at);
        }
        Err(why) => {
            verdict.break_seq = break_seq(&why);
            verdict.why = Some(why);
        }
    }
    index.set_verdict(&verdict).map_err(|e| e.to_string())?;
    Ok(verdict)
}

/// Runs until `cancel`: the consumer loop, and the pages where `listen` is set.
pub async fn serve(options: FleetOptions, cancel: CancellationToken) -> Result<(), String> {
    let index = FleetIndex::open(&options.data).map_err(|e| e.to_string())?;
    let fleet = Arc::new(Fleet {
        index,
        progress: Mutex::new(Progress::default()),
        stale: options.stale,
    });
    let pages = match options.listen {
        Some(addr) => {
            if !addr.ip().is_loopback() {
                return Err(format!(
                    "--listen {addr}: the fleet pages are served on loopback only (they have no login)"
                ));
            }
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| format!("--listen {addr}: {e}"))?;
            let bound = listener.local_addr().map_err(|e| e.to_string())?;
            tracing::info!(%bound, "fleet pages listening");
            println!("fleet listening on http://{bound}");
            let router = web::router(fleet.clone());
            let stop = cancel.clone();
            Some(tokio::spawn(async move {
                let _ = axum::serve(listener, router)
                    .with_graceful_shutdown(async move { stop.cancelled().await })
                    .await;
            }))
        }
        None => None,
    };
    consume(&options, &fleet, &cancel).await;
    if let Some(pages) = pages {
        let _ = tokio::time::timeout(Duration::from_secs(5), pages).await;
    }
    Ok(())
}

/// A consumer with messages pending that delivers none for this long is
/// stalled: its leader is asked to step down and the reader reconnects.
const STALLED: Duration = Duration::from_secs(15);

/// Watches a consumer for a stall: messages pending, fewer than the most it
/// may have unacked, and none delivered for [`STALLED`]. No clock of its
/// own: the caller says when each look was taken.
#[derive(Debug, Default)]
struct StallWatch {
    /// Since when messages are pending and none has been delivered.
    quiet_since: Option<Instant>,
}

impl StallWatch {
    /// One look: `delivered` messages came in the last fetch, the consumer
    /// stands at `position`. True once the quiet has lasted [`STALLED`].
    fn look(&mut self, delivered: usize, position: &ConsumerPosition, now: Instant) -> bool {
        let starved =
            delivered == 0 && position.pending > 0 && position.ack_pending < FLEET_MAX_ACK_PENDING;
        if !starved {
            self.quiet_since = None;
            return false;
        }
        now.duration_since(*self.quiet_since.get_or_insert(now)) >= STALLED
    }

    /// A fetch delivered messages (between looks): the quiet is over.
    fn delivered(&mut self) {
        self.quiet_since = None;
    }
}

/// The consumer loop: reconnects with backoff (1 s doubling to 30 s, back
/// to 1 s once a connection is made).
async fn consume(options: &FleetOptions, fleet: &Fleet, cancel: &CancellationToken) {
    let mut backoff = Duration::from_secs(1);
    while !cancel.is_cancelled() {
        let failed = tokio::select! {
            _ = cancel.cancelled() => return,
            r = consume_connected(options, fleet, cancel, &mut backoff) => r,
        };
        if let Err(e) = failed {
            tracing::warn!("fleet consumer: {e}; retrying");
            let mut p = fleet.progress();
            p.connected = false;
            p.last_error = Some(e);
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(30));
    }
}

async fn consume_connected(
    options: &FleetOptions,
    fleet: &Fleet,
    cancel: &CancellationToken,
    backoff: &mut Duration,
) -> Result<(), String> {
    let mut reader = FleetReader::connect(&options.nats, &options.consumer)
        .await
        .map_err(|e| e.to_string())?;
    fleet.progress().connected = true;
    *backoff = Duration::from_secs(1);
    let mut last_walk = Instant::now() - Duration::from_secs(60);
    let mut walk_took = Duration::ZERO;
    let mut stall = StallWatch::default();
    while !cancel.is_cancelled() {
        let batch = reader
            .fetch(500, Duration::from_millis(500))
            .await
            .map_err(|e| e.to_string())?;
        if !batch.is_empty() {
            stall.delivered();
            let messages: Vec<_> = batch.iter().map(|r| r.message.clone()).collect();
            let fresh = fleet.index.insert(&messages).map_err(|e| e.to_string())?;
            {
                let mut p = fleet.progress();
                for (m, new) in messages.iter().zip(fresh) {
                    *p.received.entry(m.host.clone()).or_default() += 1;
                    if new {
                        *p.indexed_here.entry(m.host.clone()).or_default() += 1;
                    }
                }
            }
            reader.ack(&batch).await.map_err(|e| e.to_string())?;
        }
        // Walked whenever the consumer is idle; while a backlog is read, at
        // most once a second and at most a fifth of the time (a walk re-reads
        // each host it takes from its first event).
        let due = (walk_took * 4).max(Duration::from_secs(1));
        if batch.is_empty() || last_walk.elapsed() >= due {
            last_walk = Instant::now();
            let position = reader.position().await.map_err(|e| e.to_string())?;
            if stall.look(batch.len(), &position, Instant::now()) {
                if let Err(e) = reader.step_down().await {
                    tracing::warn!("fleet consumer: {e}");
                }
                return Err(format!(
                    "consumer stalled: {} messages pending, none delivered for {} s",
                    position.pending,
                    STALLED.as_secs()
                ));
            }
            let in_stream = reader.per_host().await.map_err(|e| e.to_string())?;
            {
                let mut p = fleet.progress();
                p.position = position;
                p.in_stream = in_stream;
                p.last_error = None;
            }
            let started = Instant::now();
            walk(fleet, position.ack_floor);
            walk_took = started.elapsed();
        }
    }
    Ok(())
}

/// Walks every host with messages the verdict has not covered, up to `floor`.
fn walk(fleet: &Fleet, floor: u64) {
    let hosts = match fleet.index.hosts_to_verify(floor) {
        Ok(h) => h,
        Err(e) => {
            tracing::error!("fleet index: {e}");
            return;
        }
    };
    for host in hosts {
        match verify_one(&fleet.index, &host, floor) {
            Ok(v) if !v.ok => tracing::warn!(
                host = %host,
                seq = v.break_seq,
                "fleet: host {host}'s chain is broken: {}",
                v.why.as_deref().unwrap_or("-")
            ),
            Ok(_) => {}
            Err(e) => tracing::error!(host = %host, "fleet: walking host {host}: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_consumer_is_stalled_only_after_a_quiet_with_messages_pending() {
        let t0 = Instant::now();
        let pending = |pending, ack_pending| ConsumerPosition {
            ack_floor: 10,
            pending,
            ack_pending,
        };
        let mut w = StallWatch::default();
        assert!(!w.look(0, &pending(5, 0), t0));
        assert!(!w.look(0, &pending(5, 0), t0 + STALLED - Duration::from_millis(1)));
        assert!(w.look(0, &pending(5, 0), t0 + STALLED));
        // A delivery, or nothing pending, ends the quiet.
        let mut w = StallWatch::default();
        assert!(!w.look(0, &pending(5, 0), t0));
        assert!(!w.look(3, &pending(5, 0), t0 + STALLED / 2));
        assert!(!w.look(0, &pending(5, 0), t0 + STALLED));
        assert!(!w.look(
            0,
            &pending(5, 0),
            t0 + STALLED * 2 - Duration::from_millis(1)
        ));
        assert!(w.look(0, &pending(5, 0), t0 + STALLED * 2));
        let mut w = StallWatch::default();
        assert!(!w.look(0, &pending(5, 0), t0));
        assert!(!w.look(0, &pending(0, 0), t0 + STALLED / 2));
        assert!(!w.look(0, &pending(5, 0), t0 + STALLED));
        // Deliveries between looks end the quiet too.
        let mut w = StallWatch::default();
        assert!(!w.look(0, &pending(5, 0), t0));
        w.delivered();
        assert!(!w.look(0, &pending(5, 0), t0 + STALLED));
        assert!(w.look(0, &pending(5, 0), t0 + STALLED * 2));
        // At the unacked limit the server holds deliveries back by design.
        let mut w = StallWatch::default();
        let full = pending(5, FLEET_MAX_ACK_PENDING);
        assert!(!w.look(0, &full, t0));
        assert!(!w.look(0, &full, t0 + STALLED * 2));
        assert!(!w.look(0, &pending(5, FLEET_MAX_ACK_PENDING - 1), t0 + STALLED * 2));
    }

    #[test]
    fn a_break_names_its_seq() {
        assert_eq!(break_seq("seq 17: prev_hash does not match"), Some(17));
        assert_eq!(
            break_seq("seq 9: after seq 12 (stream seq 40): went back"),
            Some(9)
        );
        assert_eq!(break_seq("integrity_check: no"), None);
    }
}
