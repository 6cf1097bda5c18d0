//! One validated configuration, built from environment and flags by the CLI and
//! passed explicitly to everything that needs it. There are no global settings.

use std::path::PathBuf;
use std::time::Duration;

/// Parses a duration as every treewarden interface takes it: a bare number
/// is seconds, as timeout(1) takes it (`10`, `1.5`), else humantime
/// (`500ms`, `5s`, `10m`). The error names the value, not the flag.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let d = parse_duration_unbounded(s)?;
    // Every duration treewarden takes is added to a clock: bounded, so no
    // `Instant + d` can overflow (a grace or timeout of a century is a typo).
    if d > MAX_DURATION {
        return Err(format!("duration {s:?} is over ten years"));
    }
    Ok(d)
}

/// `serve --max-connections`'s default: connections served at once on
/// each listener (declared here, not in `http`, so that the flag reads the
/// same on every OS the binary builds for).
pub const MAX_CONNECTIONS: usize = 1024;

/// `serve --max-connections-per-uid`'s default.
pub const MAX_CONNECTIONS_PER_UID: usize = 64;

/// The longest duration any flag or field takes.
pub const MAX_DURATION: Duration = Duration::from_secs(10 * 365 * 86_400);

fn parse_duration_unbounded(s: &str) -> Result<Duration, String> {
    // `1.5` and `1.5s` are seconds (humantime takes no fractions).
    let bare = s
        .strip_suffix('s')
        .filter(|n| !n.ends_with(['m', 'u', 'n']))
        .unwrap_or(s);
    if let Ok(secs) = bare.parse::<f64>() {
        return Duration::try_from_secs_f64(secs).map_err(|_| {
            format!("malformed duration {s:?}: seconds must be finite and not negative")
        });
    }
    humantime::parse_duration(s).map_err(|e| {
        format!("malformed duration {s:?}: {e} (a number of seconds, or 500ms, 5s, 10m)")
    })
}

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
    /// Bytes the ledger preallocates for its WAL at open (`--ledger-reserve`).
    pub ledger_reserve: u64,
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
    /// `$XDG_STATE_HOME/treewarden`, else `<home>/.local/state/treewarden`
    /// where home is `$HOME` if it is a directory, else the user's home in
    /// the user database if that is one. A user with neither (`$HOME` unset
    /// or `/nonexistent`, as for system users) gets
    /// `$XDG_RUNTIME_DIR/treewarden` (per user, 0700, cleared at logout)
    /// when that is set; else `$HOME/.local/state/treewarden` is kept, and
    /// the error creating it names the path (`--data-dir` and
    /// `TREEWARDEN_DATA_DIR` choose another).
    pub fn default_data_dir() -> PathBuf {
        if let Some(dir) = crate::proc::SUPERUSER_DATA_DIR
            && crate::proc::effective_uid() == 0
        {
            return PathBuf::from(dir);
        }
        let var = |name: &str| std::env::var_os(name).filter(|s| !s.is_empty());
        if let Some(state) = var("XDG_STATE_HOME") {
            return PathBuf::from(state).join("treewarden");
        }
        let home = var("HOME").map(PathBuf::from);
        let state_in = |home: &std::path::Path| home.join(".local/state/treewarden");
        if let Some(home) = home.as_deref().filter(|h| h.is_dir()) {
            return state_in(home);
        }
        let uid = crate::proc::current_uid();
        if let Some(home) = crate::proc::user_by_uid(uid)
            .ok()
            .flatten()
            .map(|u| u.home)
            .filter(|h| h.is_dir())
        {
            return state_in(&home);
        }
        if let Some(runtime) = var("XDG_RUNTIME_DIR")
            .map(PathBuf::from)
            .filter(|r| r.is_dir())
        {
            return runtime.join("treewarden");
        }
        state_in(&home.unwrap_or_else(|| PathBuf::from(".")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_are_seconds_when_bare_and_humantime_otherwise() {
        let ok = |s: &str| parse_duration(s).expect(s);
        assert_eq!(ok("10"), Duration::from_secs(10));
        assert_eq!(ok("1.5"), Duration::from_millis(1500));
        assert_eq!(ok("1.5s"), Duration::from_millis(1500));
        assert_eq!(ok("500ms"), Duration::from_millis(500));
        assert_eq!(ok("2m"), Duration::from_secs(120));
        assert_eq!(ok("0"), Duration::ZERO);
        for bad in ["-1", "nonsense", "NaN", "inf", "5x", ""] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }
}
