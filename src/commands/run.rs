//! `treewarden run`: spawn a tree, wait for its end (root exit, timeout,
//! signals, owner death), tear it down, report the root's status.

use super::*;

#[derive(Args, Debug)]
pub struct RunArgs {
    /// A label for the tree (shown by ls and the dashboard).
    #[arg(long)]
    label: Option<String>,
    /// Time between the first signal and the forced kill (a bare number is
    /// seconds, as in timeout(1)).
    #[arg(long, default_value = policy::DEFAULT_GRACE, value_parser = parse_duration)]
    grace: Duration,
    /// Tear the tree down after this long (exit 124); a bare number is seconds.
    #[arg(long, value_parser = parse_duration)]
    timeout: Option<Duration>,
    /// The first signal of the teardown: TERM (default), INT, HUP, QUIT,
    /// USR1 or USR2, by name or number, as timeout(1) takes it.
    #[arg(short = 's', long = "signal", value_name = "SIG", default_value = "TERM", value_parser = parse_signal)]
    signal: Sig,
    /// Add K=V to the command's environment (repeatable).
    #[arg(long = "env", value_name = "K=V", value_parser = parse_env)]
    env: Vec<(OsString, OsString)>,
    /// Run the command in DIR.
    #[arg(long, value_name = "DIR")]
    cwd: Option<std::path::PathBuf>,
    /// The tree's memory limit (`memory.max`): bytes, or with K, M, G, T.
    /// Like every limit it needs the cgroup boundary and its controller;
    /// without them the run is refused (125), never started unlimited.
    #[arg(long, value_name = "SIZE", value_parser = treewarden::ledger::parse_size)]
    memory_max: Option<u64>,
    /// The tree's process limit (`pids.max`).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pids_max: Option<u64>,
    /// The tree's CPU limit as a percentage of one CPU (`cpu.max`; `50%`,
    /// `200%`), like systemd's CPUQuota=.
    #[arg(long, value_name = "PCT", value_parser = treewarden::ledger::parse_cpu_pct)]
    cpu_max: Option<u32>,
    /// How often the tree is scanned for members and escapes.
    #[arg(long, default_value = "250ms", value_parser = parse_duration)]
    scan_interval: Duration,
    /// Tear the tree down when run's parent process dies (the process, not
    /// the thread that spawned run: a thread pool may retire that thread).
    #[arg(long)]
    die_with_parent: bool,
    /// Run on behalf of this process: it is the tree's owner on the record,
    /// and the tree is torn down when it exits (as --die-with-parent does
    /// for the parent). Allowed only where the caller may signal it.
    #[arg(long, value_name = "PID", value_parser = clap::value_parser!(i32).range(1..))]
    owner_pid: Option<i32>,
    /// The owner's start time in clock ticks (field 22 of /proc/PID/stat),
    /// so a pid recycled since the caller read it is refused.
    #[arg(long, value_name = "TICKS", requires = "owner_pid")]
    owner_start_ticks: Option<u64>,
    /// Whom an unsettled tree (a teardown that could not be authorized)
    /// refuses new work to: `owner` (the same owner record or requester;
    /// default) or `host` (every run on this data dir).
    #[arg(long, value_name = "SCOPE", default_value = "owner")]
    dispatch_scope: treewarden::custody::DispatchScope,
    /// Give the tree its own terminal (a pty as its controlling terminal
    /// and stdio), relayed to this one in raw mode: prompts, full-screen
    /// tools, window resizes and Ctrl-C (SIGINT to the tree through its
    /// terminal) work. Default: when stdin is a terminal (and the lifetime
    /// is `root`: a kept tree's terminal would hang up when run returns).
    #[arg(long, overrides_with = "no_tty")]
    tty: bool,
    /// No terminal for the tree, even when stdin is one (it inherits
    /// run's descriptors, in a session without a controlling terminal).
    #[arg(long, overrides_with = "tty")]
    no_tty: bool,
    /// `root` (default): the tree ends when the command exits. `owner`: run
    /// returns the command's status when it exits, and what it left running
    /// stays in custody (a custodian process) until the owner — run's
    /// parent process, or --owner-pid — exits, `treewarden kill`, or
    /// --timeout.
    #[arg(long, value_name = "LIFETIME", default_value = "root")]
    lifetime: Lifetime,
    /// Do not settle, before starting, what dead owners left: teardowns
    /// that failed closed (finished with a fresh authorization) and orphans
    /// (torn down with their recorded grace, beside the command, at most 8).
    #[arg(long)]
    no_settle: bool,
    /// Write the tree's id and a newline to descriptor N (inherited, 3 or
    /// above) once the tree is recorded, before the command runs; N is then
    /// closed. The command never inherits it.
    #[arg(long, value_name = "N")]
    id_fd: Option<i32>,
    /// Write one JSON line to descriptor N when run ends, on every path:
    /// {"tree", "state", "exit": {"code", "signal"} or null, "error": null
    /// or treewarden's own failure} (docs/INTEGRATION.md).
    #[arg(long, value_name = "N")]
    status_fd: Option<i32>,
    /// No teardown progress and no summary line on stderr.
    #[arg(long, short)]
    quiet: bool,
    /// The summary line on stderr after every run, a clean one too, with
    /// what the tree consumed (like `systemd-run --wait`).
    #[arg(long, short, conflicts_with = "quiet")]
    verbose: bool,
    /// The command and its arguments (after `--` when they start with `-`).
    #[arg(trailing_var_arg = true, value_name = "CMD")]
    command: Vec<OsString>,
}

pub fn run(config: &Config, args: RunArgs) -> CliResult {
    // No tree is spawned on macOS yet: refused before anything.
    if !treewarden::proc::SPAWNS_TREES {
        return Err(CliError::internal(anyhow!(
            "run: macOS is not supported yet: no tree is spawned there (the process layer is compile-checked only; docs/RESIDUALS.md, \"macOS\")"
        )));
    }
    // The caller's descriptors first, before anything else opens one.
    let (id_file, status_file) = take_run_fds(args.id_fd, args.status_fd)?;
    let mut status = RunStatus::default();
    let result = run_owned(config, args, &mut status, id_file);
    if let Some(mut file) = status_file {
        if let Err(e) = &result
            && status.error.is_none()
        {
            status.error = Some(format!("{:#}", e.error));
        }
        let line = serde_json::to_string(&status).unwrap_or_default();
        if let Err(e) = writeln!(file, "{line}") {
            tracing::warn!(error = %e, "--status-fd not written");
        }
    }
    result
}

/// The line `run --status-fd N` writes when it ends, on every path: the
/// tree (`null` when none was recorded), its state in the ledger, how its
/// root ended (`null` when unknown), and treewarden's own failure (`null`
/// when there was none) — so a command's own `exit 125` is told from
/// run's. A contract (docs/INTEGRATION.md): fields are only ever added.
#[derive(Debug, Default, serde::Serialize)]
pub(super) struct RunStatus {
    pub(super) tree: Option<i64>,
    pub(super) state: Option<String>,
    pub(super) exit: Option<RunExit>,
    pub(super) error: Option<String>,
}

/// The root's end: `code` when it exited, `signal` when a signal killed it.
#[derive(Debug, serde::Serialize)]
pub(super) struct RunExit {
    code: Option<i32>,
    signal: Option<i32>,
}

impl From<treewarden::proc::ExitStatus> for RunExit {
    fn from(s: treewarden::proc::ExitStatus) -> Self {
        match s {
            treewarden::proc::ExitStatus::Exited(c) => Self {
                code: Some(c),
                signal: None,
            },
            treewarden::proc::ExitStatus::Signaled(n) => Self {
                code: None,
                signal: Some(n),
            },
        }
    }
}

/// `--id-fd` and `--status-fd` (one descriptor may serve both: the id line
/// comes first, the status line last).
pub(super) fn take_run_fds(
    id_fd: Option<i32>,
    status_fd: Option<i32>,
) -> Result<(Option<std::fs::File>, Option<std::fs::File>), CliError> {
    let take = |flag: &str, n: i32| {
        treewarden::proc::take_inherited_fd(n)
            .map_err(|e| CliError::internal(anyhow!("{flag} {n}: {e}")))
    };
    let id = id_fd.map(|n| take("--id-fd", n)).transpose()?;
    let status = match (status_fd, &id) {
        (Some(n), Some(file)) if Some(n) == id_fd => Some(
            file.try_clone()
                .map_err(|e| CliError::internal(anyhow!("--status-fd {n}: {e}")))?,
        ),
        (Some(n), _) => Some(take("--status-fd", n)?),
        (None, _) => None,
    };
    Ok((id, status))
}

// Over 100 lines on purpose: the tree's terminal (pty, relay, raw mode) is set up before the run
// and undone after it in order (relay finished, raw mode left, then the output), and the `recorded`
// closure borrows the relay and the id file; one frame keeps that order.
pub(super) fn run_owned(
    config: &Config,
    args: RunArgs,
    status: &mut RunStatus,
    mut id_file: Option<std::fs::File>,
) -> CliResult {
    if args.command.is_empty() {
        return Err(CliError::internal(anyhow!(
            "empty command: usage is `treewarden run [OPTIONS] -- CMD [ARGS...]`"
        )));
    }
    let reaper = Reaper::install()
        .map_err(|e| CliError::internal(anyhow!("cannot become a subreaper: {e}")))?;
    let named_owner = match (args.owner_pid, args.lifetime) {
        (Some(pid), _) => Some(named_owner(pid, args.owner_start_ticks)?),
        // A tree that outlives its root lives as long as its owner: the
        // caller (run's parent process) unless --owner-pid names another.
        (None, Lifetime::Owner) => Some(named_owner(treewarden::proc::parent_pid(), None)?),
        (None, Lifetime::Root) => None,
    };
    let mut engine = engine(config, Some(reaper))?;
    engine.set_dispatch_scope(args.dispatch_scope);
    // What a teardown could not authorize is finished first, by the first
    // process that finds the ledger writable: this one. Dispatch then judges
    // what is left.
    if !args.no_settle {
        engine.sweeper().settle_failed_closed(SETTLE_LIMIT);
    }
    let me = treewarden::proc::self_identity().map_err(CliError::internal)?;
    let (owner, owner_kind) = match &named_owner {
        Some(id) => (id.clone(), OwnerKind::Client),
        None => (me.clone(), OwnerKind::Run),
    };
    let env = (!args.env.is_empty()).then(|| {
        let mut env: Vec<(OsString, OsString)> = std::env::vars_os()
            .filter(|(k, _)| !args.env.iter().any(|(added, _)| added == k))
            .collect();
        env.extend(args.env.iter().cloned());
        env
    });
    let req = SpawnRequest {
        argv: args.command,
        label: args.label,
        cwd: args.cwd,
        env,
        limits: treewarden::ledger::Limits {
            memory_max: args.memory_max,
            pids_max: args.pids_max,
            cpu_max_pct: args.cpu_max,
        },
        umask: None,
        first_signal: None,
        // The invoking user is the requester: its uid is on the tree row.
        on_behalf: Some(treewarden::custody::OnBehalf {
            requester: treewarden::ledger::Requester {
                pid: Some(me.pid),
                ..super::cli_requester()
            },
            run_as: None,
        }),
        stdio: SpawnStdio::Inherit,
        owner,
        owner_kind,
        grace: Some(args.grace),
        timeout: args.timeout,
    };
    let opts = RunOptions {
        grace: Grace::resolve(Some(args.grace), None, policy::default_grace(), None),
        timeout: args.timeout,
        scan_interval: args.scan_interval,
        die_with_parent: args.die_with_parent,
        owner: named_owner,
        observer: config.observer,
        observer_rcvbuf: config.observer_rcvbuf,
        first_signal: args.signal,
        lifetime: args.lifetime,
        tty: None,
    };
    let mut opts = opts;
    // Terminal mode: the tree's own pty, the caller's terminal raw (restored
    // when `_raw` drops, before anything more is printed).
    // Not automatic for a tree that outlives run (`--lifetime owner`): its
    // terminal's master closes with run, and the hang-up would reach what
    // the tree keeps running.
    let auto_tty = args.lifetime == Lifetime::Root && treewarden::proc::tty::stdin_is_tty();
    let pty = if args.tty || (!args.no_tty && auto_tty) {
        let pty = treewarden::proc::tty::Pty::open()
            .map_err(|e| CliError::internal(anyhow!("--tty: no pseudo-terminal: {e}")))?;
        pty.copy_size_from_stdin();
        opts.tty = Some(pty.slave().to_path_buf());
        Some(pty)
    } else {
        None
    };
    let mut relay = match &pty {
        Some(p) => Some(TtyRelay::new(p).map_err(|e| CliError::internal(anyhow!("--tty: {e}")))?),
        None => None,
    };
    let raw = match &pty {
        Some(_) => treewarden::proc::tty::RawTerminal::enter()
            .map_err(|e| CliError::internal(anyhow!("--tty: raw mode: {e}")))?,
        None => None,
    };
    let args_for_keep = KeepArgs {
        grace: args.grace,
        signal: args.signal,
        scan_interval: args.scan_interval,
        timeout: args.timeout,
        started: std::time::Instant::now(),
        quiet: args.quiet,
    };
    let mut progress = progress_printer(args.quiet);
    let mut recorded_tree = None;
    // The id goes to the caller once the tree is recorded, before the
    // command runs; the descriptor is closed then (EOF for its reader).
    let mut recorded = |tree: TreeId| {
        recorded_tree = Some(tree.0);
        // The tree's terminal is open on its side now: relay it.
        if let Some(r) = relay.as_mut() {
            r.start();
        }
        if let Some(mut file) = id_file.take()
            && let Err(e) = writeln!(file, "{}", tree.0)
        {
            tracing::warn!(error = %e, "--id-fd not written");
        }
    };
    // Orphans dead wrappers left are torn down beside the command, with the
    // grace each was given, so a host without a sweep timer does not depend
    // on one; run waits for them before it exits (never half done).
    let outcome = std::thread::scope(|scope| {
        let settling = (!args.no_settle).then(|| {
            std::thread::Builder::new()
                .name("tw-settle".into())
                .spawn_scoped(scope, || {
                    engine.sweeper().settle_orphans(SETTLE_LIMIT, args.grace)
                })
        });
        let outcome = engine.run_with(&req, &opts, &mut progress, &mut recorded);
        if let Some(Ok(handle)) = settling {
            let _ = handle.join();
        }
        outcome
    });
    // What the tree wrote is on its way to our stdout; then the caller's
    // terminal gets its mode back.
    if let Some(r) = relay.take() {
        r.finish(Duration::from_secs(2));
    }
    drop(raw);
    progress_done(args.quiet);
    status.tree = recorded_tree;
    let outcome = outcome.map_err(custody_error)?;
    let code = outcome.exit_code();
    status.tree = Some(outcome.tree.0);
    let row = engine.ledger().tree(outcome.tree).ok().flatten();
    status.state = match (&row, &outcome.teardown) {
        (Some(row), _) => Some(row.state.as_str().to_string()),
        (None, Ok(Some(r))) => Some(r.state.as_str().to_string()),
        (None, _) => None,
    };
    status.exit = match outcome.end {
        treewarden::custody::RunEnd::RootExited(s) => Some(s.into()),
        _ => row.as_ref().and_then(|r| r.exit).map(|e| RunExit {
            code: e.code,
            signal: e.signal,
        }),
    };
    if let Ok(None) = outcome.teardown {
        // The root exited and the tree lives on: a custodian keeps it.
        let owner = opts
            .owner
            .clone()
            .ok_or_else(|| CliError::internal(anyhow!("a kept tree without an owner (a bug)")))?;
        return hand_over(config, &engine, &outcome, &owner, &args_for_keep, status);
    }
    if !args.quiet
        && let Some(line) = run_summary(&outcome, args.verbose)
    {
        eprintln!("{line}");
    }
    if let Err(e) = outcome.teardown {
        status.error = Some(e.to_string());
        if let Some(line) = survivors_hold_pipes(&engine, outcome.tree) {
            eprintln!("{line}");
        }
        return Err(CliError::internal(anyhow!(e)));
    }
    Ok(code)
}

/// When `run` failed closed leaving survivors and its stdout or stderr is a
/// pipe: one line saying the survivors hold the caller's pipes (run cannot
/// close another process's descriptors, and must not kill it without an
/// authorization), so a caller waiting for EOF knows why it waits and
/// what ends it.
/// (Where the OS cannot tell a pipe, as on Windows, the line names none.)
pub(super) fn survivors_hold_pipes(engine: &Engine, tree: TreeId) -> Option<String> {
    let survivors = engine.ambiguity().survivors_left(tree);
    if survivors.is_empty() {
        return None;
    }
    let pipes = treewarden::proc::stdio_pipes().unwrap_or_default();
    let pids: Vec<String> = survivors.iter().map(i32::to_string).collect();
    let held = if pipes.is_empty() {
        String::new()
    } else {
        format!(
            "; they still hold this run's {} (a pipe: a reader waiting for its end waits for them)",
            pipes.join(" and ")
        )
    };
    Some(format!(
        "treewarden: tree {} left {} survivor(s) alive as evidence (pid {}){held}; the next treewarden run, ls, kill or sweep that can write the ledger finishes the teardown",
        tree.0,
        survivors.len(),
        pids.join(", ")
    ))
}

/// The process `run --owner-pid` names: it exists, is the one the caller
/// meant (`--owner-start-ticks`), and the caller may signal it.
pub(super) fn named_owner(
    pid: i32,
    start_ticks: Option<u64>,
) -> Result<treewarden::proc::Identity, CliError> {
    let id = treewarden::proc::identity_of(pid)
        .map_err(CliError::internal)?
        .ok_or_else(|| CliError::internal(anyhow!("--owner-pid {pid}: no such process")))?;
    if let Some(ticks) = start_ticks
        && ticks != id.start_ticks
    {
        return Err(CliError::internal(anyhow!(
            "--owner-pid {pid}: started at tick {}, not {ticks} (the pid was recycled)",
            id.start_ticks
        )));
    }
    if !treewarden::proc::may_signal(pid) {
        return Err(CliError::internal(anyhow!(
            "--owner-pid {pid}: not a process you may signal"
        )));
    }
    Ok(id)
}

/// `, consumed cpu 12.3 ms, …`: the figures the host gave.
pub(super) fn consumed(r: treewarden::ledger::Resources) -> String {
    match r.summary() {
        s if s.is_empty() => s,
        s => format!("; consumed {s}"),
    }
}

/// One line on stderr, like `systemd-run --wait`, when `run` tore its tree
/// down for any reason but a clean exit of a tree that left nothing behind:
/// the tree, why, what was there, what was forced, and the authority.
pub(super) fn run_summary(
    outcome: &treewarden::custody::RunOutcome,
    always: bool,
) -> Option<String> {
    use treewarden::custody::RunEnd;
    let why = match outcome.end {
        RunEnd::RootExited(_) => "root exited",
        RunEnd::Timeout => "timed out",
        RunEnd::Signal(_) => "received a signal",
        RunEnd::ParentDied => "parent died",
        RunEnd::OwnerDied => "owner died",
    };
    match &outcome.teardown {
        // Kept (`--lifetime owner`): the line is the custodian's to say.
        Ok(None) => None,
        Ok(Some(r))
            if !always
                && matches!(outcome.end, RunEnd::RootExited(_))
                && r.members_at_start == 0 =>
        {
            None
        }
        Ok(Some(r)) => Some(format!(
            "treewarden: tree {} {why}: {} members torn down, {} force-killed ({} authorization{}), {}, {:.0} ms{}",
            outcome.tree.0,
            r.members_at_start,
            r.force_killed,
            r.authorizations,
            if r.authorizations == 1 { "" } else { "s" },
            r.state.as_str(),
            r.elapsed.as_secs_f64() * 1000.0,
            r.resources.map(consumed).unwrap_or_default()
        )),
        Err(e) => Some(format!(
            "treewarden: tree {} {why}: teardown not settled: {e}",
            outcome.tree.0
        )),
    }
}
