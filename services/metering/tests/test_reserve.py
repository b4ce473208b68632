"""A turn's reservation (`MeteringRepository.reserve`), on the path of every first token:
when this replica wrote the run's row last, the run's hold, the turn's claim and its share
on every limit in force go in one statement (one round trip), all or nothing, against
real Postgres."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import date
from typing import Any

import asyncpg
import pytest
import pytest_asyncio
from asyncpg.connection import LoggedQuery

from contracts.common import ErrorCode
from contracts.metering import ChatMessage, LlmTurn
from domain.errors import DomainError
from domain.metering import Price
from domain.metering_turn import hold_for
from metering.repository import MeteringRepository, Reservation

from .conftest import migrated_pool

PRICE = Price("claude-sonnet-4-6", date(2026, 5, 29), 3_000_000, 15_000_000, 3_750_000,
              6_000_000, 300_000)  # fmt: skip


@pytest_asyncio.fixture
async def pool(database_url: str) -> AsyncIterator[asyncpg.Pool]:
    # One connection: every statement of the repository goes through it, where it is heard.
    async with migrated_pool(database_url, size=1) as pool:
        yield pool


@pytest.fixture
def repo(pool: asyncpg.Pool) -> MeteringRepository:
    return MeteringRepository(pool, replica="metering-a")


def turn(run_id: str, project: str, **fields: Any) -> LlmTurn:
    values: dict[str, Any] = {
        "run_id": run_id,
        "turn_id": f"turn-{uuid.uuid4().hex}",
        "agent_slug": "criativo",
        "project_id": project,
        "person": "ana",
        "messages": [ChatMessage(role="user", content="Um app para padarias")],
        "max_tokens": 100,
        **fields,
    }
    return LlmTurn.model_validate(values)


async def reserve(repo: MeteringRepository, cmd: LlmTurn) -> Reservation:
    return await repo.reserve(cmd, hold_for(cmd, PRICE), "scripted", PRICE.model)


async def statements_of(pool: asyncpg.Pool) -> list[str]:
    """The statements the pool's connection sends from now on, as they are sent."""
    sent: list[str] = []

    def heard(query: LoggedQuery) -> None:
        sent.append(query.query)

    async with pool.acquire() as conn:
        conn.add_query_logger(heard)
    return sent


async def counters(pool: asyncpg.Pool, project: str) -> dict[str, tuple[int, int]]:
    """The project's counters of the windows open now: (held, used) by metric/window."""
    rows = await pool.fetch(
        """SELECT metric || '/' || win AS what, held, used FROM usage_counters
            WHERE scope = 'project' AND name = $1 AND starts = date_trunc(win, now(), 'UTC')""",
        project,
    )
    return {r["what"]: (r["held"], r["used"]) for r in rows}


async def run_row(pool: asyncpg.Pool, run_id: str) -> tuple[int, int]:
    """The run's reserved µUSD and its row's version."""
    row = await pool.fetchrow(
        "SELECT reserved_micros, version FROM run_budgets WHERE run_id = $1", run_id
    )
    assert row is not None
    return row["reserved_micros"], row["version"]


async def test_a_turn_of_a_run_this_replica_wrote_last_is_held_in_one_round_trip(
    pool: asyncpg.Pool, repo: MeteringRepository
) -> None:
    project, run = f"proj-{uuid.uuid4().hex[:8]}", f"criativo.{uuid.uuid4()}"
    first, second = turn(run, project), turn(run, project)
    assert await reserve(repo, first) == Reservation(claimed=True)
    sent = await statements_of(pool)

    assert await reserve(repo, second) == Reservation(claimed=True)
    await asyncio.sleep(0)  # the connection tells its query loggers on the next loop turn

    assert len(sent) == 1, sent  # no read, no BEGIN and COMMIT: one statement
    hold = await pool.fetchrow(
        """SELECT h.hold_micros, h.replica, h.kind, h.provider, h.person, h.counters,
                  r.reserved_micros
             FROM budget_holds h JOIN run_budgets r USING (run_id) WHERE turn_id = $1""",
        second.turn_id,
    )
    assert hold is not None
    both = hold_for(first, PRICE).micros + hold_for(second, PRICE).micros
    assert hold["reserved_micros"] == both  # the run holds both turns
    assert (hold["replica"], hold["kind"], hold["provider"], hold["person"]) == (
        "metering-a",
        "turn",
        "scripted",
        "ana",
    )
    # the seeded default limits: the project's and the person's day, month, requests, tokens
    assert sorted(hold["counters"]) == [
        f"{scope}/{counter}"
        for scope in ("person", "project")
        for counter in ("micros/day", "micros/month", "requests/minute", "tokens/minute")
    ]
    assert (await counters(pool, project))["requests/minute"] == (2, 0)


async def test_a_limit_the_turn_does_not_fit_under_leaves_nothing_of_its_reservation(
    pool: asyncpg.Pool, repo: MeteringRepository
) -> None:
    project, run = f"proj-{uuid.uuid4().hex[:8]}", f"criativo.{uuid.uuid4()}"
    await pool.execute(
        "INSERT INTO limits (scope, name, requests_per_minute) VALUES ('project', $1, 1)",
        project,
    )
    first, second = turn(run, project), turn(run, project)
    assert await reserve(repo, first) == Reservation(claimed=True)
    before = await counters(pool, project), await run_row(pool, run)

    refused = await reserve(repo, second)

    assert refused.claimed and refused.refused is not None
    assert (refused.refused.metric, refused.refused.window) == ("requests", "minute")
    assert (refused.refused.limit, refused.refused.used, refused.refused.held) == (1, 0, 1)
    after = await counters(pool, project), await run_row(pool, run)
    assert after == before  # neither the run nor any counter moved
    held = "SELECT count(*) FROM budget_holds WHERE turn_id = $1"
    assert await pool.fetchval(held, second.turn_id) == 0
    # the next turn that fits is held as usual
    await pool.execute("DELETE FROM limits WHERE scope = 'project' AND name = $1", project)
    assert await reserve(repo, turn(run, project)) == Reservation(claimed=True)


async def test_a_turn_id_claimed_under_another_run_is_refused_and_writes_nothing(
    pool: asyncpg.Pool, repo: MeteringRepository
) -> None:
    project = f"proj-{uuid.uuid4().hex[:8]}"
    taken = turn(f"criativo.{uuid.uuid4()}", project)
    assert await reserve(repo, taken) == Reservation(claimed=True)
    before = await counters(pool, project)
    fresh = f"criativo.{uuid.uuid4()}"  # a run without a row: the hold creates it

    with pytest.raises(DomainError) as refused:
        await reserve(repo, turn(fresh, project, turn_id=taken.turn_id))

    assert refused.value.code == ErrorCode.TURN_ID_REUSED
    assert await pool.fetchval("SELECT count(*) FROM run_budgets WHERE run_id = $1", fresh) == 0
    assert await counters(pool, project) == before
