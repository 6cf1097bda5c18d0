//! `GET /api/export`: the audit trail for incident review, as NDJSON or
//! CSV, exactly as `treewarden export` writes it, streamed from the ledger
//! page by page (constant memory), as a download (`Content-Disposition`,
//! a file name with the host and the time).
//! `after=SEQ` makes it incremental: exactly the events after SEQ.
//! Narrowed by `since`, `until`, `tree` or `kind`, the NDJSON proves
//! itself as the CLI's does (`ledger/export.rs`).

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use serde::Deserialize;

use super::AppState;
use super::api::parse_since_query;
use super::error::{ApiError, ApiQuery};
use crate::ledger::{EventFilter, EventSearch, ExportFormat, TreeId};

#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ExportQuery {
    /// `ndjson` (default; the evidence `verify --export` checks), `csv`, or
    /// `ocsf` (OCSF 1.5.0 Process Activity for a SIEM: a view whose records
    /// name the seq and hash of the events they came from; other kinds are
    /// left out).
    #[param(pattern = "^(ndjson|csv|ocsf)$")]
    pub format: Option<String>,
    /// Events at or after this RFC 3339 time (with an offset), or within an
    /// age such as `2h`.
    #[param(format = DateTime)]
    pub since: Option<String>,
    /// Events before this time (same forms as `since`).
    #[param(format = DateTime)]
    pub until: Option<String>,
    pub tree: Option<i64>,
    /// Events whose kind starts with this (`kill.`, `signal.sent`). With
    /// `since`, `until` or `tree`, an NDJSON export carries the inclusion
    /// proofs and Merkle root `treewarden verify --export` checks.
    #[param(min_length = 1)]
    pub kind: Option<String>,
    /// Only events with a greater seq (an incremental export resumes from
    /// the last seq it received).
    #[param(minimum = 0)]
    pub after: Option<i64>,
}

/// The audit trail (hash-chained events), NDJSON or CSV, or its OCSF view.
#[utoipa::path(get, path = "/api/export", params(ExportQuery), security(("bearer" = [])),
    responses((status = 200, description = "NDJSON, CSV or OCSF NDJSON", content((String = "application/x-ndjson"), (String = "text/csv"))),
    (status = 400, body = super::api::ErrorBody), (status = 401, body = super::api::ErrorBody), (status = 403, body = super::api::ErrorBody),
    (status = 503, body = super::api::ErrorBody)))]
pub async fn export(
    State(s): State<AppState>,
    axum::Extension(principal): axum::Extension<super::auth::Principal>,
    ApiQuery(q): ApiQuery<ExportQuery>,
) -> Result<impl IntoResponse, ApiError> {
    principal.must_see_all("the export")?;
    let format: ExportFormat = q
        .format
        .as_deref()
        .unwrap_or("ndjson")
        .parse()
        .map_err(ApiError::BadRequest)?;
    let since = parse_since_query(q.since.as_deref())?;
    let until = parse_since_query(q.until.as_deref())?;
    if q.kind.as_deref().is_some_and(str::is_empty) {
        return Err(ApiError::BadRequest("kind: a kind or its prefix".into()));
    }
    if q.after.is_some_and(|a| a < 0) {
        return Err(ApiError::BadRequest("after: a seq is 0 or more".into()));
    }
    let filter = EventFilter {
        since,
        tree: q.tree.map(TreeId),
        after_seq: q.after,
        kind_prefix: q.kind,
        search: EventSearch {
            until,
            ..EventSearch::default()
        },
        ..EventFilter::default()
    };
    let chunks = s.service.export_stream(filter, format).await?;
    let body =
        axum::body::Body::from_stream(futures_util::stream::unfold(chunks, |mut rx| async move {
            rx.recv().await.map(|chunk| (chunk, rx))
        }));
    let content_type = match format {
        ExportFormat::Ndjson | ExportFormat::Ocsf => "application/x-ndjson",
        ExportFormat::Csv => "text/csv; charset=utf-8",
    };
    // The host and the time in the name: files from many hosts side by side.
    let name = crate::ledger::export_file_name(format, std::time::SystemTime::now());
    let disposition = format!("attachment; filename=\"{name}\"");
    Ok((
        [
            (header::CONTENT_TYPE, content_type.to_string()),
            (header::CONTENT_DISPOSITION, disposition),
        ],
        body,
    ))
}
