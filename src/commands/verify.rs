//! `treewarden verify`: the ledger's chain, archives, seals and an export.

use std::path::PathBuf;

use treewarden::config::Config;
use treewarden::ledger::{Ledger, LedgerError, LedgerOptions};

use crate::exit::{CliError, CliResult, EXIT_BROKEN};

/// `--expect-head SEQ:HASH`.
pub fn parse_head(s: &str) -> Result<(i64, String), String> {
    let bad = || format!("malformed --expect-head {s:?}: expected SEQ:HASH (64 hex digits)");
    let (seq, hash) = s.split_once(':').ok_or_else(bad)?;
    let seq: i64 = seq.trim().parse().map_err(|_| bad())?;
    let hash = hash.trim().to_ascii_lowercase();
    if seq < 1 || hash.len() != 64 || !hash.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(bad());
    }
    Ok((seq, hash))
}

pub fn verify(
    config: &Config,
    expect_head: Option<&str>,
    archives: &[PathBuf],
    json: bool,
    (seal_key, seal_pub): (Option<&str>, Option<&std::path::Path>),
    export: Option<&std::path::Path>,
) -> CliResult {
    let expect_head = expect_head
        .map(parse_head)
        .transpose()
        .map_err(|e| CliError::usage(anyhow::anyhow!(e)))?;
    use treewarden::ledger::seal::{SealKey, SealPub, SealVerifier};
    let seal_key = match (seal_key, seal_pub) {
        (Some(key), _) => Some(
            SealKey::parse(key)
                .map(SealVerifier::Key)
                .map_err(|e| CliError::usage(anyhow::anyhow!("--seal-key: {e}")))?,
        ),
        (None, Some(file)) => {
            let text = std::fs::read_to_string(file).map_err(|e| {
                CliError::usage(anyhow::anyhow!("--seal-pub {}: {e}", file.display()))
            })?;
            Some(SealPub::parse(&text).map(SealVerifier::Pub).map_err(|e| {
                CliError::usage(anyhow::anyhow!("--seal-pub {}: {e}", file.display()))
            })?)
        }
        (None, None) => None,
    };
    let broken =
        |what: String| CliError::with_code(EXIT_BROKEN, anyhow::anyhow!("verify failed: {what}"));
    let path = match export {
        Some(file) => {
            if !file.is_file() {
                return Err(CliError::usage(anyhow::anyhow!(
                    "no export at {}",
                    file.display()
                )));
            }
            file.to_path_buf()
        }
        None => crate::commands::existing_ledger_path(config)?,
    };
    for archive in archives {
        if !archive.is_file() {
            return Err(CliError::usage(anyhow::anyhow!(
                "no archive at {}",
                archive.display()
            )));
        }
    }
    let asked_seals = seal_key.is_some();
    // Set up but not asked to check: said, so a reader does not take the
    // chain's "ok" for the seals'.
    let mut unchecked_seals = false;
    let report = match export {
        Some(file) => treewarden::ledger::verify_export(file, seal_key),
        None => Ledger::open(&path, LedgerOptions::from_config(config)).and_then(|ledger| {
            unchecked_seals = !asked_seals && ledger.seal_setup_of()?.is_some();
            let (mut report, sealed) = ledger.verify_sealed(expect_head, seal_key)?;
            if report.first_break.is_none() && !archives.is_empty() {
                for (_, archived) in ledger.verify_archives(archives)? {
                    if archived.first_break.is_some() {
                        report.first_break = archived.first_break;
                        break;
                    }
                }
            }
            Ok((report, sealed))
        }),
    };
    let (report, sealed) = match report {
        Ok(report) => report,
        // A file SQLite cannot read as a database is a failed verification.
        Err(e @ LedgerError::Corrupt(_)) => return Err(broken(e.to_string())),
        Err(e) => {
            return Err(CliError::internal(anyhow::anyhow!(
                "{}: {e}",
                path.display()
            )));
        }
    };
    print_verify(
        &report,
        sealed,
        archives.len(),
        export.is_some(),
        unchecked_seals,
        json,
    )
}

/// `verify`'s answer: the JSON object, or one line (`ok: …`), or the first
/// break as the error (exit 1).
pub fn print_verify(
    report: &treewarden::ledger::VerifyReport,
    sealed: Option<treewarden::ledger::SealReport>,
    archives: usize,
    export: bool,
    unchecked_seals: bool,
    json: bool,
) -> CliResult {
    let broken =
        |what: String| CliError::with_code(EXIT_BROKEN, anyhow::anyhow!("verify failed: {what}"));
    if json {
        let text = serde_json::to_string(&serde_json::json!({
            "ok": report.first_break.is_none(),
            "events": report.events,
            "head": report.head.as_ref().map(|(seq, hash)| serde_json::json!({"seq": seq, "hash": hash})),
            "checkpoint": report.checkpoint,
            "archives": archives,
            "seal": sealed,
            "trailer": report.trailer,
            "first_break": report.first_break.as_ref().map(|b| b.to_string()),
        }))
        .map_err(CliError::internal)?;
        println!("{text}");
        return Ok(if report.first_break.is_some() {
            EXIT_BROKEN
        } else {
            0
        });
    }
    match &report.first_break {
        Some(found) => Err(broken(found.to_string())),
        None => {
            let head = match &report.head {
                Some((seq, hash)) => format!("head {seq}:{hash}"),
                None => "no head".to_string(),
            };
            let from = report
                .checkpoint
                .map(|seq| format!(", from checkpoint seq {seq}"))
                .unwrap_or_default();
            let archived = if archives == 0 {
                String::new()
            } else {
                format!(", {archives} archive(s) chain in")
            };
            let integrity = if export { "export" } else { "integrity ok" };
            let sealed = sealed
                .map(|s| {
                    format!(
                        ", sealed: epochs 0 to {} ({} seals, {} late{}), the newest made {}{}, {} events after it not sealed yet",
                        s.last_epoch,
                        s.seals,
                        s.late,
                        s.first_late
                            .map(|e| format!(" from epoch {e}"))
                            .unwrap_or_default(),
                        s.last_made_at,
                        if s.closed { " as a clean close" } else { "" },
                        s.unsealed
                    )
                })
                .unwrap_or_else(|| {
                    if unchecked_seals {
                        ", sealing set up (seals not checked: no --seal-key or --seal-pub)".to_string()
                    } else {
                        String::new()
                    }
                });
            let trailer = report
                .trailer
                .as_ref()
                .map(|t| format!("; {t}"))
                .unwrap_or_default();
            println!(
                "ok: {} events, {head}{from}, {integrity}{archived}{sealed}{trailer}",
                report.events
            );
            Ok(0)
        }
    }
}
