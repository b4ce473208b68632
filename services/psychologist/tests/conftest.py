"""Fixtures: the log, metering (scripted provider) and the psychologist in-process, and a
small driver for tests."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import asyncpg
import pytest
import pytest_asyncio
from nats.aio.client import Client

from contracts import subjects
from contracts.events import Event, EventType
from contracts.metering import UsageSummaryReply, UsageSummaryRequest
from contracts.psychologist import (
    AnalysisOutcome,
    HypothesesReply,
    ListHypotheses,
    Reanalyze,
)
from contracts.session_events import (
    AppendedReply,
    AppendEvent,
    CloseSession,
    EventsReply,
    ListEvents,
    OpenSession,
    SessionClosedReply,
    SessionOpenedReply,
    TerminateSession,
)
from metering.providers.base import OnText, Progress, ProviderReply, ProviderRequest
from metering.providers.scripted import DEFAULT_SCRIPT, Script, ScriptedProvider
from psychologist.app import main as psychologist_main
from psychologist.settings import PsychologistSettings
from servicekit.client import call
from session_events.app import main as log_main
from session_events.settings import LogSettings
from testkit.metering import Metering, Starter
from testkit.probes import log_events, outbox_drained, wait_for
from testkit.services import running_service

FINISHED = (EventType.ANALYSIS_COMPLETED.value, EventType.ANALYSIS_FAILED.value)


class RecordingProvider(ScriptedProvider):
    """The scripted provider, keeping every request it answered (what the model read)."""

    def __init__(self, script: Script) -> None:
        super().__init__(script)
        self.requests: list[ProviderRequest] = []

    async def complete(
        self, request: ProviderRequest, progress: Progress, on_text: OnText | None
    ) -> ProviderReply:
        self.requests.append(request)
        return await super().complete(request, progress, on_text)


@dataclass
class LogDriver:
    """What a test does to the system, by name, through the log and the psychologist."""

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

    async def say(self, session_id: uuid.UUID, text: str = "Quero um app de receitas") -> uuid.UUID:
        reply = await call(
            self.nc,
            subjects.EVENTS_APPEND,
            AppendEvent(
                session_id=session_id, type="chat.message", actor="user:ana", payload={"text": text}
            ),
            AppendedReply,
        )
        return reply.event_id

    async def session_with(self, messages: int, project: str | None = None) -> uuid.UUID:
        """An open session of `messages` chat messages (plus its `session.opened`)."""
        session_id = await self.open(project)
        for i in range(messages):
            await self.say(session_id, f"mensagem {i}")
        return session_id

    async def close(self, session_id: uuid.UUID) -> None:
        await call(
            self.nc,
            subjects.SESSIONS_CLOSE,
            CloseSession(session_id=session_id, closed_by="user:ana"),
            SessionClosedReply,
        )

    async def terminate(self, session_id: uuid.UUID, reason: str) -> None:
        await call(
            self.nc,
            subjects.SESSIONS_TERMINATE,
            TerminateSession(session_id=session_id, reason=reason),
            SessionClosedReply,
        )

    async def settled(self) -> None:
        """Wait until every event the psychologist service committed reached the log."""
        await outbox_drained(self.db, "psychologist")

    async def events(self, session_id: uuid.UUID, prefix: str = "") -> list[Event]:
        await self.settled()
        return await log_events(self.nc, session_id, prefix)

    async def outcome(self, session_id: uuid.UUID, count: int = 1, timeout: float = 30) -> Event:
        """The `count`-th analysis outcome event of the session, once it is in the log."""

        async def finished() -> list[Event]:
            reply = await call(
                self.nc, subjects.EVENTS_LIST, ListEvents(session_id=session_id), EventsReply
            )
            done = [e for e in reply.events if e.type.value in FINISHED]
            return done if len(done) >= count else []

        done = await wait_for(finished, timeout=timeout, what=f"analysis of {session_id}")
        result: Event = done[count - 1]
        return result

    async def analyses(self, session_id: uuid.UUID) -> list[asyncpg.Record]:
        return await self.db.fetch(
            "SELECT * FROM psychologist.psychologist_analyses WHERE session_id = $1 "
            "ORDER BY created_at",
            session_id,
        )

    async def hypotheses(self, session_id: uuid.UUID) -> list[asyncpg.Record]:
        return await self.db.fetch(
            "SELECT * FROM psychologist.psychologist_hypotheses WHERE session_id = $1 "
            "ORDER BY created_at, position",
            session_id,
        )

    async def reanalyze(self, session_id: uuid.UUID, project: str | None = None) -> AnalysisOutcome:
        return await call(
            self.nc,
            subjects.PSYCHOLOGIST_REANALYZE,
            Reanalyze(project_id=project or self.project, session_id=session_id),
            AnalysisOutcome,
            timeout=30,
        )

    async def listed(self, **fields: Any) -> HypothesesReply:
        return await call(
            self.nc,
            subjects.HYPOTHESES_LIST,
            ListHypotheses(project_id=self.project, **fields),
            HypothesesReply,
        )

    async def usage(self, **filters: Any) -> UsageSummaryReply:
        return await call(
            self.nc,
            subjects.USAGE_SUMMARY,
            UsageSummaryRequest(group_by=["agent", "model"], project_id=self.project, **filters),
            UsageSummaryReply,
        )


@dataclass
class Driver(LogDriver):
    """The same, with the model and the metering replica the fixtures started."""

    provider: RecordingProvider
    metering: Metering


@pytest.fixture
def heartbeat_timeout() -> float:
    """How long the log waits for a heartbeat before reaping a session (long by default)."""
    return 60.0


@pytest.fixture
def provider() -> RecordingProvider:
    """The model every test talks to: the offline demo's script unless a test sets one."""
    return RecordingProvider(DEFAULT_SCRIPT.model_copy(update={"token_delay_ms": 0.0}))


@pytest_asyncio.fixture(loop_scope="session")
async def backing(
    nats_url: str,
    database_url: str,
    nc: Client,
    start_metering: Starter,
    provider: RecordingProvider,
    heartbeat_timeout: float,
) -> AsyncIterator[Metering]:
    """session_events and metering, in this process."""
    settings = LogSettings(
        nats_url=nats_url,
        database_url=database_url,
        outbox_poll_seconds=0.2,
        heartbeat_timeout_seconds=heartbeat_timeout,
        reaper_interval_seconds=0.2,
    )
    async with running_service(log_main(settings), nc, "session_events"):
        yield await start_metering(provider=provider)


def psychologist_settings(
    nats_url: str, database_url: str, **overrides: Any
) -> PsychologistSettings:
    return PsychologistSettings(
        nats_url=nats_url,
        database_url=database_url,
        outbox_poll_seconds=0.2,
        redelivery_backoff=[1.0, 2.0, 2.0, 2.0],
        **overrides,
    )


@pytest_asyncio.fixture(loop_scope="session")
async def psychologist(
    backing: Metering, nats_url: str, database_url: str, nc: Client
) -> AsyncIterator[None]:
    """The psychologist service, in this process."""
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(
            running_service(
                psychologist_main(psychologist_settings(nats_url, database_url)),
                nc,
                "psychologist",
            )
        )
        yield


async def _driver(
    nc: Client, database_url: str, provider: RecordingProvider, metering: Metering
) -> tuple[Driver, asyncpg.Pool]:
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=4)
    assert pool is not None
    return Driver(nc, pool, f"p-{uuid.uuid4().hex[:8]}", provider, metering), pool


@pytest_asyncio.fixture(loop_scope="session")
async def bus(
    psychologist: None,
    backing: Metering,
    nc: Client,
    database_url: str,
    provider: RecordingProvider,
) -> AsyncIterator[Driver]:
    """A driver with every service running in this process."""
    driver, pool = await _driver(nc, database_url, provider, backing)
    yield driver
    await pool.close()


@pytest_asyncio.fixture(loop_scope="session")
async def bare(
    backing: Metering, nc: Client, database_url: str, provider: RecordingProvider
) -> AsyncIterator[Driver]:
    """A driver with the log and metering only: the test starts the psychologist itself."""
    driver, pool = await _driver(nc, database_url, provider, backing)
    yield driver
    await pool.close()
