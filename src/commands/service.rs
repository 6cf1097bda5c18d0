//! The commands that drive the service: `serve` (`serve.rs`) and `token`
//! (its arguments in `token.rs`). The service (`http`, `service`, `serve`)
//! is built on Linux and Windows; on macOS `commands/mod.rs` takes
//! `no_service.rs` in this file's place.

use super::*;

pub use super::serve::serve;

/// `treewarden token create|list|revoke`.
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
