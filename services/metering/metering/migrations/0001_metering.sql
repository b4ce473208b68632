-- Metering: which model each agent uses, what models cost, what runs may spend and
-- what every call consumed.

-- One row per level of the cascade (session > agent > project > workspace). The
-- unique index treats a missing key as a value of its own, so there is one
-- workspace binding, one per project, one per agent (globally or per project) and
-- one per session.
CREATE TABLE bindings (
    id          bigserial PRIMARY KEY,
    scope       text        NOT NULL CHECK (scope IN ('session', 'agent', 'project', 'workspace')),
    project_id  text,
    agent_slug  text,
    session_id  uuid,
    model       text        NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);
CREATE UNIQUE INDEX bindings_level_idx ON bindings (
    scope, coalesce(project_id, ''), coalesce(agent_slug, ''),
    coalesce(session_id, '00000000-0000-0000-0000-000000000000'::uuid)
);

-- List prices in µUSD per million tokens; a new price is a new row with a later
-- effective date, so past calls keep the price they were billed at.
CREATE TABLE prices (
    model                   text    NOT NULL,
    effective_from          date    NOT NULL,
    input_micros            bigint  NOT NULL CHECK (input_micros >= 0),
    output_micros           bigint  NOT NULL CHECK (output_micros >= 0),
    cache_write_5m_micros   bigint  NOT NULL CHECK (cache_write_5m_micros >= 0),
    cache_write_1h_micros   bigint  NOT NULL CHECK (cache_write_1h_micros >= 0),
    cache_read_micros       bigint  NOT NULL CHECK (cache_read_micros >= 0),
    source                  text    NOT NULL,
    PRIMARY KEY (model, effective_from)
);

-- A run's budget: its cap (null: none), what settled turns spent and what live
-- turns hold. Reservations lock this row, so parallel turns of one run serialise
-- on the decision and never promise the same µUSD twice.
CREATE TABLE run_budgets (
    run_id          text        PRIMARY KEY,
    budget_micros   bigint      CHECK (budget_micros >= 0),
    spent_micros    bigint      NOT NULL DEFAULT 0,
    reserved_micros bigint      NOT NULL DEFAULT 0 CHECK (reserved_micros >= 0),
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now()
);

-- One hold per turn: the worst case reserved before the provider is called, settled
-- to the real cost after. Its primary key also claims the turn id, so the same turn
-- can never run twice at once.
CREATE TABLE budget_holds (
    turn_id         text        PRIMARY KEY,
    run_id          text        NOT NULL REFERENCES run_budgets (run_id),
    hold_micros     bigint      NOT NULL CHECK (hold_micros >= 0),
    status          text        NOT NULL DEFAULT 'held' CHECK (status IN ('held', 'settled')),
    cost_micros     bigint,
    created_at      timestamptz NOT NULL DEFAULT now(),
    settled_at      timestamptz
);
CREATE INDEX budget_holds_live_idx ON budget_holds (created_at) WHERE status = 'held';

-- One row per provider call, whatever its outcome; idempotent on turn_id.
CREATE TABLE token_usage (
    turn_id                 text        PRIMARY KEY,
    run_id                  text        NOT NULL,
    kind                    text        NOT NULL CHECK (kind IN ('turn', 'stream')),
    provider                text        NOT NULL,
    model                   text        NOT NULL,
    agent_slug              text        NOT NULL,
    project_id              text        NOT NULL,
    session_id              uuid,
    input_tokens            integer     NOT NULL,
    output_tokens           integer     NOT NULL,
    cache_write_5m_tokens   integer     NOT NULL,
    cache_write_1h_tokens   integer     NOT NULL,
    cache_read_tokens       integer     NOT NULL,
    cost_micros             bigint      NOT NULL,
    status                  text        NOT NULL CHECK (status IN ('ok', 'error', 'cancelled')),
    error_code              text,
    error_message           text,
    started_at              timestamptz NOT NULL,
    first_token_at          timestamptz,
    finished_at             timestamptz NOT NULL,
    -- the whole reply of a successful call, returned again to a caller that repeats the turn
    reply                   jsonb
);
CREATE INDEX token_usage_project_idx ON token_usage (project_id, started_at);
CREATE INDEX token_usage_run_idx ON token_usage (run_id);
