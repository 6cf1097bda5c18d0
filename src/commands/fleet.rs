//! `treewarden fleet`'s arguments: the fleet's view of what hosts shipped
//! to JetStream (the commands are `fleet_service.rs`'s, the service
//! `src/fleet/`'s).

use std::path::PathBuf;

/// The NATS servers and credentials every `fleet` command takes.
#[derive(clap::Args, Debug, Clone)]
pub struct NatsArgs {
    /// The NATS servers, comma separated: nats://HOST:PORT[,HOST:PORT…].
    #[arg(long, value_name = "URLS")]
    pub nats: String,
    /// A NATS credentials file (user JWT and NKey seed).
    #[arg(long, value_name = "FILE")]
    pub creds: Option<PathBuf>,
}

/// `treewarden fleet …`: the fleet's view, from the JetStream stream.
#[derive(clap::Subcommand, Debug)]
pub enum FleetCommand {
    /// Consume every host's events from the stream (a durable pull
    /// consumer: several `fleet serve` naming the same --consumer share
    /// the work and the --data dir), verify each host's chain and seals,
    /// index them in DIR/fleet.db, and serve the fleet dashboard and
    /// /metrics on --listen (loopback only). Runs until SIGINT/SIGTERM.
    Serve {
        #[command(flatten)]
        nats: NatsArgs,
        /// The fleet's directory: its index (fleet.db) and the hosts'
        /// registered verification material.
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
        /// Serve the dashboard and /metrics here (a loopback address).
        #[arg(long, value_name = "ADDR")]
        listen: Option<std::net::SocketAddr>,
        /// The durable consumer's name.
        #[arg(long, value_name = "NAME", default_value = "treewarden-fleet")]
        consumer: String,
        /// A host whose newest event is older than this is stale.
        #[arg(long, value_name = "D", default_value = "15m", value_parser = treewarden::config::parse_duration)]
        stale: std::time::Duration,
    },
    /// Register or list hosts' seal verification material.
    #[command(subcommand)]
    Hosts(HostsCommand),
    /// Forget the index's messages and verdicts and delete the durable
    /// consumer, so the next `fleet serve` re-reads the stream from its
    /// first message (registered hosts stay). Stop every `fleet serve` of
    /// this consumer first.
    Rebuild {
        #[command(flatten)]
        nats: NatsArgs,
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
        #[arg(long, value_name = "NAME", default_value = "treewarden-fleet")]
        consumer: String,
    },
    /// Verify one host's events from the stream alone: each seq the one
    /// after the last (no gap, no rewind), each message's ids its own
    /// event's, every hash recomputed and linked, and with --seal-key or
    /// --seal-pub the seals. Exit 0 when whole; 1 naming the first broken
    /// seq; 3 when no server answered.
    Verify {
        #[command(flatten)]
        nats: NatsArgs,
        /// The host's id, as it ships (`--ship-host-id`, or its machine id).
        #[arg(value_name = "HOST")]
        host: String,
        /// The host's seal verification key (`seal setup` printed it).
        #[arg(long, value_name = "KEY", conflicts_with = "seal_pub")]
        seal_key: Option<String>,
        /// The host's root public key (`seal setup --pub` wrote it).
        #[arg(long, value_name = "KEY")]
        seal_pub: Option<String>,
        /// Also count the events at or after T (`2h` or an RFC 3339 time).
        /// The walk itself always starts at the host's first event: the
        /// chain is anchored there.
        #[arg(long, value_name = "T")]
        since: Option<String>,
        /// Print {"ok", "host", "events", "head", "seal", "first_break"} as JSON.
        #[arg(long)]
        json: bool,
    },
}

/// `treewarden fleet hosts …`.
#[derive(clap::Subcommand, Debug)]
pub enum HostsCommand {
    /// Register (or replace) a host's seal verification material: the key
    /// `seal setup` printed, or the root public key `seal setup --pub` wrote.
    #[command(group(clap::ArgGroup::new("material").required(true).args(["seal_pub", "seal_key"])))]
    Add {
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
        #[arg(value_name = "HOST")]
        host: String,
        /// A file holding the host's root public key.
        #[arg(
            long,
            value_name = "FILE",
            required_unless_present = "seal_key",
            conflicts_with = "seal_key"
        )]
        seal_pub: Option<PathBuf>,
        /// A file holding the host's seal verification key.
        #[arg(long, value_name = "FILE")]
        seal_key: Option<PathBuf>,
    },
    /// List the registered hosts.
    Ls {
        #[arg(long, value_name = "DIR")]
        data: PathBuf,
        /// Print the hosts as JSON.
        #[arg(long)]
        json: bool,
    },
}
