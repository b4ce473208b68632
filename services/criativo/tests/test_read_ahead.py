"""The log read that goes out while the lease is taken (issue 12: one round trip off the
first token) stands only when the lease was taken alone, resumed from this replica's own
release or the key's first write: a read taken before another replica held the session
is read again, so a message that replica answered is not answered twice.

Against the real log, NATS and leases; the two replicas' `SessionWork` are driven here,
with no Criativo service running, so nothing else takes the session.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from nats.aio.client import Client

from contracts.events import AgentResponse, Event, EventType
from criativo.lease import BUCKET, SessionLeases, open_leases
from criativo.presence import Presence
from criativo.session import SessionWork
from criativo.turns import RecordRule, TurnOutcome, Turns
from domain.criativo import Conversation
from harness import MeteringClient
from servicekit.bus import Bucket
from servicekit.sessionlog import SessionLogClient

from .conftest import Driver, provisioned_leases


class WatchedLog(SessionLogClient):
    """The log, counting the reads of a session's events and saying when one was served."""

    def __init__(self, nc: Client) -> None:
        super().__init__(nc)
        self.read = asyncio.Event()
        self.reads = 0

    async def events(self, session_id: uuid.UUID, after_seq: int = 0) -> list[Event]:
        events = await super().events(session_id, after_seq)
        self.reads += 1
        self.read.set()
        return events


class LateLeases(SessionLeases):
    """Leases taken only once `before` ran: another replica's turn slips in between."""

    before: Callable[[], Awaitable[None]] | None = None

    @asynccontextmanager
    async def hold(self, session_id: uuid.UUID) -> AsyncIterator[bool]:
        if self.before is not None:
            await self.before()
        async with super().hold(session_id) as resumed:
            yield resumed


class CountedTurns(Turns):
    """Turns that only count how often Criativo was asked to answer."""

    def __init__(self, nc: Client) -> None:
        super().__init__(MeteringClient(nc), max_iterations=1, max_tokens=64, budget_micros=None)
        self.answered: list[uuid.UUID] = []

    async def criativo(
        self, conv: Conversation, message_id: uuid.UUID, record: RecordRule
    ) -> TurnOutcome:
        self.answered.append(message_id)
        return TurnOutcome(text="resposta")


@dataclass
class Replica:
    """One Criativo replica's session work, with what the tests watch of it."""

    work: SessionWork
    log: WatchedLog
    leases: SessionLeases
    turns: CountedTurns


async def replica(driver: Driver, nc: Client, leases: SessionLeases) -> Replica:
    log, turns = WatchedLog(nc), CountedTurns(nc)
    work = SessionWork(nc, driver.db, log, leases, turns, crash_limit=3)
    return Replica(work, log, leases, turns)


async def message_event(driver: Driver, session: uuid.UUID, text: str) -> Event:
    """Say `text` in the session; the log's copy of the message."""
    message = await driver.say(session, text)
    return next(e for e in await driver.events(session, "chat.message") if e.id == message)


async def answer_under_lease(
    log: SessionLogClient, leases: SessionLeases, session: uuid.UUID, message: uuid.UUID
) -> None:
    """Another replica's answer to `message`, appended under that replica's lease."""
    async with leases.hold(session):
        await log.append(
            session,
            EventType.AGENT_RESPONSE,
            "agent:criativo",
            AgentResponse(agent="criativo", text="de B"),
            causation_id=message,
            idempotency_key=f"criativo:response:{message}",
        )


async def test_a_read_taken_before_another_replica_held_the_session_is_read_again(
    driver: Driver, nc: Client
) -> None:
    session = await driver.open()
    a_leases = LateLeases(
        await Bucket.open(await provisioned_leases(nc.jetstream(), 30), BUCKET),
        await Presence.started(nc, "replica-a"),
    )
    a = await replica(driver, nc, a_leases)
    log, turns = a.log, a.turns
    b_leases = await open_leases(nc, await provisioned_leases(nc.jetstream(), 30), "replica-b")
    conv = await a.work.catch_up(Conversation(session))
    async with a_leases.hold(session):  # A released it last: it may resume
        pass
    event = await message_event(driver, session, "oi")
    message = event.id

    async def b_answers_after_a_read() -> None:
        await asyncio.wait_for(log.read.wait(), 30)  # A's read went out ahead of its lease
        await answer_under_lease(log, b_leases, session, message)

    log.read.clear()
    a_leases.before = b_answers_after_a_read
    conv = await a.work.handle(conv, event, deliveries=1)

    assert turns.answered == []  # B's answer was read again under A's lease
    responses = await driver.events(session, "agent.response")
    assert [e.causation_id for e in responses] == [message]
    assert message in conv.answered


async def test_a_resumed_lease_answers_on_the_one_read_that_went_out_with_it(
    driver: Driver, nc: Client
) -> None:
    session = await driver.open()
    a = await replica(
        driver, nc, await open_leases(nc, await provisioned_leases(nc.jetstream(), 30), "replica-a")
    )
    conv = await a.work.catch_up(Conversation(session))
    first = await message_event(driver, session, "um")
    conv = await a.work.handle(conv, first, deliveries=1)  # takes the lease anew
    second = await message_event(driver, session, "dois")
    reads = a.log.reads
    conv = await a.work.handle(conv, second, deliveries=1)

    assert a.log.reads == reads + 1  # the read sent ahead stood: the lease was resumed
    assert a.turns.answered == [first.id, second.id]
    assert first.id in conv.answered  # the read saw the first answer


async def test_a_sessions_first_turn_answers_on_the_read_that_went_out_beside_its_lease(
    driver: Driver, nc: Client
) -> None:
    """No replica ever held the session: the lease is its key's first write, so the read
    sent before it was asked for stands, and the turn waits for one round trip, not two."""
    session = await driver.open()
    leases = LateLeases(
        await Bucket.open(await provisioned_leases(nc.jetstream(), 30), BUCKET),
        await Presence.started(nc, "replica-a"),
    )
    a = await replica(driver, nc, leases)
    conv = await a.work.catch_up(Conversation(session))
    event = await message_event(driver, session, "oi")

    async def read_first() -> None:
        await asyncio.wait_for(a.log.read.wait(), 30)  # sent before the lease is taken

    a.log.read.clear()
    reads = a.log.reads
    leases.before = read_first
    await a.work.handle(conv, event, deliveries=1)

    assert a.log.reads == reads + 1  # the read sent ahead stood: nobody held it before
    assert a.turns.answered == [event.id]
    responses = await driver.events(session, "agent.response")
    assert [e.causation_id for e in responses] == [event.id]


async def test_a_read_taken_before_another_replica_first_held_the_session_is_read_again(
    driver: Driver, nc: Client
) -> None:
    """B takes the session for the first time, answers and releases it while A's read is
    out: A's lease is no first write any more (B's release marker is there), so A reads
    again and leaves B's answer the only one."""
    session = await driver.open()
    a_leases = LateLeases(
        await Bucket.open(await provisioned_leases(nc.jetstream(), 30), BUCKET),
        await Presence.started(nc, "replica-a"),
    )
    a = await replica(driver, nc, a_leases)
    b_leases = await open_leases(nc, await provisioned_leases(nc.jetstream(), 30), "replica-b")
    conv = await a.work.catch_up(Conversation(session))
    event = await message_event(driver, session, "oi")
    message = event.id

    async def b_answers_after_a_read() -> None:
        await asyncio.wait_for(a.log.read.wait(), 30)
        await answer_under_lease(a.log, b_leases, session, message)

    a.log.read.clear()
    a_leases.before = b_answers_after_a_read
    conv = await a.work.handle(conv, event, deliveries=1)

    assert a.turns.answered == []
    responses = await driver.events(session, "agent.response")
    assert [e.causation_id for e in responses] == [message]
    assert message in conv.answered
