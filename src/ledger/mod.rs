//! The write-ahead authority ledger: the only code that knows SQL.
//!
//! One SQLite file (`<data-dir>/ledger.db`, WAL mode) is shared by every
//! treewarden process on the host. In each process one owner thread holds the
//! connection; [`Ledger`] is a cheap, cloneable handle whose methods are typed
//! and blocking: they send a job over a channel and wait for the reply.
//!
//! # Writes
//!
//! Every write is one `BEGIN IMMEDIATE` transaction, so writers in several
//! processes serialise; a write lock held elsewhere for longer than the busy
//! timeout becomes [`LedgerError::Busy`], never an endless wait. Rows that
//! release a spawn ([`Ledger::create_tree`], [`Ledger::tree_spawned`]) or
//! authorize a kill ([`Ledger::authorize_kill`]) commit with
//! `synchronous=FULL` (the WAL is fsynced before the call returns); the rest
//! use `NORMAL` (crash-safe, but a power loss may drop the newest commits).
//!
//! Invariants are enforced by the database itself (`migrations/0001_init.sql`):
//! a SIGKILL signal row must cite a kill authorization of the same tree; events,
//! observations, signals and kill authorizations are append-only; a tree never
//! leaves a terminal state; only an ambiguous tree is resolved. A refusal
//! surfaces as [`LedgerError::Invariant`]. This module must never work around
//! them (no `PRAGMA writable_schema`, no dropping triggers).
//!
//! # The hash chain
//!
//! Every write transaction that records an audit fact appends its event(s)
//! to `events` in the same transaction (bookkeeping writes append none). `seq` is gapless from 1. For each event:
//!
//! ```text
//! canonical = canonical JSON of the array [seq, at, tree, kind, data]
//! hash      = lowercase_hex(sha256(prev_hash || canonical))
//! ```
//!
//! where `prev_hash` enters as its 64 ASCII hex characters (the previous
//! event's `hash`; 64 `0`s for seq 1), `seq` is a JSON integer, `at` the
//! RFC 3339 UTC timestamp string with milliseconds (`2024-05-01T12:00:00.123Z`),
//! `tree` an integer or `null`, `kind` a string, and `data` a JSON object.
//! *Canonical JSON* means: no whitespace; object keys sorted by their UTF-8
//! bytes; strings escaped as serde_json does (`"` `\` and control characters
//! only; `\n \r \t \b \f` short forms, other controls `\u00XX` lowercase; no
//! escaping of `/` or non-ASCII); numbers as serde_json prints them (integers
//! in decimal; the ledger's own events carry no floats, and callers of
//! [`Ledger::append_event`] should not either, since float spelling differs
//! between JSON libraries). `data` is stored in this canonical form, so an external tool
//! can recompute every hash from an NDJSON export alone, e.g. in Python
//! (checked against exports with escapes, non-ASCII and nested objects):
//!
//! ```text
//! c = json.dumps([e["seq"], e["at"], e["tree"], e["kind"], e["data"]],
//!                separators=(",", ":"), sort_keys=True, ensure_ascii=False)
//! assert e["hash"] == sha256((prev_hash + c).encode()).hexdigest()
//! ```
//!
//! The chain shows edits, deletions and reorderings, but not that its newest
//! events were cut off: after each commit the head is logged at info level
//! (target `treewarden::ledger::head`: `ledger head seq=N hash=H`), and
//! [`Ledger::verify`] checks against a head published elsewhere.
//!
//! A chain rewritten from some point with fresh hashes is internally
//! consistent; forward-secure seals (`seal.rs`) make such a
//! rewrite of anything sealed before the attacker arrived fail
//! [`Ledger::verify_sealed`]: `ledger.seal` events MACed with a key that
//! evolves one way each epoch, checked with the key `seal setup` printed.

mod bound;
mod chain;
mod db;
mod error;
pub mod event;
mod evidence;
mod export;
pub mod fleet;
pub(crate) mod fsmode;
pub mod hierarchy;
mod ocsf;
pub mod outcome;
mod projection;
mod prune;
mod read;
pub mod seal;
mod sentence;
mod sqlvalue;
mod types;
mod verify;
mod write;

use std::io::Write;

use rusqlite::OptionalExtension;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

pub use bound::FIELD_MAX;
pub use chain::{GENESIS, canonical_event, canonical_string, event_hash, event_hash_of_text};
pub use error::LedgerError;
pub use event::{Event, RowKind};
pub use evidence::{DEFAULT_EVIDENCE_MAX, EVIDENCE_MARGIN};
pub use export::file_name as export_file_name;
pub use ocsf::{OCSF_VERSION, OcsfCounts};
pub use prune::{PruneReport, PruneRequest};
pub use types::{
    AuthorizationId, AuthorizationRow, BoundaryKind, Deferred, EpochSeal, EventFilter, EventKind,
    EventRow, EventSearch, ExitRecord, ExportFormat, IdentityRecord, KillTarget, Limits,
    MemberCounts, MemberRecord, MemberRow, NewTree, ObservationRow, OnBehalfRecord, OwnerId,
    OwnerKind, OwnerRecord, OwnerRow, PageAt, Requester, Resources, SealData, SealReport,
    SealSetup, SignalName, SignalRecord, SignalResult, SignalRow, SpawnRecord, SurvivorRecord,
    TargetKind, TokenRow, TokenScope, TreeDetail, TreeFilter, TreeFlag, TreeId, TreeOwner, TreeRow,
    TreeState, VerifyBreak, VerifyReport, parse_cpu_pct, parse_since, parse_size,
};

use db::Durability;

/// A time as the ledger writes it (RFC 3339, UTC, milliseconds).
pub fn timestamp(t: std::time::SystemTime) -> String {
    humantime::format_rfc3339_millis(t).to_string()
}

/// How to open the ledger.
#[derive(Clone, Copy, Debug)]
pub struct LedgerOptions {
    /// How long a write waits for another connection's write lock before it
    /// fails with [`LedgerError::Busy`].
    pub busy_timeout: Duration,
    /// Bytes preallocated for the WAL at open (see `db::reserve_wal`): room
    /// no other writer on the filesystem can take, so authorizations still
    /// commit on a disk someone else filled. 0: none.
    pub reserve: u64,
}

/// The default [`LedgerOptions::reserve`]: about 2,000 WAL pages, hundreds
/// of teardowns' authorizations.
pub const DEFAULT_RESERVE: u64 = 8 << 20;

impl Default for LedgerOptions {
    fn default() -> Self {
        Self {
            busy_timeout: Duration::from_secs(2),
            reserve: DEFAULT_RESERVE,
        }
    }
}

impl LedgerOptions {
    pub fn from_config(config: &crate::config::Config) -> Self {
        Self {
            busy_timeout: config.busy_timeout,
            reserve: config.ledger_reserve,
        }
    }
}

/// A cheap handle to the ledger's owner thread. Clones share the thread; the
/// connection closes when the last clone is dropped.
#[derive(Clone)]
pub struct Ledger {
    handle: Arc<db::Handle>,
    /// The evidence bounds: the per-tree budget, and the free-space floor
    /// that keeps the reserve for authority (`evidence.rs`).
    evidence: Arc<evidence::Gate>,
    /// The directory of the ledger's file: the data dir, where the seal
    /// key file is (a sealed ledger's export seals its trailer with it).
    dir: Arc<std::path::PathBuf>,
}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ledger").finish_non_exhaustive()
    }
}

/// A fresh batch name for a replay of deferred writes (`deferred_batch` in
/// each replayed event's data, so a replay is never written twice): the time
/// and this process, unique enough for one tree's journal (hex).
pub fn new_batch() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!("{nanos:x}-{:x}", std::process::id())
}

impl Ledger {
    /// Opens the ledger at `path`, creating the file and its parent directory
    /// if needed, in WAL mode with foreign keys on, and applies migrations.
    pub fn open(path: &Path, opts: LedgerOptions) -> Result<Ledger, LedgerError> {
        Self::open_as(path, opts, "ledger")
    }

    /// [`Ledger::open`], its owner thread named `thread` (at most 15
    /// bytes show): a second handle kept for one job (the JetStream
    /// shipper's `ledger-ship`), so its cost can be told from custody's.
    pub fn open_as(path: &Path, opts: LedgerOptions, thread: &str) -> Result<Ledger, LedgerError> {
        let dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."))
            .to_path_buf();
        Ok(Ledger {
            handle: db::start_in(
                path,
                opts.busy_timeout,
                opts.reserve,
                db::DirRule::DataDir,
                thread,
            )?,
            evidence: Arc::new(evidence::Gate::new(dir.clone(), opts.reserve)),
            dir: Arc::new(dir),
        })
    }

    /// Opens a copy the caller named (a backup's file), to read and verify
    /// it: unlike [`Ledger::open`] its directory is not made or held to the
    /// data dir's privacy rule (a backup into `/tmp` is the caller's
    /// choice), and no WAL room is reserved. The file itself must exist.
    pub fn open_copy(path: &Path, busy_timeout: Duration) -> Result<Ledger, LedgerError> {
        if !path.is_file() {
            return Err(LedgerError::Other(format!(
                "{}: no such ledger file",
                path.display()
            )));
        }
        let dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."))
            .to_path_buf();
        Ok(Ledger {
            handle: db::start_in(path, busy_timeout, 0, db::DirRule::AsIs, "ledger")?,
            evidence: Arc::new(evidence::Gate::new(dir.clone(), 0)),
            dir: Arc::new(dir),
        })
    }

    /// Sets the evidence budget of each tree (bytes of its members' command
    /// lines, exe and cwd as stored; past it, argv by digest: see
    /// `evidence.rs`). Every clone of this ledger shares it.
    pub fn set_evidence_budget(&self, bytes: u64) {
        self.evidence.set_budget(bytes);
    }

    /// Runs an evidence write (see `evidence.rs`): refused with
    /// [`LedgerError::Full`] while the ledger's filesystem is under the
    /// floor that keeps the reserve for authority; the tree is then flagged
    /// [`TreeFlag::EvidenceDropped`] once.
    fn evidence_write<T: Send + 'static>(
        &self,
        tree: Option<TreeId>,
        f: impl FnOnce(&mut db::Writer<'_>, u64) -> Result<T, error::Fail> + Send + 'static,
    ) -> Result<T, LedgerError> {
        if let Err(refused) = self.evidence.admit(tree) {
            if let Some(t) = refused.flag
                && let Err(e) = self.add_flag(t, TreeFlag::EvidenceDropped)
            {
                tracing::debug!(tree = t.0, error = %e, "the evidence-dropped flag was not written");
            }
            return Err(refused.error);
        }
        let budget = self.evidence.budget();
        self.write_normal(move |w| f(w, budget))
    }

    fn write<T: Send + 'static>(
        &self,
        durability: Durability,
        f: impl FnOnce(&mut db::Writer<'_>) -> Result<T, error::Fail> + Send + 'static,
    ) -> Result<T, LedgerError> {
        self.handle.call(move |store| store.write(durability, f))
    }

    /// [`Ledger::write`] at [`Durability::Normal`].
    fn write_normal<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut db::Writer<'_>) -> Result<T, error::Fail> + Send + 'static,
    ) -> Result<T, LedgerError> {
        self.write(Durability::Normal, f)
    }

    fn read<T: Send + 'static>(
        &self,
        f: impl FnOnce(&rusqlite::Transaction<'_>) -> Result<T, error::Fail> + Send + 'static,
    ) -> Result<T, LedgerError> {
        self.handle.call(move |store| store.read(f))
    }

    /// The ledger's instance id (32 hex digits), made once with the ledger:
    /// names this ledger gives outside itself (per-tree cgroups) carry it so
    /// that two ledgers on one host never pick the same name.
    pub fn instance_id(&self) -> Result<String, LedgerError> {
        self.read(|tx| read::instance_id(tx))
    }

    /// The owner row for this identity and kind, created if it is new.
    pub fn register_owner(&self, owner: &OwnerRecord) -> Result<OwnerId, LedgerError> {
        let owner = owner.clone();
        self.write_normal(move |w| write::register_owner(w, &owner))
    }

    /// [`Ledger::register_owner`] and [`Ledger::create_tree_for`] in one
    /// transaction (FULL): a spawn's first records in one commit, not two
    /// (`tree.owner` is replaced by the owner's id).
    pub fn create_tree_with_owner(
        &self,
        owner: &OwnerRecord,
        tree: &NewTree,
        on_behalf: Option<&OnBehalfRecord>,
    ) -> Result<TreeId, LedgerError> {
        let owner = owner.clone();
        let mut tree = tree.clone();
        let on_behalf = on_behalf.cloned();
        self.write(Durability::Full, move |w| {
            tree.owner = write::register_owner(w, &owner)?;
            write::create_tree(w, &tree, on_behalf.as_ref())
        })
    }

    /// Commits a tree in state `spawning` (FULL) with a `tree.created` event.
    pub fn create_tree(&self, tree: &NewTree) -> Result<TreeId, LedgerError> {
        self.create_tree_for(tree, None)
    }

    /// [`Ledger::create_tree`], recording who asked and as whom the tree
    /// runs (`requester_uid`, `requested_by`, `run_uid`, `run_gid`, and
    /// `by` in `tree.created`).
    pub fn create_tree_for(
        &self,
        tree: &NewTree,
        on_behalf: Option<&OnBehalfRecord>,
    ) -> Result<TreeId, LedgerError> {
        let tree = tree.clone();
        let on_behalf = on_behalf.cloned();
        self.write(Durability::Full, move |w| {
            write::create_tree(w, &tree, on_behalf.as_ref())
        })
    }

    /// A new API token: only its SHA-256 (64 hex digits) is kept. Event
    /// `token.created`. Returns its id.
    pub fn create_token(
        &self,
        name: &str,
        scope: TokenScope,
        sha256: &str,
        by: &Requester,
    ) -> Result<i64, LedgerError> {
        let (name, sha256, by) = (name.to_string(), sha256.to_string(), by.clone());
        self.write(Durability::Full, move |w| {
            write::create_token(w, &name, scope, &sha256, &by)
        })
    }

    /// The token file's secret as an admin token named `name`, added once;
    /// a live token of that name with another hash (a replaced file) is
    /// revoked. Returns the token's id.
    pub fn import_token(
        &self,
        name: &str,
        sha256: &str,
        by: &Requester,
    ) -> Result<i64, LedgerError> {
        let (name, sha256, by) = (name.to_string(), sha256.to_string(), by.clone());
        self.write(Durability::Full, move |w| {
            write::import_token(w, &name, &sha256, &by)
        })
    }

    /// Revokes a token, at once for every reader of this ledger (event
    /// `token.revoked`); `false` when it was already revoked.
    pub fn revoke_token(&self, id: i64, by: &Requester) -> Result<bool, LedgerError> {
        let by = by.clone();
        self.write(Durability::Full, move |w| write::revoke_token(w, id, &by))
    }

    /// Every token (never a secret), oldest first.
    pub fn tokens(&self) -> Result<Vec<TokenRow>, LedgerError> {
        self.read(|tx| read::tokens(tx))
    }

    /// The live token whose SHA-256 is `sha256`.
    pub fn token_by_hash(&self, sha256: &str) -> Result<Option<TokenRow>, LedgerError> {
        let sha256 = sha256.to_string();
        self.read(move |tx| read::token_by_hash(tx, &sha256))
    }

    /// Records what the spawn formed; state `running`, event `tree.spawned`.
    /// Commits with FULL: this commit is what releases the child to exec.
    pub fn tree_spawned(&self, id: TreeId, spawn: &SpawnRecord) -> Result<(), LedgerError> {
        let spawn = spawn.clone();
        self.write(Durability::Full, move |w| {
            write::tree_spawned(w, id, &spawn)
        })
    }

    /// The spawn failed; state `spawn_failed`, event `tree.spawn_failed`.
    pub fn tree_spawn_failed(
        &self,
        id: TreeId,
        reason: &str,
        exit_code: i32,
    ) -> Result<(), LedgerError> {
        let reason = reason.to_string();
        self.write_normal(move |w| write::tree_spawn_failed(w, id, &reason, exit_code))
    }

    /// Records a scan's members. First sightings insert the row and emit one
    /// `member.observed` each (returned); later ones only bump `last_seen`.
    pub fn observe_members(
        &self,
        id: TreeId,
        members: &[MemberRecord],
    ) -> Result<Vec<IdentityRecord>, LedgerError> {
        let members = members.to_vec();
        self.evidence_write(Some(id), move |w, budget| {
            write::observe_members(w, id, &members, budget)
        })
    }

    /// Bumps `last_seen` of the named live members of many trees in one
    /// write (see [`write::bump_last_seen`]); no event. Returns how many
    /// rows were bumped.
    pub fn bump_last_seen(
        &self,
        seen: Vec<(TreeId, Vec<IdentityRecord>)>,
    ) -> Result<usize, LedgerError> {
        self.evidence_write(None, move |w, _| write::bump_last_seen(w, &seen))
    }

    /// Updates what known members run now (exe, argv) after an exec: a
    /// member first seen between its fork and its exec would otherwise show
    /// its parent's command line. Rows only; the events keep the first sighting.
    pub fn refresh_members(&self, id: TreeId, members: &[MemberRecord]) -> Result<(), LedgerError> {
        let members = members.to_vec();
        self.evidence_write(Some(id), move |w, budget| {
            write::refresh_members(w, id, &members, budget)
        })
    }

    /// Records an escape once per identity (observation + `escape.observed`);
    /// returns whether it was new. Never erased.
    pub fn record_escape(
        &self,
        id: TreeId,
        member: &MemberRecord,
        reason: &str,
    ) -> Result<bool, LedgerError> {
        let member = member.clone();
        let reason = reason.to_string();
        // Not refused under the floor (an escapee is a target of the next
        // teardown's signals), but budgeted as members are.
        let budget = self.evidence.budget();
        self.write_normal(move |w| write::record_escape(w, id, &member, &reason, budget))
    }

    /// Records exits (observation + `member.exited`, once per identity).
    /// An exit with a status says `"reaped_by": "treewarden"`; one without
    /// says who reaped it instead (`unknown_reaper`: "parent", "init"), so
    /// an unknowable status is never a bare `null`.
    pub fn record_exits(
        &self,
        id: TreeId,
        exits: &[(IdentityRecord, Option<ExitRecord>)],
        unknown_reaper: &'static str,
    ) -> Result<(), LedgerError> {
        let exits = exits.to_vec();
        self.evidence_write(Some(id), move |w, _| {
            write::record_exits(w, id, &exits, unknown_reaper)
        })
    }

    /// Moves the tree to `to` (event `tree.state {from,to,reason}`) and returns
    /// the state it left. Same state: no write. Leaving a terminal state: `Invariant`.
    pub fn set_state(
        &self,
        id: TreeId,
        to: TreeState,
        reason: Option<&str>,
    ) -> Result<TreeState, LedgerError> {
        let reason = reason.map(str::to_string);
        self.write_normal(move |w| write::set_state(w, id, to, reason.as_deref()))
    }

    /// Forensic snapshot of the survivors before a forced kill (observations
    /// + one `survivors.recorded` event).
    pub fn record_survivors(
        &self,
        id: TreeId,
        survivors: &[SurvivorRecord],
        taken_at: std::time::SystemTime,
    ) -> Result<(), LedgerError> {
        let survivors = survivors.to_vec();
        let taken_at = humantime::format_rfc3339_millis(taken_at).to_string();
        self.write_normal(move |w| write::record_survivors(w, id, &survivors, &taken_at))
    }

    /// Commits (FULL) the authority for a forced kill of these targets, with
    /// its `kill.authorized` event. Only after this returns may SIGKILL be sent.
    pub fn authorize_kill(
        &self,
        id: TreeId,
        targets: &[KillTarget],
        reason: &str,
    ) -> Result<AuthorizationId, LedgerError> {
        let targets = targets.to_vec();
        let reason = reason.to_string();
        self.write(Durability::Full, move |w| {
            write::authorize_kill(w, id, &targets, &reason)
        })
    }

    /// [`Ledger::authorize_kill`], with the survivor snapshot it rests on
    /// (taken at `taken_at`, while frozen) written in the same FULL
    /// transaction, just before it: one commit, and the chain shows the
    /// evidence ahead of the authority.
    ///
    /// `prior` is the evidence this teardown could not write before (a
    /// ledger that refused writes, then took them again): it goes first in
    /// the same transaction, so the chain keeps the order things happened
    /// in (its state changes and SIGTERM before the authority).
    ///
    /// `then` is the state the tree takes with the authorization (`killing`,
    /// in a teardown's first round), written right after it in the same
    /// transaction, unless the tree is terminal by then: nothing is
    /// written between an authorization and its SIGKILL.
    #[allow(clippy::too_many_arguments)]
    pub fn authorize_kill_after_snapshot(
        &self,
        id: TreeId,
        prior: &[Deferred],
        survivors: &[SurvivorRecord],
        taken_at: std::time::SystemTime,
        targets: &[KillTarget],
        reason: &str,
        then: Option<TreeState>,
    ) -> Result<AuthorizationId, LedgerError> {
        let prior = prior.to_vec();
        let batch = new_batch();
        let survivors = survivors.to_vec();
        let taken_at = humantime::format_rfc3339_millis(taken_at).to_string();
        let targets = targets.to_vec();
        let reason = reason.to_string();
        let auth = self.write(Durability::Authority, move |w| {
            if !prior.is_empty() {
                write::replay_deferred(w, id, &prior, &batch)?;
            }
            write::record_survivors(w, id, &survivors, &taken_at)?;
            let auth = write::authorize_kill(w, id, &targets, &reason)?;
            if let Some(to) = then {
                write::apply_deferred(
                    w,
                    id,
                    &Deferred::State {
                        to,
                        reason: Some(reason.clone()),
                        at: w.now.clone(),
                    },
                )?;
            }
            Ok(auth)
        })?;
        // The authorization is committed; its SIGKILL is the caller's next step.
        Ok(auth)
    }

    /// Records a sent signal (`signal.sent`); returns the signal row id. The
    /// database refuses a SIGKILL without an authorization of this tree.
    pub fn record_signal(&self, id: TreeId, signal: &SignalRecord) -> Result<i64, LedgerError> {
        let signal = signal.clone();
        self.write_normal(move |w| write::record_signal(w, id, &signal))
    }

    /// Records a teardown step's signals in one transaction (one
    /// `signal.sent` each). All or nothing: the database refuses a SIGKILL
    /// without an authorization of this tree, and then none is written.
    pub fn record_signals(&self, id: TreeId, signals: &[SignalRecord]) -> Result<(), LedgerError> {
        let signals = signals.to_vec();
        self.write_normal(move |w| write::record_signals(w, id, &signals))
    }

    /// Records the exit (observation + `member.exited`) of every member not
    /// yet recorded as exited, with the statuses given by pid; returns how
    /// many. One transaction, and no member list read back into memory.
    pub fn record_remaining_exits(
        &self,
        id: TreeId,
        statuses: &[(i32, ExitRecord)],
        unknown_reaper: &'static str,
    ) -> Result<usize, LedgerError> {
        let statuses = statuses.to_vec();
        self.write_normal(move |w| write::record_remaining_exits(w, id, &statuses, unknown_reaper))
    }

    /// A forced kill was not sent (event `kill.skipped`).
    pub fn kill_skipped(&self, id: TreeId, reason: &str) -> Result<(), LedgerError> {
        let reason = reason.to_string();
        self.write_normal(move |w| write::kill_skipped(w, id, &reason))
    }

    /// Ends the tree as `ended` or `vanished` (event `tree.ended`).
    pub fn end_tree(
        &self,
        id: TreeId,
        state: TreeState,
        exit: Option<ExitRecord>,
    ) -> Result<(), LedgerError> {
        self.end_tree_with(id, state, exit, None)
    }

    /// [`Ledger::end_tree`] with what the tree consumed (`resources` in
    /// the `tree.ended` data).
    pub fn end_tree_with(
        &self,
        id: TreeId,
        state: TreeState,
        exit: Option<ExitRecord>,
        resources: Option<Resources>,
    ) -> Result<(), LedgerError> {
        self.write_normal(move |w| write::end_tree(w, id, state, exit, resources))
    }

    /// An operator's resolution of an ambiguous tree (event `tree.resolved`).
    pub fn resolve(
        &self,
        id: TreeId,
        note: &str,
        left_alive: &[IdentityRecord],
        by: Option<&Requester>,
    ) -> Result<(), LedgerError> {
        let note = note.to_string();
        let left_alive = left_alive.to_vec();
        let by = by.cloned();
        self.write_normal(move |w| write::resolve(w, id, &note, &left_alive, by.as_ref()))
    }

    /// Makes one evidence write described by a [`Deferred`] (used at once
    /// by a teardown; what the ledger refuses is kept and replayed later).
    pub fn apply_deferred(&self, id: TreeId, d: &Deferred) -> Result<(), LedgerError> {
        let d = d.clone();
        self.write_normal(move |w| write::apply_deferred(w, id, &d))
    }

    /// Writes evidence a teardown could not write when it happened, in
    /// order, in one transaction (each event with `deferred_from`).
    /// `batch` names the list: it is written into each event, and a batch
    /// the ledger already holds is not written again.
    pub fn replay_deferred(
        &self,
        id: TreeId,
        list: &[Deferred],
        batch: &str,
    ) -> Result<(), LedgerError> {
        let list = list.to_vec();
        let batch = batch.to_string();
        self.write_normal(move |w| write::replay_deferred(w, id, &list, &batch))
    }

    /// Adds a flag to the tree (idempotent); returns whether it was new.
    pub fn add_flag(&self, id: TreeId, flag: impl Into<TreeFlag>) -> Result<bool, LedgerError> {
        let flag = flag.into();
        self.write_normal(move |w| write::add_flag(w, id, &flag))
    }

    /// Flags the tree `holds_capped` and writes its `tree.holds_capped`
    /// event, once (`custody/holds.rs`); whether it was new.
    pub fn holds_capped(&self, id: TreeId, data: event::HoldsCapped) -> Result<bool, LedgerError> {
        self.write_normal(move |w| write::holds_capped(w, id, &data))
    }

    /// Appends a free-standing event (`sweep.*`, `dispatch.refused`): kinds
    /// with rows of their own are written only by their typed method.
    /// `data` must be a JSON object. Returns the event's seq.
    pub fn append_event(&self, tree: Option<TreeId>, event: Event) -> Result<i64, LedgerError> {
        self.write_normal(move |w| write::append_event(w, tree, &event))
    }

    /// Records one scan's cost and findings (no event).
    pub fn record_scan(
        &self,
        tree: Option<TreeId>,
        duration: Duration,
        processes: usize,
        members: usize,
        escapes: usize,
    ) -> Result<(), LedgerError> {
        self.evidence_write(tree, move |w, _| {
            write::record_scan(w, tree, duration, processes, members, escapes)
        })
    }

    pub fn tree(&self, id: TreeId) -> Result<Option<TreeRow>, LedgerError> {
        self.read(move |tx| read::tree(tx, id))
    }

    /// The first teardown of a tree, step by step, from its events (`None`:
    /// none has started).
    pub fn teardown_timeline(
        &self,
        id: TreeId,
    ) -> Result<Option<event::TeardownTimeline>, LedgerError> {
        let events = self.events(&EventFilter {
            tree: Some(id),
            ..EventFilter::default()
        })?;
        Ok(event::TeardownTimeline::from_events(&events))
    }

    pub fn tree_detail(&self, id: TreeId) -> Result<Option<TreeDetail>, LedgerError> {
        self.read(move |tx| read::tree_detail(tx, id))
    }

    /// A tree's row and its members only: what a teardown or a scan needs to
    /// pick a tree up, without the events, signals and observations
    /// [`Ledger::tree_detail`] also reads (a 1,000-member tree has thousands).
    pub fn tree_members(
        &self,
        id: TreeId,
    ) -> Result<Option<(TreeRow, Vec<MemberRow>)>, LedgerError> {
        self.read(move |tx| {
            let Some(tree) = read::tree(tx, id)? else {
                return Ok(None);
            };
            Ok(Some((tree, read::members(tx, id)?)))
        })
    }

    /// Live and escaped member counts of each of `ids`, in one query and
    /// one snapshot; trees with no member rows are left out. What a tree
    /// list needs without reading each tree's detail.
    pub fn member_counts(
        &self,
        ids: &[TreeId],
    ) -> Result<std::collections::HashMap<TreeId, MemberCounts>, LedgerError> {
        let ids = ids.to_vec();
        self.read(move |tx| Ok(read::member_counts(tx, &ids)?.into_iter().collect()))
    }

    /// One page of trees, newest first (keyset: the `limit` ids right below
    /// or right above a bound), filtered by state and exact label.
    pub fn tree_page(
        &self,
        filter: TreeFilter,
        at: PageAt,
        limit: usize,
    ) -> Result<Vec<TreeRow>, LedgerError> {
        self.read(move |tx| read::tree_page(tx, &filter, at, limit))
    }

    /// The sum of the `cpu_usec` the tree's `member.exited` events carry
    /// (the exits this process reaped, with their rusage; `None` when none
    /// carries one), and whether the exit of the pid `root` is among them.
    pub fn reaped_cpu_usec(
        &self,
        id: TreeId,
        root: Option<i32>,
    ) -> Result<(Option<u64>, bool), LedgerError> {
        self.read(move |tx| read::reaped_cpu_usec(tx, id, root))
    }

    /// How each of `trees` ended (or that it has not), read from its
    /// events in one snapshot ([`outcome::Outcome::of`]).
    pub fn outcomes(
        &self,
        trees: &[TreeRow],
    ) -> Result<std::collections::HashMap<TreeId, outcome::Outcome>, LedgerError> {
        let ids: Vec<TreeId> = trees.iter().map(|t| t.id).collect();
        let events = self.read(move |tx| read::outcome_events(tx, &ids))?;
        Ok(trees
            .iter()
            .zip(events)
            .map(|(t, (id, evs))| (id, outcome::Outcome::of(t, &evs)))
            .collect())
    }

    /// What each of `ids` that has ended consumed (from its `tree.ended`).
    pub fn ended_resources(
        &self,
        ids: &[TreeId],
    ) -> Result<std::collections::HashMap<TreeId, Resources>, LedgerError> {
        let ids = ids.to_vec();
        self.read(move |tx| Ok(read::ended_resources(tx, &ids)?.into_iter().collect()))
    }

    /// Live (non-terminal) trees, or every tree with `all`.
    pub fn list_trees(&self, all: bool) -> Result<Vec<TreeRow>, LedgerError> {
        if all {
            self.read(|tx| read::trees(tx, None))
        } else {
            self.nonterminal_trees()
        }
    }

    /// Directories holding this ledger's per-tree cgroups named
    /// `<prefix>-<tree id>` (see [`Ledger::instance_id`]).
    pub fn cgroup_dirs(&self, prefix: &str) -> Result<Vec<String>, LedgerError> {
        let prefix = prefix.to_string();
        self.read(move |tx| read::cgroup_dirs(tx, &prefix))
    }

    /// What a sweep looks at: every non-terminal tree, and the resolved
    /// trees that still have survivors an operator left
    /// ([`TreeRow::has_survivors_left`]).
    pub fn sweep_candidates(&self) -> Result<Vec<TreeRow>, LedgerError> {
        let mut trees = self.nonterminal_trees()?;
        let resolved = self.read(|tx| read::trees(tx, Some(&[TreeState::Resolved])))?;
        trees.extend(resolved.into_iter().filter(TreeRow::has_survivors_left));
        trees.sort_by_key(|t| t.id);
        Ok(trees)
    }

    /// The ids of every non-terminal tree: [`Ledger::nonterminal_trees`]
    /// without reading the rows (the leftover-cgroup check of every sweep
    /// asks only whether a tree still lives).
    pub fn nonterminal_tree_ids(&self) -> Result<std::collections::HashSet<i64>, LedgerError> {
        let live: Vec<TreeState> = TreeState::ALL
            .into_iter()
            .filter(|s| !s.is_terminal())
            .collect();
        self.read(move |tx| read::tree_ids(tx, &live))
            .map(|ids| ids.into_iter().collect())
    }

    pub fn nonterminal_trees(&self) -> Result<Vec<TreeRow>, LedgerError> {
        let live: Vec<TreeState> = TreeState::ALL
            .into_iter()
            .filter(|s| !s.is_terminal())
            .collect();
        self.read(move |tx| read::trees(tx, Some(&live)))
    }

    /// The trees whose state alone can hold dispatch closed: ambiguous,
    /// terminating and killing (what [`crate::custody::Gate::unsettled`]
    /// judges), read through the state index. Not every live tree: with
    /// 2,000 running trees, reading them all made every `/healthz`, spawn
    /// gate and `/metrics` scrape read 2,000 rows.
    pub fn unsettled_candidates(&self) -> Result<Vec<TreeRow>, LedgerError> {
        self.read(|tx| {
            read::trees(
                tx,
                Some(&[
                    TreeState::Terminating,
                    TreeState::Killing,
                    TreeState::Ambiguous,
                ]),
            )
        })
    }

    /// How many trees are in each state (states with none are left out).
    pub fn tree_counts(&self) -> Result<Vec<(TreeState, u64)>, LedgerError> {
        self.read(|tx| read::tree_counts(tx))
    }

    /// Trees awaiting an operator's resolution: while any exists, dispatch is refused.
    pub fn ambiguous_trees(&self) -> Result<Vec<TreeRow>, LedgerError> {
        self.read(|tx| read::trees(tx, Some(&[TreeState::Ambiguous])))
    }

    pub fn events(&self, filter: &EventFilter) -> Result<Vec<EventRow>, LedgerError> {
        let filter = filter.clone();
        self.read(move |tx| read::events(tx, &filter))
    }

    /// The newest event's (seq, hash).
    pub fn head(&self) -> Result<Option<(i64, String)>, LedgerError> {
        self.read(|tx| db::read_head(tx))
    }

    /// Integrity check, the whole chain, the SIGKILL authority rule and, if
    /// given, the expected head (which catches truncation). Reports the first break.
    pub fn verify(&self, expect_head: Option<(i64, String)>) -> Result<VerifyReport, LedgerError> {
        self.read(move |tx| Ok(verify::verify(tx, expect_head, None)?.0))
    }

    /// [`Ledger::verify`], and with `seal_key` (the verification key or
    /// the root public key) the seals (`seal.rs`): every MAC or signature,
    /// consecutive epochs from the setup, every event at or
    /// below a seal's head covered by it, and the newest seal fresh at the
    /// time of the read (or a clean close). One read transaction: one
    /// consistent snapshot of a ledger that is being written.
    pub fn verify_sealed(
        &self,
        expect_head: Option<(i64, String)>,
        seal_key: Option<seal::SealVerifier>,
    ) -> Result<(VerifyReport, Option<SealReport>), LedgerError> {
        // The data dir is looked through for erased epochs' private keys
        // where it holds a key file (a live ledger's, not a copy's).
        let dir = Some(self.dir.as_ref().clone()).filter(|d| seal::key_path(d).exists());
        self.read(move |tx| {
            // Taken before the snapshot's first read: a seal the snapshot
            // holds was made before it, or at the latest just after it.
            let read_at = std::time::SystemTime::now();
            let seals = seal_key.map(|k| (seal::SealCheck::new(k, dir), read_at));
            verify::verify(tx, expect_head, seals)
        })
    }

    /// Prunes the events and rows of trees that ended before `req.before`
    /// (never a live, ambiguous or otherwise unsettled tree's, never one in
    /// `req.keep`), and tree-less events older than it: first the archive
    /// (if asked) is written and fsynced from one snapshot, then one FULL
    /// transaction re-plans, appends the `ledger.checkpoint` event and
    /// deletes. Any failure deletes nothing and leaves no archive. Nothing
    /// prunable: no checkpoint, no archive (`checkpoint: None`).
    /// See `prune.rs` for the scheme `verify` proves.
    pub fn prune(&self, req: &PruneRequest) -> Result<PruneReport, LedgerError> {
        let req = req.clone();
        let prepared = {
            let req = req.clone();
            self.read(move |tx| Ok(prune::prepare(tx, &req)))?
        }?;
        let Some(planned) = prepared else {
            return Ok(PruneReport {
                checkpoint: None,
                events: 0,
                trees: 0,
                pruned_through: 0,
                kept_below: 0,
                archive: None,
                pruned_trees: Vec::new(),
            });
        };
        let archive = req.archive.clone();
        let result = self.write(Durability::Full, move |w| prune::commit(w, &req, &planned));
        if result.is_err()
            && let Some(path) = &archive
        {
            // The delete did not commit: the archive holds events the
            // ledger still has, and must not pass for a prune's.
            let _ = std::fs::remove_file(path);
        }
        result
    }

    /// Checks archives written by [`Ledger::prune`] against this ledger
    /// (see `prune.rs`): one report per archive, with the checkpoint it
    /// matched.
    pub fn verify_archives(
        &self,
        paths: &[std::path::PathBuf],
    ) -> Result<Vec<(std::path::PathBuf, VerifyReport)>, LedgerError> {
        let paths = paths.to_vec();
        self.read(move |tx| {
            Ok(prune::verify_archives(tx, &paths)?
                .into_iter()
                .map(|(p, r, _)| (p, r))
                .collect())
        })
    }

    /// The last seq the shipping sink `sink` had acknowledged, if shipping
    /// ever ran (`service::ship`).
    pub fn ship_cursor(&self, sink: &str) -> Result<Option<i64>, LedgerError> {
        let sink = sink.to_string();
        self.read(move |tx| {
            Ok(tx
                .prepare_cached("SELECT seq FROM ship_cursor WHERE sink = ?1")?
                .query_row([&sink], |r| r.get(0))
                .optional()?)
        })
    }

    /// Creates the shipping cursor of `sink` at 0 if it has none (the
    /// whole ledger is then shipped). A bookkeeping row: no event.
    pub fn init_ship_cursor(&self, sink: &str) -> Result<(), LedgerError> {
        let sink = sink.to_string();
        self.write_normal(move |w| {
            let now = w.now.clone();
            w.exec(
                "INSERT INTO ship_cursor (sink, seq, at) VALUES (?1, 0, ?2) ON CONFLICT (sink) DO NOTHING",
                rusqlite::params![sink, now],
            )?;
            Ok(())
        })
    }

    /// Moves the shipping cursor of `sink` forward to `seq` (never back).
    pub fn set_ship_cursor(&self, sink: &str, seq: i64) -> Result<(), LedgerError> {
        let sink = sink.to_string();
        self.write_normal(move |w| {
            let now = w.now.clone();
            w.exec(
                "INSERT INTO ship_cursor (sink, seq, at) VALUES (?1, ?2, ?3)
                 ON CONFLICT (sink) DO UPDATE SET seq = max(seq, excluded.seq), at = excluded.at",
                rusqlite::params![sink, seq, now],
            )?;
            Ok(())
        })
    }

    /// The shipping cursor of `sink` and the sink's own position of the
    /// event at it (JetStream: its stream sequence), if shipping ever ran.
    pub fn ship_position(&self, sink: &str) -> Result<Option<(i64, Option<i64>)>, LedgerError> {
        let sink = sink.to_string();
        self.read(move |tx| {
            Ok(tx
                .prepare_cached("SELECT seq, remote_seq FROM ship_cursor WHERE sink = ?1")?
                .query_row([&sink], |r| Ok((r.get(0)?, r.get(1)?)))
                .optional()?)
        })
    }

    /// Moves the shipping cursor of `sink` forward to `seq` with the sink's
    /// position of that event; a `seq` behind the cursor changes nothing.
    pub fn set_ship_position(&self, sink: &str, seq: i64, remote: i64) -> Result<(), LedgerError> {
        let sink = sink.to_string();
        self.write_normal(move |w| {
            let now = w.now.clone();
            w.exec(
                "INSERT INTO ship_cursor (sink, seq, at, remote_seq) VALUES (?1, ?2, ?3, ?4)
                 ON CONFLICT (sink) DO UPDATE SET
                   remote_seq = CASE WHEN excluded.seq >= seq THEN excluded.remote_seq ELSE remote_seq END,
                   at = CASE WHEN excluded.seq >= seq THEN excluded.at ELSE at END,
                   seq = max(seq, excluded.seq)",
                rusqlite::params![sink, seq, now, remote],
            )?;
            Ok(())
        })
    }

    /// Writes the selected events to `out` in `format`; returns how many.
    /// Nothing is written to `out` unless the whole export was read.
    pub fn export(
        &self,
        filter: &EventFilter,
        format: ExportFormat,
        out: &mut dyn Write,
    ) -> Result<usize, LedgerError> {
        let n = self.export_with(filter, format, &mut |bytes| export::write_all(bytes, out))?;
        out.flush()
            .map_err(|e| LedgerError::Other(format!("export: cannot write output: {e}")))?;
        Ok(n)
    }

    /// Every export path's one form (the CLI's, `/api/export`, the
    /// dashboard's links): the events `filter` selects, page by page to
    /// `sink`, and for a whole NDJSON export of a sealed ledger a last line
    /// of its own (`verify::ExportStamp`): its time (`verify --export`
    /// judges the seals' freshness at it), host, machine and boot, the head
    /// it stops at, its filter and count, sealed with the current epoch's
    /// key from the data dir's key file. Returns how many events.
    pub fn export_with(
        &self,
        filter: &EventFilter,
        format: ExportFormat,
        sink: &mut dyn FnMut(&[u8]) -> Result<(), LedgerError>,
    ) -> Result<usize, LedgerError> {
        if format == ExportFormat::Ocsf {
            return self.export_ocsf_with(filter, sink).map(|c| c.records);
        }
        let selection = export::Selection::of(filter);
        if format == ExportFormat::Ndjson
            && let Some(selection) = selection.clone().filter(export::Selection::narrows)
        {
            return self.export_proven(filter, selection, sink);
        }
        let whole = selection.is_some_and(|s| s.is_whole());
        let sealed = if format == ExportFormat::Ndjson && whole {
            self.export_seal(&self.dir)?
        } else {
            None
        };
        let head = match &sealed {
            Some(s) => s.head.clone(),
            None => self.head()?,
        };
        let upto = head.as_ref().map_or(0, |h| h.0);
        let n = self.pages_to(filter, upto, &mut |rows, first| {
            sink(&export::format(rows, format, first)?)
        })?;
        if let Some(sealed) = sealed {
            let stamp = verify::ExportStamp {
                v: Some(2),
                at: timestamp(sealed.at),
                events: n as u64,
                host: Some(crate::proc::host_name()),
                machine_id: machine_id(),
                boot_id: crate::proc::boot_id().ok().map(str::to_string),
                head: Some(head.map(|(seq, hash)| verify::StampHead { seq, hash })),
                filter: Some(serde_json::json!({})),
                tree_size: None,
                root: None,
                head_path: None,
            };
            let fail = |e: serde_json::Error| LedgerError::Other(format!("export: {e}"));
            let mut raw = serde_json::to_value(&stamp).map_err(fail)?;
            sealed.key.seal(&mut raw);
            let mut line =
                serde_json::to_vec(&serde_json::json!({ "exported": raw })).map_err(fail)?;
            line.push(b'\n');
            sink(&line)?;
        }
        Ok(n)
    }

    /// Copies the whole ledger to `dest` (a new file, created 0600) through
    /// SQLite's online backup API, a few hundred pages at a time, so other
    /// processes keep writing meanwhile (a step that meets a write starts
    /// over from what changed). The copy is a consistent snapshot of one
    /// moment: it verifies on its own.
    ///
    /// A sealed ledger's copy is made under the seal key file's lock (no
    /// seal commits meanwhile) and then stamped (`seal::stamp_backup`):
    /// its time, host, machine, boot and head, sealed with the key after
    /// its newest seal, so that `verify --seal-key`/`--seal-pub` judges it
    /// at the time it was taken, however much later it is checked.
    pub fn backup_to(&self, dest: &Path) -> Result<(), LedgerError> {
        let lock = self.seal_lock(&self.dir)?;
        let copy = dest.to_path_buf();
        self.handle.call(move |store| store.backup_to(&copy))?;
        if let Some(lock) = &lock {
            let stamp = serde_json::json!({
                "v": 2,
                "at": timestamp(std::time::SystemTime::now()),
                "host": crate::proc::host_name(),
                "machine_id": machine_id(),
                "boot_id": crate::proc::boot_id().ok(),
            });
            if let Err(e) = seal::stamp_backup(dest, lock, stamp) {
                // An unstamped copy of a sealed ledger would read as stale.
                let _ = std::fs::remove_file(dest);
                return Err(e);
            }
        }
        Ok(())
    }

    /// The streaming core of every export: the events `filter` selects up
    /// to the event `head` (a seq), oldest first, in pages of
    /// [`export::PAGE`] (keyset on `seq`), each handed to `each` (with
    /// whether it is the first) before the next is read; the first page
    /// always, even empty. Memory stays flat however long the ledger is.
    /// Returns how many events.
    pub(crate) fn pages_to(
        &self,
        filter: &EventFilter,
        head: i64,
        each: &mut PageSink<'_>,
    ) -> Result<usize, LedgerError> {
        let mut page = filter.clone();
        page.newest_first = false;
        page.limit = Some(export::PAGE);
        let mut sent = 0;
        let mut first = true;
        loop {
            let rows = self.events(&page)?;
            let full = rows.len() == export::PAGE;
            let rows: Vec<EventRow> = rows.into_iter().take_while(|r| r.seq <= head).collect();
            let reached_head = rows.last().is_none_or(|r| r.seq >= head);
            if !rows.is_empty() || first {
                each(&rows, first)?;
            }
            first = false;
            sent += rows.len();
            match rows.last() {
                Some(last) if full && !reached_head => page.after_seq = Some(last.seq),
                _ => return Ok(sent),
            }
        }
    }
}

/// What [`Ledger::pages_to`] hands each page to: its rows, and whether it
/// is the first.
pub(crate) type PageSink<'a> = dyn FnMut(&[EventRow], bool) -> Result<(), LedgerError> + 'a;

/// This host's `/etc/machine-id`, where it has one.
fn machine_id() -> Option<String> {
    std::fs::read_to_string("/etc/machine-id")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

/// `verify --export FILE`: an NDJSON export checked alone, with the same
/// chain walk and (with `seal_key`) the same seal check as the ledger's;
/// freshness is judged at the export's own time (its last line).
pub fn verify_export(
    path: &Path,
    seal_key: Option<seal::SealVerifier>,
) -> Result<(VerifyReport, Option<SealReport>), LedgerError> {
    verify::verify_export(path, seal_key.map(|k| seal::SealCheck::new(k, None)), None)
}

/// [`verify_export`] for a trail with no trailer of its own (a JetStream
/// stream's events): its seals' freshness is judged as of `as_of`.
pub fn verify_trail_as_of(
    path: &Path,
    seal_key: Option<seal::SealVerifier>,
    as_of: std::time::SystemTime,
) -> Result<(VerifyReport, Option<SealReport>), LedgerError> {
    verify::verify_export(
        path,
        seal_key.map(|k| seal::SealCheck::new(k, None)),
        Some(as_of),
    )
}

/// Test-only: a second connection holding the ledger's write lock, which is
/// what a stuck writer in another process looks like to this one. While it
/// is held every write of a [`Ledger`] fails with [`LedgerError::Busy`]
/// after its busy timeout; reads go on (WAL). Dropping it lets go.
#[cfg(test)]
pub(crate) struct WriteLock {
    _conn: rusqlite::Connection,
}

#[cfg(test)]
impl WriteLock {
    pub(crate) fn hold(path: &Path) -> WriteLock {
        let conn = rusqlite::Connection::open(path).expect("second connection to the ledger");
        conn.execute_batch("BEGIN IMMEDIATE")
            .expect("the write lock is free when the test takes it");
        WriteLock { _conn: conn }
    }
}
