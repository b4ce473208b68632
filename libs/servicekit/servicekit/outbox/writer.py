"""Writing to the outbox: a service writes its state change and an outbox row in one
transaction, always through `Outbox` — `append(event)` for the session log, `send(...)`
for any other subject, `append_with`/`send_with` to write the row in the very statement
of the effect. Rows written here go once the transaction commits, and never if it rolls
back; the relay (`servicekit.outbox.relay`) delivers them.

A service opens such a transaction with `with_outbox`, wrapped by its repository's typed
transaction, and gives it its relay's wake-up (`OutboxRelay.wake`): the writer knows the
relay only as that callback.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import asyncpg

from contracts.session_events import AppendEvent
from servicekit.db import Connection
from servicekit.outbox.announcement import Announcement, append_args, queued_append
from servicekit.outbox.rows import (
    NO_NOTIFY,
    NOTIFY,
    Queued,
    queue_args,
    queue_many_args,
    queue_many_statement,
    queue_statement,
    without_notify,
)


class Outbox:
    """The outbox of the caller's transaction — the one way a service writes an outbox
    row. Rows written here are delivered once the transaction commits, and never if it
    rolls back.

    `append`/`send` write the row alone; `append_with`/`send_with` write it in the
    same statement as the caller's own effect (data-modifying CTEs): one round trip
    while a lock is held, which is why the log and the handoffs use them
    (bench/append.py measures it).
    """

    def __init__(self, conn: Connection, notify: bool = True) -> None:
        """`notify` False: rows go without a NOTIFY, for a writer that wakes the relay of
        its own process itself once they are committed (`with_outbox`)."""
        self._conn = conn
        self._wake = NOTIFY if notify else NO_NOTIFY
        self.queued = 0  # statements that queued rows, for the caller's wake-up

    async def append(self, event: AppendEvent | Announcement) -> None:
        """Append `event` to the session log after commit, in its session's order.

        Its idempotency key is required: it makes a repeated append a no-op. An event
        the log would refuse raises `DomainError` now (`check_appendable`). An
        `Announcement` is not validated again: build one where the payload is built."""
        await self._conn.execute(f"WITH {queue_statement(1, self._wake)}", *append_args(event))
        self.queued += 1

    async def send(
        self,
        subject: str,
        msg_id: str,
        body: bytes,
        headers: Mapping[str, str] | None = None,
        ordering_key: str | None = None,
    ) -> None:
        """Deliver `body` on `subject` after commit (published, or sent as a command,
        as the relay's sender does), deduplicated by `msg_id`."""
        await self._conn.execute(
            f"WITH {queue_statement(1, self._wake)}",
            *queue_args(subject, msg_id, body, headers, ordering_key),
        )
        self.queued += 1

    async def append_with(
        self,
        effect: str,
        args: Sequence[Any],
        event: AppendEvent | Announcement,
        returning: str = "",
    ) -> dict[str, Any] | None:
        """`append`, in one statement with `effect`: CTEs (`name AS (…)`, parameters
        `$1`..`$len(args)`). With `returning`, the row of that CTE comes back."""
        return await self._with(effect, args, append_args(event), returning)

    async def send_with(
        self,
        effect: str,
        args: Sequence[Any],
        subject: str,
        msg_id: str,
        body: bytes,
        ordering_key: str | None = None,
        returning: str = "",
    ) -> dict[str, Any] | None:
        """`send`, in one statement with `effect` (as `append_with`)."""
        queued = queue_args(subject, msg_id, body, ordering_key=ordering_key)
        return await self._with(effect, args, queued, returning)

    async def send_many_with(
        self,
        effect: str,
        args: Sequence[Any],
        messages: Sequence[Queued],
        returning: str = "",
    ) -> list[dict[str, Any]]:
        """`send_with` for many rows at once: the effect (CTEs, parameters
        `$1`..`$len(args)`) and every row in one statement, and one wake-up for all. With
        `returning`, the rows of that CTE come back."""
        rows_json, bodies = queue_many_args(messages)
        rows = await self._conn.fetch(
            f"WITH {effect}, {queue_many_statement(len(args) + 1, self._wake, returning)}",
            *args,
            rows_json,
            bodies,
        )
        self.queued += 1
        return [without_notify(r) for r in rows] if returning else []

    async def append_many_with(
        self,
        effect: str,
        args: Sequence[Any],
        events: Sequence[AppendEvent | Announcement],
        returning: str = "",
    ) -> list[dict[str, Any]]:
        """`append_with` for many events (each appended in its session's order, in the order
        given), in one statement with `effect`."""
        queued = [queued_append(e) for e in events]
        return await self.send_many_with(effect, args, queued, returning)

    async def _with(
        self, effect: str, args: Sequence[Any], queued: list[Any], returning: str
    ) -> dict[str, Any] | None:
        row = await self._conn.fetchrow(
            f"WITH {effect}, {queue_statement(len(args) + 1, self._wake, returning)}",
            *args,
            *queued,
        )
        self.queued += 1
        return None if row is None else without_notify(row)


# What wakes the relay of this process once rows are committed (`OutboxRelay.wake`).
Wake = Callable[[], None]


@asynccontextmanager
async def with_outbox(
    pool: asyncpg.Pool, wake: Wake | None, *, transaction: bool = True
) -> AsyncIterator[tuple[Connection, Outbox]]:
    """A connection of `pool`, in a transaction (or, `transaction` False, each statement
    committing on its own), and the outbox its statements queue rows in: the one way a
    service opens a transaction that writes outbox rows (its repository wraps it in its
    own typed transaction).

    Given `wake`, what wakes the relay of this process, rows go without a NOTIFY — each
    NOTIFY signals every listening backend of the database, and takes a database-wide
    lock at commit — and `wake` is called once they are committed. Another replica's
    relay finds them by polling should this process die before delivering them. Without
    it (no relay in this process), a NOTIFY announces them on commit."""
    async with pool.acquire() as conn:
        outbox = Outbox(conn, notify=wake is None)
        if transaction:
            async with conn.transaction():
                yield conn, outbox
        else:
            yield conn, outbox
        if wake is not None and outbox.queued:
            wake()
