-- Handoffs (mutable status; every transition is also an event in the log) and
-- activations. No unique index enforces "one offered per (project, target)": the
-- rule is kept under an advisory lock, so duplicates from before it converge with
-- events instead of being cleaned up silently (ADR 0182 decision 3).

CREATE TABLE handoffs (
    id             uuid PRIMARY KEY,
    project_id     text        NOT NULL,
    session_id     uuid        NOT NULL,
    from_agent     text        NOT NULL,
    to_agent       text        NOT NULL,
    artifact_id    uuid,
    status         text        NOT NULL
                   CHECK (status IN ('offered', 'accepted', 'completed', 'rejected', 'superseded')),
    superseded_by  uuid REFERENCES handoffs (id),
    created_at     timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX handoffs_pending_idx ON handoffs (project_id, to_agent, created_at)
    WHERE status = 'offered';
CREATE INDEX handoffs_project_idx ON handoffs (project_id, created_at);

-- Which agent is active in which session; `ended_at` is set when the session closes.
CREATE TABLE activations (
    project_id    text        NOT NULL,
    session_id    uuid        NOT NULL,
    agent         text        NOT NULL,
    via           text        NOT NULL CHECK (via IN ('accept', 'direct', 'execution', 'user')),
    handoff_id    uuid REFERENCES handoffs (id),
    activated_at  timestamptz NOT NULL DEFAULT now(),
    ended_at      timestamptz,
    PRIMARY KEY (session_id, agent)
);
CREATE INDEX activations_active_idx ON activations (project_id, agent) WHERE ended_at IS NULL;

-- Sessions the log announced as closed; activity in them has ended.
CREATE TABLE closed_sessions (
    session_id  uuid PRIMARY KEY,
    closed_at   timestamptz NOT NULL DEFAULT now()
);
