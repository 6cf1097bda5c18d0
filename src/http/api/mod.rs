//! The JSON API: handlers, their request and response shapes, and the
//! OpenAPI document generated from them (utoipa), so the description cannot
//! drift from the code that answers.
//!
//! One file a job: bodies.rs the shapes, parse.rs their checks,
//! run_as.rs who a spawn runs as, spawn.rs `POST /api/trees`, stdio.rs its streamed stdio, trees.rs the
//! other tree routes, events.rs `GET /api/events`, health.rs `/healthz`,
//! `/readyz` and `POST /api/shutdown`, doc.rs the OpenAPI document. Every
//! public item is re-exported here: the rest of the crate names
//! `api::list_trees`, `api::ErrorBody`, ... as before.

mod bodies;
mod doc;
mod events;
mod health;
mod parse;
mod run_as;
mod spawn;
mod stdio;
mod trees;

pub use bodies::*;
pub use doc::ApiDoc;
pub use events::*;
pub use health::*;
pub(super) use parse::{parse_flag, parse_since_query};
pub use spawn::*;
pub use trees::*;

// The files below name their http siblings as `super::error`,
// `super::conn`, `super::auth` and `super::stream`, as they did when they
// were one file: these keep those paths.
use super::{auth, conn, error, stream};

use std::time::Duration;

use error::ApiError;

/// Default of the longest grace the API accepts (`serve --max-grace`; a
/// kill request waits for its teardown, so the request timeout follows it).
pub const DEFAULT_MAX_GRACE: Duration = Duration::from_secs(600);
/// Longest a `GET /api/trees/{id}/wait` holds its request.
pub const MAX_WAIT: Duration = Duration::from_secs(60);
/// Longest label accepted.
const MAX_LABEL: usize = 256;

pub async fn not_found() -> ApiError {
    ApiError::NotFound("no such endpoint".into())
}
