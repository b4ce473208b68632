"""Fixtures: the log, handoff, metering (scripted), Criativo, the psychologist and the
gateway in this process, against real NATS and Postgres; clients speak real HTTP and
WebSocket to the gateway."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import pytest_asyncio
from nats.aio.client import Client
from playwright.async_api import async_playwright
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from criativo.app import main as criativo_main
from criativo.settings import CriativoSettings
from gateway.app import main as gateway_main
from gateway.auth import mint
from gateway.settings import GatewaySettings
from handoff.app import main as handoff_main
from metering.providers.scripted import DEFAULT_SCRIPT, Script, ScriptedProvider
from psychologist.app import main as psychologist_main
from psychologist.settings import PsychologistSettings
from servicekit.settings import ServiceSettings
from session_events.app import main as log_main
from session_events.settings import LogSettings
from testkit.metering import Starter
from testkit.probes import wait_for
from testkit.services import running_service

from .browsing import ARGS, CHROMIUM, INSTALLED, Browsing

SECRET = "test-secret-" + "x" * 40


@dataclass
class WsClient:
    """A WebSocket client that keeps every frame it received, in order."""

    ws: ClientConnection
    frames: list[dict[str, Any]] = field(default_factory=list)
    reader: asyncio.Task[None] | None = None

    async def send(self, frame: dict[str, Any] | str) -> None:
        await self.ws.send(frame if isinstance(frame, str) else json.dumps(frame))

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [f for f in self.frames if f["type"] == kind]

    async def answer(self, ref: str, timeout: float = 15) -> dict[str, Any]:
        """The `ack` or `error` that answered the frame sent with `ref`."""

        def found() -> dict[str, Any] | None:
            for f in self.frames:
                if f["type"] in ("ack", "error") and f.get("ref") == ref:
                    return f
            return None

        got: dict[str, Any] = await wait_for(found, timeout=timeout, what=f"answer to {ref}")
        return got

    async def request(self, frame: dict[str, Any], timeout: float = 15) -> dict[str, Any]:
        ref = uuid.uuid4().hex
        await self.send({**frame, "ref": ref})
        return await self.answer(ref, timeout)

    def event_seqs(self) -> list[int]:
        return [f["event"]["seq"] for f in self.of("event")]

    def event_types(self) -> list[str]:
        return [f["event"]["type"] for f in self.of("event")]


@dataclass
class Gateway:
    """The running gateway and a way to talk to it as a project's person."""

    url: str
    project: str

    def token(self, project: str | None = None) -> str:
        return mint(SECRET, project or self.project, "ana")

    def http(self, project: str | None = None) -> httpx.AsyncClient:
        headers = {"authorization": f"Bearer {self.token(project)}"}
        return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=30)

    async def ticket(self, token: str | None = None) -> str:
        """A ticket for one socket, as the page gets it (the token in a header)."""
        headers = {"authorization": f"Bearer {token or self.token()}"}
        async with httpx.AsyncClient(base_url=self.url, headers=headers, timeout=30) as http:
            r = await http.post(f"/api/projects/{self.project}/ws-ticket")
            assert r.status_code == 200, r.text
            ticket: str = r.json()["ticket"]
            return ticket

    async def ws(self, token: str | None = None, *, query: str | None = None) -> WsClient:
        """A socket opened with a ticket for `token` (or with `query` as it is)."""
        query = query if query is not None else f"ticket={await self.ticket(token)}"
        ws_url = self.url.replace("http://", "ws://") + f"/ws?{query}"
        client = WsClient(await connect(ws_url, max_size=None))

        async def read() -> None:
            with contextlib.suppress(ConnectionClosed):
                async for raw in client.ws:
                    client.frames.append(json.loads(raw))

        client.reader = asyncio.create_task(read())
        return client

    async def open_session(self, project: str | None = None) -> uuid.UUID:
        async with self.http(project) as http:
            r = await http.post(f"/api/projects/{project or self.project}/sessions")
            assert r.status_code == 201, r.text
            return uuid.UUID(r.json()["session_id"])


@pytest.fixture
def heartbeat_timeout() -> float:
    return 60.0


@pytest.fixture
def gateway_overrides() -> dict[str, Any]:
    return {}


@pytest.fixture
def metering_overrides() -> dict[str, Any]:
    return {}


@pytest.fixture
def script() -> Script:
    """What the scripted model answers; a test overrides it for a slower or longer turn."""
    return DEFAULT_SCRIPT.model_copy(update={"token_delay_ms": 5.0})


def fast(nats_url: str, database_url: str) -> dict[str, Any]:
    return {"nats_url": nats_url, "database_url": database_url, "outbox_poll_seconds": 0.2}


@pytest_asyncio.fixture(loop_scope="session")
async def gateway(
    nats_url: str,
    database_url: str,
    nc: Client,
    start_metering: Starter,
    heartbeat_timeout: float,
    gateway_overrides: dict[str, Any],
    metering_overrides: dict[str, Any],
    script: Script,
) -> AsyncIterator[Gateway]:
    """The whole platform (offline script) and the gateway on a free port."""
    base = fast(nats_url, database_url)
    urls: list[str] = []
    async with AsyncExitStack() as stack:
        log_settings = LogSettings(
            **base, heartbeat_timeout_seconds=heartbeat_timeout, reaper_interval_seconds=0.2
        )
        for main, name in [
            (log_main(log_settings), "session_events"),
            (handoff_main(ServiceSettings(**base)), "handoff"),
        ]:
            await stack.enter_async_context(running_service(main, nc, name))
        await start_metering(provider=ScriptedProvider(script), **metering_overrides)
        criativo = CriativoSettings(**base)
        await stack.enter_async_context(running_service(criativo_main(criativo), nc, "criativo"))
        psych = PsychologistSettings(**base)
        await stack.enter_async_context(
            running_service(psychologist_main(psych), nc, "psychologist")
        )
        settings = GatewaySettings(
            nats_url=nats_url,
            gateway_port=0,
            gateway_secret=SECRET,
            **gateway_overrides,
        )
        await stack.enter_async_context(
            running_service(gateway_main(settings, on_listening=urls.append), nc, "gateway")
        )
        yield Gateway(urls[0], f"p-{uuid.uuid4().hex[:8]}")


@pytest_asyncio.fixture(loop_scope="session")
async def browser() -> AsyncIterator[Browsing]:
    """Debian's headless Chromium (only the browser tests ask for it); a test whose pages
    met a Content-Security-Policy violation fails."""
    assert INSTALLED, "Debian's chromium is missing: .ci/run installs it"
    async with async_playwright() as pw:
        chromium = await pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        browsing = Browsing(chromium)
        yield browsing
        await chromium.close()
    assert browsing.violations == [], browsing.violations
