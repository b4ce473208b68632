-- Issue 12: a run's budget row carries a version, bumped by every write, so a replica
-- that knows the row as it last wrote it can reserve the next turn in one statement
-- (compare-and-set on the version) instead of a locked read-decide-write transaction.
-- A row changed by anyone else (another replica, the sweeper) no longer matches, and
-- the turn is reserved under the row lock as before.
ALTER TABLE run_budgets ADD COLUMN version bigint NOT NULL DEFAULT 0
