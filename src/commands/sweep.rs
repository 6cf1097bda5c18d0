//! `treewarden sweep`: tear down the trees whose owner is gone.

use super::*;

#[derive(Args, Debug)]
pub struct SweepArgs {
    /// Grace of an orphan whose tree records none (trees recorded before
    /// grace was); every other orphan gets the grace it was spawned with.
    #[arg(long, default_value = policy::DEFAULT_GRACE, value_parser = parse_duration)]
    grace: Duration,
    /// Orphans torn down at once.
    #[arg(long, default_value_t = treewarden::custody::DEFAULT_SWEEP_CONCURRENCY, value_parser = parse_concurrency)]
    concurrency: usize,
    #[arg(long)]
    json: bool,
}

pub fn sweep(config: &Config, args: SweepArgs) -> CliResult {
    shield_from_interrupts();
    let engine = signal_engine(config)?;
    let mut opts = treewarden::custody::SweepOptions::new(args.grace);
    opts.concurrency = args.concurrency;
    let report = engine.sweeper().sweep_with(&opts).map_err(custody_error)?;
    if args.json {
        print_json(&report)?;
    } else {
        println!(
            "sweep: {} live trees examined, {} owned, {} orphans",
            report.examined,
            report.owned,
            report.orphans.len()
        );
        for o in &report.orphans {
            match (&o.to, &o.error) {
                (Some(to), _) => println!(
                    "  tree {}: {} -> {} (grace {})",
                    o.tree,
                    o.from.as_str(),
                    to.as_str(),
                    humantime::format_duration(Duration::from_millis(o.grace_ms))
                ),
                (None, Some(e)) => {
                    println!("  tree {}: {} -> unsettled: {e}", o.tree, o.from.as_str())
                }
                (None, None) => {}
            }
        }
    }
    Ok(if report.settled() { 0 } else { EXIT_INTERNAL })
}
