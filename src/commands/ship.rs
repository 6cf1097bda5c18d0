//! `treewarden ship`'s arguments: one pass of the JetStream shipping for
//! hosts that only `run` (the command is `service.rs`'s: the shipper is the
//! service's, `service/nats.rs`). `fleet`'s are `fleet.rs`'s.

use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct ShipArgs {
    /// The NATS servers, comma separated: nats://HOST:PORT[,HOST:PORT…].
    #[arg(value_name = "URLS")]
    pub servers: String,
    /// A NATS credentials file (user JWT and NKey seed).
    #[arg(long, value_name = "FILE")]
    pub creds: Option<PathBuf>,
    /// This host's id in the subject and the message ids. Default:
    /// /etc/machine-id, else the host name (as `serve --ship`).
    #[arg(long, value_name = "ID")]
    pub host_id: Option<String>,
    /// The stream's replicas when this makes it (1 to 5).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub replicas: usize,
    /// How long to wait for the server to connect and for each ack.
    #[arg(long, value_name = "D", default_value = "5s", value_parser = treewarden::config::parse_duration)]
    pub timeout: std::time::Duration,
    /// Print {"shipped", "cursor", "head"} as JSON.
    #[arg(long)]
    pub json: bool,
}
