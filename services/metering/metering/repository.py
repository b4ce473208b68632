"""Metering's SQL: a turn's reservation and bill, usage, bindings, prices and limits.
Every statement is parameterised; nothing is built from strings. The statements of the
holds on budgets and limits are in `metering.budgets`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any
from uuid import UUID

import asyncpg

from contracts.metering import (
    Binding,
    LimitsSetReply,
    LimitsStatus,
    LimitUse,
    LlmStream,
    LlmTurn,
    SetBinding,
    SetLimits,
    SpendLimits,
    TokenUsage,
    TurnReply,
    UsageGroup,
    UsageSummaryReply,
    UsageSummaryRequest,
)
from domain.metering import Price, RunBudget
from domain.metering_turn import EndedTurn, Hold, UsageRecord, reserved, reserved_if_fits
from metering.budgets import (
    HOLD_RETURNING,
    LIMITS_STATUS,
    REPLICA_LOCK_KEY,
    BudgetTransaction,
    CounterUse,
    HeldCall,
    LimitRefused,
    RememberedRuns,
    StoredRun,
    hold_if_unchanged_in,
    limit_use,
    reserve_whole_in,
    settle_counters,
    stored_run_of,
)
from servicekit.db import Connection

BINDING_COLUMNS = "scope, project_id, agent_slug, session_id, model, updated_at, provider"


@dataclass(frozen=True)
class Reservation:
    """What holding a turn's worst case came to: whether this request claimed the turn id
    (False: it was claimed already, nothing was held), and the limit that refused the turn
    (then nothing of the reservation was kept)."""

    claimed: bool
    refused: LimitUse | None = None


@dataclass(frozen=True)
class Bill:
    """What billing a call did: whether this call wrote its usage row (False: it had one
    already), the run's row afterwards (None only for a run without a row), and the
    limits' counters the call settled."""

    billed: bool
    run: StoredRun | None
    counters: tuple[CounterUse, ...] = ()


def _binding(row: asyncpg.Record) -> Binding:
    return Binding.model_validate(dict(row))


def tokens_of(usage: TokenUsage) -> int:
    """Every token a call consumed, whatever its kind (what a per-minute token limit counts)."""
    return (
        usage.input_tokens
        + usage.output_tokens
        + usage.cache_write_5m_tokens
        + usage.cache_write_1h_tokens
        + usage.cache_read_tokens
    )


class MeteringRepository:
    """Reads and transactions over the `metering` schema."""

    def __init__(self, pool: asyncpg.Pool, replica: str | None = None) -> None:
        """`replica`: this process's instance id, noted on every hold it makes (None: holds
        no survivor can tell from a live one's, settled by age only)."""
        self._pool = pool
        self._runs = RememberedRuns()
        self.replica = replica

    @asynccontextmanager
    async def transaction(self, on: Connection | None = None) -> AsyncIterator[BudgetTransaction]:
        """One unit of work: everything inside commits together or not at all (on the
        connection `on`, when the caller holds one)."""
        if on is not None:
            async with on.transaction():
                yield BudgetTransaction(on)
            return
        async with self._pool.acquire() as conn, conn.transaction():
            yield BudgetTransaction(conn)

    async def stored_run(self, run_id: str) -> StoredRun | None:
        """The run's row as it is now (not locked); None before the run's first turn."""
        row = await self._pool.fetchrow(
            """SELECT budget_micros, spent_micros, reserved_micros, version
                 FROM run_budgets WHERE run_id = $1""",
            run_id,
        )
        return stored_run_of(row) if row is not None else None

    async def hold_if_unchanged(
        self, run_id: str, turn_id: str, amount: int, seen: StoredRun | None, run: RunBudget
    ) -> int | None:
        """`hold_if_unchanged_in` in a statement of its own (no limits held: the benches')."""
        async with self._pool.acquire() as conn:
            return await hold_if_unchanged_in(conn, run_id, turn_id, amount, seen, run)

    async def reserve(self, cmd: LlmTurn, hold: Hold, provider: str, model: str) -> Reservation:
        """Hold the turn's worst case on its run and on every limit of its project and
        person, all or nothing, deciding with `domain.metering_turn`; raises the run's
        refusal, or `turn_id_reused`. The hold names this replica and the call to
        `provider`'s `model` (`HeldCall`), for a survivor to bill should this replica die.

        The run's row first, then the limits' counters (the order a bill and the sweeper
        lock them in too). In one statement when this replica knows the run's row as it
        last wrote it (the run's previous turn), or reads it first: the decision is taken
        on that row, and the hold, the claim and the counters are written only if the row
        is still the same (`reserve_whole_in`). A row someone else changed, or a turn that
        does not fit what this replica saw, is decided again under the row lock, on the
        row as it is. A limit the turn does not fit under refuses it, and nothing of the
        reservation is kept.
        """
        call = HeldCall(
            self.replica,
            "stream" if isinstance(cmd, LlmStream) else "turn",
            provider,
            model,
            cmd.agent_slug,
            cmd.session_id,
        )
        seen = self._runs.get(cmd.run_id)
        if seen is None:
            seen = await self.stored_run(cmd.run_id)
        run = reserved_if_fits(seen.budget if seen else None, cmd, hold.micros)
        try:
            if run is not None:
                version = await reserve_whole_in(self._pool, cmd, hold, call, seen, run)
                if version is not None:
                    self._runs.remember(cmd.run_id, StoredRun(run, version))
                    return Reservation(claimed=True)
            return await self._reserve_locked(cmd, hold, call)
        except LimitRefused as refusal:
            return Reservation(claimed=True, refused=refusal.use)

    async def _reserve_locked(self, cmd: LlmTurn, hold: Hold, call: HeldCall) -> Reservation:
        """`reserve` under the run's row lock, on the row as it is (a transaction)."""
        self._runs.forget(cmd.run_id)
        async with self.transaction() as tx:
            stored = await tx.lock_stored_run(cmd.run_id)
            run = reserved(stored.budget, cmd, hold.micros)
            version = await tx.hold(cmd.run_id, cmd.turn_id, hold.micros, run)
            if version is None:
                return Reservation(claimed=False)
            refused = await tx.hold_limits(
                cmd.turn_id,
                cmd.project_id,
                cmd.person,
                hold.micros,
                hold.tokens,
                hold.owner,
                call,
            )
            if refused:
                raise LimitRefused(refused[0])  # rolls the transaction back
        self._runs.remember(cmd.run_id, StoredRun(run, version))
        return Reservation(claimed=True)

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
        A hold lost with a crashed store releases nothing: the cost is still spent. The
        run's row this call wrote is remembered for the run's next reservation."""
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
            + HOLD_RETURNING
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
        run = stored_run_of(row)
        if row["billed"]:
            self._runs.remember(record.run_id, run)
        return Bill(billed=row["billed"], run=run, counters=counters)

    async def replicas_holding(self) -> list[str]:
        """The other replicas that have live holds (alive or not: `if_gone` tells)."""
        rows = await self._pool.fetch(
            """SELECT DISTINCT replica FROM budget_holds
                WHERE status = 'held' AND replica IS NOT NULL AND replica <> $1""",
            self.replica or "",
        )
        return [r["replica"] for r in rows]

    @asynccontextmanager
    async def if_gone(self, replica: str) -> AsyncIterator[Connection | None]:
        """A connection holding `replica`'s lock when it is free (the replica is gone: none
        of its holds has a call running any more), else None; the lock is held for the
        block, so a restart of that replica under the same id waits for it."""
        async with self._pool.acquire() as conn:
            if not await conn.fetchval(f"SELECT pg_try_advisory_lock({REPLICA_LOCK_KEY})", replica):
                yield None
                return
            try:
                yield conn
            finally:
                await conn.execute(f"SELECT pg_advisory_unlock({REPLICA_LOCK_KEY})", replica)

    async def owner_of(self, turn_id: str) -> str | None:
        """Whose request claimed the turn id (`domain.metering_turn.owner_of`); None when
        unknown."""
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
        uses = [limit_use(r) for r in rows]
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
