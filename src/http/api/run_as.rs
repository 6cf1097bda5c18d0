//! Who a spawned tree runs as: the request's principal put in the
//! service's words ([`crate::service::users::run_as`] decides), its
//! refusal put in HTTP's. Blocking reads: the caller runs it on the
//! blocking pool.

use crate::http::auth::Principal;
use crate::http::error::ApiError;
use crate::service::users::{Asker, Refusal};

/// The user a spawn runs as, from the principal and the body's `user`.
pub(super) fn run_as(
    principal: &Principal,
    user: Option<&str>,
) -> Result<Option<crate::service::RunAs>, ApiError> {
    let asker = match principal {
        Principal::Local { cred, .. } => Asker::Local {
            pid: cred.pid,
            uid: cred.uid,
            gid: cred.gid,
        },
        Principal::Token { name, scope, .. } => Asker::Token {
            name,
            scope: *scope,
        },
        Principal::Anonymous => Asker::Anonymous,
    };
    crate::service::users::run_as(asker, user).map_err(|r| match r {
        Refusal::Forbidden(m) => ApiError::Forbidden(m),
        Refusal::Unprocessable(m) => ApiError::Unprocessable(m),
        Refusal::Internal(m) => ApiError::Internal(m),
        Refusal::Unauthorized(m) => ApiError::Unauthorized(m),
    })
}
