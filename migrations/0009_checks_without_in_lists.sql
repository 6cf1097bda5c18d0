-- 0009: every CHECK that lists values, and the two triggers on rows the
-- custody path writes, compare with `=` chains, not IN lists (issue 30; the
-- prune's trigger and view keep theirs). SQLite compiles a constant IN
-- list in a CHECK or a trigger's WHEN into an ephemeral table, built and
-- dropped for every row written: with the bundled SQLite 3.53, 1,000
-- observation inserts (a 1,000-process teardown writes 1,000 survivors
-- before its SIGKILL and 1,000 exits after it) took 2.39 ms with
-- `kind IN (...)`, 1.12 ms with the `=` chain and 1.06 ms with no CHECK.
-- The same values pass and the same are refused (NULL included: both
-- forms are NULL for a NULL operand).
--
-- As in 0008 the on-disk format is unchanged and no row that was valid
-- becomes invalid, so SQLite's documented in-place edit of sqlite_schema is
-- enough for the tables' CHECKs; the triggers are dropped and made again,
-- which bumps the schema cookie (every connection re-reads the schema).
PRAGMA writable_schema = ON;
UPDATE sqlite_schema
   SET sql = replace(sql, 'CHECK (kind IN (''run'', ''client'', ''service''))',
                          'CHECK (kind = ''run'' OR kind = ''client'' OR kind = ''service'')')
 WHERE type = 'table' AND name = 'owners';
UPDATE sqlite_schema
   SET sql = replace(sql, 'CHECK (state IN (''spawning'', ''running'', ''terminating'', ''killing'',
                                                       ''ambiguous'', ''ended'', ''vanished'', ''spawn_failed'',
                                                       ''resolved''))',
                          'CHECK (state = ''spawning'' OR state = ''running'' OR state = ''terminating'' OR state = ''killing'' OR state = ''ambiguous'' OR state = ''ended'' OR state = ''vanished'' OR state = ''spawn_failed'' OR state = ''resolved'')')
 WHERE type = 'table' AND name = 'trees';
UPDATE sqlite_schema
   SET sql = replace(sql, 'CHECK (boundary IN (''cgroup'', ''session'', ''job''))',
                          'CHECK (boundary = ''cgroup'' OR boundary = ''session'' OR boundary = ''job'')')
 WHERE type = 'table' AND name = 'trees';
UPDATE sqlite_schema
   SET sql = replace(sql, 'CHECK (first_signal IS NULL OR first_signal IN (''SIGTERM'', ''SIGINT'', ''SIGHUP'', ''SIGQUIT'', ''SIGUSR1'', ''SIGUSR2''))',
                          'CHECK (first_signal IS NULL OR first_signal = ''SIGTERM'' OR first_signal = ''SIGINT'' OR first_signal = ''SIGHUP'' OR first_signal = ''SIGQUIT'' OR first_signal = ''SIGUSR1'' OR first_signal = ''SIGUSR2'')')
 WHERE type = 'table' AND name = 'trees';
UPDATE sqlite_schema
   SET sql = replace(sql, 'CHECK (kind IN (''escape'', ''exit'', ''survivor''))',
                          'CHECK (kind = ''escape'' OR kind = ''exit'' OR kind = ''survivor'')')
 WHERE type = 'table' AND name = 'observations';
UPDATE sqlite_schema
   SET sql = replace(sql, 'CHECK (target_kind IN (''group'', ''cgroup'', ''pid'', ''job''))',
                          'CHECK (target_kind = ''group'' OR target_kind = ''cgroup'' OR target_kind = ''pid'' OR target_kind = ''job'')')
 WHERE type = 'table' AND name = 'signals';
UPDATE sqlite_schema
   SET sql = replace(sql, 'CHECK (scope IN (''read'', ''spawn'', ''admin''))',
                          'CHECK (scope = ''read'' OR scope = ''spawn'' OR scope = ''admin'')')
 WHERE type = 'table' AND name = 'api_tokens';
PRAGMA writable_schema = OFF;
PRAGMA writable_schema = RESET;

DROP TRIGGER trees_terminal_is_final;
CREATE TRIGGER trees_terminal_is_final
BEFORE UPDATE OF state ON trees
WHEN (OLD.state = 'ended' OR OLD.state = 'vanished' OR OLD.state = 'spawn_failed'
      OR OLD.state = 'resolved')
     AND NEW.state IS NOT OLD.state
BEGIN
    SELECT RAISE(ABORT, 'invariant: a tree never leaves a terminal state');
END;

DROP TRIGGER signals_terminate_needs_authority;
CREATE TRIGGER signals_terminate_needs_authority
BEFORE INSERT ON signals
WHEN (NEW.signal = 'TERMINATE_JOB' OR NEW.signal = 'TERMINATE_PROCESS') AND NOT EXISTS (
    SELECT 1 FROM kill_authorizations ka
    WHERE ka.id = NEW.authorization_id AND ka.tree_id = NEW.tree_id
)
BEGIN
    SELECT RAISE(ABORT, 'invariant: a forced terminate without a kill authorization for this tree');
END;
