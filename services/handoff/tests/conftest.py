"""Fixtures: the log and the handoff service in-process, and a small driver for tests."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import asyncpg
import pytest_asyncio
from nats.aio.client import Client

from contracts import subjects
from contracts.events import Event
from contracts.handoff import OfferHandoff, OfferReply
from contracts.session_events import (
    AppendedReply,
    AppendEvent,
    CloseSession,
    OpenSession,
    SessionClosedReply,
    SessionOpenedReply,
)
from handoff.app import main as handoff_main
from servicekit.client import call
from servicekit.settings import ServiceSettings
from session_events.app import main as log_main
from session_events.settings import LogSettings
from testkit.probes import log_events, outbox_drained
from testkit.services import running_service


@dataclass
class Driver:
    """What a test does to the system, by name."""

    nc: Client
    db: asyncpg.Pool
    project: str

    async def open(self, project: str | None = None) -> uuid.UUID:
        reply = await call(
            self.nc,
            subjects.SESSIONS_OPEN,
            OpenSession(project_id=project or self.project, opened_by="user:ana"),
            SessionOpenedReply,
        )
        return reply.session_id

    async def close(self, session_id: uuid.UUID) -> None:
        await call(
            self.nc,
            subjects.SESSIONS_CLOSE,
            CloseSession(session_id=session_id),
            SessionClosedReply,
        )

    async def artifact(self, session_id: uuid.UUID, text: str = "a brief") -> uuid.UUID:
        """An event of the log to carry as an offer's artifact."""
        reply = await call(
            self.nc,
            subjects.EVENTS_APPEND,
            AppendEvent(
                session_id=session_id, type="chat.message", actor="user:ana", payload={"text": text}
            ),
            AppendedReply,
        )
        return reply.event_id

    async def offer(
        self,
        session_id: uuid.UUID,
        to: str = "po",
        artifact: uuid.UUID | None = None,
        **fields: Any,
    ) -> OfferReply:
        return await call(
            self.nc,
            subjects.HANDOFFS_OFFER,
            OfferHandoff(
                project_id=fields.pop("project", self.project),
                session_id=session_id,
                from_agent=fields.pop("src", "criativo"),
                to_agent=to,
                artifact_id=artifact,
                **fields,
            ),
            OfferReply,
        )

    async def settled(self) -> None:
        """Wait until every event the handoff service committed reached the log."""
        await outbox_drained(self.db, "handoff")

    async def events(self, session_id: uuid.UUID, prefix: str = "") -> list[Event]:
        """The session's events (after the outbox drained), optionally of one type prefix."""
        await self.settled()
        return await log_events(self.nc, session_id, prefix)

    async def rows(self, to: str = "po") -> list[asyncpg.Record]:
        return await self.db.fetch(
            "SELECT * FROM handoff.handoffs WHERE project_id = $1 AND to_agent = $2 "
            "ORDER BY created_at, id",
            self.project,
            to,
        )


def offered_id(reply: OfferReply) -> uuid.UUID:
    """The id of the offer a reply names (every reply but an `if_absent` skip names one)."""
    assert reply.handoff is not None, reply
    return reply.handoff.id


@pytest_asyncio.fixture(loop_scope="session")
async def services(nats_url: str, database_url: str, nc: Client) -> AsyncIterator[None]:
    """session_events and handoff, in this process."""
    fast: dict[str, Any] = {
        "nats_url": nats_url,
        "database_url": database_url,
        "outbox_poll_seconds": 0.2,
    }
    async with (
        running_service(log_main(LogSettings(**fast)), nc, "session_events"),
        running_service(handoff_main(ServiceSettings(**fast)), nc, "handoff"),
    ):
        yield


@pytest_asyncio.fixture(loop_scope="session")
async def bus(services: None, nc: Client, database_url: str) -> AsyncIterator[Driver]:
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=4)
    assert pool is not None
    yield Driver(nc, pool, f"p-{uuid.uuid4().hex[:8]}")
    await pool.close()
