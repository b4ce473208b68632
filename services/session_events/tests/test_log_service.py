"""The session_events service against real NATS and real Postgres."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import asyncpg
import pytest
from nats.aio.client import Client

from contracts import streams, subjects
from contracts.events import Event, EventType
from contracts.session_events import (
    TITLE_MAX_CHARS,
    AppendedReply,
    AppendEvent,
    CloseSession,
    EventsReply,
    GetEvents,
    HeartbeatReply,
    ListEvents,
    ListSessions,
    QueryEvents,
    SessionClosedReply,
    SessionRef,
    SessionsReply,
    SessionView,
    TerminateSession,
)
from servicekit.client import CommandFailed, call
from testkit.probes import stream_messages, wait_for


async def append(
    nc: Client, session_id: uuid.UUID, type_: str, actor: str = "user:ana", **fields: Any
) -> AppendedReply:
    payload = fields.pop("payload", {})
    return await call(
        nc,
        subjects.EVENTS_APPEND,
        AppendEvent(session_id=session_id, type=type_, actor=actor, payload=payload, **fields),
        AppendedReply,
    )


async def events_of(nc: Client, session_id: uuid.UUID) -> list[Event]:
    reply = await call(nc, subjects.EVENTS_LIST, ListEvents(session_id=session_id), EventsReply)
    return reply.events


async def raw_request(nc: Client, subject: str, data: bytes) -> dict[str, Any]:
    msg = await nc.request(subject, data, timeout=5)
    result: dict[str, Any] = json.loads(msg.data)
    return result


def chat(text: str = "I want an app for my bakery") -> dict[str, Any]:
    return {"payload": {"text": text}}


async def test_open_writes_session_opened_and_publishes_it(nc: Client, open_session: Any) -> None:
    opened = await open_session("bakery", "user:ana")

    [event] = await events_of(nc, opened.session_id)
    assert (event.id, event.seq, event.type) == (opened.event_id, 1, EventType.SESSION_OPENED)
    assert event.payload == {"opened_by": "user:ana"}
    subject = subjects.event_subject(EventType.SESSION_OPENED, "bakery", opened.session_id)
    [msg] = await wait_for(
        lambda: stream_messages(nc, streams.EVENTS.name, subject),
        what="session.opened on JetStream",
    )
    assert msg.headers["Nats-Msg-Id"] == str(opened.event_id)
    assert Event.model_validate_json(msg.data) == event


async def test_append_assigns_the_next_seq_and_reads_back(nc: Client, open_session: Any) -> None:
    opened = await open_session()
    first = await append(nc, opened.session_id, "chat.message", **chat("hello"))
    second = await append(nc, opened.session_id, "chat.message", **chat("again"))

    assert (first.seq, second.seq) == (2, 3)
    listed = await events_of(nc, opened.session_id)
    assert [e.seq for e in listed] == [1, 2, 3]
    assert [e.payload.get("text") for e in listed[1:]] == ["hello", "again"]

    after = await call(
        nc, subjects.EVENTS_LIST, ListEvents(session_id=opened.session_id, after_seq=2), EventsReply
    )
    assert [e.seq for e in after.events] == [3]

    unknown = uuid.uuid4()
    got = await call(
        nc, subjects.EVENTS_GET, GetEvents(event_ids=[second.event_id, unknown]), EventsReply
    )
    assert [e.id for e in got.events] == [second.event_id]
    assert got.events[0].session_id == opened.session_id
    assert got.events[0].project_id == "proj-1"
    assert got.missing == [unknown]


async def test_query_returns_a_projects_events_of_the_given_types(
    nc: Client, open_session: Any
) -> None:
    a = await open_session("shop")
    b = await open_session("shop")
    other = await open_session("elsewhere")
    for session in (a, b, other):
        msg = await append(nc, session.session_id, "chat.message", **chat())
        await append(
            nc,
            session.session_id,
            "artifact.business_rule",
            actor="agent:criativo",
            payload={
                "title": "Opening hours",
                "statement": "Orders close at 18h",
                "origin": [str(msg.event_id)],
            },
        )

    reply = await call(
        nc,
        subjects.EVENTS_QUERY,
        QueryEvents(project_id="shop", types=["artifact.business_rule"]),
        EventsReply,
    )
    assert {e.session_id for e in reply.events} == {a.session_id, b.session_id}
    assert {e.type for e in reply.events} == {EventType.ARTIFACT_BUSINESS_RULE}

    with pytest.raises(CommandFailed) as refused:
        await call(
            nc,
            subjects.EVENTS_QUERY,
            QueryEvents(project_id="shop", types=["no.such"]),
            EventsReply,
        )
    assert refused.value.code == "unknown_event_type"


async def test_a_repeated_idempotency_key_returns_the_original_and_writes_nothing(
    nc: Client, open_session: Any
) -> None:
    opened = await open_session()
    first = await append(nc, opened.session_id, "chat.message", idempotency_key="k-1", **chat())
    again = await append(nc, opened.session_id, "chat.message", idempotency_key="k-1", **chat())

    assert (again.event_id, again.seq, again.duplicate) == (first.event_id, first.seq, True)
    assert len(await events_of(nc, opened.session_id)) == 2


@pytest.mark.parametrize(
    ("type_", "actor", "payload", "code"),
    [
        ("chat.shout", "user:ana", {"text": "hi"}, "unknown_event_type"),
        ("session.closed", "user:ana", {}, "reserved_event_type"),
        ("chat.message", "user:ana", {"text": ""}, "invalid_payload"),
        ("chat.message", "user:ana", {"text": "hi", "mood": "happy"}, "invalid_payload"),
        (
            "artifact.business_rule",
            "agent:criativo",
            {"title": "t", "statement": "s", "origin": []},
            "invalid_payload",
        ),
        (
            "artifact.product_brief",
            "agent:criativo",
            {"title": "t", "summary": "s"},
            "brief_requires_readiness",
        ),
        ("artifact.product_brief", "agent:po", {"title": "t", "summary": "s"}, "actor_not_allowed"),
    ],
    ids=[
        "unknown-type",
        "reserved-type",
        "empty-text",
        "extra-field",
        "rule-without-origin",
        "brief-without-readiness",
        "brief-from-another-agent",
    ],
)
async def test_refused_appends_write_nothing(
    nc: Client, open_session: Any, type_: str, actor: str, payload: dict[str, Any], code: str
) -> None:
    opened = await open_session()
    with pytest.raises(CommandFailed) as refused:
        await append(nc, opened.session_id, type_, actor=actor, payload=payload)
    assert refused.value.code == code
    assert refused.value.message
    assert [e.seq for e in await events_of(nc, opened.session_id)] == [1]


async def test_the_brief_follows_only_a_persons_readiness_in_the_same_session(
    nc: Client, open_session: Any
) -> None:
    opened = await open_session()
    elsewhere = await open_session()
    brief = {"title": "Bakery app", "summary": "Pre-orders for pickup"}
    ready = await append(nc, opened.session_id, "criativo.readiness_confirmed")
    ready_elsewhere = await append(nc, elsewhere.session_id, "criativo.readiness_confirmed")
    with pytest.raises(CommandFailed) as not_a_person:
        await append(nc, opened.session_id, "criativo.readiness_confirmed", actor="agent:criativo")
    assert not_a_person.value.code == "actor_not_allowed"

    for cause, code in [
        (ready_elsewhere.event_id, "brief_requires_readiness"),
        (uuid.uuid4(), "causation_not_found"),
    ]:
        with pytest.raises(CommandFailed) as refused:
            await append(
                nc,
                opened.session_id,
                "artifact.product_brief",
                actor="agent:criativo",
                payload=brief,
                causation_id=cause,
            )
        assert refused.value.code == code

    written = await append(
        nc,
        opened.session_id,
        "artifact.product_brief",
        actor="agent:criativo",
        payload=brief,
        causation_id=ready.event_id,
    )
    [stored] = (
        await call(nc, subjects.EVENTS_GET, GetEvents(event_ids=[written.event_id]), EventsReply)
    ).events
    assert stored.causation_id == ready.event_id
    assert stored.payload["title"] == "Bakery app"


async def test_a_closed_session_refuses_conversation_but_records_system_facts(
    nc: Client, open_session: Any
) -> None:
    opened = await open_session()
    closed = await call(
        nc,
        subjects.SESSIONS_CLOSE,
        CloseSession(session_id=opened.session_id, closed_by="user:ana"),
        SessionClosedReply,
    )
    assert closed.status == "closed"

    for type_, payload in [
        ("chat.message", {"text": "still there?"}),
        ("agent.response", {"agent": "criativo", "text": "yes"}),
        ("criativo.readiness_confirmed", {}),
    ]:
        with pytest.raises(CommandFailed) as refused:
            await append(nc, opened.session_id, type_, payload=payload)
        assert refused.value.code == "session_closed"

    superseded = {"handoffId": str(uuid.uuid4()), "toAgent": "po", "motivo": "agente_ativado"}
    await append(
        nc,
        opened.session_id,
        "handoff.superseded",
        actor="system:handoff-lifecycle",
        payload=superseded,
    )

    with pytest.raises(CommandFailed) as again:
        await call(
            nc,
            subjects.SESSIONS_CLOSE,
            CloseSession(session_id=opened.session_id),
            SessionClosedReply,
        )
    assert again.value.code == "session_closed"
    view = await call(
        nc, subjects.SESSIONS_GET, SessionRef(session_id=opened.session_id), SessionView
    )
    assert (view.status, view.termination_reason, view.event_count) == ("closed", None, 3)
    assert [e.type for e in await events_of(nc, opened.session_id)] == [
        EventType.SESSION_OPENED,
        EventType.SESSION_CLOSED,
        EventType.HANDOFF_SUPERSEDED,
    ]


async def test_terminate_keeps_the_reason(nc: Client, open_session: Any) -> None:
    opened = await open_session()
    reply = await call(
        nc,
        subjects.SESSIONS_TERMINATE,
        TerminateSession(session_id=opened.session_id, reason="** (RuntimeError) boom"),
        SessionClosedReply,
    )
    assert reply.status == "closed_abnormally"
    view = await call(
        nc, subjects.SESSIONS_GET, SessionRef(session_id=opened.session_id), SessionView
    )
    assert (view.status, view.termination_reason) == ("closed_abnormally", "** (RuntimeError) boom")
    assert view.closed_at is not None
    [_, closing] = await events_of(nc, opened.session_id)
    assert closing.type == EventType.SESSION_CLOSED_ABNORMALLY
    assert closing.payload == {"reason": "** (RuntimeError) boom"}


async def test_the_reaper_closes_a_session_whose_heartbeats_stopped(
    nc: Client, open_session: Any
) -> None:
    beating = await open_session()
    never_beat = await open_session()
    beat = await call(
        nc, subjects.SESSIONS_HEARTBEAT, SessionRef(session_id=beating.session_id), HeartbeatReply
    )
    assert beat.session_id == beating.session_id

    async def reaped() -> SessionView | None:
        view = await call(
            nc, subjects.SESSIONS_GET, SessionRef(session_id=beating.session_id), SessionView
        )
        return view if view.status != "open" else None

    view = await wait_for(reaped, what="the reaper to close the silent session")
    assert (view.status, view.termination_reason) == ("closed_abnormally", "heartbeat_timeout")
    untouched = await call(
        nc, subjects.SESSIONS_GET, SessionRef(session_id=never_beat.session_id), SessionView
    )
    assert untouched.status == "open"
    with pytest.raises(CommandFailed) as late:
        await call(
            nc,
            subjects.SESSIONS_HEARTBEAT,
            SessionRef(session_id=beating.session_id),
            HeartbeatReply,
        )
    assert late.value.code == "session_closed"


async def test_concurrent_appends_get_gap_free_unique_seqs(nc: Client, open_session: Any) -> None:
    opened = await open_session()
    replies = await asyncio.gather(
        *(append(nc, opened.session_id, "chat.message", **chat(f"m{i}")) for i in range(50))
    )
    assert sorted(r.seq for r in replies) == list(range(2, 52))
    assert [e.seq for e in await events_of(nc, opened.session_id)] == list(range(1, 52))


async def test_unknown_session_is_reported(nc: Client, log_service: Any) -> None:
    missing = uuid.uuid4()
    for subject, request in [
        (
            subjects.EVENTS_APPEND,
            AppendEvent(
                session_id=missing, type="chat.message", actor="user:ana", payload={"text": "hi"}
            ),
        ),
        (subjects.EVENTS_LIST, ListEvents(session_id=missing)),
        (subjects.SESSIONS_GET, SessionRef(session_id=missing)),
        (subjects.SESSIONS_HEARTBEAT, SessionRef(session_id=missing)),
        (subjects.SESSIONS_CLOSE, CloseSession(session_id=missing)),
    ]:
        with pytest.raises(CommandFailed) as refused:
            await call(nc, subject, request, SessionView)
        assert refused.value.code == "session_not_found", subject


async def test_malformed_requests_get_precise_errors_and_write_nothing(
    nc: Client, open_session: Any, database_url: str
) -> None:
    opened = await open_session()
    sid = str(opened.session_id)
    good = {
        "session_id": sid,
        "type": "chat.message",
        "actor": "user:ana",
        "payload": {"text": "hi"},
    }
    cases: list[tuple[bytes, str]] = [
        (b"{not json", "malformed_json"),
        (b"", "malformed_json"),
        (json.dumps({**good, "session_id": 42}).encode(), "invalid_request"),
        (json.dumps({**good, "payload": "text"}).encode(), "invalid_request"),
        (json.dumps({k: v for k, v in good.items() if k != "actor"}).encode(), "invalid_request"),
        (json.dumps({**good, "actor": "ana"}).encode(), "invalid_request"),
        (json.dumps({**good, "type": "chat.whisper"}).encode(), "unknown_event_type"),
        (
            json.dumps(
                {
                    **good,
                    "type": "agent.response",
                    "actor": "agent:criativo",
                    "payload": {"agent": "criativo", "text": "x" * 300_000},
                }
            ).encode(),
            "payload_too_large",
        ),
    ]
    for data, code in cases:
        reply = await raw_request(nc, subjects.EVENTS_APPEND, data)
        assert reply["error"]["code"] == code, (data[:80], reply)
        assert reply["error"]["message"]

    huge = json.dumps({**good, "payload": {"text": "x" * (2 * 1024 * 1024)}}).encode()
    if nc.max_payload >= len(huge):
        reply = await raw_request(nc, subjects.EVENTS_APPEND, huge)
        assert reply["error"]["code"] == "payload_too_large"
    else:  # a server with the default 1 MB limit refuses it before it reaches the service
        with pytest.raises(Exception, match=r"(?i)payload"):
            await raw_request(nc, subjects.EVENTS_APPEND, huge)

    conn = await asyncpg.connect(database_url)
    try:
        count = await conn.fetchval("SELECT count(*) FROM session_events.events")
    finally:
        await conn.close()
    assert count == 1  # only session.opened
    ok = await append(nc, opened.session_id, "chat.message", **chat())
    assert ok.seq == 2


async def test_the_service_is_discoverable_through_nats_micro(nc: Client, log_service: Any) -> None:
    ping = await raw_request(nc, "$SRV.PING.session_events", b"")
    info = await raw_request(nc, "$SRV.INFO.session_events", b"")
    stats = await raw_request(nc, "$SRV.STATS.session_events", b"")

    assert ping["name"] == "session_events"
    assert {e["subject"] for e in info["endpoints"]} == {
        subjects.SESSIONS_LIST,
        subjects.SESSIONS_FORK,
        subjects.SESSIONS_OPEN,
        subjects.SESSIONS_CLOSE,
        subjects.SESSIONS_TERMINATE,
        subjects.SESSIONS_HEARTBEAT,
        subjects.SESSIONS_GET,
        subjects.EVENTS_APPEND,
        subjects.EVENTS_APPEND_MANY,
        subjects.EVENTS_GET,
        subjects.EVENTS_LIST,
        subjects.EVENTS_QUERY,
    }
    assert stats["name"] == "session_events"


async def test_a_projects_sessions_are_listed_newest_first(nc: Client, open_session: Any) -> None:
    older = await open_session("listed")
    newer = await open_session("listed")
    await open_session("another-project")
    await call(
        nc,
        subjects.SESSIONS_TERMINATE,
        TerminateSession(session_id=older.session_id, reason="boom"),
        SessionClosedReply,
    )

    said = "Um app para padarias " + "x" * TITLE_MAX_CHARS
    await append(nc, newer.session_id, "chat.message", payload={"text": said})
    await append(nc, newer.session_id, "chat.message", payload={"text": "e entregas?"})

    reply = await call(nc, subjects.SESSIONS_LIST, ListSessions(project_id="listed"), SessionsReply)
    assert [(s.session_id, s.status, s.termination_reason) for s in reply.sessions] == [
        (newer.session_id, "open", None),
        (older.session_id, "closed_abnormally", "boom"),
    ]
    # What the list shows comes in the one reply: the first message, cut, as the title,
    # and the latest event's time as the last activity (none said: no title).
    latest = [(await events_of(nc, s.session_id))[-1] for s in reply.sessions]
    assert [(s.title, s.last_event_at) for s in reply.sessions] == [
        (said[:TITLE_MAX_CHARS], latest[0].created_at),
        (None, latest[1].created_at),
    ]
    assert latest[1].type == "session.closed_abnormally"


async def test_values_postgres_cannot_keep_are_refused_naming_the_field(
    nc: Client, open_session: Any, database_url: str
) -> None:
    opened = await open_session()
    sid = str(opened.session_id)
    good = {
        "session_id": sid,
        "type": "chat.message",
        "actor": "user:ana",
        "payload": {"text": "hi"},
    }
    cases: list[tuple[str, dict[str, Any], str]] = [
        (subjects.EVENTS_APPEND, {**good, "payload": {"text": "a\u0000b"}}, "payload"),
        (subjects.EVENTS_APPEND, {**good, "idempotency_key": "k\u0000"}, "idempotency_key"),
        (subjects.EVENTS_APPEND, {**good, "type": "chat.message\u0000"}, "type"),
        (subjects.SESSIONS_TERMINATE, {"session_id": sid, "reason": "gone\u0000"}, "reason"),
        (subjects.EVENTS_LIST, {"session_id": sid, "after_seq": 2**63}, "after_seq"),
        (subjects.SESSIONS_OPEN, {"project_id": "p\u0000", "opened_by": "user:ana"}, "project_id"),
    ]
    for subject, request, field in cases:
        reply = await raw_request(nc, subject, json.dumps(request).encode())
        assert reply["error"]["code"] == "invalid_request", (subject, request, reply)
        assert f"{field}:" in reply["error"]["message"], reply

    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch("SELECT status FROM session_events.sessions")
        count = await conn.fetchval("SELECT count(*) FROM session_events.events")
    finally:
        await conn.close()
    assert [r["status"] for r in rows] == ["open"]
    assert count == 1  # only session.opened
