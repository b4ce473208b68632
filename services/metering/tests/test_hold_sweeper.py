"""Holds whose call died with its replica are released, charged at their worst case,
with a usage row that says so."""

from __future__ import annotations

import asyncpg

from domain.metering import RunBudget
from metering.repository import MeteringRepository
from metering.sweeper import sweep_once
from servicekit.db import KIT_MIGRATIONS, create_pool, migrate


async def test_an_abandoned_hold_is_settled_once_at_its_worst_case(database_url: str) -> None:
    pool: asyncpg.Pool = await create_pool(database_url, "metering")
    try:
        await migrate(pool, "metering", [KIT_MIGRATIONS, "metering.migrations"])
        repo = MeteringRepository(pool)
        async with repo.transaction() as tx:  # a replica reserved, then died before billing
            await tx.lock_run("run-1")
            assert await tx.hold("run-1", "turn-dead", 600, RunBudget(1000, 0, 600))
            await tx.lock_run("run-2")
            assert await tx.hold("run-2", "turn-live", 300, RunBudget(1000, 0, 300))
        await pool.execute(
            "UPDATE budget_holds SET created_at = now() - interval '1 hour' "
            "WHERE turn_id = 'turn-dead'"
        )

        assert await sweep_once(repo, older_than_seconds=1800) == 1
        assert await sweep_once(repo, older_than_seconds=1800) == 0

        runs = {
            r["run_id"]: (r["spent_micros"], r["reserved_micros"])
            for r in await pool.fetch(
                "SELECT run_id, spent_micros, reserved_micros FROM run_budgets"
            )
        }
        assert runs == {"run-1": (600, 0), "run-2": (0, 300)}  # the live call keeps its hold
        holds = {
            r["turn_id"]: r["status"]
            for r in await pool.fetch("SELECT turn_id, status FROM budget_holds")
        }
        assert holds == {"turn-dead": "settled", "turn-live": "held"}
        # The dead call has its usage row, at its worst case and marked so; the live one none.
        rows = [
            tuple(r)
            for r in await pool.fetch(
                "SELECT turn_id, cost_micros, billed_at_hold, error_code FROM token_usage"
            )
        ]
        assert rows == [("turn-dead", 600, True, "replica_lost")]
    finally:
        await pool.close()


async def test_an_abandoned_holds_limits_are_charged_its_worst_case_too(
    database_url: str,
) -> None:
    pool: asyncpg.Pool = await create_pool(database_url, "metering")
    try:
        await migrate(pool, "metering", [KIT_MIGRATIONS, "metering.migrations"])
        repo = MeteringRepository(pool)
        async with repo.transaction() as tx:  # reserved on the run and the limits, then died
            await tx.lock_run("run-1")
            assert await tx.hold("run-1", "turn-dead", 600, RunBudget(None, 0, 600))
            assert await tx.hold_limits("turn-dead", "proj", "ana", 600, 900, "owner") == []
        await pool.execute(
            "UPDATE budget_holds SET created_at = now() - interval '1 hour' "
            "WHERE turn_id = 'turn-dead'"
        )
        held = {
            (r["scope"], r["metric"], r["win"]): (r["used"], r["held"])
            for r in await pool.fetch("SELECT scope, metric, win, used, held FROM usage_counters")
        }
        assert held[("project", "micros", "day")] == (0, 600)
        assert held[("person", "tokens", "minute")] == (0, 900)
        # the hold's windows are those of when it was made, an hour ago: moved back with it
        await pool.execute(
            """UPDATE usage_counters SET starts = date_trunc(win, now() - interval '1 hour',
                                                             'UTC')"""
        )

        assert await sweep_once(repo, older_than_seconds=1800) == 1

        settled = {
            (r["scope"], r["metric"], r["win"]): (r["used"], r["held"])
            for r in await pool.fetch("SELECT scope, metric, win, used, held FROM usage_counters")
        }
        assert settled[("project", "micros", "day")] == (600, 0)
        assert settled[("person", "micros", "month")] == (600, 0)
        assert settled[("project", "requests", "minute")] == (1, 0)
        assert settled[("person", "tokens", "minute")] == (900, 0)
    finally:
        await pool.close()
