-- The session log. `events` is append-only: a trigger refuses UPDATE and DELETE.

CREATE TABLE sessions (
    id                  uuid PRIMARY KEY,
    project_id          text        NOT NULL,
    opened_by           text        NOT NULL,
    status              text        NOT NULL DEFAULT 'open'
                        CHECK (status IN ('open', 'closed', 'closed_abnormally')),
    -- null for a normal close (ADR 0015 decision 6)
    termination_reason  text,
    -- the last seq handed out; bumped under the row lock, so seqs have no gaps
    last_seq            bigint      NOT NULL DEFAULT 0,
    opened_at           timestamptz NOT NULL DEFAULT now(),
    closed_at           timestamptz,
    last_heartbeat_at   timestamptz
);
CREATE INDEX sessions_project_idx ON sessions (project_id, opened_at);
CREATE INDEX sessions_reaper_idx ON sessions (last_heartbeat_at)
    WHERE status = 'open' AND last_heartbeat_at IS NOT NULL;

CREATE TABLE events (
    id               uuid PRIMARY KEY,
    session_id       uuid        NOT NULL REFERENCES sessions (id),
    project_id       text        NOT NULL,
    seq              bigint      NOT NULL,
    type             text        NOT NULL,
    actor            text        NOT NULL,
    payload          jsonb       NOT NULL,
    causation_id     uuid,
    idempotency_key  text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    UNIQUE (session_id, seq)
);
CREATE UNIQUE INDEX events_idempotency_idx ON events (session_id, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX events_project_type_idx ON events (project_id, type, created_at);

CREATE FUNCTION events_are_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'session events are append-only (% refused)', TG_OP;
END $$;
CREATE TRIGGER events_append_only BEFORE UPDATE OR DELETE ON events
    FOR EACH ROW EXECUTE FUNCTION events_are_append_only();
