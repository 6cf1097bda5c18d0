//! `treewarden report`: one tree's incident report, in Markdown or HTML: the
//! verdict in one line, the tree's record, the timeline of what mattered,
//! the process tree, escapes, survivors, and the proof references (seqs,
//! hashes, the newest seal) a reviewer checks with `verify`. Everything in
//! it is read from the ledger; nothing is inferred from free text.

use super::*;
use treewarden::ledger::{EventFilter, EventKind, EventRow, RowKind, TreeDetail};

#[derive(Args, Debug)]
pub struct ReportArgs {
    /// Tree id.
    tree: i64,
    /// md (Markdown) or html (one self-contained page).
    #[arg(long, default_value = "md", value_enum)]
    format: ReportFormat,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum ReportFormat {
    Md,
    Html,
}

/// One block of the report, rendered as Markdown or HTML.
enum Block {
    Title(String),
    Section(&'static str),
    Para(String),
    Pairs(Vec<(&'static str, String)>),
    List(Vec<String>),
    Pre(String),
}

pub fn report(config: &Config, args: ReportArgs) -> CliResult {
    let ledger = open_for_reading(config)?;
    let detail = ledger
        .tree_detail(TreeId(args.tree))
        .map_err(CliError::internal)?
        .ok_or_else(|| CliError::usage(anyhow!("unknown tree {}", args.tree)))?;
    let outcome = ledger
        .outcomes(std::slice::from_ref(&detail.tree))
        .map_err(CliError::internal)?
        .remove(&TreeId(args.tree))
        .ok_or_else(|| CliError::internal(anyhow!("tree {} has no outcome", args.tree)))?;
    let head = ledger.head().map_err(CliError::internal)?;
    let seal = ledger
        .events(&EventFilter {
            kind_prefix: Some(EventKind::LedgerSeal.as_str().into()),
            newest_first: true,
            limit: Some(1),
            ..EventFilter::default()
        })
        .map_err(CliError::internal)?
        .pop();
    let blocks = blocks(&detail, &outcome, head, seal.as_ref());
    print!(
        "{}",
        match args.format {
            ReportFormat::Md => markdown(&blocks),
            ReportFormat::Html => html(&blocks, &format!("treewarden report: tree {}", args.tree)),
        }
    );
    Ok(0)
}

/// The report's content, in reading order.
fn blocks(
    d: &TreeDetail,
    o: &treewarden::ledger::outcome::Outcome,
    head: Option<(i64, String)>,
    seal: Option<&EventRow>,
) -> Vec<Block> {
    let t = &d.tree;
    let mut b = vec![
        Block::Title(format!(
            "Incident report: tree {}{}",
            t.id,
            t.label
                .as_deref()
                .map(|l| format!(" ({l})"))
                .unwrap_or_default()
        )),
        Block::Para(format!("Verdict: {}", o.verdict(t, &d.members))),
        Block::Pairs(vec![
            ("outcome", o.summary()),
            ("command", t.argv.join(" ")),
            (
                "owner",
                format!(
                    "{} pid {} (start {})",
                    t.owner.kind, t.owner.pid, t.owner.start
                ),
            ),
            ("boundary", t.boundary.to_string()),
            ("created", t.created_at.clone()),
            ("ended", t.ended_at.clone().unwrap_or_else(|| "-".into())),
            (
                "asked by",
                t.requested_by
                    .as_ref()
                    .map(ToString::to_string)
                    .unwrap_or_else(|| "-".into()),
            ),
        ]),
        Block::Section("Timeline"),
    ];
    // What mattered, in order: every event of the tree but the members'
    // sightings and execs, which the process tree below shows.
    let noise = [EventKind::MemberObserved, EventKind::MemberExec];
    let mut quiet = 0;
    let mut timeline = Vec::new();
    for e in &d.events {
        if matches!(e.kind, RowKind::Known(k) if noise.contains(&k)) {
            quiet += 1;
            continue;
        }
        timeline.push(format!(
            "{} seq {} {}: {}",
            e.at,
            e.seq,
            e.kind,
            e.sentence()
        ));
    }
    if quiet > 0 {
        timeline.push(format!(
            "(and {quiet} member sightings and execs: `treewarden show {}`)",
            t.id
        ));
    }
    b.push(Block::List(timeline));
    b.push(Block::Section("Process tree"));
    let drawn = treewarden::ledger::hierarchy::draw(&d.hierarchy());
    b.push(if drawn.trim().is_empty() {
        Block::Para("No member was seen.".into())
    } else {
        Block::Pre(drawn)
    });
    b.push(Block::Section("Escapes"));
    let escapes: Vec<String> = d
        .members
        .iter()
        .filter_map(|m| {
            Some(format!(
                "pid {} (start {}) seen outside at {}, now in group {} session {}: {}",
                m.pid,
                m.start_ticks,
                m.escaped_at.as_deref()?,
                show::opt(m.pgid),
                show::opt(m.sid),
                m.cmdline.join(" ")
            ))
        })
        .collect();
    b.push(if escapes.is_empty() {
        Block::Para("None seen.".into())
    } else {
        Block::List(escapes)
    });
    b.push(Block::Section("Survivors"));
    let survivors: Vec<String> = d
        .members
        .iter()
        .filter(|m| m.exited_at.is_none())
        .map(|m| {
            format!(
                "pid {} (start {}): no exit recorded; last seen {}: {}",
                m.pid,
                m.start_ticks,
                m.last_seen,
                m.cmdline.join(" ")
            )
        })
        .collect();
    b.push(if survivors.is_empty() {
        Block::Para("None: every member's exit is recorded.".into())
    } else {
        Block::List(survivors)
    });
    b.push(Block::Section("Proof"));
    let mut proof = Vec::new();
    if let (Some(first), Some(last)) = (d.events.first(), d.events.last()) {
        proof.push(format!(
            "The tree's {} events: seq {} (hash {}) to seq {} (hash {}).",
            d.events.len(),
            first.seq,
            first.hash,
            last.seq,
            last.hash
        ));
    }
    for a in &d.authorizations {
        proof.push(format!(
            "Kill authorization #{} committed at {} before its SIGKILL: {}.",
            a.id, a.at, a.reason
        ));
    }
    if let Some((seq, hash)) = head {
        proof.push(format!(
            "The ledger's head when this report was made: seq {seq}, hash {hash}."
        ));
    }
    proof.push(match seal {
        Some(s) => format!(
            "The newest seal: seq {} at {} (hash {}); what it covers is proven by `treewarden verify --seal-key KEY` (or `--seal-pub FILE`).",
            s.seq, s.at, s.hash
        ),
        None => "The ledger is not sealed: the chain proves the order and integrity of its events, not who could have rewritten them (`treewarden seal setup`).".into(),
    });
    proof.push(
        "Check it yourself: `treewarden verify` on the ledger, or `treewarden export > trail.ndjson && treewarden verify --export trail.ndjson` on a copy that travels.".into(),
    );
    b.push(Block::List(proof));
    b
}

fn markdown(blocks: &[Block]) -> String {
    let mut out = String::new();
    for b in blocks {
        match b {
            Block::Title(s) => out.push_str(&format!("# {s}\n\n")),
            Block::Section(s) => out.push_str(&format!("## {s}\n\n")),
            Block::Para(s) => out.push_str(&format!("{s}\n\n")),
            Block::Pairs(kv) => {
                out.push_str("| | |\n|---|---|\n");
                for (k, v) in kv {
                    out.push_str(&format!("| {k} | {} |\n", v.replace('|', "\\|")));
                }
                out.push('\n');
            }
            Block::List(items) => {
                for i in items {
                    out.push_str(&format!("- {i}\n"));
                }
                out.push('\n');
            }
            Block::Pre(s) => out.push_str(&format!("```\n{}\n```\n\n", s.trim_end())),
        }
    }
    out
}

fn html(blocks: &[Block], title: &str) -> String {
    fn esc(s: &str) -> String {
        s.replace('&', "&amp;")
            .replace('<', "&lt;")
            .replace('>', "&gt;")
            .replace('"', "&quot;")
    }
    let mut out = format!(
        "<!doctype html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>{}</title>\n\
         <style>body{{font:14px/1.45 system-ui,sans-serif;max-width:70em;margin:2em auto;color:#1d2330}}\
         th,td{{text-align:left;padding:.3em .6em;border-bottom:1px solid #e3e6ec;vertical-align:top}}\
         pre{{background:#f6f7f9;padding:.8em}}</style>\n</head>\n<body>\n",
        esc(title)
    );
    for b in blocks {
        match b {
            Block::Title(s) => out.push_str(&format!("<h1>{}</h1>\n", esc(s))),
            Block::Section(s) => out.push_str(&format!("<h2>{}</h2>\n", esc(s))),
            Block::Para(s) => out.push_str(&format!("<p>{}</p>\n", esc(s))),
            Block::Pairs(kv) => {
                out.push_str("<table>\n");
                for (k, v) in kv {
                    out.push_str(&format!(
                        "<tr><th scope=\"row\">{}</th><td>{}</td></tr>\n",
                        esc(k),
                        esc(v)
                    ));
                }
                out.push_str("</table>\n");
            }
            Block::List(items) => {
                out.push_str("<ul>\n");
                for i in items {
                    out.push_str(&format!("<li>{}</li>\n", esc(i)));
                }
                out.push_str("</ul>\n");
            }
            Block::Pre(s) => out.push_str(&format!("<pre>{}</pre>\n", esc(s.trim_end()))),
        }
    }
    out.push_str("</body>\n</html>\n");
    out
}
