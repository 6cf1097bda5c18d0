//! What the command line and the ledger's files ask of the OS, on
//! Windows: the console's interrupts held off while a bounded command
//! finishes; its streams' kinds, a terminal's size, a directory's mode bits
//! and room reserved past a file's end are not here, and say so.

/// `kill` and `sweep` finish what they started: the console's Ctrl+C and
/// Ctrl+Break are noted and ignored.
pub fn shield_from_interrupts() {
    if let Err(e) = super::forward_console_ctrl(Box::new(|_| {})) {
        tracing::warn!(error = %e, "cannot shield the teardown from console interrupts");
    }
}

/// Which of stdout and stderr are pipes: not told on Windows (`None`).
pub fn stdio_pipes() -> Option<Vec<&'static str>> {
    None
}

/// No terminal is relayed on Windows (no pseudo-terminal is ever opened):
/// nothing to follow.
pub fn follow_terminal_resizes(_master: std::fs::File) -> Option<Box<dyn FnOnce()>> {
    None
}

/// A data directory's privacy is its ACL's on Windows, the user's own
/// (no mode bits to check): nothing to change or refuse.
pub fn make_dir_private(_dir: &std::path::Path) -> std::io::Result<Result<(), String>> {
    Ok(Ok(()))
}
