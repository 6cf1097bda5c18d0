//! What readers ask for: "since" (a time or an age), a page of trees and
//! its filter, whose trees, the events selected for reads and export.

use super::names::{TreeId, TreeState};

/// Parses how a reader says "events since": an RFC 3339 time, or an age
/// such as `2h` counted back from now. One grammar for the CLI's `--since`
/// and the HTTP API's `since=`; the error names the value, not the flag.
pub fn parse_since(s: &str) -> Result<std::time::SystemTime, String> {
    if let Ok(at) = s.parse::<jiff::Timestamp>() {
        // Nothing in a ledger is older than the epoch: an earlier time
        // selects everything, like the epoch itself (and a time before it
        // must never reach the formatter, which cannot write one).
        let ns = u64::try_from(at.as_nanosecond().max(0)).unwrap_or(u64::MAX);
        return std::time::UNIX_EPOCH
            .checked_add(std::time::Duration::from_nanos(ns))
            .ok_or_else(|| format!("since {s:?} is out of range"));
    }
    // A time without an offset names no moment: refused, not taken as UTC.
    if s.parse::<jiff::civil::DateTime>().is_ok() {
        return Err(format!(
            "since {s:?} has no offset: add Z (UTC) or one like +02:00 (2024-05-01T12:00:00+02:00)"
        ));
    }
    let age = humantime::parse_duration(s).map_err(|_| {
        format!(
            "malformed since {s:?}: expected RFC 3339 with an offset (2024-05-01T12:00:00Z, 2024-05-01T14:00:00+02:00) or an age (2h)"
        )
    })?;
    if age.is_zero() {
        return Err(format!(
            "since {s:?} is an empty window: give an age such as 2h, or a time"
        ));
    }
    Ok(std::time::SystemTime::now()
        .checked_sub(age)
        .unwrap_or(std::time::UNIX_EPOCH)
        .max(std::time::UNIX_EPOCH))
}

/// Where a keyset page of trees starts: the newest, the page right below a
/// tree id (older), or the page right above one (newer). Every page is
/// returned newest first.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PageAt {
    #[default]
    Newest,
    Before(i64),
    After(i64),
}

/// Selects trees for a page: all conditions combine with AND.
#[derive(Clone, Debug, Default)]
pub struct TreeFilter {
    /// Only trees in one of these states (`None`: any).
    pub states: Option<Vec<TreeState>>,
    /// Only trees with exactly this label.
    pub label: Option<String>,
    /// Only trees created at or after this moment.
    pub since: Option<std::time::SystemTime>,
    /// Only trees this principal asked for (`None`: anyone's).
    pub owner: Option<TreeOwner>,
    /// Only trees whose label contains this (the dashboard's search).
    pub label_contains: Option<String>,
    /// Only trees created before this moment.
    pub until: Option<std::time::SystemTime>,
}

/// Whose trees a [`TreeFilter`] keeps: a principal's own, as
/// `http::auth::Principal::owns` decides it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TreeOwner {
    /// Asked for by this uid (over the socket, or the CLI).
    Uid(u32),
    /// Asked for with this token.
    Token(i64),
    /// Nobody's: an anonymous principal owns no tree.
    Nobody,
}

/// Selects events for reads and export. All conditions combine with AND;
/// rows come back in seq order (newest first with `newest_first`).
#[derive(Clone, Debug, Default)]
pub struct EventFilter {
    /// Events at or after this moment.
    pub since: Option<std::time::SystemTime>,
    pub tree: Option<TreeId>,
    /// Events with seq strictly greater than this (for paging / tailing).
    pub after_seq: Option<i64>,
    /// Events with seq strictly less than this (keyset paging backwards,
    /// with `newest_first`).
    pub before_seq: Option<i64>,
    /// Events whose kind starts with this (case-sensitive), e.g. `kill.`.
    pub kind_prefix: Option<String>,
    /// Descending seq order, so `limit` keeps the newest matches rather
    /// than the oldest. Off by default (export and tailing read oldest first).
    pub newest_first: bool,
    pub limit: Option<usize>,
    /// The dashboard's incident search (none by default).
    pub search: EventSearch,
}

/// What the events page narrows the trail by, beyond [`EventFilter`]'s
/// keys: all combine with AND.
#[derive(Clone, Debug, Default)]
pub struct EventSearch {
    /// Only these kinds (exact names).
    pub kinds: Option<Vec<String>>,
    /// Events before this moment.
    pub until: Option<std::time::SystemTime>,
    /// Events whose data contains this text (a scan of what the other
    /// conditions leave).
    pub text: Option<String>,
    /// Events of trees whose label contains this.
    pub tree_label: Option<String>,
}

#[cfg(test)]
mod since_tests {
    use super::parse_since;
    use std::time::{Duration, UNIX_EPOCH};

    #[test]
    fn since_takes_offsets_clamps_to_the_epoch_and_refuses_naive_or_empty() {
        let utc = parse_since("2024-05-01T12:00:00Z").expect("utc");
        let plus2 = parse_since("2024-05-01T14:00:00+02:00").expect("offset");
        assert_eq!(utc, plus2);
        assert_eq!(utc, UNIX_EPOCH + Duration::from_secs(1_714_564_800));
        assert_eq!(
            parse_since("1960-01-01T00:00:00Z").expect("old"),
            UNIX_EPOCH
        );
        assert!(
            parse_since("2024-05-01T12:00:00")
                .expect_err("naive")
                .contains("no offset")
        );
        assert!(parse_since("0").is_err());
        assert!(parse_since("yesterday").is_err());
        assert!(parse_since("2h").is_ok());
    }
}
