"""The outbox relay's claim when a session's backlog is held by another relay.

After an outage a busy session can hold thousands of outbox rows. While one relay
replica delivers them (holding a lease on the first of them), every other replica's
claim passes over each of those rows, asking whether a row of its key waits for a retry. Asked of
each row as "does an older row of its key wait", with the planner's choice of index,
that read every older row of the key: n²/2 index reads per claim, 33 s for 20,000 rows
on a 2-core machine, while the relay delivered nothing else. The claim now reads
the waiting keys once (`servicekit.outbox.CLAIM`).

Per backlog size (rows of one key, the first `HELD` of them leased as the other relay's
claim would, and 32 ready rows of 32 other sessions), the median time of a claim
(`servicekit.outbox.CLAIM`, rolled back so every round claims the same), under each of
the planner statistics the table may have (`STATISTICS`). The baseline in the same run:
the claim of the 32 rows alone, no backlog.

Goal: a claim grows linearly with the backlog. Its time beyond the baseline at 20,000
rows ÷ at 5,000, ÷ 4, is 1 when linear and 4 when quadratic; the goal allows 2.5 (a
claim of a few milliseconds is noisy on a shared machine).

    .venv/bin/python bench/outbox.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import uuid

import asyncpg
import uvloop

from benchkit import Goals, fresh_database, percentile, servers
from servicekit.db import KIT_MIGRATIONS, create_pool, migrate
from servicekit.outbox import CLAIM

SCHEMA = "bench_outbox"
BACKLOGS = (0, 5_000, 20_000)
OTHER_SESSIONS = 32
GROWTH_SLACK = 2.5
# The planner's statistics of the outbox: none yet (a new service's table, which autovacuum
# has not analyzed: the plan that took 33 s), those of the quiet outbox the backlog grew
# in (how autovacuum leaves a table that is nearly always empty), or the backlog's own.
STATISTICS = ("never analyzed", "quiet", "analyzed")
# The rows of the busy session another relay's claim holds (a relay's batch).
HELD = 256
LEASE_SECONDS = 60


async def fill(pool: asyncpg.Pool, backlog: int, statistics: str) -> None:
    """A fresh outbox holding a row of each of the other sessions and, ahead of them,
    `backlog` rows of the busy session; its planner statistics as `STATISTICS` names."""
    await pool.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
    await migrate(pool, SCHEMA, [KIT_MIGRATIONS])
    await pool.execute(
        """INSERT INTO outbox (subject, msg_id, body, ordering_key)
           SELECT 'evt', 'other-' || n, '{}', 'other-' || n FROM generate_series(1, $1) n""",
        OTHER_SESSIONS,
    )
    if statistics == "quiet":
        await pool.execute("ANALYZE outbox")
    await pool.execute(
        """INSERT INTO outbox (subject, msg_id, body, ordering_key)
           SELECT 'evt', 'busy-' || n, '{}', 'busy' FROM generate_series(1, $1) n""",
        backlog,
    )
    await pool.execute(
        """UPDATE outbox SET leased_until = now() + interval '1 hour', lease = gen_random_uuid()
            WHERE id IN (SELECT id FROM outbox WHERE ordering_key = 'busy' ORDER BY id LIMIT $1)""",
        HELD,
    )
    if statistics == "analyzed":
        await pool.execute("ANALYZE outbox")


async def claim_ms(pool: asyncpg.Pool, rounds: int) -> float:
    """The median time of a claim while another relay holds the busy session."""
    times = []
    for _ in range(rounds):
        async with pool.acquire() as conn:
            tx = conn.transaction()
            await tx.start()
            started = time.perf_counter()
            claimed = await conn.fetch(CLAIM, 256, LEASE_SECONDS, uuid.uuid4())
            times.append((time.perf_counter() - started) * 1000)
            await tx.rollback()
        if len(claimed) != OTHER_SESSIONS:
            raise RuntimeError(f"claimed {len(claimed)} rows, not the {OTHER_SESSIONS} free")
    return percentile(times, 0.5)


async def run(rounds: int) -> int:
    goals = Goals()
    async with contextlib.AsyncExitStack() as stack:
        srv = stack.enter_context(servers(prefix="bench-outbox-"))
        database_url = await stack.enter_async_context(fresh_database(srv.admin_url))
        pool = await create_pool(database_url, SCHEMA, min_size=2, max_size=4)
        stack.push_async_callback(pool.close)
        print(f"claim of {OTHER_SESSIONS} free rows behind one held session's backlog, p50 ms")
        print(f"{'backlog':>8}" + "".join(f"{name:>16}" for name in STATISTICS))
        results: dict[tuple[int, str], float] = {}
        for backlog in BACKLOGS:
            for statistics in STATISTICS:
                await fill(pool, backlog, statistics)
                results[backlog, statistics] = await claim_ms(pool, rounds)
            print(f"{backlog:>8}" + "".join(f"{results[backlog, n]:>16.2f}" for n in STATISTICS))
        small, large = BACKLOGS[1], BACKLOGS[-1]
        for statistics in STATISTICS:
            base = results[0, statistics]  # what the free rows cost alone
            beyond = results[large, statistics] - base
            growth = beyond / max(results[small, statistics] - base, 1e-3) / (large / small)
            goals.at_most(
                f"{statistics}: claim time beyond the baseline at {large} ÷ at {small} rows, "
                f"÷ {large // small} (linear: 1)",
                growth,
                GROWTH_SLACK,
            )
    print("goals:")
    print("\n".join(goals.report()))
    return goals.exit_code


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="claims per measurement")
    sys.exit(uvloop.run(run(parser.parse_args().rounds)))
