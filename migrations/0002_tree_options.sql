-- 0002: what a tree was given, recorded with it (issue 11, the part crash
-- recovery needs). A teardown resumed by a sweep, or a tree re-adopted by a
-- restarted service, uses the tree's own grace and timeout, not a default.
--
-- Both are milliseconds. NULL means "not recorded": trees written before
-- this migration, and trees given no timeout. A reader falls back to its
-- configured default grace for a NULL grace_ms.

ALTER TABLE trees ADD COLUMN grace_ms INTEGER CHECK (grace_ms IS NULL OR grace_ms >= 0);
ALTER TABLE trees ADD COLUMN timeout_ms INTEGER CHECK (timeout_ms IS NULL OR timeout_ms >= 0);
