//! The errors below the service that its callers match on, by name: a
//! refused dispatch, a child's setup step that failed (its cwd, its
//! credentials). Re-exported so that `http` maps them to answers without
//! naming `custody` or `proc`.

pub use crate::custody::CustodyError;
pub use crate::proc::ProcError;
