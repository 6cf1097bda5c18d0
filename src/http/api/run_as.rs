//! Who a spawned tree runs as: from the request's principal and the body's
//! `user` (Unix: the user database, the socket peer's credentials;
//! Windows: always the service's own user). Blocking reads: the caller
//! runs it on the blocking pool.

use crate::http::auth::Principal;
use crate::http::error::ApiError;

/// The user a spawn runs as, and who asked, from the principal and the
/// body's `user`. Non-root socket principals run as themselves; root (and
/// admin tokens) as the named user, or as the service; anyone else naming
/// another user is refused (403).
#[cfg(unix)]
pub(super) fn run_as(
    principal: &Principal,
    user: Option<&str>,
) -> Result<Option<crate::service::RunAs>, ApiError> {
    let named = match user {
        None => None,
        // A numeric user is a uid, as `systemd-run --uid` takes it.
        Some(n) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => {
            let uid: u32 = n
                .parse()
                .map_err(|_| ApiError::Unprocessable(format!("uid {n} is out of range")))?;
            Some(
                crate::proc::user_by_uid(uid)
                    .map_err(|e| ApiError::Internal(format!("user database: {e}")))?
                    .unwrap_or_else(|| crate::proc::UserInfo::unnamed(uid)),
            )
        }
        Some(name) => Some(
            crate::proc::user_by_name(name)
                .map_err(|e| ApiError::Internal(format!("user database: {e}")))?
                .ok_or_else(|| ApiError::Unprocessable(format!("no such user {name:?}")))?,
        ),
    };
    let of_user = |u: crate::proc::UserInfo| -> Result<crate::service::RunAs, ApiError> {
        if u.name.is_empty() {
            // A uid the database does not know: no supplementary groups.
            return Ok(crate::service::RunAs {
                credentials: crate::proc::Credentials {
                    uid: u.uid,
                    gid: u.gid,
                    groups: Vec::new(),
                    rlimits: Vec::new(),
                    cgroups_v1: Vec::new(),
                },
                user: None,
            });
        }
        let groups = crate::proc::groups_of(&u, u.gid)
            .map_err(|e| ApiError::Internal(format!("groups of {}: {e}", u.name)))?;
        Ok(crate::service::RunAs {
            credentials: crate::proc::Credentials {
                uid: u.uid,
                gid: u.gid,
                groups,
                rlimits: Vec::new(),
                cgroups_v1: Vec::new(),
            },
            user: Some(u),
        })
    };
    let me = crate::proc::effective_uid();
    match principal {
        Principal::Local { cred, .. } if cred.uid == 0 => named.map(of_user).transpose(),
        // The service's own user: its trees run as the service, as before.
        Principal::Local { cred, .. }
            if cred.uid == me && named.as_ref().is_none_or(|u| u.uid == me) =>
        {
            Ok(None)
        }
        Principal::Local { cred, .. } if me != 0 => Err(ApiError::Forbidden(format!(
            "this service runs as uid {me}, not root: it cannot start trees as uid {}",
            cred.uid
        ))),
        Principal::Local { cred, .. } => {
            if let Some(u) = &named
                && u.uid != cred.uid
            {
                return Err(ApiError::Forbidden(format!(
                    "uid {} may not run a tree as {} (only root may)",
                    cred.uid, u.name
                )));
            }
            let credentials = crate::proc::credentials_of_peer(cred.pid, cred.uid, cred.gid)
                .map_err(ApiError::Forbidden)?;
            let user = crate::proc::user_by_uid(cred.uid).ok().flatten();
            Ok(Some(crate::service::RunAs { credentials, user }))
        }
        Principal::Token { scope, name, .. } => match named {
            None => Ok(None),
            Some(u) if *scope == crate::ledger::TokenScope::Admin => of_user(u).map(Some),
            Some(u) => Err(ApiError::Forbidden(format!(
                "token {name:?} has scope {}: only admin tokens may run a tree as {}",
                scope.as_str(),
                u.name
            ))),
        },
        Principal::Anonymous => Err(ApiError::Unauthorized(
            "missing bearer token (Authorization: Bearer <token>)",
        )),
    }
}

/// Windows: every tree runs as the service's own user. There is no other
/// user to start one as yet (no `CreateProcessAsUser`, no logon tokens),
/// so a `user` is refused (422) rather than ignored.
#[cfg(windows)]
pub(super) fn run_as(
    _principal: &Principal,
    user: Option<&str>,
) -> Result<Option<crate::service::RunAs>, ApiError> {
    match user {
        None => Ok(None),
        Some(u) => Err(ApiError::Unprocessable(format!(
            "user {u:?}: on Windows every tree runs as the service's own user (running as another user is not built there)"
        ))),
    }
}
