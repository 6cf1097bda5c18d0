//! The Windows bodies of the commands whose Unix bodies need Unix-only
//! parts: `doctor` (the job-object probe), and `run`'s helpers
//! for a terminal relay (none: no ConPTY) and its interrupts. `serve` and
//! `token` are the shared bodies (src/commands/): the service is built on
//! Windows too, over TCP on loopback only.

use treewarden::config::Config;
use treewarden::custody::Engine;
use treewarden::ledger::TreeId;

use crate::exit::{CliError, CliResult};

/// `treewarden doctor [--json]` on Windows: what the Job Object boundary
/// needs, probed by making a job.
pub fn doctor(config: &Config, json: bool) -> CliResult {
    let probe = treewarden::proc::probe(config.cgroup_root.as_deref());
    let run_boundary = treewarden::proc::resolve_boundary(config.boundary, None);
    if json {
        let mut value = serde_json::to_value(&probe).map_err(CliError::internal)?;
        value["run_boundary"] = match &run_boundary {
            Ok(kind) => serde_json::json!(kind.to_string()),
            Err(e) => serde_json::json!({ "refused": e.to_string() }),
        };
        println!("{value}");
        return Ok(if probe.job_object.available { 0 } else { 1 });
    }
    let cap = |c: &treewarden::proc::Capability| if c.available { "yes" } else { "no" }.to_string();
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
    let name_w = rows.iter().map(|r| r.0.len()).max().unwrap_or(0);
    let value_w = rows.iter().map(|r| r.1.len()).max().unwrap_or(0);
    for (name, value, note) in rows {
        let line = format!("{name:<name_w$}  {value:<value_w$}  {note}");
        println!("{}", line.trim_end());
    }
    Ok(if probe.job_object.available { 0 } else { 1 })
}

/// `run --tty` has no relay on Windows (no pseudo-terminal is ever opened,
/// so this is never made).
pub struct TtyRelay(());

impl TtyRelay {
    pub fn new(_pty: &treewarden::proc::tty::Pty) -> std::io::Result<Self> {
        Err(std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            "no terminal relay on Windows",
        ))
    }
    pub fn start(&mut self) {}
    pub fn finish(self, _wait: std::time::Duration) {}
}

/// `kill` and `sweep` finish what they started: the console's Ctrl+C and
/// Ctrl+Break are noted and ignored.
pub fn shield_from_interrupts() {
    if let Err(e) = treewarden::proc::forward_console_ctrl(Box::new(|_| {})) {
        tracing::warn!(error = %e, "cannot shield the teardown from console interrupts");
    }
}

/// The line `run` prints when a tree left survivors alive as evidence
/// (Windows cannot tell whether they hold this run's pipes).
pub fn survivors_hold_pipes(engine: &Engine, tree: TreeId) -> Option<String> {
    let survivors = engine.ambiguity().survivors_left(tree);
    if survivors.is_empty() {
        return None;
    }
    let pids: Vec<String> = survivors.iter().map(i32::to_string).collect();
    Some(format!(
        "treewarden: tree {} left {} survivor(s) alive as evidence (pid {}); the next treewarden run, ls, kill or sweep that can write the ledger finishes the teardown",
        tree.0,
        survivors.len(),
        pids.join(", ")
    ))
}
