-- 0004: the teardown's first signal, recorded with the tree (`run -s SIG`),
-- so a sweep that resumes the teardown of a dead `run` sends the signal the
-- tree was given, not SIGTERM. NULL: SIGTERM (the default, and every tree
-- recorded before this migration).

ALTER TABLE trees ADD COLUMN first_signal TEXT
    CHECK (first_signal IS NULL OR first_signal IN ('SIGTERM', 'SIGINT', 'SIGHUP', 'SIGQUIT', 'SIGUSR1', 'SIGUSR2'));
