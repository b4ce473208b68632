-- servicekit's tables, created in every service schema.

-- Outbox: written in the caller's transaction, drained by the relay. Rows are
-- claimed with FOR UPDATE SKIP LOCKED, never by "last id seen" (a BIGSERIAL is
-- assigned at insert, not at commit, so a cursor would skip late commits).
CREATE TABLE outbox (
    id              bigserial PRIMARY KEY,
    subject         text        NOT NULL,
    msg_id          text        NOT NULL,
    body            bytea       NOT NULL,
    headers         jsonb       NOT NULL DEFAULT '{}'::jsonb,
    attempts        integer     NOT NULL DEFAULT 0,
    last_error      text,
    available_at    timestamptz NOT NULL DEFAULT now(),
    created_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX outbox_available_idx ON outbox (available_at, id);

-- Idempotent consumers: one row per (consumer, message) processed, inserted in the
-- same transaction as the effect; a repeat hits the primary key and is "already done".
CREATE TABLE processed_messages (
    consumer        text        NOT NULL,
    msg_id          text        NOT NULL,
    processed_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, msg_id)
);

-- Messages a consumer gave up on: terminated (can never succeed) or out of deliveries.
CREATE TABLE dead_letters (
    id              bigserial PRIMARY KEY,
    consumer        text        NOT NULL,
    stream          text        NOT NULL,
    stream_seq      bigint      NOT NULL,
    subject         text        NOT NULL,
    msg_id          text,
    deliveries      integer     NOT NULL,
    reason          text        NOT NULL,
    body            bytea       NOT NULL,
    recorded_at     timestamptz NOT NULL DEFAULT now(),
    UNIQUE (consumer, stream, stream_seq)
);
