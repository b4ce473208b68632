"""Prepared frames are what a WebSocket client's own parser reads as text messages, at
each of the three length encodings (RFC 6455 §5.2)."""

from __future__ import annotations

import pytest
from websockets.client import ClientProtocol
from websockets.frames import Frame, Opcode
from websockets.protocol import State
from websockets.uri import parse_uri

from gateway.wire import text_frame


@pytest.mark.parametrize("size", [0, 125, 126, 65535, 65536, 70000])
def test_a_prepared_frame_parses_as_one_text_message(size: int) -> None:
    client = ClientProtocol(parse_uri("ws://gateway/ws"), state=State.OPEN, max_size=None)
    payload = b'"' + b"x" * max(0, size - 2) + b'"' if size >= 2 else b"1" * size
    client.receive_data(text_frame(payload) + text_frame(b"{}"))
    frames = [e for e in client.events_received() if isinstance(e, Frame)]
    assert [(f.opcode, f.fin, f.rsv1, bytes(f.data)) for f in frames] == [
        (Opcode.TEXT, True, False, payload),
        (Opcode.TEXT, True, False, b"{}"),
    ]
    assert client.parser_exc is None
