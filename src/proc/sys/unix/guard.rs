//! The sentinel guard every Unix signal path runs before it sends: the one
//! place that says which pids and groups treewarden never signals, for
//! Linux and macOS alike (Windows refuses its own list, the system's pids,
//! in `windows/signal.rs`).
//!
//! What it must never do: let a target through because a lookup of our own
//! ids failed. An id we cannot name (our group or session outside our pid
//! namespace reads 0) is `None` and refuses nothing, but it is never a pid
//! we could target either.

use crate::proc::ProcError;

/// This process's own ids, as the caller read them.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Own {
    pub pid: i32,
    /// Our process group; `None` when it lies outside our pid namespace.
    pub pgrp: Option<i32>,
    /// Our session; `None` when it lies outside our pid namespace or
    /// cannot be read.
    pub sid: Option<i32>,
}

/// Refuses a pid or pgid (`what` names which, for the message) that is 0,
/// -1 or any other negative number (each names more than one process to
/// `kill`), init, this process, or our own group or session.
pub(crate) fn check(target: i32, what: &str, own: &Own) -> Result<(), ProcError> {
    let reason = if target == 0 {
        format!("{what} 0 means the caller's own process group")
    } else if target == -1 {
        format!("{what} -1 means every process we may signal")
    } else if target < 0 {
        format!("negative {what} {target} names a process group")
    } else if target == 1 {
        format!("{what} 1 is init")
    } else if target == own.pid {
        format!("{what} {target} is treewarden itself")
    } else if own.pgrp == Some(target) {
        format!("{what} {target} is treewarden's own process group")
    } else if own.sid == Some(target) {
        format!("{what} {target} is treewarden's own session")
    } else {
        return Ok(());
    };
    Err(ProcError::Refused {
        pid: target,
        reason,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const OWN: Own = Own {
        pid: 500,
        pgrp: Some(400),
        sid: Some(300),
    };

    fn refused(target: i32, own: &Own) -> Option<String> {
        match check(target, "pid", own) {
            Ok(()) => None,
            Err(ProcError::Refused { pid, reason }) => {
                assert_eq!(pid, target);
                Some(reason)
            }
            Err(e) => panic!("not a refusal: {e}"),
        }
    }

    #[test]
    fn every_sentinel_is_refused_with_its_reason_and_a_stranger_is_not() {
        let cases = [
            (0, "pid 0 means the caller's own process group"),
            (-1, "pid -1 means every process we may signal"),
            (-42, "negative pid -42 names a process group"),
            (1, "pid 1 is init"),
            (500, "pid 500 is treewarden itself"),
            (400, "pid 400 is treewarden's own process group"),
            (300, "pid 300 is treewarden's own session"),
        ];
        for (target, reason) in cases {
            assert_eq!(refused(target, &OWN).as_deref(), Some(reason), "{target}");
        }
        for stranger in [2, 299, 301, 399, 401, 499, 501, i32::MAX] {
            assert_eq!(refused(stranger, &OWN), None, "{stranger}");
        }
    }

    #[test]
    fn an_id_outside_our_namespace_refuses_nothing_but_the_sentinels() {
        let own = Own {
            pid: 500,
            pgrp: None,
            sid: None,
        };
        assert_eq!(refused(400, &own), None);
        assert_eq!(refused(300, &own), None);
        assert!(refused(0, &own).is_some());
        assert!(refused(500, &own).is_some());
    }
}
