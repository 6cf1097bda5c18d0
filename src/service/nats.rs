//! Shipping the audit trail to NATS JetStream (`serve --ship nats://…`, and
//! `treewarden ship` once for hosts that only `run`): every committed
//! ledger event, in seq order, to the subject `treewarden.<host-id>.events`
//! of a stream (`TREEWARDEN`) made, where absent, with file storage,
//! `deny_delete`, `deny_purge` and a duplicate window. docs/FLEET.md says
//! how to point hosts at it and what a refusal means.
//!
//! Why JetStream: a publish is acknowledged once the stream stored it, a
//! `Nats-Msg-Id` seen within the duplicate window is stored once, and
//! `Nats-Expected-Last-Subject-Sequence` makes the server refuse a message
//! whose publisher's idea of the subject's last message is not the stream's.
//! The shipper keeps that idea durably: the stream sequence of the event at
//! the cursor is stored in the cursor's own row (`ship_cursor.remote_seq`).
//! A ledger restored from an older copy therefore carries the older
//! position, and the first event it ships that the stream does not already
//! hold is refused by the server ("wrong last sequence"), counted in
//! `treewarden_ship_refused_total` and logged; the cursor does not move.
//!
//! The message id is `<host-id>:<seq>:<first 16 hex of the event's hash>`,
//! not `<host-id>:<seq>` alone: the server checks the id before the
//! expected sequence, so with the seq alone a forked event (same seq, other
//! content) shipped within the window would be answered "duplicate" and
//! dropped unseen. With the hash in it, a replay of the same event is a
//! duplicate and a different event at the same seq reaches the sequence
//! check and is refused.
//!
//! After a refusal the shipper reads the subject's newest message: when it
//! is one of this ledger's events (same seq, same hash; the chain makes
//! the whole prefix equal) the refusal was a replay outside the window (a
//! crash between the ack and the cursor write, or a `ship` and a `serve` at
//! once), and shipping resumes after it; otherwise the refusal stands.
//!
//! It never blocks custody: a thread of its own with a runtime and a ledger
//! handle of its own; reads are WAL snapshots; its one write is the cursor
//! row, once per batch, after the stream acknowledged every event of it.
//! A server that is down costs retries with backoff on this thread and a
//! growing `treewarden_ship_lag_events`, nothing else. `prune` never removes
//! an event past the lowest cursor (`ledger/prune.rs`), this one included.

use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, context::PublishErrorKind, stream};
use prometheus_client::metrics::counter::Counter;
use tokio_util::sync::CancellationToken;

use crate::ledger::{EventFilter, EventRow, Ledger};

/// The cursor's name in the ledger.
pub const SINK: &str = "nats";
/// The stream's name where none is configured.
pub const STREAM: &str = "TREEWARDEN";
/// The stream's duplicate window when the shipper makes it (NATS's default).
pub const DUPLICATE_WINDOW: Duration = Duration::from_secs(120);

/// The refusals counter (`treewarden_ship_refused_total`).
pub type Refusals = Counter<u64, AtomicU64>;

/// What shipping to JetStream needs.
#[derive(Clone, Debug)]
pub struct NatsConfig {
    /// The servers, as `--ship` names them (`nats://h:p,h:p`).
    pub servers: Vec<async_nats::ServerAddr>,
    /// A NATS credentials file (`--ship-creds`).
    pub creds: Option<PathBuf>,
    /// The subject's host token: `--ship-host-id`, else `/etc/machine-id`,
    /// else the host name (see [`host_id`]).
    pub host_id: String,
    pub stream: String,
    /// The stream's replicas when the shipper makes it.
    pub replicas: usize,
    /// Events per batch (one ledger read, one cursor write).
    pub batch: usize,
    /// How often to look for new events when caught up.
    pub poll: Duration,
    /// The connect and per-ack timeout.
    pub timeout: Duration,
}

/// Whether `id` can be a subject token (and a message id's part).
fn valid_host_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// The host's id in subjects and ids: `configured` when given (it must be
/// 1–64 of `A-Z a-z 0-9 - _`), else `/etc/machine-id` (stable across
/// renames and reinstalls of treewarden, unique per installed OS), else the
/// host name with every other character made `-`.
pub fn host_id(configured: Option<&str>) -> Result<String, String> {
    if let Some(id) = configured {
        return if valid_host_id(id) {
            Ok(id.to_string())
        } else {
            Err(format!(
                "host id {id:?}: 1 to 64 of A-Z, a-z, 0-9, '-' and '_' (it is a NATS subject token)"
            ))
        };
    }
    if let Ok(id) = std::fs::read_to_string("/etc/machine-id") {
        let id = id.trim();
        if valid_host_id(id) {
            return Ok(id.to_string());
        }
    }
    let name: String = crate::proc::host_name()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '-'
            }
        })
        .take(64)
        .collect();
    if name.is_empty() {
        return Err("no host id: /etc/machine-id is unreadable and the host has no name; give --ship-host-id".into());
    }
    Ok(name)
}

impl NatsConfig {
    /// The configuration `--ship URLS` and its companions give; an error is
    /// one line naming the bad value.
    pub fn new(
        urls: &str,
        creds: Option<PathBuf>,
        host: Option<&str>,
        replicas: usize,
    ) -> Result<NatsConfig, String> {
        let mut servers = Vec::new();
        for url in urls.split(',').map(str::trim).filter(|u| !u.is_empty()) {
            if url.contains("://") && !(url.starts_with("nats://") || url.starts_with("tls://")) {
                return Err(format!(
                    "{url}: a NATS server is nats://HOST:PORT or tls://HOST:PORT"
                ));
            }
            servers.push(
                url.parse::<async_nats::ServerAddr>()
                    .map_err(|e| format!("{url}: {e}"))?,
            );
        }
        if servers.is_empty() {
            return Err(format!("{urls:?}: no NATS server named"));
        }
        if !(1..=5).contains(&replicas) {
            return Err(format!("{replicas} replicas: JetStream takes 1 to 5"));
        }
        if let Some(path) = &creds
            && !path.is_file()
        {
            return Err(format!("{}: no such credentials file", path.display()));
        }
        Ok(NatsConfig {
            servers,
            creds,
            host_id: host_id(host)?,
            stream: STREAM.to_string(),
            replicas,
            batch: 256,
            poll: Duration::from_millis(200),
            timeout: Duration::from_secs(5),
        })
    }

    /// `treewarden.<host-id>.events`.
    pub fn subject(&self) -> String {
        subject_of(&self.host_id)
    }

    /// The servers, for logs.
    pub fn servers_text(&self) -> String {
        self.servers
            .iter()
            .map(|s| format!("{}:{}", s.host(), s.port()))
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// A host's subject.
pub fn subject_of(host_id: &str) -> String {
    format!("treewarden.{host_id}.events")
}

/// Why shipping stopped short.
#[derive(Debug, thiserror::Error)]
pub enum ShipError {
    /// No server answered, or none acknowledged in time.
    #[error("NATS unreachable: {0}")]
    Unreachable(String),
    /// The stream refused an event: the ledger does not extend what the
    /// stream holds for this host (rewound, forked, or another ledger with
    /// the same host id).
    #[error("refused by the stream: {0}")]
    Refused(String),
    /// The ledger could not be read or the cursor written.
    #[error("ledger: {0}")]
    Ledger(String),
}

/// A connection, the stream, and where shipping stands.
struct Link {
    js: jetstream::Context,
    stream: stream::Stream,
    subject: String,
    /// The last event the stream acknowledged (the cursor, maybe ahead of
    /// the ledger's copy until the next write).
    cursor: i64,
    /// The stream sequence of the subject's message at `cursor` (0: none).
    expected: u64,
    /// The stream's position was read from the ledger (else it is read
    /// before the next publish).
    loaded: bool,
}

/// A JetStream context on the configured servers.
async fn context(config: &NatsConfig) -> Result<jetstream::Context, ShipError> {
    let mut options = async_nats::ConnectOptions::new()
        .name("treewarden")
        .connection_timeout(config.timeout);
    if let Some(path) = &config.creds {
        options = options
            .credentials_file(path)
            .await
            .map_err(|e| ShipError::Unreachable(format!("{}: {e}", path.display())))?;
    }
    let client = async_nats::connect_with_options(config.servers.clone(), options)
        .await
        .map_err(|e| ShipError::Unreachable(format!("{}: {e}", config.servers_text())))?;
    Ok(jetstream::ContextBuilder::new()
        .timeout(config.timeout)
        .build(client))
}

/// Connects and makes (or finds) the stream.
async fn connect(config: &NatsConfig) -> Result<Link, ShipError> {
    let js = context(config).await?;
    let stream = js
        .get_or_create_stream(stream::Config {
            name: config.stream.clone(),
            subjects: vec!["treewarden.*.events".into()],
            storage: stream::StorageType::File,
            num_replicas: config.replicas,
            deny_delete: true,
            deny_purge: true,
            duplicate_window: DUPLICATE_WINDOW,
            ..Default::default()
        })
        .await
        .map_err(|e| ShipError::Unreachable(format!("stream {}: {e}", config.stream)))?;
    let made = stream.cached_info().config.clone();
    if !made.deny_delete || !made.deny_purge {
        tracing::warn!(
            stream = %config.stream,
            "JetStream shipping: the stream allows deleting or purging messages; the trail off the host can then be cut (docs/FLEET.md)"
        );
    }
    Ok(Link {
        js,
        stream,
        subject: config.subject(),
        cursor: 0,
        expected: 0,
        loaded: false,
    })
}

/// The message id: host, seq and the hash's first 16 hex digits.
pub fn message_id(host_id: &str, e: &EventRow) -> String {
    format!(
        "{host_id}:{}:{}",
        e.seq,
        e.hash.get(..16).unwrap_or(&e.hash)
    )
}

/// One event as a JetStream message: body = its export line, headers =
/// CloudEvents 1.0 (binary mode) and JetStream's.
fn message(
    host_id: &str,
    stream: &str,
    e: &EventRow,
    expected: u64,
) -> jetstream::message::PublishMessage {
    let body = serde_json::to_vec(e).unwrap_or_default();
    jetstream::message::PublishMessage::build()
        .payload(body.into())
        .message_id(message_id(host_id, e))
        .expected_last_subject_sequence(expected)
        .expected_stream(stream)
        .header("ce-specversion", "1.0")
        .header("ce-id", format!("{host_id}:{}", e.seq).as_str())
        .header("ce-source", format!("treewarden://{host_id}").as_str())
        .header("ce-type", e.kind.to_string().as_str())
        .header("ce-time", e.at.as_str())
        .header("content-type", "application/json")
}

/// What a shipped message says of its event: seq and hash.
fn shipped_event(payload: &[u8]) -> Option<(i64, String)> {
    let v: serde_json::Value = serde_json::from_slice(payload).ok()?;
    Some((v["seq"].as_i64()?, v["hash"].as_str()?.to_string()))
}

/// The ledger's event `seq`, if it holds it.
fn event_at(ledger: &Ledger, seq: i64) -> Result<Option<EventRow>, ShipError> {
    let events = ledger
        .events(&EventFilter {
            after_seq: Some(seq - 1),
            limit: Some(1),
            ..EventFilter::default()
        })
        .map_err(|e| ShipError::Ledger(e.to_string()))?;
    Ok(events.into_iter().next().filter(|e| e.seq == seq))
}

/// The subject's newest message as (ledger seq, hash, stream seq); `None`
/// when the subject has none.
async fn subject_head(
    stream: &stream::Stream,
    subject: &str,
) -> Result<Option<(i64, String, u64)>, ShipError> {
    use async_nats::jetstream::stream::LastRawMessageErrorKind as K;
    match stream.get_last_raw_message_by_subject(subject).await {
        Ok(m) => {
            let (seq, hash) = shipped_event(&m.payload).ok_or_else(|| {
                ShipError::Refused(format!(
                    "the subject's message at stream seq {} is not a treewarden event",
                    m.sequence
                ))
            })?;
            Ok(Some((seq, hash, m.sequence)))
        }
        Err(e) if matches!(e.kind(), K::NoMessageFound) => Ok(None),
        Err(e) => Err(ShipError::Unreachable(format!("reading {subject}: {e}"))),
    }
}

/// After the server refused `next` (wrong last sequence): resumes after
/// the subject's newest message when it is this ledger's own event at or
/// past the cursor, else the refusal stands (its reason returned).
async fn reconcile(
    link: &mut Link,
    ledger: &Ledger,
    next: &EventRow,
    server: &str,
) -> Result<(), ShipError> {
    let (subject, cursor) = (link.subject.clone(), link.cursor);
    let refused = |why: String| {
        ShipError::Refused(format!(
            "event seq {} ({subject}): {server}; {why}",
            next.seq
        ))
    };
    let Some((seq, hash, at)) = subject_head(&link.stream, &link.subject).await? else {
        return Err(refused(format!(
            "the stream holds no event of this host, but this ledger shipped up to seq {cursor} before (was the stream replaced, or the host id changed?)"
        )));
    };
    if seq < cursor {
        return Err(refused(format!(
            "the stream's newest event of this host is seq {seq}, behind this ledger's shipped seq {cursor} (the stream lost events)"
        )));
    }
    match event_at(ledger, seq)? {
        Some(mine) if mine.hash == hash => {
            tracing::info!(
                seq,
                stream_seq = at,
                "JetStream shipping: the stream already holds this ledger's events up to seq {seq}; resuming after it"
            );
            link.cursor = seq;
            link.expected = at;
            Ok(())
        }
        Some(_) => Err(refused(format!(
            "the stream's event seq {seq} has hash {hash}, this ledger's another: the ledger was rewound or forked"
        ))),
        None => Err(refused(format!(
            "the stream holds this host's events up to seq {seq} (hash {hash}), which this ledger does not have: it was rewound, or another ledger ships to {subject}"
        ))),
    }
}

/// Loads the cursor and the stream position from the ledger (making the
/// cursor row at 0 the first time).
fn load(link: &mut Link, ledger: &Ledger) -> Result<(), ShipError> {
    let lerr = |e: crate::ledger::LedgerError| ShipError::Ledger(e.to_string());
    let position = match ledger.ship_position(SINK).map_err(lerr)? {
        Some(p) => p,
        None => {
            ledger.init_ship_cursor(SINK).map_err(lerr)?;
            (0, None)
        }
    };
    link.cursor = position.0;
    link.expected = position.1.map_or(0, |s| u64::try_from(s).unwrap_or(0));
    link.loaded = true;
    Ok(())
}

/// Ships the events after the cursor, a batch at a time, until none is
/// left (or `until` is reached); returns how many the stream took.
async fn pass(
    link: &mut Link,
    ledger: &Ledger,
    config: &NatsConfig,
    until: Option<i64>,
    cancel: &CancellationToken,
) -> Result<u64, ShipError> {
    if !link.loaded {
        load(link, ledger)?;
    }
    let mut shipped = 0;
    loop {
        if cancel.is_cancelled() || until.is_some_and(|u| link.cursor >= u) {
            return Ok(shipped);
        }
        let events = ledger
            .events(&EventFilter {
                after_seq: Some(link.cursor),
                limit: Some(config.batch),
                ..EventFilter::default()
            })
            .map_err(|e| ShipError::Ledger(e.to_string()))?;
        if events.is_empty() {
            return Ok(shipped);
        }
        let before = link.cursor;
        // A short batch was all there was: once it is acknowledged the
        // pass is over, without a read that would find nothing.
        let last = events.len() < config.batch;
        let result = publish_all(link, ledger, config, &events, &mut shipped).await;
        if link.cursor > before {
            crate::testhook::crash_point("ship-acked");
            // Acknowledged: the cursor moves. If this write fails, the batch
            // is sent again (deduplicated by the stream).
            if let Err(e) = ledger.set_ship_position(
                SINK,
                link.cursor,
                i64::try_from(link.expected).unwrap_or(i64::MAX),
            ) {
                tracing::warn!(
                    "JetStream shipping: cannot advance the cursor to {}: {e}",
                    link.cursor
                );
            }
        }
        result?;
        if last && events.last().is_some_and(|e| link.cursor >= e.seq) {
            return Ok(shipped);
        }
    }
}

/// Publishes `events` in order, each after the previous one's ack.
async fn publish_all(
    link: &mut Link,
    ledger: &Ledger,
    config: &NatsConfig,
    events: &[EventRow],
    shipped: &mut u64,
) -> Result<(), ShipError> {
    for e in events {
        if e.seq <= link.cursor {
            continue;
        }
        let ack = async {
            link.js
                .send_publish(
                    link.subject.clone(),
                    message(&config.host_id, &config.stream, e, link.expected),
                )
                .await?
                .await
        }
        .await;
        match ack {
            Ok(ack) => {
                link.cursor = e.seq;
                link.expected = ack.sequence;
                if !ack.duplicate {
                    *shipped += 1;
                }
            }
            Err(err) if err.kind() == PublishErrorKind::WrongLastSequence => {
                reconcile(link, ledger, e, &err.to_string()).await?;
                // Resumed: the next batch starts after the new cursor.
                return Ok(());
            }
            Err(err) if err.kind() == PublishErrorKind::StreamNotFound => {
                return Err(ShipError::Unreachable(format!(
                    "stream {}: {err}",
                    config.stream
                )));
            }
            Err(err) => {
                return Err(ShipError::Unreachable(format!(
                    "publishing seq {}: {err}",
                    e.seq
                )));
            }
        }
    }
    Ok(())
}

/// The outcome of one [`ship_once`].
#[derive(Clone, Copy, Debug)]
pub struct Shipped {
    /// Events the stream stored (duplicates not counted).
    pub events: u64,
    /// The cursor after it.
    pub cursor: i64,
}

/// `treewarden ship`: every event up to the head as it is now, then
/// returns. Its own runtime on this thread.
pub fn ship_once(ledger: &Ledger, config: &NatsConfig) -> Result<Shipped, ShipError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| ShipError::Unreachable(format!("runtime: {e}")))?;
    let head = ledger
        .head()
        .map_err(|e| ShipError::Ledger(e.to_string()))?
        .map_or(0, |(seq, _)| seq);
    rt.block_on(async {
        let mut link = connect(config).await?;
        let events = pass(
            &mut link,
            ledger,
            config,
            Some(head),
            &CancellationToken::new(),
        )
        .await?;
        Ok(Shipped {
            events,
            cursor: link.cursor,
        })
    })
}

/// The running shipper of `serve`; [`NatsShipper::stop`] ends it after the
/// publish in flight (bounded by the ack timeout).
pub struct NatsShipper {
    cancel: CancellationToken,
    thread: JoinHandle<()>,
}

impl NatsShipper {
    /// Starts the thread; nothing here waits on the server or the ledger.
    pub fn start(
        ledger: Ledger,
        config: NatsConfig,
        refused: Refusals,
    ) -> Result<NatsShipper, String> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("JetStream shipping runtime: {e}"))?;
        let cancel = CancellationToken::new();
        let token = cancel.clone();
        let thread = std::thread::Builder::new()
            .name("tw-ship-nats".into())
            .spawn(move || rt.block_on(run(&ledger, &config, &refused, &token)))
            .map_err(|e| format!("JetStream shipping thread: {e}"))?;
        Ok(NatsShipper { cancel, thread })
    }

    pub fn stop(self) {
        self.cancel.cancel();
        super::join(self.thread, "JetStream shipping thread");
    }
}

/// Sleeps `d` unless cancelled first; false when cancelled.
async fn nap(d: Duration, cancel: &CancellationToken) -> bool {
    tokio::select! {
        _ = cancel.cancelled() => false,
        _ = tokio::time::sleep(d) => true,
    }
}

/// The service's loop: connect, ship, wait for more; a failure backs off
/// (1 s doubling to 30 s) and tries again, a refusal counted each time.
async fn run(ledger: &Ledger, config: &NatsConfig, refused: &Refusals, cancel: &CancellationToken) {
    let mut backoff = Duration::from_secs(1);
    let mut failing_since: Option<Instant> = None;
    let mut link: Option<Link> = None;
    while !cancel.is_cancelled() {
        let outcome = match link.as_mut() {
            Some(l) => tokio::select! {
                _ = cancel.cancelled() => return,
                r = pass(l, ledger, config, None, cancel) => r,
            },
            None => tokio::select! {
                _ = cancel.cancelled() => return,
                r = connect(config) => r.map(|l| {
                    link = Some(l);
                    0
                }),
            },
        };
        match outcome {
            Ok(_) => {
                if let Some(since) = failing_since.take() {
                    tracing::info!(
                        down_for = %humantime::format_duration(Duration::from_secs(since.elapsed().as_secs())),
                        "JetStream shipping: the stream takes events again"
                    );
                }
                backoff = Duration::from_secs(1);
                if link.as_ref().is_some_and(|l| l.loaded) && !nap(config.poll, cancel).await {
                    return;
                }
                continue;
            }
            Err(ShipError::Refused(why)) => {
                refused.inc();
                tracing::error!(
                    "JetStream shipping refused (custody goes on; shipping retries, the cursor holds): {why}"
                );
                failing_since.get_or_insert_with(Instant::now);
            }
            Err(e) => {
                if failing_since.is_none() {
                    failing_since = Some(Instant::now());
                    tracing::warn!(
                        servers = %config.servers_text(),
                        "JetStream shipping failed, retrying with backoff (custody goes on): {e}"
                    );
                } else {
                    tracing::debug!("JetStream shipping failed again: {e}");
                }
                // The position is read again from the ledger on the next try.
                if let Some(l) = link.as_mut() {
                    l.loaded = false;
                }
            }
        }
        if !nap(backoff, cancel).await {
            return;
        }
        backoff = (backoff * 2).min(Duration::from_secs(30));
    }
}

/// A header of a message the stream holds, as text.
fn header(m: &async_nats::Message, name: &str) -> Option<String> {
    m.headers
        .as_ref()
        .and_then(|h| h.get(name))
        .map(|v| v.as_str().to_string())
}

/// One message of a host's subject, as the stream holds it.
#[derive(Clone, Debug)]
pub struct StoredEvent {
    pub stream_seq: u64,
    /// `Nats-Msg-Id` and `ce-id`, when present.
    pub msg_id: Option<String>,
    pub ce_id: Option<String>,
    pub body: Vec<u8>,
}

/// Every message of `host`'s subject, in stream order, read by an
/// ephemeral pull consumer (`fleet verify`): the stream alone, no ledger.
pub fn read_host(config: &NatsConfig, host: &str) -> Result<Vec<StoredEvent>, ShipError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| ShipError::Unreachable(format!("runtime: {e}")))?;
    rt.block_on(read_host_async(config, host))
}

async fn read_host_async(config: &NatsConfig, host: &str) -> Result<Vec<StoredEvent>, ShipError> {
    use futures_util::StreamExt;
    use jetstream::consumer;
    let subject = subject_of(host);
    let unreachable = |e: &dyn std::fmt::Display| ShipError::Unreachable(format!("{subject}: {e}"));
    let stream = context(config)
        .await?
        .get_stream(&config.stream)
        .await
        .map_err(|e| unreachable(&format!("stream {}: {e}", config.stream)))?;
    let last = match subject_head(&stream, &subject).await {
        Ok(Some((_, _, at))) => at,
        Ok(None) => return Ok(Vec::new()),
        // A message that is no event still bounds the read; the walk names it.
        Err(ShipError::Refused(_)) => {
            stream
                .get_last_raw_message_by_subject(&subject)
                .await
                .map_err(|e| unreachable(&e))?
                .sequence
        }
        Err(e) => return Err(e),
    };
    let consumer = stream
        .create_consumer(consumer::pull::Config {
            filter_subject: subject.clone(),
            deliver_policy: consumer::DeliverPolicy::All,
            ack_policy: consumer::AckPolicy::None,
            inactive_threshold: Duration::from_secs(60),
            ..Default::default()
        })
        .await
        .map_err(|e| unreachable(&e))?;
    let mut out: Vec<StoredEvent> = Vec::new();
    while out.last().is_none_or(|m| m.stream_seq < last) {
        let mut batch = consumer
            .fetch()
            .max_messages(1000)
            .expires(config.timeout)
            .messages()
            .await
            .map_err(|e| unreachable(&e))?;
        let before = out.len();
        while let Some(m) = batch.next().await {
            let m = m.map_err(|e| unreachable(&e))?;
            let stream_seq = m.info().map_err(|e| unreachable(&e))?.stream_sequence;
            out.push(StoredEvent {
                stream_seq,
                msg_id: header(&m, "Nats-Msg-Id"),
                ce_id: header(&m, "ce-id"),
                body: m.payload.to_vec(),
            });
        }
        if out.len() == before {
            return Err(ShipError::Unreachable(format!(
                "{subject}: the stream stopped delivering at stream seq {} of {last}",
                out.last().map_or(0, |m| m.stream_seq)
            )));
        }
    }
    Ok(out)
}

/// The subject every host ships to.
pub const ALL_HOSTS: &str = "treewarden.*.events";

/// The host a subject names (`treewarden.<host>.events`).
pub fn host_of_subject(subject: &str) -> Option<&str> {
    subject
        .strip_prefix("treewarden.")?
        .strip_suffix(".events")
        .filter(|h| valid_host_id(h))
}

/// `fleet serve`'s side of the stream: a durable pull consumer over every
/// host's subject. Every `fleet serve` naming the same consumer shares its
/// messages (JetStream hands each to one of them); a message is acked only
/// after the caller stored it, so the consumer's ack floor is a stream
/// sequence below which every message is in the index.
pub struct FleetReader {
    js: jetstream::Context,
    stream: stream::Stream,
    consumer: jetstream::consumer::PullConsumer,
    name: String,
}

/// At most this many messages delivered and not yet acked: past it the
/// server delivers nothing more until acks come back.
pub const FLEET_MAX_ACK_PENDING: u64 = 20_000;

/// One message received by [`FleetReader::fetch`], to ack once stored.
pub struct Received {
    pub message: crate::ledger::fleet::FleetMessage,
    raw: jetstream::Message,
}

/// Where the fleet's consumer stands.
#[derive(Clone, Copy, Debug, Default)]
pub struct ConsumerPosition {
    /// Every message at or below this stream sequence was acked.
    pub ack_floor: u64,
    /// Messages not delivered yet.
    pub pending: u64,
    /// Messages delivered, not acked yet.
    pub ack_pending: u64,
}

impl FleetReader {
    /// Connects, makes the stream where absent (as a shipper would) and
    /// binds the durable consumer `name` (made where absent, from the
    /// stream's first message).
    pub async fn connect(config: &NatsConfig, name: &str) -> Result<FleetReader, ShipError> {
        use jetstream::consumer;
        let link = connect(config).await?;
        let consumer = link
            .stream
            .get_or_create_consumer(
                name,
                consumer::pull::Config {
                    durable_name: Some(name.to_string()),
                    filter_subject: ALL_HOSTS.into(),
                    deliver_policy: consumer::DeliverPolicy::All,
                    ack_policy: consumer::AckPolicy::Explicit,
                    ack_wait: Duration::from_secs(30),
                    max_ack_pending: FLEET_MAX_ACK_PENDING as i64,
                    ..Default::default()
                },
            )
            .await
            .map_err(|e| ShipError::Unreachable(format!("consumer {name}: {e}")))?;
        Ok(FleetReader {
            js: link.js,
            stream: link.stream,
            consumer,
            name: name.to_string(),
        })
    }

    /// Asks the consumer's leader to step down, so that its replicas elect
    /// another from the replicated state. A replicated consumer that lost
    /// its quorum can come back with a leader that answers pull requests
    /// with nothing while messages are pending; a new leader serves them.
    /// A consumer of one replica has no one to step down for: the server
    /// says so, and that answer is returned as an error.
    pub async fn step_down(&self) -> Result<(), ShipError> {
        let subject = format!(
            "CONSUMER.LEADER.STEPDOWN.{}.{}",
            self.stream.cached_info().config.name,
            self.name
        );
        let answer: serde_json::Value = self
            .js
            .request(subject, &serde_json::json!({}))
            .await
            .map_err(|e| ShipError::Unreachable(format!("consumer step-down: {e}")))?;
        match answer.get("error") {
            Some(e) => Err(ShipError::Unreachable(format!("consumer step-down: {e}"))),
            None => Ok(()),
        }
    }

    /// Up to `max` messages, waiting at most `wait` for the first.
    pub async fn fetch(&self, max: usize, wait: Duration) -> Result<Vec<Received>, ShipError> {
        use futures_util::StreamExt;
        let failed = |e: &dyn std::fmt::Display| ShipError::Unreachable(format!("fetch: {e}"));
        let mut batch = self
            .consumer
            .fetch()
            .max_messages(max)
            .expires(wait)
            .messages()
            .await
            .map_err(|e| failed(&e))?;
        let mut out = Vec::new();
        while let Some(m) = batch.next().await {
            let m = m.map_err(|e| failed(&e))?;
            let stream_seq = m.info().map_err(|e| failed(&e))?.stream_sequence;
            let message = crate::ledger::fleet::FleetMessage {
                stream_seq,
                host: host_of_subject(m.subject.as_str())
                    .unwrap_or("-")
                    .to_string(),
                msg_id: header(&m, "Nats-Msg-Id"),
                ce_id: header(&m, "ce-id"),
                body: m.payload.to_vec(),
            };
            out.push(Received { message, raw: m });
        }
        Ok(out)
    }

    /// Acks what the caller stored.
    pub async fn ack(&self, stored: &[Received]) -> Result<(), ShipError> {
        for r in stored {
            r.raw
                .ack()
                .await
                .map_err(|e| ShipError::Unreachable(format!("ack: {e}")))?;
        }
        Ok(())
    }

    pub async fn position(&mut self) -> Result<ConsumerPosition, ShipError> {
        let info = self
            .consumer
            .info()
            .await
            .map_err(|e| ShipError::Unreachable(format!("consumer info: {e}")))?;
        Ok(ConsumerPosition {
            ack_floor: info.ack_floor.stream_sequence,
            pending: info.num_pending,
            ack_pending: info.num_ack_pending as u64,
        })
    }

    /// How many messages the stream holds per host.
    pub async fn per_host(&mut self) -> Result<std::collections::BTreeMap<String, u64>, ShipError> {
        use futures_util::StreamExt;
        let failed =
            |e: &dyn std::fmt::Display| ShipError::Unreachable(format!("stream info: {e}"));
        let mut subjects = self
            .stream
            .info_with_subjects(ALL_HOSTS)
            .await
            .map_err(|e| failed(&e))?;
        let mut out = std::collections::BTreeMap::new();
        while let Some(item) = subjects.next().await {
            let (subject, n) = item.map_err(|e| failed(&e))?;
            if let Some(host) = host_of_subject(&subject) {
                out.insert(host.to_string(), n as u64);
            }
        }
        Ok(out)
    }
}

/// `fleet rebuild`: deletes the durable consumer `name` (absent is fine),
/// so the next `fleet serve` makes it again from the stream's first message.
pub fn delete_fleet_consumer(config: &NatsConfig, name: &str) -> Result<bool, ShipError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| ShipError::Unreachable(format!("runtime: {e}")))?;
    rt.block_on(async {
        let js = context(config).await?;
        let stream = match js.get_stream(&config.stream).await {
            Ok(s) => s,
            Err(e) if e.to_string().contains("not found") => return Ok(false),
            Err(e) => {
                return Err(ShipError::Unreachable(format!(
                    "stream {}: {e}",
                    config.stream
                )));
            }
        };
        match stream.delete_consumer(name).await {
            Ok(_) => Ok(true),
            Err(e) if e.to_string().contains("not found") => Ok(false),
            Err(e) => Err(ShipError::Unreachable(format!("consumer {name}: {e}"))),
        }
    })
}

/// What `fleet verify` proved of a host's events in the stream.
#[derive(Debug)]
pub struct HostReport {
    pub events: usize,
    /// The newest event's seq and hash.
    pub head: Option<(i64, String)>,
    pub sealed: Option<crate::ledger::SealReport>,
}

/// `fleet verify`: a host's events as the stream alone holds them, checked
/// for continuity (each seq the one after the last: no gap, no rewind; each
/// message's ids naming its own event), then walked as an export is
/// (`ledger::verify_export`: every hash recomputed, every `prev_hash` the
/// previous event's hash, and with `seal_key` every seal). `Ok(Err(why))`:
/// the first break, naming the seq.
pub fn verify_host(
    stored: &[StoredEvent],
    host: &str,
    seal: Option<crate::ledger::seal::SealVerifier>,
) -> Result<Result<HostReport, String>, ShipError> {
    let mut lines = String::new();
    let mut seqs = Vec::with_capacity(stored.len());
    let mut prev: Option<i64> = None;
    let mut last_at: Option<std::time::SystemTime> = None;
    for m in stored {
        let Ok(e) = serde_json::from_slice::<EventRow>(&m.body) else {
            return Ok(Err(format!(
                "stream seq {}: not a treewarden event",
                m.stream_seq
            )));
        };
        if let Some(p) = prev {
            if e.seq <= p {
                return Ok(Err(format!(
                    "seq {}: after seq {p} (stream seq {}): the host's sequence went back (a rewind or a fork in the stream)",
                    e.seq, m.stream_seq
                )));
            }
            if e.seq != p + 1 {
                return Ok(Err(format!(
                    "seq {}: after seq {p} (stream seq {}): seqs {} to {} are missing",
                    e.seq,
                    m.stream_seq,
                    p + 1,
                    e.seq - 1
                )));
            }
        }
        let want_id = message_id(host, &e);
        if m.msg_id.as_deref() != Some(want_id.as_str())
            || m.ce_id.as_deref() != Some(format!("{host}:{}", e.seq).as_str())
        {
            return Ok(Err(format!(
                "seq {}: its message ids ({:?}, {:?}) are not this event's ({want_id})",
                e.seq, m.msg_id, m.ce_id
            )));
        }
        prev = Some(e.seq);
        last_at = humantime::parse_rfc3339(&e.at).ok().or(last_at);
        seqs.push(e.seq);
        lines.push_str(&String::from_utf8_lossy(&m.body));
        lines.push('\n');
    }
    // The walk reads a file: the events, written where only this user reads.
    let path = std::env::temp_dir().join(format!(
        "treewarden-fleet-{host}-{}-{}.ndjson",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    ));
    let written = {
        use crate::ledger::fsmode::Mode as _;
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create_new(true).mode(0o600);
        options.open(&path).and_then(|mut f| {
            use std::io::Write as _;
            f.write_all(lines.as_bytes())
        })
    };
    if let Err(e) = written {
        let _ = std::fs::remove_file(&path);
        return Err(ShipError::Ledger(format!("{}: {e}", path.display())));
    }
    // The stream has no trailer: its seals are judged as of its last event
    // (how stale the host's shipping is, is the lag's to say).
    let walked = crate::ledger::verify_trail_as_of(
        &path,
        seal,
        last_at.unwrap_or_else(std::time::SystemTime::now),
    );
    let _ = std::fs::remove_file(&path);
    let (report, sealed) = walked.map_err(|e| ShipError::Ledger(e.to_string()))?;
    if let Some(found) = report.first_break {
        // A break the walk names by line is named by the event on it.
        let line_seq = found
            .what
            .strip_prefix("line ")
            .and_then(|rest| rest.split(':').next())
            .and_then(|n| n.parse::<usize>().ok())
            .and_then(|n| seqs.get(n.wrapping_sub(1)));
        return Ok(Err(match (found.seq, line_seq) {
            (Some(_), _) | (None, None) => found.to_string(),
            (None, Some(seq)) => format!("seq {seq}: {}", found.what),
        }));
    }
    Ok(Ok(HostReport {
        events: stored.len(),
        head: report.head,
        sealed,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_configured_host_id_is_a_subject_token_or_refused() {
        assert_eq!(host_id(Some("build-17_a")).as_deref(), Ok("build-17_a"));
        for bad in ["", "a.b", "a*", "a>", "a b", &"x".repeat(65)] {
            let e = host_id(Some(bad)).expect_err(bad);
            assert!(e.contains("NATS subject token"), "{e}");
        }
        // Unconfigured: the machine id or the host name, always a token.
        let id = host_id(None).expect("a host id");
        assert!(valid_host_id(&id), "{id}");
    }

    #[test]
    fn servers_are_nats_urls_and_each_bad_value_is_named() {
        let c = NatsConfig::new("nats://127.0.0.1:4222, 127.0.0.1:4223", None, Some("h"), 3)
            .expect("two servers");
        assert_eq!(c.servers_text(), "127.0.0.1:4222,127.0.0.1:4223");
        assert_eq!(c.subject(), "treewarden.h.events");
        let e = NatsConfig::new("http://127.0.0.1:4222", None, Some("h"), 1).expect_err("http");
        assert!(e.starts_with("http://127.0.0.1:4222: "), "{e}");
        assert!(NatsConfig::new(" , ", None, Some("h"), 1).is_err());
        assert!(NatsConfig::new("nats://h:4222", None, Some("h"), 0).is_err());
        assert!(NatsConfig::new("nats://h:4222", None, Some("h"), 6).is_err());
        let e = NatsConfig::new(
            "nats://h:4222",
            Some("/nonexistent/tw.creds".into()),
            Some("h"),
            1,
        )
        .expect_err("creds");
        assert!(e.contains("no such credentials file"), "{e}");
    }

    #[test]
    fn the_message_id_carries_the_hash_so_a_fork_is_no_duplicate() {
        let event = |hash: &str| EventRow {
            seq: 7,
            at: "2026-01-01T00:00:00.000Z".into(),
            tree: None,
            kind: crate::ledger::RowKind::Unknown("x.y".into()),
            data: serde_json::json!({}),
            prev_hash: "0".repeat(64),
            hash: hash.into(),
        };
        let a = message_id("h", &event(&"a".repeat(64)));
        let b = message_id("h", &event(&"b".repeat(64)));
        assert_eq!(a, format!("h:7:{}", "a".repeat(16)));
        assert_ne!(a, b);
        assert_eq!(
            shipped_event(&serde_json::to_vec(&event(&"a".repeat(64))).expect("json")),
            Some((7, "a".repeat(64)))
        );
    }
}
