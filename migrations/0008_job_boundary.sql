-- 0008: the Windows Job Object boundary (issue 27). A Windows tree records
-- boundary 'job' (its Job Object, named in the `cgroup` column as
-- `job:<name>`), and its forced kill is one `TerminateJobObject`, recorded
-- as signal 'TERMINATE_JOB' with target_kind 'job'.
--
-- Both CHECKs only grow (a value is added to an IN list): no row that was
-- valid becomes invalid and the on-disk format is unchanged, so SQLite's
-- documented in-place edit of sqlite_schema is enough (no table rebuild,
-- which `trees` with its foreign keys and triggers could not have inside
-- the migration's transaction). The CREATE TRIGGER below bumps the schema
-- cookie, so every connection re-reads the edited schema; RESET re-reads
-- it on this one.
PRAGMA writable_schema = ON;
UPDATE sqlite_schema
   SET sql = replace(sql, 'CHECK (boundary IN (''cgroup'', ''session''))',
                          'CHECK (boundary IN (''cgroup'', ''session'', ''job''))')
 WHERE type = 'table' AND name = 'trees';
UPDATE sqlite_schema
   SET sql = replace(sql, 'CHECK (target_kind IN (''group'', ''cgroup'', ''pid''))',
                          'CHECK (target_kind IN (''group'', ''cgroup'', ''pid'', ''job''))')
 WHERE type = 'table' AND name = 'signals';
PRAGMA writable_schema = OFF;
PRAGMA writable_schema = RESET;

-- The database itself refuses a TerminateJobObject (or TerminateProcess)
-- row without a kill authorization of the same tree, as it refuses a
-- SIGKILL row (0001).
CREATE TRIGGER signals_terminate_needs_authority
BEFORE INSERT ON signals
WHEN NEW.signal IN ('TERMINATE_JOB', 'TERMINATE_PROCESS') AND NOT EXISTS (
    SELECT 1 FROM kill_authorizations ka
    WHERE ka.id = NEW.authorization_id AND ka.tree_id = NEW.tree_id
)
BEGIN
    SELECT RAISE(ABORT, 'invariant: a forced terminate without a kill authorization for this tree');
END;
