//! What this host supports, probed for real (the `doctor` command).
//!
//! Each item is tried, not guessed from the kernel version: a pidfd is opened
//! on ourselves, a probe cgroup is created and removed, the subreaper flag is
//! set and read back. An unsupported item always carries a reason. The probe
//! never changes lasting state: the subreaper flag is restored when the probe
//! set it, and the probe cgroup is removed.

use std::path::Path;

use super::boundary::{cgroup_root, cgroup2_mount, probe_child_cgroup};
use crate::proc::{BoundaryKind, Probe};

pub use crate::proc::types::Capability;

/// Probes the host. `cgroup_root_override` is `Config::cgroup_root`.
// Over 100 lines on purpose: a flat list of independent capability checks filling one `Probe`
// (doctor's report), a few lines each.
pub fn probe(cgroup_root_override: Option<&Path>) -> Probe {
    let kernel_release = rustix::system::uname()
        .release()
        .to_string_lossy()
        .into_owned();
    let boot_id = super::identity::boot_id().ok().map(str::to_owned);
    let pid_max = procfs::sys::kernel::pid_max().ok();

    let mount = cgroup2_mount();
    let cgroup2_mount = mount.as_ref().ok().cloned().flatten();
    let cgroup_v2 = match &mount {
        Ok(Some(m)) => Capability::yes(format!("mounted at {}", m.display())),
        Ok(None) => Capability::no("no cgroup2 filesystem in /proc/self/mountinfo"),
        Err(e) => Capability::no(format!("cannot read mountinfo: {e}")),
    };
    let root = cgroup_root(cgroup_root_override);
    let (cgroup_root, root_note) = match root {
        Ok(Some(r)) => (Some(r), String::new()),
        Ok(None) if cgroup2_mount.is_some() => (
            None,
            "our cgroup (/proc/self/cgroup 0::) is not reachable through the cgroup2 mount".into(),
        ),
        Ok(None) => (None, "no cgroup v2 hierarchy".into()),
        Err(e) => (None, e.to_string()),
    };
    let unavailable = |what: &str| -> Capability {
        Capability::no(format!("{what}: no cgroup root ({root_note})"))
    };
    let (cgroup_writable, cgroup_kill, cgroup_freeze) = match &cgroup_root {
        None => (
            unavailable("not writable"),
            unavailable("unknown"),
            unavailable("unknown"),
        ),
        Some(r) => match probe_child_cgroup(r) {
            Ok((kill, freeze)) => {
                let file = |present: bool, name: &str, kernel: &str| {
                    if present {
                        Capability::yes(format!("{name} present in a tree cgroup"))
                    } else {
                        Capability::no(format!("{name} missing (needs Linux >= {kernel})"))
                    }
                };
                (
                    Capability::yes(format!(
                        "created and removed a probe cgroup in {}",
                        r.display()
                    )),
                    file(kill, "cgroup.kill", "5.14"),
                    file(freeze, "cgroup.freeze", "5.2"),
                )
            }
            Err(why) => (
                Capability::no(why.clone()),
                Capability::no(format!("unknown: {why}")),
                Capability::no(format!("unknown: {why}")),
            ),
        },
    };

    let cgroup_layout = cgroup_root.as_deref().map(super::delegation::layout);
    let cgroup_controllers = cgroup_root
        .as_deref()
        .and_then(|r| super::resources::cgroup_controllers(r).ok())
        .unwrap_or_default();

    let pidfd = match rustix::process::pidfd_open(
        rustix::process::getpid(),
        rustix::process::PidfdFlags::empty(),
    ) {
        Ok(_) => Capability::yes("pidfd_open on self works"),
        Err(e) => Capability::no(format!("pidfd_open failed: {e} (needs Linux >= 5.3)")),
    };
    let pidfd_group_signal = if super::signal::pidfd_group_signals_supported() {
        Capability::yes(
            "pidfd_send_signal(PIDFD_SIGNAL_PROCESS_GROUP): group signals reach the recorded leader's group or nobody",
        )
    } else {
        Capability::no(
            "no PIDFD_SIGNAL_PROCESS_GROUP (needs Linux >= 6.9): groups get the checked killpg",
        )
    };
    let subreaper = probe_subreaper();
    let proc_connector = probe_proc_connector();

    let (auto_boundary, auto_reason) = if cgroup_writable.available {
        (
            BoundaryKind::Cgroup,
            "a writable cgroup v2 hierarchy exists".to_owned(),
        )
    } else {
        (
            BoundaryKind::Session,
            format!("no writable cgroup v2: {}", cgroup_writable.note),
        )
    };
    Probe {
        kernel_release,
        boot_id,
        pid_max,
        cgroup_v2,
        cgroup2_mount,
        cgroup_root,
        cgroup_writable,
        cgroup_kill,
        cgroup_freeze,
        cgroup_layout,
        cgroup_controllers,
        pidfd,
        pidfd_group_signal,
        subreaper,
        proc_connector,
        auto_boundary,
        auto_reason,
    }
}

/// Sets the subreaper flag, reads it back, and restores it if it was unset,
/// so probing inside a long-running owner changes nothing.
fn probe_subreaper() -> Capability {
    match rustix::process::child_subreaper() {
        Ok(Some(_)) => return Capability::yes("already set on this process"),
        Ok(None) => {}
        Err(e) => return Capability::no(format!("PR_GET_CHILD_SUBREAPER failed: {e}")),
    }
    let me = rustix::process::getpid();
    if let Err(e) = rustix::process::set_child_subreaper(Some(me)) {
        return Capability::no(format!("PR_SET_CHILD_SUBREAPER failed: {e}"));
    }
    let read_back = rustix::process::child_subreaper();
    let _ = rustix::process::set_child_subreaper(None);
    match read_back {
        Ok(Some(_)) => Capability::yes("PR_SET_CHILD_SUBREAPER set and read back"),
        Ok(None) => Capability::no("PR_SET_CHILD_SUBREAPER did not stick"),
        Err(e) => Capability::no(format!("PR_GET_CHILD_SUBREAPER failed: {e}")),
    }
}

/// Opens and subscribes a connector for real (the kernel acknowledges the
/// subscription, or says why not), then closes it.
fn probe_proc_connector() -> Capability {
    match super::connector::Connector::open(4096) {
        Ok(_) => Capability::yes("subscribed to proc events and acknowledged by the kernel"),
        Err(e) => {
            const CAP_NET_ADMIN: u32 = 12;
            let has_cap = procfs::process::Process::myself()
                .and_then(|p| p.status())
                .map(|s| s.capeff & (1u64 << CAP_NET_ADMIN) != 0)
                .unwrap_or(false);
            let hint = if has_cap {
                ""
            } else {
                " (needs CAP_NET_ADMIN, not in CapEff)"
            };
            Capability::no(format!("proc connector unavailable: {e}{hint}"))
        }
    }
}
