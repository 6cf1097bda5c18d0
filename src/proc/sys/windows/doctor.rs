//! `treewarden doctor`'s report on Windows: what the Job Object boundary
//! needs, and the boundary `run` would use. `commands/doctor.rs` prints it.

use crate::config::Config;
use crate::proc::DoctorReport;

/// `treewarden doctor [--json]`'s report and exit status on Windows: what the
/// Job Object boundary needs, probed by making a job; 1 when no job can be made.
pub fn doctor_report(config: &Config, json: bool) -> Result<(DoctorReport, u8), serde_json::Error> {
    let probe = crate::proc::probe(config.cgroup_root.as_deref());
    let run_boundary = crate::proc::resolve_boundary(config.boundary, None);
    if json {
        let mut value = serde_json::to_value(&probe)?;
        value["run_boundary"] = match &run_boundary {
            Ok(kind) => serde_json::json!(kind.to_string()),
            Err(e) => serde_json::json!({ "refused": e.to_string() }),
        };
        let code = if probe.job_object.available { 0 } else { 1 };
        return Ok((DoctorReport::Json(value.to_string()), code));
    }
    let cap = |c: &crate::proc::Capability| if c.available { "yes" } else { "no" }.to_string();
    let rows = vec![
        ("os", probe.kernel_release.clone(), String::new()),
        (
            "job object",
            cap(&probe.job_object),
            probe.job_object.note.clone(),
        ),
        (
            "breakaway",
            if probe.breakaway_refused.available {
                "refused"
            } else {
                "allowed"
            }
            .to_string(),
            probe.breakaway_refused.note.clone(),
        ),
        (
            "run_boundary",
            match &run_boundary {
                Ok(kind) => kind.to_string(),
                Err(_) => "none".into(),
            },
            match &run_boundary {
                Ok(_) => format!("--boundary {}", config.boundary),
                Err(e) => format!("--boundary {}: {e}", config.boundary),
            },
        ),
        (
            "observer",
            "off".into(),
            "the proc connector is Linux's: scans only".into(),
        ),
        (
            "serve",
            "yes".into(),
            "TCP on loopback with tokens (the Unix socket is Unix-only)".into(),
        ),
    ];
    Ok((
        DoctorReport::Table(rows),
        if probe.job_object.available { 0 } else { 1 },
    ))
}
