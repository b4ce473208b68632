"""Metering's SQL. Every statement is parameterised; nothing is built from strings."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

import asyncpg

from contracts.common import ErrorCode
from contracts.metering import (
    Binding,
    LimitsSetReply,
    LimitsStatus,
    LimitUse,
    SetBinding,
    SetLimits,
    SpendLimits,
    TokenUsage,
    TurnReply,
    UsageGroup,
    UsageSummaryReply,
    UsageSummaryRequest,
)
from domain.errors import DomainError
from domain.metering import Price, RunBudget, window_end
from servicekit.db import Connection

BINDING_COLUMNS = "scope, project_id, agent_slug, session_id, model, updated_at, provider"


# The compare-and-set reservations (`MeteringRepository.hold_if_unchanged`): a `run` CTE
# writes the run's row only if it is as the caller saw it ($1 turn, $2 run, $3 hold, $4-$6
# the run's new budget, spent and reserved); the claim below is written from its output,
# so never without it. Two shapes of `run`, one claim.
_CLAIM_AFTER_RUN = """,
   claim AS (
       INSERT INTO budget_holds (turn_id, run_id, hold_micros)
       SELECT $1, $2, $3 FROM run
       ON CONFLICT (turn_id) DO NOTHING RETURNING true)
   SELECT (SELECT version FROM run) AS version, EXISTS (SELECT 1 FROM claim) AS claimed"""
# The run's first turn: the row is created, unless someone created it meanwhile.
HOLD_ON_NEW_RUN = (
    """WITH run AS (
       INSERT INTO run_budgets (run_id, budget_micros, spent_micros, reserved_micros, version)
       VALUES ($2, $4, $5, $6, 1)
       ON CONFLICT (run_id) DO NOTHING RETURNING version)"""
    + _CLAIM_AFTER_RUN
)
# A run whose row the caller saw at version $7.
HOLD_ON_SEEN_RUN = (
    """WITH run AS (
       UPDATE run_budgets SET budget_micros = $4, spent_micros = $5, reserved_micros = $6,
              version = version + 1, updated_at = now()
        WHERE run_id = $2 AND version = $7
          AND NOT EXISTS (SELECT 1 FROM budget_holds WHERE turn_id = $1)
       RETURNING version)"""
    + _CLAIM_AFTER_RUN
)


def _limits_in_force(project: str, person: str, amount: str, tokens: str) -> str:
    """CTEs of the limits in force for a project and a person (may be null; parameters,
    e.g. "$2"): each one's own row, field by field over the default row ('*'), and the
    counters a call of `amount` µUSD and `tokens` tokens would hold in the windows open
    now (UTC)."""
    return f"""
   who(scope, name) AS (VALUES ('project', {project}::text), ('person', {person}::text)),
   caps AS (
       SELECT w.scope, w.name,
              coalesce(own.micros_per_day, dflt.micros_per_day) AS micros_per_day,
              coalesce(own.micros_per_month, dflt.micros_per_month) AS micros_per_month,
              coalesce(own.requests_per_minute, dflt.requests_per_minute) AS requests_per_minute,
              coalesce(own.tokens_per_minute, dflt.tokens_per_minute) AS tokens_per_minute
         FROM who w
         LEFT JOIN limits own ON own.scope = w.scope AND own.name = w.name
         LEFT JOIN limits dflt ON dflt.scope = w.scope AND dflt.name = '*'
        WHERE w.name IS NOT NULL),
   wanted AS (
       SELECT c.scope, c.name, m.metric, m.win, date_trunc(m.win, now(), 'UTC') AS starts,
              m.amount, m.lim
         FROM caps c CROSS JOIN LATERAL (VALUES
              ('micros', 'day', {amount}::bigint, c.micros_per_day),
              ('micros', 'month', {amount}::bigint, c.micros_per_month),
              ('requests', 'minute', 1::bigint, c.requests_per_minute),
              ('tokens', 'minute', {tokens}::bigint, c.tokens_per_minute))
              AS m(metric, win, amount, lim)
        WHERE m.lim IS NOT NULL)"""


# A held turn's ($1) counters: each admitted only if used + held + its share fits under
# the limit, in this one statement (row locks taken in one order: scope, name, metric,
# window), so parallel calls never promise the last cents twice. The hold notes what it
# holds and for whom ($6: `turns.owner_of`). The caller's transaction is
# rolled back when any counter refused: a call holds on all of them or on none.
HOLD_LIMITS = (
    "WITH"
    + _limits_in_force("$2", "$3", "$4", "$5")
    + """,
   held AS (
       INSERT INTO usage_counters AS c (scope, name, metric, win, starts, held, "limit")
       SELECT scope, name, metric, win, starts, amount, lim FROM wanted WHERE amount <= lim
        ORDER BY scope, name, metric, win
       ON CONFLICT (scope, name, metric, win, starts) DO UPDATE
          SET held = c.held + EXCLUDED.held, "limit" = EXCLUDED."limit"
        WHERE c.used + c.held + EXCLUDED.held <= EXCLUDED."limit"
       RETURNING scope, metric, win),
   noted AS (
       UPDATE budget_holds
          SET project_id = $2, person = $3, tokens_held = $5, owner = $6,
              counters = (SELECT coalesce(array_agg(scope || '/' || metric || '/' || win), '{}')
                            FROM held)
        WHERE turn_id = $1)
   SELECT w.scope, w.name, w.metric, w.win, w.starts, w.lim AS "limit", w.amount,
          coalesce(u.used, 0) AS used, coalesce(u.held, 0) AS held,
          EXISTS (SELECT 1 FROM held h
                   WHERE (h.scope, h.metric, h.win) = (w.scope, w.metric, w.win)) AS admitted
     FROM wanted w
     LEFT JOIN usage_counters u USING (scope, name, metric, win, starts)
    ORDER BY w.scope, w.metric, w.win"""
)

# What the limits in force have used in the windows open now.
LIMITS_STATUS = (
    "WITH"
    + _limits_in_force("$1", "$2", "0", "0")
    + """
   SELECT w.scope, w.name, w.metric, w.win, w.starts, w.lim AS "limit", w.amount,
          coalesce(u.used, 0) AS used, coalesce(u.held, 0) AS held
     FROM wanted w
     LEFT JOIN usage_counters u USING (scope, name, metric, win, starts)
    ORDER BY w.scope, w.metric, w.win"""
)


def settle_counters(cost: str, tokens: str) -> str:
    """The CTEs that settle the counters of the hold a `hold` CTE returned (its
    hold_micros, project_id, person, tokens_held, counters, created_at): each counter's
    share moves from held to used at the call's real `cost` and `tokens` (parameters,
    e.g. "$14"). Locked in the same order as `HOLD_LIMITS` takes them."""
    return f""",
   counter_rows AS MATERIALIZED (
       SELECT c.scope, c.name, c.metric, c.win, c.starts, h.hold_micros, h.tokens_held
         FROM usage_counters c, hold h
        WHERE c.scope || '/' || c.metric || '/' || c.win = ANY (h.counters)
          AND c.name = CASE c.scope WHEN 'project' THEN h.project_id ELSE h.person END
          AND c.starts = date_trunc(c.win, h.created_at, 'UTC')
        ORDER BY c.scope, c.name, c.metric, c.win
          FOR UPDATE OF c),
   counted AS (
       UPDATE usage_counters c
          SET held = c.held - CASE r.metric WHEN 'micros' THEN r.hold_micros
                                            WHEN 'requests' THEN 1 ELSE r.tokens_held END,
              used = c.used + CASE r.metric WHEN 'micros' THEN {cost}::bigint
                                            WHEN 'requests' THEN 1 ELSE {tokens}::bigint END
         FROM counter_rows r
        WHERE (c.scope, c.name, c.metric, c.win, c.starts)
              = (r.scope, r.name, r.metric, r.win, r.starts)
       RETURNING c.scope, c.name, c.metric, c.win, c.used, c.held, c."limit")"""


_HOLD_RETURNING = "hold_micros, project_id, person, tokens_held, counters, created_at"


@dataclass(frozen=True)
class UsageRecord:
    """One `token_usage` row: who called, what it consumed and cost, how it ended."""

    turn_id: str
    run_id: str
    kind: str
    provider: str
    model: str
    agent_slug: str
    project_id: str
    session_id: UUID | None
    usage: TokenUsage
    cost_micros: int
    status: str
    error_code: str | None
    error_message: str | None
    started_at: datetime
    first_token_at: datetime | None
    finished_at: datetime
    reply: TurnReply | None

    def as_log(self) -> dict[str, Any]:
        """The row as log fields (the reply left out: it can be large)."""
        fields = {k: v for k, v in vars(self).items() if k not in ("reply", "usage")}
        return {**fields, **self.usage.model_dump()}


@dataclass(frozen=True)
class EndedTurn:
    """A turn that already has its usage row."""

    status: str
    error_code: str | None
    reply: TurnReply | None


@dataclass(frozen=True)
class StoredRun:
    """A run's budget as its row holds it, and the row's version (bumped by every write)."""

    budget: RunBudget
    version: int


@dataclass(frozen=True)
class CounterUse:
    """A limit's counter as a bill left it."""

    scope: str
    name: str
    metric: str
    window: str
    used: int
    held: int
    limit: int


@dataclass(frozen=True)
class Bill:
    """What billing a call did: whether this call wrote its usage row (False: it had one
    already), the run's row afterwards (None only for a run without a row), and the
    limits' counters the call settled."""

    billed: bool
    run: StoredRun | None
    counters: tuple[CounterUse, ...] = ()


def _stored(row: asyncpg.Record) -> StoredRun:
    budget = RunBudget(row["budget_micros"], row["spent_micros"], row["reserved_micros"])
    return StoredRun(budget, row["version"])


def _binding(row: asyncpg.Record) -> Binding:
    return Binding.model_validate(dict(row))


async def _hold_if_unchanged(
    conn: Connection,
    run_id: str,
    turn_id: str,
    amount: int,
    seen: StoredRun | None,
    run: RunBudget,
) -> int | None:
    """Claim the turn id with its hold and save `run`, in one statement, only if the row is
    still as `seen` (None: the run has no row yet) and the turn id is unclaimed; the row's
    new version, or None when nothing was written.

    The claim depends on the row's update, so a claim is never written without its
    reservation; a concurrent claim of the same turn id bumped the version too (`hold`,
    this statement), so the update cannot succeed beside it."""
    figures = (turn_id, run_id, amount, run.budget, run.spent, run.reserved)
    if seen is None:
        row = await conn.fetchrow(HOLD_ON_NEW_RUN, *figures)
    else:
        row = await conn.fetchrow(HOLD_ON_SEEN_RUN, *figures, seen.version)
    assert row is not None
    if row["version"] is not None and not row["claimed"]:
        # The turn id is claimed under another run: a caller reused it for another request.
        raise turn_id_reused(turn_id)
    version: int | None = row["version"]
    return version


def turn_id_reused(turn_id: str) -> DomainError:
    """The refusal of a turn id already used for another request."""
    return DomainError(
        ErrorCode.TURN_ID_REUSED,
        f"turn id {turn_id} was already used for another request (another run, project, "
        "person or prompt); send each new request under a new turn_id",
        turn_id=turn_id,
    )


def tokens_of(usage: TokenUsage) -> int:
    """Every token a call consumed, whatever its kind (what a per-minute token limit counts)."""
    return (
        usage.input_tokens
        + usage.output_tokens
        + usage.cache_write_5m_tokens
        + usage.cache_write_1h_tokens
        + usage.cache_read_tokens
    )


def _limit_use(row: asyncpg.Record) -> LimitUse:
    """A limit in force and its open window's use, as `_limits_in_force`'s rows give it."""
    return LimitUse(
        scope=row["scope"],
        name=row["name"],
        metric=row["metric"],
        window=row["win"],
        limit=row["limit"],
        used=row["used"],
        held=row["held"],
        resets_at=window_end(row["win"], row["starts"]),
    )


class BudgetTransaction:
    """The statements that run while one run's budget row is locked."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    async def hold_if_unchanged(
        self, run_id: str, turn_id: str, amount: int, seen: StoredRun | None, run: RunBudget
    ) -> int | None:
        """`_hold_if_unchanged` inside this transaction (the limits are held after it)."""
        return await _hold_if_unchanged(self._conn, run_id, turn_id, amount, seen, run)

    async def hold_limits(
        self,
        turn_id: str,
        project_id: str,
        person: str | None,
        amount: int,
        tokens: int,
        owner: str,
    ) -> list[LimitUse]:
        """Hold the turn's share on every limit in force for the project and the person;
        the limits it did not fit under (then nothing may be committed: the caller rolls
        back). The turn's hold must be claimed in this transaction first."""
        rows = await self._conn.fetch(
            HOLD_LIMITS, turn_id, project_id, person, amount, tokens, owner
        )
        return [_limit_use(r) for r in rows if not r["admitted"]]

    async def lock_run(self, run_id: str) -> RunBudget:
        """The run's budget, created empty on its first turn, locked until commit."""
        return (await self.lock_stored_run(run_id)).budget

    async def lock_stored_run(self, run_id: str) -> StoredRun:
        """`lock_run`, with the row's version.

        One statement: the no-op update of an existing row takes its row lock."""
        row = await self._conn.fetchrow(
            """INSERT INTO run_budgets (run_id) VALUES ($1)
               ON CONFLICT (run_id) DO UPDATE SET run_id = EXCLUDED.run_id
               RETURNING budget_micros, spent_micros, reserved_micros, version""",
            run_id,
        )
        assert row is not None
        return _stored(row)

    async def save_run(self, run_id: str, run: RunBudget) -> int:
        """Save the locked run; returns the row's new version."""
        version: int = await self._conn.fetchval(
            """UPDATE run_budgets SET budget_micros = $2, spent_micros = $3, reserved_micros = $4,
                      version = version + 1, updated_at = now()
                WHERE run_id = $1
               RETURNING version""",
            run_id,
            run.budget,
            run.spent,
            run.reserved,
        )
        return version

    async def hold(self, run_id: str, turn_id: str, amount: int, run: RunBudget) -> int | None:
        """Claim the turn id with its hold and save the run that holds it, in one statement;
        the row's new version, or None (nothing written) when the turn id is already claimed."""
        version: int | None = await self._conn.fetchval(
            """WITH claim AS (
                   INSERT INTO budget_holds (turn_id, run_id, hold_micros) VALUES ($1, $2, $3)
                   ON CONFLICT (turn_id) DO NOTHING RETURNING true)
               UPDATE run_budgets SET budget_micros = $4, spent_micros = $5,
                      reserved_micros = $6, version = version + 1, updated_at = now()
                WHERE run_id = $2 AND EXISTS (SELECT 1 FROM claim)
               RETURNING version""",
            turn_id,
            run_id,
            amount,
            run.budget,
            run.spent,
            run.reserved,
        )
        return version

    async def settle_hold(self, turn_id: str, cost: int) -> int | None:
        """Mark the turn's hold settled at `cost`, and its limits' counters with it (at the
        tokens it held); returns what it held (None if settled before)."""
        held: int | None = await self._conn.fetchval(
            """WITH hold AS (
                   UPDATE budget_holds SET status = 'settled', cost_micros = $2,
                          settled_at = now()
                    WHERE turn_id = $1 AND status = 'held'
                   RETURNING """
            + _HOLD_RETURNING
            + ")"
            + settle_counters("$2", "r.tokens_held")
            + """
               SELECT hold_micros FROM hold""",
            turn_id,
            cost,
        )
        return held

    async def abandoned_holds(self, older_than_seconds: float, limit: int = 100) -> list[Any]:
        """Holds still live long after any call could have ended (the replica that made
        them died mid-call). Not locked here: the sweep locks each run first, in the
        same order as a reservation, and settles only a hold that is still live."""
        return list(
            await self._conn.fetch(
                """SELECT turn_id, run_id, hold_micros FROM budget_holds
                    WHERE status = 'held' AND created_at < now() - make_interval(secs => $1)
                    ORDER BY created_at LIMIT $2""",
                older_than_seconds,
                limit,
            )
        )


class MeteringRepository:
    """Reads and transactions over the `metering` schema."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[BudgetTransaction]:
        """One unit of work: everything inside commits together or not at all."""
        async with self._pool.acquire() as conn, conn.transaction():
            yield BudgetTransaction(conn)

    async def stored_run(self, run_id: str) -> StoredRun | None:
        """The run's row as it is now (not locked); None before the run's first turn."""
        row = await self._pool.fetchrow(
            """SELECT budget_micros, spent_micros, reserved_micros, version
                 FROM run_budgets WHERE run_id = $1""",
            run_id,
        )
        return _stored(row) if row is not None else None

    async def hold_if_unchanged(
        self, run_id: str, turn_id: str, amount: int, seen: StoredRun | None, run: RunBudget
    ) -> int | None:
        """`_hold_if_unchanged` in a statement of its own (no limits held: the benches')."""
        async with self._pool.acquire() as conn:
            return await _hold_if_unchanged(conn, run_id, turn_id, amount, seen, run)

    async def bill(self, record: UsageRecord) -> Bill:
        """Write the call's usage row, settle its hold to the real cost and move the hold to
        the run's spend: one statement, so one round trip and its own transaction.

        Exactly once: the rest follows only from the usage row being inserted here; a turn
        that already has one (a retry after a lost reply) changes nothing, and gets the run
        as it is. The run's row is locked first, in the same order as a reservation and
        the sweeper (run, then hold), so the three never deadlock; its new figures are
        `domain.metering.settle` computed on the row as locked (`spent_micros + cost`, so
        parallel bills of one run never overwrite each other), and the hold is released
        only if still live, so a hold the sweeper settled meanwhile is not released twice.
        A hold lost with a crashed store releases nothing: the cost is still spent."""
        u = record.usage
        row = await self._pool.fetchrow(
            """WITH run_locked AS MATERIALIZED (
                   SELECT budget_micros, spent_micros, reserved_micros, version
                     FROM run_budgets WHERE run_id = $2 FOR UPDATE),
               usage AS (
                   INSERT INTO token_usage (turn_id, run_id, kind, provider, model, agent_slug,
                       project_id, session_id, input_tokens, output_tokens,
                       cache_write_5m_tokens, cache_write_1h_tokens, cache_read_tokens,
                       cost_micros, status, error_code, error_message, started_at,
                       first_token_at, finished_at, reply)
                   -- run_locked is read before the row goes in: the run's lock comes first
                   SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15,
                          $16, $17, $18, $19, $20, $21
                    WHERE (SELECT count(*) FROM run_locked) >= 0
                   ON CONFLICT (turn_id) DO NOTHING RETURNING turn_id),
               hold AS (
                   UPDATE budget_holds SET status = 'settled', cost_micros = $14,
                          settled_at = now()
                    WHERE turn_id = $1 AND status = 'held' AND EXISTS (SELECT 1 FROM usage)
                   RETURNING """
            + _HOLD_RETURNING
            + ")"
            + settle_counters("$14", "$22")
            + """,
               run AS (
                   UPDATE run_budgets
                      SET spent_micros = spent_micros + $14,
                          reserved_micros = reserved_micros
                                            - coalesce((SELECT hold_micros FROM hold), 0),
                          version = version + 1, updated_at = now()
                    WHERE run_id = $2 AND EXISTS (SELECT 1 FROM usage)
                   RETURNING budget_micros, spent_micros, reserved_micros, version)
               SELECT true AS billed, *, (SELECT json_agg(counted) FROM counted) AS counters
                 FROM run
               UNION ALL
               SELECT false, *, NULL FROM run_locked WHERE NOT EXISTS (SELECT 1 FROM run)""",
            record.turn_id,
            record.run_id,
            record.kind,
            record.provider,
            record.model,
            record.agent_slug,
            record.project_id,
            record.session_id,
            u.input_tokens,
            u.output_tokens,
            u.cache_write_5m_tokens,
            u.cache_write_1h_tokens,
            u.cache_read_tokens,
            record.cost_micros,
            record.status,
            record.error_code,
            record.error_message,
            record.started_at,
            record.first_token_at,
            record.finished_at,
            record.reply.model_dump(mode="json") if record.reply is not None else None,
            tokens_of(u),
        )
        if row is None:  # no run row: cannot happen (a hold needs one), billed regardless
            return Bill(billed=True, run=None)
        counters = tuple(
            CounterUse(
                c["scope"], c["name"], c["metric"], c["win"], c["used"], c["held"], c["limit"]
            )
            for c in row["counters"] or ()
        )
        return Bill(billed=row["billed"], run=_stored(row), counters=counters)

    async def owner_of(self, turn_id: str) -> str | None:
        """Whose request claimed the turn id (`turns.owner_of`); None when unknown."""
        found: str | None = await self._pool.fetchval(
            "SELECT owner FROM budget_holds WHERE turn_id = $1", turn_id
        )
        return found

    async def ended_turn(self, turn_id: str) -> EndedTurn | None:
        """The outcome of a turn that already ran, if it did."""
        row = await self._pool.fetchrow(
            "SELECT status, error_code, reply FROM token_usage WHERE turn_id = $1", turn_id
        )
        if row is None:
            return None
        reply = TurnReply.model_validate(row["reply"]) if row["reply"] is not None else None
        return EndedTurn(row["status"], row["error_code"], reply)

    async def turn_ended(self, turn_id: str, project_id: str, session_id: UUID) -> bool:
        """Whether this project's session has a usage row for the turn (it ran to its end)."""
        found = await self._pool.fetchval(
            """SELECT true FROM token_usage
                WHERE turn_id = $1 AND project_id = $2 AND session_id = $3""",
            turn_id,
            project_id,
            session_id,
        )
        return bool(found)

    async def bindings(self) -> list[Binding]:
        """Every binding (the table is small: the cache holds all of it)."""
        rows = await self._pool.fetch(f"SELECT {BINDING_COLUMNS} FROM bindings ORDER BY id")
        return [_binding(r) for r in rows]

    async def prices(self) -> list[Price]:
        rows = await self._pool.fetch(
            """SELECT model, effective_from, input_micros, output_micros, cache_write_5m_micros,
                      cache_write_1h_micros, cache_read_micros FROM prices"""
        )
        return [Price(*r.values()) for r in rows]

    async def known_model(self, model: str) -> bool:
        return bool(await self._pool.fetchval("SELECT 1 FROM prices WHERE model = $1", model))

    async def set_binding(self, cmd: SetBinding) -> Binding | None:
        """Create, replace or (model null) remove the binding at the level `cmd` names."""
        keys = (cmd.scope, cmd.project_id, cmd.agent_slug, cmd.session_id)
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.execute(
                """DELETE FROM bindings WHERE scope = $1
                      AND project_id IS NOT DISTINCT FROM $2
                      AND agent_slug IS NOT DISTINCT FROM $3
                      AND session_id IS NOT DISTINCT FROM $4""",
                *keys,
            )
            if cmd.model is None:
                return None
            row = await conn.fetchrow(
                f"""INSERT INTO bindings (scope, project_id, agent_slug, session_id, model,
                                         provider)
                    VALUES ($1, $2, $3, $4, $5, $6) RETURNING {BINDING_COLUMNS}""",
                *keys,
                cmd.model,
                cmd.provider,
            )
            assert row is not None
            return _binding(row)

    async def list_bindings(self, project_id: str | None) -> list[Binding]:
        """Bindings of a project and the global ones (or all), most specific level first."""
        rows = await self._pool.fetch(
            f"""SELECT {BINDING_COLUMNS} FROM bindings
                 WHERE $1::text IS NULL OR project_id IS NULL OR project_id = $1
                 ORDER BY array_position(ARRAY['session', 'agent', 'project', 'workspace'], scope),
                          project_id NULLS LAST, agent_slug, session_id""",
            project_id,
        )
        return [_binding(r) for r in rows]

    async def project_spend(self) -> list[CounterUse]:
        """Every project's spend counters of the windows open now (day and month)."""
        rows = await self._pool.fetch(
            """SELECT scope, name, metric, win, used, held, "limit" FROM usage_counters
                WHERE scope = 'project' AND metric = 'micros'
                  AND starts = date_trunc(win, now(), 'UTC')"""
        )
        return [CounterUse(*r.values()) for r in rows]

    async def set_limits(self, cmd: SetLimits) -> LimitsSetReply:
        """Create or replace the limits at one level (a project, a person, or a default)."""
        lim = cmd.limits
        row = await self._pool.fetchrow(
            """INSERT INTO limits (scope, name, micros_per_day, micros_per_month,
                                   requests_per_minute, tokens_per_minute)
               VALUES ($1, $2, $3, $4, $5, $6)
               ON CONFLICT (scope, name) DO UPDATE
                  SET micros_per_day = EXCLUDED.micros_per_day,
                      micros_per_month = EXCLUDED.micros_per_month,
                      requests_per_minute = EXCLUDED.requests_per_minute,
                      tokens_per_minute = EXCLUDED.tokens_per_minute, updated_at = now()
               RETURNING micros_per_day, micros_per_month, requests_per_minute,
                         tokens_per_minute""",
            cmd.scope,
            cmd.name,
            lim.micros_per_day,
            lim.micros_per_month,
            lim.requests_per_minute,
            lim.tokens_per_minute,
        )
        assert row is not None
        return LimitsSetReply(scope=cmd.scope, name=cmd.name, limits=SpendLimits(**dict(row)))

    async def limits_status(self, project_id: str, person: str | None) -> LimitsStatus:
        """The limits in force for the project and the person, and their open windows' use."""
        rows = await self._pool.fetch(LIMITS_STATUS, project_id, person)
        uses = [_limit_use(r) for r in rows]
        return LimitsStatus(limits=uses, exhausted=[u for u in uses if u.used + u.held >= u.limit])

    async def summary(self, req: UsageSummaryRequest) -> UsageSummaryReply:
        """Usage grouped by the requested dimensions; each one is a flag, never SQL text."""
        by = set(req.group_by)
        rows = await self._pool.fetch(
            """SELECT CASE WHEN $1 THEN project_id END AS project,
                      CASE WHEN $2 THEN session_id::text END AS session,
                      CASE WHEN $3 THEN agent_slug END AS agent,
                      CASE WHEN $4 THEN model END AS model,
                      CASE WHEN $5 THEN to_char(started_at AT TIME ZONE 'UTC', 'YYYY-MM-DD') END
                          AS day,
                      CASE WHEN $6 THEN run_id END AS run,
                      count(*) AS calls,
                      -- a stream the person stopped is not an error (no error_code)
                      count(*) FILTER (WHERE error_code IS NOT NULL) AS errors,
                      sum(input_tokens) AS input_tokens, sum(output_tokens) AS output_tokens,
                      sum(cache_write_5m_tokens) AS cache_write_5m_tokens,
                      sum(cache_write_1h_tokens) AS cache_write_1h_tokens,
                      sum(cache_read_tokens) AS cache_read_tokens,
                      sum(cost_micros) AS cost_micros
                 FROM token_usage
                WHERE ($7::text IS NULL OR project_id = $7)
                  AND ($8::uuid IS NULL OR session_id = $8)
                  AND ($9::text IS NULL OR agent_slug = $9)
                  AND ($10::text IS NULL OR run_id = $10)
                  AND ($11::date IS NULL OR started_at >= $11::date)
                  AND ($12::date IS NULL OR started_at < $12::date + 1)
                GROUP BY 1, 2, 3, 4, 5, 6
                ORDER BY cost_micros DESC, 1, 2, 3, 4, 5, 6""",
            "project" in by,
            "session" in by,
            "agent" in by,
            "model" in by,
            "day" in by,
            "run" in by,
            req.project_id,
            req.session_id,
            req.agent_slug,
            req.run_id,
            req.since,
            req.until,
        )
        groups = [_group(r, req.group_by) for r in rows]
        return UsageSummaryReply(
            groups=groups,
            total_cost_micros=sum(g.cost_micros for g in groups),
            total_calls=sum(g.calls for g in groups),
        )


def _group(row: asyncpg.Record, dimensions: Sequence[str]) -> UsageGroup:
    values: dict[str, Any] = dict(row)
    return UsageGroup(
        key={d: values[d] for d in dimensions},
        calls=values["calls"],
        errors=values["errors"],
        usage=TokenUsage(
            input_tokens=values["input_tokens"],
            output_tokens=values["output_tokens"],
            cache_write_5m_tokens=values["cache_write_5m_tokens"],
            cache_write_1h_tokens=values["cache_write_1h_tokens"],
            cache_read_tokens=values["cache_read_tokens"],
        ),
        cost_micros=values["cost_micros"],
    )
