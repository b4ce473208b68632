"""`cmd.sessions.fork` against real NATS and real Postgres: a branch's log, its
publication, its idempotency and its refusals."""

from __future__ import annotations

import json
import uuid
from typing import Any

import asyncpg
import pytest
from nats.aio.client import Client

from contracts import streams, subjects
from contracts.events import Event, EventType
from contracts.session_events import (
    AppendedReply,
    AppendEvent,
    CloseSession,
    EventsReply,
    ForkSession,
    ListEvents,
    ListSessions,
    SessionClosedReply,
    SessionForkedReply,
    SessionRef,
    SessionsReply,
    SessionView,
)
from servicekit.client import CommandFailed, call
from testkit.probes import stream_messages, wait_for


async def append(
    nc: Client, session_id: uuid.UUID, type_: str, actor: str = "user:ana", **fields: Any
) -> AppendedReply:
    request = AppendEvent(session_id=session_id, type=type_, actor=actor, **fields)
    return await call(nc, subjects.EVENTS_APPEND, request, AppendedReply)


async def events_of(nc: Client, session_id: uuid.UUID) -> list[Event]:
    reply = await call(nc, subjects.EVENTS_LIST, ListEvents(session_id=session_id), EventsReply)
    return reply.events


ANA = "user:ana"


async def fork(
    nc: Client,
    session_id: uuid.UUID,
    at_seq: int,
    text: str = "An app for my café instead",
    *,
    project_id: str = "proj-1",
    forked_by: str = ANA,
    fork_id: str | None = None,
) -> SessionForkedReply:
    request = ForkSession(
        session_id=session_id,
        project_id=project_id,
        at_seq=at_seq,
        text=text,
        forked_by=forked_by,
        fork_id=fork_id or uuid.uuid4().hex,
    )
    return await call(nc, subjects.SESSIONS_FORK, request, SessionForkedReply)


async def answer(nc: Client, sid: uuid.UUID, message: AppendedReply, text: str) -> None:
    payload = {"agent": "criativo", "text": text}
    await append(
        nc, sid, "agent.response", "agent:criativo", payload=payload, causation_id=message.event_id
    )


async def conversation(nc: Client, open_session: Any) -> tuple[uuid.UUID, list[Event]]:
    """A parent: opened (1), Criativo activated (2), a message (3) and its answer (4), a
    rule citing the message (5), a second message (6) and its answer (7)."""
    opened = await open_session()
    sid = opened.session_id
    await append(
        nc, sid, "agent.activated", "agent:criativo", payload={"agent": "criativo", "via": "user"}
    )
    first = await append(nc, sid, "chat.message", payload={"text": "An app for my bakery"})
    await answer(nc, sid, first, "Who buys?")
    await append(
        nc,
        sid,
        "artifact.business_rule",
        "agent:criativo",
        payload={"title": "Bread", "statement": "Sells bread.", "origin": [str(first.event_id)]},
        causation_id=first.event_id,
    )
    second = await append(nc, sid, "chat.message", payload={"text": "Neighbours"})
    await answer(nc, sid, second, "Nice.")
    return sid, await events_of(nc, sid)


async def test_a_branch_is_forked_copies_then_the_new_message(
    nc: Client, open_session: Any
) -> None:
    parent_id, parent = await conversation(nc, open_session)

    # "Edit" the second message (seq 6): the branch keeps 1..5 and says the new text.
    branch = await fork(nc, parent_id, 5, "Office workers")

    log = await events_of(nc, branch.session_id)
    assert [e.seq for e in log] == list(range(1, 8))
    forked, copies, message = log[0], log[1:6], log[6]
    assert (forked.id, forked.type, forked.actor) == (
        branch.forked_event_id,
        EventType.SESSION_FORKED,
        "user:ana",
    )
    assert forked.payload == {
        "parent_session_id": str(parent_id),
        "at_seq": 5,
        "forked_by": "user:ana",
    }
    assert forked.copied_from is None
    originals = {e.id: e for e in parent}
    assert [c.copied_from for c in copies] == [e.id for e in parent[:5]]
    assert not {c.id for c in copies} & set(originals)
    for copy in copies:
        original = originals[copy.copied_from]  # type: ignore[index]
        assert (copy.type, copy.actor) == (original.type, original.actor)
    # The answer and the rule are caused by the branch's copy of the message, and the
    # rule's origin cites that copy.
    copy_of = {c.copied_from: c.id for c in copies}
    first_message = parent[2].id
    assert copies[3].causation_id == copy_of[first_message]
    assert copies[4].causation_id == copy_of[first_message]
    assert copies[4].payload["origin"] == [str(copy_of[first_message])]
    assert (message.id, message.type, message.actor) == (
        branch.message_event_id,
        EventType.CHAT_MESSAGE,
        "user:ana",
    )
    assert message.payload["text"] == "Office workers"
    assert (message.copied_from, message.causation_id) == (None, None)

    # The parent is left as it was.
    assert await events_of(nc, parent_id) == parent

    # Every event of the branch is on the bus, under the branch's subjects, as logged.
    published = await wait_for(
        lambda: _when_all(
            stream_messages(nc, streams.EVENTS.name, f"*.*.proj-1.{branch.session_id}"), 7
        ),
        what="the branch's events on JetStream",
    )
    assert [Event.model_validate_json(m.data) for m in published] == log

    view = await call(
        nc, subjects.SESSIONS_GET, SessionRef(session_id=branch.session_id), SessionView
    )
    assert (view.parent_session_id, view.forked_at_seq, view.status) == (parent_id, 5, "open")
    listed = await call(
        nc,
        subjects.SESSIONS_LIST,
        ListSessions(project_id="proj-1", forked_from=parent_id),
        SessionsReply,
    )
    assert [s.session_id for s in listed.sessions] == [branch.session_id]


async def _when_all(messages: Any, count: int) -> list[Any] | None:
    got = await messages
    return got if len(got) >= count else None


async def test_a_repeated_fork_id_answers_the_branch_it_made(nc: Client, open_session: Any) -> None:
    parent_id, _ = await conversation(nc, open_session)

    first = await fork(nc, parent_id, 5, "Office workers", fork_id="edit-6")
    again = await fork(nc, parent_id, 5, "Office workers", fork_id="edit-6")

    assert again.duplicate and not first.duplicate
    assert again.model_dump(exclude={"duplicate"}) == first.model_dump(exclude={"duplicate"})
    with pytest.raises(CommandFailed) as refused:
        await fork(nc, parent_id, 5, "Students", fork_id="edit-6")
    assert refused.value.code == "idempotency_conflict"
    listed = await call(
        nc,
        subjects.SESSIONS_LIST,
        ListSessions(project_id="proj-1", forked_from=parent_id),
        SessionsReply,
    )
    assert len(listed.sessions) == 1


async def test_a_fork_of_a_fork_copies_the_branch_as_it_is(nc: Client, open_session: Any) -> None:
    parent_id, _ = await conversation(nc, open_session)
    branch = await fork(nc, parent_id, 5, "Office workers")
    branch_log = await events_of(nc, branch.session_id)

    # Retry the branch's own message (seq 7): keep its 1..6 and send the same text again.
    twig = await fork(nc, branch.session_id, 6, "Office workers")

    log = await events_of(nc, twig.session_id)
    assert log[0].payload["parent_session_id"] == str(branch.session_id)
    assert [e.copied_from for e in log[1:7]] == [e.id for e in branch_log[:6]]
    # The branch's own `session.forked` is copied as the history it is.
    assert log[1].type is EventType.SESSION_FORKED
    assert log[7].payload["text"] == "Office workers"
    assert await events_of(nc, branch.session_id) == branch_log


async def test_a_closed_session_forks_before_its_closing(nc: Client, open_session: Any) -> None:
    parent_id, _ = await conversation(nc, open_session)
    await call(nc, subjects.SESSIONS_CLOSE, CloseSession(session_id=parent_id), SessionClosedReply)

    branch = await fork(nc, parent_id, 7, "Anything else?")
    assert len(await events_of(nc, branch.session_id)) == 9
    with pytest.raises(CommandFailed) as refused:
        await fork(nc, parent_id, 8)  # the closing itself
    assert refused.value.code == "fork_point_not_found"
    assert refused.value.details["last_seq"] == 7


async def test_bad_forks_get_a_code_and_write_nothing(
    nc: Client, open_session: Any, database_url: str
) -> None:
    parent_id, _ = await conversation(nc, open_session)
    other = await open_session("proj-2")
    before = await _counts(database_url)

    cases: list[tuple[dict[str, Any], str]] = [
        ({"forked_by": "agent:criativo"}, "actor_not_allowed"),
        ({"session_id": uuid.uuid4()}, "session_not_found"),
        ({"session_id": other.session_id}, "session_not_in_project"),
        ({"at_seq": 8}, "fork_point_not_found"),
    ]
    for changes, code in cases:
        args: dict[str, Any] = {"session_id": parent_id, "at_seq": 5, **changes}
        with pytest.raises(CommandFailed) as refused:
            await fork(nc, args["session_id"], args["at_seq"], forked_by=args.get("forked_by", ANA))
        assert refused.value.code == code, changes
        assert refused.value.message

    malformed: list[dict[str, Any]] = [
        {"at_seq": 0},
        {"text": "   "},
        {"text": ""},
        {"fork_id": ""},
        {"project_id": "a.b"},
    ]
    for changes in malformed:
        body = {
            "session_id": str(parent_id),
            "project_id": "proj-1",
            "at_seq": 5,
            "text": "x",
            "forked_by": "user:ana",
            "fork_id": "f",
            **changes,
        }
        msg = await nc.request(subjects.SESSIONS_FORK, json.dumps(body).encode(), timeout=5)
        assert b'"invalid_request"' in msg.data, (changes, msg.data)

    assert await _counts(database_url) == before


async def _counts(database_url: str) -> tuple[int, int]:
    """How many sessions and events the log holds."""
    conn = await asyncpg.connect(database_url)
    try:
        row = await conn.fetchrow(
            """SELECT (SELECT count(*) FROM session_events.sessions) AS sessions,
                      (SELECT count(*) FROM session_events.events) AS events"""
        )
    finally:
        await conn.close()
    assert row is not None
    return row["sessions"], row["events"]
