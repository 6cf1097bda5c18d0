//! How a command of the binary fails: [`CliError`] (an error and the exit
//! code it maps to) and the exit codes themselves. A leaf: `cli` and
//! `commands` use it, and it uses neither, so the
//! commands do not reach back into the command line's module.

/// Exit code for bad input: unknown tree, malformed duration, empty command.
pub const EXIT_USAGE: u8 = 2;
/// Exit code of `verify` when the ledger is broken (the first break is printed).
pub const EXIT_BROKEN: u8 = 1;
/// Exit code when treewarden itself failed (cannot record, ambiguous, refused).
pub const EXIT_INTERNAL: u8 = 125;

/// An error that knows which exit code it maps to.
#[derive(Debug)]
pub struct CliError {
    pub code: u8,
    pub error: anyhow::Error,
}

impl CliError {
    pub fn usage(error: impl Into<anyhow::Error>) -> Self {
        Self {
            code: EXIT_USAGE,
            error: error.into(),
        }
    }
    pub fn internal(error: impl Into<anyhow::Error>) -> Self {
        Self {
            code: EXIT_INTERNAL,
            error: error.into(),
        }
    }
    pub fn with_code(code: u8, error: impl Into<anyhow::Error>) -> Self {
        Self {
            code,
            error: error.into(),
        }
    }
}

/// Result of a subcommand: the exit code on success.
pub type CliResult = Result<u8, CliError>;
