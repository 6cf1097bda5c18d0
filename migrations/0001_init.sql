-- 0001: the authority ledger.
--
-- Invariants live here, in the database, so that no code path (present or
-- future, in any treewarden process sharing this file) can break them:
--   * a SIGKILL signal row must reference a kill authorization of the same tree;
--   * events, observations and kill_authorizations are append-only;
--   * a tree never leaves a terminal state, and only an ambiguous tree is resolved.
-- The connection runs with recursive_triggers=ON so that INSERT OR REPLACE
-- (which deletes the old row) also meets the DELETE guards below.

CREATE TABLE owners (
    id          INTEGER PRIMARY KEY,
    pid         INTEGER NOT NULL,
    start_ticks INTEGER NOT NULL,
    boot_id     TEXT    NOT NULL,
    kind        TEXT    NOT NULL CHECK (kind IN ('run', 'client', 'service')),
    created_at  TEXT    NOT NULL,
    UNIQUE (pid, start_ticks, boot_id, kind)
);

CREATE TABLE trees (
    id               INTEGER PRIMARY KEY,
    label            TEXT,
    state            TEXT    NOT NULL CHECK (state IN ('spawning', 'running', 'terminating', 'killing',
                                                       'ambiguous', 'ended', 'vanished', 'spawn_failed',
                                                       'resolved')),
    boundary         TEXT    NOT NULL CHECK (boundary IN ('cgroup', 'session')),
    owner_id         INTEGER NOT NULL REFERENCES owners (id),
    argv             TEXT    NOT NULL CHECK (json_valid(argv) AND json_type(argv) = 'array'),
    cwd              TEXT,
    root_pid         INTEGER,
    root_start_ticks INTEGER,
    boot_id          TEXT,
    pgid             INTEGER,
    sid              INTEGER,
    cgroup           TEXT,
    created_at       TEXT    NOT NULL,
    ended_at         TEXT,
    exit_code        INTEGER,
    exit_signal      INTEGER,
    flags            TEXT    NOT NULL DEFAULT '[]' CHECK (json_valid(flags) AND json_type(flags) = 'array'),
    note             TEXT
);
CREATE INDEX trees_state ON trees (state);

CREATE TRIGGER trees_terminal_is_final
BEFORE UPDATE OF state ON trees
WHEN OLD.state IN ('ended', 'vanished', 'spawn_failed', 'resolved') AND NEW.state IS NOT OLD.state
BEGIN
    SELECT RAISE(ABORT, 'invariant: a tree never leaves a terminal state');
END;

CREATE TRIGGER trees_resolve_only_ambiguous
BEFORE UPDATE OF state ON trees
WHEN NEW.state = 'resolved' AND OLD.state IS NOT 'ambiguous'
BEGIN
    SELECT RAISE(ABORT, 'invariant: only an ambiguous tree can be resolved');
END;

CREATE TRIGGER trees_no_delete
BEFORE DELETE ON trees
BEGIN
    SELECT RAISE(ABORT, 'invariant: trees are never deleted');
END;

CREATE TABLE members (
    id          INTEGER PRIMARY KEY,
    tree_id     INTEGER NOT NULL REFERENCES trees (id),
    pid         INTEGER NOT NULL,
    start_ticks INTEGER NOT NULL,
    boot_id     TEXT    NOT NULL,
    ppid        INTEGER,
    pgid        INTEGER,
    sid         INTEGER,
    cgroup      TEXT,
    uid         INTEGER,
    exe         TEXT,
    cmdline     TEXT    CHECK (cmdline IS NULL OR json_valid(cmdline)),
    cwd         TEXT,
    first_seen  TEXT    NOT NULL,
    last_seen   TEXT    NOT NULL,
    exited_at   TEXT,
    exit_code   INTEGER,
    exit_signal INTEGER,
    escaped_at  TEXT,
    UNIQUE (tree_id, pid, start_ticks, boot_id)
);

-- Escape findings are monotonic: once set, escaped_at never changes.
CREATE TRIGGER members_escape_is_monotonic
BEFORE UPDATE OF escaped_at ON members
WHEN OLD.escaped_at IS NOT NULL AND NEW.escaped_at IS NOT OLD.escaped_at
BEGIN
    SELECT RAISE(ABORT, 'invariant: an escape finding is never erased');
END;

-- Append-only forensic record: escapes, exits, survivor snapshots.
CREATE TABLE observations (
    id          INTEGER PRIMARY KEY,
    tree_id     INTEGER NOT NULL REFERENCES trees (id),
    kind        TEXT    NOT NULL CHECK (kind IN ('escape', 'exit', 'survivor')),
    pid         INTEGER NOT NULL,
    start_ticks INTEGER NOT NULL,
    boot_id     TEXT    NOT NULL,
    at          TEXT    NOT NULL,
    detail      TEXT    NOT NULL CHECK (json_valid(detail))
);
CREATE INDEX observations_tree ON observations (tree_id);
-- An identity escapes (and exits) at most once per tree.
CREATE UNIQUE INDEX observations_escape_once
    ON observations (tree_id, pid, start_ticks, boot_id) WHERE kind = 'escape';
CREATE UNIQUE INDEX observations_exit_once
    ON observations (tree_id, pid, start_ticks, boot_id) WHERE kind = 'exit';

CREATE TRIGGER observations_no_update BEFORE UPDATE ON observations
BEGIN
    SELECT RAISE(ABORT, 'invariant: observations are append-only');
END;
CREATE TRIGGER observations_no_delete BEFORE DELETE ON observations
BEGIN
    SELECT RAISE(ABORT, 'invariant: observations are append-only');
END;

CREATE TABLE scans (
    id          INTEGER PRIMARY KEY,
    tree_id     INTEGER REFERENCES trees (id),
    at          TEXT    NOT NULL,
    duration_us INTEGER NOT NULL,
    processes   INTEGER NOT NULL,
    members     INTEGER NOT NULL,
    escapes     INTEGER NOT NULL
);

CREATE TABLE kill_authorizations (
    id      INTEGER PRIMARY KEY,
    tree_id INTEGER NOT NULL REFERENCES trees (id),
    reason  TEXT    NOT NULL,
    targets TEXT    NOT NULL CHECK (json_valid(targets) AND json_type(targets) = 'array'),
    at      TEXT    NOT NULL
);
CREATE INDEX kill_authorizations_tree ON kill_authorizations (tree_id);

CREATE TRIGGER kill_authorizations_no_update BEFORE UPDATE ON kill_authorizations
BEGIN
    SELECT RAISE(ABORT, 'invariant: kill authorizations are append-only');
END;
CREATE TRIGGER kill_authorizations_no_delete BEFORE DELETE ON kill_authorizations
BEGIN
    SELECT RAISE(ABORT, 'invariant: kill authorizations are append-only');
END;

CREATE TABLE signals (
    id               INTEGER PRIMARY KEY,
    tree_id          INTEGER NOT NULL REFERENCES trees (id),
    signal           TEXT    NOT NULL,
    target_kind      TEXT    NOT NULL CHECK (target_kind IN ('group', 'cgroup', 'pid')),
    target           TEXT    NOT NULL,
    result           TEXT    NOT NULL,
    authorization_id INTEGER REFERENCES kill_authorizations (id),
    at               TEXT    NOT NULL
);
CREATE INDEX signals_tree ON signals (tree_id);

CREATE TRIGGER signals_sigkill_needs_authority
BEFORE INSERT ON signals
WHEN NEW.signal = 'SIGKILL' AND NOT EXISTS (
    SELECT 1 FROM kill_authorizations ka
    WHERE ka.id = NEW.authorization_id AND ka.tree_id = NEW.tree_id
)
BEGIN
    SELECT RAISE(ABORT, 'invariant: SIGKILL without a kill authorization for this tree');
END;

CREATE TRIGGER signals_no_update BEFORE UPDATE ON signals
BEGIN
    SELECT RAISE(ABORT, 'invariant: signals are append-only');
END;
CREATE TRIGGER signals_no_delete BEFORE DELETE ON signals
BEGIN
    SELECT RAISE(ABORT, 'invariant: signals are append-only');
END;

-- The hash-chained audit trail. seq is gapless (max + 1, assigned inside the
-- writing transaction); hash = sha256(prev_hash || canonical event), see
-- src/ledger/mod.rs for the canonical form.
CREATE TABLE events (
    seq       INTEGER PRIMARY KEY,
    at        TEXT    NOT NULL,
    tree      INTEGER REFERENCES trees (id),
    kind      TEXT    NOT NULL,
    data      TEXT    NOT NULL CHECK (json_valid(data) AND json_type(data) = 'object'),
    prev_hash TEXT    NOT NULL CHECK (length(prev_hash) = 64),
    hash      TEXT    NOT NULL CHECK (length(hash) = 64)
);
CREATE INDEX events_tree ON events (tree, seq);
CREATE INDEX events_at ON events (at);

CREATE TRIGGER events_gapless
BEFORE INSERT ON events
WHEN NEW.seq IS NOT (SELECT coalesce(max(seq), 0) + 1 FROM events)
BEGIN
    SELECT RAISE(ABORT, 'invariant: event seq must be the next one (gapless)');
END;

CREATE TRIGGER events_linked
BEFORE INSERT ON events
WHEN NEW.prev_hash IS NOT coalesce((SELECT hash FROM events WHERE seq = NEW.seq - 1),
                                   '0000000000000000000000000000000000000000000000000000000000000000')
BEGIN
    SELECT RAISE(ABORT, 'invariant: event prev_hash must be the hash of the previous event');
END;

CREATE TRIGGER events_no_update BEFORE UPDATE ON events
BEGIN
    SELECT RAISE(ABORT, 'invariant: events are append-only');
END;
CREATE TRIGGER events_no_delete BEFORE DELETE ON events
BEGIN
    SELECT RAISE(ABORT, 'invariant: events are append-only');
END;
