//! The typed records callers write and the rows they read back. Plain data:
//! no SQL here, and no rusqlite type ever appears in these shapes.

//!
//! One file a job: names.rs the row ids and the closed
//! vocabularies (tree states, event kinds), records.rs what writers hand
//! in, limits.rs a tree's cgroup limits and the resources it used,
//! filters.rs what readers ask for, rows.rs what they read back, reports.rs
//! what `verify` and the sealer report and the export formats, vocab.rs
//! the words rows and events are written in (signals, targets, results,
//! flags). Every item
//! is re-exported here, as `ledger::types::*`.

mod filters;
mod limits;
mod names;
mod records;
mod reports;
mod rows;
mod vocab;

pub use filters::*;
pub use limits::*;
pub use names::*;
pub use records::*;
pub use reports::*;
pub use rows::*;
pub use vocab::*;

// `super::Ledger` in records.rs's docs.
#[cfg(doc)]
use super::Ledger;
