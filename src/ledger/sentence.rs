//! One sentence per event for a reader at 3 a.m. (the dashboard's events,
//! the tree page, `treewarden report`); the JSON stays one click away. Read
//! typed: an event this build does not type shows its JSON.

use super::event::Event;
use super::{EventRow, ExitRecord};

impl EventRow {
    /// This event as one sentence a person reads.
    pub fn sentence(&self) -> String {
        sentence(self)
    }
}

fn sentence(e: &EventRow) -> String {
    fn opt<T: std::fmt::Display>(v: &Option<T>) -> String {
        v.as_ref().map_or_else(|| "-".into(), T::to_string)
    }
    let exit = |v: &Option<ExitRecord>| match v.map(|x| (x.code, x.signal)) {
        Some((_, Some(sig))) => format!("killed by signal {sig}"),
        Some((Some(code), None)) => format!("exit {code}"),
        _ => "no status".into(),
    };
    match e.event() {
        Event::TreeCreated(d) => format!(
            "{} (owner {} {})",
            d.argv.join(" "),
            d.owner.kind,
            d.owner.pid
        ),
        Event::TreeSpawned(d) => {
            format!("root pid {}, pgid {}, sid {}", d.root.pid, d.pgid, d.sid)
        }
        Event::TreeSpawnFailed(d) => format!("exit {}: {}", d.exit_code, d.reason),
        Event::TreeState(d) => format!("{} → {}: {}", d.from, d.to, opt(&d.reason)),
        Event::TreeEnded(d) => format!("{} → {}, root {}", d.from, d.to, exit(&d.exit)),
        Event::TreeResolved(d) => format!("resolved: {}", d.note),
        Event::TreeOomKill(d) => format!(
            "the kernel's OOM killer ended {} process(es) ({} in all)",
            d.oom_kills, d.total
        ),
        Event::TreeHoldsCapped(d) => format!(
            "loose members past {} held handles (the {} cap; {} held) are kept by identity and uid",
            d.limit, d.cap, d.held
        ),
        Event::MemberObserved(d) => format!("pid {}: {}", d.identity.pid, d.cmdline.join(" ")),
        Event::MemberExec(d) => format!(
            "pid {} ran {} (was {})",
            d.identity.pid,
            d.to.argv.join(" "),
            d.from.argv.join(" ")
        ),
        Event::MemberExited(d) => format!(
            "pid {} {} (reaped by {})",
            d.identity.pid,
            exit(&d.exit),
            d.reaped_by
        ),
        Event::EscapeObserved(d) => format!(
            "pid {} left to pgid {} sid {}",
            d.member.identity.pid, d.member.pgid, d.member.sid
        ),
        Event::SignalSent(d) => format!(
            "{} → {} {}: {}",
            d.signal, d.target_kind, d.target, d.result
        ),
        Event::KillAuthorized(d) => {
            let pids: Vec<String> = d
                .targets
                .iter()
                .flat_map(|t| t.identities.iter().map(|i| i.pid.to_string()))
                .collect();
            format!(
                "#{} for pid {}: {}",
                d.authorization,
                pids.join(" "),
                d.reason
            )
        }
        Event::KillSkipped(d) | Event::SweepRefused(d) => d.reason,
        Event::SurvivorsRecorded(d) => format!("{} survivors snapshotted", d.survivors.len()),
        Event::SweepStarted(d) => format!("{} candidates", d.candidates),
        Event::SweepOrphanFound(d) => {
            format!("owner pid {} gone; tree was {}", d.owner.pid, d.state)
        }
        Event::DispatchRefused(d) => format!("tree {} unsettled: {}", d.tree, d.reason),
        Event::KillRequested(d) => format!(
            "kill asked for by {}{}",
            d.by,
            d.grace_ms
                .map(|g| format!(", grace {g} ms"))
                .unwrap_or_default()
        ),
        _ => e.data.to_string(),
    }
}
