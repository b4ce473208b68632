"""Fixtures for servicekit's own tests: a kit schema in this test's database, scratch streams.

The servers come from the `testkit.plugin` pytest plugin (real NATS, real Postgres). Each
test gets its own database; the streams made here have names of their own and are
deleted afterwards, so no test sees another's messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import asyncpg
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import StorageType, StreamConfig
from nats.js.errors import NotFoundError

from servicekit.consumer import ConsumerSpec, DurableConsumer, Handler
from servicekit.db import KIT_MIGRATIONS, create_pool, migrate

KIT_SCHEMA = "kit_test"

# Makes a stream capturing `<prefix>.>`; returns (stream name, subject prefix).
# Keyword arguments: `prefix` (else a fresh one), `max_msg_size` (bytes, -1 = none),
# `allow_atomic` (takes atomic batches, as EVENTS does; default True).
MakeStream = Callable[..., Awaitable[tuple[str, str]]]
MakePool = Callable[[], Awaitable[asyncpg.Pool]]
# Runs a coroutine (a relay's or a consumer's `run()`) for the rest of the test.
Background = Callable[[Coroutine[Any, Any, None]], "asyncio.Task[None]"]
# Starts a durable consumer of `spec` with `handler` in the background (`run_consumer`).
RunConsumer = Callable[[ConsumerSpec, Handler], DurableConsumer]


async def stop(task: asyncio.Task[None], patience: float = 10.0) -> None:
    """Cancel `task` and wait for it to end, cancelling again if a cancellation was lost.

    On Python 3.11 `asyncio.wait_for` drops a cancellation that arrives together with
    its result (nats-py's `fetch` and the relay's wake-up both use it), and the loops
    under test would then run on: one cancel could hang the teardown for ever.
    """
    deadline = time.monotonic() + patience
    while not task.done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{task.get_name()} ignored cancellation for {patience}s")
        task.cancel()
        await asyncio.wait([task], timeout=0.2)
    failure = None if task.cancelled() else task.exception()
    if failure is not None:
        raise failure


@pytest_asyncio.fixture(loop_scope="session")
async def background() -> AsyncIterator[Background]:
    """Start long-running loops; they are stopped (and their failures raised) afterwards."""
    tasks: list[asyncio.Task[None]] = []

    def start(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        tasks.append(asyncio.create_task(coro))
        return tasks[-1]

    yield start
    for task in tasks:
        await stop(task)


@pytest.fixture
def run_consumer(
    nc: Client, js: JetStreamContext, pool: asyncpg.Pool, background: Background
) -> RunConsumer:
    def start(spec: ConsumerSpec, handler: Handler) -> DurableConsumer:
        consumer = DurableConsumer(nc, js, pool, spec, handler)
        background(consumer.run())
        return consumer

    return start


@pytest_asyncio.fixture(loop_scope="session")
async def pool(database_url: str) -> AsyncIterator[asyncpg.Pool]:
    """A pool on a schema holding servicekit's own tables (outbox, processed, dead letters)."""
    kit_pool = await create_pool(database_url, KIT_SCHEMA, min_size=1, max_size=10)
    await migrate(kit_pool, KIT_SCHEMA, [KIT_MIGRATIONS])
    yield kit_pool
    await kit_pool.close()


@pytest_asyncio.fixture(loop_scope="session")
async def make_pool(pool: asyncpg.Pool, database_url: str) -> AsyncIterator[MakePool]:
    """More pools on the same kit schema, as another replica of a service would have."""
    made: list[asyncpg.Pool] = []

    async def make() -> asyncpg.Pool:
        made.append(await create_pool(database_url, KIT_SCHEMA, min_size=1, max_size=4))
        return made[-1]

    yield make
    for extra in made:
        await extra.close()


@pytest_asyncio.fixture(loop_scope="session")
async def js(nc: Client) -> JetStreamContext:
    return nc.jetstream()


@pytest_asyncio.fixture(loop_scope="session")
async def make_stream(js: JetStreamContext) -> AsyncIterator[MakeStream]:
    """Make streams of this test only (`<prefix>.>`); they are deleted afterwards."""
    made: list[str] = []

    async def make(
        prefix: str | None = None, max_msg_size: int = -1, allow_atomic: bool = True
    ) -> tuple[str, str]:
        token = uuid.uuid4().hex[:10]
        name, prefix = f"KIT_{token}", prefix or f"kit{token}"
        await js.add_stream(
            StreamConfig(
                name=name,
                subjects=[f"{prefix}.>"],
                storage=StorageType.MEMORY,
                max_msg_size=max_msg_size,
                allow_atomic=allow_atomic,
            )
        )
        made.append(name)
        return name, prefix

    yield make
    for name in made:
        with contextlib.suppress(NotFoundError):
            await js.delete_stream(name)


@pytest_asyncio.fixture(loop_scope="session")
async def stream(make_stream: MakeStream) -> tuple[str, str]:
    """A fresh stream of this test: (its name, the prefix of the subjects it captures)."""
    return await make_stream()
