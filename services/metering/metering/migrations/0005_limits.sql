-- Spend limits per project and per person: what they may spend per UTC day and month,
-- and how many requests and tokens per minute. A project's or person's own row
-- overrides the default row (`name` '*') field by field: NULL on an own row means "as
-- the default", NULL on the default means no limit.
CREATE TABLE limits (
    scope               text    NOT NULL CHECK (scope IN ('project', 'person')),
    name                text    NOT NULL,
    micros_per_day      bigint  CHECK (micros_per_day >= 0),
    micros_per_month    bigint  CHECK (micros_per_month >= 0),
    requests_per_minute bigint  CHECK (requests_per_minute >= 0),
    tokens_per_minute   bigint  CHECK (tokens_per_minute >= 0),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (scope, name)
);

-- The defaults every deployment starts with (docs/services.md lists them): $20 a day and
-- $200 a month per project, $10 a day and $100 a month per person; 600 calls and
-- 4,000,000 tokens a minute per project, 120 calls and 1,000,000 tokens per person (a
-- person's burst of messages in a few sessions, each answered by a tool loop of several
-- calls, stays well under them; a runaway loop does not).
INSERT INTO limits (scope, name, micros_per_day, micros_per_month, requests_per_minute,
                    tokens_per_minute)
VALUES ('project', '*', 20000000, 200000000, 600, 4000000),
       ('person',  '*', 10000000, 100000000, 120, 1000000);

-- One row per limited quantity and window: `used` by settled calls, `held` by calls in
-- flight (their worst case, like a run's reservation). A call is admitted only if
-- used + held + its own hold fits under the limit, in the statement that holds it, so
-- parallel calls never promise the same µUSD, request or token twice. A window's row
-- is new at its start (`starts`), which is the reset.
CREATE TABLE usage_counters (
    scope   text        NOT NULL,
    name    text        NOT NULL,
    metric  text        NOT NULL CHECK (metric IN ('micros', 'requests', 'tokens')),
    win     text        NOT NULL CHECK (win IN ('minute', 'day', 'month')),
    starts  timestamptz NOT NULL,
    used    bigint      NOT NULL DEFAULT 0,
    held    bigint      NOT NULL DEFAULT 0 CHECK (held >= 0),
    "limit" bigint      NOT NULL,
    PRIMARY KEY (scope, name, metric, win, starts)
);

-- What a hold holds beyond its run: the counters it was admitted under (as
-- 'scope/metric/win'), for whom, and the tokens it reserved; settled with the hold.
ALTER TABLE budget_holds
    ADD COLUMN project_id  text,
    ADD COLUMN person      text,
    ADD COLUMN tokens_held bigint NOT NULL DEFAULT 0,
    ADD COLUMN counters    text[] NOT NULL DEFAULT '{}';

-- Whose request claimed the turn id (a digest of its run, project, session, person and
-- agent), so that a turn id used again by another is refused instead of answered with
-- the first one's reply.
ALTER TABLE budget_holds ADD COLUMN owner text;
