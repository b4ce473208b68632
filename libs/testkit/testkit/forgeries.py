"""Forgeries: events published straight onto the bus, never committed by the log, to prove
a consumer acts only on what the log committed."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import asyncpg
from nats.aio.client import Client

from contracts import streams, subjects
from contracts.events import Event, EventType
from testkit.probes import wait_for


def forged_closing(project: str, session_id: uuid.UUID, **fields: object) -> Event:
    """A `session.closed` of valid shape that the log never committed (override any field)."""
    return Event.model_validate(
        {
            "id": uuid.uuid4(),
            "session_id": session_id,
            "project_id": project,
            "seq": 99,
            "type": EventType.SESSION_CLOSED,
            "actor": "user:mallory",
            "payload": {"closed_by": "user:mallory"},
            "created_at": datetime.now(UTC),
            **fields,
        }
    )


async def publish_forged(nc: Client, event: Event) -> None:
    """Publish `event` where the log publishes its events, as any client of the bus could."""
    subject = subjects.event_subject(event.type, event.project_id, event.session_id)
    # A forger picks its own message id, so the stream's dedup of real ids does not stop it.
    headers = {"Nats-Msg-Id": f"forged-{uuid.uuid4()}"}
    await nc.jetstream().publish(subject, event.model_dump_json().encode(), headers=headers)


async def forgeries_acked(nc: Client, db: asyncpg.Pool, consumer: str, schema: str) -> None:
    """Every forgery acked by `consumer` (nothing pending or redelivered), none dead-lettered."""

    async def settled() -> bool:
        info = await nc.jetstream().consumer_info(streams.EVENTS.name, consumer)
        return bool(info.num_ack_pending == 0 and info.num_redelivered == 0)

    await wait_for(settled, what="the forgeries acked")
    # The schema is the test's own service's, a constant of the test, never input.
    assert await db.fetchval(f"SELECT count(*) FROM {schema}.dead_letters") == 0
