//! One error type for every HTTP answer that is not a success, and the one
//! place that picks its status: an exhaustive match, no `_` arm, so a new
//! engine or ledger error cannot slip through with a guessed status.
//!
//! Bodies are `{"error": "...", "code": "..."}` (plus `"tree"` where one is
//! named): `error` is the message for a person, `code` ([`ErrorCode`]) what
//! a client branches on (the Python client maps it to its exception
//! classes). 5xx bodies stay generic; the detail goes to the log.

use axum::Json;
use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::ledger::{LedgerError, TreeId};
use crate::service::ServiceError;
use crate::service::failure::{CustodyError, ProcError};

/// A failed request.
#[derive(Debug)]
pub enum ApiError {
    /// 401: token missing or wrong.
    Unauthorized(&'static str),
    /// 403: the principal is known, but may not do this (another user's
    /// tree, a token whose scope is too small, a user it may not run as).
    Forbidden(String),
    /// 400: the request cannot be parsed (JSON syntax, query, path).
    BadRequest(String),
    /// 422: parsed, but the values are not acceptable.
    Unprocessable(String),
    /// 404.
    NotFound(String),
    /// 409: the tree's state does not allow it.
    Conflict { message: String, tree: Option<i64> },
    /// 409: the tree's teardown is ambiguous (survivors left alive as
    /// evidence; dispatch into its scope closed).
    Ambiguous { message: String, tree: TreeId },
    /// 413: body over the limit.
    TooLarge,
    /// 415: a JSON body without `Content-Type: application/json`.
    UnsupportedMediaType(String),
    /// 503: dispatch is closed; names the unsettled tree and why, or,
    /// to a principal that may not see that tree (`None`), neither.
    DispatchClosed { tree: Option<i64>, reason: String },
    /// 503: the service is draining, or the ledger is busy.
    Unavailable(String),
    /// 500: generic body; the detail is logged here.
    Internal(String),
}

/// The machine-readable kind of an error, beside its message: what a
/// client does next depends on it, not on the status alone (a 503 is a
/// closed dispatch, which waits for an operator, or a drain or a busy
/// ledger, which a retry outlives).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub enum ErrorCode {
    /// 503: a tree in the requester's scope is unsettled; an operator (or
    /// the next settle) must act first. `tree` names it.
    DispatchClosed,
    /// 409: the teardown is ambiguous: survivors were left alive as
    /// evidence. `tree` names it.
    Ambiguous,
    /// 403: the principal may not do this.
    Forbidden,
    /// 404: no such tree or endpoint.
    NotFound,
    /// 400, 405, 413, 415, 422: the request itself is wrong; `error` says how.
    BadRequest,
    /// 503 (draining, ledger busy, a bound of the principal reached), 408:
    /// not now; retry later.
    Unavailable,
    /// 401: token missing, wrong or revoked.
    Unauthorized,
    /// 409: the tree's state does not allow it.
    Conflict,
    /// 500: the service failed; the detail is in its log.
    Internal,
}

impl ErrorCode {
    /// The code of an error made by a layer or the router, from its status.
    fn of_status(status: StatusCode) -> Self {
        match status.as_u16() {
            401 => Self::Unauthorized,
            403 => Self::Forbidden,
            404 => Self::NotFound,
            408 | 429 | 503 => Self::Unavailable,
            409 => Self::Conflict,
            400..=499 => Self::BadRequest,
            _ => Self::Internal,
        }
    }
}

#[derive(Serialize)]
struct Body<'a> {
    error: &'a str,
    code: ErrorCode,
    #[serde(skip_serializing_if = "Option::is_none")]
    tree: Option<i64>,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        use ErrorCode as C;
        let (status, code, message, tree) = match self {
            ApiError::Unauthorized(m) => (
                StatusCode::UNAUTHORIZED,
                C::Unauthorized,
                m.to_string(),
                None,
            ),
            ApiError::Forbidden(m) => {
                // Refusals are logged, not written to the ledger (any local
                // user reaches the socket; the ledger must not grow at will).
                tracing::info!(reason = %m, "request refused (403)");
                (StatusCode::FORBIDDEN, C::Forbidden, m, None)
            }
            ApiError::BadRequest(m) => (StatusCode::BAD_REQUEST, C::BadRequest, m, None),
            ApiError::Unprocessable(m) => {
                (StatusCode::UNPROCESSABLE_ENTITY, C::BadRequest, m, None)
            }
            ApiError::NotFound(m) => (StatusCode::NOT_FOUND, C::NotFound, m, None),
            ApiError::Conflict { message, tree } => {
                (StatusCode::CONFLICT, C::Conflict, message, tree)
            }
            ApiError::Ambiguous { message, tree } => {
                (StatusCode::CONFLICT, C::Ambiguous, message, Some(tree.0))
            }
            ApiError::TooLarge => (
                StatusCode::PAYLOAD_TOO_LARGE,
                C::BadRequest,
                format!("request body over {} bytes", super::BODY_LIMIT),
                None,
            ),
            ApiError::UnsupportedMediaType(m) => {
                (StatusCode::UNSUPPORTED_MEDIA_TYPE, C::BadRequest, m, None)
            }
            ApiError::DispatchClosed {
                tree: Some(tree),
                reason,
            } => (
                StatusCode::SERVICE_UNAVAILABLE,
                C::DispatchClosed,
                format!("dispatch refused: tree {tree} is unsettled ({reason}); resolve it first"),
                Some(tree),
            ),
            ApiError::DispatchClosed { tree: None, .. } => (
                StatusCode::SERVICE_UNAVAILABLE,
                C::DispatchClosed,
                "dispatch refused: a tree you may not see is unsettled and this service closes dispatch host-wide (serve --dispatch-scope host); an operator must settle it".to_string(),
                None,
            ),
            ApiError::Unavailable(m) => (StatusCode::SERVICE_UNAVAILABLE, C::Unavailable, m, None),
            ApiError::Internal(detail) => {
                tracing::error!(error = %detail, "internal error answering a request");
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    C::Internal,
                    "internal error (see the service log)".to_string(),
                    None,
                )
            }
        };
        let mut resp = (
            status,
            Json(Body {
                error: &message,
                code,
                tree,
            }),
        )
            .into_response();
        if status == StatusCode::UNAUTHORIZED {
            resp.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        resp
    }
}

/// `found`, or a 404 naming tree `id` when the ledger has no such tree.
pub(crate) fn known<T>(found: Option<T>, id: impl std::fmt::Display) -> Result<T, ApiError> {
    found.ok_or_else(|| ApiError::NotFound(format!("unknown tree {id}")))
}

impl From<LedgerError> for ApiError {
    fn from(e: LedgerError) -> Self {
        match e {
            LedgerError::Busy(_) => ApiError::Unavailable(e.to_string()),
            LedgerError::NotFound(m) => ApiError::NotFound(m),
            LedgerError::Invariant(m) => ApiError::Conflict {
                message: m,
                tree: None,
            },
            LedgerError::Full(_)
            | LedgerError::ReadOnly(_)
            | LedgerError::Corrupt(_)
            | LedgerError::Other(_) => ApiError::Internal(e.to_string()),
        }
    }
}

impl From<CustodyError> for ApiError {
    fn from(e: CustodyError) -> Self {
        match e {
            CustodyError::DispatchRefused { tree, reason } => ApiError::DispatchClosed {
                tree: Some(tree.0),
                reason,
            },
            CustodyError::Ledger(e) => e.into(),
            // The requested cwd closed to the user the tree runs as, or
            // credentials the kernel refused: the request's, not ours.
            // One answer for a cwd the tree's user cannot use, whatever
            // the reason (absent, closed, not a directory): the child found
            // out as that user, and says no more than that user could learn.
            CustodyError::Proc(ProcError::ChildSetup { step: "chdir", .. }) => {
                ApiError::Unprocessable(
                    "cannot start the tree: its cwd is not usable by the user it runs as".into(),
                )
            }
            CustodyError::Proc(ProcError::ChildSetup { step, source }) if step == "credentials" => {
                ApiError::Unprocessable(format!("cannot start the tree: {step}: {source}"))
            }
            CustodyError::Proc(e) => ApiError::Internal(e.to_string()),
            CustodyError::Exec(failure) => ApiError::Unprocessable(failure.to_string()),
            CustodyError::UnknownTree(id) => ApiError::NotFound(format!("unknown tree {id}")),
            CustodyError::Unsupported(m) => ApiError::Unprocessable(m),
            CustodyError::Conflict(m) => ApiError::Conflict {
                message: m,
                tree: None,
            },
            CustodyError::Ambiguous { tree, reason } => ApiError::Ambiguous {
                message: format!(
                    "teardown of tree {tree} is ambiguous: {reason}; once the cause is fixed, POST /api/trees/{tree}/kill ends them with authority"
                ),
                tree,
            },
            e @ CustodyError::Incomplete { .. } => ApiError::Unavailable(e.to_string()),
        }
    }
}

impl From<ServiceError> for ApiError {
    fn from(e: ServiceError) -> Self {
        match e {
            ServiceError::Custody(e) => e.into(),
            ServiceError::Ledger(e) => e.into(),
            ServiceError::Invalid(m) => ApiError::Unprocessable(m),
            ServiceError::ShuttingDown => ApiError::Unavailable(e.to_string()),
            ServiceError::Busy(m) => ApiError::Unavailable(m),
            ServiceError::Task(m) => ApiError::Internal(m),
        }
    }
}

impl From<JsonRejection> for ApiError {
    fn from(r: JsonRejection) -> Self {
        match r.status() {
            StatusCode::PAYLOAD_TOO_LARGE => ApiError::TooLarge,
            StatusCode::UNSUPPORTED_MEDIA_TYPE => ApiError::UnsupportedMediaType(r.body_text()),
            StatusCode::UNPROCESSABLE_ENTITY => ApiError::Unprocessable(r.body_text()),
            _ => ApiError::BadRequest(r.body_text()),
        }
    }
}

/// `Json<T>` whose rejections are [`ApiError`]s.
pub struct ApiJson<T>(pub T);

impl<T, S> FromRequest<S> for ApiJson<T>
where
    Json<T>: FromRequest<S, Rejection = JsonRejection>,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let Json(v) = Json::<T>::from_request(req, state).await?;
        Ok(ApiJson(v))
    }
}

/// `Query<T>` whose rejections are 400 [`ApiError`]s.
pub struct ApiQuery<T>(pub T);

impl<T, S> FromRequestParts<S> for ApiQuery<T>
where
    axum::extract::Query<T>: FromRequestParts<S, Rejection = QueryRejection>,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let axum::extract::Query(v) = axum::extract::Query::<T>::from_request_parts(parts, state)
            .await
            .map_err(|r| ApiError::BadRequest(r.body_text()))?;
        Ok(ApiQuery(v))
    }
}

/// A tree id from the path; anything but an integer is 400.
pub struct TreePath(pub TreeId);

impl<S: Send + Sync> FromRequestParts<S> for TreePath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let axum::extract::Path(raw) =
            axum::extract::Path::<String>::from_request_parts(parts, state)
                .await
                .map_err(|r: PathRejection| ApiError::BadRequest(r.body_text()))?;
        raw.parse::<i64>()
            .map(|id| TreePath(TreeId(id)))
            .map_err(|_| {
                ApiError::BadRequest(format!("malformed tree id {raw:?}: expected an integer"))
            })
    }
}

/// An error of a dashboard page as a small HTML page: the status, the
/// message (HTML-escaped), a link back.
async fn html_error(resp: Response) -> Response {
    let (mut parts, body) = resp.into_parts();
    let bytes = axum::body::to_bytes(body, 64 * 1024)
        .await
        .unwrap_or_default();
    let message = serde_json::from_slice::<serde_json::Value>(&bytes)
        .ok()
        .and_then(|v| v["error"].as_str().map(String::from))
        .unwrap_or_else(|| String::from_utf8_lossy(&bytes).into_owned());
    let escape = |s: &str| {
        s.replace('&', "&amp;")
            .replace('<', "&lt;")
            .replace('>', "&gt;")
            .replace('"', "&quot;")
    };
    let title = format!(
        "{} {}",
        parts.status.as_u16(),
        parts.status.canonical_reason().unwrap_or("error")
    );
    let page = format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>treewarden — {t}</title></head>\
         <body><main><h1>{t}</h1><p id=\"error\">{m}</p><p><a href=\"/\">back to the trees</a></p></main></body></html>",
        t = escape(&title),
        m = escape(&message)
    );
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    Response::from_parts(parts, axum::body::Body::from(page))
}

/// Gives errors made by layers and the router (413 from the body limit,
/// 408 from the timeout, 405, unknown routes) the same JSON shape under
/// `/api`, `/metrics` and `/healthz`; a dashboard page's error is an HTML
/// page for a browser.
pub async fn json_errors(req: Request, next: Next) -> Response {
    let path = req.uri().path();
    let api = path.starts_with("/api") || path == "/metrics" || path == "/healthz";
    let browser = req
        .headers()
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("text/html"));
    let resp = next.run(req).await;
    let status = resp.status();
    if !(status.is_client_error() || status.is_server_error()) {
        return resp;
    }
    if !api {
        // The dashboard's errors are pages for a browser (JSON stays for
        // everything else).
        return if browser {
            html_error(resp).await
        } else {
            resp
        };
    }
    let is_json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if is_json {
        return resp;
    }
    let message = status
        .canonical_reason()
        .unwrap_or("error")
        .to_ascii_lowercase();
    let (mut parts, _) = resp.into_parts();
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let body =
        serde_json::json!({ "error": message, "code": ErrorCode::of_status(status) }).to_string();
    Response::from_parts(parts, axum::body::Body::from(body))
}
