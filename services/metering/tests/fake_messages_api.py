"""A local fake of the Anthropic Messages API: HTTP/1.1 and SSE on loopback, plain asyncio.

Each request to `POST /v1/messages` takes the next `Reply` from the queue: a JSON
body (any status, any headers such as `retry-after`), or an SSE stream of events
that may end normally, drop the connection, hold until the client goes away, or
slow down after some events (`pace_after`) like a long answer being written, and
stop as soon as the client closes the connection. `events_sent` then tells how many
events the client was given before it left: fewer than the reply had means the
client closed the connection rather than draining it.
Requests are recorded (headers and parsed body) for the tests to inspect. The
official SDK is pointed at it through `base_url`, so its real code paths run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

REASONS = {200: "OK", 400: "Bad Request", 429: "Too Many Requests", 500: "Internal Server Error",
           529: "Overloaded"}  # fmt: skip
MODEL = "claude-sonnet-4-6"

Event = tuple[str, dict[str, Any]]


@dataclass
class Reply:
    """One scripted response."""

    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: dict[str, Any] | None = None  # a JSON response
    events: list[Event] | None = None  # an SSE response
    drop_after: int | None = None  # close the socket abruptly after this many events
    hold_after: int | None = None  # after this many events, wait for the client to leave
    # After this many events, wait `pace_seconds` before each next one, and stop sending
    # when the client closes the connection (a long answer, slow enough to cancel).
    pace_after: int | None = None
    pace_seconds: float = 0.05


@dataclass
class Recorded:
    """A request as the fake received it."""

    path: str
    headers: dict[str, str]
    body: dict[str, Any]


class FakeMessagesApi:
    """The server; `base_url` once started."""

    def __init__(self) -> None:
        self.replies: list[Reply] = []
        self.requests: list[Recorded] = []
        self.client_left = asyncio.Event()
        # per SSE reply, in order: how many of its events were written before it ended
        self.events_sent: list[int] = []
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()

    @property
    def base_url(self) -> str:
        assert self._server is not None
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    async def start(self) -> FakeMessagesApi:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)  # a free port
        return self

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._handlers):
            task.cancel()
        with contextlib.suppress(Exception):
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            while await self._one_request(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # the client went away, or the fake is stopping
        finally:
            self._handlers.discard(task)
            with contextlib.suppress(Exception):
                writer.close()

    async def _one_request(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Answer one request; False when the connection is over."""
        head = await reader.readuntil(b"\r\n\r\n")
        request_line, *header_lines = head.decode("latin-1").split("\r\n")
        _, path, _ = request_line.split(" ", 2)
        headers = {}
        for line in header_lines:
            if ":" in line:
                name, value = line.split(":", 1)
                headers[name.strip().lower()] = value.strip()
        raw = await reader.readexactly(int(headers.get("content-length", "0")))
        self.requests.append(Recorded(path, headers, json.loads(raw) if raw else {}))
        reply = self.replies.pop(0) if self.replies else Reply(500, body=_error("api_error"))
        if reply.events is None:
            body = json.dumps(reply.body or {}).encode()
            extra = "".join(f"{k}: {v}\r\n" for k, v in reply.headers.items())
            status = f"HTTP/1.1 {reply.status} {REASONS.get(reply.status, 'Status')}\r\n"
            length = f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
            writer.write(f"{status}{length}{extra}\r\n".encode() + body)
            await writer.drain()
            return True
        # Chunked, as the real API streams: a connection cut before the last chunk is
        # then a broken body to the client, not a normal end.
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
            b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n"
        )
        left = asyncio.Event()
        watcher = asyncio.create_task(self._watch_eof(reader, left))
        try:
            sent = await self._send_events(reply, writer, left)
        finally:
            watcher.cancel()
        self.events_sent.append(sent)
        if sent < len(reply.events):
            return False
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()
        return False

    async def _send_events(
        self, reply: Reply, writer: asyncio.StreamWriter, left: asyncio.Event
    ) -> int:
        """Write the reply's events; returns how many went out before it stopped."""
        assert reply.events is not None
        for i, (name, data) in enumerate(reply.events):
            if reply.drop_after is not None and i == reply.drop_after:
                writer.transport.abort()  # no final chunk: the client sees a broken stream
                return i
            if reply.hold_after is not None and i == reply.hold_after:
                await writer.drain()
                await left.wait()  # the client closed its side
                self.client_left.set()
                return i
            if reply.pace_after is not None and i >= reply.pace_after:
                # The pace of a slow answer, not a synchronisation: the wait ends early
                # when the client leaves.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(left.wait(), reply.pace_seconds)
                if left.is_set():
                    self.client_left.set()
                    return i
            chunk = f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()
            writer.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            await writer.drain()
        return len(reply.events)

    @staticmethod
    async def _watch_eof(reader: asyncio.StreamReader, left: asyncio.Event) -> None:
        """Set `left` when the client closes the connection (EOF or reset)."""
        try:
            while await reader.read(65536):
                pass
        except ConnectionError:
            pass
        left.set()


# --- building replies --------------------------------------------------------


def _error(kind: str, message: str = "scripted failure") -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_reply(status: int, kind: str, **headers: str) -> Reply:
    """An HTTP error, e.g. `error_reply(429, "rate_limit_error", **{"retry-after": "2"})`."""
    return Reply(status, headers=headers, body=_error(kind))


def message_start(
    input_tokens: int, cache_read: int = 0, cache_5m: int = 0, cache_1h: int = 0
) -> Event:
    return (
        "message_start",
        {
            "type": "message_start",
            "message": {
                "id": "msg_fake",
                "type": "message",
                "role": "assistant",
                "model": MODEL,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {
                    "input_tokens": input_tokens,
                    "output_tokens": 1,
                    "cache_creation_input_tokens": cache_5m + cache_1h,
                    "cache_read_input_tokens": cache_read,
                    "cache_creation": {
                        "ephemeral_5m_input_tokens": cache_5m,
                        "ephemeral_1h_input_tokens": cache_1h,
                    },
                },
            },
        },
    )


def text_block(index: int, pieces: list[str]) -> list[Event]:
    return [
        ("content_block_start", {"type": "content_block_start", "index": index,
                                 "content_block": {"type": "text", "text": ""}}),
        ("ping", {"type": "ping"}),
        *[
            ("content_block_delta", {"type": "content_block_delta", "index": index,
                                     "delta": {"type": "text_delta", "text": p}})
            for p in pieces
        ],
        ("content_block_stop", {"type": "content_block_stop", "index": index}),
    ]  # fmt: skip


def tool_block(index: int, tool_id: str, name: str, json_parts: list[str]) -> list[Event]:
    return [
        ("content_block_start", {"type": "content_block_start", "index": index,
                                 "content_block": {"type": "tool_use", "id": tool_id,
                                                   "name": name, "input": {}}}),
        *[
            ("content_block_delta", {"type": "content_block_delta", "index": index,
                                     "delta": {"type": "input_json_delta", "partial_json": p}})
            for p in json_parts
        ],
        ("content_block_stop", {"type": "content_block_stop", "index": index}),
    ]  # fmt: skip


def message_delta(output_tokens: int, stop_reason: str | None = "end_turn") -> Event:
    """Usage here is cumulative (the API's contract): the last one is the total."""
    return (
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": None},
            "usage": {"output_tokens": output_tokens},
        },
    )


MESSAGE_STOP: Event = ("message_stop", {"type": "message_stop"})


def overloaded_event() -> Event:
    return ("error", _error("overloaded_error", "Overloaded"))


def message_body(
    text: str, input_tokens: int, output_tokens: int, cache_read: int = 0
) -> dict[str, Any]:
    """A whole (non-streaming) Messages API response."""
    return {
        "id": "msg_fake",
        "type": "message",
        "role": "assistant",
        "model": MODEL,
        "content": [{"type": "text", "text": text}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {
            "input_tokens": input_tokens,
            "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cache_read,
        },
    }
