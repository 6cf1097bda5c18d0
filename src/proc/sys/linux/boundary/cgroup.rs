//! The cgroup side of a boundary: where the cgroup v2 hierarchy is and
//! whether tree cgroups can be made there (the boundary a tree gets), and a
//! tree's own cgroup: made (a leftover refused when populated), given its
//! limits, removed once the kernel reports it empty; and the parent several
//! trees share (a principal's, `serve --principal-*`): made with the first,
//! given its limits, removed with the last.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::config::BoundaryChoice;
use crate::proc::BoundaryKind;
use crate::proc::signal::cgroup_populated;
use crate::proc::{CgroupSetting, ProcError};

/// The cgroup2 mount point (from `/proc/self/mountinfo`), if any.
pub fn cgroup2_mount() -> Result<Option<PathBuf>, ProcError> {
    Ok(cgroup2_mount_entry()?.map(|(mount, _)| mount))
}

/// (mount point, root of the mount inside the hierarchy) of the first cgroup2 mount.
fn cgroup2_mount_entry() -> Result<Option<(PathBuf, String)>, ProcError> {
    let me = procfs::process::Process::myself().map_err(|e| ProcError::Proc(e.to_string()))?;
    let mounts = me
        .mountinfo()
        .map_err(|e| ProcError::Proc(format!("mountinfo: {e}")))?;
    Ok(mounts
        .into_iter()
        .find(|m| m.fs_type == "cgroup2")
        .map(|m| (m.mount_point, m.root)))
}

/// The cgroup v2 directory the calling process lives in: the cgroup2 mount
/// joined with our `0::` path from `/proc/self/cgroup`. `None` when there is
/// no cgroup2 mount or our cgroup lies outside it.
pub fn own_cgroup_dir() -> Result<Option<PathBuf>, ProcError> {
    let Some((mount, mount_root)) = cgroup2_mount_entry()? else {
        return Ok(None);
    };
    let me = procfs::process::Process::myself().map_err(|e| ProcError::Proc(e.to_string()))?;
    let groups = me
        .cgroups()
        .map_err(|e| ProcError::Proc(format!("/proc/self/cgroup: {e}")))?;
    let Some(v2) = groups.0.into_iter().find(|g| g.hierarchy == 0) else {
        return Ok(None);
    };
    // Inside a cgroup namespace or a bind mount the mount's root is not "/";
    // our path must lie below it to be reachable through this mount.
    let Some(rel) = Path::new(&v2.pathname)
        .strip_prefix(&mount_root)
        .ok()
        .map(Path::to_path_buf)
    else {
        return Ok(None);
    };
    let dir = if rel.as_os_str().is_empty() {
        mount
    } else {
        mount.join(rel)
    };
    Ok(dir.join("cgroup.procs").exists().then_some(dir))
}

/// Where tree cgroups go: the override (`TREEWARDEN_CGROUP_ROOT`,
/// `Config::cgroup_root`) if given, else the cgroup v2 directory of our own
/// process. `Ok(None)` when no cgroup v2 hierarchy is mounted.
///
/// Tree cgroups are made next to our own processes. cgroup v2's "no internal
/// processes" rule does not stop this: it applies only to a cgroup with
/// controllers enabled in `cgroup.subtree_control`, and treewarden enables
/// none (it needs only `cgroup.procs`, `cgroup.kill`, `cgroup.freeze`,
/// `cgroup.events`, which every non-root cgroup has). Under systemd the
/// owning unit needs `Delegate=yes`, or systemd may move or remove them.
pub fn cgroup_root(override_: Option<&Path>) -> Result<Option<PathBuf>, ProcError> {
    match override_ {
        Some(root) if root.join("cgroup.procs").exists() => Ok(Some(root.to_path_buf())),
        Some(root) => Err(ProcError::NoCgroup(format!(
            "{} is not a cgroup v2 directory (no cgroup.procs)",
            root.display()
        ))),
        None => own_cgroup_dir(),
    }
}

/// Whether tree cgroups can be made under `root`: `cgroup.procs` is
/// writable and a probe cgroup is created (and removed again). `Err` is the
/// reason.
pub fn check_cgroup_writable(root: &Path) -> Result<(), String> {
    probe_child_cgroup(root).map(|_| ())
}

/// Which control files a tree cgroup under `root` gets (the root cgroup
/// itself has neither `cgroup.kill` nor `cgroup.freeze`, so a child is
/// created to look). Returns `(cgroup.kill, cgroup.freeze)` present.
pub(crate) fn probe_child_cgroup(root: &Path) -> Result<(bool, bool), String> {
    rustix::fs::access(root.join("cgroup.procs"), rustix::fs::Access::WRITE_OK)
        .map_err(|e| format!("{}/cgroup.procs not writable: {e}", root.display()))?;
    let probe = root.join(format!("treewarden-probe-{}", std::process::id()));
    std::fs::create_dir(&probe)
        .map_err(|e| format!("cannot create a cgroup under {}: {e}", root.display()))?;
    let files = (
        probe.join("cgroup.kill").exists(),
        probe.join("cgroup.freeze").exists(),
    );
    std::fs::remove_dir(&probe)
        .map_err(|e| format!("cannot remove probe cgroup {}: {e}", probe.display()))?;
    Ok(files)
}

/// Resolves the configured choice to the boundary a new tree gets. `Cgroup`
/// without a writable root is an error; `Auto` falls back to `Session`.
pub fn resolve_boundary(
    choice: BoundaryChoice,
    root: Option<&Path>,
) -> Result<BoundaryKind, ProcError> {
    match choice {
        BoundaryChoice::Session => Ok(BoundaryKind::Session),
        BoundaryChoice::Auto => Ok(match root.map(check_cgroup_writable) {
            Some(Ok(())) => BoundaryKind::Cgroup,
            _ => BoundaryKind::Session,
        }),
        BoundaryChoice::Cgroup => match root {
            None => Err(ProcError::NoCgroup(
                "no cgroup v2 hierarchy is mounted".into(),
            )),
            Some(root) => check_cgroup_writable(root)
                .map(|()| BoundaryKind::Cgroup)
                .map_err(ProcError::NoCgroup),
        },
    }
}

/// Removes a tree's cgroup directory (and any empty sub-cgroups the tree
/// made) if nothing lives in it. `Ok(true)`: the directory is gone (removed
/// now, or already absent). `Ok(false)`: still populated, left in place.
pub fn remove_cgroup_if_empty(path: &Path) -> Result<bool, ProcError> {
    if !path.join("cgroup.procs").exists() {
        return if path.exists() {
            Err(ProcError::cgroup(
                path,
                std::io::Error::other("not a cgroup directory"),
            ))
        } else {
            Ok(true)
        };
    }
    let entries = std::fs::read_dir(path).map_err(|e| ProcError::cgroup(path, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| ProcError::cgroup(path, e))?;
        if entry.file_type().map(|t| t.is_dir()).unwrap_or(false)
            && !remove_cgroup_if_empty(&entry.path())?
        {
            return Ok(false);
        }
    }
    match std::fs::remove_dir(path) {
        Ok(()) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => Ok(false),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(true),
        Err(e) => Err(ProcError::cgroup(path, e)),
    }
}

/// Writes the settings (limits) into a fresh tree cgroup, enabling each
/// controller in the parent's `cgroup.subtree_control` where it is not yet.
/// On failure the controllers this call enabled are disabled again, so a
/// refused spawn leaves the parent as it found it (the caller removes the
/// tree cgroup).
pub(super) fn apply_settings(cg: &Path, settings: &[CgroupSetting]) -> Result<(), ProcError> {
    let mut enabled: Vec<&str> = Vec::new();
    let result = (|| {
        for s in settings {
            if let Some(parent) = cg.parent()
                && super::delegation::enable_controller(parent, s.controller)?
            {
                enabled.push(s.controller);
            }
            let file = cg.join(s.file);
            std::fs::write(&file, &s.value).map_err(|e| ProcError::cgroup(&file, e))?;
        }
        Ok(())
    })();
    if result.is_err()
        && let Some(parent) = cg.parent()
        && !enabled.is_empty()
    {
        // The tree cgroup goes first, then the controllers it was to use.
        let _ = remove_cgroup_if_empty(cg);
        super::delegation::disable_controllers(parent, &enabled);
    }
    result
}

/// Creates a tree's cgroup. The name is new to the caller's ledger, so a
/// directory already there is a leftover it does not know (another ledger's
/// crash, or a ledger restored from a backup): an *empty* one is removed and
/// made again; a populated one is refused, never joined.
fn make_tree_cgroup(cg: &Path) -> Result<(), ProcError> {
    match std::fs::create_dir(cg) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            if cgroup_populated(cg)? {
                return Err(ProcError::cgroup(
                    cg,
                    std::io::Error::other(
                        "exists and holds processes this ledger does not know; refusing to join it (remove it, or end what it holds)",
                    ),
                ));
            }
            tracing::warn!(cgroup = %cg.display(), "an empty leftover cgroup of this name was removed");
            if !remove_cgroup_if_empty(cg)? {
                return Err(ProcError::cgroup(
                    cg,
                    std::io::Error::other("an empty leftover of this name could not be removed"),
                ));
            }
            std::fs::create_dir(cg).map_err(|e| ProcError::cgroup(cg, e))
        }
        Err(e) => Err(ProcError::cgroup(cg, e)),
    }
}

/// Removes an empty cgroup once the kernel lets go of it, waiting up to
/// `wait` for `populated 0` (the kernel's notification, not a timed poll;
/// [`super::cgroup_wait_event`]); `false` when it stayed populated. A tree
/// cgroup whose parent is a shared one ([`is_shared_parent`]) takes that
/// parent with it when it was the last tree there.
pub fn remove_cgroup_when_empty(path: &Path, wait: Duration) -> Result<bool, ProcError> {
    let removed = remove_one_when_empty(path, wait)?;
    if removed
        && let Some(parent) = path.parent()
        && is_shared_parent(parent)
        && let Err(e) = remove_shared_parent_if_empty(parent)
    {
        tracing::warn!(cgroup = %parent.display(), error = %e, "a shared parent cgroup left empty was not removed");
    }
    Ok(removed)
}

fn remove_one_when_empty(path: &Path, wait: Duration) -> Result<bool, ProcError> {
    let deadline = Instant::now() + wait;
    loop {
        if !path.exists() {
            return Ok(true);
        }
        if !super::cgroup_wait_event(path, crate::proc::CgroupEvent::Populated, false, deadline)? {
            return Ok(false);
        }
        if remove_cgroup_if_empty(path)? {
            return Ok(true);
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
        // Empty by `cgroup.events` but rmdir still busy: the kernel is
        // finishing the last exit.
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// What marks a shared parent's name after the ledger's prefix: the
/// parent is `tw-<8 hex>-p-<key>` (a tree cgroup is `tw-<8 hex>-<id>`).
pub const SHARED_PARENT_MARK: &str = "-p-";

/// Whether `dir` is named as the parent several trees share
/// (`tw-<8 hex>-p-<key>`, with a key): the cgroup a tree's removal takes
/// with it once it is left empty. By name alone: a teardown knows its
/// tree's recorded path, not how the spawn laid it out.
pub fn is_shared_parent(dir: &Path) -> bool {
    let Some(rest) = dir
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix("tw-"))
    else {
        return false;
    };
    let b = rest.as_bytes();
    b.len() > 8 + SHARED_PARENT_MARK.len()
        && b[..8].iter().all(u8::is_ascii_hexdigit)
        && b[8..].starts_with(SHARED_PARENT_MARK.as_bytes())
}

/// Removes a shared parent with no tree left in it. A plain `rmdir`: the
/// kernel refuses it (EBUSY) while any child cgroup is there, so a tree
/// being made in it meanwhile keeps it (and one whose parent went just
/// before its own `mkdir` makes it again: [`make_tree_cgroups`]).
/// `Ok(true)`: removed by this call; `Ok(false)`: a tree is still there, or
/// it was already gone.
pub fn remove_shared_parent_if_empty(dir: &Path) -> Result<bool, ProcError> {
    match std::fs::remove_dir(dir) {
        Ok(()) => {
            tracing::debug!(cgroup = %dir.display(), "shared parent cgroup removed with its last tree");
            Ok(true)
        }
        Err(e)
            if e.kind() == std::io::ErrorKind::NotFound
                || matches!(e.raw_os_error(), Some(libc::EBUSY | libc::ENOTEMPTY)) =>
        {
            Ok(false)
        }
        Err(e) => Err(ProcError::cgroup(dir, e)),
    }
}

/// What [`make_tree_cgroups`] did to a shared parent, so a refused spawn
/// undoes it ([`SharedParent::undo`]).
#[derive(Debug)]
pub(super) struct SharedParent {
    dir: PathBuf,
    /// Controllers this spawn enabled in the cgroup root's
    /// `cgroup.subtree_control` for the parent.
    root_enabled: Vec<&'static str>,
}

impl SharedParent {
    /// After the tree's cgroup was removed: the parent goes if no other
    /// tree is in it, and then the controllers this spawn enabled in the
    /// root for it (the kernel keeps one a sibling still uses).
    pub(super) fn undo(&self) {
        let gone =
            matches!(remove_shared_parent_if_empty(&self.dir), Ok(true)) || !self.dir.exists();
        if gone
            && !self.root_enabled.is_empty()
            && let Some(root) = self.dir.parent()
        {
            super::delegation::disable_controllers(root, &self.root_enabled);
        }
    }
}

/// Makes a tree's cgroup, and first its shared parent when `parent_settings`
/// names one (see `SpawnSpec::parent_settings`). A parent its last tree's
/// teardown removed between the two `mkdir`s (the tree's then fails with
/// ENOENT) is made again, up to a few times.
pub(super) fn make_tree_cgroups(
    cg: &Path,
    parent_settings: &[CgroupSetting],
    settings: &[CgroupSetting],
) -> Result<Option<SharedParent>, ProcError> {
    if parent_settings.is_empty() {
        return make_tree_cgroup(cg).map(|()| None);
    }
    let parent = cg.parent().ok_or_else(|| {
        ProcError::cgroup(
            cg,
            std::io::Error::other("a tree cgroup below a shared parent has a parent"),
        )
    })?;
    let mut tries = 0;
    loop {
        tries += 1;
        let shared = prepare_shared_parent(parent, parent_settings, settings)?;
        match make_tree_cgroup(cg) {
            Ok(()) => return Ok(Some(shared)),
            Err(_) if !parent.exists() && tries < 5 => continue,
            Err(e) => {
                shared.undo();
                return Err(e);
            }
        }
    }
}

/// Makes the shared parent if absent and gives it its limits: the
/// controllers of its settings and of the tree's own enabled in the root
/// (so the parent can be limited and the tree's limits enabled in it), its
/// own settings' enabled in the parent's `cgroup.subtree_control` (each
/// tree keeps its own `memory.events`: the OOM kill is recorded for the
/// tree whose process it killed), then its settings written (every time
/// a tree joins: the running service's limits are the parent's). On
/// failure what this call did is undone.
fn prepare_shared_parent(
    parent: &Path,
    parent_settings: &[CgroupSetting],
    settings: &[CgroupSetting],
) -> Result<SharedParent, ProcError> {
    let root = parent.parent().ok_or_else(|| {
        ProcError::cgroup(
            parent,
            std::io::Error::other("a shared parent has a parent"),
        )
    })?;
    let mut shared = SharedParent {
        dir: parent.to_path_buf(),
        root_enabled: Vec::new(),
    };
    let result = (|| {
        for s in parent_settings.iter().chain(settings) {
            if !shared.root_enabled.contains(&s.controller)
                && super::delegation::enable_controller(root, s.controller)?
            {
                shared.root_enabled.push(s.controller);
            }
        }
        match std::fs::create_dir(parent) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(ProcError::cgroup(parent, e)),
        }
        for s in parent_settings {
            super::delegation::enable_controller(parent, s.controller)?;
        }
        for s in parent_settings {
            let file = parent.join(s.file);
            std::fs::write(&file, &s.value).map_err(|e| ProcError::cgroup(&file, e))?;
        }
        Ok(())
    })();
    match result {
        Ok(()) => Ok(shared),
        Err(e) => {
            shared.undo();
            Err(e)
        }
    }
}
