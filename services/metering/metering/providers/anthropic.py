"""The `anthropic` provider: the official SDK's async client, behind metering only.

- The request's JSON is written here, once per call (`build_params`,
  `base.request_body`), and sent through the SDK's client (`post`): the SDK adds the
  key, the API version and its headers, resolves the base URL, sends on its connection
  pool and raises an error status as its exceptions. Handed a dict (`messages.create`),
  it would walk and copy the whole conversation on every call before writing it, and
  trace the call with a span of its own; metering's span of the call is `traced`'s,
  whose context the provider hears in `traceparent` (decision 0019).
- The SDK's client sends and reads over aiohttp (`DefaultAioHttpClient`, the SDK's
  own): through httpx's stack, the socket read of each streamed event cost metering
  more CPU than the rest of the real path's work per delta (decision 0024).
- A whole turn's answer is parsed by the SDK into its `Message`. A streaming turn reads
  the raw SSE body, parses each event's data with orjson (`base.json_object`: an event
  that is not a JSON object fails the call) and assembles the message itself
  (`StreamedMessage`): the SDK's stream builds a typed model of every event and of the
  whole message so far, which cost metering more CPU per token than all the rest of its
  work. Text is handed on as it arrives; a tool_use block's input, streamed as pieces
  of JSON, is parsed once, at its `content_block_stop`; event types not listed
  (thinking, citations, what the API adds later) are skipped.
- Usage: `message_start` carries input and cache tokens; every `message_delta`
  carries *cumulative* counts, so the last one seen is kept, never summed. A call
  that fails or is cancelled mid-stream is billed from what was seen; its output
  count, which the API sends only at the end, is estimated from the text received
  (`estimate_output_tokens`).
- Retries: the SDK's own retries are off (`max_retries=0`) so that one loop for every
  provider decides (`base.with_retries`), with this classification (`failure_of`):
  429, 529, `overloaded_error` (also when it arrives as an SSE `error` event in the
  middle of a stream), 5xx and connection failures are retried with backoff,
  honouring `retry-after-ms` / `retry-after`, but only while no text has been handed
  on — a retry after deltas went out would publish them twice.
- Prompt caching: `cache_control` on the system prompt, on the last block of the
  previous user message (read back from the cache) and on the last block of the
  conversation (written for the next turn), so a long conversation reads its
  history from cache.
- `base_url`: given, or the SDK's standard `ANTHROPIC_BASE_URL`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx2
from anthropic import (
    APIConnectionError,
    APIStatusError,
    AsyncAnthropic,
    DefaultAioHttpClient,
    RequestOptions,
)
from anthropic.types import Message as SdkMessage

from contracts.common import ErrorCode
from contracts.metering import ChatMessage, ReplyBlock, TextBlock, TokenUsage, ToolUseBlock
from metering.providers.base import (
    DEFAULT_CONNECTIONS,
    OnText,
    Progress,
    ProviderError,
    ProviderReply,
    ProviderRequest,
    connection_failed,
    estimate_output_tokens,
    http_limits,
    json_object,
    request_body,
    retry_after,
    sse_data,
    traced,
    with_retries,
)
from servicekit.logs import get_logger
from servicekit.telemetry import inject_headers

log = get_logger(__name__)

# Where the Messages API answers, under the base URL.
MESSAGES_PATH = "/v1/messages"
EPHEMERAL = {"type": "ephemeral"}
RETRYABLE_TYPES = {"overloaded_error", "rate_limit_error", "api_error"}


def usage_of(usage: Mapping[str, Any]) -> TokenUsage:
    """Our usage from the API's, cache writes split by TTL when the API says how."""
    written = usage.get("cache_creation_input_tokens") or 0
    one_hour = (usage.get("cache_creation") or {}).get("ephemeral_1h_input_tokens") or 0
    return TokenUsage(
        input_tokens=usage.get("input_tokens") or 0,
        output_tokens=usage.get("output_tokens") or 0,
        cache_write_5m_tokens=written - one_hour,
        cache_write_1h_tokens=one_hour,
        cache_read_tokens=usage.get("cache_read_input_tokens") or 0,
    )


def with_delta(current: TokenUsage, delta: Mapping[str, Any]) -> TokenUsage:
    """`current` updated from a message_delta's usage: its counts are cumulative, so they
    replace."""
    update: dict[str, int] = {}
    for name, ours in (
        ("output_tokens", "output_tokens"),
        ("input_tokens", "input_tokens"),
        ("cache_read_input_tokens", "cache_read_tokens"),
    ):
        if delta.get(name) is not None:
            update[ours] = delta[name]
    if delta.get("cache_creation_input_tokens") is not None:
        update["cache_write_5m_tokens"] = (
            delta["cache_creation_input_tokens"] - current.cache_write_1h_tokens
        )
    return current.model_copy(update=update)


@dataclass
class _Block:
    """A content block being streamed: its text or its tool input's JSON, in pieces."""

    type: str
    id: str = ""
    name: str = ""
    input: dict[str, Any] = field(default_factory=dict)
    parts: list[str] = field(default_factory=list)


@dataclass
class StreamedMessage:
    """A message assembled from the raw events of a Messages API stream.

    Usage is message_start's, then each message_delta's (cumulative: it replaces).
    """

    model: str = ""
    stop_reason: str | None = None
    usage: TokenUsage = field(default_factory=TokenUsage)
    stopped: bool = False  # message_stop arrived: the message is whole
    blocks: dict[int, _Block] = field(default_factory=dict)

    def take(self, event: Mapping[str, Any]) -> str | None:
        """Take one event in; returns the text it adds to a text block, if any."""
        kind = event.get("type")
        if kind == "content_block_delta":
            delta = event["delta"]
            block = self.blocks.get(event["index"])
            if block is None:
                return None
            if delta["type"] == "text_delta" and block.type == "text":
                block.parts.append(delta["text"])
                return str(delta["text"])
            if delta["type"] == "input_json_delta" and block.type == "tool_use":
                block.parts.append(delta["partial_json"])
        elif kind == "content_block_start":
            start = event["content_block"]
            block = _Block(start["type"])
            if block.type == "text":
                block.parts.append(start.get("text") or "")
            elif block.type == "tool_use":
                block.id, block.name = start["id"], start["name"]
                block.input = dict(start.get("input") or {})
            self.blocks[event["index"]] = block
        elif kind == "content_block_stop":
            block = self.blocks.get(event["index"])
            if block is not None and block.type == "tool_use" and block.parts:
                block.input = tool_input(block.parts)
        elif kind == "message_start":
            message = event["message"]
            self.model = message.get("model") or ""
            self.usage = usage_of(message.get("usage") or {})
        elif kind == "message_delta":
            self.stop_reason = event.get("delta", {}).get("stop_reason") or self.stop_reason
            self.usage = with_delta(self.usage, event.get("usage") or {})
        elif kind == "message_stop":
            self.stopped = True
        return None

    def content(self) -> list[ReplyBlock]:
        """The text and tool_use blocks, in the order of their index."""
        blocks: list[ReplyBlock] = []
        for index in sorted(self.blocks):
            block = self.blocks[index]
            if block.type == "text":
                blocks.append(TextBlock(text="".join(block.parts)))
            elif block.type == "tool_use":
                blocks.append(ToolUseBlock(id=block.id, name=block.name, input=block.input))
        return blocks


def tool_input(parts: list[str]) -> dict[str, Any]:
    """A tool_use block's input from the pieces of JSON it was streamed in."""
    raw = "".join(parts)
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        raise ProviderError(
            ErrorCode.PROVIDER_ERROR, f"a tool_use input is not a JSON object: {raw[:200]!r}"
        )
    return parsed


def _blocks(message: ChatMessage) -> list[dict[str, Any]]:
    if isinstance(message.content, str):
        return [{"type": "text", "text": message.content}]
    return [block.model_dump(mode="json") for block in message.content]


def build_params(request: ProviderRequest) -> dict[str, Any]:
    """The Messages API request, with the cache breakpoints described above."""
    contents = [_blocks(m) for m in request.messages]
    user_turns = [i for i, m in enumerate(request.messages) if m.role == "user"]
    breakpoints = {len(contents) - 1}
    if len(user_turns) >= 2:
        breakpoints.add(user_turns[-2])
    for i in breakpoints:
        if contents[i]:
            contents[i][-1]["cache_control"] = EPHEMERAL
    messages = [
        {"role": m.role, "content": blocks}
        for m, blocks in zip(request.messages, contents, strict=True)
    ]
    params: dict[str, Any] = {
        "model": request.model,
        "max_tokens": request.max_tokens,
        "messages": messages,
    }
    if request.system:
        params["system"] = [{"type": "text", "text": request.system, "cache_control": EPHEMERAL}]
    if request.tools:
        params["tools"] = [t.model_dump(mode="json") for t in request.tools]
    return params


def _content(message: SdkMessage) -> list[ReplyBlock]:
    blocks: list[ReplyBlock] = []
    for block in message.content:
        if block.type == "text":
            blocks.append(TextBlock(text=block.text))
        elif block.type == "tool_use":
            blocks.append(ToolUseBlock(id=block.id, name=block.name, input=dict(block.input)))
    return blocks


def _error_type(exc: APIStatusError) -> str | None:
    body = exc.body
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and isinstance(error.get("type"), str):
            return str(error["type"])
    return None


def classify(exc: APIStatusError) -> tuple[str, bool]:
    """The ErrorCode a failed call is reported with, and whether a retry may cure it."""
    kind = _error_type(exc)
    if exc.status_code in (429, 529) or kind in ("overloaded_error", "rate_limit_error"):
        return ErrorCode.PROVIDER_OVERLOADED, True
    if exc.status_code >= 500 or kind in RETRYABLE_TYPES:
        return ErrorCode.PROVIDER_ERROR, True
    return ErrorCode.PROVIDER_ERROR, False


def failure_of(exc: Exception) -> tuple[ProviderError, bool] | None:
    """A failed attempt as this provider reads it (`with_retries`)."""
    if isinstance(exc, APIStatusError):
        code, retryable = classify(exc)
        return ProviderError(code, _message_of(exc), retry_after(exc.response.headers)), retryable
    if isinstance(exc, (APIConnectionError, httpx2.TransportError)):
        return connection_failed(exc), True
    return None


def _message_of(exc: APIStatusError) -> str:
    body = exc.body
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return f"{body['error'].get('type')}: {body['error'].get('message')}"
    return str(exc)


class AnthropicProvider:
    """Claude through the official SDK."""

    name = "anthropic"

    def __init__(
        self,
        api_key: str,
        base_url: str | None = None,
        max_retries: int = 4,
        timeout: float = 600.0,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        connections: int = DEFAULT_CONNECTIONS,
    ) -> None:
        # max_retries=0: `with_retries` decides, knowing whether text went out.
        self._client = AsyncAnthropic(
            api_key=api_key,
            base_url=base_url,
            max_retries=0,
            timeout=timeout,
            http_client=DefaultAioHttpClient(limits=http_limits(connections)),
        )
        self._max_retries = max_retries
        self._sleep = sleep

    @traced
    async def complete(
        self, request: ProviderRequest, progress: Progress, on_text: OnText | None
    ) -> ProviderReply:
        params = build_params(request)
        body = request_body(params if on_text is None else params | {"stream": True})
        # The call's trace context, for a provider that joins traces: the SDK, handed a
        # body, makes no span of its own, so metering's (`traced`) is the parent.
        options: RequestOptions = {"headers": inject_headers()}

        async def attempt() -> ProviderReply:
            if on_text is None:
                message = await self._client.post(
                    MESSAGES_PATH, cast_to=SdkMessage, content=body, options=options
                )
                progress.current = usage_of(message.usage.model_dump())
                return ProviderReply(
                    content=_content(message),
                    stop_reason=message.stop_reason or "end_turn",
                    model=message.model,
                )
            streamed = await self._stream(body, options, progress, on_text)
            return ProviderReply(
                content=streamed.content(),
                stop_reason=streamed.stop_reason or "end_turn",
                model=streamed.model or request.model,
            )

        return await with_retries(attempt, failure_of, progress, self._max_retries, self._sleep)

    async def _stream(
        self, body: bytes, options: RequestOptions, progress: Progress, on_text: OnText
    ) -> StreamedMessage:
        message = StreamedMessage()
        texts, chars = 0, 0
        try:
            # An HTTP error status is raised here, as `messages.create` raises it. Leaving
            # the `async with` early (failed, or cancelled: shutdown, or `cmd.llm.cancel`)
            # closes the HTTP response: the connection is closed, not drained.
            async with contextlib.aclosing(await self._open(body, options)) as http:
                async for data in sse_data(http.aiter_bytes()):
                    event = json_object(data)
                    if event.get("type") == "error":
                        # An error after the 200 (overloaded_error): classified as the
                        # same error would be as a status (`failure_of`).
                        raise APIStatusError(str(event), response=http, body=event)
                    text = message.take(event)
                    progress.current = message.usage
                    if text:
                        texts += 1
                        chars += len(text)
                        await on_text(text, progress.text())
            if not message.stopped:
                # A body that ended without message_stop was cut short somewhere.
                raise ProviderError(
                    ErrorCode.PROVIDER_ERROR, "the provider's stream ended before message_stop"
                )
        except BaseException:
            # Input and cache tokens are message_start's; output is what the last
            # message_delta said, unless the text received implies more (the module's docstring).
            estimate = estimate_output_tokens(texts, chars)
            if estimate > progress.current.output_tokens:
                progress.current = progress.current.model_copy(update={"output_tokens": estimate})
            raise
        return message

    async def _open(self, body: bytes, options: RequestOptions) -> httpx2.Response:
        """The response to a streamed Messages request, its body unread."""
        response: httpx2.Response = await self._client.post(
            MESSAGES_PATH, cast_to=httpx2.Response, content=body, options=options, stream=True
        )
        return response

    async def close(self) -> None:
        await self._client.close()
