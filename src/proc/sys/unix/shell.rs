//! What the command line asks of the OS on Linux and macOS: interrupts
//! held off while a bounded command finishes, the termination signals
//! forwarded to an owner's loop, which of its standard streams are pipes,
//! and a terminal's size followed into a tree's pseudo-terminal.

/// A teardown interrupted between freeze and thaw would leave the tree
/// frozen (or SIGSTOPped). `kill` and `sweep` are bounded, so they finish
/// what they started: SIGINT, SIGTERM and SIGHUP are noted and ignored.
/// (SIGKILL cannot be; a tree left frozen by it is in state `killing` and
/// the next sweep resumes it.)
pub fn shield_from_interrupts() {
    let noted = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    for sig in [
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGHUP,
    ] {
        if let Err(e) = signal_hook::flag::register(sig, noted.clone()) {
            tracing::warn!(signal = sig, error = %e, "cannot shield the teardown from this signal");
        }
    }
}

/// Which of this process's stdout and stderr are pipes (`"stdout"`,
/// `"stderr"`, in that order); `None` where that cannot be told.
pub fn stdio_pipes() -> Option<Vec<&'static str>> {
    use std::os::unix::fs::FileTypeExt;
    Some(
        [("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")]
            .into_iter()
            .filter(|(_, fd)| std::fs::metadata(fd).is_ok_and(|m| m.file_type().is_fifo()))
            .map(|(name, _)| name)
            .collect(),
    )
}

/// Copies the caller's terminal size to `master` on every SIGWINCH, on a
/// thread of its own; the returned call stops it. `None` when the signal
/// cannot be followed.
pub fn follow_terminal_resizes(master: std::fs::File) -> Option<Box<dyn FnOnce()>> {
    let mut winch = signal_hook::iterator::Signals::new([signal_hook::consts::SIGWINCH]).ok()?;
    let handle = winch.handle();
    let _ = std::thread::Builder::new()
        .name("tw-tty-winch".into())
        .spawn(move || {
            for _ in winch.forever() {
                crate::proc::tty::copy_stdin_size_to(&master);
            }
        });
    Some(Box::new(move || handle.close()))
}

/// A running forward of the termination signals ([`forward_console_ctrl`]).
pub struct CtrlForward(signal_hook::iterator::Handle);

impl CtrlForward {
    /// Ends the forwarding thread.
    pub fn close(&self) {
        self.0.close();
    }
}

/// SIGINT, SIGTERM and SIGHUP handed to `on`, each by its number, from a
/// thread of its own until [`CtrlForward::close`] (Windows: the console's
/// Ctrl+C, Ctrl+Break and close, as those numbers).
pub fn forward_console_ctrl(
    on: Box<dyn Fn(i32) + Send + Sync>,
) -> Result<CtrlForward, crate::proc::ProcError> {
    let mut signals = signal_hook::iterator::Signals::new([
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGHUP,
    ])
    .map_err(crate::proc::ProcError::Io)?;
    let handle = signals.handle();
    std::thread::Builder::new()
        .name("tw-signals".into())
        .spawn(move || {
            for sig in signals.forever() {
                on(sig);
            }
        })
        .map_err(crate::proc::ProcError::Io)?;
    Ok(CtrlForward(handle))
}
