//! The local end of `serve` on Unix: the Unix socket it listens on (bound,
//! a stale one replaced, its file removed only while still this one's),
//! SIGTERM and SIGINT as the drain's start, and the token file's mode.

use std::path::Path;

/// Whether this platform serves a local socket beside TCP (Unix: yes; its
/// peers are named by `SO_PEERCRED` and may send descriptors).
pub const LOCAL_SOCKET: bool = true;

/// The directory `serve` runs in, its own paths made absolute first, so
/// that no relative path resolves against where it was started (Unix: `/`).
pub const SERVICE_DIR: Option<&str> = Some("/");

/// The data dir root (the superuser) gets by default (Unix: `/var/lib/treewarden`).
pub const SUPERUSER_DATA_DIR: Option<&str> = Some("/var/lib/treewarden");

/// Whether `serve` may listen on TCP beyond loopback (Unix: yes, every request then needing a token).
pub const BEYOND_LOOPBACK: bool = true;

/// The local socket's listener.
pub type LocalListener = tokio::net::UnixListener;

/// A socket file's identity, not following a last symlink: its device and
/// inode, and its change time, since a filesystem such as ext4 gives a
/// file made just after another's removal the same inode number.
pub type FileKey = (u64, u64, i64, i64);

/// The identity of the file at `path` ([`FileKey`]); `None` where there is
/// none.
pub fn file_key(path: &Path) -> Option<FileKey> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino(), m.ctime(), m.ctime_nsec()))
}

/// Routes SIGTERM and SIGINT to `shutdown`. Called before any listener
/// opens and before any teardown can start, so a signal at any moment of
/// start-up (recovery included) starts the bounded drain instead of ending
/// the process where it stands.
pub fn shutdown_on_signals(shutdown: tokio_util::sync::CancellationToken) -> std::io::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = int.recv() => tracing::info!("SIGINT: shutting down"),
            _ = shutdown.cancelled() => return,
        }
        shutdown.cancel();
    });
    Ok(())
}

/// Binds the Unix socket at `path`: its directory made (0755) if missing, a
/// stale socket left by a killed instance removed (one that still answers
/// is in use: refused), and the socket made 0666 — any local user may
/// connect; who they are comes from `SO_PEERCRED`, not from the file mode
/// (docs/THREAT-MODEL.md).
pub fn bind_local(path: &Path) -> std::io::Result<LocalListener> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    if let Some(dir) = path.parent()
        && !dir.as_os_str().is_empty()
        && !dir.exists()
    {
        std::os::unix::fs::DirBuilderExt::mode(std::fs::DirBuilder::new().recursive(true), 0o755)
            .create(dir)?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::AddrInUse,
                    format!("{} is in use by a running service", path.display()),
                ));
            }
            std::fs::remove_file(path)?;
        }
        Ok(_) => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                format!("{} exists and is not a socket", path.display()),
            ));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let listener = tokio::net::UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))?;
    Ok(listener)
}

/// A secret's file others may read is refused (its mode).
pub fn refuse_if_open_to_others(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(path)?.permissions().mode();
    if mode & 0o077 != 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "{} is readable by others (mode {:o}); run `chmod 600` on it",
                path.display(),
                mode & 0o777
            ),
        ));
    }
    Ok(())
}

/// systemd's notify protocol (`Type=notify`, the watchdog): the crate's.
pub use ::sd_notify;
