//! The commands that drive the service: `serve` (`serve.rs`), `token`
//! (its arguments in `token.rs`), `ship` (`ship.rs`) and `fleet`
//! (`fleet_service.rs`). The service (`http`, `service`, `serve`)
//! is built on Linux and Windows; on macOS `commands/mod.rs` takes
//! `no_service.rs` in this file's place.

use super::*;

pub use super::serve::serve;

/// `treewarden token create|list|revoke`.
pub fn token(config: &Config, cmd: TokenCommand) -> CliResult {
    let ledger = open_ledger(config)?;
    match cmd {
        TokenCommand::Create { scope, name, json } => {
            let secret = treewarden::http::auth::new_secret()
                .map_err(|e| CliError::internal(anyhow!("random bytes: {e}")))?;
            let hash = treewarden::http::auth::token_hash(&secret);
            let id = ledger
                .create_token(&name, scope, &hash, &cli_requester())
                .map_err(CliError::internal)?;
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
            let tokens = ledger.tokens().map_err(CliError::internal)?;
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
                Err(e) => return Err(CliError::internal(e)),
            }
            Ok(0)
        }
    }
}

/// Exit code of `ship` (and `fleet verify`) when no NATS server answered
/// or acknowledged in time. Declared beside its only users: macOS builds
/// neither.
const EXIT_UNREACHABLE: u8 = 3;
/// Exit code of `ship` when the stream refused an event (the ledger does not
/// extend what the stream holds for this host).
const EXIT_REFUSED: u8 = 4;

/// `treewarden ship URLS`: every event up to the head, to JetStream, from
/// the same cursor as `serve --ship`. Exit 0 when caught up; 3 when no
/// server answered or acknowledged in time; 4 when the stream refused.
pub fn ship(config: &Config, args: ShipArgs) -> CliResult {
    use treewarden::service::nats::{NatsConfig, ShipError, ship_once};
    let mut nats = NatsConfig::new(
        &args.servers,
        args.creds.clone(),
        args.host_id.as_deref(),
        args.replicas,
    )
    .map_err(|e| CliError::usage(anyhow!("{e}")))?;
    nats.timeout = args.timeout;
    let ledger = open_existing_ledger(config)?;
    let head = ledger
        .head()
        .map_err(CliError::internal)?
        .map_or(0, |(seq, _)| seq);
    match ship_once(&ledger, &nats) {
        Ok(done) => {
            if args.json {
                print_json(&serde_json::json!({
                    "shipped": done.events, "cursor": done.cursor, "head": head,
                    "subject": nats.subject(),
                }))?;
            } else {
                println!(
                    "shipped {} events to {}; cursor at seq {} (head {head})",
                    done.events,
                    nats.subject(),
                    done.cursor
                );
            }
            Ok(0)
        }
        Err(e @ ShipError::Unreachable(_)) => {
            Err(CliError::with_code(EXIT_UNREACHABLE, anyhow!("ship: {e}")))
        }
        Err(e @ ShipError::Refused(_)) => {
            Err(CliError::with_code(EXIT_REFUSED, anyhow!("ship: {e}")))
        }
        Err(e @ ShipError::Ledger(_)) => Err(CliError::internal(anyhow!("ship: {e}"))),
    }
}

// `fleet`'s commands read the stream with the service's NATS code.
#[path = "fleet_service.rs"]
mod fleet_service;
pub use fleet_service::fleet;
