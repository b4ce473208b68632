"""A client that stops reading is disconnected, not buffered without bound, and the
close is counted (`agentbus_gateway_ws_slow_client_closes_total`, issue 14): at the
connection's boundary, and through a real socket whose reader stopped. A client that
reads gets each loop tick's frames in one write, in order."""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.parse
from collections.abc import Callable
from typing import Any, cast

import pytest
from nats.aio.client import Client
from starlette.websockets import WebSocket
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from contracts import subjects
from contracts.session_events import AppendedReply, AppendEvent
from gateway.auth import Principal
from gateway.settings import GatewaySettings
from gateway.wire import text_frame
from gateway.ws import CLOSE_TOO_SLOW, Connection, Hub
from servicekit.client import call
from servicekit.metrics import value

from .conftest import Gateway

CLOSES = "agentbus_gateway_ws_slow_client_closes_total"
SENT = "agentbus_gateway_ws_frames_sent_total"


class Transport:
    """The socket boundary (a `FrameWriter`): records writes; `stall_after` writes, it is
    over its high-water mark for good, as when the peer's network stopped."""

    def __init__(self, stall_after: int | None = None) -> None:
        self.writes: list[bytes] = []
        self.stall_after = stall_after
        self.on_writable: Callable[[], None] | None = None

    def ready(self) -> bool:
        return self.stall_after is None or len(self.writes) < self.stall_after

    def write_frames(self, data: bytes) -> bool:
        self.writes.append(data)
        return True


class Socket:
    """The ASGI side: only the close is used here."""

    def __init__(self) -> None:
        self.closed_with: int | None = None
        self.closed = asyncio.Event()

    async def close(self, code: int = 1000) -> None:
        self.closed_with = code
        self.closed.set()


async def flushed() -> None:
    """Return once the callbacks scheduled so far have run: a connection flushes its
    queued frames by `loop.call_soon`, first in first out, so the tick's write is done."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    loop.call_soon(done.set_result, None)
    await done


def connection(transport: Transport, socket: Socket, **settings: Any) -> Connection:
    hub = Hub(
        settings=GatewaySettings(**settings),
        secret="s",
        commands=cast(Any, None),
        session_log=cast(Any, None),
        presence=cast(Any, None),
        fanout=cast(Any, None),
        confirmations=cast(Any, None),
    )
    return Connection(hub, cast(WebSocket, socket), Principal("p", "ana"), transport)


def event(n: int) -> bytes:
    return text_frame(f'{{"type":"event","n":{n}}}'.encode())


async def test_a_client_that_stops_reading_is_let_go_with_1013() -> None:
    transport, socket = Transport(stall_after=1), Socket()
    client = connection(transport, socket, max_queued_frames=5)
    closes, sent = value(CLOSES), value(SENT, type="event")
    client.send("event", event(0))
    await flushed()  # the first frame is written and fills the socket
    assert transport.writes == [event(0)]
    for n in range(1, 5 + 1 + 1):  # five queued, one too many
        client.send("event", event(n))
        await flushed()
    await asyncio.wait_for(socket.closed.wait(), 10)  # the close runs as a task of its own
    assert transport.writes == [event(0)], "nothing written while the socket is full"
    assert socket.closed_with == CLOSE_TOO_SLOW
    assert value(CLOSES) == closes + 1
    client.send("event", event(99))  # after the close: dropped, no error
    assert value(CLOSES) == closes + 1  # one close per connection, however many follow
    assert value(SENT, type="event") == sent + 6  # the frames that were queued, no more


async def test_frames_of_one_tick_go_out_in_one_write_and_the_rest_once_drained() -> None:
    transport, socket = Transport(stall_after=1), Socket()
    client = connection(transport, socket)
    for n in range(3):
        client.send("event", event(n))
    await flushed()
    assert transport.writes == [event(0) + event(1) + event(2)]
    client.send("event", event(3))
    client.send("event", event(4))
    await flushed()
    assert len(transport.writes) == 1, "the socket is full: the frames wait"
    transport.stall_after = None  # it drained: the protocol calls back
    assert transport.on_writable is not None
    transport.on_writable()
    assert transport.writes[1:] == [event(3) + event(4)]
    assert socket.closed_with is None


@pytest.fixture
def gateway_overrides() -> dict[str, Any]:
    return {"max_queued_frames": 10}


async def test_a_reader_that_stopped_on_a_real_socket_is_closed_with_1013(
    gateway: Gateway, nc: Client
) -> None:
    session = await gateway.open_session()
    url = urllib.parse.urlsplit(gateway.url)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: fills fast
    sock.connect((url.hostname, url.port))
    # max_queue=1: the client stops reading the socket once one message waits unread
    ws = await connect(
        f"ws://{url.netloc}/ws?ticket={await gateway.ticket()}",
        sock=sock,
        max_queue=1,
        max_size=None,
    )
    await ws.send(json.dumps({"type": "join", "session_id": str(session)}))
    while json.loads(await ws.recv())["type"] != "ack":  # the log replayed, then the ack
        pass
    closes = value(CLOSES)
    said = AppendEvent(
        session_id=session, type="chat.message", actor="user:ana", payload={"text": "x" * 20_000}
    )
    for _ in range(200):  # ~4 MB of frames at most: the socket's buffers are far smaller
        await call(nc, subjects.EVENTS_APPEND, said, AppendedReply)
        if value(CLOSES) > closes:
            break
    assert value(CLOSES) == closes + 1
    # Reading again, the client gets what the socket held, then the close.
    with pytest.raises(ConnectionClosed):
        while True:
            await ws.recv()
    assert ws.close_code == CLOSE_TOO_SLOW
