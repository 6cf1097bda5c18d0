//! The service's Prometheus metrics: one registry, the families it
//! exports, and how each is fed.
//!
//! Three sources, so that no number is invented twice:
//! - the ledger's events, tailed by the scan loop from the head at start:
//!   signals, authorizations written, kills skipped, escapes, sweeps,
//!   orphans, dispatch refusals, spawns (every treewarden process on the
//!   host writes there, so these are host-wide);
//! - the engine's [`EngineStats`]: what the ledger refused to hold
//!   (authorizations failed, write errors, survivors after a forced kill);
//! - this process's own timings: scan and teardown durations, live members.
//!
//! Everything that is a reading rather than a tally is taken once, at scrape
//! time, by `GET /metrics` (the HTTP face's handler): trees by state, dispatch
//! closed, the ledger head seq (host-wide, straight from the ledger), and the
//! catch-up of the [`EngineStats`] and observer counters.
//!
//! Labels are bounded: states, signal names, target kinds, scan modes and
//! teardown origins. Never a tree id or a pid.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use crate::custody::EngineStats;
use crate::ledger::{Event, EventRow, TreeState};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabel {
    pub state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SignalLabels {
    pub signal: String,
    pub target_kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModeLabel {
    pub mode: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OriginLabel {
    pub origin: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CapLabel {
    pub cap: String,
}

type C = Counter<u64, AtomicU64>;

/// Every metric family the service exports.
pub struct Metrics {
    registry: Registry,
    /// `treewarden_trees{state}`: trees in the ledger by state (set at scrape time).
    pub trees: Family<StateLabel, Gauge>,
    /// `treewarden_members`: live members of the trees this service scans.
    pub members: Gauge,
    /// `treewarden_trees_spawned_total`: trees released to exec since start.
    pub trees_spawned: C,
    /// `treewarden_escapes_observed_total`: members found outside their
    /// tree's group and session.
    pub escapes: C,
    /// `treewarden_signals_sent_total{signal,target_kind}`: signals recorded.
    pub signals: Family<SignalLabels, C>,
    /// `treewarden_kill_authorizations_written_total`: committed
    /// `kill.authorized` rows.
    pub authorizations_written: C,
    /// `treewarden_kill_authorizations_failed_total`: authorizations the
    /// ledger refused (each a skipped kill and an ambiguous tree).
    pub authorizations_failed: C,
    /// `treewarden_kills_skipped_total`: forced kills not sent.
    pub kills_skipped: C,
    /// `treewarden_survivors_after_kill_total`: members that outlived every
    /// round of a forced kill.
    pub survivors_after_kill: C,
    /// `treewarden_sweeps_total`: orphan sweeps started.
    pub sweeps: C,
    /// `treewarden_sweep_orphans_total`: orphans the sweeps found.
    pub orphans: C,
    /// `treewarden_scan_duration_seconds{mode}`: the scan loop's ticks.
    pub scan_duration: Family<ModeLabel, Histogram>,
    /// `treewarden_scan_trees_skipped_total`: trees a targeted tick did not
    /// re-read, the observer having seen no change of their members since
    /// their last complete tick (service/scan.rs `quiet_trees`).
    pub scan_skipped: C,
    /// `treewarden_teardown_duration_seconds{origin}`: teardowns this
    /// service ran, from the call to their return.
    pub teardown_duration: Family<OriginLabel, Histogram>,
    /// `treewarden_ledger_write_errors_total`: evidence writes the ledger
    /// refused (logged; authority is counted apart).
    pub ledger_write_errors: C,
    /// `treewarden_scans_incomplete_total`: ticks whose `/proc` or
    /// `cgroup.procs` reads failed for a reason other than the process
    /// being gone (out of descriptors, I/O); nothing was concluded from them.
    pub scans_incomplete: C,
    /// `treewarden_dispatch_closed`: 1 while an unsettled tree closes the
    /// spawn gate.
    pub dispatch_closed: Gauge,
    /// `treewarden_unkillable_tree`: the id of the newest unsettled tree
    /// whose teardown left a member no signal ends (`member.unkillable`),
    /// 0 when none; set at scrape time. Its value names the tree for the
    /// operator's alert (a label would be a tree id).
    pub unkillable_tree: Gauge,
    /// `treewarden_dispatch_refused_total`: spawns refused by the gate.
    pub dispatch_refused: C,
    /// Processes the kernel's OOM killer ended inside trees (`tree.oom_kill`).
    pub oom_kills: C,
    /// Orphans found by this service's sweeps whose teardown has not
    /// finished (queued or running); set at scrape time.
    pub orphans_pending: Gauge,
    /// 1 while the start-up recovery sweep runs; set at scrape time.
    pub recovering: Gauge,
    /// Set only at scrape time, from the ledger's head.
    pub ledger_head_seq: Gauge,
    /// Events committed but not yet acknowledged by every shipping sink
    /// (head minus the lowest cursor, OTLP's and JetStream's); 0 when
    /// shipping never ran. Set only at scrape time, from the ledger.
    pub ship_lag_events: Gauge,
    /// The last seq every shipping sink acknowledged (the lowest cursor).
    pub ship_acked_seq: Gauge,
    /// `treewarden_ship_refused_total`: events the JetStream stream refused
    /// because this ledger does not extend what it holds for the host
    /// (rewound, forked, or a second ledger under one host id), each try.
    pub ship_refused: C,
    /// `treewarden_observer_up`: 1 while the proc-connector observer runs.
    pub observer_up: Gauge,
    /// `treewarden_observer_events_total`: proc-connector events read (after the socket filter).
    pub observer_events: C,
    /// `treewarden_observer_overflows_total`: times the observer lost
    /// events (each followed by a forced full scan).
    pub observer_overflows: C,
    /// `treewarden_observer_forced_scans_total`: full scans forced by overflows.
    pub observer_forced_scans: C,
    /// `treewarden_observer_escapes_total`: escapes the observer recorded.
    pub observer_escapes: C,
    /// `treewarden_held_pidfds`: loose members held by a handle (a pidfd)
    /// now, in all (`custody/holds.rs`); set at scrape time.
    pub held_pidfds: Gauge,
    /// `treewarden_holds_refused_total{cap}`: holds a cap refused (`tree`,
    /// `principal`, `host`); the member was kept by identity and uid.
    pub holds_refused: Family<CapLabel, C>,
    /// `treewarden_http_peers_cut_off_total`: connections cut off (their
    /// descriptors refused, answered 503) because their peer's descriptor
    /// closes piled up (the serving loop's closer); caught up at scrape time.
    pub http_peers_cut_off: C,
}

fn scan_buckets() -> Histogram {
    Histogram::new([
        0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    ])
}

fn teardown_buckets() -> Histogram {
    Histogram::new([
        0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    ])
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    // Over 100 lines on purpose: a flat list, every metric made and then registered under its name
    // and help text (a few lines each); the one list is the /metrics catalogue, and a split would
    // only cut it in two.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("treewarden");
        let m = Metrics {
            registry: Registry::default(),
            trees: Family::default(),
            members: Gauge::default(),
            trees_spawned: C::default(),
            escapes: C::default(),
            signals: Family::default(),
            authorizations_written: C::default(),
            authorizations_failed: C::default(),
            kills_skipped: C::default(),
            survivors_after_kill: C::default(),
            sweeps: C::default(),
            orphans: C::default(),
            scan_duration: Family::new_with_constructor(scan_buckets),
            scan_skipped: C::default(),
            teardown_duration: Family::new_with_constructor(teardown_buckets),
            ledger_write_errors: C::default(),
            scans_incomplete: C::default(),
            dispatch_closed: Gauge::default(),
            unkillable_tree: Gauge::default(),
            dispatch_refused: C::default(),
            oom_kills: C::default(),
            orphans_pending: Gauge::default(),
            recovering: Gauge::default(),
            ledger_head_seq: Gauge::default(),
            ship_lag_events: Gauge::default(),
            ship_acked_seq: Gauge::default(),
            ship_refused: C::default(),
            observer_up: Gauge::default(),
            observer_events: C::default(),
            observer_overflows: C::default(),
            observer_forced_scans: C::default(),
            observer_escapes: C::default(),
            http_peers_cut_off: C::default(),
            held_pidfds: Gauge::default(),
            holds_refused: Family::default(),
        };
        registry.register("trees", "Trees in the ledger by state", m.trees.clone());
        registry.register(
            "members",
            "Live members of the trees this service scans",
            m.members.clone(),
        );
        registry.register(
            "trees_spawned",
            "Trees released to exec (tree.spawned events since start)",
            m.trees_spawned.clone(),
        );
        registry.register(
            "escapes_observed",
            "Members seen outside their tree's group and session",
            m.escapes.clone(),
        );
        registry.register(
            "signals_sent",
            "Signals sent, by signal and target kind",
            m.signals.clone(),
        );
        registry.register(
            "kill_authorizations_written",
            "Kill authorizations committed before a forced kill",
            m.authorizations_written.clone(),
        );
        registry.register(
            "kill_authorizations_failed",
            "Kill authorizations the ledger refused (the kill was skipped)",
            m.authorizations_failed.clone(),
        );
        registry.register(
            "kills_skipped",
            "Forced kills not sent (kill.skipped events)",
            m.kills_skipped.clone(),
        );
        registry.register(
            "survivors_after_kill",
            "Members still alive after the last forced-kill round",
            m.survivors_after_kill.clone(),
        );
        registry.register("sweeps", "Orphan sweeps started", m.sweeps.clone());
        registry.register(
            "sweep_orphans",
            "Trees found orphaned by a sweep",
            m.orphans.clone(),
        );
        registry.register_with_unit(
            "scan_duration",
            "Duration of one scan of the trees this service watches, by mode",
            Unit::Seconds,
            m.scan_duration.clone(),
        );
        registry.register(
            "scan_trees_skipped",
            "Watched trees a targeted scan tick skipped: no change of their members since their last complete tick",
            m.scan_skipped.clone(),
        );
        registry.register_with_unit(
            "teardown_duration",
            "Duration of teardowns run by this service, by origin",
            Unit::Seconds,
            m.teardown_duration.clone(),
        );
        registry.register(
            "ledger_write_errors",
            "Ledger writes that failed (evidence and authority)",
            m.ledger_write_errors.clone(),
        );
        registry.register(
            "scans_incomplete",
            "Scans whose reads failed for a reason other than a process being gone (nothing concluded from them)",
            m.scans_incomplete.clone(),
        );
        registry.register(
            "orphans_pending",
            "Orphans found by this service's sweeps whose teardown has not finished",
            m.orphans_pending.clone(),
        );
        registry.register(
            "recovering",
            "1 while the start-up recovery sweep runs",
            m.recovering.clone(),
        );
        registry.register(
            "dispatch_closed",
            "1 while new work is refused because a tree is unsettled",
            m.dispatch_closed.clone(),
        );
        registry.register(
            "unkillable_tree",
            "Id of the newest unsettled tree with a member that outlived every SIGKILL sent under authorization (member.unkillable); 0 when none",
            m.unkillable_tree.clone(),
        );
        registry.register(
            "dispatch_refused",
            "Spawns refused while dispatch was closed",
            m.dispatch_refused.clone(),
        );
        registry.register(
            "oom_kills",
            "Processes the kernel's OOM killer ended inside trees (tree.oom_kill events)",
            m.oom_kills.clone(),
        );
        registry.register(
            "ledger_head_seq",
            "Sequence number of the newest ledger event",
            m.ledger_head_seq.clone(),
        );
        registry.register(
            "ship_lag_events",
            "Ledger events not yet acknowledged by every shipping sink, OTLP and JetStream (head minus the lowest cursor; 0 when shipping never ran)",
            m.ship_lag_events.clone(),
        );
        registry.register(
            "ship_acked_seq",
            "The last ledger seq every shipping sink acknowledged (the lowest cursor)",
            m.ship_acked_seq.clone(),
        );
        registry.register(
            "ship_refused",
            "Events the JetStream stream refused: this ledger does not extend what the stream holds for its host (rewound, forked, or a second ledger under one host id)",
            m.ship_refused.clone(),
        );
        registry.register(
            "observer_up",
            "1 while the proc-connector observer runs beside the scans, else 0",
            m.observer_up.clone(),
        );
        registry.register(
            "observer_events",
            "Process events received from the kernel's proc connector (those its socket filter passed)",
            m.observer_events.clone(),
        );
        registry.register(
            "observer_overflows",
            "Times the proc connector dropped events (each forces a full scan)",
            m.observer_overflows.clone(),
        );
        registry.register(
            "observer_forced_scans",
            "Full scans forced by an observer overflow",
            m.observer_forced_scans.clone(),
        );
        registry.register(
            "observer_escapes",
            "Escapes the observer recorded the moment they happened",
            m.observer_escapes.clone(),
        );
        registry.register(
            "held_pidfds",
            "Loose members held by a pidfd now (capped per tree, per principal and under the descriptor limit)",
            m.held_pidfds.clone(),
        );
        registry.register(
            "holds_refused",
            "Holds of loose members a cap refused, by cap (the member is kept by identity and uid)",
            m.holds_refused.clone(),
        );
        registry.register(
            "http_peers_cut_off",
            "Connections cut off because their peer's descriptor closes piled up",
            m.http_peers_cut_off.clone(),
        );
        Metrics { registry, ..m }
    }

    /// Brings the observer's families up to date (`None`: it is off).
    pub fn sync_observer(&self, stats: Option<&crate::custody::ObserverStats>) {
        let Some(stats) = stats else {
            self.observer_up.set(0);
            return;
        };
        self.observer_up.set(1);
        catch_up(&self.observer_events, stats.events);
        catch_up(&self.observer_overflows, stats.overflows);
        catch_up(&self.observer_forced_scans, stats.forced_scans);
        catch_up(&self.observer_escapes, stats.escapes_recorded);
    }

    /// Brings the serving loop's tallies up to date: `cut_off`, the
    /// connections cut off since start.
    pub fn sync_http(&self, cut_off: u64) {
        catch_up(&self.http_peers_cut_off, cut_off);
    }

    /// Counts one ledger event into the families fed by events.
    pub fn count_event(&self, e: &EventRow) {
        let counter = match e.event() {
            Event::TreeSpawned(_) => &self.trees_spawned,
            Event::EscapeObserved(_) => &self.escapes,
            Event::SignalSent(s) => &*self.signals.get_or_create(&SignalLabels {
                signal: bounded(s.signal.as_str()).to_string(),
                target_kind: bounded(s.target_kind.as_str()).to_string(),
            }),
            Event::KillAuthorized(_) => &self.authorizations_written,
            Event::KillSkipped(_) => &self.kills_skipped,
            Event::SweepStarted(_) => &self.sweeps,
            Event::SweepOrphanFound(_) => &self.orphans,
            Event::DispatchRefused(_) => &self.dispatch_refused,
            Event::TreeOomKill(o) => {
                self.oom_kills.inc_by(o.oom_kills);
                return;
            }
            _ => return,
        };
        counter.inc();
    }

    /// Brings the held-handle gauge and refusal counters up to date.
    pub fn sync_holds(&self, holds: &crate::custody::Holds) {
        self.held_pidfds
            .set(i64::try_from(holds.held()).unwrap_or(i64::MAX));
        for cap in crate::custody::HoldCap::ALL {
            let c = self.holds_refused.get_or_create(&CapLabel {
                cap: cap.as_str().to_string(),
            });
            catch_up(&c, holds.refused(cap));
        }
    }

    /// Brings the counters fed by [`EngineStats`] up to date.
    pub fn sync_stats(&self, stats: &EngineStats) {
        catch_up(&self.authorizations_failed, stats.authorizations_failed());
        catch_up(&self.ledger_write_errors, stats.ledger_write_errors());
        catch_up(&self.survivors_after_kill, stats.survivors_after_kill());
        catch_up(&self.scans_incomplete, stats.scans_incomplete());
    }

    /// Sets the per-state gauge (every state, zero where none).
    pub fn set_tree_counts(&self, counts: &[(TreeState, u64)]) {
        for state in TreeState::ALL {
            let n = counts
                .iter()
                .find(|(s, _)| *s == state)
                .map(|(_, n)| *n)
                .unwrap_or(0);
            self.trees
                .get_or_create(&StateLabel {
                    state: state.as_str().to_string(),
                })
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    /// The OpenMetrics text exposition.
    pub fn encode_openmetrics(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }

    /// The Prometheus text format (0.0.4): what `promtool check metrics`
    /// and older scrapers read. OpenMetrics names a counter family without
    /// `_total` and adds `# UNIT` and `# EOF`; this spells the family as its
    /// samples are named and drops the two lines 0.0.4 does not have.
    pub fn encode_text(&self) -> Result<String, std::fmt::Error> {
        Ok(openmetrics_to_text(&self.encode_openmetrics()?))
    }
}

/// Raises a counter to a running total kept elsewhere (never lowers it).
fn catch_up(c: &C, now: u64) {
    let have = c.get();
    if now > have {
        c.inc_by(now - have);
    }
}

/// Only the values treewarden writes pass through as label values; anything
/// else (a hand-edited ledger) becomes "other", so label sets stay bounded.
fn bounded(v: &str) -> &str {
    match v {
        "SIGTERM" | "SIGKILL" | "SIGSTOP" | "SIGCONT" | "SIGHUP" | "SIGINT" | "SIGQUIT"
        | "SIGUSR1" | "SIGUSR2" | "group" | "cgroup" | "pid" => v,
        _ => "other",
    }
}

fn openmetrics_to_text(om: &str) -> String {
    let counters: std::collections::HashSet<&str> = om
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(om.len());
    for line in om.lines() {
        if line.starts_with("# UNIT ") || line == "# EOF" {
            continue;
        }
        let fixed = ["# HELP ", "# TYPE "].iter().find_map(|prefix| {
            let rest = line.strip_prefix(prefix)?;
            let (name, tail) = rest.split_once(' ')?;
            counters
                .contains(name)
                .then(|| format!("{prefix}{name}_total {tail}"))
        });
        out.push_str(fixed.as_deref().unwrap_or(line));
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_signal_treewarden_sends_is_its_own_label_and_others_are_other() {
        use crate::proc::Sig;
        for sig in [
            Sig::Term,
            Sig::Kill,
            Sig::Stop,
            Sig::Cont,
            Sig::Int,
            Sig::Hup,
            Sig::Quit,
            Sig::Usr1,
            Sig::Usr2,
        ] {
            assert_eq!(bounded(sig.name()), sig.name());
        }
        assert_eq!(bounded("SIGWINCH"), "other");
    }

    #[test]
    fn counters_are_spelled_with_total_in_the_text_format() {
        let m = Metrics::new();
        m.sweeps.inc();
        let text = m.encode_text().expect("encode");
        assert!(
            text.contains("# TYPE treewarden_sweeps_total counter"),
            "{text}"
        );
        assert!(text.contains("treewarden_sweeps_total 1"), "{text}");
        assert!(!text.contains("# EOF"));
        assert!(!text.contains("# UNIT"));
    }
}
