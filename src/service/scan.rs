//! The scan loop: the cheap targeted tick over the watched trees, the full
//! `/proc` re-read every `full_scan_interval`, the ledger tail into the
//! metrics, and the observer's start.

use super::*;

impl Service {
    pub(super) async fn scan_loop(self: Arc<Self>) {
        let mut every = tokio::time::interval(self.config.scan_interval);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let first_seq = self.start_seq.load(std::sync::atomic::Ordering::Relaxed);
        let fresh = |after_seq: i64| ScanState {
            host: None,
            relist: false,
            watches: HashMap::new(),
            exits: HashMap::new(),
            last_full: None,
            after_seq,
            quiet: HashMap::new(),
            idle_at: None,
        };
        let mut state = fresh(first_seq);
        let mut tailed = first_seq;
        // `WatchdogSec=`: each completed scan tick says the service lives
        // (a hung blocking pool or ledger stops the pings, and systemd
        // restarts the service; its orphans are then recovered).
        let watchdog = sd_notify::watchdog_enabled().is_some();
        loop {
            tokio::select! {
                _ = self.shutdown.cancelled() => return,
                _ = every.tick() => {}
            }
            if watchdog {
                sd_notify_state(&[sd_notify::NotifyState::Watchdog]);
            }
            let this = self.clone();
            match blocking(move || {
                if !this.idle_tick(&mut state) {
                    // Read before the trees it stands for.
                    let version = this.owned_version.load(std::sync::atomic::Ordering::SeqCst);
                    // Trees being torn down are skipped: the teardown scans them.
                    let wanted: Vec<TreeId> = this
                        .lock_owned()
                        .iter()
                        .filter(|(_, o)| o.lock.try_lock().is_ok())
                        .map(|(id, _)| *id)
                        .collect();
                    this.scan_once(&mut state, &wanted, version);
                }
                state
            })
            .await
            {
                Ok(s) => {
                    tailed = s.after_seq;
                    state = s;
                }
                Err(e) => {
                    // A panicking tick loses its state, not the loop: the
                    // next tick starts over (a full scan; event tailing
                    // resumes where the last good tick left it).
                    tracing::error!(error = %e, "scan task failed; starting the scan state over");
                    state = fresh(tailed);
                }
            }
        }
    }

    /// One scan-loop tick (blocking).
    // Over 100 lines on purpose: one scan tick in its order (watches synced, the host read full,
    // observed or targeted, the quiet trees skipped, every other tree ticked on one index), on one
    // `ScanState`; `forced` and `full`, decided at its start, are used again at its end.
    pub(super) fn scan_once(&self, st: &mut ScanState, wanted: &[TreeId], owned_version: u64) {
        let ledger = self.engine.ledger();
        self.cap_logs(wanted);
        // A set, not the slice: at 2,000 live trees `contains` on the slice
        // made these two lines 8 M comparisons a tick (in a profile of the idle service).
        let wanted_set: HashSet<TreeId> = wanted.iter().copied().collect();
        st.watches.retain(|id, _| wanted_set.contains(id));
        st.quiet.retain(|id, _| wanted_set.contains(id));
        for id in wanted {
            if st.watches.contains_key(id) {
                continue;
            }
            let Ok(Some((tree, members))) = ledger.tree_members(*id) else {
                continue;
            };
            let exclude = HashSet::from([self.me.pid]);
            if let Some(mut w) = TreeWatch::new(&tree, &members, &exclude) {
                w.set_observer(self.observer_handle.clone());
                st.watches.insert(*id, w);
            }
        }
        // The reaper keeps the unclaimed exits (the last 4,096) until they
        // are claimed: each tick reads them as they are now.
        if let Some(reaper) = self.reaper {
            st.exits = reaper.unclaimed().into_iter().collect();
        }
        let started = Instant::now();
        let forced = self
            .force_full
            .swap(false, std::sync::atomic::Ordering::SeqCst);
        let full = forced
            || st
                .last_full
                .is_none_or(|t: Instant| t.elapsed() >= self.config.full_scan_interval);
        // While the observer follows every watched tree and missed nothing
        // (no overflow: that forces a full scan; no member a scan found
        // first), a new member is a fork it attributed: re-reading the
        // members, leaders, cgroup members and the observer's members finds
        // every member a listing would, without listing `/proc`.
        // And each tree's generation, read before any of its pids (one lock
        // for all of them): a change after this read moves it past what
        // this tick records as seen.
        // Before the generations: a move after this read is a new epoch.
        let epoch = self.observer_handle.as_ref().map(|h| h.epoch());
        let (observed, generations) = match self.observer_handle.as_ref() {
            Some(h) if !st.relist && h.healthy() => {
                match h.generations(st.watches.keys().copied()) {
                    Some(g) => (Some(h), g),
                    None => (None, HashMap::new()),
                }
            }
            _ => (None, HashMap::new()),
        };
        let quiet = match observed {
            Some(_) if !full => st.quiet_trees(&generations),
            _ => HashSet::new(),
        };
        let mut reread = Vec::new();
        for (id, w) in &mut st.watches {
            if !quiet.contains(id) {
                reread.extend(w.pids_to_reread());
            }
        }
        if let Some(h) = observed {
            for id in st.watches.keys().filter(|id| !quiet.contains(id)) {
                reread.extend(h.members(*id).into_iter().map(|k| k.pid));
            }
        }
        let host = st.host.get_or_insert_with(HostView::default);
        if full {
            host.full_refresh();
            st.last_full = Some(Instant::now());
        } else if observed.is_some() {
            host.reread(reread);
        } else if !st.watches.is_empty() {
            host.refresh(reread);
        }
        // One index of the host for every tree; each keeps its own
        // exclusions (the owner of one may be a member of another).
        let mut members = 0usize;
        let mut unobserved = 0u64;
        // The full scan's members of each tree, for one `last_seen` write.
        let mut seen = Vec::new();
        members += quiet
            .iter()
            .filter_map(|id| st.quiet.get(id))
            .map(|q| q.members)
            .sum::<usize>();
        // Only trees to tick need the index (at 1,000 quiet trees, building
        // it was most of what an idle tick cost).
        if st.watches.keys().any(|id| !quiet.contains(id)) {
            let index = crate::scan::SnapshotIndex::new(host.snapshot());
            for (id, w) in &mut st.watches {
                if quiet.contains(id) {
                    continue;
                }
                // A full scan of a tree still quiet at its generation: no
                // OOM read unless this tick finds its membership changed.
                if full
                    && st
                        .quiet
                        .get(id)
                        .is_some_and(|q| generations.get(id) == Some(&q.generation))
                {
                    w.expect_unchanged();
                }
                // `last_seen` is bumped below, for every tree in one write.
                let report =
                    w.tick_indexed(&self.engine, &st.exits, host.snapshot(), &index, false);
                if full && report.incomplete.is_none() {
                    seen.push((*id, report.members.iter().map(|m| w.identity(m)).collect()));
                }
                members += report.members.len();
                unobserved += report.unobserved;
                // Quiet from here while its generation stays, if this tick
                // read and wrote all it found (an incomplete read or a
                // refused write is tried again at the next tick).
                match generations.get(id) {
                    Some(&generation)
                        if report.incomplete.is_none() && report.write_errors == 0 =>
                    {
                        st.quiet.insert(
                            *id,
                            Quiet {
                                generation,
                                members: report.members.len(),
                            },
                        );
                    }
                    _ => {
                        st.quiet.remove(id);
                    }
                }
            }
        }
        if !seen.is_empty()
            && let Err(e) = ledger.bump_last_seen(seen)
        {
            // A liveness hint, not evidence: the next full scan tries again.
            self.metrics.ledger_write_errors.inc();
            tracing::warn!(error = %e, "last_seen of the watched trees not bumped");
        }
        if !quiet.is_empty() {
            self.metrics.scan_skipped.inc_by(quiet.len() as u64);
        }
        st.relist = unobserved > 0;
        // Every tree skipped, observed, nothing unattributed: until the
        // epoch or the owned trees move, the next ticks have nothing to do.
        st.idle_at = match (observed, epoch) {
            (Some(_), Some(epoch))
                if !full
                    && unobserved == 0
                    && st.watches.len() == wanted.len()
                    && quiet.len() == st.watches.len() =>
            {
                Some(Idle {
                    owned_version,
                    epoch,
                })
            }
            _ => None,
        };
        if !st.watches.is_empty() || full {
            self.metrics
                .scan_duration
                .get_or_create(&metrics::ModeLabel {
                    mode: if full { "full" } else { "targeted" }.into(),
                })
                .observe(started.elapsed().as_secs_f64());
        }
        self.metrics.members.set(members as i64);
        self.tail_ledger(st);
        // EngineStats and the ledger head are synced at scrape time (GET /metrics).
        if forced && let Some(h) = &self.observer_handle {
            tracing::warn!("forced full scan after observer overflow");
            h.forced_scan_done();
        }
    }

    /// A tick with nothing to do, done in O(1): the last tick skipped every
    /// tree (each quiet at the observer's generation), and since then the
    /// observer's epoch did not move (no watched tree's generation did),
    /// the service owns the same trees, no full scan is due or forced, the
    /// observer is healthy and the log-cap thread caps. At 2,000 quiet
    /// trees the tick's walk over them (the owned map, the watches, the
    /// generations) was a third of idle `serve`'s CPU. It still
    /// counts the skips and tails the ledger.
    fn idle_tick(&self, st: &mut ScanState) -> bool {
        let (Some(at), Some(h)) = (st.idle_at, self.observer_handle.as_ref()) else {
            return false;
        };
        let still = at.owned_version
            == self.owned_version.load(std::sync::atomic::Ordering::SeqCst)
            && at.epoch == h.epoch()
            && h.healthy()
            && !st.relist
            && !self.force_full.load(std::sync::atomic::Ordering::SeqCst)
            && st
                .last_full
                .is_some_and(|t| t.elapsed() < self.config.full_scan_interval)
            && self.log_capping();
        if !still {
            return false;
        }
        let started = Instant::now();
        self.metrics.scan_skipped.inc_by(st.watches.len() as u64);
        if !st.watches.is_empty() {
            self.metrics
                .scan_duration
                .get_or_create(&metrics::ModeLabel {
                    mode: "targeted".into(),
                })
                .observe(started.elapsed().as_secs_f64());
        }
        self.tail_ledger(st);
        true
    }

    /// Whether the log-cap thread caps captured output (else each tick does).
    fn log_capping(&self) -> bool {
        self.log_cap
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .is_some_and(logcap::LogCap::running)
    }

    /// Captured output stays under its cap: capped as it is written by the
    /// log-cap thread; here (one stat per owned tree) only when that thread
    /// does not run.
    fn cap_logs(&self, wanted: &[TreeId]) {
        let capping = self.log_capping();
        for id in wanted.iter().filter(|_| !capping) {
            let path = crate::custody::log_path(self.engine.data_dir(), *id);
            match crate::proc::cap_log(&path, self.config.log_max) {
                Ok(0) => {}
                Ok(dropped) => {
                    tracing::debug!(tree = id.0, dropped, "oldest captured output dropped")
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => tracing::warn!(tree = id.0, error = %e, "captured output not capped"),
            }
        }
    }

    /// Tails the ledger into the event-fed metrics, from where the last
    /// tick left off; a tree another process ended wakes its waiters.
    fn tail_ledger(&self, st: &mut ScanState) {
        loop {
            let filter = EventFilter {
                after_seq: Some(st.after_seq),
                limit: Some(1000),
                ..EventFilter::default()
            };
            match self.engine.ledger().events(&filter) {
                Ok(events) => {
                    let mut ended = false;
                    for e in &events {
                        self.metrics.count_event(e);
                        st.after_seq = e.seq;
                        // A tree another process ended (a `run`, a `kill`,
                        // a sweep): its waiters are woken.
                        ended |= matches!(
                            e.kind,
                            crate::ledger::RowKind::Known(
                                crate::ledger::EventKind::TreeEnded
                                    | crate::ledger::EventKind::TreeState
                                    | crate::ledger::EventKind::TreeResolved
                                    | crate::ledger::EventKind::TreeSpawnFailed
                            )
                        );
                    }
                    if ended {
                        self.note_ended();
                    }
                    if events.len() < 1000 {
                        break;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "tailing the ledger failed");
                    break;
                }
            }
        }
    }
}

/// The scan loop's state, moved into the blocking pool for each tick.
pub(super) struct ScanState {
    pub(super) host: Option<HostView>,
    /// The last tick found members the observer did not know: this one
    /// lists `/proc` (their children are found by descent).
    pub(super) relist: bool,
    pub(super) watches: HashMap<TreeId, TreeWatch>,
    pub(super) exits: HashMap<i32, ExitStatus>,
    pub(super) last_full: Option<Instant>,
    pub(super) after_seq: i64,
    /// Trees whose last tick found everything and wrote it, with the
    /// observer's generation of each then: see [`ScanState::quiet_trees`].
    pub(super) quiet: HashMap<TreeId, Quiet>,
    /// Set by a tick that skipped every tree: see [`Service::idle_tick`].
    pub(super) idle_at: Option<Idle>,
}

/// What an all-quiet tick saw: the owned trees' version and the observer's
/// epoch, both read before it looked at any tree.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Idle {
    owned_version: u64,
    epoch: u64,
}

/// A tree as its last complete tick left it.
pub(super) struct Quiet {
    /// The observer's generation of the tree, read before that tick.
    generation: u64,
    /// Live members that tick found (for the members gauge).
    members: usize,
}

impl ScanState {
    /// The watched trees this targeted tick can skip: the last tick read
    /// each completely at the generation the observer still reports (so no
    /// fork, exec, setsid or exit of a member happened since, and no scan
    /// handed it a member it did not know). Re-reading such a tree's
    /// members would find what the last tick found. What the observer
    /// cannot see (a process moved into the tree's cgroup from outside, a
    /// member's `setpgid` without `setsid`) is found by the next tick that
    /// reads the tree: the full scan (`full_scan_interval`) reads every
    /// tree, and any fork or exit of a member makes it read again
    /// (docs/RESIDUALS.md). A `cgroup.procs` re-read of every quiet tree
    /// between full scans is not done: at 2,000 live trees every 10 s, it
    /// was a ninth of the idle service's CPU.
    fn quiet_trees(&self, generations: &HashMap<TreeId, u64>) -> HashSet<TreeId> {
        self.watches
            .keys()
            .filter(|id| {
                self.quiet
                    .get(id)
                    .is_some_and(|q| generations.get(id) == Some(&q.generation))
            })
            .copied()
            .collect()
    }
}

/// Starts the observer per the configuration
/// ([`crate::custody::policy::start_observer`]); overflows set `force_full`
/// for the scan loop. Returns it and why there is none.
pub(super) fn start_observer(
    engine: &Engine,
    config: &ServiceConfig,
    force_full: Arc<std::sync::atomic::AtomicBool>,
) -> Result<(Option<crate::custody::Observer>, String), ServiceError> {
    let on_overflow = Box::new(move || {
        force_full.store(true, std::sync::atomic::Ordering::SeqCst);
    });
    let started = crate::custody::policy::start_observer(
        engine.ledger(),
        config.observer,
        config.observer_rcvbuf,
        on_overflow,
    )
    .map_err(ServiceError::Invalid)?;
    Ok((started.observer, started.off_because))
}
