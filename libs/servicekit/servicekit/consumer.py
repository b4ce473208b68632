"""Durable JetStream pull consumers that lose nothing and do nothing twice.

The rules (docs/decisions/0001-own-jetstream-consumer.md says why the kit has its own):
- ack only after the handler's effect is committed;
- a transient failure is nak'ed with a delay that grows with each delivery;
- `Permanent` (the message can never succeed) and the last allowed delivery are
  dead-lettered: recorded in the schema's `dead_letters` table, announced on
  `deadletter.<consumer>` and logged with the message id, then terminated. A message
  that ran out of deliveries without reaching the handler (a crash loop) is caught
  from the server's MAX_DELIVERIES advisory and recorded the same way;
- an ack can arrive after AckWait, when the message was already redelivered, so the
  handler must be idempotent: `claim_once` in the same transaction as the effect.

Messages are handled one at a time, in stream order — or, with `ordering_key`, one at a
time per key (a session) and concurrently across keys: concurrency across sessions
without an over-fetching worker pool (as FastStream's `max_workers` is). Either way
every message fetched and not yet settled is kept in progress (`_keep_alive`, the one
keep-alive of the code base), so a long handler, or a message waiting behind its
session's earlier ones, is not redelivered to another replica meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import asyncpg
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError
from opentelemetry.semconv._incubating.attributes import messaging_attributes as messaging
from opentelemetry.trace import SpanKind

from contracts import subjects
from servicekit.cancellation import raise_if_cancelling
from servicekit.db import Connection
from servicekit.drift import keep_declared
from servicekit.logs import get_logger
from servicekit.metrics import (
    CONSUMER_DELIVERIES,
    CONSUMER_HANDLER_SECONDS,
    CONSUMER_REDELIVERIES,
    DEAD_LETTERS,
)
from servicekit.patience import is_unavailable
from servicekit.telemetry import destination, handling_span

log = get_logger(__name__)

# How long a puller waits before asking again while JetStream does not answer.
UNAVAILABLE_PAUSE_SECONDS = 0.5
# How long a pull waits for a message before asking again (idle consumers).
FETCH_WAIT_SECONDS = 1.0
# The server's AckWait when a consumer declares neither one nor a BackOff.
SERVER_ACK_WAIT_SECONDS = 30.0
# The bound on taking the messages a delivered one says are already waiting behind it.
DRAIN_SECONDS = 0.05

Handler = Callable[[Msg], Awaitable[None]]
# The key of a message's lane: messages of one key are handled in stream order.
OrderingKey = Callable[[Msg], str]


class Permanent(Exception):
    """The message can never be handled (bad shape, impossible state): dead-letter it now."""


@dataclass(frozen=True)
class ConsumerSpec:
    """A durable consumer's identity and redelivery policy."""

    durable: str
    stream: str
    filter_subjects: list[str]
    max_deliver: int = 8
    # Delay before each redelivery; the last value repeats. Also the server's
    # redelivery schedule when the process dies holding a message.
    backoff: list[float] = field(default_factory=lambda: [1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0])
    deliver_policy: DeliverPolicy = DeliverPolicy.ALL
    batch: int = 32
    # The server's AckWait (its default, 30 s, when None), for a consumer without a
    # BackOff only: given one, the server holds AckWait at its first step whatever is
    # asked, and a message held unacknowledged is redelivered after its backoff step.
    ack_wait: float | None = None
    # The least time the server gives a held message before delivering it again (its
    # holder dead or stalled): each step of the server's schedule is at least this, while
    # a nak's delay still follows `backoff`. A holder reports its messages in progress
    # within it (`keep_alive_interval`), a message each time; None: the backoff steps.
    redeliver_held_after: float | None = None
    # Pullers of this durable per replica, each handling one fetched batch at a time.
    workers: int = 1
    # How often the consumer is compared with this declaration, and put back if it
    # drifted (servicekit.drift); also at start.
    drift_check_seconds: float = 60.0

    def config(self) -> ConsumerConfig:
        """The server-side configuration: explicit acks, bounded deliveries, backoff.

        Declared as the server keeps it: asked for another AckWait beside a BackOff, the
        server keeps its first step, and the consumer would be found drifted from its
        declaration at every check (`servicekit.drift`), and updated each time.
        """
        backoff = self.redelivery[: self.max_deliver - 1]
        return ConsumerConfig(
            durable_name=self.durable,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=self.deliver_policy,
            filter_subjects=list(self.filter_subjects),
            max_deliver=self.max_deliver,
            backoff=backoff,
            max_ack_pending=1000,
            ack_wait=backoff[0] if backoff else self.ack_wait,
        )

    @property
    def redelivery(self) -> list[float]:
        """The server's schedule (its BackOff): how long the n-th delivery of a message may
        be held unsettled before the server delivers it again."""
        least = self.redeliver_held_after or 0.0
        return [max(step, least) for step in self.backoff]

    @property
    def keep_alive_interval(self) -> float:
        """How often a held message is reported in progress: well within the time the
        server gives it before delivering it again (AckWait: the first step of the
        BackOff, when there is one)."""
        return max((self.config().ack_wait or SERVER_ACK_WAIT_SECONDS) / 3, 0.05)

    def delay_after(self, deliveries: int) -> float:
        """The nak delay after the `deliveries`-th failed attempt."""
        return self.backoff[min(deliveries, len(self.backoff)) - 1]


async def claim_once(conn: Connection, consumer: str, msg_id: str) -> bool:
    """Record that `consumer` processed `msg_id`; False when it already had (skip the effect)."""
    status: str = await conn.execute(
        "INSERT INTO processed_messages (consumer, msg_id) VALUES ($1, $2) ON CONFLICT DO NOTHING",
        consumer,
        msg_id,
    )
    return status.endswith(" 1")


class DurableConsumer:
    """Pulls a durable consumer and runs `handler` on each message, by the rules above."""

    def __init__(
        self,
        nc: Client,
        js: JetStreamContext,
        pool: asyncpg.Pool,
        spec: ConsumerSpec,
        handler: Handler,
        ordering_key: OrderingKey | None = None,
    ) -> None:
        self._nc = nc
        self._js = js
        self._pool = pool
        self.spec = spec
        self._handler = handler
        self._ordering_key = ordering_key
        # Fetched and not settled yet, by identity (a `Msg` is not hashable), with when it
        # was fetched or last reported in progress: kept in progress until acked, nak'ed or
        # termed.
        self._held: dict[int, tuple[Msg, float]] = {}
        # Set while anything is held: the keep-alive sleeps, not ticks, while nothing is.
        self._holding = asyncio.Event()
        # Per key, the task of its latest message (lanes, with `ordering_key`).
        self._lanes: dict[str, asyncio.Task[None]] = {}
        self._inflight: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        """Create the consumer (or put it back as declared), then handle messages until
        cancelled, checking its configuration every `drift_check_seconds`."""
        await keep_declared(self._nc, self._js, self.spec.stream, self.spec.config())
        advisory = await self._nc.subscribe(
            f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{self.spec.stream}.{self.spec.durable}",
            cb=self._on_max_deliveries,
        )
        sub = await self._js.pull_subscribe_bind(durable=self.spec.durable, stream=self.spec.stream)
        keepalive = asyncio.create_task(self._keep_alive())
        watch = asyncio.create_task(self._watch_drift())
        try:
            while True:
                raise_if_cancelling()
                try:
                    msgs = await self._fetch(sub)
                except (NatsTimeoutError, TimeoutError):
                    continue
                except Exception as exc:
                    # JetStream away for a moment (the server restarting, a node electing
                    # leaders): no messages this time, not the end of the service.
                    # A pull to a consumer that no longer exists gets the same 503: that
                    # one still stops the service (a deleted stream is never papered over).
                    if not is_unavailable(exc) or await self._gone():
                        raise
                    log.warning(
                        "consumer_fetch_unavailable", consumer=self.spec.durable, error=repr(exc)
                    )
                    await asyncio.sleep(UNAVAILABLE_PAUSE_SECONDS)
                    continue
                fetched = time.monotonic()
                self._held.update((id(m), (m, fetched)) for m in msgs)
                if msgs:
                    self._holding.set()
                if self._ordering_key is None:
                    await self._handle_batch(msgs)
                else:
                    for msg in msgs:
                        self._dispatch(msg, self._ordering_key(msg))
        finally:
            keepalive.cancel()
            watch.cancel()
            for task in list(self._inflight):
                task.cancel()
            await self._hand_back()
            with contextlib.suppress(Exception):
                await advisory.unsubscribe()
                await sub.unsubscribe()

    async def _watch_drift(self) -> None:
        """Put the consumer back whenever it drifted from its declaration. A check that
        fails (JetStream away) is tried at the next interval."""
        while True:
            await asyncio.sleep(self.spec.drift_check_seconds)
            try:
                await keep_declared(self._nc, self._js, self.spec.stream, self.spec.config())
            except Exception as exc:
                log.warning(
                    "consumer_drift_check_failed", consumer=self.spec.durable, error=repr(exc)
                )

    async def _fetch(self, sub: JetStreamContext.PullSubscription) -> list[Msg]:
        """The next messages, as soon as one is there: a pull of one, then, only when that
        one says more are waiting (`num_pending`), a short pull of those.

        With `fetch(batch)` alone, a lone chat message waits hundreds of milliseconds
        before it reaches its handler; this way, a few
        (docs/decisions/0001-own-jetstream-consumer.md). A bare probe of `fetch(32)` on an
        idle consumer answers at once, so the holding comes from something around it,
        likely a pull request an earlier fetch left on the server, which nats-py's own
        comments describe; the cause is not pinned down."""
        first = await sub.fetch(1, timeout=FETCH_WAIT_SECONDS)
        waiting = first[0].metadata.num_pending if first else 0
        if self.spec.batch == 1 or not waiting:
            return first
        try:
            more = await sub.fetch(min(self.spec.batch - 1, waiting), timeout=DRAIN_SECONDS)
        except (NatsTimeoutError, TimeoutError):  # taken by another replica meanwhile
            more = []
        return first + more

    async def _gone(self) -> bool:
        """Whether JetStream says this consumer (or its stream) no longer exists; a
        JetStream that does not answer says nothing."""
        try:
            await self._js.consumer_info(self.spec.stream, self.spec.durable)
        except NotFoundError:
            return True
        except Exception:
            return False
        return False

    async def _handle_batch(self, msgs: list[Msg]) -> None:
        """Handle the fetched messages in order (the waiting ones are kept alive)."""
        for msg in msgs:
            raise_if_cancelling()
            await self._handle_held(msg)

    def _dispatch(self, msg: Msg, key: str) -> None:
        """Queue `msg` behind the latest message of its key; other keys do not wait."""
        previous = self._lanes.get(key)
        task = asyncio.create_task(self._after(previous, msg))
        self._lanes[key] = task
        self._inflight.add(task)

        def done(t: asyncio.Task[None]) -> None:
            self._inflight.discard(t)
            if self._lanes.get(key) is t:
                del self._lanes[key]

        task.add_done_callback(done)

    async def _after(self, previous: asyncio.Task[None] | None, msg: Msg) -> None:
        if previous is not None:
            await asyncio.wait([previous])  # its outcome is its own; only its end matters
        await self._handle_held(msg)

    async def _handle_held(self, msg: Msg) -> None:
        stopping = False
        try:
            await self._handle(msg)
        except asyncio.CancelledError:
            # This task told to stop (not a cancelled future it awaited): the consumer is
            # stopping, and hands the message back (`_hand_back`) while it is held.
            task = asyncio.current_task()
            stopping = task is not None and task.cancelling() > 0
            raise
        finally:
            if not stopping:
                self._held.pop(id(msg), None)

    async def _hand_back(self) -> None:
        """Stopping: every message held and not settled goes back to JetStream now, for a
        replica that stays, rather than after the server's redelivery time. One whose
        effect committed before its ack went out is redelivered to a handler that is
        idempotent, as after any late ack."""
        held, self._held = list(self._held.values()), {}
        for msg, _ in held:
            with contextlib.suppress(Exception):  # the connection gone: the server's time
                await msg.nak()

    async def _keep_alive(self) -> None:
        """With BackOff set, JetStream's ack wait is its first step (`redelivery`): a
        handler that runs longer (an LLM turn, an analysis), or a message waiting for its
        turn, would be redelivered — to another replica — while it is still held, unless
        `in_progress` resets the timer.
        """
        interval = self.spec.keep_alive_interval
        while True:
            if not self._held:  # an idle service wakes for nothing
                self._holding.clear()
                await self._holding.wait()
            # Twice an interval, each message fetched or reported an interval ago or more (so
            # within 1.5 intervals, half the redelivery time): one settled within an interval
            # is never reported, so a quick message costs its ack and no progress report.
            await asyncio.sleep(interval / 2)
            due = time.monotonic() - interval
            for key, (msg, since) in list(self._held.items()):
                if since > due:
                    continue
                with contextlib.suppress(Exception):
                    await msg.in_progress()
                if key in self._held:  # not settled meanwhile
                    self._held[key] = msg, time.monotonic()

    async def _handle(self, msg: Msg) -> None:
        deliveries = msg.metadata.num_delivered
        msg_id = (msg.headers or {}).get("Nats-Msg-Id")
        durable = self.spec.durable
        CONSUMER_DELIVERIES.labels(durable).inc()
        if deliveries > 1:
            CONSUMER_REDELIVERIES.labels(durable).inc()
        started = time.perf_counter()

        def took(outcome: str) -> None:
            elapsed = time.perf_counter() - started
            CONSUMER_HANDLER_SECONDS.labels(durable, outcome).observe(elapsed)

        with handling_span(
            f"process {destination(msg.subject)}",
            msg.headers,
            SpanKind.CONSUMER,
            msg.subject,
            **{
                messaging.MESSAGING_CONSUMER_GROUP_NAME: durable,
                messaging.MESSAGING_MESSAGE_ID: msg_id,
            },
        ):
            try:
                await self._handler(msg)
            except Permanent as exc:
                took("dead_letter")
                await self._give_up(msg, f"permanent: {exc}")
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if deliveries >= self.spec.max_deliver:
                    took("dead_letter")
                    await self._give_up(msg, f"exhausted {deliveries} deliveries: {exc!r}")
                    return
                took("retry")
                delay = self.spec.delay_after(deliveries)
                log.warning(
                    "consumer_retry",
                    consumer=self.spec.durable,
                    subject=msg.subject,
                    msg_id=msg_id,
                    deliveries=deliveries,
                    retry_in=delay,
                    error=repr(exc),
                )
                await msg.nak(delay=delay)
                return
            log.debug("message_handled", consumer=durable, subject=msg.subject, msg_id=msg_id)
        took("ack")
        await msg.ack()

    async def _give_up(self, msg: Msg, reason: str) -> None:
        try:
            await self.record_dead_letter(
                msg.metadata.sequence.stream,
                msg.subject,
                msg.headers,
                msg.data,
                msg.metadata.num_delivered,
                reason,
            )
        except Exception as exc:  # cannot record it: keep the message, try again later
            log.error("dead_letter_record_failed", consumer=self.spec.durable, error=repr(exc))
            await msg.nak(delay=self.spec.delay_after(msg.metadata.num_delivered))
            return
        await msg.term()

    async def record_dead_letter(
        self,
        stream_seq: int,
        subject: str,
        headers: dict[str, str] | None,
        body: bytes,
        deliveries: int,
        reason: str,
    ) -> None:
        """Keep the message where an operator finds it: table, dead-letter subject, log."""
        msg_id = (headers or {}).get("Nats-Msg-Id")
        await self._pool.execute(
            """INSERT INTO dead_letters
                   (consumer, stream, stream_seq, subject, msg_id, deliveries, reason, body)
               VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
               ON CONFLICT (consumer, stream, stream_seq) DO NOTHING""",
            self.spec.durable,
            self.spec.stream,
            stream_seq,
            subject,
            msg_id,
            deliveries,
            reason,
            body,
        )
        # The event type (`<domain>.<name>`), not the whole subject: ids are unbounded.
        DEAD_LETTERS.labels(self.spec.durable, ".".join(subject.split(".")[:2])).inc()
        with contextlib.suppress(Exception):  # the table is the record; the subject a signal
            await self._js.publish(
                subjects.dead_letter_subject(self.spec.durable),
                body,
                headers={
                    "Nats-Msg-Id": f"dl:{self.spec.durable}:{self.spec.stream}:{stream_seq}",
                    "Agentbus-Dead-Letter-Reason": reason[:1000],
                    "Agentbus-Original-Subject": subject,
                },
            )
        log.error(
            "dead_letter",
            consumer=self.spec.durable,
            subject=subject,
            msg_id=msg_id,
            stream_seq=stream_seq,
            deliveries=deliveries,
            reason=reason,
        )

    async def _on_max_deliveries(self, advisory: Msg) -> None:
        try:
            info = json.loads(advisory.data)
            stored = await self._js.get_msg(self.spec.stream, seq=info["stream_seq"])
            await self.record_dead_letter(
                info["stream_seq"],
                stored.subject or "",
                stored.headers,
                stored.data or b"",
                info.get("deliveries", self.spec.max_deliver),
                "max deliveries reached",
            )
        except Exception as exc:
            log.error("max_deliveries_advisory_failed", consumer=self.spec.durable, error=repr(exc))
