//! The macOS bodies of the commands that do not run there yet:
//! `serve` and `token` (the service, `http` and `service`, is built on
//! Linux and Windows only) and `run` (no tree is spawned on macOS: the
//! process layer there is compile-checked, never run). Each refuses with
//! one line, exit 125. docs/RESIDUALS.md, "macOS".

use treewarden::config::Config;

use crate::commands::{ServeArgs, TokenCommand};
use crate::exit::{CliError, CliResult};

/// The one line a command refuses with on macOS.
pub fn not_supported(what: &str, why: &str) -> CliError {
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
