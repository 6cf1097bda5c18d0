//! `treewarden resolve`: settle a tree recorded ambiguous.

use super::*;

#[derive(Args, Debug)]
pub struct ResolveArgs {
    tree: i64,
    /// The operator's decision, for the audit trail.
    #[arg(long)]
    note: String,
    /// Print the resolved tree as JSON.
    #[arg(long)]
    json: bool,
    /// Resolve even though survivors the teardown left still live; they are
    /// named in `tree.resolved` (and the tree flagged `survivors_left`).
    #[arg(long)]
    force: bool,
}

pub fn resolve(config: &Config, args: ResolveArgs) -> CliResult {
    let engine = signal_engine(config)?;
    engine
        .ambiguity()
        .resolve_by(
            TreeId(args.tree),
            &args.note,
            args.force,
            Some(&cli_requester()),
        )
        .map_err(custody_error)?;
    if args.json {
        let row = engine
            .ledger()
            .tree(TreeId(args.tree))
            .map_err(CliError::internal)?;
        print_json(&row)?;
        return Ok(0);
    }
    println!("tree {} resolved", args.tree);
    Ok(0)
}
