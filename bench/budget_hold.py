"""Metering's budget reservation on the first-token path, alone: both ways, same run.

Every streaming turn holds its worst case on its run before the provider is called
(DESIGN.md, budget races). Measured against metering's own tables (a fresh database,
migrated as the service does), `RESERVING_RUNS` runs at once, each reserving
`TURNS_PER_RUN` turns one after another as a session's turns come:

- baseline: the locked read-decide-write transaction (BEGIN, lock the row, claim +
  save, COMMIT: four round trips), the way a replica that does not know the run's row
  reserves;
- one statement: `hold_if_unchanged` on the row as this replica last wrote it (the run's
  previous turn), what metering does on its hot path since issue 12.

Interleaved rounds, so both see the same machine; latency and CPU ms per reservation
(this process and Postgres). Exits non-zero when the one statement is not cheaper.

    .venv/bin/python bench/budget_hold.py
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
import uuid

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
from domain.metering import RunBudget, reserve
from metering.repository import MeteringRepository, StoredRun
from servicekit.db import create_pool, migrate

# The reservation on the first-token path, alone: runs reserving their turns one after
# another, this many runs at once, this many turns each.
RESERVING_RUNS, TURNS_PER_RUN, HOLD = 50, 20, 1_000


async def reservations(database_url: str) -> tuple[list[str], Goals]:
    """A turn's budget reservation, both ways, against metering's tables (migrated by the
    service): the locked read-decide-write transaction (4 round trips, the way a replica
    that does not know the run's row reserves, and the baseline), and the one statement
    of a replica that wrote the row last (`hold_if_unchanged`). Interleaved rounds, so
    both see the same machine."""
    pool = await create_pool(database_url, "metering", min_size=10, max_size=10)
    repo = MeteringRepository(pool)
    meters = {"locked": CpuMeter({"bench": [os.getpid()]}, pool)}
    meters["one statement"] = CpuMeter({"bench": [os.getpid()]}, pool)
    latencies: dict[str, list[float]] = {name: [] for name in meters}
    cpu: dict[str, list[CpuUsage]] = {name: [] for name in meters}

    async def locked(run_id: str, turns: int, times: list[float]) -> None:
        for _ in range(turns):
            started = time.perf_counter()
            async with repo.transaction() as tx:
                run = reserve(await tx.lock_run(run_id), HOLD, run_id)
                await tx.hold(run_id, uuid.uuid4().hex, HOLD, run)
            times.append((time.perf_counter() - started) * 1000)

    async def remembered(run_id: str, turns: int, times: list[float]) -> None:
        seen: StoredRun | None = None
        for _ in range(turns):
            started = time.perf_counter()
            run = reserve(seen.budget if seen else RunBudget(None, 0, 0), HOLD, run_id)
            version = await repo.hold_if_unchanged(run_id, uuid.uuid4().hex, HOLD, seen, run)
            assert version is not None, "only this bench writes these runs"
            seen = StoredRun(run, version)
            times.append((time.perf_counter() - started) * 1000)

    ways = {"locked": locked, "one statement": remembered}
    try:
        for _ in range(3):
            for name, way in ways.items():
                await meters[name].start()
                started = time.perf_counter()
                runs = [f"bench-reserve-{uuid.uuid4().hex}" for _ in range(RESERVING_RUNS)]
                await asyncio.gather(*(way(r, TURNS_PER_RUN, latencies[name]) for r in runs))
                turns = RESERVING_RUNS * TURNS_PER_RUN
                cpu[name].append(await meters[name].stop(turns, time.perf_counter() - started))
    finally:
        await pool.close()
    base = latencies["locked"]
    lines = [f"reservation, {RESERVING_RUNS} runs at once, {TURNS_PER_RUN} turns each:"]
    lines += [
        latency_row(name, latencies[name], None if name == "locked" else base) for name in ways
    ]
    rows = [(name, RESERVING_RUNS, usage) for name in ways for usage in cpu[name]]
    lines += cpu_table(["bench", "postgres"], rows, name_width=14)
    goals = Goals()
    goals.at_most(
        "one statement's p50 ÷ the locked transaction's",
        percentile(latencies["one statement"], 0.5) / percentile(base, 0.5),
        1.0,
    )
    return lines, goals


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
        lines, goals = await reservations(database_url)
        print("\n".join(lines))
        print("goals:")
        print("\n".join(goals.report()))
        return goals.exit_code


if __name__ == "__main__":
    sys.exit(uvloop.run(run()))
