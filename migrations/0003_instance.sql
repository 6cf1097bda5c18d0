-- 0003: the ledger's instance id.
--
-- Tree ids are per ledger, but some names a tree gets live outside it: its
-- cgroup, on a host that may run several ledgers (a user's and root's, a
-- test's and the service's). Those names carry this id, made once with the
-- ledger and never changed, so two ledgers can never pick the same name.

CREATE TABLE ledger_meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);

INSERT INTO ledger_meta (key, value) VALUES ('instance_id', lower(hex(randomblob(16))));

CREATE TRIGGER ledger_meta_no_update BEFORE UPDATE ON ledger_meta
BEGIN
    SELECT RAISE(ABORT, 'invariant: ledger metadata is written once');
END;
CREATE TRIGGER ledger_meta_no_delete BEFORE DELETE ON ledger_meta
BEGIN
    SELECT RAISE(ABORT, 'invariant: ledger metadata is written once');
END;
