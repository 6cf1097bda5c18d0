//! The local end of `serve` on Windows: no local socket (`serve` listens on
//! loopback TCP only), the console's Ctrl+C, Ctrl+Break and close as the
//! drain's start, and no mode bits on the token file.

use std::path::Path;

/// Whether this platform serves a local socket beside TCP (Windows: no;
/// the Unix socket's peer credentials and `SCM_RIGHTS` are Unix's).
pub const LOCAL_SOCKET: bool = false;

/// The directory `serve` runs in, its own paths made absolute first
/// (Windows: none; it stays where it was started, as before).
pub const SERVICE_DIR: Option<&str> = None;

/// The data dir root (the superuser) gets by default (Windows: none; root has no meaning there, every user gets the per-user default).
pub const SUPERUSER_DATA_DIR: Option<&str> = None;

/// Whether `serve` may listen on TCP beyond loopback (Windows: no, `serve` is loopback TCP only there).
pub const BEYOND_LOOPBACK: bool = false;

/// The local socket's listener: there is none, so none is ever made.
pub enum LocalListener {}

/// A socket file's identity (Unix's); never read here.
pub type FileKey = (u64, u64, i64, i64);

/// No local socket file: `None`.
pub fn file_key(_path: &Path) -> Option<FileKey> {
    None
}

/// The console's Ctrl+C, Ctrl+Break and close (the window closed, or
/// `GenerateConsoleCtrlEvent` from a supervisor) start the bounded drain. A
/// console close gives the process only a few seconds before Windows ends
/// it (and with it the jobs it holds: their standing authorization,
/// `kill_on_job_close`).
pub fn shutdown_on_signals(shutdown: tokio_util::sync::CancellationToken) -> std::io::Result<()> {
    use tokio::signal::windows::{ctrl_break, ctrl_c, ctrl_close};
    let mut c = ctrl_c()?;
    let mut brk = ctrl_break()?;
    let mut close = ctrl_close()?;
    tokio::spawn(async move {
        tokio::select! {
            _ = c.recv() => tracing::info!("Ctrl+C: shutting down"),
            _ = brk.recv() => tracing::info!("Ctrl+Break: shutting down"),
            _ = close.recv() => tracing::info!("console closed: shutting down"),
            _ = shutdown.cancelled() => return,
        }
        shutdown.cancel();
    });
    Ok(())
}

/// No local socket here: refused (never called: [`LOCAL_SOCKET`] is false).
pub fn bind_local(path: &Path) -> std::io::Result<LocalListener> {
    Err(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        format!("{}: no local socket on Windows", path.display()),
    ))
}

/// No mode bits: a secret's file is as private as its directory's ACL (by
/// default the user's own profile's: the user, SYSTEM and Administrators).
pub fn refuse_if_open_to_others(_path: &Path) -> std::io::Result<()> {
    Ok(())
}

/// Windows has no systemd: the notify calls are no-ops here (the same
/// names as the crate's on Unix, so the call sites are one).
pub mod sd_notify {
    /// A state told to the service manager; named, never read here.
    pub enum NotifyState<'a> {
        Ready,
        Stopping,
        Watchdog,
        Status(&'a str),
    }

    /// No watchdog.
    pub fn watchdog_enabled() -> Option<std::time::Duration> {
        None
    }

    /// Nothing to tell.
    pub fn notify(_state: &[NotifyState<'_>]) -> std::io::Result<()> {
        Ok(())
    }
}
