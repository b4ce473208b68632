-- Per-key order for the outbox (a session's events leave in the order they were
-- written, across retries and relay replicas), and the index the claim needs.
ALTER TABLE outbox ADD COLUMN ordering_key text;
CREATE INDEX outbox_ordering_idx ON outbox (ordering_key, id) WHERE ordering_key IS NOT NULL;
