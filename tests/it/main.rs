//! One integration test binary (ripgrep style): real processes, real SQLite
//! files, real HTTP on 127.0.0.1:0. Each area lives in its own module.

mod alerts;
mod bench_smoke;
mod budget;
mod conventions;
mod custody;
mod delegation;
mod docs;
mod fidelity;
mod golden;
mod harness;
mod hierarchy;
mod hostile;
mod ledger;
mod ledger_life;
mod observer;
mod privilege;
mod proc;
mod recovery;
mod retention;
mod rules;
mod scale;
mod seal;
mod seal_pub;
mod serve;
mod session;
mod shipping;
mod tenants;
mod tenants_conn;
mod tenants_fds;
mod tidy;
mod trailer;
mod util;
mod wrapper;
