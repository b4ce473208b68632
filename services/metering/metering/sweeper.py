"""Releases the budget holds of calls whose metering replica died mid-call.

A hold is settled by the replica that made it, in the same transaction as the call's
usage row. If that replica is killed between the reservation and the bill, the hold
stays live for ever and blocks that much of the run's budget. Once a hold is older
than any call can last, it is settled here at its full worst case: the provider may
have produced up to that much, and the budget must never be under-counted (no
overspend). It is logged loudly, since its real usage is unknown.
"""

from __future__ import annotations

import asyncio

import asyncpg

from domain.metering import settle
from metering.metrics import observe_spend
from metering.repository import MeteringRepository
from servicekit.logs import get_logger

log = get_logger(__name__)


async def sweep_once(repo: MeteringRepository, older_than_seconds: float) -> int:
    """Settle every abandoned hold at its worst case; return how many were settled."""
    settled = 0
    async with repo.transaction() as tx:
        holds = await tx.abandoned_holds(older_than_seconds)
    for hold in holds:
        async with repo.transaction() as tx:
            run = await tx.lock_run(hold["run_id"])
            if await tx.settle_hold(hold["turn_id"], hold["hold_micros"]) is None:
                continue  # billed meanwhile, or swept by another replica
            await tx.save_run(hold["run_id"], settle(run, hold["hold_micros"], hold["hold_micros"]))
            settled += 1
            log.warning(
                "abandoned_hold_settled",
                turn_id=hold["turn_id"],
                run_id=hold["run_id"],
                charged_micros=hold["hold_micros"],
                reason="no bill after the longest a call can last: charged its worst case",
            )
    return settled


async def run_sweeper(
    repo: MeteringRepository, older_than_seconds: float, interval_seconds: float
) -> None:
    """Sweep every `interval_seconds` until cancelled, and read the projects' spend into
    their budget gauges (a window that ended resets them); a database outage only delays
    it."""
    while True:
        try:
            await sweep_once(repo, older_than_seconds)
            observe_spend(await repo.project_spend(), whole=True)
        except (asyncpg.PostgresError, OSError) as exc:
            log.warning("hold_sweep_failed", error=repr(exc))
        await asyncio.sleep(interval_seconds)
