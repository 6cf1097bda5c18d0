-- A shipping sink's own position of the event at its cursor (JetStream: the
-- stream sequence the server gave it). Kept in the same row as the cursor,
-- so a restored older ledger carries the older position too, and the
-- server's expected-sequence check refuses what it ships next.
ALTER TABLE ship_cursor ADD COLUMN remote_seq INTEGER CHECK (remote_seq IS NULL OR remote_seq >= 0);
