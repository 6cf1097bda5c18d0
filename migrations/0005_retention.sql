-- 0005: retention (issue 15). The append-only guards of 0001 refused every
-- DELETE; they now let exactly one writer through: a prune, inside the
-- transaction in which it appended its `ledger.checkpoint` event. A row may
-- be deleted only while the chain's head is such a checkpoint, and only if
-- that checkpoint covers it:
--   * an event: its seq is at or below the checkpoint's `pruned_through`,
--     and it is tree-less and older than the checkpoint's `before`, or it
--     belongs to a prunable tree;
--   * a tree (and its observations, kill authorizations, signals): the
--     tree is prunable;
-- where a prunable tree is terminal (ended, vanished, spawn_failed,
-- resolved), ended before `before`, and is not a resolved tree whose
-- survivors an operator left alive. A kill authorization is deleted only
-- once no signal row cites it. Every UPDATE of these tables is still
-- refused, and every other DELETE too: the checkpoint is the head only
-- inside the prune's own transaction, since the next write appends after it.
--
-- Also here: the shipping cursor (the last seq an OTLP endpoint
-- acknowledged), a bookkeeping row outside the chain.

DROP TRIGGER events_no_delete;
CREATE TRIGGER events_no_delete BEFORE DELETE ON events
WHEN NOT EXISTS (
    SELECT 1 FROM events h
    WHERE h.seq = (SELECT max(seq) FROM events)
      AND h.kind = 'ledger.checkpoint'
      AND OLD.seq < h.seq
      AND OLD.seq <= json_extract(h.data, '$.pruned_through')
      AND ((OLD.tree IS NULL AND OLD.at < json_extract(h.data, '$.before'))
           OR EXISTS (
               SELECT 1 FROM trees t
               WHERE t.id = OLD.tree
                 AND t.state IN ('ended', 'vanished', 'spawn_failed', 'resolved')
                 AND t.ended_at < json_extract(h.data, '$.before')
                 AND NOT (t.state = 'resolved'
                          AND EXISTS (SELECT 1 FROM json_each(t.flags) WHERE value = 'survivors_left')
                          AND NOT EXISTS (SELECT 1 FROM json_each(t.flags) WHERE value = 'survivors_ended'))))
)
BEGIN
    SELECT RAISE(ABORT, 'invariant: events are append-only (only a prune, under its ledger.checkpoint, deletes)');
END;

-- Whether tree `id` may be deleted now (its rows and itself): used by the
-- guards below through a view, so the rule is written once.
CREATE VIEW prunable_trees AS
SELECT t.id AS id FROM trees t, events h
WHERE h.seq = (SELECT max(seq) FROM events)
  AND h.kind = 'ledger.checkpoint'
  AND t.state IN ('ended', 'vanished', 'spawn_failed', 'resolved')
  AND t.ended_at < json_extract(h.data, '$.before')
  AND NOT (t.state = 'resolved'
           AND EXISTS (SELECT 1 FROM json_each(t.flags) WHERE value = 'survivors_left')
           AND NOT EXISTS (SELECT 1 FROM json_each(t.flags) WHERE value = 'survivors_ended'));

DROP TRIGGER trees_no_delete;
CREATE TRIGGER trees_no_delete BEFORE DELETE ON trees
WHEN NOT EXISTS (SELECT 1 FROM prunable_trees p WHERE p.id = OLD.id)
BEGIN
    SELECT RAISE(ABORT, 'invariant: trees are never deleted (but by a prune, under its ledger.checkpoint)');
END;

DROP TRIGGER observations_no_delete;
CREATE TRIGGER observations_no_delete BEFORE DELETE ON observations
WHEN NOT EXISTS (SELECT 1 FROM prunable_trees p WHERE p.id = OLD.tree_id)
BEGIN
    SELECT RAISE(ABORT, 'invariant: observations are append-only');
END;

DROP TRIGGER signals_no_delete;
CREATE TRIGGER signals_no_delete BEFORE DELETE ON signals
WHEN NOT EXISTS (SELECT 1 FROM prunable_trees p WHERE p.id = OLD.tree_id)
BEGIN
    SELECT RAISE(ABORT, 'invariant: signals are append-only');
END;

DROP TRIGGER kill_authorizations_no_delete;
CREATE TRIGGER kill_authorizations_no_delete BEFORE DELETE ON kill_authorizations
WHEN NOT EXISTS (SELECT 1 FROM prunable_trees p WHERE p.id = OLD.tree_id)
  OR EXISTS (SELECT 1 FROM signals s WHERE s.authorization_id = OLD.id)
BEGIN
    SELECT RAISE(ABORT, 'invariant: kill authorizations are append-only (and never deleted while a signal cites them)');
END;

-- Members had no delete guard; they get the same one.
CREATE TRIGGER members_no_delete BEFORE DELETE ON members
WHEN NOT EXISTS (SELECT 1 FROM prunable_trees p WHERE p.id = OLD.tree_id)
BEGIN
    SELECT RAISE(ABORT, 'invariant: members are deleted only by a prune');
END;

CREATE TABLE ship_cursor (
    sink  TEXT PRIMARY KEY,
    seq   INTEGER NOT NULL CHECK (seq >= 0),
    at    TEXT    NOT NULL
);

-- Trees by state, kept by triggers: the dashboard's index and /metrics
-- read the counts on every request, and `GROUP BY state` over every tree
-- grew with the ledger (2.8x slower index at 1M events than at 10k,
-- docs/PERFORMANCE.md). A bookkeeping table: the triggers are its only writers.
CREATE TABLE tree_counts (
    state TEXT PRIMARY KEY,
    n     INTEGER NOT NULL CHECK (n >= 0)
);
INSERT INTO tree_counts (state, n) SELECT state, count(*) FROM trees WHERE true GROUP BY state;

CREATE TRIGGER tree_counts_insert AFTER INSERT ON trees
BEGIN
    INSERT INTO tree_counts (state, n) VALUES (NEW.state, 1)
        ON CONFLICT (state) DO UPDATE SET n = n + 1;
END;

CREATE TRIGGER tree_counts_update AFTER UPDATE OF state ON trees
WHEN OLD.state IS NOT NEW.state
BEGIN
    UPDATE tree_counts SET n = n - 1 WHERE state = OLD.state;
    INSERT INTO tree_counts (state, n) VALUES (NEW.state, 1)
        ON CONFLICT (state) DO UPDATE SET n = n + 1;
END;

CREATE TRIGGER tree_counts_delete AFTER DELETE ON trees
BEGIN
    UPDATE tree_counts SET n = n - 1 WHERE state = OLD.state;
END;
