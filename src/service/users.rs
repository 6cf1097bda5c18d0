//! Users: who a spawned tree runs as (the user database, the socket peer's
//! credentials; on Windows always the service's own user), who is in the
//! admin group, the service's own uid, and new token secrets. Blocking
//! reads (NSS may be LDAP or sssd, the peer's files are read from `/proc`):
//! callers on the async side run them on the blocking pool.

use crate::ledger::TokenScope;

pub use crate::proc::{Credentials, UserInfo, refuse_if_open_to_others};

use super::RunAs;

/// The uid this service runs as.
pub fn own_uid() -> u32 {
    crate::proc::effective_uid()
}

/// Whether the user `uid` (primary group `gid`) is in `group`: its gid, or
/// the user database's groups of the uid.
pub fn in_group(uid: u32, gid: u32, group: u32) -> bool {
    gid == group
        || crate::proc::user_by_uid(uid)
            .ok()
            .flatten()
            .and_then(|u| crate::proc::groups_of(&u, gid).ok())
            .is_some_and(|g| g.contains(&group))
}

/// A new token's secret: 32 random bytes as hex.
pub fn new_secret() -> std::io::Result<String> {
    let mut bytes = [0u8; 32];
    crate::proc::fill_random(&mut bytes)?;
    Ok(hex::encode(bytes))
}

/// Who asks for a spawn, as [`run_as`] weighs it.
#[derive(Clone, Copy, Debug)]
pub enum Asker<'a> {
    /// A local process on the Unix socket.
    Local {
        pid: Option<i32>,
        uid: u32,
        gid: u32,
    },
    /// A bearer token.
    Token { name: &'a str, scope: TokenScope },
    /// No credentials.
    Anonymous,
}

/// Why [`run_as`] said no; the caller maps each to its answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The asker may not run a tree as that user.
    Forbidden(String),
    /// The request names a user there is not (or cannot be).
    Unprocessable(String),
    /// The user database failed.
    Internal(String),
    /// No credentials at all.
    Unauthorized(&'static str),
}

/// The user a spawn runs as, and who asked, from the asker and the body's
/// `user`. Non-root socket askers run as themselves; root (and admin
/// tokens) as the named user, or as the service; anyone else naming
/// another user is refused. `None`: as the service.
#[cfg(unix)]
pub fn run_as(asker: Asker<'_>, user: Option<&str>) -> Result<Option<RunAs>, Refusal> {
    let named = match user {
        None => None,
        // A numeric user is a uid, as `systemd-run --uid` takes it.
        Some(n) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => {
            let uid: u32 = n
                .parse()
                .map_err(|_| Refusal::Unprocessable(format!("uid {n} is out of range")))?;
            Some(
                crate::proc::user_by_uid(uid)
                    .map_err(|e| Refusal::Internal(format!("user database: {e}")))?
                    .unwrap_or_else(|| UserInfo::unnamed(uid)),
            )
        }
        Some(name) => Some(
            crate::proc::user_by_name(name)
                .map_err(|e| Refusal::Internal(format!("user database: {e}")))?
                .ok_or_else(|| Refusal::Unprocessable(format!("no such user {name:?}")))?,
        ),
    };
    let of_user = |u: UserInfo| -> Result<RunAs, Refusal> {
        if u.name.is_empty() {
            // A uid the database does not know: no supplementary groups.
            return Ok(RunAs {
                credentials: Credentials {
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
            .map_err(|e| Refusal::Internal(format!("groups of {}: {e}", u.name)))?;
        Ok(RunAs {
            credentials: Credentials {
                uid: u.uid,
                gid: u.gid,
                groups,
                rlimits: Vec::new(),
                cgroups_v1: Vec::new(),
            },
            user: Some(u),
        })
    };
    let me = own_uid();
    match asker {
        Asker::Local { uid: 0, .. } => named.map(of_user).transpose(),
        // The service's own user: its trees run as the service, as before.
        Asker::Local { uid, .. } if uid == me && named.as_ref().is_none_or(|u| u.uid == me) => {
            Ok(None)
        }
        Asker::Local { uid, .. } if me != 0 => Err(Refusal::Forbidden(format!(
            "this service runs as uid {me}, not root: it cannot start trees as uid {uid}"
        ))),
        Asker::Local { pid, uid, gid } => {
            if let Some(u) = &named
                && u.uid != uid
            {
                return Err(Refusal::Forbidden(format!(
                    "uid {uid} may not run a tree as {} (only root may)",
                    u.name
                )));
            }
            let credentials =
                crate::proc::credentials_of_peer(pid, uid, gid).map_err(Refusal::Forbidden)?;
            let user = crate::proc::user_by_uid(uid).ok().flatten();
            Ok(Some(RunAs { credentials, user }))
        }
        Asker::Token { name, scope } => match named {
            None => Ok(None),
            Some(u) if scope == TokenScope::Admin => of_user(u).map(Some),
            Some(u) => Err(Refusal::Forbidden(format!(
                "token {name:?} has scope {}: only admin tokens may run a tree as {}",
                scope.as_str(),
                u.name
            ))),
        },
        Asker::Anonymous => Err(Refusal::Unauthorized(
            "missing bearer token (Authorization: Bearer <token>)",
        )),
    }
}

/// Windows: every tree runs as the service's own user. There is no other
/// user to start one as yet (no `CreateProcessAsUser`, no logon tokens),
/// so a `user` is refused rather than ignored.
#[cfg(windows)]
pub fn run_as(_asker: Asker<'_>, user: Option<&str>) -> Result<Option<RunAs>, Refusal> {
    match user {
        None => Ok(None),
        Some(u) => Err(Refusal::Unprocessable(format!(
            "user {u:?}: on Windows every tree runs as the service's own user (running as another user is not built there)"
        ))),
    }
}
