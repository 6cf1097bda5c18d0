//! `treewarden kill`: tear one tree down with its recorded grace.

use super::*;

#[derive(Args, Debug)]
pub struct KillArgs {
    /// Tree id.
    tree: i64,
    /// Time between the first signal and the forced kill (default: the
    /// grace recorded with the tree, else 5s).
    #[arg(long, value_parser = parse_duration)]
    grace: Option<Duration>,
    /// The first signal (as for run).
    #[arg(short = 's', long = "signal", value_name = "SIG", default_value = "TERM", value_parser = parse_signal)]
    signal: Sig,
    #[arg(long, short)]
    quiet: bool,
    /// Print the teardown report as one JSON object.
    #[arg(long)]
    json: bool,
}

pub fn kill(config: &Config, args: KillArgs) -> CliResult {
    shield_from_interrupts();
    let engine = signal_engine(config)?;
    engine.sweeper().settle_failed_closed(SETTLE_LIMIT);
    let tree = TreeId(args.tree);
    let row = engine
        .ledger()
        .tree(tree)
        .map_err(CliError::internal)?
        .ok_or_else(|| CliError::usage(anyhow!("unknown tree {}", args.tree)))?;
    if row.state.is_terminal() && !row.has_survivors_left() {
        if args.json {
            print_json(&serde_json::json!({"tree": row.id, "state": row.state, "already": true}))?;
            return Ok(0);
        }
        println!("tree {} is already {}", row.id, row.state.as_str());
        return Ok(0);
    }
    // Who asked, as a structured event before anything is signalled (as the
    // API records it), and in the reason the teardown records. A ledger
    // that refuses the event still gets the principal in the reason.
    let by = cli_requester();
    let asked =
        treewarden::ledger::Event::KillRequested(treewarden::ledger::event::KillRequested {
            by: by.clone(),
            grace_ms: args.grace.map(|g| g.as_millis() as u64),
        });
    if let Err(e) = engine.ledger().append_event(Some(tree), asked) {
        tracing::warn!(tree = tree.0, error = %e, "kill.requested not recorded; the teardown's reason names the principal");
    }
    let reason = format!("treewarden kill by {by}");
    // The grace recorded with the tree unless one is asked for (one hop to
    // the policy, one to the teardown).
    let grace = Grace::for_tree(&row, args.grace, policy::default_grace(), None);
    let mut opts = TeardownOptions::new(grace, reason, Origin::Kill);
    opts.first_signal = args.signal;
    let mut progress = progress_printer(args.quiet || args.json);
    let report = engine.teardown(tree, &opts, &mut progress);
    progress_done(args.quiet || args.json);
    let report = report.map_err(custody_error)?;
    if args.json {
        print_json(&report)?;
        return Ok(0);
    }
    println!(
        "tree {} {}: {} members at start, {} force-killed, {:.0} ms",
        report.tree,
        report.state.as_str(),
        report.members_at_start,
        report.force_killed,
        report.elapsed.as_secs_f64() * 1000.0
    );
    Ok(0)
}
