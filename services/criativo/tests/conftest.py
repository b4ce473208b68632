"""Fixtures: the log, handoff, metering (scripted) and Criativo in-process, and a driver."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field, replace
from typing import Any

import asyncpg
import pytest_asyncio
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from contracts import streams, subjects
from contracts.common import ErrorCode
from contracts.criativo import AgentDone
from contracts.events import Event
from contracts.handoff import ActivateAgent, ActivationReply
from contracts.metering import TurnDelta
from contracts.session_events import (
    AppendedReply,
    AppendEvent,
    OpenSession,
    SessionOpenedReply,
)
from criativo.app import main as criativo_main
from criativo.settings import CriativoSettings
from handoff.app import main as handoff_main
from metering.providers.base import (
    OnText,
    Progress,
    ProviderError,
    ProviderReply,
    ProviderRequest,
)
from metering.providers.scripted import (
    UUID_PATTERN,
    Script,
    ScriptedProvider,
    ScriptedToolCall,
    ScriptStep,
)
from servicekit.bus import provision_buckets
from servicekit.client import call
from servicekit.settings import ServiceSettings
from session_events.app import main as log_main
from session_events.settings import LogSettings
from testkit.metering import Metering, Starter
from testkit.probes import log_events, subscribed, wait_for
from testkit.services import running_service

WORDS = " ".join(f"palavra{i}" for i in range(15))

# The offline demo's Criativo steps, plus the misbehaviours tests ask for by keyword.
CRIATIVO_SCRIPT = Script(
    steps=[
        # a reply the log refuses (> 256 KiB): Criativo crashes on it every time
        ScriptStep(contains="HUGE", text="x" * 300_000),
        ScriptStep(
            contains="EMIT-BRIEF",
            has_tool="emit_artifact",
            text="Vou registrar o brief.",
            tool_calls=[
                ScriptedToolCall(
                    name="emit_artifact",
                    input={"type": "product_brief", "title": "B", "summary": "s"},
                )
            ],
        ),
        ScriptStep(
            has_tool="emit_artifact",
            after_tool_error=True,
            text="Certo: o brief só existe depois da sua confirmação.",
        ),
        ScriptStep(contains="SLOW", text=WORDS, token_delay_ms=20),
        ScriptStep(contains="KILLME", text=" ".join(f"w{i}" for i in range(60)), token_delay_ms=50),
        ScriptStep(contains="product_brief", responder="criativo_brief"),
        ScriptStep(has_tool="emit_artifact", after_tool_result=False, responder="criativo_rule"),
        ScriptStep(has_tool="emit_artifact", text="Anotei essa regra. O que mais é importante?"),
        ScriptStep(responder="echo", token_delay_ms=2),
    ]
)


# The issue 10 case: a message saying "RULE: …" is a rule the model records, slowly
# enough for the person to type again meanwhile; one rule per such message it reads
# in the last user turn (so a prompt that merges two messages records one twice).
RULE_TEXT = re.compile(r"\[message ([0-9a-f-]{36})\]\nRULE: ([^\n]*)")
RULE_WORDS = " ".join(f"regra{i}" for i in range(20))


def rule_step(request: ProviderRequest) -> ScriptStep | None:
    """The step answering a message that states a RULE, if this request is one."""
    last = request.messages[-1]
    if not isinstance(last.content, str) or not any(
        t.name == "emit_artifact" for t in request.tools
    ):
        return None
    found = RULE_TEXT.findall(last.content)
    if not found:
        return None
    calls = [
        ScriptedToolCall(
            name="emit_artifact",
            input={"type": "business_rule", "title": rule[:40], "statement": rule, "origin": [mid]},
        )
        for mid, rule in found
    ]
    return ScriptStep(text=RULE_WORDS, tool_calls=calls, token_delay_ms=30)


def _answering(request: ProviderRequest) -> str:
    """The message being answered: the last user turn written as text."""
    texts = [m.content for m in request.messages if m.role == "user" and isinstance(m.content, str)]
    return texts[-1] if texts else ""


def _rule_for(request: ProviderRequest) -> ScriptedToolCall:
    mid = UUID_PATTERN.findall(_answering(request))[-1]
    rule = {"type": "business_rule", "title": "Parte", "statement": "parte", "origin": [mid]}
    return ScriptedToolCall(name="emit_artifact", input=rule)


def stop_step(request: ProviderRequest) -> ScriptStep | None:
    """STOP-LATER: a first call that records a rule, then a second call the person stops
    (metering replies `cancelled` with the text so far, and a tool call it cut)."""
    if "STOP-LATER" not in _answering(request):
        return None
    if isinstance(request.messages[-1].content, str):
        return ScriptStep(text="Primeira parte.", tool_calls=[_rule_for(request)])
    return ScriptStep(
        text="Segunda parte, interrom", tool_calls=[_rule_for(request)], stop_reason="cancelled"
    )


class RecordingProvider(ScriptedProvider):
    """The scripted provider, keeping every request it was asked (what the model read)."""

    def __init__(self) -> None:
        super().__init__(CRIATIVO_SCRIPT)
        self.requests: list[ProviderRequest] = []
        # The next calls that fail as a provider does after its own retries.
        self.failures = 0

    async def complete(
        self, request: ProviderRequest, progress: Progress, on_text: OnText | None
    ) -> ProviderReply:
        self.requests.append(request)
        if self.failures > 0:
            self.failures -= 1
            raise ProviderError(ErrorCode.PROVIDER_ERROR, "the provider failed after retries")
        step = rule_step(request) or stop_step(request)
        if step is not None:
            self.calls += 1
            once = ScriptedProvider(Script(steps=[step]))
            once.calls = self.calls  # tool_use ids stay unique across calls
            return await once.complete(request, progress, on_text)
        return await super().complete(request, progress, on_text)


@dataclass
class Watch:
    """Deltas and turn ends seen on one session's subjects, in arrival order."""

    deltas: list[tuple[float, TurnDelta]] = field(default_factory=list)
    dones: list[AgentDone] = field(default_factory=list)


@dataclass
class Driver:
    """What a test does to the system, by name."""

    nc: Client
    db: asyncpg.Pool
    project: str
    provider: RecordingProvider

    async def open(self, criativo: bool = True) -> uuid.UUID:
        reply = await call(
            self.nc,
            subjects.SESSIONS_OPEN,
            OpenSession(project_id=self.project, opened_by="user:ana"),
            SessionOpenedReply,
        )
        if criativo:
            await self.start_criativo(reply.session_id)
        return reply.session_id

    async def start_criativo(self, session_id: uuid.UUID) -> None:
        await call(
            self.nc,
            subjects.AGENTS_ACTIVATE,
            ActivateAgent(
                project_id=self.project,
                session_id=session_id,
                agent="criativo",
                via="user",
                actor="user:ana",
            ),
            ActivationReply,
        )
        # The activation reaches the log through handoff's outbox; the log decides
        # which chat path a message takes, so wait until it is there.
        await wait_for(
            lambda: self.events(session_id, "agent.activated"), what="agent.activated in the log"
        )

    async def append(self, session_id: uuid.UUID, kind: str, **payload: Any) -> uuid.UUID:
        reply = await call(
            self.nc,
            subjects.EVENTS_APPEND,
            AppendEvent(session_id=session_id, type=kind, actor="user:ana", payload=payload),
            AppendedReply,
        )
        return reply.event_id

    async def say(self, session_id: uuid.UUID, text: str) -> uuid.UUID:
        return await self.append(session_id, "chat.message", text=text)

    async def ready(self, session_id: uuid.UUID) -> uuid.UUID:
        return await self.append(session_id, "criativo.readiness_confirmed")

    async def events(self, session_id: uuid.UUID, prefix: str = "") -> list[Event]:
        return await log_events(self.nc, session_id, prefix)

    async def outcome(self, session_id: uuid.UUID, message_id: uuid.UUID) -> Event:
        """The `agent.response` or `agent.error` caused by the message, once it exists."""

        async def probe() -> Event | None:
            for e in await self.events(session_id, "agent."):
                if e.causation_id == message_id and e.type.value != "agent.activated":
                    return e
            return None

        found: Event = await wait_for(probe, timeout=30, what=f"an answer to {message_id}")
        return found

    async def watch(self, session_id: uuid.UUID) -> Watch:
        seen = Watch()
        loop = asyncio.get_running_loop()

        async def on_delta(msg: Msg) -> None:
            seen.deltas.append((loop.time(), TurnDelta.model_validate_json(msg.data)))

        async def on_done(msg: Msg) -> None:
            seen.dones.append(AgentDone.model_validate_json(msg.data))

        await self.nc.subscribe(subjects.delta_subject(self.project, session_id), cb=on_delta)
        await self.nc.subscribe(subjects.done_subject(self.project, session_id), cb=on_done)
        await subscribed(self.nc)
        return seen

    async def usage(self, session_id: uuid.UUID) -> list[asyncpg.Record]:
        return await self.db.fetch(
            "SELECT * FROM metering.token_usage WHERE session_id = $1 ORDER BY started_at",
            session_id,
        )


async def provisioned_leases(
    js: JetStreamContext, ttl_seconds: float, replicas: int = 1
) -> JetStreamContext:
    """`js`, after provisioning the leases' bucket with `ttl_seconds` (as `agentbus
    provision` would: the test's own connection is admin, a service cannot)."""
    await provision_buckets(js, [replace(streams.LEASES, ttl_seconds=ttl_seconds)], replicas)
    return js


def fast(nats_url: str, database_url: str) -> dict[str, Any]:
    return {"nats_url": nats_url, "database_url": database_url, "outbox_poll_seconds": 0.2}


def criativo_settings(nats_url: str, database_url: str, **overrides: Any) -> CriativoSettings:
    values: dict[str, Any] = {
        **fast(nats_url, database_url),
        "retry_backoff_seconds": [0.2, 0.4, 0.8],
        **overrides,
    }
    return CriativoSettings(**values)


StartCriativo = Callable[..., Awaitable[None]]


@pytest_asyncio.fixture(loop_scope="session")
async def platform(
    nats_url: str, database_url: str, nc: Client, start_metering: Starter
) -> AsyncIterator[RecordingProvider]:
    """session_events, handoff and metering (recording the scripted model's requests)."""
    provider = RecordingProvider()
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
        metering: Metering = await start_metering(provider=provider)
        assert metering.provider is provider
        yield provider


@pytest_asyncio.fixture(loop_scope="session")
async def start_criativo(
    platform: RecordingProvider, nats_url: str, database_url: str, nc: Client
) -> AsyncIterator[StartCriativo]:
    """Start a Criativo replica in this process (each call is one more replica)."""
    async with AsyncExitStack() as stack:

        async def start(**overrides: Any) -> None:
            settings = criativo_settings(nats_url, database_url, **overrides)
            await stack.enter_async_context(
                running_service(criativo_main(settings), nc, "criativo")
            )

        yield start


@pytest_asyncio.fixture(loop_scope="session")
async def driver(
    platform: RecordingProvider, nc: Client, database_url: str
) -> AsyncIterator[Driver]:
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=4)
    assert pool is not None
    yield Driver(nc, pool, f"p-{uuid.uuid4().hex[:8]}", platform)
    await pool.close()


@pytest_asyncio.fixture(loop_scope="session")
async def bus(driver: Driver, start_criativo: StartCriativo) -> Driver:
    """The whole platform with one Criativo replica."""
    await start_criativo()
    return driver
