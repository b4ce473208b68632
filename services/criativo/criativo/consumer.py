"""Criativo's inputs: one durable consumer whose messages are handled concurrently
across sessions and one at a time within a session.

`servicekit.consumer.DurableConsumer` awaits each message before the next, which
would make every session wait for every other session's turn. Here each fetched
message is posted to its session's actor at once (in fetch order, so a session's
mailbox receives its inputs in stream order) and settled by the same rules when the
actor is done with it: ack after the effect, nak with backoff, dead-letter what
can never succeed. While a message waits in a mailbox or behind a lease, it is
kept in progress so the server does not redeliver it to another replica.
"""

from __future__ import annotations

import asyncio
import contextlib

import asyncpg
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext

from contracts.events import Event, EventType
from criativo.actors import Actors
from domain.criativo import CRIATIVO
from servicekit.consumer import ConsumerSpec, DurableConsumer, Permanent

# Inputs that start or feed an actor; anything else on the subjects is acknowledged.
ROUTED = frozenset(
    {
        EventType.CHAT_MESSAGE,
        EventType.CRIATIVO_READINESS_CONFIRMED,
        EventType.SESSION_CLOSED,
        EventType.SESSION_CLOSED_ABNORMALLY,
    }
)


def route(actors: Actors, msg: Msg) -> asyncio.Future[None] | None:
    """Post the message's event to its actor; None when there is nothing to do."""
    try:
        event = Event.model_validate_json(msg.data)
    except ValueError as exc:
        raise Permanent(f"not an event: {exc}") from None
    starts_criativo = (
        event.type is EventType.AGENT_ACTIVATED and event.payload.get("agent") == CRIATIVO
    )
    if not starts_criativo and event.type not in ROUTED:
        return None
    return actors.post(event, msg.metadata.num_delivered)


class SessionInputs(DurableConsumer):
    """The durable consumer of chat messages, readiness, activations and closings."""

    def __init__(
        self,
        nc: Client,
        js: JetStreamContext,
        pool: asyncpg.Pool,
        spec: ConsumerSpec,
        actors: Actors,
        ack_wait: float,
    ) -> None:
        super().__init__(nc, js, pool, spec, self._outcome_of)
        self._actors = actors
        self._ack_wait = ack_wait
        self._inflight: set[asyncio.Task[None]] = set()
        self._progress_interval = ack_wait / 3
        # A message's outcome, by the message object's identity while it is in flight.
        self._outcomes: dict[int, asyncio.Future[None] | None] = {}

    async def _outcome_of(self, msg: Msg) -> None:
        outcome = self._outcomes.pop(id(msg), None)
        if outcome is not None:
            await outcome

    async def run(self) -> None:
        """Create or update the consumer, then route messages until cancelled."""
        config = self.spec.config()
        config.ack_wait = self._ack_wait
        await self._js.add_consumer(self.spec.stream, config)
        # With a BackOff, the server redelivers an unacknowledged message after the
        # backoff step of its delivery, not after AckWait: keep it alive well within both.
        self._progress_interval = min(self._ack_wait, self.spec.backoff[0]) / 3
        advisory = await self._nc.subscribe(
            f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{self.spec.stream}.{self.spec.durable}",
            cb=self._on_max_deliveries,
        )
        sub = await self._js.pull_subscribe_bind(durable=self.spec.durable, stream=self.spec.stream)
        try:
            while True:
                try:
                    msgs = await sub.fetch(self.spec.batch, timeout=1.0)
                except (NatsTimeoutError, TimeoutError):
                    continue
                for msg in msgs:
                    self._track(msg)
        finally:
            for task in self._inflight:
                task.cancel()
            with contextlib.suppress(Exception):
                await advisory.unsubscribe()
                await sub.unsubscribe()

    def _track(self, msg: Msg) -> None:
        try:
            outcome = route(self._actors, msg)
        except Permanent as exc:
            outcome = asyncio.get_running_loop().create_future()
            outcome.set_exception(exc)
        task = asyncio.create_task(self._settle(msg, outcome))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    async def _settle(self, msg: Msg, outcome: asyncio.Future[None] | None) -> None:
        keeper = asyncio.create_task(self._keep_in_progress(msg))
        self._outcomes[id(msg)] = outcome
        try:
            # The base class's rules: ack, nak with backoff, or dead-letter.
            await self._handle(msg)
        finally:
            self._outcomes.pop(id(msg), None)
            keeper.cancel()

    async def _keep_in_progress(self, msg: Msg) -> None:
        while True:
            await asyncio.sleep(self._progress_interval)
            with contextlib.suppress(Exception):
                await msg.in_progress()
