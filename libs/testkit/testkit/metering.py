"""Pytest fixtures that run metering in the test's process, against its real NATS and
Postgres (a pytest plugin, loaded with `-p testkit.metering` after `testkit.plugin`).

Used by metering's own tests and by every test that needs model calls (the harness,
the agents): `start_metering(provider=…)` starts a replica, `metering` is one replica
running `TEST_SCRIPT`. This is the one testkit module that imports a service: metering
is the only door to a model, so whatever a test's agents say goes through it, and the
fixtures run its real `main` rather than a stand-in.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import asyncpg
import pytest_asyncio
from nats.aio.client import Client

from metering.app import main
from metering.cancels import Cancellations
from metering.providers.base import Provider
from metering.providers.scripted import Script, ScriptedProvider, ScriptStep
from metering.settings import MeteringSettings
from testkit.services import running_service

# Steps keyed by agent slug, so each test picks its behaviour by the agent it names.
TEST_SCRIPT = Script(
    steps=[
        ScriptStep(
            agent="writer",
            text="Three words here.",
            input_tokens=1200,
            output_tokens=30,
            cache_write_5m_tokens=500,
            cache_read_tokens=4000,
        ),
        ScriptStep(agent="streamer", text="one two three four five six seven eight nine ten"),
        ScriptStep(
            agent="failer",
            text="partial words before the overload hits",
            input_tokens=800,
            fail="overloaded",
            fail_after_words=3,
        ),
        ScriptStep(
            agent="slowpoke",
            text=" ".join(f"w{i}" for i in range(40)),
            input_tokens=300,
            token_delay_ms=10,
        ),
        # spends nearly its whole hold: input as the prompt's size, output up to max_tokens
        ScriptStep(agent="spender", text="ok", output_tokens=200),
        ScriptStep(agent="cheap", text="ok", input_tokens=100, output_tokens=100),
        ScriptStep(responder="echo"),
    ]
)


@dataclass
class Metering:
    """A running metering service and what tests look at."""

    settings: MeteringSettings
    provider: Provider
    db: asyncpg.Connection
    cancels: Cancellations

    @property
    def calls(self) -> int:
        """How many calls reached the (scripted) provider."""
        assert isinstance(self.provider, ScriptedProvider)
        return self.provider.calls


Starter = Callable[..., Awaitable[Metering]]


@pytest_asyncio.fixture(loop_scope="session")
async def start_metering(nats_url: str, database_url: str, nc: Client) -> AsyncIterator[Starter]:
    """Start metering (once per call; a second call is a second replica)."""
    async with AsyncExitStack() as stack:

        async def start(provider: Provider | None = None, **overrides: Any) -> Metering:
            # Replicas in one process: each its own instance id, as separate processes have.
            overrides.setdefault("instance_id", f"metering-{uuid.uuid4().hex[:8]}")
            settings = MeteringSettings(
                nats_url=nats_url, database_url=database_url, provider="scripted", **overrides
            )
            chosen = provider or ScriptedProvider(TEST_SCRIPT)
            cancels = Cancellations(settings.cancel_memory_seconds)
            await stack.enter_async_context(
                running_service(main(settings, provider=chosen, cancels=cancels), nc, "metering")
            )
            db = await asyncpg.connect(database_url, server_settings={"search_path": "metering"})
            stack.push_async_callback(db.close)
            return Metering(settings, chosen, db, cancels)

        yield start


@pytest_asyncio.fixture(loop_scope="session")
async def metering(start_metering: Starter) -> Metering:
    """One metering replica with the test script."""
    return await start_metering()
