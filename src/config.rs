//! One validated configuration, built from environment and flags by the CLI and
//! passed explicitly to everything that needs it. There are no global settings.

use std::path::PathBuf;
use std::time::Duration;

/// Which ownership boundary `run` and the service form at spawn.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
#[value(rename_all = "lowercase")]
pub enum BoundaryChoice {
    /// A cgroup v2 per tree where the hierarchy is writable, else session + process group.
    Auto,
    /// Always a cgroup; spawning fails when no writable cgroup v2 hierarchy exists.
    Cgroup,
    /// Always session + process group, even where cgroups are available.
    Session,
}

impl std::str::FromStr for BoundaryChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Self::Auto),
            "cgroup" => Ok(Self::Cgroup),
            "session" => Ok(Self::Session),
            other => Err(format!(
                "unknown boundary {other:?}: expected auto, cgroup or session"
            )),
        }
    }
}

impl std::fmt::Display for BoundaryChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::Cgroup => "cgroup",
            Self::Session => "session",
        })
    }
}

/// Whether an owner runs the proc-connector observer beside its scans.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
#[value(rename_all = "lowercase")]
pub enum ObserverMode {
    /// Run it where the proc connector can be subscribed to; otherwise scans only.
    Auto,
    /// Require it: `run` refuses to start work when it cannot subscribe.
    On,
    /// Scans only (the control case of the observer tests).
    Off,
}

impl std::str::FromStr for ObserverMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Self::Auto),
            "on" => Ok(Self::On),
            "off" => Ok(Self::Off),
            other => Err(format!(
                "unknown observer mode {other:?}: expected on, off or auto"
            )),
        }
    }
}

impl std::fmt::Display for ObserverMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::On => "on",
            Self::Off => "off",
        })
    }
}

/// Everything a treewarden process needs to know about where it keeps its
/// evidence and how it forms boundaries.
#[derive(Clone, Debug)]
pub struct Config {
    /// Holds `ledger.db` (and, for the service, `api-token`).
    pub data_dir: PathBuf,
    /// Boundary requested for new trees.
    pub boundary: BoundaryChoice,
    /// Overrides cgroup v2 root discovery (`TREEWARDEN_CGROUP_ROOT`).
    pub cgroup_root: Option<PathBuf>,
    /// How long a ledger write waits for another process's write lock before
    /// it fails. Bounded so a stuck writer elsewhere becomes an error, not a hang.
    pub busy_timeout: Duration,
    /// Whether owners run the proc-connector observer (`--observer`).
    pub observer: ObserverMode,
    /// The observer socket's receive buffer in bytes (0: the default). Small
    /// values provoke overflows in tests.
    pub observer_rcvbuf: usize,
}

impl Config {
    /// The ledger file inside the data directory.
    pub fn ledger_path(&self) -> PathBuf {
        self.data_dir.join("ledger.db")
    }

    /// Default data directory: `/var/lib/treewarden` for root, else
    /// `$XDG_STATE_HOME/treewarden` (or `~/.local/state/treewarden`).
    pub fn default_data_dir() -> PathBuf {
        if rustix::process::geteuid().is_root() {
            return PathBuf::from("/var/lib/treewarden");
        }
        if let Some(state) = std::env::var_os("XDG_STATE_HOME").filter(|s| !s.is_empty()) {
            return PathBuf::from(state).join("treewarden");
        }
        let home = std::env::var_os("HOME").unwrap_or_else(|| ".".into());
        PathBuf::from(home).join(".local/state/treewarden")
    }
}
