//! `treewarden token create|list|revoke`.

#[cfg(any(target_os = "linux", windows))]
use super::*;

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

#[cfg(any(target_os = "linux", windows))]
pub fn token(config: &Config, cmd: TokenCommand) -> CliResult {
    let ledger = open_ledger(config)?;
    let internal = |e: treewarden::ledger::LedgerError| CliError::internal(anyhow!(e));
    match cmd {
        TokenCommand::Create { scope, name, json } => {
            let secret = treewarden::http::auth::new_secret()
                .map_err(|e| CliError::internal(anyhow!("random bytes: {e}")))?;
            let hash = treewarden::http::auth::token_hash(&secret);
            let id = ledger
                .create_token(&name, scope, &hash, &cli_requester())
                .map_err(internal)?;
            if json {
                print_json(&serde_json::json!({
                    "id": id, "name": name, "scope": scope, "token": secret,
                }))?;
            } else {
                println!("{secret}");
                eprintln!(
                    "token {id} ({}) made; the secret above is shown only now",
                    scope.as_str()
                );
            }
            Ok(0)
        }
        TokenCommand::List { json } => {
            let tokens = ledger.tokens().map_err(internal)?;
            if json {
                print_json(&tokens)?;
                return Ok(0);
            }
            println!(
                "{:>4}  {:<6}  {:<24}  {:<24}  REVOKED",
                "ID", "SCOPE", "NAME", "CREATED"
            );
            for t in tokens {
                println!(
                    "{:>4}  {:<6}  {:<24}  {:<24}  {}",
                    t.id,
                    t.scope.as_str(),
                    t.name,
                    t.created_at,
                    t.revoked_at.as_deref().unwrap_or("-")
                );
            }
            Ok(0)
        }
        TokenCommand::Revoke { id } => {
            match ledger.revoke_token(id, &cli_requester()) {
                Ok(true) => println!("token {id} revoked"),
                Ok(false) => println!("token {id} was already revoked"),
                Err(treewarden::ledger::LedgerError::NotFound(_)) => {
                    return Err(CliError::usage(anyhow!("unknown token {id}")));
                }
                Err(e) => return Err(internal(e)),
            }
            Ok(0)
        }
    }
}
