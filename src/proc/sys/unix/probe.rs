//! What `probe` answers on Linux and macOS: one report, the same fields
//! (`sys/linux/probe.rs` probes for real; macOS answers each).

use std::path::PathBuf;

use crate::proc::Capability;

/// The host's process-custody capabilities: Linux's fields (the `doctor`
/// table is one), each answered for macOS there.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Probe {
    /// `uname -r`.
    pub kernel_release: String,
    pub boot_id: Option<String>,
    pub pid_max: Option<i32>,
    /// A cgroup2 filesystem is mounted (note: the mount point).
    pub cgroup_v2: Capability,
    pub cgroup2_mount: Option<PathBuf>,
    /// Where tree cgroups would go (override or our own cgroup).
    pub cgroup_root: Option<PathBuf>,
    /// A tree cgroup can be created under the root and processes moved there.
    pub cgroup_writable: Capability,
    /// `cgroup.kill` exists (kernel >= 5.14).
    pub cgroup_kill: Capability,
    /// `cgroup.freeze` exists (kernel >= 5.2).
    pub cgroup_freeze: Capability,
    /// `pidfd_open` works (kernel >= 5.3).
    pub pidfd: Capability,
    /// Process groups are signalled through a pidfd of their leader
    /// (`PIDFD_SIGNAL_PROCESS_GROUP`, Linux 6.9); else the checked killpg.
    pub pidfd_group_signal: Capability,
    /// `PR_SET_CHILD_SUBREAPER` can be set.
    pub subreaper: Capability,
    /// The proc connector could be subscribed to (needs CAP_NET_ADMIN in the
    /// initial user and pid namespaces); probed by subscribing.
    pub proc_connector: Capability,
    /// The cgroup root's layout (root / delegated / shared / not delegated)
    /// and whether a tree's limits can be enforced under it.
    pub cgroup_layout: Option<crate::proc::LayoutReport>,
    /// Which controllers tree cgroups can be given (`cgroup.controllers`
    /// of the root).
    pub cgroup_controllers: Vec<String>,
    /// What `--boundary auto` picks here.
    pub auto_boundary: crate::proc::BoundaryKind,
    pub auto_reason: String,
}
