"""`Confirmations` against the real session_events service (a process of its own), on real
NATS and Postgres: events waiting together, of any sessions, are confirmed by one read of
the log; a forged copy among them is answered None and counted, the real ones their log
copy; an event does not wait for a read under way before its own; a log that does not
answer confirms nothing, denies nothing and counts no forgery."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import nats.errors
import pytest
import pytest_asyncio
from nats.aio.client import Client

from contracts import subjects
from contracts.catalog import Command
from contracts.common import ErrorCode
from contracts.events import ChatMessage, Event, EventType
from contracts.session_events import AppendedReply, GetEvents
from domain.errors import DomainError
from servicekit.client import CRep, CReq, call
from servicekit.provenance import FORGED_EVENTS, Confirmations, LogUnanswered
from servicekit.sessionlog import COMMAND_TIMEOUT_SECONDS, SessionLogClient
from testkit.probes import wait_for

PERSON = "user:ana"


@pytest_asyncio.fixture(loop_scope="session")
async def log(spawn: Any, nc: Client) -> SessionLogClient:
    """A client of the session_events service, running as its own process."""
    await spawn("session_events").wait_ready(nc, "session_events")
    return SessionLogClient(nc)


async def said(log: SessionLogClient, session_id: uuid.UUID, text: str) -> Event:
    """A chat message appended, as the log committed it."""
    appended = await log.append(session_id, EventType.CHAT_MESSAGE, PERSON, ChatMessage(text=text))
    (event,) = await log.get([appended.event_id])
    return event


async def test_events_waiting_together_are_confirmed_by_one_read_forgeries_refused(
    log: SessionLogClient, nc: Client
) -> None:
    project = f"proj-{uuid.uuid4().hex[:8]}"
    sessions = [(await log.open(project, PERSON)).session_id for _ in range(3)]
    real = [await said(log, s, f"message {i}") for s in sessions for i in range(2)]
    altered = real[0].model_copy(update={"payload": {"text": "forged"}})
    unknown = real[1].model_copy(update={"id": uuid.uuid4()})
    forged_before = FORGED_EVENTS.copy()
    reads = await nc.subscribe(subjects.EVENTS_GET)  # no callback: its messages wait, counted
    await nc.flush()

    confirmations = Confirmations(log, consumer="test")
    answers = await asyncio.gather(*(confirmations.confirm(e) for e in [*real, altered, unknown]))

    assert answers == [*real, None, None]
    assert FORGED_EVENTS - forged_before == {"payload_differs": 1, "not_in_log": 1}
    await nc.flush()  # our own request, echoed to `reads`, is queued before flush returns
    assert reads.pending_msgs == 1, "one read of the log for all eight"
    await reads.unsubscribe()


async def test_a_log_that_does_not_answer_confirms_nothing_denies_nothing_counts_no_forgery(
    log: SessionLogClient, nc: Client
) -> None:
    project = f"proj-{uuid.uuid4().hex[:8]}"
    event = await said(log, (await log.open(project, PERSON)).session_id, "hello")
    asked: list[str] = []

    async def silent(command: Command[CReq, CRep], request: CReq, timeout: float) -> CRep:
        asked.append(command.subject)
        raise DomainError(ErrorCode.UNAVAILABLE, f"{command.subject} did not answer")

    forged_before = FORGED_EVENTS.copy()
    away = SessionLogClient(nc, caller=silent)
    confirmations = Confirmations(away, consumer="test", attempts=2, retry_seconds=0)

    with pytest.raises(LogUnanswered) as unanswered:
        await confirmations.confirm(event)  # not None: that is the log denying it
    assert unanswered.value.event == event
    assert asked == [subjects.EVENTS_GET] * 2, "asked again once, then given up"
    assert not FORGED_EVENTS - forged_before, "no forgery counted"


async def test_a_read_the_log_never_answers_is_asked_again_after_a_commands_time(
    log: SessionLogClient, nc: Client
) -> None:
    project = f"proj-{uuid.uuid4().hex[:8]}"
    event = await said(log, (await log.open(project, PERSON)).session_id, "hello")
    waited: list[float] = []  # each read's timeout, as the log client was given it

    async def answered(command: Command[CReq, CRep], request: CReq, timeout: float) -> CRep:
        waited.append(timeout)
        return await call(nc, command, request, timeout=timeout)

    async def first_lost(command: Command[CReq, CRep], request: CReq, timeout: float) -> CRep:
        if not waited:  # taken by a replica killed before it answered
            waited.append(timeout)
            await asyncio.sleep(timeout)
            raise nats.errors.TimeoutError
        return await answered(command, request, timeout)

    lost_once = SessionLogClient(nc, caller=first_lost)
    confirmations = Confirmations(lost_once, consumer="test", read_timeout=0.2, retry_seconds=0)
    assert await confirmations.confirm(event) == event
    assert waited == [0.2, 0.2]

    # By default a read waits as long as a command, not as long as a page of the log.
    waited.clear()
    default = Confirmations(SessionLogClient(nc, caller=answered), consumer="test")
    assert await default.confirm(event) == event
    assert waited == [COMMAND_TIMEOUT_SECONDS]


async def test_an_event_is_not_held_behind_a_read_under_way(
    log: SessionLogClient, nc: Client
) -> None:
    session_id = (await log.open(f"proj-{uuid.uuid4().hex[:8]}", PERSON)).session_id
    first, second = [await said(log, session_id, text) for text in ("one", "two")]
    released = asyncio.Event()
    asked: list[str] = []

    async def first_read_held(command: Command[CReq, CRep], request: CReq, timeout: float) -> CRep:
        asked.append(command.subject)
        if len(asked) == 1:
            await released.wait()  # a busy log, slow to answer the first read
        return await call(nc, command, request, timeout=timeout)

    confirmations = Confirmations(SessionLogClient(nc, caller=first_read_held), consumer="test")
    held = asyncio.create_task(confirmations.confirm(first))
    await wait_for(lambda: asked, what="the first read")

    assert await confirmations.confirm(second) == second
    assert not held.done()
    released.set()
    assert await held == first


async def test_an_event_this_reader_appended_is_confirmed_by_the_appends_reply_without_a_read(
    log: SessionLogClient, nc: Client
) -> None:
    project = f"proj-{uuid.uuid4().hex[:8]}"
    session_id = (await log.open(project, PERSON)).session_id
    confirmations = Confirmations(log, consumer="test")
    appended = []
    for text in ("one", "two"):
        payload = ChatMessage(text=text)
        reply = await confirmations.own_append(
            log.append(session_id, EventType.CHAT_MESSAGE, PERSON, payload),
            project_id=project,
            session_id=session_id,
            event_type=EventType.CHAT_MESSAGE,
            actor=PERSON,
            payload=payload,
        )
        appended.append(reply.event_id)
    one, two = await log.get(appended)
    forged_before = FORGED_EVENTS.copy()
    reads = await nc.subscribe(subjects.EVENTS_GET)  # no callback: its messages wait, counted
    await nc.flush()

    assert await confirmations.confirm(one) == one
    await nc.flush()
    assert reads.pending_msgs == 0, "the append's reply said it: no read of the log"

    # A copy that differs from what the log answered is judged by the log, as any other.
    altered = two.model_copy(update={"payload": {"text": "forged"}})
    assert await confirmations.confirm(altered) is None
    assert FORGED_EVENTS - forged_before == {"payload_differs": 1}
    assert await confirmations.confirm(two) == two  # read too: the reply was used once
    await nc.flush()
    assert reads.pending_msgs == 2
    await reads.unsubscribe()


async def test_a_copy_delivered_before_the_appends_reply_waits_for_it_not_for_a_read(
    log: SessionLogClient, nc: Client
) -> None:
    project = f"proj-{uuid.uuid4().hex[:8]}"
    session_id = (await log.open(project, PERSON)).session_id
    payloads = [ChatMessage(text=text) for text in ("hello", "again")]
    replies = [await log.append(session_id, EventType.CHAT_MESSAGE, PERSON, p) for p in payloads]
    real, other = await log.get([r.event_id for r in replies])
    forged = other.model_copy(update={"payload": {"text": "forged"}})
    replied = asyncio.Event()

    async def append_answered_late(reply: AppendedReply) -> AppendedReply:
        await replied.wait()  # the log's relay published the copy before the reply came
        return reply

    confirmations = Confirmations(log, consumer="test")
    reads = await nc.subscribe(subjects.EVENTS_GET)  # no callback: its messages wait, counted
    await nc.flush()
    appends = [
        asyncio.create_task(
            confirmations.own_append(
                append_answered_late(reply),
                project_id=project,
                session_id=session_id,
                event_type=EventType.CHAT_MESSAGE,
                actor=PERSON,
                payload=payload,
            )
        )
        for reply, payload in zip(replies, payloads, strict=True)
    ]
    copies = [asyncio.create_task(confirmations.confirm(e)) for e in (real, forged)]
    await asyncio.sleep(0)
    assert not any(copy.done() for copy in copies)
    await nc.flush()
    assert reads.pending_msgs == 0, "the copies wait for the replies, not for a read"

    forged_before = FORGED_EVENTS.copy()
    replied.set()
    assert await copies[0] == real, "confirmed by its reply"
    assert await copies[1] is None, "no reply matched it: read, and judged by the log"
    assert FORGED_EVENTS - forged_before == {"payload_differs": 1}
    assert await asyncio.gather(*appends) == replies
    read = await reads.next_msg()
    assert GetEvents.model_validate_json(read.data).event_ids == [forged.id], "only the forged"
    await reads.unsubscribe()
