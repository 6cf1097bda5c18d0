//! A tree's cgroup limits (as `run` and the API take them, and as the
//! cgroup files they become) and the resources it used.

use serde::{Deserialize, Serialize};

/// Limits set on a tree's cgroup before its command runs (cgroup boundary
/// only; a spawn that asks for one where the host cannot enforce it is
/// refused, never started unlimited). Recorded in `tree.created`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Limits {
    /// `memory.max` in bytes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_max: Option<u64>,
    /// `pids.max`: processes and threads at most.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pids_max: Option<u64>,
    /// `cpu.max` as a percentage of one CPU (200 = two CPUs), like
    /// systemd's `CPUQuota=`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_max_pct: Option<u32>,
}

impl Limits {
    pub fn is_empty(&self) -> bool {
        *self == Limits::default()
    }

    /// The cgroup files and values that set these limits, with the
    /// controller each needs (`memory.max` needs `memory`, ...).
    pub fn cgroup_settings(&self) -> Vec<(&'static str, &'static str, String)> {
        let mut v = Vec::new();
        if let Some(b) = self.memory_max {
            v.push(("memory", "memory.max", b.to_string()));
        }
        if let Some(n) = self.pids_max {
            v.push(("pids", "pids.max", n.to_string()));
        }
        if let Some(p) = self.cpu_max_pct {
            // quota per 100 ms period: 50% of a CPU is 50000 of 100000 us.
            v.push(("cpu", "cpu.max", format!("{} 100000", u64::from(p) * 1000)));
        }
        v
    }
}

/// Parses a size as `--memory-max` and the API take it: bytes, or a
/// number with K, M, G or T (powers of 1024, like systemd's `MemoryMax=`).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, mult) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let mult: u64 = match c.to_ascii_uppercase() {
                'K' => 1 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                'T' => 1 << 40,
                _ => return Err(format!("malformed size {s:?}: the unit is K, M, G or T")),
            };
            (&t[..i], mult)
        }
        _ => (t, 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .filter(|n| *n > 0)
        .ok_or_else(|| {
            format!("malformed size {s:?}: expected bytes or a number with K, M, G or T (64M)")
        })
}

/// Parses a CPU share as `--cpu-max` takes it: `50%` (of one CPU) or `50`.
pub fn parse_cpu_pct(s: &str) -> Result<u32, String> {
    s.trim()
        .trim_end_matches('%')
        .parse::<u32>()
        .ok()
        .filter(|p| (1..=100_000).contains(p))
        .ok_or_else(|| {
            format!(
                "malformed cpu share {s:?}: expected a percentage of one CPU such as 50% or 200%"
            )
        })
}

/// What a tree consumed, from its cgroup (`cpu.stat`, `memory.peak`,
/// `pids.peak`, `io.stat`). A figure the host cannot give (no cgroup on the
/// session boundary, a controller not enabled in the v2 hierarchy) is
/// absent, never zero.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Resources {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_usec: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_peak_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pids_peak: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub io_read_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub io_write_bytes: Option<u64>,
    /// Processes the kernel's OOM killer ended in the tree's cgroup
    /// (`memory.events` `oom_kill`; absent without the memory controller).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oom_kills: Option<u64>,
}

impl Resources {
    /// What is known, for a person: `cpu 12.3 ms, memory peak 4.1 MiB, ...`
    /// (empty when nothing is).
    pub fn summary(&self) -> String {
        let mut parts = Vec::new();
        if let Some(us) = self.cpu_usec {
            parts.push(format!("cpu {:.1} ms", us as f64 / 1000.0));
        }
        if let Some(b) = self.memory_peak_bytes {
            parts.push(format!("memory peak {:.1} MiB", b as f64 / 1048576.0));
        }
        if let Some(p) = self.pids_peak {
            parts.push(format!("pids peak {p}"));
        }
        if let (Some(rd), Some(wr)) = (self.io_read_bytes, self.io_write_bytes) {
            parts.push(format!("io {rd} B read, {wr} B written"));
        }
        if let Some(n) = self.oom_kills.filter(|n| *n > 0) {
            parts.push(format!("{n} OOM kill(s)"));
        }
        parts.join(", ")
    }
}
