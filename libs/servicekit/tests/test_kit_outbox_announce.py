"""Events a service announces in the session log through its outbox: each payload is
checked against its type's contract and the log's size rule once, before anything
commits, and the row carries the payload as it was serialised for that check."""

from __future__ import annotations

import uuid

import asyncpg
import pytest

from contracts import subjects
from contracts.common import ErrorCode, Message
from contracts.events import AgentError, AgentResponse, ChatMessage, HandoffOffered, SessionClosed
from contracts.session_events import MAX_EVENT_PAYLOAD_BYTES, AppendEnvelope, AppendEvent
from domain.errors import DomainError
from servicekit.consumer import claim_once
from servicekit.outbox import Announcement, Outbox

SESSION = uuid.UUID("00000000-0000-4000-8000-0000000000a1")
HANDOFF = uuid.UUID("00000000-0000-4000-8000-0000000000a2")


def envelope(type_: str) -> AppendEnvelope:
    return AppendEnvelope(
        session_id=SESSION, type=type_, actor="agent:criativo", idempotency_key="k-1"
    )


async def queued(pool: asyncpg.Pool) -> list[asyncpg.Record]:
    return await pool.fetch("SELECT subject, msg_id, body, ordering_key FROM outbox ORDER BY id")


async def test_an_announcement_is_queued_as_the_append_the_log_takes(pool: asyncpg.Pool) -> None:
    payload = HandoffOffered(handoff_id=HANDOFF, from_agent="criativo", to_agent="po")
    async with pool.acquire() as conn, conn.transaction():
        await Outbox(conn).append(Announcement(envelope("handoff.offered"), payload))

    [row] = await queued(pool)
    assert (row["subject"], row["msg_id"], row["ordering_key"]) == (
        subjects.EVENTS_APPEND,
        "k-1",
        str(SESSION),
    )
    assert AppendEvent.model_validate_json(row["body"]) == AppendEvent(
        **envelope("handoff.offered").model_dump(), payload=payload.model_dump(mode="json")
    )


async def test_an_append_event_is_queued_with_its_payload_as_its_contract_parses_it(
    pool: asyncpg.Pool,
) -> None:
    # Parsed once by its contract, and written as that parse serialises: the bytes whose
    # size was checked, which are what the log keeps (a NonBlank reason is stripped).
    event = AppendEvent(
        session_id=SESSION,
        type="agent.error",
        actor="agent:criativo",
        payload={"agent": "criativo", "code": "timeout", "reason": "  the model timed out "},
        idempotency_key="k-2",
    )
    async with pool.acquire() as conn:
        await Outbox(conn).append(event)

    [row] = await queued(pool)
    written = AppendEvent.model_validate_json(row["body"])
    assert written.payload == AgentError(
        agent="criativo", code="timeout", reason="the model timed out"
    ).model_dump(mode="json")
    assert written.model_dump(exclude={"payload"}) == event.model_dump(exclude={"payload"})


def agent_response(size_bytes: int) -> AgentResponse:
    """An agent.response whose payload serialises to `size_bytes` of UTF-8, counted in
    bytes and not characters (each "é" is two)."""
    room = size_bytes - len(AgentResponse(agent="criativo", text="").model_dump_json().encode())
    return AgentResponse(agent="criativo", text="é" * (room // 2) + "x" * (room % 2))


async def test_the_size_checked_is_that_of_the_payload_written(pool: asyncpg.Pool) -> None:
    at_limit = agent_response(MAX_EVENT_PAYLOAD_BYTES)
    over = agent_response(MAX_EVENT_PAYLOAD_BYTES + 1)

    async with pool.acquire() as conn:
        await Outbox(conn).append(Announcement(envelope("agent.response"), at_limit))
        with pytest.raises(DomainError) as refusal:
            await Outbox(conn).append(Announcement(envelope("agent.response"), over))

    assert refusal.value.code == ErrorCode.PAYLOAD_TOO_LARGE
    assert refusal.value.details["size_bytes"] == MAX_EVENT_PAYLOAD_BYTES + 1
    [row] = await queued(pool)
    payload = AppendEvent.model_validate_json(row["body"]).payload
    assert AgentResponse.model_validate(payload) == at_limit


@pytest.mark.parametrize(
    ("type_", "payload", "code"),
    [
        (
            "handoff.accepted",
            HandoffOffered(handoff_id=HANDOFF, from_agent="criativo", to_agent="po"),
            ErrorCode.INVALID_PAYLOAD,
        ),
        ("no.such_type", ChatMessage(text="hi"), ErrorCode.UNKNOWN_EVENT_TYPE),
        ("session.closed", SessionClosed(), ErrorCode.RESERVED_EVENT_TYPE),
        (
            "agent.response",
            AgentResponse(agent="criativo", text="x" * MAX_EVENT_PAYLOAD_BYTES),
            ErrorCode.PAYLOAD_TOO_LARGE,
        ),
    ],
    ids=["another-types-model", "unknown-type", "reserved-type", "oversized"],
)
async def test_an_announcement_the_log_would_refuse_is_refused_before_anything_commits(
    pool: asyncpg.Pool, type_: str, payload: Message, code: str
) -> None:
    with pytest.raises(DomainError) as refusal:
        async with pool.acquire() as conn, conn.transaction():
            await claim_once(conn, "kit-tests", "the-effect")
            await Outbox(conn).append(Announcement(envelope(type_), payload))

    assert refusal.value.code == code
    assert await queued(pool) == []
    assert await pool.fetchval("SELECT count(*) FROM processed_messages") == 0  # rolled back
