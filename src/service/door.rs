//! The service's reads for its HTTP face ([`Service::door`]): typed methods
//! keyed by tree id, each one blocking-pool call into the engine and the
//! ledger, returning plain data (ledger rows, or a view struct with public
//! fields). HTTP asks these; it never hands the service a closure over the
//! engine.

use crate::custody::{Host as _, LogFollower, Unsettled};
use crate::ledger::event::TeardownTimeline;
use crate::ledger::hierarchy::ProcessNode;
use crate::ledger::outcome::{Outcome, OutcomeFilter};
use crate::ledger::{
    EventFilter, EventRow, MemberCounts, PageAt, Resources, TokenRow, TreeDetail, TreeFilter,
    TreeId, TreeRow, TreeState,
};

use crate::custody::Engine;

use super::{Service, ServiceError};

/// What `GET /metrics` reads from the ledger at scrape time.
pub struct MetricsReadings {
    /// Trees by state.
    pub counts: Vec<(TreeState, u64)>,
    /// The trees that hold dispatch closed.
    pub unsettled: Vec<Unsettled>,
    /// The newest unkillable tree among them.
    pub unkillable: Option<TreeId>,
    /// The ledger's head (seq, hash).
    pub head: Option<(i64, String)>,
    /// The OTLP sink's acknowledged seq.
    pub shipped: Option<i64>,
}

/// One tree of a [`TreeListView`], with what its row shows.
pub struct ListedTree {
    pub tree: TreeRow,
    /// Its members with no exit recorded, and those seen escaped.
    pub members: MemberCounts,
    /// What it consumed: as recorded for an ended tree, as measured now for
    /// a live one, where known.
    pub resources: Option<Resources>,
    /// Whether its owner is alive (live trees only).
    pub owner_alive: Option<bool>,
    /// How it ended, or that it has not.
    pub outcome: Outcome,
}

/// One page of the dashboard's tree list, with what each row shows.
pub struct TreeListView {
    /// At most the page's size, newest first.
    pub trees: Vec<ListedTree>,
    /// Whether the next page in this direction has anything.
    pub more: bool,
    /// Trees by state, ledger-wide.
    pub counts: Vec<(TreeState, u64)>,
    /// The trees that hold dispatch closed.
    pub unsettled: Vec<Unsettled>,
    /// With an outcome filter, the trees it read to fill the page; `Some`
    /// with [`OUTCOME_SCAN`] when it stopped there (older trees may match).
    pub examined: Option<usize>,
}

/// How many trees one page filtered by outcome reads at most: an outcome is
/// read from each tree's events, not from an index.
pub const OUTCOME_SCAN: usize = 5_000;

/// The dashboard's view of one tree.
pub struct TreePanelView {
    pub detail: TreeDetail,
    /// The tail of its captured output (`None`: none, or empty).
    pub output: Option<String>,
    pub teardown: Option<TeardownTimeline>,
    /// Its process hierarchy, built on the blocking read path (its size is
    /// the tree's to choose).
    pub hierarchy: Vec<ProcessNode>,
    /// How it ended, or that it has not.
    pub outcome: Outcome,
}

impl Service {
    /// The typed reads HTTP asks of the service.
    pub fn door(&self) -> Door {
        Door {
            engine: self.engine.clone(),
        }
    }
}

/// The service's typed reads ([`Service::door`]), each on the blocking pool.
#[derive(Clone)]
pub struct Door {
    engine: Engine,
}

impl Door {
    /// This host's name, as its pages and exports name it.
    pub fn host(&self) -> String {
        crate::proc::host_name()
    }

    /// One tree's row.
    pub async fn tree(&self, id: TreeId) -> Result<Option<TreeRow>, ServiceError> {
        let engine = self.engine.clone();
        super::blocking(move || Ok(engine.ledger().tree(id)?)).await?
    }

    /// One tree with its members, signals and exits; what a live tree
    /// consumed so far, measured now, where none is recorded.
    pub async fn tree_detail(&self, id: TreeId) -> Result<Option<TreeDetail>, ServiceError> {
        let engine = self.engine.clone();
        super::blocking(move || {
            let mut detail = engine.ledger().tree_detail(id)?;
            if let Some(d) = &mut detail
                && d.resources.is_none()
            {
                d.resources = crate::custody::live_resources(&d.tree);
            }
            Ok(detail)
        })
        .await?
    }

    /// Up to `limit` trees of `filter` next to `at`.
    pub async fn tree_page(
        &self,
        filter: TreeFilter,
        at: PageAt,
        limit: usize,
    ) -> Result<Vec<TreeRow>, ServiceError> {
        let engine = self.engine.clone();
        super::blocking(move || Ok(engine.ledger().tree_page(filter, at, limit)?)).await?
    }

    /// The events `filter` selects.
    pub async fn events(&self, filter: EventFilter) -> Result<Vec<EventRow>, ServiceError> {
        let engine = self.engine.clone();
        super::blocking(move || Ok(engine.ledger().events(&filter)?)).await?
    }

    /// The ledger's head: its newest seq and hash.
    pub async fn head(&self) -> Result<Option<(i64, String)>, ServiceError> {
        let engine = self.engine.clone();
        super::blocking(move || Ok(engine.ledger().head()?)).await?
    }

    /// Every API token's row.
    pub async fn tokens(&self) -> Result<Vec<TokenRow>, ServiceError> {
        let engine = self.engine.clone();
        super::blocking(move || Ok(engine.ledger().tokens()?)).await?
    }

    /// The token whose hash is `sha256`.
    pub async fn token_by_hash(&self, sha256: String) -> Result<Option<TokenRow>, ServiceError> {
        let engine = self.engine.clone();
        super::blocking(move || Ok(engine.ledger().token_by_hash(&sha256)?)).await?
    }

    /// The trees that hold dispatch closed.
    pub async fn unsettled(&self) -> Result<Vec<Unsettled>, ServiceError> {
        let engine = self.engine.clone();
        super::blocking(move || Ok(engine.gate().unsettled()?)).await?
    }

    /// A tree's captured output (its last `tail` lines), empty when it has
    /// none; `None` for a tree the ledger does not hold.
    pub async fn tree_log(
        &self,
        id: TreeId,
        tail: Option<usize>,
    ) -> Result<Option<Vec<u8>>, ServiceError> {
        let engine = self.engine.clone();
        super::blocking(move || {
            if engine.ledger().tree(id)?.is_none() {
                return Ok(None);
            }
            let log = crate::custody::read_log(engine.data_dir(), id, tail)
                .map_err(|err| ServiceError::Task(format!("reading the log: {err}")))?;
            Ok(Some(log.unwrap_or_default()))
        })
        .await?
    }

    /// What a tree's captured log holds now, and a follower that hands out
    /// what is written after it (across the cap's collapses); `None` for a
    /// tree the ledger does not hold.
    pub async fn log_follower(
        &self,
        id: TreeId,
        tail: Option<usize>,
    ) -> Result<Option<(Vec<u8>, LogFollower)>, ServiceError> {
        let engine = self.engine.clone();
        super::blocking(move || {
            if engine.ledger().tree(id)?.is_none() {
                return Ok(None);
            }
            let read = |err: std::io::Error| ServiceError::Task(format!("reading the log: {err}"));
            let now = crate::custody::read_log(engine.data_dir(), id, None)
                .map_err(read)?
                .unwrap_or_default();
            let path = crate::custody::log_path(engine.data_dir(), id);
            let follower = LogFollower::after(path, &now).map_err(read)?;
            // What is kept, or its last `tail` lines: cut from the same
            // read the follower starts after, so nothing comes twice.
            let first = match tail {
                Some(n) => crate::custody::last_lines(&now, n).to_vec(),
                None => now,
            };
            Ok(Some((first, follower)))
        })
        .await?
    }

    /// What was written to a followed log since the last poll (empty when
    /// nothing was), and the follower back.
    pub async fn log_poll(
        &self,
        mut follower: LogFollower,
    ) -> Result<(Vec<u8>, LogFollower), ServiceError> {
        super::blocking(move || {
            let new = follower
                .poll()
                .map_err(|err| ServiceError::Task(format!("reading the log: {err}")))?;
            Ok((new, follower))
        })
        .await?
    }

    /// How a settled tree ended, typed (`None` while it runs): the
    /// ledger's one reading of its events ([`Outcome::of`]), as the
    /// dashboard shows it.
    pub async fn settled_outcome(&self, row: TreeRow) -> Result<Option<Outcome>, ServiceError> {
        if !(row.state.is_terminal() || row.state == TreeState::Ambiguous) {
            return Ok(None);
        }
        let engine = self.engine.clone();
        super::blocking(move || {
            Ok(engine
                .ledger()
                .outcomes(std::slice::from_ref(&row))?
                .remove(&row.id))
        })
        .await?
    }

    /// Whether `pid` is a descendant of `ancestor` now (its parent, its
    /// parent's parent, ..., at most 64 generations up): who a socket
    /// client may name as a tree's owner beside itself.
    pub async fn descends_from(&self, pid: i32, ancestor: i32) -> bool {
        super::blocking(move || {
            let mut at = pid;
            for _ in 0..64 {
                let Ok(Some(stat)) = crate::proc::read_stat(at) else {
                    return false;
                };
                if stat.ppid == ancestor {
                    return true;
                }
                if stat.ppid <= 1 {
                    return false;
                }
                at = stat.ppid;
            }
            false
        })
        .await
        .unwrap_or(false)
    }

    /// What `GET /metrics` reads at scrape time.
    pub async fn metrics_readings(&self) -> Result<MetricsReadings, ServiceError> {
        let engine = self.engine.clone();
        super::blocking(move || {
            let counts = engine.ledger().tree_counts()?;
            let unsettled = engine.gate().unsettled()?;
            let unkillable = engine.gate().newest_unkillable(&unsettled);
            let head = engine.ledger().head()?;
            // The lowest cursor of the sinks shipping (OTLP, JetStream): what
            // has not left the host for every one of them.
            let otlp = engine.ledger().ship_cursor(super::ship::SINK)?;
            let nats = engine.ledger().ship_cursor(super::nats::SINK)?;
            let shipped = match (otlp, nats) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            Ok(MetricsReadings {
                counts,
                unsettled,
                unkillable,
                head,
                shipped,
            })
        })
        .await?
    }

    /// One keyset page of at most `size` trees of `filter` next to `at`,
    /// however many trees the ledger holds, with what the list shows of each;
    /// with `outcome`, only the trees it selects (read in batches from `at`,
    /// at most [`OUTCOME_SCAN`] of them).
    pub async fn tree_list(
        &self,
        filter: TreeFilter,
        at: PageAt,
        size: usize,
        outcome: Option<OutcomeFilter>,
    ) -> Result<TreeListView, ServiceError> {
        let engine = self.engine.clone();
        super::blocking(move || {
            let ledger = engine.ledger();
            let (trees, more, examined) = match outcome {
                None => {
                    // One more tells whether the next page in this direction has anything.
                    let mut trees = ledger.tree_page(filter, at, size + 1)?;
                    let more = trees.len() > size;
                    if more {
                        match at {
                            // Read upwards and shown newest first: the extra one is the first.
                            PageAt::After(_) => drop(trees.remove(0)),
                            _ => trees.truncate(size),
                        }
                    }
                    let mut outcomes = ledger.outcomes(&trees)?;
                    let trees: Vec<(TreeRow, Outcome)> = trees
                        .into_iter()
                        .filter_map(|t| Some((outcomes.remove(&t.id)?, t)))
                        .map(|(o, t)| (t, o))
                        .collect();
                    (trees, more, None)
                }
                Some(f) => {
                    let (trees, more, examined) =
                        by_outcome(engine.ledger(), &filter, at, size, f)?;
                    (trees, more, Some(examined))
                }
            };
            // One query for every listed tree's counts, not a full detail read each.
            let ids: Vec<TreeId> = trees.iter().map(|(t, _)| t.id).collect();
            let members = ledger.member_counts(&ids)?;
            let ended: Vec<TreeId> = trees
                .iter()
                .filter(|(t, _)| t.state.is_terminal())
                .map(|(t, _)| t.id)
                .collect();
            let mut used = ledger.ended_resources(&ended)?;
            let host = crate::custody::KernelHost::default();
            let trees = trees
                .into_iter()
                .map(|(tree, outcome)| {
                    let id = tree.id;
                    let live = !tree.state.is_terminal();
                    ListedTree {
                        members: members.get(&id).copied().unwrap_or_default(),
                        resources: used
                            .remove(&id)
                            .or_else(|| crate::custody::live_resources(&tree)),
                        owner_alive: live
                            .then(|| host.still_alive(&(&tree.owner_identity()).into())),
                        outcome,
                        tree,
                    }
                })
                .collect();
            let counts = ledger.tree_counts()?;
            Ok(TreeListView {
                trees,
                more,
                counts,
                unsettled: engine.gate().unsettled()?,
                examined: examined.filter(|n| *n >= OUTCOME_SCAN),
            })
        })
        .await?
    }

    /// One tree as the dashboard shows it, its output's last `output_lines`.
    pub async fn tree_panel(
        &self,
        id: TreeId,
        output_lines: usize,
    ) -> Result<Option<TreePanelView>, ServiceError> {
        let engine = self.engine.clone();
        super::blocking(move || {
            let detail = engine.ledger().tree_detail(id)?;
            let teardown = engine.ledger().teardown_timeline(id)?;
            let output = crate::custody::read_log(engine.data_dir(), id, Some(output_lines))
                .ok()
                .flatten()
                .map(|b| String::from_utf8_lossy(&b).into_owned())
                .filter(|out| !out.is_empty());
            let Some(detail) = detail else {
                return Ok(None);
            };
            let outcome = engine
                .ledger()
                .outcomes(std::slice::from_ref(&detail.tree))?
                .remove(&detail.tree.id)
                .unwrap_or_else(|| Outcome::of(&detail.tree, &[]));
            let hierarchy = detail.hierarchy();
            Ok(Some(TreePanelView {
                detail,
                output,
                teardown,
                hierarchy,
                outcome,
            }))
        })
        .await?
    }
}

/// A page of trees with their outcomes, whether more matched, and how many
/// trees were read to fill it.
type OutcomePage = (Vec<(TreeRow, Outcome)>, bool, usize);

/// The trees of `filter` next to `at` whose outcome `f` selects: batches of
/// the plain page read onwards from `at` until `size + 1` match, the trees
/// run out, or [`OUTCOME_SCAN`] were read. Returns at most `size`, newest
/// first, whether more matched, and how many trees were read.
fn by_outcome(
    ledger: &crate::ledger::Ledger,
    filter: &TreeFilter,
    at: PageAt,
    size: usize,
    f: OutcomeFilter,
) -> Result<OutcomePage, crate::ledger::LedgerError> {
    const BATCH: usize = 200;
    let upwards = matches!(at, PageAt::After(_));
    let mut kept: Vec<(TreeRow, Outcome)> = Vec::new();
    let mut cursor = at;
    let mut examined = 0;
    loop {
        let mut batch = ledger.tree_page(filter.clone(), cursor, BATCH)?;
        if batch.is_empty() {
            break;
        }
        examined += batch.len();
        let full = batch.len() == BATCH;
        // Walked away from `at`: downwards newest first, upwards oldest first.
        if upwards {
            batch.reverse();
        }
        let Some(edge) = batch.last().map(|t| t.id.0) else {
            break;
        };
        let mut outcomes = ledger.outcomes(&batch)?;
        for t in batch {
            if let Some(o) = outcomes.remove(&t.id)
                && o.matches(f)
            {
                kept.push((t, o));
            }
        }
        if kept.len() > size || !full || examined >= OUTCOME_SCAN {
            break;
        }
        cursor = if upwards {
            PageAt::After(edge)
        } else {
            PageAt::Before(edge)
        };
    }
    let more = kept.len() > size;
    kept.truncate(size);
    if upwards {
        kept.reverse();
    }
    Ok((kept, more, examined))
}
