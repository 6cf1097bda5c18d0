-- 0006: principals (issue 17). Who asked for each tree, as whom it runs,
-- and the scoped API tokens of the TCP listener.
--
-- requester_uid: the uid of the principal that asked (peer credentials on
-- the Unix socket; the invoking user for `run`); NULL for trees asked for
-- with a token, and for trees recorded before this migration. A non-admin
-- principal acts only on trees whose requester_uid is its own uid.
-- requested_by: the whole principal as JSON (via, uid, pid, token id, name).
-- run_uid / run_gid: the credentials the tree's root was given before exec
-- (NULL: the service's own, as before this migration).

ALTER TABLE trees ADD COLUMN requester_uid INTEGER CHECK (requester_uid IS NULL OR requester_uid >= 0);
ALTER TABLE trees ADD COLUMN requested_by TEXT
    CHECK (requested_by IS NULL OR (json_valid(requested_by) AND json_type(requested_by) = 'object'));
ALTER TABLE trees ADD COLUMN run_uid INTEGER CHECK (run_uid IS NULL OR run_uid >= 0);
ALTER TABLE trees ADD COLUMN run_gid INTEGER CHECK (run_gid IS NULL OR run_gid >= 0);
CREATE INDEX trees_requester ON trees (requester_uid);

-- Bearer tokens for the TCP listener. Only the SHA-256 of a token is kept;
-- the secret is shown once, when it is made. A token is never deleted (the
-- events name it); revoking sets revoked_at once.
CREATE TABLE api_tokens (
    id         INTEGER PRIMARY KEY,
    name       TEXT    NOT NULL,
    scope      TEXT    NOT NULL CHECK (scope IN ('read', 'spawn', 'admin')),
    sha256     TEXT    NOT NULL UNIQUE CHECK (length(sha256) = 64),
    created_at TEXT    NOT NULL,
    revoked_at TEXT
);

CREATE TRIGGER api_tokens_no_delete BEFORE DELETE ON api_tokens
BEGIN
    SELECT RAISE(ABORT, 'invariant: tokens are revoked, never deleted');
END;
CREATE TRIGGER api_tokens_revoke_only BEFORE UPDATE ON api_tokens
WHEN OLD.revoked_at IS NOT NULL OR NEW.revoked_at IS NULL
    OR NEW.id IS NOT OLD.id OR NEW.name IS NOT OLD.name OR NEW.scope IS NOT OLD.scope
    OR NEW.sha256 IS NOT OLD.sha256 OR NEW.created_at IS NOT OLD.created_at
BEGIN
    SELECT RAISE(ABORT, 'invariant: a token changes only by being revoked, once');
END;
