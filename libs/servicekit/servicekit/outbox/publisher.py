"""The sender that publishes rows to JetStream: each key's rows in order, a backlog as
one atomic batch (decision 0002)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import uuid
from collections.abc import AsyncIterator, Sequence

from nats.aio.client import Client
from nats.aio.msg import Msg

from servicekit.outbox.delivery import (
    DELIVERED,
    HELD_BACK,
    SEND_TIMEOUT_SECONDS,
    Delivery,
    OutboxRow,
    key_chains,
)
from servicekit.telemetry import publish_span

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
