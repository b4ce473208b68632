"""The gateway while the services behind it are away: a person's frame is answered
`unavailable` (a code the web client waits out and retries), and the connection stays
open for the next frame. Its own NATS server, so no other test's services answer."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import nats
import pytest_asyncio

from contracts import streams
from gateway.app import main as gateway_main
from gateway.settings import GatewaySettings
from servicekit.bus import provision_streams
from servicekit.embedded import start_nats
from testkit.services import running_service

from .conftest import SECRET, Gateway


@pytest_asyncio.fixture(loop_scope="session")
async def lone_gateway(tmp_path: Path) -> AsyncIterator[Gateway]:
    """A gateway on a NATS server of its own, with no service behind it."""
    server = start_nats(tmp_path)
    urls: list[str] = []
    try:
        async with AsyncExitStack() as stack:
            nc = await nats.connect(server.url)
            stack.push_async_callback(nc.close)
            await provision_streams(nc.jetstream(), streams.ALL)
            settings = GatewaySettings(
                nats_url=server.url,
                gateway_port=0,
                gateway_secret=SECRET,
                command_timeout_seconds=1.0,
            )
            main = gateway_main(settings, on_listening=urls.append)
            await stack.enter_async_context(running_service(main, nc, "gateway"))
            yield Gateway(urls[0], f"p-{uuid.uuid4().hex[:8]}")
    finally:
        server.stop()


async def test_a_join_while_the_log_is_away_is_answered_unavailable_and_the_connection_stays(
    lone_gateway: Gateway,
) -> None:
    client = await lone_gateway.ws()

    joined = await client.request({"type": "join", "session_id": str(uuid.uuid4())})

    assert joined["type"] == "error"
    assert joined["code"] == "unavailable", joined
    # the same connection still answers: a chat before any join is refused as such
    refused = await client.request({"type": "chat", "text": "olá", "client_msg_id": "m1"})
    assert refused["type"] == "error"
    assert refused["code"] == "not_joined", refused
    await client.ws.close()
