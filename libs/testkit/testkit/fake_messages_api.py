"""A local fake of the Anthropic Messages API, on `testkit.fake_sse` (the twin of
`testkit.fake_chat_api`).

Each request to `POST /v1/messages` takes the next `Reply` from the queue (a 500
`api_error` when it is empty): a JSON body, or an SSE stream of named events that may
end normally, drop the connection, hold until the client goes away, or slow down
after some events (`pace_after`) and stop as soon as the client closes the
connection. `events_sent` tells how many events each stream gave before it ended.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from testkit.fake_sse import FakeSseServer, RawData, ScriptedReply, data_line, sse_frame

MODEL = "claude-sonnet-4-6"

# A named event and its data: JSON, or a `RawData` written as it is (a broken event).
Event = tuple[str, dict[str, Any] | RawData]
# What the builders below make: an event whose data is JSON (a test may edit it).
JsonEvent = tuple[str, dict[str, Any]]


@dataclass
class Reply(ScriptedReply):
    """One scripted response."""

    events: Sequence[Event] | None = None  # an SSE response


class FakeMessagesApi(FakeSseServer[Reply]):
    """The server; `base_url` once started."""

    @property
    def events_sent(self) -> list[int]:
        """Per stream, in order: how many of its events were written before it ended."""
        return self.frames_sent

    def _next_reply(self, body: dict[str, Any]) -> Reply:
        return self.replies.pop(0) if self.replies else Reply(500, body=_error("api_error"))

    def _frames(self, reply: Reply) -> list[bytes] | None:
        if reply.events is None:
            return None
        return [sse_frame(data_line(data), event=name) for name, data in reply.events]


# --- building replies --------------------------------------------------------


def _error(kind: str, message: str = "scripted failure") -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_reply(status: int, kind: str, **headers: str) -> Reply:
    """An HTTP error, e.g. `error_reply(429, "rate_limit_error", **{"retry-after": "2"})`."""
    return Reply(status, headers=headers, body=_error(kind))


def message_start(
    input_tokens: int, cache_read: int = 0, cache_5m: int = 0, cache_1h: int = 0
) -> JsonEvent:
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


def message_delta(output_tokens: int, stop_reason: str | None = "end_turn") -> JsonEvent:
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


def overloaded_event() -> JsonEvent:
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
