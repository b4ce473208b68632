"""Settles the budget holds of calls whose metering replica died mid-call.

A hold is settled by the replica that made it, in the same transaction as the call's
usage row. If that replica is killed between the reservation and the bill, the hold
stays live and blocks that much of the run's budget, and the call (if it reached the
provider) has no usage row. Such a hold is settled at its full worst case, with a usage
row that says so (`billed_at_hold`): the provider may have produced up to that much,
and the budget must never be under-counted (no overspend). It is logged loudly, since
its real usage is unknown.

A hold is known abandoned three ways, each settling it exactly once whoever races
(the hold is settled and the row written only while the hold is still live, and the
row's turn id is unique):
- its replica is gone: every replica holds an advisory lock for its life
  (`metering.replicas.ReplicaLock`), which Postgres frees when the process dies; a
  survivor that can take it settles the holds of that replica (`settle_orphans`);
- its replica restarted under the same instance id: a process's holds cannot outlive it,
  so it settles its own at start, before it serves (`settle_own`);
- it is older than any call can last (holds of a process without an instance id).
"""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg

from domain.metering import settle
from metering.metrics import observe_spend
from metering.repository import MeteringRepository
from servicekit.db import Connection
from servicekit.logs import get_logger

log = get_logger(__name__)


async def _settle(
    repo: MeteringRepository, holds: list[Any], reason: str, on: Connection | None = None
) -> int:
    """Settle each hold still live at its worst case, with its usage row; how many were."""
    settled = 0
    for hold in holds:
        async with repo.transaction(on) as tx:
            run = await tx.lock_run(hold["run_id"])
            if await tx.settle_hold(hold["turn_id"]) is None:
                continue  # billed meanwhile, or settled by another replica
            await tx.save_run(hold["run_id"], settle(run, hold["hold_micros"], hold["hold_micros"]))
            settled += 1
            log.warning(
                "abandoned_hold_settled",
                turn_id=hold["turn_id"],
                run_id=hold["run_id"],
                charged_micros=hold["hold_micros"],
                reason=reason,
            )
    return settled


async def sweep_once(repo: MeteringRepository, older_than_seconds: float) -> int:
    """Settle every hold older than any call can last; return how many were settled."""
    async with repo.transaction() as tx:
        holds = await tx.abandoned_holds(older_than_seconds)
    reason = "no bill after the longest a call can last: charged its worst case"
    return await _settle(repo, holds, reason)


async def settle_orphans(repo: MeteringRepository) -> int:
    """Settle the holds of every other replica that is gone (its lock is free)."""
    settled = 0
    for replica in await repo.replicas_holding():
        async with repo.if_gone(replica) as conn:
            if conn is None:
                continue  # alive: its calls still run, and it bills them
            async with repo.transaction(conn) as tx:
                holds = await tx.holds_of(replica)
            reason = f"replica {replica} died before billing: charged its worst case"
            settled += await _settle(repo, holds, reason, conn)
    return settled


async def settle_own(repo: MeteringRepository) -> int:
    """At start, under this replica's lock: settle the holds an earlier process of the same
    instance id left (it died: none of their calls runs any more)."""
    if repo.replica is None:
        return 0
    async with repo.transaction() as tx:
        holds = await tx.holds_of(repo.replica)
    reason = "this replica restarted after dying before billing: charged its worst case"
    return await _settle(repo, holds, reason)


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
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as exc:
            log.warning("hold_sweep_failed", error=repr(exc))
        await asyncio.sleep(interval_seconds)


async def run_orphan_sweeper(repo: MeteringRepository, interval_seconds: float) -> None:
    """Settle the holds of dead replicas every `interval_seconds` until cancelled: a person
    whose call died with its replica sees the budget it held back within seconds."""
    while True:
        try:
            await settle_orphans(repo)
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as exc:
            log.warning("orphan_sweep_failed", error=repr(exc))
        await asyncio.sleep(interval_seconds)
