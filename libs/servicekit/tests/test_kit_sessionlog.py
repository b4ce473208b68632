"""`SessionLogClient` against the real session_events service, started as a process (by
module name: the kit imports no service), on real NATS and Postgres: paging past the
log's page size both ways, idempotent appends, the project's sessions and heartbeats,
a service's own caller carrying every command, and the refusals callers branch on
arriving as types, not as strings."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import nats.errors
import pytest
import pytest_asyncio
from nats.aio.client import Client
from pydantic import ValidationError

from contracts import subjects
from contracts.catalog import Command
from contracts.common import ErrorCode
from contracts.events import BusinessRule, ChatMessage, EventType
from contracts.session_events import EVENTS_PAGE_MAX
from domain.errors import DomainError
from servicekit.client import CommandFailed, CRep, CReq, call, parse_reply, resent
from servicekit.endpoint import error_reply
from servicekit.sessionlog import (
    MAX_REASON_CHARS,
    READ_TIMEOUT_SECONDS,
    RESEND_READ_AFTER_SECONDS,
    SessionClosed,
    SessionLogClient,
    SessionNotFound,
)

PERSON = "user:ana"


@pytest_asyncio.fixture(loop_scope="session")
async def log(spawn: Any, nc: Client) -> SessionLogClient:
    """A client of the session_events service, running as its own process."""
    await spawn("session_events").wait_ready(nc, "session_events")
    return SessionLogClient(nc)


def project() -> str:
    return f"proj-{uuid.uuid4().hex[:8]}"


async def say(log: SessionLogClient, session_id: uuid.UUID, text: str) -> uuid.UUID:
    appended = await log.append(session_id, EventType.CHAT_MESSAGE, PERSON, ChatMessage(text=text))
    return appended.event_id


async def test_append_is_idempotent_and_keeps_its_causation(log: SessionLogClient) -> None:
    opened = await log.open(project(), PERSON)
    said = await say(log, opened.session_id, "hello")
    rule = BusinessRule(title="t", statement="s", origin=[said])

    first = await log.append(
        opened.session_id,
        EventType.ARTIFACT_BUSINESS_RULE,
        "agent:criativo",
        rule,
        causation_id=said,
        idempotency_key="rule-1",
    )
    again = await log.append(
        opened.session_id,
        EventType.ARTIFACT_BUSINESS_RULE,
        "agent:criativo",
        rule,
        causation_id=said,
        idempotency_key="rule-1",
    )

    assert (again.event_id, again.seq, again.duplicate) == (first.event_id, first.seq, True)
    events = await log.events(opened.session_id)
    assert [e.type for e in events] == [
        EventType.SESSION_OPENED,
        EventType.CHAT_MESSAGE,
        EventType.ARTIFACT_BUSINESS_RULE,
    ]
    assert events[-1].causation_id == said
    assert [e.id for e in await log.events(opened.session_id, after_seq=2)] == [first.event_id]
    view = await log.session(opened.session_id)
    assert (view.status, view.event_count) == ("open", 3)


async def test_reads_page_past_the_logs_limit(log: SessionLogClient) -> None:
    opened = await log.open(project(), PERSON)
    ids: list[uuid.UUID] = []
    for start in range(0, EVENTS_PAGE_MAX + 1, 50):  # one more than a page, after the opening
        batch = range(start, min(start + 50, EVENTS_PAGE_MAX + 1))
        ids += await asyncio.gather(*(say(log, opened.session_id, f"m{i}") for i in batch))

    events = await log.events(opened.session_id)
    assert len(events) == EVENTS_PAGE_MAX + 2
    assert [e.seq for e in events] == list(range(1, EVENTS_PAGE_MAX + 3))
    tail = await log.events(opened.session_id, after_seq=EVENTS_PAGE_MAX)
    assert [e.seq for e in tail] == [EVENTS_PAGE_MAX + 1, EVENTS_PAGE_MAX + 2]

    pages = [page async for page in log.pages(opened.session_id)]
    assert [len(page) for page in pages] == [EVENTS_PAGE_MAX, 2]
    assert [e.seq for e in await log.page(opened.session_id, after_seq=5, limit=3)] == [6, 7, 8]

    unknown = uuid.uuid4()
    found = await log.get([*ids, unknown])  # more ids than one `cmd.events.get` takes
    assert sorted(e.id for e in found) == sorted(ids)


async def test_query_reads_a_projects_events_of_the_given_types(log: SessionLogClient) -> None:
    here, elsewhere = project(), project()
    first = await log.open(here, PERSON)
    second = await log.open(here, PERSON)
    other = await log.open(elsewhere, PERSON)
    said = [await say(log, s.session_id, "x") for s in (first, second, other)]

    chat = await log.query(here, [EventType.CHAT_MESSAGE])
    assert [e.id for e in chat] == said[:2]
    opened = await log.query(here, [EventType.SESSION_OPENED, EventType.CHAT_MESSAGE])
    assert len(opened) == 4


async def test_sessions_lists_a_projects_sessions_and_heartbeats_keep_only_open_ones(
    log: SessionLogClient,
) -> None:
    here = project()
    first = await log.open(here, PERSON)
    second = await log.open(here, PERSON)
    await log.open(project(), PERSON)

    listed = await log.sessions(here)
    assert [s.session_id for s in listed] == [second.session_id, first.session_id]
    assert (await log.heartbeat(first.session_id)).session_id == first.session_id
    await log.close(first.session_id, PERSON)
    with pytest.raises(SessionClosed):
        await log.heartbeat(first.session_id)


async def test_a_services_own_caller_carries_every_command_with_its_timeout(
    log: SessionLogClient, nc: Client
) -> None:
    sent: list[tuple[str, float]] = []

    async def caller(command: Command[CReq, CRep], request: CReq, timeout: float) -> CRep:
        sent.append((command.subject, timeout))
        return await call(nc, command, request, timeout=timeout)

    own = SessionLogClient(nc, timeout=7.0, caller=caller)
    opened = await own.open(project(), PERSON)
    assert [e.type for e in await own.page(opened.session_id)] == [EventType.SESSION_OPENED]
    with pytest.raises(SessionNotFound):  # the refusal is still typed
        await own.session(uuid.uuid4())
    assert sent == [
        (subjects.SESSIONS_OPEN, 7.0),
        (subjects.EVENTS_LIST, READ_TIMEOUT_SECONDS),
        (subjects.SESSIONS_GET, 7.0),
    ]


def dying_first(nc: Client, sent: list[tuple[str, float]]) -> Any:
    """A caller whose first request goes to a replica that dies holding it: no reply and no
    error, only its timeout (NATS cannot tell the caller); the others reach the log."""

    async def caller(command: Command[CReq, CRep], request: CReq, timeout: float) -> CRep:
        sent.append((command.subject, timeout))
        if len(sent) == 1:
            await asyncio.sleep(timeout)
            raise nats.errors.TimeoutError
        return await call(nc, command, request, timeout=timeout)

    return caller


async def test_a_read_a_dying_replica_took_is_sent_again_and_answered(
    log: SessionLogClient, nc: Client
) -> None:
    opened = await log.open(project(), PERSON)
    await say(log, opened.session_id, "hello")
    sent: list[tuple[str, float]] = []
    own = SessionLogClient(nc, caller=dying_first(nc, sent))

    events = await own.events(opened.session_id)

    assert [e.type for e in events] == [EventType.SESSION_OPENED, EventType.CHAT_MESSAGE]
    # Sent again once, within what was left of the first copy's time: the read as a whole
    # still ends by its timeout.
    assert [subject for subject, _ in sent] == [subjects.EVENTS_LIST, subjects.EVENTS_LIST]
    assert sent[0][1] == READ_TIMEOUT_SECONDS
    assert sent[1][1] <= READ_TIMEOUT_SECONDS - RESEND_READ_AFTER_SECONDS


async def test_a_write_is_never_sent_twice(log: SessionLogClient, nc: Client) -> None:
    opened = await log.open(project(), PERSON)
    sent: list[tuple[str, float]] = []
    own = SessionLogClient(nc, timeout=0.2, caller=dying_first(nc, sent))

    with pytest.raises(nats.errors.TimeoutError):
        await own.append(opened.session_id, EventType.CHAT_MESSAGE, PERSON, ChatMessage(text="x"))

    assert sent == [(subjects.EVENTS_APPEND, 0.2)]
    assert [e.type for e in await log.events(opened.session_id)] == [EventType.SESSION_OPENED]


async def test_the_first_copy_to_end_decides_even_with_an_error() -> None:
    copies: list[float] = []
    cancelled = asyncio.Event()

    async def send(timeout: float) -> str:
        copies.append(timeout)
        if len(copies) == 1:
            try:
                await asyncio.sleep(timeout)
            except asyncio.CancelledError:
                cancelled.set()
                raise
            return "too late"
        raise CommandFailed(ErrorCode.SESSION_CLOSED, "closed")

    with pytest.raises(CommandFailed) as refused:
        await resent(send, timeout=30.0, first_after=0.01)

    assert refused.value.code == ErrorCode.SESSION_CLOSED
    assert len(copies) == 2
    await asyncio.wait_for(cancelled.wait(), 1.0)  # the unanswered copy is dropped


async def test_copies_are_bounded_and_all_end_by_the_first_ones_timeout() -> None:
    timeouts: list[float] = []

    async def send(timeout: float) -> str:
        timeouts.append(timeout)
        await asyncio.sleep(timeout)
        raise nats.errors.TimeoutError

    with pytest.raises(nats.errors.TimeoutError):
        await resent(send, timeout=0.5, first_after=0.05, copies=3)

    assert len(timeouts) == 3
    assert timeouts[0] == 0.5
    assert 0.5 > timeouts[1] > timeouts[2] > 0  # each within what is left of the first's


async def test_an_unknown_session_is_session_not_found(log: SessionLogClient) -> None:
    missing = uuid.uuid4()
    for read in (log.session(missing), log.events(missing), log.terminate(missing, "x")):
        with pytest.raises(SessionNotFound) as refused:
            await read
        assert isinstance(refused.value, DomainError)
        assert refused.value.code == ErrorCode.SESSION_NOT_FOUND
        assert refused.value.details == {"session_id": str(missing)}


async def test_a_closed_session_is_session_closed(log: SessionLogClient) -> None:
    opened = await log.open(project(), PERSON)
    ended = await log.terminate(opened.session_id, "r" * (MAX_REASON_CHARS + 500))
    assert ended.status == "closed_abnormally"
    assert (await log.session(opened.session_id)).termination_reason == "r" * MAX_REASON_CHARS

    for refused_call in (
        log.terminate(opened.session_id, "again"),
        log.close(opened.session_id, PERSON),
        log.append(opened.session_id, EventType.CHAT_MESSAGE, PERSON, ChatMessage(text="hi")),
    ):
        with pytest.raises(SessionClosed) as refused:
            await refused_call
        assert refused.value.code == ErrorCode.SESSION_CLOSED


async def test_other_refusals_keep_their_code_message_and_details(log: SessionLogClient) -> None:
    opened = await log.open(project(), PERSON)
    with pytest.raises(CommandFailed) as refused:
        await log.append(
            opened.session_id,
            EventType.ARTIFACT_PRODUCT_BRIEF,
            PERSON,
            ChatMessage(text="not a brief"),
        )
    assert refused.value.code == ErrorCode.INVALID_PAYLOAD
    assert refused.value.message.startswith("invalid artifact.product_brief payload")
    assert refused.value.details["errors"]
    passed_on = refused.value.refusal()
    assert (passed_on.code, passed_on.message, passed_on.details) == (
        refused.value.code,
        refused.value.message,
        refused.value.details,
    )


def test_an_error_reply_is_read_by_its_model_and_anything_else_is_not_a_reply() -> None:
    with pytest.raises(CommandFailed) as refused:
        parse_reply(error_reply(ErrorCode.SESSION_CLOSED, "closed", status="closed"), ChatMessage)
    assert (refused.value.code, refused.value.message) == ("session_closed", "closed")
    assert refused.value.details == {"status": "closed"}
    # Spacing and key order are not part of the contract.
    spaced = b'{ "error" : {"message": "m", "code": "internal"} }'
    with pytest.raises(CommandFailed) as internal:
        parse_reply(spaced, ChatMessage)
    assert (internal.value.code, internal.value.details) == ("internal", {})
    with pytest.raises(ValidationError):
        parse_reply(b'{"txt": "neither a reply nor an error"}', ChatMessage)
