//! `GET /metrics`: refreshes the gauges read at scrape time (trees by
//! state, dispatch closed, the newest unkillable tree, ledger head, shipping lag, observer health, orphans pending) and encodes the registry, as
//! OpenMetrics when the scraper asks for it, else the Prometheus text format.

use axum::extract::State;
use axum::http::{HeaderMap, header};
use axum::response::IntoResponse;

use super::AppState;
use super::error::ApiError;

pub async fn metrics(
    State(s): State<AppState>,
    headers: HeaderMap,
) -> Result<impl IntoResponse, ApiError> {
    let crate::service::MetricsReadings {
        counts,
        unsettled,
        unkillable,
        head,
        shipped,
    } = s.service.door().metrics_readings().await?;
    let m = s.service.metrics();
    m.set_tree_counts(&counts);
    m.dispatch_closed.set(i64::from(!unsettled.is_empty()));
    m.unkillable_tree.set(unkillable.map_or(0, |t| t.0));
    // The one place the head gauge is set: the ledger's own head, host-wide.
    let head_seq = head.map_or(0, |(seq, _)| seq);
    m.ledger_head_seq.set(head_seq);
    if let Some(acked) = shipped {
        m.ship_acked_seq.set(acked);
        m.ship_lag_events.set((head_seq - acked).max(0));
    }
    s.service.sync_engine_metrics();
    m.sync_http(super::closer::cut_off_total());
    m.sync_observer(s.service.observer_status().ok().as_ref());
    let recovery = s.service.recovery();
    m.orphans_pending
        .set(i64::try_from(recovery.counts.pending()).unwrap_or(i64::MAX));
    m.recovering.set(i64::from(recovery.running));
    let openmetrics = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("application/openmetrics-text"));
    let (body, content_type) = if openmetrics {
        (
            m.encode_openmetrics(),
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )
    } else {
        (m.encode_text(), "text/plain; version=0.0.4; charset=utf-8")
    };
    let body = body.map_err(|e| ApiError::Internal(format!("encoding metrics: {e}")))?;
    Ok(([(header::CONTENT_TYPE, content_type)], body))
}
