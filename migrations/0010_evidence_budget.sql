-- The evidence a tree has spent: bytes of its members' command lines, exe
-- and cwd as the ledger stored them (rows and events), counted by the
-- writer as it records them. Past `serve --evidence-max` a new member's
-- argv is recorded by digest (its SHA-256, length and argument count), and
-- the counter is left one past the budget, so the tree's further members
-- are digested without recounting. A plain counter: no event depends on
-- it, retention deletes it with its tree.
ALTER TABLE trees ADD COLUMN evidence_bytes INTEGER NOT NULL DEFAULT 0 CHECK (evidence_bytes >= 0);
