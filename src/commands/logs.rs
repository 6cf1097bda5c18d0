//! `treewarden logs`: a tree's captured output, `--follow`.

use super::*;

#[derive(Args, Debug)]
pub struct LogsArgs {
    tree: i64,
    /// Only the last N lines.
    #[arg(long, short = 'n', value_name = "N")]
    tail: Option<usize>,
    /// Keep printing what the tree writes until it has ended.
    #[arg(long, short)]
    follow: bool,
}

pub fn logs(config: &Config, args: LogsArgs) -> CliResult {
    let engine = signal_engine(config)?;
    let tree = TreeId(args.tree);
    let read_row = |engine: &Engine| {
        engine
            .ledger()
            .tree(tree)
            .map_err(CliError::internal)?
            .ok_or_else(|| CliError::usage(anyhow!("unknown tree {}", args.tree)))
    };
    read_row(&engine)?;
    let data_dir = engine.data_dir().to_path_buf();
    let bytes = treewarden::custody::read_log(&data_dir, tree, args.tail)
        .map_err(|e| CliError::internal(anyhow!("reading the log of tree {}: {e}", args.tree)))?
        .ok_or_else(|| {
            CliError::usage(anyhow!(
                "tree {} captured no output (trees of `run` pass theirs through)",
                args.tree
            ))
        })?;
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(&bytes);
    let _ = out.flush();
    if !args.follow {
        return Ok(0);
    }
    // Follow: print what is appended, poll every 200 ms, until the tree has
    // ended and its output stopped growing; the follower keeps its place
    // across the cap's collapses (custody::LogFollower).
    let path = treewarden::custody::log_path(&data_dir, tree);
    let mut follower = treewarden::custody::LogFollower::after(path, &bytes)
        .map_err(|e| CliError::internal(anyhow!("reading the log: {e}")))?;
    let mut ended_quiet = 0;
    loop {
        std::thread::sleep(Duration::from_millis(200));
        let chunk = follower
            .poll()
            .map_err(|e| CliError::internal(anyhow!("reading the log: {e}")))?;
        if !chunk.is_empty() {
            if out.write_all(&chunk).and_then(|()| out.flush()).is_err() {
                return Ok(0);
            }
            ended_quiet = 0;
        } else if read_row(&engine)?.state.is_terminal() {
            ended_quiet += 1;
            if ended_quiet >= 2 {
                return Ok(0);
            }
        }
    }
}
