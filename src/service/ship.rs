//! Shipping the audit trail over OTLP: where
//! `OTEL_EXPORTER_OTLP_ENDPOINT` or `serve --ship-otlp URL` is set, every
//! committed ledger event leaves the host as one OpenTelemetry log record
//! (OTLP/HTTP protobuf to `<endpoint>/v1/logs`; body = the event's export
//! line, `{"seq","at","tree","kind","data","prev_hash","hash"}`; attributes
//! `seq`, `kind`, `tree` (absent for tree-less events), `hash` and `host`;
//! resource `service.name=treewarden`, `host.name`), in seq order, in
//! batches, from a durable cursor.
//!
//! Why not the SDK's batch processor: it hands records to the exporter on
//! its own schedule and drops them when its queue is full or the endpoint
//! stays down, and it never says which records were delivered. A durable
//! cursor needs exactly that, so this thread builds the batches itself and
//! calls the OTLP crate's `LogExporter::export` directly (the crate still
//! does the protobuf and the HTTP): a batch is the next events after the
//! cursor, and the cursor (`ship_cursor`, in the ledger) advances only when
//! the endpoint answered 2xx for the whole batch. Delivery is therefore
//! at-least-once: a crash between the answer and the cursor write sends
//! that batch again; receivers deduplicate by `seq` / `hash`.
//!
//! It never blocks custody: it runs on a thread of its own with a ledger
//! handle of its own, reads are WAL snapshots, and its only write is the
//! one-row cursor update. An endpoint that is down costs retries with
//! backoff (1 s doubling to 30 s) on this thread and a growing
//! `treewarden_ship_lag_events`, nothing else.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use opentelemetry::InstrumentationScope;
use opentelemetry::logs::{AnyValue, LogRecord as _, Logger as _, LoggerProvider as _, Severity};
use opentelemetry_sdk::logs::{LogBatch, LogExporter as _, SdkLogRecord, SdkLoggerProvider};

use crate::ledger::{EventFilter, EventRow, Ledger};

/// The cursor's name in the ledger.
pub const SINK: &str = "otlp";

/// What shipping needs.
#[derive(Clone, Debug)]
pub struct ShipConfig {
    /// The OTLP/HTTP base endpoint (`http://127.0.0.1:4318`); records go to
    /// `<endpoint>/v1/logs`.
    pub endpoint: String,
    /// `host.name` on every record.
    pub host: String,
    /// Events per batch.
    pub batch: usize,
    /// How often to look for new events when caught up.
    pub poll: Duration,
    /// Per-request timeout.
    pub timeout: Duration,
}

/// This host's name, as the shipped records carry it.
fn host_name() -> String {
    crate::proc::host_name()
}

impl ShipConfig {
    /// The endpoint `--ship-otlp URL` gives, else `OTEL_EXPORTER_OTLP_ENDPOINT`;
    /// `None`: shipping is off.
    pub fn from_flag_or_env(flag: Option<&str>) -> Option<ShipConfig> {
        let endpoint = flag
            .map(str::to_string)
            .or_else(|| std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT").ok())
            .filter(|s| !s.trim().is_empty())?;
        Some(ShipConfig {
            endpoint: endpoint.trim().trim_end_matches('/').to_string(),
            host: host_name(),
            batch: 512,
            poll: Duration::from_millis(500),
            timeout: Duration::from_secs(5),
        })
    }

    pub fn logs_url(&self) -> String {
        format!("{}/v1/logs", self.endpoint)
    }
}

/// The running shipper; [`Shipper::stop`] ends it after the batch in
/// flight (bounded by the request timeout).
pub struct Shipper {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

impl Shipper {
    /// Builds the exporter (an unusable endpoint is an error here, at
    /// start) and starts the thread. Nothing here waits on the ledger.
    pub fn start(ledger: Ledger, config: ShipConfig) -> Result<Shipper, String> {
        use opentelemetry_otlp::{Protocol, WithExportConfig};
        let mut exporter = opentelemetry_otlp::LogExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(config.logs_url())
            .with_timeout(config.timeout)
            .build()
            .map_err(|e| format!("OTLP log exporter for {}: {e}", config.logs_url()))?;
        let resource = opentelemetry_sdk::Resource::builder()
            .with_service_name("treewarden")
            .with_attribute(opentelemetry::KeyValue::new(
                "host.name",
                config.host.clone(),
            ))
            .build();
        exporter.set_resource(&resource);
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("tw-ship-otlp".into())
            .spawn(move || run(&ledger, &exporter, &config, &flag))
            .map_err(|e| format!("shipping thread: {e}"))?;
        Ok(Shipper { stop, thread })
    }

    pub fn stop(self) {
        self.stop.store(true, Ordering::SeqCst);
        super::join(self.thread, "OTLP shipping thread");
    }
}

/// Sleeps `d` in short steps; false when asked to stop meanwhile.
fn nap(d: Duration, stop: &AtomicBool) -> bool {
    let until = Instant::now() + d;
    while Instant::now() < until {
        if stop.load(Ordering::SeqCst) {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50).min(until - Instant::now()));
    }
    !stop.load(Ordering::SeqCst)
}

// Over 100 lines on purpose: one loop whose state (the backoff, `failing_since`) carries from turn
// to turn; each failure naps, then continues, or returns once stopped; split, every
// `continue`/`return` would become a result for the caller to interpret.
fn run(
    ledger: &Ledger,
    exporter: &opentelemetry_otlp::LogExporter,
    config: &ShipConfig,
    stop: &AtomicBool,
) {
    // Records are made by a logger of a provider with no processor: only
    // its record type is used; the records go to `exporter` by hand.
    let provider = SdkLoggerProvider::builder().build();
    let logger = provider.logger("treewarden");
    let scope = InstrumentationScope::builder("treewarden.ledger").build();
    let mut backoff = Duration::from_secs(1);
    let mut failing_since: Option<Instant> = None;
    while !stop.load(Ordering::SeqCst) {
        let cursor = match ledger.ship_cursor(SINK) {
            Ok(Some(c)) => c,
            Ok(None) => {
                // The cursor row exists from the first start on (the lag
                // metric and the prune's bound read it). A ledger busy at
                // start delays this, never the service.
                if let Err(e) = ledger.init_ship_cursor(SINK) {
                    tracing::warn!("OTLP shipping: cannot create the cursor: {e}");
                    if !nap(backoff, stop) {
                        return;
                    }
                    continue;
                }
                0
            }
            Err(e) => {
                tracing::warn!("OTLP shipping: cannot read the cursor: {e}");
                if !nap(backoff, stop) {
                    return;
                }
                continue;
            }
        };
        let events = match ledger.events(&EventFilter {
            after_seq: Some(cursor),
            limit: Some(config.batch),
            ..EventFilter::default()
        }) {
            Ok(events) => events,
            Err(e) => {
                tracing::warn!("OTLP shipping: cannot read events: {e}");
                if !nap(backoff, stop) {
                    return;
                }
                continue;
            }
        };
        let Some(last) = events.last().map(|e| e.seq) else {
            if !nap(config.poll, stop) {
                return;
            }
            continue;
        };
        let records: Vec<SdkLogRecord> = events
            .iter()
            .map(|e| {
                let mut r = logger.create_log_record();
                record(&mut r, e, &config.host);
                r
            })
            .collect();
        let pairs: Vec<(&SdkLogRecord, &InstrumentationScope)> =
            records.iter().map(|r| (r, &scope)).collect();
        match futures_executor::block_on(exporter.export(LogBatch::new(&pairs))) {
            Ok(()) => {
                if let Some(since) = failing_since.take() {
                    tracing::info!(
                        down_for = %humantime::format_duration(Duration::from_secs(since.elapsed().as_secs())),
                        "OTLP shipping: the endpoint takes events again"
                    );
                }
                backoff = Duration::from_secs(1);
                // Acknowledged: the cursor moves. If this write fails, the
                // batch is sent again (at-least-once).
                if let Err(e) = ledger.set_ship_cursor(SINK, last) {
                    tracing::warn!("OTLP shipping: cannot advance the cursor to {last}: {e}");
                    if !nap(backoff, stop) {
                        return;
                    }
                }
            }
            Err(e) => {
                if failing_since.is_none() {
                    failing_since = Some(Instant::now());
                    tracing::warn!(
                        endpoint = %config.logs_url(),
                        "OTLP shipping: export failed, retrying with backoff (custody goes on): {e}"
                    );
                } else {
                    tracing::debug!("OTLP shipping: export failed again: {e}");
                }
                if !nap(backoff, stop) {
                    return;
                }
                backoff = (backoff * 2).min(Duration::from_secs(30));
            }
        }
    }
}

/// One event as a log record: body = its export line, attributes = what a
/// pipeline routes and deduplicates on.
fn record(r: &mut SdkLogRecord, e: &EventRow, host: &str) {
    let at = humantime::parse_rfc3339(&e.at).unwrap_or(SystemTime::UNIX_EPOCH);
    r.set_timestamp(at);
    r.set_observed_timestamp(SystemTime::now());
    r.set_severity_number(Severity::Info);
    r.set_severity_text("INFO");
    r.set_event_name("treewarden.ledger.event");
    let body = serde_json::to_string(e).unwrap_or_default();
    r.set_body(AnyValue::from(body));
    r.add_attribute("seq", e.seq);
    r.add_attribute("kind", e.kind.to_string());
    if let Some(tree) = e.tree {
        r.add_attribute("tree", tree.0);
    }
    r.add_attribute("hash", e.hash.clone());
    r.add_attribute("host", host.to_string());
}
