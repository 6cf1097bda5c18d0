//! `treewarden show`: one tree's record (members, events, `--tree`).

use super::*;

#[derive(Args, Debug)]
pub struct ShowArgs {
    tree: i64,
    #[arg(long)]
    json: bool,
    /// The members as a process tree, like pstree: parent -> child by the
    /// ppid each had when first seen, marked escaped, exec, exited,
    /// force-killed (with --json: the hierarchy as JSON).
    #[arg(long = "tree", id = "tree_view")]
    tree_view: bool,
}

pub fn show(config: &Config, args: ShowArgs) -> CliResult {
    let ledger = open_for_reading(config)?;
    let mut detail = ledger
        .tree_detail(TreeId(args.tree))
        .map_err(CliError::internal)?
        .ok_or_else(|| CliError::usage(anyhow!("unknown tree {}", args.tree)))?;
    if detail.resources.is_none() {
        detail.resources = treewarden::custody::live_resources(&detail.tree);
    }
    if args.json && args.tree_view {
        print_json(&detail.hierarchy())?;
        return Ok(0);
    }
    if args.json {
        print_json(&detail)?;
        return Ok(0);
    }
    if args.tree_view {
        print!(
            "{}",
            treewarden::ledger::hierarchy::draw(&detail.hierarchy())
        );
        return Ok(0);
    }
    print_detail(&detail);
    Ok(0)
}

/// The text view: the tree row, then its members, observations, signals,
/// authorizations and events, one section each.
fn print_detail(detail: &treewarden::ledger::TreeDetail) {
    let t = &detail.tree;
    let state = if root_exited_members_alive(t) {
        format!("{} (root exited, members alive)", t.state.as_str())
    } else {
        t.state.as_str().to_string()
    };
    println!(
        "tree {}  {}  boundary {}  label {}",
        t.id,
        state,
        t.boundary,
        t.label.clone().unwrap_or_default()
    );
    println!(
        "root {}  pgid {}  sid {}  cgroup {}",
        opt(t.root_pid),
        opt(t.pgid),
        opt(t.sid),
        t.cgroup.clone().unwrap_or_else(|| "-".into())
    );
    println!(
        "owner pid {} (start {})  created {}  ended {}",
        t.owner.pid,
        t.owner.start,
        t.created_at,
        t.ended_at.clone().unwrap_or_else(|| "-".into())
    );
    println!("\nmembers ({}):", detail.members.len());
    for m in &detail.members {
        println!(
            "  {:>7} start {:<10} pgid {:<7} sid {:<7} {}{}{}",
            m.pid,
            m.start_ticks,
            opt(m.pgid),
            opt(m.sid),
            m.cmdline.join(" "),
            if m.escaped_at.is_some() {
                "  [escaped]"
            } else {
                ""
            },
            if m.exited_at.is_some() {
                "  [exited]"
            } else {
                ""
            },
        );
    }
    println!("\nobservations ({}):", detail.observations.len());
    for o in &detail.observations {
        println!(
            "  {:<9} {:>7} start {:<10} {}  {}",
            o.kind, o.identity.pid, o.identity.start_ticks, o.at, o.detail
        );
    }
    println!("\nsignals ({}):", detail.signals.len());
    for sig in &detail.signals {
        println!(
            "  {} {:<8} {:<6} {:<24} {}{}",
            sig.at,
            sig.signal,
            sig.target_kind,
            sig.target,
            sig.result,
            sig.authorization
                .map(|a| format!("  (authorization {a})"))
                .unwrap_or_default()
        );
    }
    println!("\nauthorizations ({}):", detail.authorizations.len());
    for a in &detail.authorizations {
        let targets: Vec<String> = a
            .targets
            .iter()
            .map(|t| {
                let pids: Vec<String> = t.identities.iter().map(|i| i.pid.to_string()).collect();
                format!("{} {} [{}]", t.kind, t.target, pids.join(" "))
            })
            .collect();
        println!(
            "  {:>4} {} {}: {}",
            a.id,
            a.at,
            a.reason,
            targets.join("; ")
        );
    }
    println!("\nevents ({}):", detail.events.len());
    for e in &detail.events {
        println!("  {:>6} {} {:<18} {}", e.seq, e.at, e.kind, e.data);
    }
}

pub(super) fn opt(v: Option<i32>) -> String {
    v.map(|v| v.to_string()).unwrap_or_else(|| "-".into())
}
