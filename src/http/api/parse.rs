//! The checks of what a request sends: durations, graces, flags and
//! `since=` values, a spawn body into the service's `SpawnParams`, and the
//! `Link` header's query escape. Errors are messages or 400/422s, never a
//! half-read request.

use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use super::MAX_LABEL;
use super::bodies::{LimitsBody, SpawnBody};
use crate::http::error::ApiError;
use crate::ledger::TreeState;
use crate::service::SpawnParams;

pub(super) fn parse_duration(what: &str, s: &str) -> Result<Duration, String> {
    crate::config::parse_duration(s).map_err(|e| format!("{what}: {e}"))
}

/// A grace as the API accepts it: humantime, at most `max`
/// (`serve --max-grace`). The error is the message; each caller picks its
/// status.
pub(super) fn parse_grace(g: Option<&str>, max: Duration) -> Result<Option<Duration>, String> {
    let grace = g.map(|g| parse_duration("grace", g)).transpose()?;
    if let Some(g) = grace
        && g > max
    {
        return Err(format!(
            "grace {} is over this service's cap of {} (serve --max-grace)",
            humantime::format_duration(g),
            humantime::format_duration(max)
        ));
    }
    Ok(grace)
}

/// `v` percent-encoded for a query string (all but RFC 3986's unreserved
/// characters).
pub(super) fn query_escape(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for b in v.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A `since=` query value (RFC 3339 or an age); malformed is 400.
pub(in crate::http) fn parse_since_query(v: Option<&str>) -> Result<Option<SystemTime>, ApiError> {
    v.map(crate::ledger::parse_since)
        .transpose()
        .map_err(ApiError::BadRequest)
}

/// A `1`/`0` query flag (absent, empty, `0`, `false`: off; `1`, `true`: on);
/// anything else is 400. For the API and the dashboard alike.
pub(in crate::http) fn parse_flag(what: &str, v: Option<&str>) -> Result<bool, ApiError> {
    match v {
        None | Some("0") | Some("false") | Some("") => Ok(false),
        Some("1") | Some("true") => Ok(true),
        Some(other) => Err(ApiError::BadRequest(format!(
            "malformed {what} {other:?}: expected 1 or 0"
        ))),
    }
}

impl SpawnBody {
    pub(super) fn validate(self, max_grace: Duration) -> Result<SpawnParams, ApiError> {
        let bad = ApiError::Unprocessable;
        if self.argv.is_empty() {
            return Err(bad("empty argv: nothing to run".into()));
        }
        if self.argv[0].is_empty() {
            return Err(bad("argv[0] is empty".into()));
        }
        if self.argv.iter().any(|a| a.contains('\0')) {
            return Err(bad("argv contains a NUL byte".into()));
        }
        if let Some(label) = &self.label
            && (label.chars().count() > MAX_LABEL || label.contains('\0'))
        {
            return Err(bad(format!(
                "label longer than {MAX_LABEL} characters or with a NUL byte"
            )));
        }
        let cwd = match &self.cwd {
            None => None,
            Some(c) => {
                // Whether it exists is the tree's user's to find out (in
                // the child, as that user): looked up here as root, the
                // answer would tell a user what lies in directories closed
                // to it. Trees that run as the service are
                // checked in `spawn_tree`.
                let p = PathBuf::from(c);
                if c.contains('\0') || !p.is_absolute() {
                    return Err(bad(format!("cwd {c:?} is not an absolute path")));
                }
                Some(p)
            }
        };
        let mut env = Vec::new();
        for (k, v) in self.env.unwrap_or_default() {
            if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
                return Err(bad(format!(
                    "env name {k:?} is empty or holds '=' or NUL, or its value holds NUL"
                )));
            }
            env.push((k, v));
        }
        let grace = parse_grace(self.grace.as_deref(), max_grace).map_err(bad)?;
        let first_signal = parse_first_signal(self.first_signal.as_deref()).map_err(bad)?;
        let timeout = self
            .timeout
            .as_deref()
            .map(|t| parse_duration("timeout", t))
            .transpose()
            .map_err(bad)?;
        if timeout.is_some_and(|t| t.is_zero() || t > Duration::from_secs(10 * 365 * 86400)) {
            return Err(bad("timeout must be above zero and under ten years".into()));
        }
        if let Some(pid) = self.owner_pid
            && pid <= 1
        {
            return Err(bad(format!("owner_pid {pid} is not a client process")));
        }
        let limits = parse_limits(self.limits).map_err(bad)?;
        let lifetime = match self.lifetime.as_deref() {
            None => crate::service::vocab::Lifetime::Root,
            Some(l) => l.parse().map_err(bad)?,
        };
        Ok(SpawnParams {
            lifetime,
            limits,
            argv: self.argv,
            label: self.label,
            cwd,
            env,
            grace,
            timeout,
            owner_pid: self.owner_pid,
            owner_start_ticks: self.owner_start_ticks,
            requester: None,
            run_as: None,
            first_signal,
            stdio: crate::service::vocab::GivenStdio::default(),
        })
    }
}

/// A spawn's `first_signal`: names only, as the document says (`INT`,
/// `SIGINT`): the CLI's numbers and lower case are not part of this
/// contract.
fn parse_first_signal(name: Option<&str>) -> Result<Option<crate::service::vocab::Sig>, String> {
    match name {
        None => Ok(None),
        Some(n)
            if matches!(
                n.strip_prefix("SIG").unwrap_or(n),
                "TERM" | "INT" | "HUP" | "QUIT" | "USR1" | "USR2"
            ) =>
        {
            crate::service::vocab::Sig::parse_first(n)
                .map(Some)
                .map_err(|e| format!("first_signal: {e}"))
        }
        Some(n) => Err(format!(
            "first_signal {n:?}: expected TERM, INT, HUP, QUIT, USR1 or USR2 (KILL comes only with its authorization)"
        )),
    }
}

/// A spawn's `limits` (none given: no limits).
fn parse_limits(limits: Option<LimitsBody>) -> Result<crate::ledger::Limits, String> {
    let Some(l) = limits else {
        return Ok(crate::ledger::Limits::default());
    };
    Ok(crate::ledger::Limits {
        memory_max: l
            .memory_max
            .as_deref()
            .map(crate::ledger::parse_size)
            .transpose()?,
        pids_max: match l.pids_max {
            Some(0) => return Err("pids_max must be 1 or more".into()),
            n => n,
        },
        cpu_max_pct: l
            .cpu_max
            .as_deref()
            .map(crate::ledger::parse_cpu_pct)
            .transpose()?,
    })
}

/// `?state=a,b`: the tree states named, each by its name.
pub(super) fn parse_states(list: &str) -> Result<Vec<TreeState>, ApiError> {
    list.split(',')
        .map(|name| {
            TreeState::ALL
                .into_iter()
                .find(|st| st.as_str() == name)
                .ok_or_else(|| {
                    ApiError::BadRequest(format!("malformed state {name:?}: not a tree state"))
                })
        })
        .collect()
}
