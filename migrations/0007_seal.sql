-- 0007: sealed evidence (issue 28). `ledger.seal` events (the setup, one
-- seal per epoch, the close) are read back by the sealer on every epoch and
-- by `verify`: a partial index holds just them, so finding the setup and
-- the newest seal costs nothing however long the ledger is, and the other
-- events' inserts pay only the index's WHERE.
CREATE INDEX events_seal ON events (seq) WHERE kind = 'ledger.seal';

-- A prune never removes a seal: epochs must stay consecutive from the setup
-- for `verify --seal-key` to prove that none was stripped. The guard of
-- 0005 is the same but for that one condition.
DROP TRIGGER events_no_delete;
CREATE TRIGGER events_no_delete BEFORE DELETE ON events
WHEN OLD.kind = 'ledger.seal' OR NOT EXISTS (
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
    SELECT RAISE(ABORT, 'invariant: events are append-only (only a prune, under its ledger.checkpoint, deletes; never a seal)');
END;
