//! `treewarden doctor`: what this host gives custody, as the process layer
//! probes and words it for this OS ([`treewarden::proc::doctor_report`]).

use treewarden::config::Config;
use treewarden::proc::DoctorReport;

use crate::exit::{CliError, CliResult};

/// `treewarden doctor [--json]`: the host probe, as a table or one JSON object.
pub fn doctor(config: &Config, json: bool) -> CliResult {
    let (report, code) =
        treewarden::proc::doctor_report(config, json).map_err(CliError::internal)?;
    match report {
        DoctorReport::Json(text) => println!("{text}"),
        DoctorReport::Table(rows) => {
            let name_w = rows.iter().map(|r| r.0.len()).max().unwrap_or(0);
            let value_w = rows.iter().map(|r| r.1.len()).max().unwrap_or(0);
            for (name, value, note) in rows {
                let line = format!("{name:<name_w$}  {value:<value_w$}  {note}");
                println!("{}", line.trim_end());
            }
        }
    }
    Ok(code)
}
