//! The `treewarden` binary: parse the command line, build a [`Config`], call
//! into the library, and own the exit code. Errors are printed once, as one line.

mod cli;
mod commands;
mod exit;

use std::process::ExitCode;

fn main() -> ExitCode {
    cli::main()
}
