"""A replica's life as Postgres sees it: an advisory lock on a connection of its own.

The lock is taken before the replica serves and held until it ends; Postgres frees it
when its connection closes, which a SIGKILLed process's does at once. So a survivor
that can take it knows the replica is gone, and that none of its calls still runs
(`metering.sweeper.settle_orphans`). A replica whose lock connection breaks while it
lives takes it again; meanwhile a survivor may settle its holds at their worst case,
and its own bill of those calls then writes nothing (their rows exist): each call is
still billed once, at the higher figure.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import asyncpg

from metering.budgets import REPLICA_LOCK_KEY
from servicekit.logs import get_logger

log = get_logger(__name__)

CHECK_SECONDS = 2.0
# A survivor holds a dead replica's lock for as long as it takes to settle its holds:
# longer than this, the lock is a live process's.
TAKE_PATIENCE_SECONDS = 30.0
TAKE_RETRY_SECONDS = 0.1


class ReplicaIdTaken(RuntimeError):
    """Another live process holds this replica's lock: two replicas share an instance id."""

    def __init__(self, replica: str) -> None:
        super().__init__(
            f"another live metering process holds instance id {replica!r}: give every "
            "replica its own AGENTBUS_INSTANCE_ID (holds are told apart by it)"
        )


class ReplicaLock:
    """This replica's lock, on its own connection (not the pool's: it is never released)."""

    def __init__(self, database_url: str, replica: str) -> None:
        self._url = database_url
        self.replica = replica
        self._conn: asyncpg.Connection | None = None

    async def take(self, patience_seconds: float = TAKE_PATIENCE_SECONDS) -> None:
        """Connect and take the lock, waiting while a survivor holds it (settling the holds
        an earlier process of this id left); `ReplicaIdTaken` if it stays held, by a live
        process under the same instance id."""
        conn = await asyncpg.connect(self._url)
        try:
            deadline = time.monotonic() + patience_seconds
            while not await conn.fetchval(
                f"SELECT pg_try_advisory_lock({REPLICA_LOCK_KEY})", self.replica
            ):
                if time.monotonic() > deadline:
                    raise ReplicaIdTaken(self.replica)
                await asyncio.sleep(TAKE_RETRY_SECONDS)
        except BaseException:
            await conn.close()
            raise
        self._conn = conn

    async def keep(self) -> None:
        """Until cancelled: check the connection, and take the lock again if it broke."""
        while True:
            await asyncio.sleep(CHECK_SECONDS)
            try:
                if self._conn is None or self._conn.is_closed():
                    await self.take()
                    log.warning("replica_lock_taken_again", replica=self.replica)
                else:
                    await self._conn.fetchval("SELECT 1")
            except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as exc:
                log.warning("replica_lock_lost", replica=self.replica, error=repr(exc))
                await self.close()

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()
