"""The HTTP/1.1 + SSE scaffolding of the fake model APIs, plain asyncio on loopback.

A fake records every request (path, headers, parsed body) and answers it with the
next scripted reply: a JSON body (any status, any headers such as `retry-after`), or
an SSE stream, chunked as the real servers stream it, that may end normally, drop the
connection, hold until the client goes away, or slow down after some frames
(`pace_after`) like a long answer being written, and stop as soon as the client
closes the connection. `frames_sent` then tells how many frames each stream gave
before it ended: fewer than the reply had means the client closed the connection
rather than draining it. A stream that ends normally leaves its connection open for the
client's next request, as a provider's API does (HTTP/1.1 keep-alive). The official SDKs
are pointed at `base_url`, so their real code paths run.

A provider's fake (`testkit.fake_chat_api`, `testkit.fake_messages_api`) says only
what its replies are made of and how their frames are written.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from typing import Any, Generic, Self, TypeVar

REASONS = {
    200: "OK",
    400: "Bad Request",
    429: "Too Many Requests",
    500: "Internal Server Error",
    529: "Overloaded",
}


@dataclass
class ScriptedReply:
    """What every scripted response can do; a provider's `Reply` adds its frames."""

    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: dict[str, Any] | None = None  # a JSON response, when the reply has no frames
    drop_after: int | None = None  # close the socket abruptly after this many frames
    hold_after: int | None = None  # after this many frames, wait for the client to leave
    # After this many frames, wait `pace_seconds` before each next one, and stop sending
    # when the client closes the connection (a long answer, slow enough to cancel).
    pace_after: int | None = None
    pace_seconds: float = 0.05


@dataclass
class Recorded:
    """A request as the fake received it."""

    path: str
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass(frozen=True)
class RawData:
    """An event's data written as it is, not as JSON: what a broken server sends."""

    text: str


def data_line(data: object) -> str:
    """An event's data: `data` as JSON, or a `RawData`'s text as it is."""
    return data.text if isinstance(data, RawData) else json.dumps(data)


def sse_frame(data: str, event: str | None = None) -> bytes:
    """One server-sent event, named or not."""
    named = f"event: {event}\n" if event is not None else ""
    return f"{named}data: {data}\n\n".encode()


R = TypeVar("R", bound=ScriptedReply)


class FakeSseServer(Generic[R]):
    """The server; `base_url` (with `base_path`) once started."""

    base_path = ""

    def __init__(self) -> None:
        self.replies: list[R] = []
        self.requests: list[Recorded] = []
        self.client_left = asyncio.Event()
        # per SSE reply, in order: how many of its frames were written before it ended
        self.frames_sent: list[int] = []
        # connections clients opened: fewer than the requests when they were kept
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()

    # --- what a provider's fake says -------------------------------------------

    def _next_reply(self, body: dict[str, Any]) -> R:
        """The reply to a request whose body is `body` (the queue is taken first)."""
        raise NotImplementedError

    def _frames(self, reply: R) -> list[bytes] | None:
        """The reply's SSE frames, or None for a JSON reply."""
        raise NotImplementedError

    def _trailer(self, reply: R) -> bytes | None:
        """A last frame after a stream that gave all its frames (OpenAI's `[DONE]`)."""
        return None

    # --- the server ------------------------------------------------------------

    @property
    def base_url(self) -> str:
        assert self._server is not None
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"http://{host}:{port}{self.base_path}"

    async def start(self) -> Self:
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
        self.connections += 1
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
        body = json.loads(raw) if raw else {}
        self.requests.append(Recorded(path, headers, body))
        reply = self._next_reply(body)
        frames = self._frames(reply)
        if frames is None:
            data = json.dumps(reply.body or {}).encode()
            extra = "".join(f"{k}: {v}\r\n" for k, v in reply.headers.items())
            status = f"HTTP/1.1 {reply.status} {REASONS.get(reply.status, 'Status')}\r\n"
            length = f"content-type: application/json\r\ncontent-length: {len(data)}\r\n"
            writer.write(f"{status}{length}{extra}\r\n".encode() + data)
            await writer.drain()
            return True
        # Chunked, as the real servers stream: a connection cut before the last chunk is
        # then a broken body to the client, not a normal end. A whole stream leaves the
        # connection open for the client's next request (HTTP/1.1 keep-alive), as the
        # providers' APIs do: closing it would make every call pay a connection.
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        left = asyncio.Event()
        watcher = asyncio.create_task(self._watch_eof(reader, left))
        try:
            sent = await self._send_frames(reply, frames, writer, left)
        finally:
            watcher.cancel()
            # Gone before the next request is read: a reader has one waiter at a time.
            await asyncio.wait([watcher])
        self.frames_sent.append(sent)
        if sent < len(frames) or left.is_set():
            return False
        trailer = self._trailer(reply)
        if trailer is not None:
            self._write_chunk(writer, trailer)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True

    @staticmethod
    def _write_chunk(writer: asyncio.StreamWriter, frame: bytes) -> None:
        writer.write(f"{len(frame):x}\r\n".encode() + frame + b"\r\n")

    async def _send_frames(
        self, reply: R, frames: list[bytes], writer: asyncio.StreamWriter, left: asyncio.Event
    ) -> int:
        """Write the frames; returns how many went out before the stream stopped."""
        for i, frame in enumerate(frames):
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
            self._write_chunk(writer, frame)
            await writer.drain()
        return len(frames)

    @staticmethod
    async def _watch_eof(reader: asyncio.StreamReader, left: asyncio.Event) -> None:
        """Set `left` when the client closes the connection (EOF or reset)."""
        try:
            while await reader.read(65536):
                pass
        except ConnectionError:
            pass
        left.set()
