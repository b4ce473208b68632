"""A local fake of the OpenAI Chat Completions API: HTTP/1.1 and SSE on loopback, plain
asyncio (test support, like `metering.testing`; the twin of the Anthropic fake in
metering's tests).

Each `POST /v1/chat/completions` takes the next `Reply` from the queue, or, when the
queue is empty, asks `responder` (given the parsed request) for one: a JSON body (any
status, any headers such as `retry-after`), or an SSE stream of chunks (`data: {...}`,
then `data: [DONE]` unless told otherwise) that may drop the connection, or slow down
after some chunks (`pace_after`) and stop as soon as the client closes the connection.
`chunks_sent` tells how many chunks each stream gave before it ended: fewer than the
reply had means the client closed the connection rather than draining it. Requests are
recorded for tests to inspect. The official SDK is pointed at `base_url`, so its real
code paths run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

REASONS = {200: "OK", 400: "Bad Request", 429: "Too Many Requests", 500: "Internal Server Error"}
Chunk = dict[str, Any]


@dataclass
class Reply:
    """One scripted response."""

    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: dict[str, Any] | None = None  # a JSON response
    chunks: list[Chunk] | None = None  # an SSE response
    done: bool = True  # end with `data: [DONE]`
    drop_after: int | None = None  # close the socket abruptly after this many chunks
    # After this many chunks, wait `pace_seconds` before each next one, and stop sending
    # when the client closes the connection (a long answer, slow enough to cancel).
    pace_after: int | None = None
    pace_seconds: float = 0.05


@dataclass
class Recorded:
    """A request as the fake received it."""

    path: str
    headers: dict[str, str]
    body: dict[str, Any]


Responder = Callable[[dict[str, Any]], Reply]


class FakeChatApi:
    """The server; `base_url` (with its `/v1`) once started."""

    def __init__(self, responder: Responder | None = None) -> None:
        self.replies: list[Reply] = []
        self.responder = responder
        self.requests: list[Recorded] = []
        self.client_left = asyncio.Event()
        self.chunks_sent: list[int] = []
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()

    @property
    def base_url(self) -> str:
        assert self._server is not None
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"http://{host}:{port}/v1"

    async def start(self) -> FakeChatApi:
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

    def _next_reply(self, body: dict[str, Any]) -> Reply:
        if self.replies:
            return self.replies.pop(0)
        if self.responder is not None:
            return self.responder(body)
        return error_reply(500, "server_error")

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
        if reply.chunks is None:
            data = json.dumps(reply.body or {}).encode()
            extra = "".join(f"{k}: {v}\r\n" for k, v in reply.headers.items())
            status = f"HTTP/1.1 {reply.status} {REASONS.get(reply.status, 'Status')}\r\n"
            length = f"content-type: application/json\r\ncontent-length: {len(data)}\r\n"
            writer.write(f"{status}{length}{extra}\r\n".encode() + data)
            await writer.drain()
            return True
        # Chunked, as the real servers stream: a connection cut before the last chunk is
        # then a broken body to the client, not a normal end.
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
            b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n"
        )
        left = asyncio.Event()
        watcher = asyncio.create_task(self._watch_eof(reader, left))
        try:
            sent = await self._send_chunks(reply, writer, left)
        finally:
            watcher.cancel()
        self.chunks_sent.append(sent)
        if sent < len(reply.chunks):
            return False
        if reply.done:
            self._write_event(writer, "[DONE]")
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()
        return False

    @staticmethod
    def _write_event(writer: asyncio.StreamWriter, data: str) -> None:
        event = f"data: {data}\n\n".encode()
        writer.write(f"{len(event):x}\r\n".encode() + event + b"\r\n")

    async def _send_chunks(
        self, reply: Reply, writer: asyncio.StreamWriter, left: asyncio.Event
    ) -> int:
        """Write the reply's chunks; returns how many went out before it stopped."""
        assert reply.chunks is not None
        for i, chunk in enumerate(reply.chunks):
            if reply.drop_after is not None and i == reply.drop_after:
                writer.transport.abort()  # no final chunk: the client sees a broken stream
                return i
            if reply.pace_after is not None and i >= reply.pace_after:
                # The pace of a slow answer, not a synchronisation: the wait ends early
                # when the client leaves.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(left.wait(), reply.pace_seconds)
                if left.is_set():
                    self.client_left.set()
                    return i
            self._write_event(writer, json.dumps(chunk))
            await writer.drain()
        return len(reply.chunks)

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

MODEL = "llama3.2"


def error_body(kind: str, message: str = "scripted failure") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": kind}}


def error_reply(status: int, kind: str, **headers: str) -> Reply:
    """An HTTP error, e.g. `error_reply(429, "rate_limit_exceeded", **{"retry-after": "2"})`."""
    return Reply(status, headers=headers, body=error_body(kind))


def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> Chunk:
    """One `chat.completion.chunk` with one choice."""
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": 1_700_000_000,
        "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }


def text_chunks(pieces: list[str]) -> list[Chunk]:
    """The assistant's role, then each piece of text."""
    return [chunk({"role": "assistant", "content": ""})] + [chunk({"content": p}) for p in pieces]


def tool_call_chunks(index: int, call_id: str, name: str, json_parts: list[str]) -> list[Chunk]:
    """A tool call as servers stream it: id and name first, then the arguments in pieces."""
    first = {
        "index": index,
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": ""},
    }
    return [chunk({"tool_calls": [first]})] + [
        chunk({"tool_calls": [{"index": index, "function": {"arguments": part}}]})
        for part in json_parts
    ]


def finish(reason: str = "stop") -> Chunk:
    return chunk({}, finish_reason=reason)


def usage_chunk(prompt: int, completion: int, cached: int = 0) -> Chunk:
    """The last chunk `stream_options.include_usage` asks for: no choices, the usage."""
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": 1_700_000_000,
        "model": MODEL,
        "choices": [],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        },
    }


def error_chunk(kind: str = "server_error", message: str = "the model crashed") -> Chunk:
    """An error sent inside a 200 stream, as vLLM and OpenAI do when generation fails."""
    return error_body(kind, message)


def text_reply(pieces: list[str], prompt: int = 50, completion: int | None = None) -> Reply:
    """A whole streamed answer of text, with its usage."""
    used = len(pieces) if completion is None else completion
    return Reply(chunks=[*text_chunks(pieces), finish("stop"), usage_chunk(prompt, used)])
