//! Windows: no inotify, so no thread caps the logs as they are written;
//! the scan tick caps them (`proc::cap_log`).

pub(crate) struct LogCap;

impl LogCap {
    /// Never a thread there: the tick's cap applies.
    pub(crate) fn start(_dir: &std::path::Path, _cap: u64) -> Option<LogCap> {
        None
    }

    pub(crate) fn running(&self) -> bool {
        false
    }
}
