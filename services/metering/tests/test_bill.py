"""Billing a call in one statement (`MeteringRepository.bill`, issue 12): the usage row,
the settled hold and the run's spend together, exactly once, against real Postgres."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import asyncpg
import pytest
import pytest_asyncio

from contracts.metering import TokenUsage
from domain.metering import RunBudget
from domain.metering_turn import UsageRecord
from metering.repository import MeteringRepository
from metering.sweeper import sweep_once
from testkit.probes import wait_for

from .conftest import migrated_pool

BUDGET, HOLD = 100_000, 1_000


@pytest_asyncio.fixture
async def pool(database_url: str) -> AsyncIterator[asyncpg.Pool]:
    async with migrated_pool(database_url) as pool:
        yield pool


@pytest.fixture
def repo(pool: asyncpg.Pool) -> MeteringRepository:
    return MeteringRepository(pool)


async def held(repo: MeteringRepository, run_id: str, *turn_ids: str) -> None:
    """The turns' holds on the run, as a reservation leaves them."""
    async with repo.transaction() as tx:
        run = await tx.lock_run(run_id)
        for turn_id in turn_ids:
            run = RunBudget(BUDGET, run.spent, run.reserved + HOLD)
            assert await tx.hold(run_id, turn_id, HOLD, run) is not None


def usage(turn_id: str, run_id: str, cost: int) -> UsageRecord:
    now = datetime.now(UTC)
    return UsageRecord(
        turn_id=turn_id,
        run_id=run_id,
        kind="stream",
        provider="scripted",
        model="claude-sonnet-4-6",
        agent_slug="writer",
        project_id="proj",
        session_id=None,
        usage=TokenUsage(input_tokens=10, output_tokens=cost),
        cost_micros=cost,
        status="ok",
        error_code=None,
        error_message=None,
        started_at=now,
        first_token_at=now,
        finished_at=now,
        reply=None,
    )


async def state(pool: asyncpg.Pool, run_id: str) -> tuple[int, int, int, list[str]]:
    """The run's spent and reserved µUSD, its usage rows, and its holds' statuses."""
    run = await pool.fetchrow(
        "SELECT spent_micros, reserved_micros FROM run_budgets WHERE run_id = $1", run_id
    )
    assert run is not None
    rows = await pool.fetchval("SELECT count(*) FROM token_usage WHERE run_id = $1", run_id)
    holds = await pool.fetch(
        "SELECT status FROM budget_holds WHERE run_id = $1 ORDER BY turn_id", run_id
    )
    return run["spent_micros"], run["reserved_micros"], rows, [h["status"] for h in holds]


async def test_a_bill_moves_the_hold_to_the_spend_once_however_often_it_is_written(
    repo: MeteringRepository, pool: asyncpg.Pool
) -> None:
    await held(repo, "run-1", "turn-1")
    first = await repo.bill(usage("turn-1", "run-1", 300))
    assert first.billed and first.run is not None
    assert first.run.budget == RunBudget(BUDGET, 300, 0)

    again = await repo.bill(usage("turn-1", "run-1", 300))  # a retry after a lost reply
    assert not again.billed
    assert again.run is not None and again.run.budget == RunBudget(BUDGET, 300, 0)
    assert again.run.version == first.run.version  # nothing was written
    assert await state(pool, "run-1") == (300, 0, 1, ["settled"])


async def test_parallel_bills_of_one_run_each_count_once(
    repo: MeteringRepository, pool: asyncpg.Pool
) -> None:
    turns = [f"turn-{i}" for i in range(20)]
    await held(repo, "run-1", *turns)
    bills = await asyncio.gather(
        *(repo.bill(usage(t, "run-1", 10 + i)) for i, t in enumerate(turns))
    )
    assert all(b.billed for b in bills)
    spent = sum(10 + i for i in range(20))
    assert await state(pool, "run-1") == (spent, 0, 20, ["settled"] * 20)


async def test_a_hold_the_sweeper_settled_first_is_not_released_nor_billed_twice(
    repo: MeteringRepository, pool: asyncpg.Pool
) -> None:
    await held(repo, "run-1", "turn-late", "turn-other")
    await pool.execute(
        "UPDATE budget_holds SET created_at = now() - interval '1 hour' WHERE turn_id = 'turn-late'"
    )
    assert await sweep_once(repo, older_than_seconds=1800) == 1  # charged its worst case

    bill = await repo.bill(usage("turn-late", "run-1", 300))  # the call's bill, late
    assert not bill.billed
    # The call has one row, the sweeper's, at its worst case (never under-counted, never
    # twice); the other turn's hold is untouched.
    assert await state(pool, "run-1") == (HOLD, HOLD, 1, ["settled", "held"])
    row = await pool.fetchrow(
        "SELECT cost_micros, billed_at_hold FROM token_usage WHERE turn_id = 'turn-late'"
    )
    assert row is not None and (row["cost_micros"], row["billed_at_hold"]) == (HOLD, True)


async def test_a_bill_waits_for_the_run_before_touching_the_hold(
    repo: MeteringRepository, pool: asyncpg.Pool
) -> None:
    """The sweeper locks the run, then the hold; a bill that locked the hold first would
    deadlock with it (and one of the two would be aborted: a call unbilled)."""
    await held(repo, "run-1", "turn-1")
    async with repo.transaction() as sweeper:
        await sweeper.lock_run("run-1")  # the sweeper's first step
        billing = asyncio.ensure_future(repo.bill(usage("turn-1", "run-1", 300)))
        await wait_for(
            lambda: pool.fetchval(
                """SELECT true FROM pg_stat_activity
                    WHERE wait_event_type = 'Lock' AND query LIKE '%run_locked%'"""
            ),
            what="the bill to wait for the run's lock",
        )
        # The hold is still free: the sweeper's second step goes through.
        assert await sweeper.settle_hold("turn-1") == HOLD
        await sweeper.save_run("run-1", RunBudget(BUDGET, HOLD, 0))
    bill = await billing  # then finds the call billed (at its hold), and adds nothing
    assert not bill.billed
    assert await state(pool, "run-1") == (HOLD, 0, 1, ["settled"])
