-- Analyses and their hypotheses (ADR 0015 decisions 4-5). Events are immutable, so the
-- mutable state (a hypothesis's status, an analysis being superseded) lives here; every
-- change is also an event in the analysed session's log, written through the outbox.

-- A row exists only for a completed analysis: a failed run writes none, so a retry of a
-- failed analysis is allowed while a duplicate of a completed one is not.
CREATE TABLE psychologist_analyses (
    id                  uuid PRIMARY KEY,
    project_id          text        NOT NULL,
    session_id          uuid        NOT NULL,
    tier                text        NOT NULL CHECK (tier IN ('leve', 'pesada')),
    agent_slug          text        NOT NULL,
    run_id              text        NOT NULL,
    triggered_by        text        NOT NULL CHECK (triggered_by IN ('auto', 'manual')),
    termination_class   text        NOT NULL,
    termination_reason  text,
    event_count         integer     NOT NULL CHECK (event_count >= 0),
    iterations          integer     NOT NULL CHECK (iterations >= 1),
    cost_micros         bigint      NOT NULL CHECK (cost_micros >= 0),
    -- Reanalysis marks the previous analysis superseded; it is never deleted.
    superseded          boolean     NOT NULL DEFAULT false,
    -- Deferred: the old row is marked before the new one is inserted (the unique index
    -- below must never see two current rows), yet it names the new one.
    superseded_by       uuid REFERENCES psychologist_analyses (id) DEFERRABLE INITIALLY DEFERRED,
    created_at          timestamptz NOT NULL DEFAULT now()
);
-- At most one current analysis per session, always: the safety net under the
-- `already_analyzed` pre-check for real races (decision 5).
CREATE UNIQUE INDEX psychologist_analyses_current_idx
    ON psychologist_analyses (session_id) WHERE superseded = false;

CREATE TABLE psychologist_hypotheses (
    id                    uuid PRIMARY KEY,
    analysis_id           uuid        NOT NULL REFERENCES psychologist_analyses (id),
    -- Its place in the emitted batch: the order the model gave them in.
    position              smallint    NOT NULL CHECK (position >= 0),
    project_id            text        NOT NULL,
    session_id            uuid        NOT NULL,
    target_agent          text        NOT NULL,
    statement             text        NOT NULL,
    confidence            integer     NOT NULL CHECK (confidence BETWEEN 0 AND 100),
    evidence_event_ids    uuid[]      NOT NULL CHECK (cardinality(evidence_event_ids) >= 1),
    termination_analysis  text,
    status                text        NOT NULL DEFAULT 'proposed'
                          CHECK (status IN ('proposed', 'accepted', 'dismissed')),
    decided_at            timestamptz,
    decided_by            text,
    created_at            timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX psychologist_hypotheses_project_idx
    ON psychologist_hypotheses (project_id, target_agent, created_at);
CREATE INDEX psychologist_hypotheses_analysis_idx ON psychologist_hypotheses (analysis_id);
