"""Streams have one owner (issue 11, item 3): `agentbus provision` creates them, services
only check them and refuse to start without them, and `agentbus republish` puts the
log's events back after EVENTS was lost.
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.js.api import AckPolicy, ConsumerConfig

from contracts import streams, subjects
from contracts.events import EventType
from contracts.session_events import (
    AppendedReply,
    AppendEvent,
    OpenSession,
    SessionOpenedReply,
)
from servicekit.bus import check_streams
from servicekit.client import call
from servicekit.runtime import EXIT_NOT_PROVISIONED
from session_events.app import main as log_main
from session_events.settings import LogSettings
from testkit.probes import wait_for
from testkit.servers import Servers, identity_env, without_credentials
from testkit.services import running_service


async def agentbus(servers: Servers, user: str, *args: str, database_url: str = "") -> str:
    """Run the `agentbus` command as an operator would, as `user`; its output."""
    env = {
        "NATS_URL": without_credentials(servers.nats_url),
        "DATABASE_URL": database_url,
        "PATH": "/usr/bin:/bin",
        **identity_env(servers, user),
    }
    if user in ("provision", "ops"):
        env |= {"NATS_USER": user, "NATS_PASSWORD": servers.nats_secrets[user]}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "devstack",
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await process.communicate()
    assert process.returncode == 0, out.decode()
    return out.decode()


@pytest_asyncio.fixture(loop_scope="session")
async def secured(servers: Servers) -> Servers:
    if not servers.nats_secrets:
        pytest.skip("the NATS server of this run is not the secured embedded one")
    return servers


@pytest_asyncio.fixture(loop_scope="session")
async def session_log(nats_url: str, database_url: str, nc: Client) -> AsyncIterator[None]:
    settings = LogSettings(nats_url=nats_url, database_url=database_url, outbox_poll_seconds=0.2)
    async with running_service(log_main(settings), nc, "session_events"):
        yield


async def chat_session(nc: Client, messages: int) -> tuple[uuid.UUID, list[uuid.UUID]]:
    """A session with `messages` chat messages; its events' ids, in order."""
    opened = await call(
        nc,
        subjects.SESSIONS_OPEN,
        OpenSession(project_id="bakery", opened_by="user:ana"),
        SessionOpenedReply,
    )
    ids = [opened.event_id]
    for n in range(messages):
        appended = await call(
            nc,
            subjects.EVENTS_APPEND,
            AppendEvent(
                session_id=opened.session_id,
                type=EventType.CHAT_MESSAGE,
                actor="user:ana",
                payload={"text": f"message {n}"},
            ),
            AppendedReply,
        )
        ids.append(appended.event_id)
    return opened.session_id, ids


async def drain_durable(nc: Client, name: str, session_id: uuid.UUID, expect: int) -> list[str]:
    """Create (or bind) durable `name` on the session's events and read it to the end: the
    `Nats-Msg-Id` of each message, in delivery order."""
    js = nc.jetstream()
    await js.add_consumer(
        streams.EVENTS.name,
        ConsumerConfig(
            durable_name=name,
            ack_policy=AckPolicy.EXPLICIT,
            filter_subject=f"*.*.bakery.{session_id}",
        ),
    )
    sub = await js.pull_subscribe_bind(durable=name, stream=streams.EVENTS.name)
    seen: list[str] = []
    try:
        while len(seen) < expect:
            for msg in await sub.fetch(expect - len(seen), timeout=5):
                seen.append((msg.headers or {})["Nats-Msg-Id"])
                await msg.ack()
        info = await js.consumer_info(streams.EVENTS.name, name)
        assert info.num_pending == 0  # nothing more than expected: no copy doubled
    finally:
        await sub.unsubscribe()
    return seen


async def events_on_bus(nc: Client, session_id: uuid.UUID) -> int:
    info = await nc.jetstream().stream_info(
        streams.EVENTS.name, subjects_filter=f"*.*.bakery.{session_id}"
    )
    return sum((info.state.subjects or {}).values())


async def test_a_lost_events_stream_is_provisioned_and_refilled_from_the_log(
    secured: Servers, database_url: str, session_log: None, nc: Client, connect_as: Any
) -> None:
    session_id, ids = await chat_session(nc, 3)
    await wait_for(lambda: events_on_bus(nc, session_id), what="the log to publish the session")
    assert await drain_durable(nc, "recovery-probe", session_id, 4) == [str(i) for i in ids]

    provision = await connect_as("provision")
    assert await provision.jetstream().delete_stream(streams.EVENTS.name)
    assert await check_streams(nc.jetstream(), streams.ALL) == ["EVENTS: missing"]

    await agentbus(secured, "provision", "provision")
    assert await check_streams(nc.jetstream(), streams.ALL) == []
    assert await events_on_bus(nc, session_id) == 0
    first = await agentbus(
        secured, "session_events", "republish", "--session", str(session_id),
        database_url=database_url,
    )  # fmt: skip
    again = await agentbus(
        secured, "session_events", "republish", "--session", str(session_id),
        database_url=database_url,
    )  # fmt: skip

    assert "republished 4 events: 4 stored" in first
    assert "republished 4 events: 0 stored, 4 already" in again
    assert await events_on_bus(nc, session_id) == 4
    # a consumer made again (as a service's at its restart) reads each event once, in order
    assert await drain_durable(nc, "recovery-probe", session_id, 4) == [str(i) for i in ids]


async def test_republish_since_a_time_takes_every_session_since(
    secured: Servers, database_url: str, session_log: None, nc: Client
) -> None:
    first, first_ids = await chat_session(nc, 1)
    second, second_ids = await chat_session(nc, 2)
    await wait_for(lambda: events_on_bus(nc, second), what="the log to publish")

    out = await agentbus(
        secured, "session_events", "republish", "--since", "2000-01-01T00:00:00+00:00",
        database_url=database_url,
    )  # fmt: skip

    # all were on the bus already: the server's dedup keeps one copy of each
    assert "republished 5 events: 0 stored, 5 already" in out
    assert await events_on_bus(nc, first) == len(first_ids)
    assert await events_on_bus(nc, second) == len(second_ids)


async def test_a_service_refuses_to_start_without_its_streams_and_creates_none(
    secured: Servers, nc: Client, connect_as: Any, spawn: Any
) -> None:
    provision = await connect_as("provision")
    await provision.jetstream().delete_stream(streams.EVENTS.name)

    handoff = spawn("handoff")
    code = await asyncio.get_running_loop().run_in_executor(None, handoff.wait_exit)

    assert code == EXIT_NOT_PROVISIONED
    lines = [
        ln for ln in handoff.log_path.read_text().splitlines() if "streams_not_provisioned" in ln
    ]
    assert len(lines) == 1 and "EVENTS: missing" in lines[0] and "agentbus provision" in lines[0]
    assert await check_streams(nc.jetstream(), streams.ALL) == ["EVENTS: missing"]


async def test_a_running_service_that_loses_events_stops_and_never_recreates_it(
    secured: Servers, nc: Client, connect_as: Any, spawn: Any
) -> None:
    handoff = spawn("handoff")
    await handoff.wait_ready(nc, "handoff")
    provision = await connect_as("provision")

    await provision.jetstream().delete_stream(streams.EVENTS.name)
    crashed = await asyncio.get_running_loop().run_in_executor(None, handoff.wait_exit)
    # what its supervisor does next: start it again, which it refuses until provisioned
    refused = await asyncio.get_running_loop().run_in_executor(None, handoff.start().wait_exit)

    assert crashed != 0
    assert refused == EXIT_NOT_PROVISIONED
    assert await check_streams(nc.jetstream(), streams.ALL) == ["EVENTS: missing"]
