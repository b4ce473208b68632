"""A kit client (`servicekit.bus.connect`) calls what was registered with
`on_reconnected` once it is connected again, its subscriptions back on the server: what
was published while it was away never reached them, what is published from then on
does. A listener that fails does not keep the client from reconnecting, nor the other
listeners from being called; only a kit client takes listeners."""

from __future__ import annotations

import uuid

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from servicekit.bus import connect, on_reconnected
from testkit.probes import subscribed, wait_for
from testkit.proxy import TcpProxy, through


async def test_listeners_are_called_once_connected_again_with_the_subscriptions_back(
    nats_url: str, nc: Client
) -> None:
    link = TcpProxy(nats_url)
    await link.start()
    client = await connect(through(nats_url, link), "kit-reconnect")
    subject = f"kit.reconnect.{uuid.uuid4().hex[:8]}"
    heard: list[bytes] = []

    async def hear(msg: Msg) -> None:
        heard.append(msg.data)

    try:
        await client.subscribe(subject, cb=hear)
        await subscribed(client)
        called: list[bool] = []

        def failing() -> None:
            raise RuntimeError("a listener's own fault")

        on_reconnected(client, failing)
        on_reconnected(client, lambda: called.append(client.is_connected))

        await link.cut()
        await nc.publish(subject, b"while away")
        await nc.flush()
        await link.start()
        await wait_for(lambda: called, timeout=20, what="the listener")
        await nc.publish(subject, b"once called back")

        await wait_for(lambda: heard, what="a message after the call")
        assert called == [True]
        assert heard == [b"once called back"], "what came while away is lost to the client"
    finally:
        await client.close()
        await link.cut()


async def test_only_a_kit_client_takes_listeners(nc: Client) -> None:
    with pytest.raises(ValueError, match=r"servicekit\.bus\.connect"):
        on_reconnected(nc, lambda: None)
