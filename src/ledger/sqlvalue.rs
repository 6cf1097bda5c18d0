//! The ledger's typed words as SQLite values: each column holds the type's
//! spelling (or its id's integer) exactly as it always did, so a row reads
//! typed and writes back unchanged. The types themselves (types/) know no
//! rusqlite; these impls are the one place the two meet.

use rusqlite::types::{FromSql, FromSqlError, FromSqlResult, ToSql, ToSqlOutput, ValueRef};

use super::types::{
    AuthorizationId, OwnerId, OwnerKind, SignalName, SignalResult, TargetKind, TreeFlag, TreeId,
};
use crate::proc::BoundaryKind;

/// An id newtype as its integer.
macro_rules! integer_id {
    ($($ty:ident),*) => {$(
        impl FromSql for $ty {
            fn column_result(v: ValueRef<'_>) -> FromSqlResult<Self> {
                i64::column_result(v).map($ty)
            }
        }

        impl ToSql for $ty {
            fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
                Ok(ToSqlOutput::from(self.0))
            }
        }
    )*};
}

integer_id!(TreeId, OwnerId, AuthorizationId);

/// An open vocabulary (any text reads: one this build does not spell is kept).
macro_rules! open_text {
    ($($ty:ident),*) => {$(
        impl FromSql for $ty {
            fn column_result(v: ValueRef<'_>) -> FromSqlResult<Self> {
                v.as_str().map($ty::from)
            }
        }

        impl ToSql for $ty {
            fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
                Ok(ToSqlOutput::from(self.to_string()))
            }
        }
    )*};
}

open_text!(SignalName, SignalResult, TreeFlag);

/// A closed vocabulary (the database's CHECK holds it closed; a value
/// outside it is a conversion error, as a bad state is).
macro_rules! closed_text {
    ($($ty:ident),*) => {$(
        impl FromSql for $ty {
            fn column_result(v: ValueRef<'_>) -> FromSqlResult<Self> {
                v.as_str()?
                    .parse()
                    .map_err(|e: String| FromSqlError::Other(e.into()))
            }
        }

        impl ToSql for $ty {
            fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
                Ok(ToSqlOutput::from(self.as_str()))
            }
        }
    )*};
}

closed_text!(TargetKind, OwnerKind);

impl FromSql for BoundaryKind {
    fn column_result(v: ValueRef<'_>) -> FromSqlResult<Self> {
        let name = v.as_str()?;
        BoundaryKind::recorded(name)
            .ok_or_else(|| FromSqlError::Other(format!("unknown boundary {name:?}").into()))
    }
}

impl ToSql for BoundaryKind {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        Ok(ToSqlOutput::from(self.as_str()))
    }
}
