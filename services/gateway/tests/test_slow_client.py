"""A client that stops reading is disconnected, not buffered without bound, and the
close is counted (`agentbus_gateway_ws_slow_client_closes_total`, issue 14). A client
that reads gets each loop tick's frames in one write, in order."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, cast

from starlette.websockets import WebSocket

from gateway.auth import Principal
from gateway.settings import GatewaySettings
from gateway.wire import text_frame
from gateway.ws import CLOSE_TOO_SLOW, Connection, Hub
from servicekit.metrics import value

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

    async def close(self, code: int = 1000) -> None:
        self.closed_with = code


def connection(transport: Transport, socket: Socket, **settings: Any) -> Connection:
    hub = Hub(
        settings=GatewaySettings(**settings),
        secret="s",
        commands=cast(Any, None),
        session_log=cast(Any, None),
        presence=cast(Any, None),
        fanout=cast(Any, None),
    )
    return Connection(hub, cast(WebSocket, socket), Principal("p", "ana"), transport)


def event(n: int) -> bytes:
    return text_frame(f'{{"type":"event","n":{n}}}'.encode())


async def test_a_client_that_stops_reading_is_let_go_with_1013() -> None:
    transport, socket = Transport(stall_after=1), Socket()
    client = connection(transport, socket, max_queued_frames=5)
    closes, sent = value(CLOSES), value(SENT, type="event")
    client.send("event", event(0))
    await asyncio.sleep(0)  # the tick ends: the first frame is written and fills the socket
    assert transport.writes == [event(0)]
    for n in range(1, 5 + 1 + 1):  # five queued, one too many
        client.send("event", event(n))
        await asyncio.sleep(0)
    assert transport.writes == [event(0)], "nothing written while the socket is full"
    await asyncio.sleep(0)  # the close runs as a task of its own
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
    await asyncio.sleep(0)
    assert transport.writes == [event(0) + event(1) + event(2)]
    client.send("event", event(3))
    client.send("event", event(4))
    await asyncio.sleep(0)
    assert len(transport.writes) == 1, "the socket is full: the frames wait"
    transport.stall_after = None  # it drained: the protocol calls back
    assert transport.on_writable is not None
    transport.on_writable()
    assert transport.writes[1:] == [event(3) + event(4)]
    assert socket.closed_with is None
