"""The relay: drains one schema's outbox through a sender.

It claims committed rows with `FOR UPDATE SKIP LOCKED`, hands them to its sender
(`JetStreamPublisher`, `CommandSender`), and deletes each row in the same transaction
once it was delivered. A crash before that commit sends the row again: JetStream drops
the copy inside its duplicate window (`Nats-Msg-Id`), the log drops it by idempotency
key, and consumers are idempotent beyond both. `LISTEN/NOTIFY` (or the writer of its
own process, `with_outbox`) wakes the relay early; polling is what guarantees progress.

Order: rows sharing an `ordering_key` (a session id) are delivered in the order they
were written — across retries and across relay replicas. A key with a row waiting
for a retry holds its other rows back, and a key another relay is working on is
skipped (an advisory lock per key); a claim never delivers a row whose predecessor of
its key it did not claim too (`CLAIM`). Rows without a key have no order.

Failures: a row the sender could not deliver is put back and retried with backoff
(`retry_delay`) for as long as it takes; one the sender says can never go (a permanent
`Delivery`) is moved to `dead_letters`, logged as `outbox_dead_letter` and counted
(the Prometheus counter `agentbus_dead_letters_total{consumer="outbox"}`,
`DEAD_LETTERS`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import asyncpg

from servicekit.cancellation import raise_if_cancelling
from servicekit.db import Connection
from servicekit.faults import crash_point
from servicekit.logs import get_logger
from servicekit.metrics import DEAD_LETTERS
from servicekit.outbox.delivery import OutboxRow, Sender
from servicekit.outbox.rows import notify_channel

log = get_logger(__name__)

MAX_BACKOFF_SECONDS = 60.0
# The consumer label of the outbox's dead letters (servicekit.metrics.DEAD_LETTERS).
OUTBOX_CONSUMER = "outbox"


def overtaking(claimed: Sequence[asyncpg.Record | Mapping[str, Any]]) -> set[int]:
    """The ids of claimed rows (in id order) that must not go yet: a row whose predecessor
    of its key in the claim's snapshot (`follows`) was not claimed with it, as the row
    before it, and every later row of its key (see `CLAIM`)."""
    previous: dict[str, int] = {}
    held: set[int] = set()
    stopped: set[str] = set()
    for row in claimed:
        key = row["ordering_key"]
        if key is None:
            continue
        if key in stopped or row["follows"] not in (None, previous.get(key)):
            stopped.add(key)
            held.add(row["id"])
        previous[key] = row["id"]
    return held


def retry_delay(attempts: int) -> float:
    """Seconds before a failed row is tried again: 0.5, 1, 2, 4… capped at a minute."""
    return float(min(0.5 * 2 ** max(attempts - 1, 0), MAX_BACKOFF_SECONDS))


def key_lock(key: str) -> str:
    """The id of the advisory lock a relay holds on an ordering key while it delivers the
    key's rows, as SQL (the argument of `pg_*advisory_xact_lock`); `key` the SQL of the key."""
    return f"hashtextextended('outbox:' || current_schema() || ':' || {key}, 0)"


# The rows a relay may deliver now, in order: `$1` how many at most.
_CLAIMABLE = f"""
SELECT id FROM outbox o
 WHERE available_at <= now()
   AND (ordering_key IS NULL OR (
        -- a row of the key waits for its retry: the key waits with it. The keys that
        -- wait are read once per claim (a hashed subplan), not once per row: asked of
        -- each row, "an older row of its key waits" read every older row of a key
        -- whose backlog another relay holds, n²/2 rows (bench/outbox.py). A row older
        -- than the one waiting (written by a transaction that committed late) waits
        -- for that retry too, and goes first then.
        o.ordering_key NOT IN (SELECT waiting.ordering_key FROM outbox waiting
                                WHERE waiting.available_at > now()
                                  AND waiting.ordering_key IS NOT NULL)
        -- another relay of this outbox is delivering this key: leave the key to it.
        -- The schema is part of the lock: services sharing a database (one Postgres
        -- under `make up`) use the same session ids as keys in their own outboxes,
        -- and must not hold each other back.
        AND pg_try_advisory_xact_lock({key_lock("o.ordering_key")})))
 ORDER BY id
 LIMIT $1
 FOR UPDATE SKIP LOCKED
"""

# A relay's claim deletes what it claims, in the transaction that lives while the rows are
# delivered: a row delivered needs no second statement, and one that was not is put back
# (`OutboxRelay._put_back`) before the commit, so to anyone else the claim is all or
# nothing. `ARRAY(…)`: the claimable rows are chosen once, before the delete.
#
# `follows`: the row before it of its key, as the claim's snapshot shows the outbox. The
# snapshot is taken when the statement starts, and a key's lock may only be won later in
# the same statement, once the relay that held it committed: the snapshot then still
# shows that relay's rows as it found them, not the one it put back for a retry, and the
# claim would let a later row of the key overtake it. A claimed row whose predecessor
# was not claimed with it is given back untouched (`overtaking`).
CLAIM = f"""
DELETE FROM outbox WHERE id = ANY(ARRAY({_CLAIMABLE}))
RETURNING id, subject, msg_id, body, headers, attempts, ordering_key, created_at,
          last_error,
          -- the row before it in outbox_ordering_idx, if of its key: one index step,
          -- where `ordering_key = … ORDER BY id DESC` lets the planner walk the primary
          -- key back through every other key's rows since
          (SELECT before.id FROM (SELECT older.ordering_key, older.id FROM outbox older
                                   WHERE older.ordering_key IS NOT NULL
                                     AND (older.ordering_key, older.id)
                                         < (outbox.ordering_key, outbox.id)
                                   ORDER BY older.ordering_key DESC, older.id DESC
                                   LIMIT 1) before
            WHERE before.ordering_key = outbox.ordering_key) AS follows
"""

# The claim of one key's rows (`OutboxRelay.deliver_now`), `$2` the key.
CLAIM_KEY = CLAIM.replace(
    "WHERE available_at <= now()", "WHERE ordering_key = $2 AND available_at <= now()"
)
# How often `deliver_now` looks again while another relay is delivering its key.
KEY_RECHECK_SECONDS = 0.01


class OutboxRelay:
    """Drains one schema's outbox through a sender."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        sender: Sender,
        batch: int = 256,
        poll_seconds: float = 1.0,
    ) -> None:
        self._pool = pool
        self._sender = sender
        self._batch = batch
        self._poll = poll_seconds
        self._wake = asyncio.Event()
        self.delivered = 0
        self.dead_lettered = 0

    async def run(self) -> None:
        """Deliver until cancelled; survives database and NATS outages."""
        listener = asyncio.create_task(self._listen())
        try:
            while True:
                try:
                    while await self.drain_once() == self._batch:
                        raise_if_cancelling()
                except (asyncpg.PostgresError, OSError) as exc:
                    log.warning("outbox_drain_failed", error=repr(exc))
                raise_if_cancelling()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._poll):
                        await self._wake.wait()
                self._wake.clear()
        finally:
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener

    def wake(self) -> None:
        """Rows were just committed by this process: drain now, without their NOTIFY
        (each NOTIFY signals every listening backend of the database)."""
        self._wake.set()

    async def deliver_now(self, key: str, timeout: float) -> bool:
        """Deliver the committed rows of `key` now rather than at the relay's next wake-up,
        in their order; True once none is left (delivered here or by another relay, which
        this waits for), False when `timeout` ran out first. The relay stays the backstop:
        whatever is left is delivered as always, and a row delivered twice is dropped by
        its receiver (`msg_id`, the log's idempotency key)."""
        try:
            async with asyncio.timeout(timeout):
                while True:
                    await self.drain_once(key)
                    if not await self._pool.fetchval(
                        "SELECT EXISTS (SELECT 1 FROM outbox WHERE ordering_key = $1)", key
                    ):
                        return True
                    # another relay holds the key, or a row waits for its retry
                    await asyncio.sleep(KEY_RECHECK_SECONDS)
        except TimeoutError:
            return False

    async def drain_once(self, key: str | None = None) -> int:
        """Claim, deliver and delete one batch (of `key`'s rows only, when given); return
        how many rows were claimed."""
        async with self._pool.acquire() as conn, conn.transaction():
            claimed = await (
                conn.fetch(CLAIM, self._batch)
                if key is None
                else conn.fetch(CLAIM_KEY, self._batch, key)
            )
            if not claimed:
                return 0
            claimed = sorted(claimed, key=lambda r: r["id"])  # RETURNING keeps no order
            held = overtaking(claimed)
            if held:
                await self._give_back(conn, [r for r in claimed if r["id"] in held])
                claimed = [r for r in claimed if r["id"] not in held]
                if not claimed:
                    return len(held)
            rows = [OutboxRow(*r[:7]) for r in claimed]  # CLAIM returns the fields in order
            crash_point("outbox.before_publish")
            results = await self._sender.send(rows)
            crash_point("outbox.after_publish")
            for record, row, delivery in zip(claimed, rows, results, strict=True):
                if delivery.permanent:
                    await self._dead_letter(conn, row, delivery.error or "")
                elif delivery.error is not None:
                    await self._put_back(conn, row, record["created_at"], delivery.error)
            self.delivered += sum(d.error is None for d in results)
            return len(rows) + len(held)

    async def _give_back(self, conn: Connection, claimed: Sequence[asyncpg.Record]) -> None:
        """Undo the claim's delete of rows that may not go yet, as they were: the next
        claim, with a snapshot of its own, finds them behind their predecessors."""
        await conn.executemany(
            """INSERT INTO outbox (id, subject, msg_id, body, headers, attempts, ordering_key,
                                   created_at, last_error)
               VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)""",
            [tuple(r[:9]) for r in claimed],
        )
        log.info(
            "outbox_claim_gave_back",
            rows=len(claimed),
            keys=sorted({r["ordering_key"] for r in claimed}),
        )

    async def _put_back(
        self, conn: Connection, row: OutboxRow, created_at: datetime, error: str
    ) -> None:
        """Undo the claim's delete of a row not delivered, to be tried again later: the
        same id (its place in its key's order) and age, one more attempt."""
        attempts = row.attempts + 1
        await conn.execute(
            """INSERT INTO outbox (id, subject, msg_id, body, headers, attempts, ordering_key,
                                   created_at, last_error, available_at)
               VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, now() + make_interval(secs => $10))""",
            row.id,
            row.subject,
            row.msg_id,
            row.body,
            row.headers,
            attempts,
            row.ordering_key,
            created_at,
            error,
            retry_delay(attempts),
        )
        log.warning(
            "outbox_delivery_failed",
            subject=row.subject,
            msg_id=row.msg_id,
            attempts=attempts,
            error=error,
        )

    async def _dead_letter(self, conn: Connection, row: OutboxRow, reason: str) -> None:
        await conn.execute(
            """INSERT INTO dead_letters
                   (consumer, stream, stream_seq, subject, msg_id, deliveries, reason, body)
               VALUES ('outbox', 'outbox', $1, $2, $3, $4, $5, $6)
               ON CONFLICT (consumer, stream, stream_seq) DO NOTHING""",
            row.id,
            row.subject,
            row.msg_id,
            row.attempts + 1,
            reason,
            row.body,
        )
        self.dead_lettered += 1
        DEAD_LETTERS.labels(OUTBOX_CONSUMER, row.subject).inc()
        log.error(
            "outbox_dead_letter",
            subject=row.subject,
            msg_id=row.msg_id,
            ordering_key=row.ordering_key,
            attempts=row.attempts + 1,
            reason=reason,
        )

    async def _listen(self) -> None:
        """Hold a LISTEN connection, reconnecting after failures; only ever a hint."""
        while True:
            try:
                async with self._pool.acquire() as conn:
                    wake = lambda *_: self.wake()  # noqa: E731
                    channel = notify_channel(await conn.fetchval("SELECT current_schema()"))
                    await conn.add_listener(channel, wake)
                    try:
                        while not conn.is_closed():  # noqa: ASYNC110 - asyncpg has no close event
                            await asyncio.sleep(5)
                    finally:
                        with contextlib.suppress(Exception):
                            await conn.remove_listener(channel, wake)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("outbox_listen_failed", error=repr(exc))
                await asyncio.sleep(1)
