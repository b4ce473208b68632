"""Issue 11 item 2: the psychologist spends money only on a closing the log confirms.

Forged `session.closed` events of a valid shape are published straight onto JetStream's
EVENTS subjects; they are acked and ignored (no analysis, no model call, no usage
billed), the service keeps answering, and a real closing after them is still analysed.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import asyncpg
from nats.aio.client import Client

from contracts import streams, subjects
from contracts.events import Event, EventType
from contracts.psychologist import HypothesesReply, ListHypotheses
from psychologist.handlers import CONSUMER
from servicekit import provenance
from servicekit.client import call
from servicekit.testing import wait_for

from .conftest import Driver


def forged_closing(project: str, session_id: uuid.UUID, **fields: object) -> Event:
    return Event.model_validate(
        {
            "id": uuid.uuid4(),
            "session_id": session_id,
            "project_id": project,
            "seq": 7,
            "type": EventType.SESSION_CLOSED,
            "actor": "user:mallory",
            "payload": {"closed_by": "user:mallory"},
            "created_at": datetime.now(UTC),
            **fields,
        }
    )


async def forgeries_acked(nc: Client, db: asyncpg.Pool) -> None:
    """Every forgery acked (nothing pending, nothing redelivered), none dead-lettered."""

    async def settled() -> bool:
        info = await nc.jetstream().consumer_info(streams.EVENTS.name, CONSUMER)
        return bool(info.num_ack_pending == 0 and info.num_redelivered == 0)

    await wait_for(settled, what="the forgeries acked")
    assert await db.fetchval("SELECT count(*) FROM psychologist.dead_letters") == 0


async def publish(nc: Client, event: Event) -> None:
    subject = f"{event.type.value}.{event.project_id}.{event.session_id}"
    # A forger picks its own message id, so the stream's dedup of real ids does not stop it.
    headers = {"Nats-Msg-Id": f"forged-{uuid.uuid4()}"}
    await nc.jetstream().publish(subject, event.model_dump_json().encode(), headers=headers)


async def test_forged_closings_are_ignored_and_a_real_one_is_still_analysed(bus: Driver) -> None:
    s = await bus.session_with(3)  # still open
    opened = (await bus.events(s))[0]
    ignored = sum(provenance.FORGED_EVENTS.values())
    forgeries = [
        forged_closing(bus.project, s),  # the session is still open
        forged_closing(bus.project, uuid.uuid4()),  # no such session
        # a real event's id and session, retyped as a closing by another actor
        forged_closing(bus.project, s, id=opened.id, seq=1),
        forged_closing(bus.project, s, id=opened.id, seq=1, actor=opened.actor),
    ]

    for event in forgeries:
        await publish(bus.nc, event)

    await wait_for(
        lambda: sum(provenance.FORGED_EVENTS.values()) >= ignored + len(forgeries),
        what="every forgery ignored",
    )
    await forgeries_acked(bus.nc, bus.db)
    assert bus.provider.requests == []
    assert (await bus.usage()).total_calls == 0
    assert await bus.analyses(s) == []
    assert [e.type for e in await bus.events(s)] == [EventType.SESSION_OPENED] + [
        EventType.CHAT_MESSAGE
    ] * 3
    listed = await call(
        bus.nc, subjects.HYPOTHESES_LIST, ListHypotheses(project_id=bus.project), HypothesesReply
    )
    assert listed.groups == []  # and the service still answers

    await bus.close(s)

    completed = await bus.outcome(s)
    assert completed.type == EventType.ANALYSIS_COMPLETED
    assert len(await bus.analyses(s)) == 1
    assert bus.provider.requests != []
