//! `treewarden ls`: one line a tree.

use super::*;

#[derive(Args, Debug)]
pub struct LsArgs {
    /// Include ended trees.
    #[arg(long)]
    all: bool,
    #[arg(long)]
    json: bool,
}

pub fn ls(config: &Config, args: LsArgs) -> CliResult {
    // A teardown that could not be authorized (its owner gone) is finished
    // by `ls` too, once the ledger takes writes: the list then shows it
    // settled. `show` never does (it is how an operator inspects survivors).
    signal_engine(config)?
        .sweeper()
        .settle_failed_closed(SETTLE_LIMIT);
    let ledger = open_for_reading(config)?;
    let trees = ledger.list_trees(args.all).map_err(CliError::internal)?;
    if args.json {
        print_json(&trees)?;
        return Ok(0);
    }
    println!(
        "{:>6}  {:<12}  {:<8}  {:>8}  {:<14}  {:<12}  {:<20}  CREATED",
        "ID", "STATE", "BOUNDARY", "ROOT", "OWNER", "END", "LABEL"
    );
    for t in &trees {
        println!("{}", tree_line(t));
    }
    Ok(0)
}

pub(super) fn tree_line(t: &TreeRow) -> String {
    format!(
        "{:>6}  {:<12}  {:<8}  {:>8}  {:<14}  {:<12}  {:<20}  {}",
        t.id,
        t.state.as_str(),
        t.boundary,
        t.root_pid
            .map(|p| p.to_string())
            .unwrap_or_else(|| "-".into()),
        format!("{} {}", t.owner.kind, t.owner.pid),
        end_reason(t),
        t.label.clone().unwrap_or_default(),
        t.created_at
    )
}

/// How a tree ended, in a word: its root's exit, or why it has none.
pub(super) fn end_reason(t: &TreeRow) -> String {
    use treewarden::ledger::TreeState as S;
    if root_exited_members_alive(t) {
        return "root exited, members alive".into();
    }
    match (t.state, t.exit) {
        (_, Some(e)) => match (e.code, e.signal) {
            (_, Some(sig)) => format!("signal {sig}"),
            (Some(code), None) => format!("exit {code}"),
            (None, None) => "-".into(),
        },
        (S::Ended, None) => "ended".into(),
        (S::Vanished, None) => "vanished".into(),
        (S::Resolved, None) => "resolved".into(),
        (S::SpawnFailed, None) => "spawn failed".into(),
        _ => "-".into(),
    }
}

/// A kept tree (`--lifetime owner`) whose root exited while members live on.
pub(super) fn root_exited_members_alive(t: &TreeRow) -> bool {
    !t.state.is_terminal() && t.has_flag(&treewarden::ledger::TreeFlag::RootExited)
}
