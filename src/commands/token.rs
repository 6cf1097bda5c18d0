//! `treewarden token create|list|revoke`'s arguments (the command is
//! `service.rs`'s: tokens are the service's).

#[derive(clap::Subcommand, Debug)]
pub enum TokenCommand {
    /// Make a token; its secret is printed once (only its hash is kept).
    Create {
        /// read: every read; spawn: reads, spawns, and kills/resolutions of
        /// its own trees; admin: everything.
        #[arg(long)]
        scope: treewarden::ledger::TokenScope,
        /// A name for the token list and the audit trail.
        #[arg(long, default_value = "")]
        name: String,
        /// Print {"id", "name", "scope", "token"} as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Every token (never a secret).
    List {
        #[arg(long)]
        json: bool,
    },
    /// Revoke a token: refused from the next request on.
    Revoke { id: i64 },
}
