//! Embedding treewarden in a Rust program (docs/INTEGRATION.md): open the
//! ledger, build an engine, spawn a tree, watch it once, tear it down, print
//! the report.
//!
//! ```sh
//! cargo run --example embed -- /tmp/tw-embed        # data dir (ledger.db lives there)
//! ```
//!
//! `TREEWARDEN_BOUNDARY` (auto|cgroup|session, default auto) and
//! `TREEWARDEN_CGROUP_ROOT` are honoured as by the CLI. The test
//! `docs::the_rust_embedding_example_runs` runs this binary, so it cannot rot.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use treewarden::config::{BoundaryChoice, Config, ObserverMode};
use treewarden::custody::{Engine, Origin, SpawnRequest, TeardownOptions, TreeWatch};
use treewarden::ledger::{Ledger, LedgerOptions, OwnerKind};
use treewarden::proc::{Reaper, SpawnStdio};

fn main() -> anyhow::Result<()> {
    let data_dir = std::env::args_os()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(Config::default_data_dir);
    let boundary: BoundaryChoice = std::env::var("TREEWARDEN_BOUNDARY")
        .unwrap_or_else(|_| "auto".into())
        .parse()
        .map_err(|e: String| anyhow::anyhow!(e))?;
    let config = Config {
        data_dir,
        boundary,
        cgroup_root: std::env::var_os("TREEWARDEN_CGROUP_ROOT").map(PathBuf::from),
        busy_timeout: Duration::from_secs(2),
        ledger_reserve: treewarden::ledger::DEFAULT_RESERVE,
        observer: ObserverMode::Off,
        observer_rcvbuf: 0,
    };

    // 1. This process owns the trees it spawns: it becomes their child
    //    subreaper, so orphaned descendants are re-parented to it and reaped.
    let reaper = Reaper::install()?;
    // 2. The write-ahead authority ledger (created, migrated, WAL mode).
    let ledger = Ledger::open(&config.ledger_path(), LedgerOptions::from_config(&config))?;
    // 3. The engine: the boundary is resolved here (cgroup v2 if writable).
    let engine = Engine::new(&config, ledger, Some(reaper))?;
    let me = treewarden::proc::self_identity()?;

    // 4. Spawn: the tree row is committed before the child may exec.
    let spawned = engine.spawn(&SpawnRequest {
        argv: ["sh", "-c", "sleep 300 & sleep 300 & wait"]
            .iter()
            .map(Into::into)
            .collect(),
        label: Some("embed-example".into()),
        cwd: None,
        env: None,
        stdio: SpawnStdio::Null,
        owner: me.clone(),
        owner_kind: OwnerKind::Run,
        grace: None,
        timeout: None,
        limits: Default::default(),
        umask: None,
        first_signal: None,
        on_behalf: None,
    })?;
    println!(
        "spawned tree {} (root pid {}, pgid {}, boundary {})",
        spawned.tree.0, spawned.root.pid, spawned.pgid, spawned.boundary
    );

    // 5. Watch it as an owner does on every scan interval: members and
    //    escapes are recorded in the ledger. Bounded: at most 10 seconds.
    let row = engine
        .ledger()
        .tree(spawned.tree)?
        .ok_or_else(|| anyhow::anyhow!("tree {} not in the ledger", spawned.tree.0))?;
    let mut watch = TreeWatch::new(&row, &[], &HashSet::from([me.pid]))
        .ok_or_else(|| anyhow::anyhow!("tree {} has no recorded group", spawned.tree.0))?;
    let deadline = Instant::now() + Duration::from_secs(10);
    let members = loop {
        let tick = watch.tick(&engine, &HashMap::new());
        if tick.members.len() >= 3 || Instant::now() >= deadline {
            break tick.members.len();
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    println!("members seen: {members}");

    // 6. Tear it down: SIGTERM to the group, grace, freeze, a committed
    //    kill authorization, SIGKILL, verification by scan.
    let opts = TeardownOptions::new(Duration::from_secs(2), "embed example done", Origin::Kill);
    let report = engine.teardown(spawned.tree, &opts, &mut |_| {})?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    anyhow::ensure!(
        report.state == treewarden::ledger::TreeState::Ended,
        "teardown ended in state {:?}",
        report.state
    );
    Ok(())
}
