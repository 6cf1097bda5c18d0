//! `GET /api/export`: the audit trail for incident review, as NDJSON or
//! CSV, exactly as `treewarden export` writes it.

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use serde::Deserialize;

use super::AppState;
use super::api::parse_since_query;
use super::error::{ApiError, ApiQuery};
use crate::ledger::{EventFilter, ExportFormat, TreeId};

#[derive(Deserialize, utoipa::IntoParams)]
pub struct ExportQuery {
    /// `ndjson` (default) or `csv`.
    pub format: Option<String>,
    /// RFC 3339 time, or an age such as `2h`.
    pub since: Option<String>,
    pub tree: Option<i64>,
}

/// The audit trail (hash-chained events), NDJSON or CSV.
#[utoipa::path(get, path = "/api/export", params(ExportQuery),
    responses((status = 200, description = "NDJSON or CSV", content_type = "application/x-ndjson", body = String),
    (status = 400, body = super::api::ErrorBody), (status = 401, body = super::api::ErrorBody),
    (status = 503, body = super::api::ErrorBody)))]
pub async fn export(
    State(s): State<AppState>,
    ApiQuery(q): ApiQuery<ExportQuery>,
) -> Result<impl IntoResponse, ApiError> {
    let format: ExportFormat = q
        .format
        .as_deref()
        .unwrap_or("ndjson")
        .parse()
        .map_err(ApiError::BadRequest)?;
    let since = parse_since_query(q.since.as_deref())?;
    let filter = EventFilter {
        since,
        tree: q.tree.map(TreeId),
        ..EventFilter::default()
    };
    let bytes = s
        .service
        .read(move |e| {
            let mut out = Vec::new();
            e.ledger().export(&filter, format, &mut out)?;
            Ok(out)
        })
        .await?;
    let content_type = match format {
        ExportFormat::Ndjson => "application/x-ndjson",
        ExportFormat::Csv => "text/csv; charset=utf-8",
    };
    Ok(([(header::CONTENT_TYPE, content_type)], bytes))
}
