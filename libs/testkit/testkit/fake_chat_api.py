"""A local fake of the OpenAI Chat Completions API, on `testkit.fake_sse` (the twin of
`testkit.fake_messages_api`).

Each `POST /v1/chat/completions` takes the next `Reply` from the queue, or, when the
queue is empty, asks `responder` (given the parsed request) for one: a JSON body, or
an SSE stream of chunks (`data: {...}`, then `data: [DONE]` unless told otherwise)
that may drop the connection, or slow down after some chunks (`pace_after`) and stop
as soon as the client closes the connection. `chunks_sent` tells how many chunks each
stream gave before it ended.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from testkit.fake_sse import FakeSseServer, RawData, ScriptedReply, data_line, sse_frame

Chunk = dict[str, Any]


@dataclass
class Reply(ScriptedReply):
    """One scripted response."""

    chunks: Sequence[Chunk | RawData] | None = None  # an SSE response (a RawData: a broken chunk)
    done: bool = True  # end with `data: [DONE]`


Responder = Callable[[dict[str, Any]], Reply]


class FakeChatApi(FakeSseServer[Reply]):
    """The server; `base_url` (with its `/v1`) once started."""

    base_path = "/v1"

    def __init__(self, responder: Responder | None = None) -> None:
        super().__init__()
        self.responder = responder

    @property
    def chunks_sent(self) -> list[int]:
        """Per stream, in order: how many of its chunks were written before it ended."""
        return self.frames_sent

    def _next_reply(self, body: dict[str, Any]) -> Reply:
        if self.replies:
            return self.replies.pop(0)
        if self.responder is not None:
            return self.responder(body)
        return error_reply(500, "server_error")

    def _frames(self, reply: Reply) -> list[bytes] | None:
        if reply.chunks is None:
            return None
        return [sse_frame(data_line(chunk)) for chunk in reply.chunks]

    def _trailer(self, reply: Reply) -> bytes | None:
        return sse_frame("[DONE]") if reply.done else None


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
