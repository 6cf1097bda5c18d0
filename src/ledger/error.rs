//! The ledger's one error type. A variant exists only where a caller branches
//! on it; rusqlite errors are translated here, at the edge, and never leak.

use std::time::Duration;

use rusqlite::ErrorCode;

#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// Another connection held the write lock for longer than the busy
    /// timeout. Nothing was written.
    #[error(
        "ledger busy: another writer held the lock longer than the busy timeout ({}); nothing was written",
        humantime::format_duration(*.0)
    )]
    Busy(Duration),
    /// The disk (or quota) is full. Nothing was written.
    #[error("ledger full: no space left for the write ({0}); nothing was written")]
    Full(String),
    /// The ledger file or its directory is read-only.
    #[error("ledger read-only: {0}")]
    ReadOnly(String),
    /// The row the call is about does not exist.
    #[error("not found: {0}")]
    NotFound(String),
    /// The database (or a check in front of it) refused a change that would
    /// break a ledger invariant. Nothing was written.
    #[error("{0}")]
    Invariant(String),
    /// The file is not a healthy SQLite database.
    #[error("ledger corrupt: {0}")]
    Corrupt(String),
    #[error("ledger error: {0}")]
    Other(String),
}

/// Internal failure inside an owner-thread job: either already a ledger
/// error, or a raw SQLite error translated once the busy timeout is known.
#[derive(Debug)]
pub(crate) enum Fail {
    Sql(rusqlite::Error),
    Ledger(LedgerError),
}

impl From<rusqlite::Error> for Fail {
    fn from(e: rusqlite::Error) -> Self {
        Self::Sql(e)
    }
}

impl From<LedgerError> for Fail {
    fn from(e: LedgerError) -> Self {
        Self::Ledger(e)
    }
}

impl From<serde_json::Error> for Fail {
    fn from(e: serde_json::Error) -> Self {
        Self::Ledger(LedgerError::Other(format!("json: {e}")))
    }
}

impl Fail {
    pub(crate) fn into_ledger(self, busy_timeout: Duration) -> LedgerError {
        match self {
            Self::Sql(e) => LedgerError::from_sqlite(e, busy_timeout),
            Self::Ledger(e) => e,
        }
    }
}

impl LedgerError {
    /// Translates a rusqlite error. `busy_timeout` is named in the `Busy` message.
    pub(crate) fn from_sqlite(error: rusqlite::Error, busy_timeout: Duration) -> Self {
        match &error {
            rusqlite::Error::SqliteFailure(failure, message) => {
                let detail = message.clone().unwrap_or_else(|| failure.to_string());
                match failure.code {
                    ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked => Self::Busy(busy_timeout),
                    ErrorCode::DiskFull => Self::Full(detail),
                    ErrorCode::ReadOnly => Self::ReadOnly(detail),
                    ErrorCode::ConstraintViolation => Self::Invariant(detail),
                    ErrorCode::DatabaseCorrupt | ErrorCode::NotADatabase => Self::Corrupt(detail),
                    _ => Self::Other(detail),
                }
            }
            rusqlite::Error::QueryReturnedNoRows => Self::NotFound("no such row".into()),
            _ => Self::Other(error.to_string()),
        }
    }

    pub(crate) fn from_migration(error: rusqlite_migration::Error, busy_timeout: Duration) -> Self {
        match error {
            rusqlite_migration::Error::RusqliteError { err, .. } => {
                Self::from_sqlite(err, busy_timeout)
            }
            other => Self::Other(format!("migration: {other}")),
        }
    }
}
