"""Metering's two writes per call, alone, each beside its baseline in the same run.

Measured against metering's own tables (a fresh database, migrated as the service does),
`RUNS` runs at once, each with `TURNS_PER_RUN` turns one after another as a session's
turns come.

The reservation, on the first-token path: every streaming turn holds its worst case on
its run before the provider is called (docs/decisions/0006-limits-in-the-reservation.md).
- baseline: the locked read-decide-write transaction (BEGIN, lock the row, claim +
  save, COMMIT: four round trips), the way a replica that does not know the run's row
  reserves;
- one statement: `hold_if_unchanged` on the row as this replica last wrote it (the run's
  previous turn), the run's part of what metering does on its hot path.

The whole reservation, with the limits in force (the seeded defaults):
- baseline: the run's hold and the limits' in a transaction (BEGIN, hold, limits, COMMIT);
- one statement: `reserve_whole_in`, what metering does on its hot path.

The bill, after the call: the usage row, the settled hold and the run's spend.
- baseline: a bare INSERT of the usage row alone (autocommit: one round trip), the floor
  of writing anything;
- one statement: `MeteringRepository.bill`, against the six round trips of doing it
  step by step (BEGIN, lock the run, insert, settle, save, COMMIT).

Interleaved rounds, so both ways see the same machine; latency and CPU ms per operation
(this process and Postgres). Exits non-zero when a reservation's one statement is not
cheaper than its transaction, or the bill costs over 2.5 bare inserts.

    .venv/bin/python bench/budget_hold.py
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import asyncpg
import uvloop

# This folder holds bench/metering.py too: metering's own package must win the name.
sys.path.append(sys.path.pop(0))

from benchkit import (
    CpuMeter,
    CpuUsage,
    Goals,
    cpu_table,
    fresh_database,
    latency_row,
    percentile,
    servers,
)
from contracts.metering import ChatMessage, LlmTurn, TextBlock, TokenUsage, TurnReply
from domain.metering import RunBudget, reserve
from domain.metering_turn import Hold, UsageRecord
from metering.budgets import (
    BudgetTransaction,
    HeldCall,
    StoredRun,
    hold_if_unchanged_in,
    reserve_whole_in,
)
from metering.repository import MeteringRepository
from servicekit.db import create_pool, migrate

# Runs at once, turns of each one after another, and what each turn holds.
RUNS, TURNS_PER_RUN, HOLD = 50, 20, 1_000
# A bill may cost up to this many bare inserts of its row (it writes three rows).
BILL_GOAL_RATIO = 2.5
# Runs one way: its runs' ids, each with what `prepare` gave it (not measured); its times.
Way = Callable[[str, Any, list[float]], Awaitable[None]]
Prepare = Callable[[str], Awaitable[Any]]


async def interleaved(
    pool: asyncpg.Pool, title: str, ways: dict[str, Way], prepare: Prepare
) -> tuple[list[str], dict[str, list[float]]]:
    """Each way over `RUNS` runs at once, three interleaved rounds; the report lines and
    the latencies (ms) by way, the first way being the baseline."""
    latencies: dict[str, list[float]] = {name: [] for name in ways}
    cpu: dict[str, list[CpuUsage]] = {name: [] for name in ways}
    for _ in range(3):
        for name, way in ways.items():
            runs = [f"bench-{uuid.uuid4().hex}" for _ in range(RUNS)]
            prepared = await asyncio.gather(*(prepare(r) for r in runs))
            meter = CpuMeter({"bench": [os.getpid()]}, pool)
            await meter.start()
            started = time.perf_counter()
            await asyncio.gather(
                *(way(r, p, latencies[name]) for r, p in zip(runs, prepared, strict=True))
            )
            cpu[name].append(await meter.stop(RUNS * TURNS_PER_RUN, time.perf_counter() - started))
    base, *_ = latencies.values()
    lines = [f"{title}, {RUNS} runs at once, {TURNS_PER_RUN} turns each:"]
    lines += [latency_row(n, t, None if t is base else base) for n, t in latencies.items()]
    rows = [(name, RUNS, usage) for name in ways for usage in cpu[name]]
    lines += cpu_table(["bench", "postgres"], rows, name_width=14)
    return lines, latencies


def timed(times: list[float], started: float) -> None:
    times.append((time.perf_counter() - started) * 1000)


# Holds one turn (its id) on the run's row as seen (None: no row yet) with the run's new
# figures; the row's new version.
HoldOnce = Callable[[str, StoredRun | None, RunBudget], Awaitable[int | None]]


async def turns_of(run_id: str, times: list[float], hold: HoldOnce) -> None:
    """`TURNS_PER_RUN` turns of the run one after another, each held by `hold` on the row
    as the turn before wrote it (what a replica that wrote the run last does); times each."""
    seen: StoredRun | None = None
    for _ in range(TURNS_PER_RUN):
        turn_id = uuid.uuid4().hex
        started = time.perf_counter()
        run = reserve(seen.budget if seen else RunBudget(None, 0, 0), HOLD, run_id)
        version = await hold(turn_id, seen, run)
        assert version is not None, "only this bench writes these runs"
        seen = StoredRun(run, version)
        timed(times, started)


async def reservations(
    pool: asyncpg.Pool, repo: MeteringRepository
) -> tuple[list[str], dict[str, list[float]]]:
    """A turn's budget reservation, both ways: the locked read-decide-write transaction (4
    round trips, the way a replica that does not know the run's row reserves, and the
    baseline), and the one statement of a replica that wrote the row last."""

    async def locked(run_id: str, prepared: None, times: list[float]) -> None:
        for _ in range(TURNS_PER_RUN):
            started = time.perf_counter()
            async with repo.transaction() as tx:
                run = reserve(await tx.lock_run(run_id), HOLD, run_id)
                await tx.hold(run_id, uuid.uuid4().hex, HOLD, run)
            timed(times, started)

    async def remembered(run_id: str, prepared: None, times: list[float]) -> None:
        async def hold(turn_id: str, seen: StoredRun | None, run: RunBudget) -> int | None:
            return await repo.hold_if_unchanged(run_id, turn_id, HOLD, seen, run)

        await turns_of(run_id, times, hold)

    async def nothing(run_id: str) -> None:
        return None

    ways: dict[str, Way] = {"locked": locked, "one statement": remembered}
    return await interleaved(pool, "reservation", ways, nothing)


def bench_turn(run_id: str, turn_id: str) -> LlmTurn:
    """A turn of `run_id`, for a project and a person of its own: counters far from limits."""
    return LlmTurn(run_id=run_id, turn_id=turn_id, agent_slug="bench", project_id=run_id,
                   person=run_id, messages=[ChatMessage(role="user", content="oi")],
                   max_tokens=100)  # fmt: skip


async def whole_reservations(
    pool: asyncpg.Pool, repo: MeteringRepository
) -> tuple[list[str], dict[str, list[float]]]:
    """A turn's whole reservation on a run this replica wrote last, with the limits in force
    (the seeded defaults: the project's and the person's), both ways: the run's hold and
    then the limits' in a transaction (BEGIN, the hold, the limits, COMMIT: four round
    trips, the baseline), and `reserve_whole_in`, one statement, what metering does."""
    hold = Hold(HOLD, 200, "bench")
    call = HeldCall("bench", "stream", "scripted", "claude-sonnet-4-6", "bench", None)

    async def in_transaction(run_id: str, prepared: None, times: list[float]) -> None:
        async def hold_all(turn_id: str, seen: StoredRun | None, run: RunBudget) -> int | None:
            cmd = bench_turn(run_id, turn_id)
            async with pool.acquire() as conn, conn.transaction():
                version = await hold_if_unchanged_in(conn, run_id, turn_id, HOLD, seen, run)
                refused = await BudgetTransaction(conn).hold_limits(
                    turn_id, cmd.project_id, cmd.person, hold.micros, hold.tokens, hold.owner,
                    call,
                )  # fmt: skip
                assert not refused
            return version

        await turns_of(run_id, times, hold_all)

    async def whole(run_id: str, prepared: None, times: list[float]) -> None:
        async def hold_all(turn_id: str, seen: StoredRun | None, run: RunBudget) -> int | None:
            return await reserve_whole_in(pool, bench_turn(run_id, turn_id), hold, call, seen, run)

        await turns_of(run_id, times, hold_all)

    async def nothing(run_id: str) -> None:
        return None

    ways: dict[str, Way] = {"transaction": in_transaction, "one statement": whole}
    return await interleaved(pool, "reservation with the limits", ways, nothing)


def usage_row(turn_id: str, run_id: str) -> UsageRecord:
    """A streamed call's row, as metering writes it (with its reply)."""
    now = datetime.now(UTC)
    reply = TurnReply(
        turn_id=turn_id,
        content=[TextBlock(text=" ".join(f"w{i}" for i in range(20)))],
        stop_reason="end_turn",
        model="claude-sonnet-4-6",
        usage=TokenUsage(input_tokens=100, output_tokens=20),
        cost_micros=600,
        budget_remaining_micros=None,
    )
    return UsageRecord(turn_id, run_id, "stream", "scripted", "claude-sonnet-4-6", "bench",
                       "bench", None, reply.usage, 600, "ok", None, None, now, now, now,
                       reply)  # fmt: skip


async def bills(
    pool: asyncpg.Pool, repo: MeteringRepository
) -> tuple[list[str], dict[str, list[float]]]:
    """A call's bill: the bare insert of its usage row (the baseline), and `bill`."""

    async def held(run_id: str) -> list[str]:  # the turns' holds, as reserved before the call
        turns, seen = [uuid.uuid4().hex for _ in range(TURNS_PER_RUN)], None
        for turn_id in turns:
            run = reserve(seen.budget if seen else RunBudget(None, 0, 0), HOLD, run_id)
            version = await repo.hold_if_unchanged(run_id, turn_id, HOLD, seen, run)
            assert version is not None, "only this bench writes these runs"
            seen = StoredRun(run, version)
        return turns

    async def bare(run_id: str, turns: list[str], times: list[float]) -> None:
        for turn_id in turns:
            row = usage_row(turn_id, run_id)
            assert row.reply is not None
            reply = row.reply.model_dump(mode="json")
            started = time.perf_counter()
            await pool.execute(
                """INSERT INTO token_usage (turn_id, run_id, kind, provider, model, agent_slug,
                       project_id, input_tokens, output_tokens, cache_write_5m_tokens,
                       cache_write_1h_tokens, cache_read_tokens, cost_micros, status,
                       started_at, finished_at, reply)
                   VALUES ($1, $2, 'stream', 'scripted', $3, 'bench', 'bench', $4, $5, 0, 0, 0,
                           $6, 'ok', $7, $7, $8)""",
                turn_id, run_id, row.model, row.usage.input_tokens, row.usage.output_tokens,
                row.cost_micros, row.started_at, reply,
            )  # fmt: skip
            timed(times, started)

    async def billed(run_id: str, turns: list[str], times: list[float]) -> None:
        for turn_id in turns:
            row = usage_row(turn_id, run_id)
            started = time.perf_counter()
            assert (await repo.bill(row)).billed
            timed(times, started)

    ways: dict[str, Way] = {"bare insert": bare, "one statement": billed}
    return await interleaved(pool, "bill", ways, held)


async def measure(database_url: str) -> tuple[list[str], Goals]:
    pool = await create_pool(database_url, "metering", min_size=10, max_size=10)
    repo = MeteringRepository(pool)
    goals = Goals()
    try:
        reserving, reserved = await reservations(pool, repo)
        limiting, limited = await whole_reservations(pool, repo)
        billing, billed = await bills(pool, repo)
    finally:
        await pool.close()

    def ratio(times: dict[str, list[float]], way: str, base: str) -> float:
        return percentile(times[way], 0.5) / percentile(times[base], 0.5)

    goals.at_most("reservation: one statement's p50 ÷ the locked transaction's",
                  ratio(reserved, "one statement", "locked"), 1.0)  # fmt: skip
    goals.at_most("reservation with the limits: one statement's p50 ÷ the transaction's",
                  ratio(limited, "one statement", "transaction"), 1.0)  # fmt: skip
    goals.at_most("bill: one statement's p50 ÷ a bare insert's",
                  ratio(billed, "one statement", "bare insert"), BILL_GOAL_RATIO)  # fmt: skip
    return [*reserving, *limiting, *billing], goals


async def run() -> int:
    async with contextlib.AsyncExitStack() as stack:
        srv = stack.enter_context(servers(prefix="bench-budget-hold-"))
        database_url = await stack.enter_async_context(fresh_database(srv.admin_url))
        pool = await create_pool(database_url, "metering")
        try:
            await pool.execute("CREATE SCHEMA IF NOT EXISTS metering")
            await migrate(pool, "metering", ["metering.migrations"])
        finally:
            await pool.close()
        lines, goals = await measure(database_url)
        print("\n".join(lines))
        print("goals:")
        print("\n".join(goals.report()))
        return goals.exit_code


if __name__ == "__main__":
    sys.exit(uvloop.run(run()))
