//! The cgroup layout treewarden finds, and delegation done the way cgroup v2
//! and systemd ask (systemd.io, "Control Group APIs and Delegation").
//!
//! cgroup v2's "no internal processes" rule: a non-root cgroup that holds
//! processes of its own cannot enable a domain controller (memory, io) in
//! its `cgroup.subtree_control`, and a threaded one (pids, cpu) enabled
//! there turns its children into invalid domains (EOPNOTSUPP on every
//! move). So before treewarden enables a controller for a tree's limits,
//! the cgroup root must hold no process. Under a delegated cgroup that
//! holds only treewarden itself (the unit's `Delegate=yes`, alone in
//! `/system.slice/treewarden.service`) the process moves itself into the
//! leaf `<root>/supervisor` ([`SUPERVISOR_LEAF`]) and the tree cgroups are
//! its siblings. A root that holds other processes (a login shell's scope,
//! a CI job's cgroup) is [`Layout::Shared`]: trees still get cgroups (no
//! controller is needed for `cgroup.kill`/`freeze`/`events`), limits are
//! refused with one line that says why and what to do.
//!
//! It must never: move a process that is not this one; enable a controller
//! it does not need for a spawn; leave one enabled by a spawn that was
//! refused.

use std::path::Path;

use crate::proc::{Layout, LayoutReport, ProcError};

/// The leaf a delegated treewarden moves itself into.
pub const SUPERVISOR_LEAF: &str = "supervisor";

impl std::fmt::Display for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Layout::Root => "root",
            Layout::Delegated => "delegated",
            Layout::Shared => "shared",
            Layout::NotDelegated => "not delegated",
        })
    }
}

/// The hierarchy's root cgroup has no `cgroup.type` (it is not on root).
pub fn is_hierarchy_root(dir: &Path) -> bool {
    dir.join("cgroup.procs").exists() && !dir.join("cgroup.type").exists()
}

/// The pids `cgroup.procs` of `dir` lists.
fn procs(dir: &Path) -> Result<Vec<i32>, ProcError> {
    let file = dir.join("cgroup.procs");
    let text = std::fs::read_to_string(&file).map_err(|e| ProcError::cgroup(&file, e))?;
    Ok(text.lines().filter_map(|l| l.trim().parse().ok()).collect())
}

/// Classifies `root` without changing anything (doctor). A root that holds
/// only this process counts as delegated: [`take_delegation`] would move it
/// into its leaf.
pub fn layout(root: &Path) -> LayoutReport {
    let report = |layout, limits, note: String, supervisor| LayoutReport {
        layout,
        limits,
        note,
        supervisor,
    };
    if rustix::fs::access(root.join("cgroup.procs"), rustix::fs::Access::WRITE_OK).is_err()
        || rustix::fs::access(root, rustix::fs::Access::WRITE_OK).is_err()
    {
        return report(
            Layout::NotDelegated,
            false,
            format!(
                "{} is not writable by this user: it was not delegated (under systemd: a unit with Delegate=yes, or systemd-run --user --scope -p Delegate=yes)",
                root.display()
            ),
            None,
        );
    }
    if is_hierarchy_root(root) {
        return report(
            Layout::Root,
            true,
            format!("{} is the hierarchy's root cgroup", root.display()),
            None,
        );
    }
    let me = std::process::id() as i32;
    match procs(root) {
        Err(e) => report(Layout::Shared, false, e.to_string(), None),
        Ok(pids) if pids.is_empty() => report(
            Layout::Delegated,
            true,
            format!("{} holds no process of its own", root.display()),
            None,
        ),
        Ok(pids) if pids == [me] => report(
            Layout::Delegated,
            true,
            format!(
                "{} holds only this process, which moves itself into {SUPERVISOR_LEAF}/ before it makes tree cgroups",
                root.display()
            ),
            Some(root.join(SUPERVISOR_LEAF)),
        ),
        Ok(pids) => report(
            Layout::Shared,
            false,
            shared_reason(root, pids.iter().filter(|p| **p != me).count()),
            None,
        ),
    }
}

fn shared_reason(root: &Path, others: usize) -> String {
    format!(
        "{} holds {others} other process(es), and cgroup v2 enables no controller in a non-root cgroup with processes of its own: start treewarden in a cgroup of its own (the shipped unit, or systemd-run --scope -p Delegate=yes treewarden …), or point TREEWARDEN_CGROUP_ROOT at an empty delegated cgroup",
        root.display()
    )
}

/// Makes `root` able to give tree cgroups controllers: when it is a
/// non-root cgroup holding only this process, moves this process into
/// `<root>/supervisor` (made if absent). Returns the layout afterwards.
/// Changes nothing for the root cgroup, an empty root, or a shared one.
pub fn take_delegation(root: &Path) -> Result<LayoutReport, ProcError> {
    let found = layout(root);
    let Some(leaf) = found.supervisor.clone() else {
        return Ok(found);
    };
    match std::fs::create_dir(&leaf) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(ProcError::cgroup(&leaf, e)),
    }
    // Controllers a previous instance left enabled: the kernel let this
    // process join only because none is a domain controller used by a
    // populated child (it refuses a process in an inner node otherwise),
    // so no live tree relies on them. But a threaded one (pids, cpu) with
    // this process in the cgroup makes it a thread root, and the leaf an
    // invalid domain: the move below would fail with EOPNOTSUPP. They go,
    // and come back on demand with the next limited spawn.
    let control = root.join("cgroup.subtree_control");
    let left: Vec<String> = std::fs::read_to_string(&control)
        .map_err(|e| ProcError::cgroup(&control, e))?
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    if !left.is_empty() {
        let names: Vec<&str> = left.iter().map(String::as_str).collect();
        tracing::info!(cgroup = %root.display(), controllers = %left.join(" "), "disabling controllers left enabled before moving into the leaf");
        disable_controllers(root, &names);
    }
    // Writing our pid moves every thread of this process.
    std::fs::write(leaf.join("cgroup.procs"), std::process::id().to_string())
        .map_err(|e| ProcError::cgroup(leaf.join("cgroup.procs"), e))?;
    tracing::info!(leaf = %leaf.display(), "moved into the delegated cgroup's leaf");
    let after = layout(root);
    Ok(LayoutReport {
        supervisor: Some(leaf),
        ..after
    })
}

/// Refuses limits under a root whose processes forbid the controllers
/// (one line: why and what to do). `Ok` for the root cgroup and a root with
/// no processes of its own.
pub fn check_limits_possible(root: &Path) -> Result<(), String> {
    if is_hierarchy_root(root) {
        return Ok(());
    }
    let pids = procs(root).map_err(|e| e.to_string())?;
    if pids.is_empty() {
        return Ok(());
    }
    Err(format!(
        "limits refused: {}",
        shared_reason(
            root,
            pids.iter()
                .filter(|p| **p != std::process::id() as i32)
                .count()
        )
    ))
}

/// Enables `controller` in `parent`'s `cgroup.subtree_control` if it is
/// not yet. `Ok(true)`: this call enabled it (the caller disables it again
/// if the spawn it was for is refused).
pub(crate) fn enable_controller(parent: &Path, controller: &str) -> Result<bool, ProcError> {
    let control = parent.join("cgroup.subtree_control");
    let enabled = std::fs::read_to_string(&control).map_err(|e| ProcError::cgroup(&control, e))?;
    if enabled.split_whitespace().any(|c| c == controller) {
        return Ok(false);
    }
    std::fs::write(&control, format!("+{controller}"))
        .map_err(|e| ProcError::cgroup(&control, e))?;
    Ok(true)
}

/// Disables controllers a refused spawn enabled (best effort: a sibling
/// tree that enabled the same one since keeps it, as the kernel refuses to
/// take a controller from a cgroup whose child uses it in its own
/// `subtree_control`; tree cgroups never do).
pub(crate) fn disable_controllers(parent: &Path, controllers: &[&str]) {
    let control = parent.join("cgroup.subtree_control");
    for c in controllers.iter().rev() {
        if let Err(e) = std::fs::write(&control, format!("-{c}")) {
            tracing::warn!(controller = c, cgroup = %parent.display(), error = %e, "could not disable a controller a refused spawn enabled");
        }
    }
}
