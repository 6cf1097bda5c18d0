//! `treewarden fleet serve|hosts|rebuild|verify` (their arguments in
//! `fleet.rs`; the service is `src/fleet/`). Built where the service is:
//! `service.rs` declares it.

use super::super::fleet::{HostsCommand, NatsArgs};
use super::super::*;
use treewarden::ledger::fleet::FleetIndex;
use treewarden::service::nats::{NatsConfig, ShipError, read_host, verify_host};

use super::EXIT_UNREACHABLE;

/// `treewarden fleet …`.
pub fn fleet(_config: &Config, cmd: FleetCommand) -> CliResult {
    match cmd {
        FleetCommand::Serve {
            nats,
            data,
            listen,
            consumer,
            stale,
        } => serve(&nats, data, listen, consumer, stale),
        FleetCommand::Hosts(cmd) => hosts(cmd),
        FleetCommand::Rebuild {
            nats,
            data,
            consumer,
        } => rebuild(&nats, &data, &consumer),
        FleetCommand::Verify {
            nats,
            host,
            seal_key,
            seal_pub,
            since,
            json,
        } => verify(&nats, &host, seal_key, seal_pub, since, json),
    }
}

fn nats_config(nats: &NatsArgs, host: Option<&str>) -> Result<NatsConfig, CliError> {
    NatsConfig::new(&nats.nats, nats.creds.clone(), host, 1)
        .map_err(|e| CliError::usage(anyhow!("--nats: {e}")))
}

fn open_index(data: &std::path::Path) -> Result<FleetIndex, CliError> {
    FleetIndex::open(data).map_err(|e| CliError::internal(anyhow!("{}: {e}", data.display())))
}

fn serve(
    nats: &NatsArgs,
    data: std::path::PathBuf,
    listen: Option<std::net::SocketAddr>,
    consumer: String,
    stale: Duration,
) -> CliResult {
    use treewarden::service::fleet::{FleetOptions, serve};
    let options = FleetOptions {
        nats: nats_config(nats, Some("fleet"))?,
        data,
        listen,
        consumer,
        stale,
    };
    if listen.is_some_and(|a| !a.ip().is_loopback()) {
        return Err(CliError::usage(anyhow!(
            "--listen: the fleet pages are served on loopback only (they have no login)"
        )));
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| CliError::internal(anyhow!("runtime: {e}")))?;
    rt.block_on(async {
        let cancel = tokio_util::sync::CancellationToken::new();
        treewarden::proc::shutdown_on_signals(cancel.clone())
            .map_err(|e| CliError::internal(anyhow!("signals: {e}")))?;
        serve(options, cancel)
            .await
            .map_err(|e| CliError::internal(anyhow!("fleet serve: {e}")))
    })?;
    Ok(0)
}

fn hosts(cmd: HostsCommand) -> CliResult {
    match cmd {
        HostsCommand::Add {
            data,
            host,
            seal_pub,
            seal_key,
        } => {
            treewarden::service::nats::host_id(Some(&host))
                .map_err(|e| CliError::usage(anyhow!("{e}")))?;
            let (material, path) = match (seal_pub, seal_key) {
                (Some(p), None) => ("pub", p),
                (None, Some(k)) => ("key", k),
                _ => {
                    return Err(CliError::usage(anyhow!(
                        "give one of --seal-pub FILE or --seal-key FILE"
                    )));
                }
            };
            let text = std::fs::read_to_string(&path)
                .map_err(|e| CliError::usage(anyhow!("{}: {e}", path.display())))?;
            let value = text
                .lines()
                .map(str::trim)
                .find(|l| !l.is_empty() && !l.starts_with('#'))
                .unwrap_or_default()
                .to_string();
            let parsed = match material {
                "pub" => treewarden::ledger::seal::SealPub::parse(&value).map(|_| ()),
                _ => treewarden::ledger::seal::SealKey::parse(&value).map(|_| ()),
            };
            parsed.map_err(|e| CliError::usage(anyhow!("{}: {e}", path.display())))?;
            open_index(&data)?
                .add_host(&host, material, &value)
                .map_err(CliError::internal)?;
            println!(
                "host {host}: seals verified with its {} from now on",
                match material {
                    "pub" => "root public key",
                    _ => "verification key",
                }
            );
            Ok(0)
        }
        HostsCommand::Ls { data, json } => {
            let hosts = open_index(&data)?.hosts().map_err(CliError::internal)?;
            // A verification key verifies HMAC seals and can make them:
            // its file is named, never its content.
            let shown = |m: &treewarden::ledger::fleet::HostMaterial| m.value.clone();
            if json {
                let rows: Vec<_> = hosts
                    .iter()
                    .map(|m| serde_json::json!({"host": m.host, "material": m.material, "value": shown(m), "added_at": m.added_at}))
                    .collect();
                print_json(&rows)?;
                return Ok(0);
            }
            println!("{:<32}  {:<8}  {:<24}  VALUE", "HOST", "MATERIAL", "ADDED");
            for m in &hosts {
                println!(
                    "{:<32}  {:<8}  {:<24}  {}",
                    m.host,
                    m.material,
                    m.added_at,
                    shown(m)
                );
            }
            Ok(0)
        }
    }
}

fn rebuild(nats: &NatsArgs, data: &std::path::Path, consumer: &str) -> CliResult {
    let config = nats_config(nats, Some("fleet"))?;
    let deleted = treewarden::service::nats::delete_fleet_consumer(&config, consumer)
        .map_err(|e| CliError::with_code(EXIT_UNREACHABLE, anyhow!("fleet rebuild: {e}")))?;
    open_index(data)?.clear().map_err(CliError::internal)?;
    println!(
        "the index is empty{}; the next `fleet serve --consumer {consumer}` reads the stream from its first message",
        if deleted {
            " and the consumer deleted"
        } else {
            ""
        }
    );
    Ok(0)
}

/// `fleet verify HOST`: the host's events from the stream alone. Exit 0
/// when whole; 1 naming the first broken seq; 3 when no server answered.
fn verify(
    nats: &NatsArgs,
    host: &str,
    seal_key: Option<String>,
    seal_pub: Option<String>,
    since: Option<String>,
    json: bool,
) -> CliResult {
    use treewarden::ledger::seal::{SealKey, SealPub, SealVerifier};
    let seal = match (seal_key, seal_pub) {
        (Some(k), _) => Some(
            SealKey::parse(&k)
                .map(SealVerifier::Key)
                .map_err(|e| CliError::usage(anyhow!("--seal-key: {e}")))?,
        ),
        (None, Some(p)) => Some(
            SealPub::parse(&p)
                .map(SealVerifier::Pub)
                .map_err(|e| CliError::usage(anyhow!("--seal-pub: {e}")))?,
        ),
        (None, None) => None,
    };
    let since = since
        .as_deref()
        .map(treewarden::ledger::parse_since)
        .transpose()
        .map_err(|e| CliError::usage(anyhow!("--since: {e}")))?
        .map(|t| humantime::format_rfc3339_millis(t).to_string());
    let config = nats_config(nats, Some(host))?;
    let failed = |e: ShipError| match e {
        ShipError::Unreachable(_) => {
            CliError::with_code(EXIT_UNREACHABLE, anyhow!("fleet verify: {e}"))
        }
        e => CliError::internal(anyhow!("fleet verify: {e}")),
    };
    let stored = read_host(&config, host).map_err(failed)?;
    if stored.is_empty() {
        return Err(CliError::usage(anyhow!(
            "fleet verify: the stream holds no event of host {host} ({})",
            config.subject()
        )));
    }
    // Event times are RFC 3339 in UTC with millis: they compare as text.
    let recent = since.as_ref().map(|t| {
        stored
            .iter()
            .filter(|m| {
                serde_json::from_slice::<serde_json::Value>(&m.body)
                    .ok()
                    .and_then(|v| v["at"].as_str().map(|at| at >= t.as_str()))
                    .unwrap_or(false)
            })
            .count()
    });
    let verdict = verify_host(&stored, host, seal).map_err(failed)?;
    if json {
        let (report, first_break) = match &verdict {
            Ok(r) => (Some(r), None),
            Err(why) => (None, Some(why.clone())),
        };
        print_json(&serde_json::json!({
            "ok": verdict.is_ok(),
            "host": host,
            "events": stored.len(),
            "since": since.as_ref().map(|t| serde_json::json!({"at": t, "events": recent})),
            "head": report.and_then(|r| r.head.as_ref()).map(|(seq, hash)| serde_json::json!({"seq": seq, "hash": hash})),
            "seal": report.and_then(|r| r.sealed.as_ref()),
            "first_break": first_break,
        }))?;
        return Ok(if verdict.is_ok() {
            0
        } else {
            crate::exit::EXIT_BROKEN
        });
    }
    let recent = match (&since, recent) {
        (Some(t), Some(n)) => format!(" ({n} since {t})"),
        _ => String::new(),
    };
    match verdict {
        Ok(report) => {
            let head = report
                .head
                .map(|(seq, hash)| format!("head {seq}:{hash}"))
                .unwrap_or_else(|| "no head".into());
            let sealed = report
                .sealed
                .map(|s| {
                    format!(
                        ", sealed: epochs 0 to {} ({} seals), {} events after the newest",
                        s.last_epoch, s.seals, s.unsealed
                    )
                })
                .unwrap_or_default();
            println!(
                "ok: host {host}: {} events from the stream{recent}, {head}, continuous{sealed}",
                report.events
            );
            Ok(0)
        }
        Err(why) => Err(CliError::with_code(
            crate::exit::EXIT_BROKEN,
            anyhow!("fleet verify failed: host {host}: {why}"),
        )),
    }
}
