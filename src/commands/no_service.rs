//! `serve` and `token` where the service is not built (macOS: `http`,
//! `service` and `serve` are built on Linux and Windows only), in
//! `service.rs`'s place: each refuses with one line, exit 125.
//! docs/RESIDUALS.md, "macOS".

use treewarden::config::Config;

use super::{FleetCommand, ServeArgs, ShipArgs, TokenCommand};
use crate::exit::{CliError, CliResult};

/// The one line a command refuses with on macOS.
fn not_supported(what: &str, why: &str) -> CliError {
    CliError::internal(anyhow::anyhow!("{what}: macOS is not supported yet: {why}"))
}

/// `serve` on macOS: refused with one line.
pub fn serve(_config: &Config, _args: ServeArgs) -> CliResult {
    Err(not_supported(
        "serve",
        "the service (HTTP API, Unix socket) is built on Linux and Windows only",
    ))
}

/// `token` on macOS: refused with one line (tokens are the service's).
pub fn token(_config: &Config, _cmd: TokenCommand) -> CliResult {
    Err(not_supported(
        "token",
        "tokens are the service's, which is built on Linux and Windows only",
    ))
}

/// `ship` on macOS: refused with one line (the shipper is the service's).
pub fn ship(_config: &Config, _args: ShipArgs) -> CliResult {
    Err(not_supported(
        "ship",
        "the JetStream shipper is the service's, which is built on Linux and Windows only",
    ))
}

/// `fleet` on macOS: refused with one line (it reads what the shipper sends).
pub fn fleet(_config: &Config, _cmd: FleetCommand) -> CliResult {
    Err(not_supported(
        "fleet",
        "the JetStream reader is the service's, which is built on Linux and Windows only",
    ))
}
