"""A client that stops reading is disconnected, not buffered without bound, and the
close is counted (`agentbus_gateway_ws_slow_client_closes_total`, issue 14)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from starlette.websockets import WebSocket

from gateway.auth import Principal
from gateway.settings import GatewaySettings
from gateway.ws import CLOSE_TOO_SLOW, Connection, Hub
from servicekit.metrics import value

CLOSES = "agentbus_gateway_ws_slow_client_closes_total"
SENT = "agentbus_gateway_ws_frames_sent_total"


class StalledSocket:
    """The socket boundary of a client whose network stopped: writes never complete."""

    def __init__(self) -> None:
        self.closed_with: int | None = None
        self.writes_started = 0

    async def send_text(self, text: str) -> None:
        self.writes_started += 1
        await asyncio.Event().wait()  # the peer never reads

    async def close(self, code: int = 1000) -> None:
        self.closed_with = code


async def test_a_client_that_stops_reading_is_let_go_with_1013() -> None:
    settings = GatewaySettings(max_queued_frames=5)
    hub = Hub(
        settings=settings,
        secret="s",
        commands=cast(Any, None),
        session_log=cast(Any, None),
        presence=cast(Any, None),
        fanout=cast(Any, None),
    )
    socket = StalledSocket()
    connection = Connection(hub, cast(WebSocket, socket), Principal("p", "ana"))
    closes, sent = value(CLOSES), value(SENT, type="event")
    writer = asyncio.create_task(connection._write())
    try:
        for n in range(5 + 1 + 1):  # one stuck in the socket, five queued, one too many
            connection.send("event", f'{{"type":"event","n":{n}}}')
            await asyncio.sleep(0)  # let the writer take the first frame
        assert socket.writes_started == 1
        assert socket.closed_with == CLOSE_TOO_SLOW
        assert value(CLOSES) == closes + 1
        connection.send("event", '{"type":"event","n":99}')  # after the close: dropped, no error
        assert value(CLOSES) == closes + 1  # one close per connection, however many follow
        assert value(SENT, type="event") == sent + 6  # the frames that were queued, no more
    finally:
        writer.cancel()
