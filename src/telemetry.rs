//! Logs and traces. Logs go to stderr (text, or JSON with `--log-format
//! json`) so command output on stdout stays clean. When
//! `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`)
//! is set, spans (spawn, teardown and its phases, sweep, HTTP requests) are
//! also exported over OTLP/HTTP (protobuf) by a batch processor on its own
//! thread; otherwise no exporter exists at all.
//!
//! It must never make the service fail: an exporter that cannot be built
//! is logged and skipped.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// Whether log lines on stderr get ANSI colours: only on a terminal, and
/// never with `NO_COLOR` set to anything (https://no-color.org).
pub fn use_color() -> bool {
    std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// How logs are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
#[value(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

impl std::str::FromStr for LogFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "text" => Ok(Self::Text),
            "json" => Ok(Self::Json),
            other => Err(format!(
                "unknown log format {other:?}: expected text or json"
            )),
        }
    }
}

/// Keeps the exporter alive; [`Telemetry::shutdown`] flushes it.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

/// How long `serve` waits for its last spans to reach the collector.
pub const FLUSH_BOUND: std::time::Duration = std::time::Duration::from_secs(2);

impl Telemetry {
    /// Whether spans are exported.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Flushes pending spans and stops the exporter, waiting at most
    /// [`FLUSH_BOUND`]: a collector that hangs must not keep `serve` alive
    /// past its drain (a supervisor's SIGKILL window). Spans not sent by
    /// then are dropped, with a line on stderr.
    pub fn shutdown(self) {
        let Some(provider) = self.provider else {
            return;
        };
        let (done, finished) = std::sync::mpsc::channel();
        let flusher = std::thread::Builder::new()
            .name("tw-otlp-flush".into())
            .spawn(move || {
                if let Err(e) = provider.force_flush() {
                    eprintln!("treewarden: flushing spans failed: {e}");
                }
                if let Err(e) = provider.shutdown() {
                    eprintln!("treewarden: stopping the span exporter failed: {e}");
                }
                let _ = done.send(());
            });
        if flusher.is_ok() && finished.recv_timeout(FLUSH_BOUND).is_err() {
            eprintln!(
                "treewarden: span export did not finish within {}: remaining spans dropped",
                humantime::format_duration(FLUSH_BOUND)
            );
        }
    }
}

fn otlp_configured() -> bool {
    [
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    ]
    .iter()
    .any(|v| std::env::var_os(v).is_some_and(|s| !s.is_empty()))
}

fn otlp_provider() -> Result<SdkTracerProvider, String> {
    use opentelemetry_otlp::{Protocol, WithExportConfig};
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .build()
        .map_err(|e| e.to_string())?;
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name("treewarden")
        .build();
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource)
        .build())
}

/// Installs the global subscriber. `default_filter` applies unless
/// `TREEWARDEN_LOG` says otherwise.
pub fn init(format: LogFormat, default_filter: &str) -> Telemetry {
    let filter = || {
        EnvFilter::try_from_env("TREEWARDEN_LOG").unwrap_or_else(|_| EnvFilter::new(default_filter))
    };
    let fmt = match format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_ansi(use_color())
            .with_writer(std::io::stderr)
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_writer(std::io::stderr)
            .boxed(),
    };
    let (provider, otel_error) = if otlp_configured() {
        match otlp_provider() {
            Ok(p) => (Some(p), None),
            Err(e) => (None, Some(e)),
        }
    } else {
        (None, None)
    };
    let otel = provider.as_ref().map(|p| {
        tracing_opentelemetry::layer()
            .with_tracer(p.tracer("treewarden"))
            .with_filter(filter())
    });
    let _ = tracing_subscriber::registry()
        .with(fmt.with_filter(filter()))
        .with(otel)
        .try_init();
    if let Some(e) = otel_error {
        tracing::error!(error = %e, "OTLP exporter not started; spans are not exported");
    }
    Telemetry { provider }
}
