"""The transactional outbox and its relay.

A service writes its state change and an outbox row in one transaction
(`enqueue`). The relay claims committed rows with `FOR UPDATE SKIP LOCKED`,
publishes each to JetStream with `Nats-Msg-Id`, and deletes it in the same
transaction once the server acknowledged it. A crash before the delete commits
republishes the row; the stream's duplicate window drops the copy and consumers
are idempotent beyond it. `LISTEN/NOTIFY` wakes the relay early; polling is what
guarantees progress.

Order: one relay publishes a batch in id order. Rows whose publish failed are
retried later with backoff, possibly after newer rows: consumers order by the
event's `seq`, not by arrival.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import Any

import asyncpg
from nats.js import JetStreamContext

from servicekit.db import Connection
from servicekit.faults import crash_point
from servicekit.logs import get_logger
from servicekit.telemetry import inject_headers

log = get_logger(__name__)

NOTIFY_CHANNEL = "agentbus_outbox"
PUBLISH_TIMEOUT_SECONDS = 5.0
MAX_BACKOFF_SECONDS = 60.0


async def enqueue(
    conn: Connection,
    subject: str,
    msg_id: str,
    body: bytes,
    headers: Mapping[str, str] | None = None,
) -> None:
    """Record a message to publish once the caller's transaction commits."""
    await conn.execute(
        "INSERT INTO outbox (subject, msg_id, body, headers) VALUES ($1, $2, $3, $4)",
        subject,
        msg_id,
        body,
        inject_headers(dict(headers or {})),
    )
    # Delivered on commit, dropped on rollback: exactly the hint the relay needs.
    await conn.execute("SELECT pg_notify($1, '')", NOTIFY_CHANNEL)


def retry_delay(attempts: int) -> float:
    """Seconds before a failed row is tried again: 0.5, 1, 2, 4… capped at a minute."""
    return float(min(0.5 * 2 ** max(attempts - 1, 0), MAX_BACKOFF_SECONDS))


class OutboxRelay:
    """Drains one schema's outbox to JetStream."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        js: JetStreamContext,
        batch: int = 256,
        poll_seconds: float = 1.0,
    ) -> None:
        self._pool = pool
        self._js = js
        self._batch = batch
        self._poll = poll_seconds
        self._wake = asyncio.Event()
        self.published = 0

    async def run(self) -> None:
        """Publish until cancelled; survives database and NATS outages."""
        listener = asyncio.create_task(self._listen())
        try:
            while True:
                try:
                    while await self.drain_once() == self._batch:
                        pass
                except (asyncpg.PostgresError, OSError) as exc:
                    log.warning("outbox_drain_failed", error=repr(exc))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self._poll)
                self._wake.clear()
        finally:
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener

    async def drain_once(self) -> int:
        """Claim, publish and delete one batch; return how many rows were claimed."""
        async with self._pool.acquire() as conn, conn.transaction():
            rows = await conn.fetch(
                """SELECT id, subject, msg_id, body, headers, attempts FROM outbox
                    WHERE available_at <= now()
                    ORDER BY id
                    LIMIT $1
                    FOR UPDATE SKIP LOCKED""",
                self._batch,
            )
            if not rows:
                return 0
            crash_point("outbox.before_publish")
            results = await self._publish(rows)
            crash_point("outbox.after_publish")
            done = [r["id"] for r, res in zip(rows, results, strict=True) if res is None]
            await conn.execute("DELETE FROM outbox WHERE id = ANY($1::bigint[])", done)
            for row, error in zip(rows, results, strict=True):
                if error is not None:
                    await self._postpone(conn, row, error)
            self.published += len(done)
            return len(rows)

    async def _publish(self, rows: list[asyncpg.Record]) -> list[str | None]:
        """Publish in id order without waiting for each ack; None where the server acked."""
        futures: list[asyncio.Future[Any] | None] = []
        errors: list[str | None] = []
        for row in rows:
            headers = {**row["headers"], "Nats-Msg-Id": row["msg_id"]}
            try:
                futures.append(
                    await self._js.publish_async(row["subject"], row["body"], headers=headers)
                )
                errors.append(None)
            except Exception as exc:  # connection lost mid-batch: retry the row later
                futures.append(None)
                errors.append(repr(exc))
        for i, future in enumerate(futures):
            if future is None:
                continue
            try:
                await asyncio.wait_for(future, PUBLISH_TIMEOUT_SECONDS)
            except Exception as exc:
                errors[i] = repr(exc) or type(exc).__name__
        return errors

    async def _postpone(self, conn: Connection, row: asyncpg.Record, error: str) -> None:
        attempts = row["attempts"] + 1
        await conn.execute(
            """UPDATE outbox SET attempts = $2, last_error = $3,
                      available_at = now() + make_interval(secs => $4)
                WHERE id = $1""",
            row["id"],
            attempts,
            error,
            retry_delay(attempts),
        )
        log.warning(
            "outbox_publish_failed",
            subject=row["subject"],
            msg_id=row["msg_id"],
            attempts=attempts,
            error=error,
        )

    async def _listen(self) -> None:
        """Hold a LISTEN connection, reconnecting after failures; only ever a hint."""
        while True:
            try:
                async with self._pool.acquire() as conn:
                    wake = lambda *_: self._wake.set()  # noqa: E731
                    await conn.add_listener(NOTIFY_CHANNEL, wake)
                    try:
                        while not conn.is_closed():  # noqa: ASYNC110 - asyncpg has no close event
                            await asyncio.sleep(5)
                    finally:
                        with contextlib.suppress(Exception):
                            await conn.remove_listener(NOTIFY_CHANNEL, wake)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("outbox_listen_failed", error=repr(exc))
                await asyncio.sleep(1)
