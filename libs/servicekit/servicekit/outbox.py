"""The transactional outbox and its relay.

A service writes its state change and an outbox row in one transaction, always
through `Outbox`: `tx.outbox.append(event)` for the session log, `send(...)` for any
other subject, `append_with`/`send_with` to write the row in the very statement of
the effect. The relay claims committed rows with `FOR UPDATE SKIP LOCKED`, hands
them to its sender, and deletes each row in the same transaction once it was
delivered. A crash before that commit sends the row again: JetStream drops the copy
inside its duplicate window (`Nats-Msg-Id`), the log drops it by idempotency key, and
consumers are idempotent beyond both. `LISTEN/NOTIFY` wakes the relay early; polling
is what guarantees progress. Each schema notifies on its own channel
(`notify_channel`): a service's relay wakes for its own rows only, not for every
append of every service sharing the database.

Order: rows sharing an `ordering_key` (a session id) are delivered in the order they
were written — across retries and across relay replicas. A key with a row waiting
for a retry holds its other rows back, and a key another relay is working on is
skipped (an advisory lock per key); a claim never delivers a row whose predecessor of
its key it did not claim too (`CLAIM`). Rows without a key have no order.

Failures: a transient one (timeout, no responders, the log `unavailable`) is retried
with backoff for as long as it takes; one that can never succeed (the log answered a
coded refusal: `invalid_request`, `invalid_payload`, `malformed_json`…) is moved to
`dead_letters`, logged as `outbox_dead_letter` and counted (the Prometheus counter
`agentbus_dead_letters_total{consumer="outbox"}`, `DEAD_LETTERS`), so it
neither blocks its key for ever nor disappears. An `internal` answer is a bug of the
log that a retry may or may not cure: retried `MAX_INTERNAL_ATTEMPTS` times, then
dead-lettered like a refusal, so one poison row cannot stall its session for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

import asyncpg
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError

from contracts import subjects
from contracts.common import ErrorBody, ErrorCode, Message
from contracts.events import PAYLOADS
from contracts.session_events import APPEND_MANY_MAX, AppendEnvelope, AppendEvent
from domain import log_rules
from domain.errors import DomainError
from servicekit.cancellation import raise_if_cancelling
from servicekit.db import Connection
from servicekit.faults import crash_point
from servicekit.logs import get_logger
from servicekit.metrics import DEAD_LETTERS
from servicekit.telemetry import inject_headers, publish_span, request_span

log = get_logger(__name__)

# A schema's outbox notifies `agentbus_outbox.<schema>` (`notify_channel`).
NOTIFY_CHANNEL_PREFIX = "agentbus_outbox."
# The wake-up of the schema the statement runs in (the first of its search path).
_NOTIFY = f"pg_notify('{NOTIFY_CHANNEL_PREFIX}' || current_schema(), '')"
# In its place when the writer wakes its own relay (`with_outbox`).
_NO_NOTIFY = "NULL AS pg_notify"
SEND_TIMEOUT_SECONDS = 5.0
MAX_BACKOFF_SECONDS = 60.0
# Error codes of the log that a later attempt may not get.
TRANSIENT_CODES = frozenset({ErrorCode.UNAVAILABLE.value, ErrorCode.INTERNAL.value})
# How often a row the log answers `internal` is tried before it is dead-lettered.
MAX_INTERNAL_ATTEMPTS = 8
# The consumer label of the outbox's dead letters (servicekit.metrics.DEAD_LETTERS).
OUTBOX_CONSUMER = "outbox"
# A `cmd.events.append_many` request's events, in bytes: under the log's request limit
# (servicekit.endpoint.MAX_REQUEST_BYTES) and the server's max_payload, with room to
# spare for the envelope and the headers.
MAX_APPEND_MANY_BYTES = 1024 * 1024 - 16 * 1024
APPEND_MANY_SLACK_BYTES = 16 * 1024


def notify_channel(schema: str) -> str:
    """The channel the outbox of `schema` notifies when a row is written."""
    return NOTIFY_CHANNEL_PREFIX + schema


def _queue_statement(first: int, wake: str, returning: str = "") -> str:
    """The outbox insert (and its wake-up, `_NOTIFY` or `_NO_NOTIFY`) as the tail of a
    `WITH`, parameters `$first`..`$first+4` (see `_queue_args`).

    With data-modifying CTEs before it (`Outbox.append_with`), the effect and its
    outbox row are written in one round trip. To read the effect's `RETURNING` rows
    back, name them: `returning="effect"` selects `effect.*`.
    """
    p = [f"${first + i}" for i in range(5)]
    return (
        "queued AS (INSERT INTO outbox (subject, msg_id, body, headers, ordering_key) "
        f"VALUES ({p[0]}, {p[1]}, {p[2]}, {p[3]}, {p[4]})) {_tail(wake, returning)}"
    )


def _tail(wake: str, returning: str) -> str:
    """The final SELECT of a queue statement: the wake-up (a NOTIFY, delivered on commit and
    dropped on rollback: exactly the hint the relay needs, or none), and with `returning`
    the rows of that CTE."""
    return f"SELECT {returning}.*, {wake} FROM {returning}" if returning else f"SELECT {wake}"


def _queue_args(
    subject: str,
    msg_id: str,
    body: bytes,
    headers: Mapping[str, str] | None = None,
    ordering_key: str | None = None,
) -> list[Any]:
    """The parameters of `_queue_statement`, in order; the trace context is added here."""
    return [
        subject,
        msg_id,
        body,
        inject_headers(dict(headers or {})),
        ordering_key,
    ]


@dataclass(frozen=True)
class Announcement:
    """An event for the session log as a service announces it: its envelope and its
    payload as the contract model of its type. Both were validated when they were built
    by their constructors (never `model_construct`), so the outbox checks only what
    construction cannot know: that the payload is its type's model and fits the log
    (`check_appendable`). A service that builds the payload model anyway saves the
    `AppendEvent` route its second validation and its dict round trip."""

    envelope: AppendEnvelope
    payload: Message


def _announced(event: AppendEvent) -> Announcement:
    """`event` with its payload parsed by its type's contract model: the one validation
    of a payload that comes as JSON (refused with the log's code, `invalid_payload`…)."""
    event_type = log_rules.parse_event_type(event.type)
    return Announcement(event, log_rules.validate_payload(event_type, event.payload))


def check_appendable(event: Announcement) -> bytes:
    """The `cmd.events.append` request of `event`, or, before anything is committed, the
    refusal the log would give its shape: an unknown or reserved type, a payload that is
    not its type's contract model, an oversized one.

    A service's state change and its event commit together or not at all; an event the
    log could never take would leave the change announced to nobody, so the
    command is refused with the log's own code instead (`invalid_payload`, …).
    """
    event_type = log_rules.parse_event_type(event.envelope.type)
    contract = PAYLOADS[event_type]
    if type(event.payload) is not contract:
        raise DomainError(
            ErrorCode.INVALID_PAYLOAD,
            f"invalid {event_type.value} payload: a {type(event.payload).__name__}, "
            f"where its contract is {contract.__name__}",
            errors=[{"loc": [], "msg": f"must be a {contract.__name__}", "type": "model_type"}],
        )
    # Serialised once: the size checked is that of the bytes written, which are what the
    # log measures too (it keeps a payload as its contract model dumps it).
    payload = event.payload.model_dump_json().encode()
    log_rules.check_payload_size(len(payload))
    # An `AppendEvent` is its own envelope: its payload is written as serialised here,
    # as the envelope's last member, where `AppendEvent` puts it.
    envelope = event.envelope.model_dump_json(exclude={"payload"}).encode()
    return envelope[:-1] + b',"payload":' + payload + b"}"


def _append_args(event: AppendEvent | Announcement) -> list[Any]:
    """`_queue_args` for an event to append to the session log (see `Outbox.append`);
    raises `DomainError` for an event the log would refuse (`check_appendable`)."""
    envelope = event.envelope if isinstance(event, Announcement) else event
    if envelope.idempotency_key is None:
        raise ValueError("an event appended through the outbox needs an idempotency_key")
    if not isinstance(event, Announcement):
        event = _announced(event)
    return _queue_args(
        subjects.EVENTS_APPEND,
        envelope.idempotency_key,
        check_appendable(event),
        ordering_key=str(envelope.session_id),
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
        self._wake = _NOTIFY if notify else _NO_NOTIFY
        self.queued = 0  # statements that queued rows, for the caller's wake-up

    async def append(self, event: AppendEvent | Announcement) -> None:
        """Append `event` to the session log after commit, in its session's order.

        Its idempotency key is required: it makes a repeated append a no-op. An event
        the log would refuse raises `DomainError` now (`check_appendable`). An
        `Announcement` is not validated again: build one where the payload is built."""
        await self._conn.execute(f"WITH {_queue_statement(1, self._wake)}", *_append_args(event))
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
            f"WITH {_queue_statement(1, self._wake)}",
            *_queue_args(subject, msg_id, body, headers, ordering_key),
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
        return await self._with(effect, args, _append_args(event), returning)

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
        queued = _queue_args(subject, msg_id, body, ordering_key=ordering_key)
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
        rows_json, bodies = _queue_many_args(messages)
        rows = await self._conn.fetch(
            f"WITH {effect}, {_queue_many_statement(len(args) + 1, self._wake, returning)}",
            *args,
            rows_json,
            bodies,
        )
        self.queued += 1
        return [_without_notify(r) for r in rows] if returning else []

    async def append_many_with(
        self,
        effect: str,
        args: Sequence[Any],
        events: Sequence[AppendEvent | Announcement],
        returning: str = "",
    ) -> list[dict[str, Any]]:
        """`append_with` for many events (each appended in its session's order, in the order
        given), in one statement with `effect`."""
        queued = [_queued_append(e) for e in events]
        return await self.send_many_with(effect, args, queued, returning)

    async def _with(
        self, effect: str, args: Sequence[Any], queued: list[Any], returning: str
    ) -> dict[str, Any] | None:
        row = await self._conn.fetchrow(
            f"WITH {effect}, {_queue_statement(len(args) + 1, self._wake, returning)}",
            *args,
            *queued,
        )
        self.queued += 1
        return None if row is None else _without_notify(row)


@asynccontextmanager
async def with_outbox(
    pool: asyncpg.Pool, relay: OutboxRelay | None, *, transaction: bool = True
) -> AsyncIterator[tuple[Connection, Outbox]]:
    """A connection of `pool`, in a transaction (or, `transaction` False, each statement
    committing on its own), and the outbox its statements queue rows in.

    Given `relay`, the relay of this process, rows go without a NOTIFY — each NOTIFY
    signals every listening backend of the database, and takes a database-wide lock at
    commit — and the relay is woken directly once they are committed. Another replica's
    relay finds them by polling should this process die before delivering them."""
    async with pool.acquire() as conn:
        outbox = Outbox(conn, notify=relay is None)
        if transaction:
            async with conn.transaction():
                yield conn, outbox
        else:
            yield conn, outbox
        if relay is not None and outbox.queued:
            relay.wake()


def _without_notify(row: asyncpg.Record) -> dict[str, Any]:
    fields = dict(row)
    fields.pop("pg_notify", None)  # the wake-up, not the caller's
    return fields


@dataclass(frozen=True)
class Queued:
    """One row for `Outbox.send_many_with`: what `send` takes, as a value. `headers`
    None: the current trace context; give them to carry another's (a batch writer
    sends each row with the trace of the request it came from)."""

    subject: str
    msg_id: str
    body: bytes
    ordering_key: str | None = None
    headers: Mapping[str, str] | None = None


def _queue_many_statement(first: int, wake: str, returning: str = "") -> str:
    """`_queue_statement` for many rows, inserted in the order given (so a key's rows keep
    their order): `$first`, the rows as JSON, each but its body, which is the slice
    `start`, `length` of `$first+1`, every body end to end (`_queue_many_args`)."""
    return (
        "queued AS (INSERT INTO outbox (subject, msg_id, body, headers, ordering_key) "
        f"SELECT subject, msg_id, substring(${first + 1}::bytea FROM start FOR length), "
        "headers, ordering_key "
        f"FROM ROWS FROM (json_to_recordset(${first}::json) AS (subject text, msg_id text, "
        "headers jsonb, ordering_key text, start int, length int)) "
        "WITH ORDINALITY AS m(subject, msg_id, headers, ordering_key, start, length, n) "
        f"ORDER BY n) {_tail(wake, returning)}"
    )


def _queue_many_args(messages: Sequence[Queued]) -> tuple[list[dict[str, Any]], bytes]:
    """The parameters of `_queue_many_statement`. Two values, not five arrays of a value
    per row: asyncpg checks each element of an array against three abstract classes,
    which makes the arrays cost a batch of the log more than its whole statement in
    Postgres (bench/append.py)."""
    rows = []
    start = 1  # substring() counts from 1
    for m in messages:
        headers = dict(m.headers) if m.headers is not None else inject_headers()
        rows.append(
            {
                "subject": m.subject,
                "msg_id": m.msg_id,
                "headers": headers,
                "ordering_key": m.ordering_key,
                "start": start,
                "length": len(m.body),
            }
        )
        start += len(m.body)
    return rows, b"".join(m.body for m in messages)


def _queued_append(event: AppendEvent | Announcement) -> Queued:
    """`Queued` for an event to append to the session log (see `Outbox.append`)."""
    subject, msg_id, body, headers, key = _append_args(event)
    return Queued(subject, msg_id, body, key, headers)


@dataclass(frozen=True)
class OutboxRow:
    """A claimed outbox row."""

    id: int
    subject: str
    msg_id: str
    body: bytes
    headers: dict[str, str]
    attempts: int
    ordering_key: str | None


@dataclass(frozen=True)
class Delivery:
    """What became of one row: delivered (no error), to retry, or never deliverable."""

    error: str | None = None
    permanent: bool = False
    # The receiver's error reply, when it answered with one: its code is branched on
    # as a value, never parsed back out of `error`.
    refusal: ErrorBody | None = None


DELIVERED = Delivery()
HELD_BACK = Delivery("waiting for an earlier row of the same key")


# Delivers rows (a key's, or many keys'), a Delivery each, in the order given.
DeliverRows = Callable[[Sequence[OutboxRow]], Awaitable[list[Delivery]]]


class Sender(Protocol):
    """Delivers claimed rows, in order, and says what became of each."""

    async def send(self, rows: Sequence[OutboxRow]) -> list[Delivery]: ...


def key_chains(rows: Sequence[OutboxRow]) -> list[list[int]]:
    """The indexes of `rows` by ordering key, each key's in the order written; a row
    without a key is a chain of its own."""
    chains: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        chains.setdefault(row.ordering_key or f"#row{i}", []).append(i)
    return list(chains.values())


async def one_after_another(
    chain: Sequence[OutboxRow], deliver: Callable[[OutboxRow], Awaitable[Delivery]]
) -> list[Delivery]:
    """Deliver a key's rows one after another; a row that failed (and may succeed later)
    holds the rest back, so the receiver sees them in the order they were written."""
    results: list[Delivery] = [HELD_BACK] * len(chain)
    for i, row in enumerate(chain):
        results[i] = await deliver(row)
        if results[i].error is not None and not results[i].permanent:
            break  # the rest stay HELD_BACK, retried after this one
    return results


async def in_key_order(
    rows: Sequence[OutboxRow],
    deliver_chain: DeliverRows,
) -> list[Delivery]:
    """Deliver each key's rows with `deliver_chain` (which keeps their order and holds
    back what follows a failure) and different keys in parallel; a stalled receiver
    costs one timeout per batch, not one per row."""
    results: list[Delivery] = [HELD_BACK] * len(rows)

    async def deliver(indexes: list[int]) -> None:
        delivered = await deliver_chain([rows[i] for i in indexes])
        for i, delivery in zip(indexes, delivered, strict=True):
            results[i] = delivery

    await asyncio.gather(*(deliver(chain) for chain in key_chains(rows)))
    return results


# JetStream's atomic batch (ADR-50, nats-server >= 2.12): the messages of a batch are
# stored all, in the order sent, or none. Its limits: 1,000 messages a batch, 50 batches
# in flight per stream (across every publisher: replicas share it).
BATCH_ID = "Nats-Batch-Id"
BATCH_SEQUENCE = "Nats-Batch-Sequence"
BATCH_COMMIT = "Nats-Batch-Commit"
MAX_ATOMIC_BATCH = 1000
MAX_BATCHES_IN_FLIGHT = 16
# The fewest rows a key sends as a batch. A batch's commit is synced to disk by the file
# store: a commit takes 10-25 ms where an acknowledged publish takes 0.2-0.5 ms
# (nats-server 2.15, one node: docs/decisions/0002-ordered-outbox-and-atomic-batches.md),
# so a short run of rows goes faster one by one, and only a backlog (one busy session)
# gains from a batch. (With `sync_interval:
# always`, as in production, every publish is synced and batches gain sooner.)
ATOMIC_BATCH_MIN = 32
# Refusals of a whole batch that say "publish these one by one" rather than "retry":
# a message of it is already stored (an earlier attempt's; the batch is refused whole,
# where a lone publish is deduplicated by its Nats-Msg-Id), or the stream does not
# take atomic batches.
BATCH_HAS_DUPLICATE = 10201
ATOMIC_PUBLISH_DISABLED = 10174
_ONE_BY_ONE = frozenset({BATCH_HAS_DUPLICATE, ATOMIC_PUBLISH_DISABLED})


# How nats-server says nobody took a message that asked for a reply: no stream captures
# its subject.
STATUS_HEADER = "Status"
NO_RESPONDERS = "503"


class _AckInbox:
    """One subscription (`<inbox>.*`, in the connection's own inbox, the only one its NATS
    user may read) that receives the acks of every publish, each matched by its token."""

    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self._prefix = ""
        self._waiting: dict[str, asyncio.Future[Msg]] = {}
        self._tokens = itertools.count()

    @contextlib.asynccontextmanager
    async def awaiting(self, n: int) -> AsyncIterator[list[tuple[str, asyncio.Future[Msg]]]]:
        """`n` (reply subject, ack) pairs to publish with; an ack that has not come by the
        end of the block is forgotten."""
        if not self._prefix:  # subscribed before the first publish asks for a reply
            prefix = self._nc.new_inbox() + "."
            await self._nc.subscribe(prefix + "*", cb=self._received)
            self._prefix = prefix
        loop = asyncio.get_running_loop()
        acks = [(f"{self._prefix}{next(self._tokens)}", loop.create_future()) for _ in range(n)]
        self._waiting.update(acks)
        try:
            yield acks
        finally:
            for reply, _ in acks:
                self._waiting.pop(reply, None)

    async def _received(self, msg: Msg) -> None:
        ack = self._waiting.pop(msg.subject, None)
        if ack is not None and not ack.done():
            ack.set_result(msg)


def _acknowledged(row: OutboxRow, ack: Msg) -> Delivery:
    """What JetStream's answer to the publish of `row` says: stored (or a duplicate it
    already had), no stream for the subject, or a refusal."""
    if ack.headers and ack.headers.get(STATUS_HEADER) == NO_RESPONDERS:
        return Delivery(f"NoStreamResponseError: no stream captures {row.subject}")
    if b'"error"' in ack.data:  # only then worth parsing
        error = json.loads(ack.data).get("error")
        if error:
            return Delivery(f"APIError: {error}")
    return DELIVERED


class JetStreamPublisher:
    """Publishes rows to JetStream with `Nats-Msg-Id`, each key's rows in order.

    A key with a backlog (`ATOMIC_BATCH_MIN` rows or more) sends it as one atomic batch
    rather than one acknowledged publish after another, which lets one busy session's
    publishing fall seconds behind its appends (bench/append.py); a short run goes one by
    one, which is faster for it. Why a batch and not N publishes awaited together: on one
    connection those reach the stream in order, but if row k fails (a reconnect that
    loses it, a leader election, a refusal of k alone) while k+1 is stored, k's retry
    lands after k+1, and consumers would see the session out of order. The subjects of
    a session differ by event type, so no `Nats-Expected-Last-Subject-Sequence` can
    chain them either. A batch is stored whole or not at all: a failed one is retried
    whole, and the key's order holds. When a batch cannot be used (a row of it was
    already stored by an attempt whose ack was lost, or the stream refuses batches),
    the key's rows go one acknowledged publish at a time, deduplicated one by one.

    Rows going one by one are pipelined across keys: the next row of every key is
    published at once and their acks awaited together (`_AckInbox`), and a key's
    following row goes only once its predecessor was acknowledged. That is one task and
    one timeout for them all, where a task per key and `js.publish` (a timer and a JSON
    ack parsed into a `PubAck` per row) cost the relay more CPU per row than the append
    it publishes (bench/append.py).
    """

    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self._acks = _AckInbox(nc)
        self._in_flight = asyncio.Semaphore(MAX_BATCHES_IN_FLIGHT)

    async def send(self, rows: Sequence[OutboxRow]) -> list[Delivery]:
        results: list[Delivery] = [HELD_BACK] * len(rows)
        short: list[list[int]] = []
        backlogs: list[list[int]] = []
        for chain in key_chains(rows):
            (backlogs if len(chain) >= ATOMIC_BATCH_MIN else short).append(chain)

        async def one_by_one() -> None:
            delivered = await self._one_by_one([[rows[i] for i in c] for c in short])
            for chain, chain_delivered in zip(short, delivered, strict=True):
                for i, delivery in zip(chain, chain_delivered, strict=True):
                    results[i] = delivery

        async def backlog(chain: list[int]) -> None:
            delivered = await self._publish_backlog([rows[i] for i in chain])
            for i, delivery in zip(chain, delivered, strict=True):
                results[i] = delivery

        if backlogs:
            await asyncio.gather(one_by_one(), *(backlog(c) for c in backlogs))
        else:
            await one_by_one()
        return results

    async def _publish_backlog(self, chain: Sequence[OutboxRow]) -> list[Delivery]:
        results: list[Delivery] = []
        for start in range(0, len(chain), MAX_ATOMIC_BATCH):
            piece = chain[start : start + MAX_ATOMIC_BATCH]
            delivered = None
            if len(piece) >= ATOMIC_BATCH_MIN:
                async with self._in_flight:
                    delivered = await self._publish_batch(piece)
            if delivered is None:
                [delivered] = await self._one_by_one([piece])
            results += delivered
            if any(d.error is not None for d in delivered):
                break  # the rest wait behind the failure
        return results + [HELD_BACK] * (len(chain) - len(results))

    async def _one_by_one(self, chains: Sequence[Sequence[OutboxRow]]) -> list[list[Delivery]]:
        """Each chain's rows one acknowledged publish after another, the chains side by
        side; a chain stops at its first failure, its later rows HELD_BACK."""
        results: list[list[Delivery]] = [[HELD_BACK] * len(chain) for chain in chains]
        going = [c for c, chain in enumerate(chains) if chain]
        position = 0
        while going:
            delivered = await self._publish_together([chains[c][position] for c in going])
            for c, delivery in zip(going, delivered, strict=True):
                results[c][position] = delivery
            position += 1
            going = [
                c
                for c, delivery in zip(going, delivered, strict=True)
                if delivery.error is None and position < len(chains[c])
            ]
        return results

    async def _publish_together(self, rows: Sequence[OutboxRow]) -> list[Delivery]:
        """Publish `rows` (of different keys) at once and await their acks together."""
        failed: dict[int, Delivery] = {}
        try:
            async with self._acks.awaiting(len(rows)) as acks:
                with contextlib.ExitStack() as spans:
                    for n, (row, (reply, ack)) in enumerate(zip(rows, acks, strict=True)):
                        # The row carries the trace it was written in: the publish continues it.
                        carried = {**row.headers, "Nats-Msg-Id": row.msg_id}
                        headers = spans.enter_context(
                            publish_span(row.subject, carried, row.msg_id)
                        )
                        try:
                            await self._nc.publish(
                                row.subject, row.body, reply=reply, headers=headers
                            )
                        except Exception as exc:  # connection lost, bad subject: retry later
                            failed[n] = Delivery(repr(exc) or type(exc).__name__)
                            ack.cancel()
                    await asyncio.wait([ack for _, ack in acks], timeout=SEND_TIMEOUT_SECONDS)
        except Exception as exc:  # the ack inbox could not be subscribed: retry later
            return [Delivery(repr(exc) or type(exc).__name__)] * len(rows)
        return [
            failed.get(n)
            or (
                _acknowledged(row, ack.result())
                if ack.done()
                else Delivery(f"TimeoutError: no ack within {SEND_TIMEOUT_SECONDS} s")
            )
            for n, (row, (_, ack)) in enumerate(zip(rows, acks, strict=True))
        ]

    async def _publish_batch(self, rows: Sequence[OutboxRow]) -> list[Delivery] | None:
        """Publish `rows` as one atomic batch: a Delivery each, or None when they must go
        one by one instead (`_ONE_BY_ONE`)."""
        batch_id = uuid.uuid4().hex
        with contextlib.ExitStack() as spans:  # each row's publish continues its own trace
            sent = [
                spans.enter_context(
                    publish_span(r.subject, {**r.headers, "Nats-Msg-Id": r.msg_id}, r.msg_id)
                )
                for r in rows
            ]
            for n, headers in enumerate(sent, 1):
                headers |= {BATCH_ID: batch_id, BATCH_SEQUENCE: str(n)}
            sent[-1][BATCH_COMMIT] = "1"
            last = rows[-1]
            try:
                for row, headers in zip(rows[:-1], sent, strict=False):
                    await self._nc.publish(row.subject, row.body, headers=headers)
                # The commit's reply is the batch's ack: all stored, or none.
                reply = await self._nc.request(
                    last.subject, last.body, timeout=SEND_TIMEOUT_SECONDS, headers=sent[-1]
                )
            except Exception as exc:  # no stream, timeout, connection lost: retry later
                return [Delivery(repr(exc) or type(exc).__name__)] * len(rows)
        ack = json.loads(reply.data)
        if "error" not in ack:
            return [DELIVERED] * len(rows)
        if ack["error"].get("err_code") in _ONE_BY_ONE:
            return None
        return [Delivery(f"batch refused: {ack['error']}")] * len(rows)


class LogAppender:
    """Sends rows as the commands they name and reads the replies: each key's rows in the
    order written, keys in parallel.

    Events for the log (`cmd.events.append` rows) go many to a request,
    `cmd.events.append_many`: a claim costs one round trip and one group commit of the
    log instead of one of each per row. The log writes them in the order sent, answers
    each on its own (a refused row is dead-lettered with its code, the rest go in), and
    holds a session's later events back behind one it failed to write, so a key's order
    holds as with one request per row. Requests go one after another, and a key that
    failed in one sends nothing more in the next. (The log cannot know that a row it
    answered `internal` is given up here, `MAX_INTERNAL_ATTEMPTS`: the rows it held back
    behind it go at their retry.) The request continues the trace of its
    first row. A key that also holds other commands (Criativo's offers) sends one request
    per row, in order; so do all when no log serves `append_many` (an older one).
    """

    def __init__(self, nc: Client) -> None:
        self._nc = nc

    async def send(self, rows: Sequence[OutboxRow]) -> list[Delivery]:
        results: list[Delivery] = [HELD_BACK] * len(rows)
        together: list[int] = []
        one_by_one: list[list[int]] = []
        for chain in key_chains(rows):
            if all(rows[i].subject == subjects.EVENTS_APPEND for i in chain):
                together += chain
            else:
                one_by_one.append(chain)

        async def deliver(
            indexes: list[int], how: Callable[..., Awaitable[list[Delivery]]]
        ) -> None:
            for i, delivery in zip(indexes, await how([rows[i] for i in indexes]), strict=True):
                results[i] = delivery

        together.sort()  # the order written, which keeps each key's
        await asyncio.gather(
            deliver(together, self._append_many),
            *(deliver(chain, self._one_after_another) for chain in one_by_one),
        )
        return results

    async def _one_after_another(self, chain: Sequence[OutboxRow]) -> list[Delivery]:
        return await one_after_another(chain, self._request)

    async def _append_many(self, rows: Sequence[OutboxRow]) -> list[Delivery]:
        results: list[Delivery] = [HELD_BACK] * len(rows)
        failed: set[str] = set()  # keys whose later rows wait for a retry
        for piece in self._pieces(rows):
            sent = [i for i in piece if _key(rows[i]) not in failed]
            if not sent:
                continue
            delivered = await self._append_piece([rows[i] for i in sent])
            for i, delivery in zip(sent, delivered, strict=True):
                results[i] = delivery
                if delivery.error is not None and not delivery.permanent:
                    failed.add(_key(rows[i]))
        return results

    def _pieces(self, rows: Sequence[OutboxRow]) -> list[list[int]]:
        """`rows` in order, cut into requests the log takes: at most `APPEND_MANY_MAX`
        events and `MAX_APPEND_MANY_BYTES` (a larger row goes alone, and is answered
        `payload_too_large` as its own request would be)."""
        limit = min(MAX_APPEND_MANY_BYTES, self._nc.max_payload - APPEND_MANY_SLACK_BYTES)
        pieces: list[list[int]] = []
        size = 0
        for i, row in enumerate(rows):
            if not pieces or len(pieces[-1]) >= APPEND_MANY_MAX or size + len(row.body) > limit:
                pieces.append([])
                size = 0
            pieces[-1].append(i)
            size += len(row.body) + 1
        return pieces

    async def _append_piece(self, rows: Sequence[OutboxRow]) -> list[Delivery]:
        body = b'{"events":[' + b",".join(r.body for r in rows) + b"]}"
        try:
            with request_span(subjects.EVENTS_APPEND_MANY, rows[0].headers) as headers:
                reply = await self._nc.request(
                    subjects.EVENTS_APPEND_MANY,
                    body,
                    timeout=SEND_TIMEOUT_SECONDS,
                    headers=headers,
                )
        except NoRespondersError:  # no log serves it (an older one): a request per row
            return await in_key_order(rows, self._one_after_another)
        except Exception as exc:
            return [Delivery(repr(exc) or type(exc).__name__)] * len(rows)
        answer = json.loads(reply.data)
        if "error" in answer:
            if answer["error"]["code"] in TRANSIENT_CODES:
                return [_answered(row, answer["error"]) for row in rows]
            # Refused whole (a row that is not even JSON): one request per row finds
            # the one to dead-letter, and the others go in.
            return await in_key_order(rows, self._one_after_another)
        return [
            DELIVERED if outcome.get("error") is None else _answered(row, outcome["error"])
            for row, outcome in zip(rows, answer["results"], strict=True)
        ]

    async def _request(self, row: OutboxRow) -> Delivery:
        try:
            with request_span(row.subject, row.headers) as headers:
                reply = await self._nc.request(
                    row.subject, row.body, timeout=SEND_TIMEOUT_SECONDS, headers=headers
                )
        except Exception as exc:
            return Delivery(repr(exc) or type(exc).__name__)
        if not reply.data.startswith(b'{"error":'):
            return DELIVERED
        return _answered(row, json.loads(reply.data)["error"])


def _key(row: OutboxRow) -> str:
    return row.ordering_key or f"#{row.id}"


def _answered(row: OutboxRow, error: dict[str, Any]) -> Delivery:
    """What the receiver's coded error means for `row`: retry, or never (dead letter)."""
    code = error["code"]
    gave_up = code == ErrorCode.INTERNAL and row.attempts + 1 >= MAX_INTERNAL_ATTEMPTS
    return Delivery(
        f"{code}: {error['message']}",
        permanent=code not in TRANSIENT_CODES or gave_up,
        refusal=ErrorBody(code=code, message=error["message"], details=error.get("details") or {}),
    )


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
