"""The relay: drains one schema's outbox through a sender.

It claims committed rows with a **lease** (`CLAIM`: one statement, committing on its
own, that marks the rows its own until `leased_until`), hands them to its sender
(`JetStreamPublisher`, `CommandSender`) holding no transaction and no lock while the
receiver answers, then deletes what was delivered: in its next claim when that comes at
once (`CLAIM_AFTER_DELIVERY`, one statement a batch), else alone. A relay that dies
holding a lease leaves its rows to whichever relay claims them once the lease expired;
one whose lease expired while it was still sending has lost them: whatever it writes
afterwards names its lease (`lease = $n`) and changes nothing. Either way a row may be
sent twice: JetStream drops the copy inside its duplicate window (`Nats-Msg-Id`), the log
drops it by idempotency key, and consumers are idempotent beyond both. A second copy
never lands ahead of a later row of its key: a sender sends a key's next row only once
the receiver acknowledged the row before it (`one_after_another`, an atomic batch), so
every row before it is stored by then, whoever sent it. `LISTEN/NOTIFY` (or the writer of
its own process, `with_outbox`) wakes the relay early; polling is what guarantees progress.

Order: rows sharing an `ordering_key` (a session id) are delivered in the order they
were written — across retries and across relay replicas. A key with a row waiting
for a retry holds its other rows back, and a key with a row another relay holds an
unexpired lease on is skipped; a claim never delivers a row whose predecessor of its
key it did not claim too (`CLAIM`, `overtaking`). Rows without a key have no order.

Failures: a row the sender could not deliver is put back and retried with backoff
(`retry_delay`) for as long as it takes; one the sender says can never go (a permanent
`Delivery`) is moved to `dead_letters`, logged as `outbox_dead_letter` and counted
(the Prometheus counter `agentbus_dead_letters_total{consumer="outbox"}`,
`DEAD_LETTERS`).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import asyncpg

from servicekit.cancellation import raise_if_cancelling
from servicekit.faults import crash_point
from servicekit.logs import get_logger
from servicekit.metrics import DEAD_LETTERS
from servicekit.outbox.delivery import Delivery, OutboxRow, Sender
from servicekit.outbox.rows import notify_channel

log = get_logger(__name__)

MAX_BACKOFF_SECONDS = 60.0
# How long a claim keeps its rows from other relays. Longer than a send takes (a
# receiver's answer is awaited `SEND_TIMEOUT_SECONDS`), so that a live relay keeps its
# rows; short, because the rows of a relay that died wait that long for another.
LEASE_SECONDS = 10.0
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


# Set in a statement that commits on its own, its commit does not wait for the WAL to reach
# the disk. The claim and the delete of delivered rows are the relay's hot path, and each
# would otherwise pay a disk flush (two per batch, where a claim in one transaction paid
# one). Losing either to a crash of Postgres costs a row sent twice, never a row lost: a
# lost lease lets another relay send the rows too, a lost delete sends them again, and
# the receivers drop the copies as they drop any other.
_UNSYNCED = "set_config('synchronous_commit', 'off', true)"

# The rows a relay may deliver now, in order: `$1` how many at most.
_CLAIMABLE = """
SELECT id FROM outbox o
 WHERE available_at <= now()
   AND (leased_until IS NULL OR leased_until <= now())
   AND (ordering_key IS NULL OR o.ordering_key NOT IN (
        -- a row of the key waits for its retry, or another relay holds a lease on one:
        -- the key waits with it. The keys that wait are read once per claim (a hashed
        -- subplan), not once per row: asked of each row, "an older row of its key
        -- waits" read every older row of a key whose backlog another relay holds,
        -- n²/2 rows (bench/outbox.py). A row older than the one waiting (written by a
        -- transaction that committed late) waits too, and goes first then.
        SELECT busy.ordering_key FROM outbox busy
         WHERE (busy.available_at > now() OR busy.leased_until > now())
           AND busy.ordering_key IS NOT NULL))
 ORDER BY id
 LIMIT $1
 FOR UPDATE SKIP LOCKED
"""

# A relay's claim: the claimable rows leased to `$3` (a claim's own id) for `$2` seconds,
# in one statement that commits on its own. `ARRAY(…)`: the rows are chosen once, before
# the update.
#
# `follows`: the row before it of its key, as the claim's snapshot shows the outbox. The
# snapshot is taken when the statement starts; another relay's claim may commit later in
# the statement, once its rows were passed over (`SKIP LOCKED`: locked by that claim) or
# found leased. The snapshot still shows those rows unleased, and a later row of their
# key, which that claim did not take, would go ahead of them. A claimed row whose
# predecessor was not claimed with it is given back (`overtaking`).
CLAIM = f"""
UPDATE outbox SET leased_until = now() + make_interval(secs => $2), lease = $3
 WHERE id = ANY(ARRAY({_CLAIMABLE}))
RETURNING id, subject, msg_id, body, headers, attempts, ordering_key,
          -- the row before it in outbox_ordering_idx, if of its key: one index step,
          -- where `ordering_key = … ORDER BY id DESC` lets the planner walk the primary
          -- key back through every other key's rows since
          (SELECT before.id FROM (SELECT older.ordering_key, older.id FROM outbox older
                                   WHERE older.ordering_key IS NOT NULL
                                     AND (older.ordering_key, older.id)
                                         < (outbox.ordering_key, outbox.id)
                                   ORDER BY older.ordering_key DESC, older.id DESC
                                   LIMIT 1) before
            WHERE before.ordering_key = outbox.ordering_key) AS follows,
          {_UNSYNCED} AS unsynced
"""

# A claim that also deletes the rows the relay's previous claim delivered (`$4`, under
# its lease `$5`): a batch costs the relay one statement fewer. Until this statement
# deletes them those rows keep their lease, so other relays still pass over their keys;
# this one passes over them (neither claimable, nor busy, nor the row a claimed row of
# their key must follow), as it will see them once deleted.
_NOT_DELIVERED = "NOT ({t}.id = ANY($4::bigint[]) AND {t}.lease IS NOT DISTINCT FROM $5)"


def _and_after(statement: str, clause: str, condition: str) -> str:
    """`statement` with `condition` ANDed to `clause`, which it must hold exactly once: a
    claim edited out of step with this one fails at import instead of losing a guard."""
    if statement.count(clause) != 1:
        raise ValueError(f"the claim holds {clause!r} {statement.count(clause)} times, not once")
    return statement.replace(clause, f"{clause} AND {condition}")


_CLAIM_PASSING_OVER_DELIVERED = _and_after(
    _and_after(
        _and_after(
            CLAIM,
            "AND (leased_until IS NULL OR leased_until <= now())",
            _NOT_DELIVERED.format(t="o"),
        ),
        "AND busy.ordering_key IS NOT NULL",
        _NOT_DELIVERED.format(t="busy"),
    ),
    "WHERE older.ordering_key IS NOT NULL",
    _NOT_DELIVERED.format(t="older"),
)
CLAIM_AFTER_DELIVERY = (
    "WITH delivered AS (DELETE FROM outbox WHERE id = ANY($4::bigint[]) AND lease = $5 "
    f"RETURNING {_UNSYNCED})" + _CLAIM_PASSING_OVER_DELIVERED
)
# How long a relay with nothing left to claim keeps the rows it delivered for its next
# claim to delete, waiting for a wake-up, before deleting them alone. Short: meanwhile
# another relay passes over their keys (their lease is live).
SETTLE_WAIT_SECONDS = 0.01
# The claim of one key's rows (`OutboxRelay.deliver_now`), `$4` the key.
CLAIM_KEY = CLAIM.replace(
    "WHERE available_at <= now()", "WHERE ordering_key = $4 AND available_at <= now()"
)
# What a claim `$2` did with its rows `$1`. Each names the lease: rows whose lease expired
# and that another relay claimed since are that relay's to settle, and stay as it left them.
DELIVERED_ROWS = (
    f"DELETE FROM outbox WHERE id = ANY($1::bigint[]) AND lease = $2 RETURNING {_UNSYNCED}"
)
RELEASED_ROWS = """
UPDATE outbox SET leased_until = NULL, lease = NULL WHERE id = ANY($1::bigint[]) AND lease = $2
"""
# Rows to try again, each after its `retry_delay`, with its error: `$3`, `$4`.
RETRIED_ROWS = """
UPDATE outbox SET attempts = attempts + 1, last_error = retried.error,
                  available_at = now() + make_interval(secs => retried.delay),
                  leased_until = NULL, lease = NULL
  FROM unnest($1::bigint[], $3::text[], $4::float8[]) AS retried(id, error, delay)
 WHERE outbox.id = retried.id AND outbox.lease = $2
"""
# A row moved to the dead letters, `$3` why: whether it still was the claim's to move.
DEAD_LETTERED_ROW = """
WITH gone AS (DELETE FROM outbox WHERE id = $1 AND lease = $2
              RETURNING id, subject, msg_id, attempts, body),
     kept AS (INSERT INTO dead_letters
                     (consumer, stream, stream_seq, subject, msg_id, deliveries, reason, body)
              SELECT 'outbox', 'outbox', id, subject, msg_id, attempts + 1, $3, body FROM gone
              ON CONFLICT (consumer, stream, stream_seq) DO NOTHING)
SELECT count(*) FROM gone
"""
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
        lease_seconds: float = LEASE_SECONDS,
    ) -> None:
        self._pool = pool
        self._sender = sender
        self._batch = batch
        self._poll = poll_seconds
        self._lease = lease_seconds
        self._wake = asyncio.Event()
        # The lease and ids of the rows this relay delivered and has not deleted yet.
        self._delivered: tuple[uuid.UUID, list[int]] | None = None
        self.delivered = 0
        self.dead_lettered = 0

    async def run(self) -> None:
        """Deliver until cancelled; survives database and NATS outages."""
        listener = asyncio.create_task(self._listen())
        try:
            while True:
                try:
                    while await self._drain() == self._batch:
                        raise_if_cancelling()
                    if self._delivered and not await self._woken_within(SETTLE_WAIT_SECONDS):
                        await self._settle()  # no claim comes soon to delete them
                except (asyncpg.PostgresError, OSError) as exc:
                    log.warning("outbox_drain_failed", error=repr(exc))
                raise_if_cancelling()
                await self._woken_within(self._poll)
                self._wake.clear()
        finally:
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener
            with contextlib.suppress(Exception):  # stopping: not left for the lease to expire
                async with asyncio.timeout(self._lease):
                    await self._settle()

    async def _woken_within(self, seconds: float) -> bool:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._wake.wait()
        return self._wake.is_set()

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
        """Claim, deliver and settle one batch (of `key`'s rows only, when given), its
        delivered rows deleted before it returns; return how many rows were claimed."""
        if key is not None:
            await self._settle()  # rows of the key this relay delivered would hold it
        claimed = await self._drain(key)
        await self._settle()
        return claimed

    async def _drain(self, key: str | None = None) -> int:
        """`drain_once`, leaving the rows it delivered for the next claim to delete."""
        lease = uuid.uuid4()  # this claim's: what it writes later changes its rows only
        if key is not None:
            claimed = await self._pool.fetch(CLAIM_KEY, self._batch, self._lease, lease, key)
        elif (delivered := self._delivered) is None:
            claimed = await self._pool.fetch(CLAIM, self._batch, self._lease, lease)
        else:
            self._delivered = None
            try:
                claimed = await self._pool.fetch(
                    CLAIM_AFTER_DELIVERY,
                    self._batch,
                    self._lease,
                    lease,
                    delivered[1],
                    delivered[0],
                )
            except BaseException:
                self._delivered = self._delivered or delivered  # nothing was deleted
                raise
        if not claimed:
            return 0
        try:
            return await self._deliver(lease, sorted(claimed, key=lambda r: r["id"]))
        except BaseException:
            # Cancelled (the service stops) or the database failed: what this claim did
            # not settle goes to the next claim now, not once the lease expires.
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self._lease):
                    await self._pool.execute(RELEASED_ROWS, [r["id"] for r in claimed], lease)
            raise

    async def _deliver(self, lease: uuid.UUID, claimed: list[asyncpg.Record]) -> int:
        """Deliver the rows of a claim (in id order) and settle each."""
        held = overtaking(claimed)
        if held:
            await self._give_back(lease, [r for r in claimed if r["id"] in held])
            claimed = [r for r in claimed if r["id"] not in held]
            if not claimed:
                return len(held)
        rows = [OutboxRow(*r[:7]) for r in claimed]  # CLAIM returns the fields in order
        crash_point("outbox.before_publish")
        results = await self._sender.send(rows)
        crash_point("outbox.after_publish")
        outcomes = list(zip(rows, results, strict=True))
        delivered = [row.id for row, d in outcomes if d.error is None and not d.permanent]
        if delivered:
            await self._keep_delivered(lease, delivered)
        retried = [(row, d) for row, d in outcomes if d.error is not None and not d.permanent]
        if retried:
            await self._retry(lease, retried)
        for row, delivery in outcomes:
            if delivery.permanent:
                await self._dead_letter(lease, row, delivery.error or "")
        self.delivered += sum(d.error is None for d in results)
        return len(rows) + len(held)

    async def _keep_delivered(self, lease: uuid.UUID, ids: list[int]) -> None:
        """Leave delivered rows for the next claim to delete (`CLAIM_AFTER_DELIVERY`);
        deleted now when rows of another claim already wait (`deliver_now` beside `run`)."""
        if self._delivered is None:
            self._delivered = (lease, ids)
        else:
            await self._pool.execute(DELIVERED_ROWS, ids, lease)

    async def _settle(self) -> None:
        """Delete the rows this relay delivered and has not deleted yet."""
        if (delivered := self._delivered) is None:
            return
        self._delivered = None
        try:
            await self._pool.execute(DELIVERED_ROWS, delivered[1], delivered[0])
        except BaseException:
            self._delivered = self._delivered or delivered  # nothing was deleted
            raise

    async def _give_back(self, lease: uuid.UUID, claimed: Sequence[asyncpg.Record]) -> None:
        """Release rows that may not go yet, as they were: the next claim, with a snapshot
        of its own, finds them behind their predecessors."""
        await self._pool.execute(RELEASED_ROWS, [r["id"] for r in claimed], lease)
        log.info(
            "outbox_claim_gave_back",
            rows=len(claimed),
            keys=sorted({r["ordering_key"] for r in claimed}),
        )

    async def _retry(self, lease: uuid.UUID, failed: Sequence[tuple[OutboxRow, Delivery]]) -> None:
        """Put rows not delivered back, to be tried again later: the same id (their place in
        their key's order) and age, one more attempt each."""
        await self._pool.execute(
            RETRIED_ROWS,
            [row.id for row, _ in failed],
            lease,
            [delivery.error for _, delivery in failed],
            [retry_delay(row.attempts + 1) for row, _ in failed],
        )
        for row, delivery in failed:
            log.warning(
                "outbox_delivery_failed",
                subject=row.subject,
                msg_id=row.msg_id,
                attempts=row.attempts + 1,
                error=delivery.error,
            )

    async def _dead_letter(self, lease: uuid.UUID, row: OutboxRow, reason: str) -> None:
        if not await self._pool.fetchval(DEAD_LETTERED_ROW, row.id, lease, reason):
            return  # the lease expired, and the relay that claimed the row since decides
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
