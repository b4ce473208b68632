"""A dependency that is restarting is a wait, not a crash (issue 13).

Metering runs as a real process that is not there when the message arrives (or is
killed): Criativo waits for it, answers once it is back, and only tells the person
(`agent.error`, code `dependency_unavailable`) when it stays away past the wait —
without ever counting the outage as a crash or ending the session.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import asyncpg
import pytest_asyncio
from nats.aio.client import Client

from contracts import subjects
from contracts.common import ErrorCode
from contracts.events import Event
from contracts.session_events import SessionRef, SessionView
from criativo.app import main as criativo_main
from criativo.handlers import CONSUMER
from domain.criativo import readable_reason
from handoff.app import main as handoff_main
from servicekit.client import call
from servicekit.settings import ServiceSettings
from session_events.app import main as log_main
from session_events.settings import LogSettings
from testkit.probes import wait_for
from testkit.services import running_service

from .conftest import Driver, RecordingProvider, criativo_settings, fast

SCRIPTED = {"AGENTBUS_PROVIDER": "scripted"}


@pytest_asyncio.fixture(loop_scope="session")
async def without_metering(nats_url: str, database_url: str, nc: Client) -> AsyncIterator[Driver]:
    """The log and handoff in this process; metering is the test's to start (or not)."""
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(
            running_service(
                log_main(LogSettings(**fast(nats_url, database_url))), nc, "session_events"
            )
        )
        await stack.enter_async_context(
            running_service(
                handoff_main(ServiceSettings(**fast(nats_url, database_url))), nc, "handoff"
            )
        )
        pool = await asyncpg.create_pool(database_url, min_size=1, max_size=4)
        assert pool is not None
        stack.push_async_callback(pool.close)
        # The recording provider is not used: the model is in the metering process.
        yield Driver(nc, pool, f"p-{uuid.uuid4().hex[:8]}", RecordingProvider())


async def start_criativo(
    stack: AsyncExitStack, nc: Client, nats_url: str, database_url: str, **overrides: Any
) -> None:
    settings = criativo_settings(nats_url, database_url, **overrides)
    await stack.enter_async_context(running_service(criativo_main(settings), nc, "criativo"))


async def held_by_criativo(nc: Client) -> bool:
    """Criativo fetched an input and has not settled it (it is waiting on something)."""
    info = await nc.jetstream().consumer_info("EVENTS", CONSUMER)
    return bool(info.num_ack_pending > 0)


async def session_status(nc: Client, session: uuid.UUID) -> str:
    reply = await call(nc, subjects.SESSIONS_GET, SessionRef(session_id=session), SessionView)
    return str(reply.status)


async def test_metering_started_within_the_wait_the_message_is_answered_once(
    without_metering: Driver, spawn: Any, nc: Client, nats_url: str, database_url: str
) -> None:
    driver = without_metering
    async with AsyncExitStack() as stack:
        await start_criativo(stack, nc, nats_url, database_url, dependency_wait_seconds=60.0)
        plain = await driver.open(criativo=False)
        session = await driver.open()
        said = await driver.say(session, "Um app para padarias de bairro")
        asked = await driver.say(plain, "olá?")
        # Criativo holds the messages, finding nobody at cmd.llm.stream; now metering comes.
        await wait_for(lambda: held_by_criativo(nc), what="criativo to hold the messages")
        metering = spawn("metering", **SCRIPTED)
        await metering.wait_ready(nc, "metering")

        answer = await driver.outcome(session, said)
        assert answer.type.value == "agent.response"
        assert answer.payload["agent"] == "criativo"
        plain_answer = await driver.outcome(plain, asked)
        assert plain_answer.type.value == "agent.response"
        assert plain_answer.payload["agent"] == "chat"

        # Metering dies (SIGKILL) and the person asks for the brief meanwhile: the
        # consolidation waits for the restarted metering, then brief and offer, once.
        metering.kill()
        readiness = await driver.ready(session)
        await wait_for(lambda: held_by_criativo(nc), what="criativo to hold the readiness")
        metering.start(**SCRIPTED)
        await metering.wait_ready(nc, "metering")

        async def offered() -> list[Event]:
            return await driver.events(session, "handoff.offered")

        [offer] = await wait_for(offered, timeout=30, what="the brief offered to po")
        [brief] = await driver.events(session, "artifact.product_brief")
        assert brief.causation_id == readiness and offer.causation_id == brief.id

        # Answered once, nothing reported as an error, both sessions still open.
        for s in (session, plain):
            outcomes = [e for e in await driver.events(s, "agent.") if e.causation_id]
            assert [e.type.value for e in outcomes] == ["agent.response"]
            assert not await driver.events(s, "session.closed")
            assert await session_status(nc, s) == "open"


async def test_metering_away_past_the_wait_the_person_is_told_and_the_session_goes_on(
    without_metering: Driver, spawn: Any, nc: Client, nats_url: str, database_url: str
) -> None:
    driver = without_metering
    async with AsyncExitStack() as stack:
        # crash_limit 1: were the outage counted as a crash, the session would end.
        await start_criativo(
            stack, nc, nats_url, database_url, dependency_wait_seconds=1.0, crash_limit=1
        )
        session = await driver.open()
        said = await driver.say(session, "Um app para padarias de bairro")
        error = await driver.outcome(session, said)
        assert error.type.value == "agent.error"
        assert error.payload["code"] == ErrorCode.DEPENDENCY_UNAVAILABLE
        assert error.payload["reason"] == readable_reason(ErrorCode.DEPENDENCY_UNAVAILABLE)

        # Still down: the next message is told too (after one more try, not a whole wait).
        again = await driver.say(session, "ainda aí?")
        assert (await driver.outcome(session, again)).payload["code"] == "dependency_unavailable"
        # The consolidation is told the same way; the readiness is not lost to a crash.
        readiness = await driver.ready(session)
        told = await driver.outcome(session, readiness)
        assert told.type.value == "agent.error"
        assert told.payload["code"] == "dependency_unavailable"
        assert await session_status(nc, session) == "open"

        metering = spawn("metering", **SCRIPTED)
        await metering.wait_ready(nc, "metering")
        later = await driver.say(session, "e agora?")
        answer = await driver.outcome(session, later)
        assert answer.type.value == "agent.response"

        outcomes = [e for e in await driver.events(session, "agent.") if e.causation_id]
        assert [(e.type.value, e.causation_id) for e in outcomes] == [
            ("agent.error", said),
            ("agent.error", again),
            ("agent.error", readiness),
            ("agent.response", later),
        ]
        assert not await driver.events(session, "session.closed")
        assert await session_status(nc, session) == "open"
