//! treewarden takes custody of process trees.
//!
//! Modules in reading order:
//!
//! - [`config`]: one validated [`config::Config`], passed explicitly; no globals.
//! - [`proc`]: the only code that makes process syscalls: identity, boundary
//!   (session, process group, cgroup v2), signals, subreaper and reaping, host probe.
//! - [`ledger`]: the only code that knows SQL: the write-ahead authority ledger.
//! - [`scan`]: `/proc` snapshots and the pure classification of members and escapes.
//! - [`custody`]: the engine: spawn protocol, teardown state machine, dispatch gate, sweep.
//! - [`service`]: `serve`'s owner loop: API-spawned trees, scans, sweeps, owner watches, shutdown.
//! - [`http`]: `router(state)`: the JSON API, dashboard, `/metrics`, export, OpenAPI.
//! - [`serve`]: `treewarden serve` as a library call: builds the service and its router, binds, runs.
//! - [`service::fleet`] (`src/fleet/`): `fleet serve`: the fleet's JetStream consumer, verdicts, pages.
//! - [`telemetry`]: logs to stderr (text or JSON) and OTLP span export when configured.
//! - [`testhook`]: test-only crash points (`TREEWARDEN_TEST_CRASH_AT`), off by default.
//!
//! The binary (`src/main.rs`, `src/cli.rs`) is a thin shell over these.

pub mod config;
pub mod custody;
// The service: HTTP over TCP (both) and the Unix socket (Linux), built on
// Linux and Windows.
#[cfg(any(target_os = "linux", windows))]
pub mod http;
pub mod ledger;
pub mod proc;
pub mod scan;
#[cfg(any(target_os = "linux", windows))]
pub mod serve;
#[cfg(any(target_os = "linux", windows))]
pub mod service;
pub mod telemetry;
pub mod testhook;
