//! The owner thread and the connection it alone holds (wastebin's db.rs
//! pattern): callers send boxed jobs over a channel and block on the reply.
//! Every write is one `BEGIN IMMEDIATE` transaction; a write that records an
//! audit fact extends the hash chain in it, so the change and its event
//! commit or vanish together (bookkeeping writes — owners, flags, scans,
//! `last_seen`, exec refreshes — carry no event).

use super::fsmode::Mode as _;
use std::path::Path;
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

use rusqlite::{Connection, OptionalExtension, Transaction, TransactionBehavior, params};
use rusqlite_migration::{M, Migrations};

use super::chain;
use super::error::{Fail, LedgerError};
use super::event::Event;
use super::types::TreeId;

/// The schema, oldest first. Append only: a shipped migration never changes.
const MIGRATIONS: &[M<'static>] = &[
    M::up(include_str!("../../migrations/0001_init.sql")),
    M::up(include_str!("../../migrations/0002_tree_options.sql")),
    M::up(include_str!("../../migrations/0003_instance.sql")),
    M::up(include_str!("../../migrations/0004_first_signal.sql")),
    M::up(include_str!("../../migrations/0005_retention.sql")),
    M::up(include_str!("../../migrations/0006_principals.sql")),
    M::up(include_str!("../../migrations/0007_seal.sql")),
    M::up(include_str!("../../migrations/0008_job_boundary.sql")),
    M::up(include_str!(
        "../../migrations/0009_checks_without_in_lists.sql"
    )),
    M::up(include_str!("../../migrations/0010_evidence_budget.sql")),
    M::up(include_str!("../../migrations/0011_ship_remote_seq.sql")),
];

/// How hard a commit must be on disk before it returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Durability {
    /// `synchronous=FULL`: the WAL is fsynced at commit, so the row survives
    /// power loss. For rows that release a spawn or authorize a kill.
    Full,
    /// [`Durability::Full`] without SQLite's automatic checkpoint: the
    /// teardown's snapshot and authorization, which stand between frozen
    /// survivors and their SIGKILL (see `Store::set_sync`).
    Authority,
    /// `synchronous=NORMAL`: survives a crash of any process; the WAL is
    /// fsynced at checkpoints, so a power loss may lose the newest commits
    /// (never corrupt or half-write them).
    Normal,
}

/// SQLite's default automatic checkpoint threshold, in WAL pages (see
/// `Store::set_sync`).
const WAL_AUTOCHECKPOINT: i64 = 1000;

/// A job for the owner thread.
type Job = Box<dyn FnOnce(&mut Store) + Send>;

/// The connection and what the owner thread remembers about it.
pub(crate) struct Store {
    conn: Connection,
    busy_timeout: Duration,
    /// The `synchronous` level currently set on the connection.
    sync: Durability,
    /// When the head was last published at INFO, and the newest head not
    /// yet published there (see [`HEAD_LOG_EVERY`]).
    head_logged: Option<std::time::Instant>,
    head_pending: Option<(i64, String)>,
}

/// How often the chain head is published at INFO (`ledger head seq=N
/// hash=H`): at most once per this interval, and once more when the
/// ledger closes, so the last head is always published; every commit's
/// head is logged at DEBUG. Per commit at INFO it was most of what `serve`
/// logged.
pub(crate) const HEAD_LOG_EVERY: Duration = Duration::from_secs(10);

impl Store {
    /// Publishes a new head: at DEBUG always, at INFO when the interval
    /// has passed (else it waits, as the pending head, for the next commit
    /// or the close).
    fn publish_head(&mut self, seq: i64, hash: String) {
        tracing::debug!(target: "treewarden::ledger::head", seq, hash = %hash, "ledger head");
        let due = self
            .head_logged
            .is_none_or(|t| t.elapsed() >= HEAD_LOG_EVERY);
        if due {
            // Text logs render this as `ledger head seq=N hash=H`; JSON logs keep the fields.
            tracing::info!(target: "treewarden::ledger::head", seq, hash = %hash, "ledger head");
            self.head_logged = Some(std::time::Instant::now());
            self.head_pending = None;
        } else {
            self.head_pending = Some((seq, hash));
        }
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        if let Some((seq, hash)) = self.head_pending.take() {
            tracing::info!(target: "treewarden::ledger::head", seq, hash = %hash, "ledger head");
        }
    }
}

/// Owns the channel to the owner thread and joins it when the last handle goes.
pub(crate) struct Handle {
    jobs: Option<mpsc::Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        // Closing the channel ends the owner thread's loop; joining makes the
        // connection close before the last handle's drop returns.
        self.jobs.take();
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            tracing::error!("ledger owner thread panicked");
        }
    }
}

/// Opens (creating if needed) and migrates the ledger, then starts its owner thread.
#[cfg(test)]
pub(crate) fn start(
    path: &Path,
    busy_timeout: Duration,
    reserve: u64,
) -> Result<Arc<Handle>, LedgerError> {
    start_in(path, busy_timeout, reserve, DirRule::DataDir, "ledger")
}

/// [`start`], with what may be assumed of the file's directory and the
/// owner thread's name (what `top -H` and a per-thread CPU count show).
pub(crate) fn start_in(
    path: &Path,
    busy_timeout: Duration,
    reserve: u64,
    dir: DirRule,
    thread: &str,
) -> Result<Arc<Handle>, LedgerError> {
    let conn =
        open_connection(path, busy_timeout, dir).map_err(|fail| fail.into_ledger(busy_timeout))?;
    reserve_wal(&conn, path, reserve);
    let mut store = Store {
        conn,
        busy_timeout,
        sync: Durability::Normal,
        head_logged: None,
        head_pending: None,
    };
    let (jobs, inbox) = mpsc::channel::<Job>();
    let thread = std::thread::Builder::new()
        .name(thread.into())
        .spawn(move || {
            while let Ok(job) = inbox.recv() {
                // A job that panics (a bug in one request's code) must not
                // take the ledger down for every other caller: its caller
                // sees the reply channel close ("stopped before replying"),
                // its open transaction rolls back as it unwinds, and the
                // thread goes on with the next job.
                if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(&mut store)))
                    .is_err()
                {
                    tracing::error!("a ledger job panicked; its transaction was rolled back");
                }
            }
        })
        .map_err(|e| LedgerError::Other(format!("cannot start ledger thread: {e}")))?;
    Ok(Arc::new(Handle {
        jobs: Some(jobs),
        thread: Some(thread),
    }))
}

impl Handle {
    /// Runs `f` on the owner thread and waits for its result.
    pub(crate) fn call<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Store) -> Result<T, LedgerError> + Send + 'static,
    ) -> Result<T, LedgerError> {
        let (reply, answer) = mpsc::sync_channel(1);
        let job: Job = Box::new(move |store| {
            // The caller may have gone away; then nobody needs the answer.
            let _ = reply.send(f(store));
        });
        let jobs = self
            .jobs
            .as_ref()
            .ok_or_else(|| LedgerError::Other("ledger is closed".into()))?;
        jobs.send(job)
            .map_err(|_| LedgerError::Other("ledger thread has stopped".into()))?;
        answer
            .recv()
            .map_err(|_| LedgerError::Other("ledger thread stopped before replying".into()))?
    }
}

/// A failure to create the ledger's directory or file, by what it means.
fn creation_error(path: &Path, e: std::io::Error) -> LedgerError {
    let msg = format!("cannot create {}: {e}", path.display());
    match e.kind() {
        std::io::ErrorKind::StorageFull => LedgerError::Full(msg),
        std::io::ErrorKind::ReadOnlyFilesystem | std::io::ErrorKind::PermissionDenied => {
            LedgerError::ReadOnly(msg)
        }
        _ => LedgerError::Other(msg),
    }
}

/// Makes the data dir private to its owner: one that already exists with
/// group or other bits (0755, say) is tightened to 0700 (logged at info: the service says it, a CLI command stays quiet).
/// A directory that is not this user's own (whatever its mode: its owner
/// could replace the ledger), or is shared on purpose (the sticky bit, as
/// `/tmp`) and already holds something, is refused with one line: tightening it would break its other users, and leaving it so would
/// show every tree's argv. An *empty* sticky directory of this user's (a
/// tmpfs freshly mounted for the data dir: its root is 1777) is tightened.
fn make_private(dir: &Path) -> Result<(), LedgerError> {
    crate::proc::make_dir_private(dir)
        .map_err(|e| creation_error(dir, e))?
        .map_err(LedgerError::Other)
}

/// Creates the ledger file with mode 0600 if it does not exist yet (an
/// existing file keeps the mode its owner gave it).
fn create_private(path: &Path) -> std::io::Result<()> {
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
    {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(e),
    }
}

/// What opening a ledger file may assume of the directory it is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DirRule {
    /// The data dir: made if missing and kept private to its owner
    /// ([`make_private`]), since it holds the live ledger's companions
    /// (tokens, sockets, keys) and every tree's argv.
    DataDir,
    /// A file the caller named on its own (a backup's copy): its directory
    /// is the caller's business, `/tmp` included; the file itself is 0600.
    AsIs,
}

fn open_connection(path: &Path, busy_timeout: Duration, dir: DirRule) -> Result<Connection, Fail> {
    if let Some(parent) = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty() && dir == DirRule::DataDir)
    {
        // The ledger holds every tree's argv and cwd: private to its owner,
        // whoever creates it (directories made here are 0700, the file 0600;
        // SQLite gives the -wal and -shm files the database file's mode).
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(parent)
            .map_err(|e| creation_error(parent, e))?;
        make_private(parent)?;
    }
    create_private(path).map_err(|e| creation_error(path, e))?;
    let mut conn = Connection::open(path)?;
    conn.busy_timeout(busy_timeout)?;
    // Every write goes through `Writer::exec`/`Writer::row`, which keep their
    // statements prepared: re-preparing was 40% of the owner thread's time in
    // a 1,000-member teardown. Reads use the cache too. Room for
    // every distinct statement (the event reads' filter combinations included).
    conn.set_prepared_statement_cache_capacity(128);
    conn.pragma_update(None, "foreign_keys", true)?;
    // INSERT OR REPLACE deletes the old row; with recursive triggers that
    // delete meets the append-only guards instead of slipping past them.
    conn.pragma_update(None, "recursive_triggers", true)?;
    conn.pragma_update(None, "synchronous", "NORMAL")?;
    // Opening a current ledger (every `show`, `ls`, `export`) reads two
    // header fields and takes no lock that could queue behind busy writers.
    if is_current(&conn) {
        return Ok(conn);
    }
    // A new ledger (or one behind the schema) is made current by one process
    // at a time: switching to WAL needs an exclusive lock, and SQLite answers
    // a lock upgrade that could deadlock with BUSY at once, without its busy
    // handler, so concurrent first uses (40 `run`s on a new data dir) failed
    // in milliseconds claiming a writer held the lock for the busy timeout.
    // Under the init lock (on the ledger's directory) the others wait their
    // turn, then find it current.
    let _init = InitLock::take(path, busy_timeout.max(INIT_WAIT))?;
    if is_current(&conn) {
        return Ok(conn);
    }
    make_current(&mut conn, path, busy_timeout)?;
    Ok(conn)
}

/// Preallocates `bytes` for the ledger's WAL (`fallocate` with
/// `KEEP_SIZE`: blocks allocated past its end, its length unchanged), so
/// that its next appends need no new blocks: a tree (or anything else)
/// that fills the filesystem cannot take the room the next kill's
/// authorization needs. SQLite never truncates the
/// WAL here (no `journal_size_limit`, no TRUNCATE checkpoint), so the
/// room lasts until the last connection closes and removes the WAL; every
/// open makes it again (a no-op where it is there). Checkpoints that
/// cannot grow the database file on a full disk leave their frames in the
/// WAL, which then lives on its reserve.
///
/// The WAL is opened by path beside SQLite's own descriptor: SQLite holds
/// no POSIX lock on the WAL file (its locks are on the database and the
/// `-shm`), so closing ours drops none of its locks. Best effort: a
/// filesystem without `fallocate` or without the room is logged, and the
/// ledger works as before (a full disk then fails its writes closed).
/// Where no reserve can be made ([`crate::proc::RESERVES_PAST_END`]: not on
/// Windows or macOS) none is, and a full disk fails the writes closed.
fn reserve_wal(conn: &Connection, path: &Path, bytes: u64) {
    if bytes == 0 || !crate::proc::RESERVES_PAST_END {
        return;
    }
    // A read makes SQLite open (create) the WAL of a WAL-mode database.
    if conn
        .query_row("SELECT count(*) FROM sqlite_master", [], |r| {
            r.get::<_, i64>(0)
        })
        .is_err()
    {
        return;
    }
    let mut wal = path.as_os_str().to_owned();
    wal.push("-wal");
    let wal = std::path::PathBuf::from(wal);
    let Ok(file) = std::fs::OpenOptions::new().write(true).open(&wal) else {
        return;
    };
    if let Err(e) = crate::proc::reserve_past_end(&file, bytes) {
        tracing::warn!(wal = %wal.display(), bytes, error = %e, "the ledger's reserve could not be allocated; a full disk will fail its writes closed");
    }
}

/// How long a first use waits for another process that is creating or
/// migrating the ledger (at least; the busy timeout when longer).
const INIT_WAIT: Duration = Duration::from_secs(30);

/// An advisory `flock` on the ledger's directory, held while a process
/// creates or migrates the ledger, released when the handle closes (also
/// when the process dies). The directory, not a file of its own: nothing is
/// left behind, and the ledger file itself is not touched outside SQLite
/// (closing another descriptor of it would drop SQLite's POSIX locks).
struct InitLock {
    _file: Option<std::fs::File>,
}

impl InitLock {
    /// Takes the lock, waiting at most `wait`. A directory that cannot be
    /// opened or locked is no lock: the migration's own retries still apply.
    fn take(path: &Path, wait: Duration) -> Result<Self, Fail> {
        let dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let file = match std::fs::File::open(dir) {
            Ok(f) => f,
            Err(e) => {
                tracing::debug!(error = %e, "no ledger init lock: migrating without one");
                return Ok(Self { _file: None });
            }
        };
        let deadline = std::time::Instant::now() + wait;
        loop {
            match file.try_lock() {
                Ok(()) => return Ok(Self { _file: Some(file) }),
                Err(std::fs::TryLockError::WouldBlock) => {}
                Err(std::fs::TryLockError::Error(e)) => {
                    tracing::debug!(error = %e, "ledger init lock not taken: migrating without it");
                    return Ok(Self { _file: None });
                }
            }
            if std::time::Instant::now() >= deadline {
                return Err(LedgerError::Busy(wait).into());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// The migrations' latest version.
fn latest() -> Option<rusqlite_migration::SchemaVersion> {
    std::num::NonZeroUsize::new(MIGRATIONS.len()).map(rusqlite_migration::SchemaVersion::Inside)
}

/// Whether the ledger is in WAL mode at the latest schema (reads only). A
/// read that fails (busy past the busy timeout under load) is asked again,
/// a few times, before the answer is "not current" (which only costs the
/// init lock and a no-op migration).
fn is_current(conn: &Connection) -> bool {
    for _ in 0..3 {
        let mode = conn.pragma_query_value(None, "journal_mode", |row| row.get::<_, String>(0));
        let version = Migrations::from_slice(MIGRATIONS).current_version(conn);
        match (mode, version) {
            (Ok(mode), Ok(version)) => {
                return mode.eq_ignore_ascii_case("wal") && latest().is_some_and(|l| l == version);
            }
            (mode, version) => tracing::debug!(
                mode = ?mode.err(),
                version = ?version.err(),
                "ledger header not read; asking again"
            ),
        }
    }
    false
}

/// WAL mode, then the migrations; called under the init lock.
fn make_current(conn: &mut Connection, path: &Path, busy_timeout: Duration) -> Result<(), Fail> {
    // Switched only when it is not WAL yet (the switch takes an exclusive lock).
    let mode: String =
        match conn.pragma_query_value(None, "journal_mode", |row| row.get::<_, String>(0)) {
            Ok(m) if m.eq_ignore_ascii_case("wal") => m,
            _ => conn.pragma_update_and_check(None, "journal_mode", "WAL", |row| row.get(0))?,
        };
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(LedgerError::Other(format!(
            "{} cannot use WAL (journal_mode is {mode})",
            path.display()
        ))
        .into());
    }
    // Migrations take the write lock up front, like every other write.
    mend_0006_before_0005(conn)?;
    let migrations = Migrations::from_slice(MIGRATIONS);
    let latest = latest().ok_or_else(|| LedgerError::Other("no migrations".into()))?;
    if migrations.current_version(conn).ok() == Some(latest) {
        return Ok(());
    }
    conn.set_transaction_behavior(TransactionBehavior::Immediate);
    let started = std::time::Instant::now();
    loop {
        let Err(failed) = migrations.to_latest(conn) else {
            break;
        };
        // A process of an older build (which takes no init lock) may have
        // migrated between our version check and our transaction; then the
        // schema is current and our attempt rolled back.
        if migrations.current_version(conn).ok() == Some(latest) {
            break;
        }
        // Or it is migrating right now: try again within the busy timeout.
        let error = LedgerError::from_migration(failed, busy_timeout);
        if !matches!(error, LedgerError::Busy(_)) || started.elapsed() >= busy_timeout {
            return Err(error.into());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    conn.set_transaction_behavior(TransactionBehavior::Deferred);
    Ok(())
}

/// A ledger made by a build that listed 0006 right after 0004 (a development
/// build of main, after 0006 landed and before 0005 did) has `user_version` 5 with 0006's
/// schema and without 0005's: applied in list order, 0005 would be taken as
/// done and 0006 applied twice. Such a ledger gets 0005 now, and version 6.
fn mend_0006_before_0005(conn: &mut Connection) -> Result<(), Fail> {
    let has = |conn: &Connection, table: &str| -> rusqlite::Result<bool> {
        conn.query_row(
            "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?1)",
            [table],
            |r| r.get(0),
        )
    };
    let version: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
    if version != 5 || !has(conn, "api_tokens")? || has(conn, "ship_cursor")? {
        return Ok(());
    }
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    if has(&tx, "ship_cursor")? {
        // Another process mended it first.
        return Ok(());
    }
    tx.execute_batch(include_str!("../../migrations/0005_retention.sql"))?;
    tx.pragma_update(None, "user_version", 6)?;
    tx.commit()?;
    Ok(())
}

/// Now, as the ledger spells times: RFC 3339, UTC, milliseconds.
pub(crate) fn now_string() -> String {
    humantime::format_rfc3339_millis(SystemTime::now()).to_string()
}

impl Store {
    /// Sets the durability of the next commits. The teardown's authority
    /// commit ([`Durability::Authority`]) never runs the WAL's automatic
    /// checkpoint: SQLite runs it inside whichever commit crosses the
    /// threshold (1,000 pages), and copying the WAL into the database with
    /// its fsync would then stand between an authorization and its SIGKILL
    /// (a 1,000-survivor snapshot writes about 300 pages). The next commit
    /// runs it instead. Other FULL commits keep it: a run of FULL commits
    /// and nothing else would only grow the WAL, and an fdatasync that must
    /// also journal a growing file's size costs about twice as much (the
    /// authority bench, docs/PERFORMANCE.md).
    fn set_sync(&mut self, level: Durability) -> Result<(), Fail> {
        if self.sync != level {
            let (value, autocheckpoint) = match level {
                Durability::Full => ("FULL", WAL_AUTOCHECKPOINT),
                Durability::Authority => ("FULL", 0),
                Durability::Normal => ("NORMAL", WAL_AUTOCHECKPOINT),
            };
            self.conn.pragma_update(None, "synchronous", value)?;
            self.conn
                .pragma_update(None, "wal_autocheckpoint", autocheckpoint)?;
            self.sync = level;
        }
        Ok(())
    }

    /// One write transaction: `BEGIN IMMEDIATE` at the given durability, `f`,
    /// commit, then publish the new chain head in the log. On any error the
    /// transaction rolls back and nothing is written.
    pub(crate) fn write<T>(
        &mut self,
        durability: Durability,
        f: impl FnOnce(&mut Writer<'_>) -> Result<T, Fail>,
    ) -> Result<T, LedgerError> {
        let busy_timeout = self.busy_timeout;
        let result = (|| {
            self.set_sync(durability)?;
            let tx = self
                .conn
                .transaction_with_behavior(TransactionBehavior::Immediate)?;
            let mut writer = Writer {
                tx: &tx,
                now: now_string(),
                head: None,
                appended: false,
                late: None,
            };
            let value = f(&mut writer)?;
            let head = writer.appended.then(|| writer.head.clone()).flatten();
            tx.commit()?;
            Ok((value, head))
        })();
        let (value, head) = result.map_err(|fail: Fail| fail.into_ledger(busy_timeout))?;
        if let Some((seq, hash)) = head {
            self.publish_head(seq, hash);
        }
        Ok(value)
    }

    /// An online copy of the database into the new file `dest` (0600),
    /// stepwise (256 pages a step, a short pause between steps, so other
    /// connections keep writing; SQLite restarts the copy of what changed).
    pub(crate) fn backup_to(&mut self, dest: &Path) -> Result<(), LedgerError> {
        let busy = self.busy_timeout;
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(dest)
            .map_err(|e| creation_error(dest, e))?;
        let mut copy = Connection::open(dest).map_err(|e| LedgerError::from_sqlite(e, busy))?;
        let backup = rusqlite::backup::Backup::new(&self.conn, &mut copy)
            .map_err(|e| LedgerError::from_sqlite(e, busy))?;
        backup
            .run_to_completion(256, Duration::from_millis(2), None)
            .map_err(|e| LedgerError::from_sqlite(e, busy))
    }

    /// A consistent read: one deferred transaction (a WAL snapshot).
    pub(crate) fn read<T>(
        &mut self,
        f: impl FnOnce(&Transaction<'_>) -> Result<T, Fail>,
    ) -> Result<T, LedgerError> {
        let busy_timeout = self.busy_timeout;
        let result = (|| {
            let tx = self
                .conn
                .transaction_with_behavior(TransactionBehavior::Deferred)?;
            let value = f(&tx)?;
            tx.finish()?;
            Ok(value)
        })();
        result.map_err(|fail: Fail| fail.into_ledger(busy_timeout))
    }
}

/// The open write transaction, with the chain head it has extended so far.
pub(crate) struct Writer<'t> {
    pub(crate) tx: &'t Transaction<'t>,
    /// One timestamp for everything this transaction records.
    pub(crate) now: String,
    head: Option<(i64, String)>,
    appended: bool,
    /// Set while replaying evidence a refused write deferred: each event
    /// then carries `deferred_from`, the time the fact happened (the
    /// event's own `at` is when the ledger finally took it).
    pub(crate) late: Option<(String, String)>,
}

impl Writer<'_> {
    /// `execute` through the connection's prepared-statement cache.
    pub(crate) fn exec<P: rusqlite::Params>(
        &self,
        sql: &str,
        params: P,
    ) -> rusqlite::Result<usize> {
        self.tx.prepare_cached(sql)?.execute(params)
    }

    /// `query_row` through the connection's prepared-statement cache.
    pub(crate) fn row<T, P: rusqlite::Params>(
        &self,
        sql: &str,
        params: P,
        f: impl FnOnce(&rusqlite::Row<'_>) -> rusqlite::Result<T>,
    ) -> rusqlite::Result<T> {
        self.tx.prepare_cached(sql)?.query_row(params, f)
    }

    /// The chain's head as this transaction sees it (with what it appended).
    pub(crate) fn head_now(&self) -> Result<Option<(i64, String)>, Fail> {
        match &self.head {
            Some(head) => Ok(Some(head.clone())),
            None => read_head(self.tx),
        }
    }

    /// Appends one event to the hash chain inside this transaction.
    /// `data` must be a JSON object; it is stored in canonical form.
    pub(crate) fn event(&mut self, tree: Option<TreeId>, event: &Event) -> Result<i64, Fail> {
        let Some(kind) = event.kind() else {
            return Err(LedgerError::Invariant(
                "an event of a kind this build does not know is never written".into(),
            )
            .into());
        };
        let data = event.to_data()?;
        if !data.is_object() {
            return Err(LedgerError::Invariant(format!(
                "event data for {kind} must be a JSON object"
            ))
            .into());
        }
        let mut data = data;
        if let (Some((at, batch)), Some(obj)) = (&self.late, data.as_object_mut()) {
            obj.insert(
                "deferred_from".into(),
                serde_json::Value::String(at.clone()),
            );
            obj.insert(
                "deferred_batch".into(),
                serde_json::Value::String(batch.clone()),
            );
        }
        let (prev_seq, prev_hash) = match self.head.take() {
            Some(head) => head,
            None => read_head(self.tx)?.unwrap_or_else(|| (0, chain::GENESIS.to_string())),
        };
        let seq = prev_seq + 1;
        let tree = tree.map(|t| t.0);
        // Canonicalized once: the stored text is what the hash covers.
        let data_text = chain::canonical_string(&data);
        let hash =
            chain::event_hash_of_text(&prev_hash, seq, &self.now, tree, kind.as_str(), &data_text);
        self.exec(
            "INSERT INTO events (seq, at, tree, kind, data, prev_hash, hash)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
            params![
                seq,
                self.now,
                tree,
                kind.as_str(),
                data_text,
                prev_hash,
                hash
            ],
        )?;
        self.head = Some((seq, hash));
        self.appended = true;
        Ok(seq)
    }
}

/// The newest event's (seq, hash).
pub(crate) fn read_head(conn: &Connection) -> Result<Option<(i64, String)>, Fail> {
    Ok(conn
        .prepare_cached("SELECT seq, hash FROM events ORDER BY seq DESC LIMIT 1")?
        .query_row([], |row| Ok((row.get(0)?, row.get(1)?)))
        .optional()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_authority_commit_leaves_the_wal_checkpoint_to_the_next_commit() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("ledger.db");
        let handle = start(&path, Duration::from_secs(5), 0).expect("ledger");
        let db_size = || std::fs::metadata(&path).expect("ledger file").len();
        let write = |durability: Durability, key: &'static str, bytes: usize| {
            handle
                .call(move |store| {
                    store.write(durability, move |w| {
                        w.exec(
                            "INSERT INTO ledger_meta (key, value) VALUES (?1, ?2)",
                            params![key, "x".repeat(bytes)],
                        )
                        .map(|_| ())
                        .map_err(Fail::from)
                    })
                })
                .expect("written");
        };
        let before = db_size();
        // 6 MB in one authority commit: past the 1,000-page threshold (4 MB).
        write(Durability::Authority, "test_big", 6 << 20);
        assert!(
            db_size() < before + (1 << 20),
            "the authority commit copied its WAL into the database: {} -> {}",
            before,
            db_size()
        );
        write(Durability::Normal, "test_small", 10);
        let after = db_size();
        assert!(
            after > before + (5 << 20),
            "the next commit checkpoints: {before} -> {after}"
        );
        // Any other FULL commit (a spawn's release) keeps SQLite's checkpoint.
        write(Durability::Full, "test_big_full", 6 << 20);
        assert!(
            db_size() > after + (5 << 20),
            "a FULL commit past the threshold checkpoints: {after} -> {}",
            db_size()
        );
    }

    #[test]
    fn a_ledger_with_0006_but_not_0005_gets_0005_and_version_6() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("ledger.db");
        {
            let conn = Connection::open(&path).expect("open");
            for sql in [
                include_str!("../../migrations/0001_init.sql"),
                include_str!("../../migrations/0002_tree_options.sql"),
                include_str!("../../migrations/0003_instance.sql"),
                include_str!("../../migrations/0004_first_signal.sql"),
                include_str!("../../migrations/0006_principals.sql"),
            ] {
                conn.execute_batch(sql).expect("migration");
            }
            conn.pragma_update(None, "user_version", 5)
                .expect("version");
        }
        let handle = start(&path, Duration::from_secs(1), 0).expect("opens");
        drop(handle);
        let conn = Connection::open(&path).expect("open");
        let version: i64 = conn
            .pragma_query_value(None, "user_version", |r| r.get(0))
            .expect("version");
        // 0005 now, then every later migration.
        assert_eq!(version, MIGRATIONS.len() as i64);
        let tables: i64 = conn
            .query_row(
                "SELECT count(*) FROM sqlite_master WHERE name IN ('ship_cursor', 'tree_counts', 'api_tokens')",
                [],
                |r| r.get(0),
            )
            .expect("tables");
        assert_eq!(tables, 3);
    }

    /// A ledger with every migration applied (by [`start`]), opened raw.
    fn migrated() -> (tempfile::TempDir, Connection) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("ledger.db");
        drop(start(&path, Duration::from_secs(1), 0).expect("opens"));
        let conn = Connection::open(&path).expect("open");
        (dir, conn)
    }

    /// Migration 0008 (Windows' Job Objects): a tree may record boundary `job` and a
    /// signal target kind `job`, the CHECKs still refuse anything else, and
    /// a TERMINATE_JOB / TERMINATE_PROCESS row without an authorization of
    /// its tree is refused by the database, one with it accepted.
    #[test]
    fn migration_0008_takes_the_job_boundary_and_guards_its_terminate() {
        let (_dir, conn) = migrated();
        conn.execute_batch(
            "INSERT INTO owners (id, pid, start_ticks, boot_id, kind, created_at)
             VALUES (1, 10, 1, 'b', 'run', 'now');",
        )
        .expect("an owner");
        let tree = |boundary: &str| {
            conn.execute(
                "INSERT INTO trees (state, boundary, owner_id, argv, created_at) VALUES ('running', ?1, 1, '[]', 'now')",
                [boundary],
            )
        };
        tree("job").expect("boundary job accepted");
        assert!(tree("jail").is_err(), "the boundary CHECK still holds");
        let signal = |sig: &str, kind: &str, auth: Option<i64>| {
            conn.execute(
                "INSERT INTO signals (tree_id, signal, target_kind, target, result, authorization_id, at)
                 VALUES (1, ?1, ?2, 'job:tw-1', 'sent', ?3, 'now')",
                rusqlite::params![sig, kind, auth],
            )
        };
        assert!(signal("TERMINATE_JOB", "job", None).is_err());
        assert!(signal("TERMINATE_PROCESS", "pid", None).is_err());
        assert!(
            signal("CTRL_BREAK", "nowhere", None).is_err(),
            "the target_kind CHECK still holds"
        );
        signal("CTRL_BREAK", "group", None).expect("a break needs no authorization");
        conn.execute(
            "INSERT INTO kill_authorizations (tree_id, reason, targets, at) VALUES (1, 'test', '[]', 'now')",
            [],
        )
        .expect("an authorization");
        let auth = conn.last_insert_rowid();
        signal("TERMINATE_JOB", "job", Some(auth)).expect("an authorized terminate");
    }

    /// Migration 0009: the statements a teardown runs for every
    /// member (an observation: survivor, exit, escape), for every signal and
    /// state change, and a new tree, owner and token, build no ephemeral
    /// table (an IN list in a CHECK or a trigger's WHEN built one per row);
    /// every CHECK and trigger the edit touched still refuses what it did.
    #[test]
    fn migration_0009_builds_no_ephemeral_table_per_row_and_refuses_as_before() {
        let (_dir, conn) = migrated();
        let owner = |kind: &str| {
            conn.execute(
                "INSERT INTO owners (pid, start_ticks, boot_id, kind, created_at) VALUES (10, 1, 'b', ?1, 'now')",
                [kind],
            )
        };
        owner("run").expect("an owner");
        let tree = |state: &str, boundary: &str, first: Option<&str>| {
            conn.execute(
                "INSERT INTO trees (state, boundary, owner_id, argv, created_at, first_signal)
                 VALUES (?1, ?2, 1, '[]', 'now', ?3)",
                rusqlite::params![state, boundary, first],
            )
        };
        tree("running", "cgroup", Some("SIGINT")).expect("a tree");
        tree("ended", "session", None).expect("an ended tree");
        let statements = [
            "INSERT INTO observations (tree_id, kind, pid, start_ticks, boot_id, at, detail)
             VALUES (1, 'survivor', 3, 4, 'b', 'now', '{}') ON CONFLICT DO NOTHING",
            "INSERT INTO signals (tree_id, signal, target_kind, target, result, authorization_id, at)
             VALUES (1, 'SIGTERM', 'group', '5', 'sent', NULL, 'now')",
            "UPDATE trees SET state = 'terminating' WHERE id = 1",
            "INSERT INTO trees (state, boundary, owner_id, argv, created_at, first_signal)
             VALUES ('spawning', 'cgroup', 1, '[]', 'now', 'SIGTERM')",
            "INSERT INTO owners (pid, start_ticks, boot_id, kind, created_at) VALUES (11, 1, 'b', 'service', 'now')",
            "INSERT INTO api_tokens (name, scope, sha256, created_at)
             VALUES ('t', 'read', '0000000000000000000000000000000000000000000000000000000000000000', 'now')",
        ];
        for sql in statements {
            let mut stmt = conn.prepare(&format!("EXPLAIN {sql}")).expect("explain");
            let ops: Vec<String> = stmt
                .query_map([], |r| r.get::<_, String>(1))
                .expect("opcodes")
                .collect::<Result<_, _>>()
                .expect("opcodes");
            assert!(
                ops.iter()
                    .any(|o| o == "Insert" || o == "Program" || o == "IdxInsert"),
                "{ops:?}"
            );
            assert!(!ops.iter().any(|o| o == "OpenEphemeral"), "{sql}: {ops:?}");
        }
        // The same refusals as before the edit.
        assert!(owner("robot").is_err(), "owners.kind");
        assert!(tree("sleeping", "cgroup", None).is_err(), "trees.state");
        assert!(tree("running", "jail", None).is_err(), "trees.boundary");
        assert!(
            tree("running", "cgroup", Some("SIGKILL")).is_err(),
            "trees.first_signal"
        );
        tree("ambiguous", "job", Some("SIGUSR2")).expect("the last value of each list");
        let observation = |kind: &str| {
            conn.execute(
                "INSERT INTO observations (tree_id, kind, pid, start_ticks, boot_id, at, detail)
                 VALUES (1, ?1, 3, 4, 'b', 'now', '{}')",
                [kind],
            )
        };
        observation("exit").expect("an exit");
        assert!(observation("rumour").is_err(), "observations.kind");
        let signal = |sig: &str, kind: &str| {
            conn.execute(
                "INSERT INTO signals (tree_id, signal, target_kind, target, result, at)
                 VALUES (1, ?1, ?2, '5', 'sent', 'now')",
                [sig, kind],
            )
        };
        signal("SIGTERM", "job").expect("a signal");
        assert!(signal("SIGTERM", "planet").is_err(), "signals.target_kind");
        assert!(
            signal("TERMINATE_PROCESS", "pid").is_err(),
            "a terminate needs authority"
        );
        let token = |scope: &str| {
            conn.execute(
                "INSERT INTO api_tokens (name, scope, sha256, created_at) VALUES ('u', ?1, ?2, 'now')",
                [scope, &format!("{scope:1>64}")],
            )
        };
        token("admin").expect("a token");
        assert!(token("root").is_err(), "api_tokens.scope");
        assert!(
            conn.execute("UPDATE trees SET state = 'running' WHERE id = 2", [])
                .is_err(),
            "a terminal tree stays terminal"
        );
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn the_reserve_is_allocated_past_the_wals_end_and_zero_is_none() {
        use std::os::unix::fs::MetadataExt;
        let allocated = |reserve: u64| {
            let dir = tempfile::tempdir().expect("tempdir");
            let path = dir.path().join("ledger.db");
            let _handle = start(&path, Duration::from_secs(1), reserve).expect("start");
            let wal = std::fs::metadata(dir.path().join("ledger.db-wal")).expect("the WAL");
            (wal.blocks() * 512, wal.len())
        };
        let (blocks, len) = allocated(1 << 20);
        assert!(blocks >= 1 << 20, "1 MiB allocated: {blocks}");
        assert!(len < 1 << 20, "its length is SQLite's: {len}");
        let (blocks, _) = allocated(0);
        assert!(blocks < 1 << 20, "none asked, none made: {blocks}");
    }

    #[test]
    fn a_panicking_job_does_not_stop_the_ledger_thread() {
        let dir = tempfile::tempdir().expect("tempdir");
        let handle =
            start(&dir.path().join("ledger.db"), Duration::from_secs(1), 0).expect("start");
        let panicked: Result<(), LedgerError> = handle.call(|_| panic!("a bug in one job"));
        assert!(
            panicked.is_err(),
            "the caller of the panicking job gets an error"
        );
        let after = handle.call(|store| store.read(|tx| read_head(tx)));
        assert!(after.is_ok(), "the next job runs: {after:?}");
    }
}
