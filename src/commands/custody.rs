//! `--lifetime owner`: the hand-over of a tree whose root exited to a
//! custodian, and the hidden `custody` command that custodian runs.

use super::*;

/// What the custodian of a kept tree needs from `run`'s arguments.
pub(super) struct KeepArgs {
    pub(super) grace: Duration,
    pub(super) signal: Sig,
    pub(super) scan_interval: Duration,
    pub(super) timeout: Option<Duration>,
    /// When the tree was spawned (its timeout counts from there).
    pub(super) started: std::time::Instant,
    pub(super) quiet: bool,
}

/// `--lifetime owner`, the root exited and members live on: hands the tree
/// to a custodian — a `treewarden custody` process in a session of its own,
/// which outlives `run` — and returns the root's status at once. Without a
/// custodian the tree is torn down now (never left unwatched), and run
/// says so.
pub(super) fn hand_over(
    config: &Config,
    engine: &Engine,
    outcome: &treewarden::custody::RunOutcome,
    owner: &treewarden::proc::Identity,
    keep: &KeepArgs,
    status: &mut RunStatus,
) -> CliResult {
    let tree = outcome.tree;
    let code = outcome.exit_code();
    let mut argv: Vec<OsString> = vec![
        std::env::current_exe()
            .map(OsString::from)
            .unwrap_or_else(|_| "treewarden".into()),
        "--data-dir".into(),
        config.data_dir.clone().into(),
        "custody".into(),
        tree.0.to_string().into(),
        "--owner-pid".into(),
        owner.pid.to_string().into(),
        "--owner-start-ticks".into(),
        owner.start_ticks.to_string().into(),
        "--grace".into(),
        format!("{}ms", keep.grace.as_millis()).into(),
        "--signal".into(),
        keep.signal.name().into(),
        "--scan-interval".into(),
        format!("{}ms", keep.scan_interval.as_millis()).into(),
    ];
    if let Some(t) = keep.timeout {
        let left = t.saturating_sub(keep.started.elapsed());
        argv.push("--timeout".into());
        argv.push(format!("{}ms", left.as_millis()).into());
    }
    let spec = treewarden::proc::SpawnSpec {
        argv,
        cwd: None,
        env: None,
        stdio: SpawnStdio::Null,
        container: None,
        cgroup_settings: Vec::new(),
        parent_settings: Vec::new(),
        log_file: None,
        umask: None,
        credentials: None,
        tty: None,
    };
    let started = treewarden::proc::spawn_held(&spec)
        .map_err(|e| e.to_string())
        .and_then(|held| held.release().map_err(|e| e.to_string()));
    match started {
        Ok(custodian) => {
            tracing::info!(
                tree = tree.0,
                custodian = custodian.pid,
                "tree kept by a custodian"
            );
            if !keep.quiet {
                eprintln!(
                    "treewarden: tree {} root exited; what it left runs on in custody (custodian pid {}) until its owner (pid {}) exits, `treewarden kill {}`, or its timeout",
                    tree.0, custodian.pid, owner.pid, tree.0
                );
            }
            Ok(code)
        }
        Err(e) => {
            // Never unwatched: torn down now, with the usual rules.
            let reason = format!("root exited; no custodian to keep the tree ({e})");
            let mut opts = TeardownOptions::new(keep.grace, reason, Origin::Run);
            opts.first_signal = keep.signal;
            let report = engine.teardown(tree, &opts, &mut |_| {});
            status.state = report.as_ref().ok().map(|r| r.state.as_str().to_string());
            let msg = format!(
                "tree {}: --lifetime owner could not start its custodian ({e}); the tree was torn down",
                tree.0
            );
            status.error = Some(msg.clone());
            Err(CliError::internal(anyhow!(msg)))
        }
    }
}

/// `treewarden custody TREE --owner-pid P`: the custodian `run --lifetime
/// owner` hands a tree to when its root exits (not for people; hidden).
#[derive(Args, Debug)]
pub struct CustodyArgs {
    tree: i64,
    #[arg(long, value_parser = clap::value_parser!(i32).range(1..))]
    owner_pid: i32,
    #[arg(long)]
    owner_start_ticks: u64,
    #[arg(long, default_value = policy::DEFAULT_GRACE, value_parser = parse_duration)]
    grace: Duration,
    #[arg(short = 's', long = "signal", default_value = "TERM", value_parser = parse_signal)]
    signal: Sig,
    #[arg(long, default_value = "250ms", value_parser = parse_duration)]
    scan_interval: Duration,
    #[arg(long, value_parser = parse_duration)]
    timeout: Option<Duration>,
}

/// The custodian: keeps the tree until its owner exits (or its timeout,
/// a signal, or nothing left), then tears it down.
pub fn custody(config: &Config, args: CustodyArgs) -> CliResult {
    let deadline = args.timeout.map(|t| std::time::Instant::now() + t);
    let engine = signal_engine(config)?;
    let owner = treewarden::proc::Identity {
        pid: args.owner_pid,
        start_ticks: args.owner_start_ticks,
        boot_id: treewarden::proc::boot_id()
            .map_err(CliError::internal)?
            .to_owned(),
    };
    let opts = treewarden::custody::KeepOptions {
        owner,
        deadline,
        scan_interval: args.scan_interval,
        // The grace its run resolved, handed over as it was.
        grace: Grace::from(args.grace),
        first_signal: args.signal,
    };
    let (end, report) = engine
        .keep(TreeId(args.tree), &opts, &mut |_| {})
        .map_err(custody_error)?;
    tracing::info!(
        tree = args.tree,
        ?end,
        state = report.state.as_str(),
        "kept tree torn down"
    );
    Ok(0)
}
