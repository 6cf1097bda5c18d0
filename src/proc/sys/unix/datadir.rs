//! A data directory made private to its owner (POSIX modes).

use std::path::Path;

/// Makes `dir` private to its owner: group and other bits (0755, say) are
/// dropped to 0700 (logged at info). `Ok(Err(why))` refuses it, changing
/// nothing: a directory that is not this user's own (whatever its mode: its
/// owner could replace what is in it), or one shared on purpose (the sticky
/// bit, as `/tmp`) that already holds something. An *empty* sticky directory
/// of this user's (a tmpfs freshly mounted for it: its root is 1777) is
/// tightened. `Err` is a failed read or change of its mode.
pub fn make_dir_private(dir: &Path) -> std::io::Result<Result<(), String>> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let meta = std::fs::metadata(dir)?;
    let mode = meta.mode() & 0o7777;
    let me = rustix::process::geteuid().as_raw();
    // Whatever its mode: its owner can replace the ledger in it (and, a
    // 0700 folder being theirs to open, read every tree's argv), so a
    // ledger there is theirs to rewrite, not this user's record.
    if meta.uid() != me {
        return Ok(Err(format!(
            "data dir {} is owned by uid {}, not by this user (uid {me}): use a --data-dir of this user's own (mode 0700)",
            dir.display(),
            meta.uid()
        )));
    }
    if mode & 0o077 == 0 {
        return Ok(Ok(()));
    }
    let in_use = || {
        std::fs::read_dir(dir)
            .map(|mut entries| entries.next().is_some())
            .unwrap_or(true)
    };
    if mode & 0o1000 != 0 && in_use() {
        return Ok(Err(format!(
            "data dir {} is shared (mode {mode:04o}, owner uid {}): use a private --data-dir (mode 0700)",
            dir.display(),
            meta.uid()
        )));
    }
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    tracing::info!(dir = %dir.display(), was = format!("{mode:04o}"), "data dir was open to others: made 0700");
    Ok(Ok(()))
}
