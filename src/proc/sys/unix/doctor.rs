//! `treewarden doctor`'s report on Linux and macOS: what this host gives
//! custody (cgroup v2, pidfds, the subreaper, the proc connector), and the
//! boundary and observer `run` would use. `commands/doctor.rs` prints it.

use crate::config::{Config, ObserverMode};
use crate::proc::DoctorReport;

/// The boundary `run` would use with the configured `--boundary`.
fn run_boundary_row(config: &Config, probe: &crate::proc::Probe) -> (&'static str, String, String) {
    let choice = config.boundary;
    match crate::proc::resolve_boundary(choice, probe.cgroup_root.as_deref()) {
        Ok(kind) => (
            "run_boundary",
            kind.to_string(),
            format!("--boundary {choice}"),
        ),
        Err(e) => (
            "run_boundary",
            "none".into(),
            format!("--boundary {choice}: {e}"),
        ),
    }
}

/// Whether `run` would start the observer with the configured `--observer`,
/// and why (not).
fn observer_row(config: &Config, probe: &crate::proc::Probe) -> (bool, String, String) {
    let mode = config.observer;
    let cap = &probe.proc_connector;
    match (mode, cap.available) {
        (ObserverMode::Off, _) => (false, "off".into(), "--observer off: scans only".into()),
        (_, true) => (
            true,
            "on".into(),
            format!("--observer {mode}: proc connector available"),
        ),
        (ObserverMode::Auto, false) => (
            false,
            "off".into(),
            format!("--observer auto: scans only; {}", cap.note),
        ),
        (ObserverMode::On, false) => (
            false,
            "refuse".into(),
            format!("--observer on: run will refuse to start work; {}", cap.note),
        ),
    }
}

/// The cgroup root's layout: root / delegated / shared / not delegated.
fn layout_row(probe: &crate::proc::Probe) -> (&'static str, String, String) {
    match &probe.cgroup_layout {
        Some(l) => ("cgroup_layout", l.layout.to_string(), l.note.clone()),
        None => ("cgroup_layout", "-".into(), "no cgroup root".into()),
    }
}

/// Whether limits (`--pids-max`, `--memory-max`, `--cpu-max`) will work.
fn limits_row(probe: &crate::proc::Probe) -> (&'static str, String, String) {
    let layout_ok = probe.cgroup_layout.as_ref().is_some_and(|l| l.limits);
    let usable: Vec<&str> = ["pids", "memory", "cpu"]
        .into_iter()
        .filter(|c| probe.cgroup_controllers.iter().any(|o| o == c))
        .collect();
    let value = match (layout_ok, usable.len()) {
        (false, _) | (true, 0) => "no",
        (true, 3) => "yes",
        (true, _) => "partly",
    };
    let offered = if probe.cgroup_controllers.is_empty() {
        "none".to_string()
    } else {
        probe.cgroup_controllers.join(" ")
    };
    let why = match &probe.cgroup_layout {
        Some(l) if !l.limits => format!("; {}", l.layout),
        _ => String::new(),
    };
    (
        "limits",
        value.into(),
        format!("controllers offered to tree cgroups: {offered}{why}"),
    )
}

/// `treewarden doctor [--json]`'s report and exit status: the host probe, as a
/// table or one (pretty) JSON object; 0 (the probe describes, never refuses).
pub fn doctor_report(config: &Config, json: bool) -> Result<(DoctorReport, u8), serde_json::Error> {
    let probe = crate::proc::probe(config.cgroup_root.as_deref());
    let (observer_runs, observer_value, observer_note) = observer_row(config, &probe);
    if json {
        let mut value = serde_json::to_value(&probe)?;
        value["observer"] = serde_json::json!({
            "mode": config.observer,
            "would_run": observer_runs,
            "state": observer_value,
            "reason": observer_note,
        });
        let text = serde_json::to_string_pretty(&value)?;
        return Ok((DoctorReport::Json(text), 0));
    }
    let opt = |v: Option<String>| v.unwrap_or_else(|| "-".into());
    let cap = |c: &crate::proc::Capability| (if c.available { "yes" } else { "no" }).to_owned();
    let cap_row = |name, c: &crate::proc::Capability| (name, cap(c), c.note.clone());
    let rows: Vec<(&str, String, String)> = vec![
        ("kernel", probe.kernel_release.clone(), String::new()),
        ("boot_id", opt(probe.boot_id.clone()), String::new()),
        (
            "pid_max",
            opt(probe.pid_max.map(|p| p.to_string())),
            String::new(),
        ),
        cap_row("cgroup_v2", &probe.cgroup_v2),
        (
            "cgroup_root",
            opt(probe.cgroup_root.as_ref().map(|p| p.display().to_string())),
            String::new(),
        ),
        cap_row("cgroup_writable", &probe.cgroup_writable),
        cap_row("cgroup_kill", &probe.cgroup_kill),
        cap_row("cgroup_freeze", &probe.cgroup_freeze),
        layout_row(&probe),
        limits_row(&probe),
        cap_row("pidfd", &probe.pidfd),
        cap_row("pidfd_group_signal", &probe.pidfd_group_signal),
        cap_row("subreaper", &probe.subreaper),
        cap_row("proc_connector", &probe.proc_connector),
        (
            "auto_boundary",
            probe.auto_boundary.to_string(),
            probe.auto_reason.clone(),
        ),
        run_boundary_row(config, &probe),
        ("observer", observer_value, observer_note),
    ];
    Ok((DoctorReport::Table(rows), 0))
}
