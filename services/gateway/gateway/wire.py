"""Server frames prepared once and written straight to a connection's transport.

Through ASGI, every frame to every connection goes `WebSocket.send_text` → uvicorn's
`send` → websockets' framing → one `transport.write`: the gateway's largest cost per
token (docs/decisions/0005-gateway-websocket-frames.md). A server's frame is unmasked
and, with no compression negotiated, the same bytes for every client, so a session's
message is framed once (`text_frame`) and its followers' transports get those bytes; a
connection's frames of one loop tick go out in one write (`ws.Connection`).

uvicorn offers no such path, so `PreparedFramesProtocol` (its sans-I/O WebSocket
protocol, named in `server.py`) hands the app a `FrameWriter` in the scope's extensions.
Everything else (handshake, reading, ping/pong, close) stays uvicorn's.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, Protocol

from pydantic import BaseModel
from uvicorn._types import ASGISendEvent
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.http11 import Request

# The scope extension under which the app finds the connection's `FrameWriter`.
EXTENSION = "agentbus.prepared_frames"
_FIN_TEXT = 0x81  # FIN + opcode 1 (text); RSV bits clear: not compressed


def text_frame(payload: bytes) -> bytes:
    """A whole, unfragmented server text frame carrying `payload` (UTF-8 JSON)."""
    size = len(payload)
    if size < 126:
        return bytes((_FIN_TEXT, size)) + payload
    if size < 1 << 16:
        return struct.pack("!BBH", _FIN_TEXT, 126, size) + payload
    return struct.pack("!BBQ", _FIN_TEXT, 127, size) + payload


def model_frame(frame: BaseModel) -> bytes:
    """A frame model (`contracts.gateway`), prepared."""
    return text_frame(frame.model_dump_json().encode())


class FrameWriter(Protocol):
    """A connection's transport, for prepared frames."""

    # Called when a transport that was over its high-water mark drained (pending frames
    # can go out again).
    on_writable: Callable[[], None] | None

    def ready(self) -> bool:
        """Whether the transport takes more now (below its high-water mark)."""
        ...

    def write_frames(self, data: bytes) -> bool:
        """Write whole prepared frames; False (nothing written) once the connection closes."""
        ...


class PreparedFramesProtocol(WebSocketsSansIOProtocol):
    """uvicorn's sans-I/O WebSocket protocol that is also its connection's `FrameWriter`.

    Prepared frames and uvicorn's own writes (the close frame, pongs) interleave only
    between whole frames: both write complete frames in one `transport.write`, on the one
    event loop, and no message is ever fragmented.
    """

    on_writable: Callable[[], None] | None = None

    def handle_connect(self, event: Request) -> None:
        super().handle_connect(event)
        if self.response.status_code == 101:
            # The app's task was created above but has not run yet: it sees the writer.
            extensions: dict[str, Any] = self.scope["extensions"]
            extensions[EXTENSION] = {"writer": self}

    async def send(self, message: ASGISendEvent) -> None:
        await super().send(message)
        if message["type"] == "websocket.accept" and self.handshake_complete:
            # The handshake's request and response are never read again: ~1.4 KiB a
            # connection, kept for its whole life otherwise (bench/gateway.py's KiB per
            # joined connection).
            del self.request, self.response

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.on_writable is not None:
            self.on_writable()

    def ready(self) -> bool:
        return self.writable.is_set()  # uvicorn's flag, kept by pause/resume_writing

    def write_frames(self, data: bytes) -> bool:
        if self.close_sent or self.disconnected or self.transport.is_closing():
            return False
        self.transport.write(data)
        return True
