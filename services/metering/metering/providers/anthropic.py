"""The `anthropic` provider: the official SDK's async client, behind metering only.

- Turns use `messages.create`; streaming turns use `messages.stream`, whose text
  events are handed on as they arrive.
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
from collections.abc import Awaitable, Callable
from typing import Any

import httpx2
from anthropic import APIConnectionError, APIStatusError, AsyncAnthropic
from anthropic.types import Message as SdkMessage
from anthropic.types import MessageDeltaUsage, Usage

from contracts.common import ErrorCode
from contracts.metering import ChatMessage, ReplyBlock, TextBlock, TokenUsage, ToolUseBlock
from metering.providers.base import (
    OnText,
    Progress,
    ProviderError,
    ProviderReply,
    ProviderRequest,
    connection_failed,
    estimate_output_tokens,
    retry_after,
    traced,
    with_retries,
)
from servicekit.logs import get_logger

log = get_logger(__name__)

EPHEMERAL = {"type": "ephemeral"}
RETRYABLE_TYPES = {"overloaded_error", "rate_limit_error", "api_error"}


def usage_of(usage: Usage) -> TokenUsage:
    """Our usage from the SDK's, cache writes split by TTL when the API says how."""
    written = usage.cache_creation_input_tokens or 0
    one_hour = usage.cache_creation.ephemeral_1h_input_tokens if usage.cache_creation else 0
    return TokenUsage(
        input_tokens=usage.input_tokens,
        output_tokens=usage.output_tokens,
        cache_write_5m_tokens=written - one_hour,
        cache_write_1h_tokens=one_hour,
        cache_read_tokens=usage.cache_read_input_tokens or 0,
    )


def with_delta(current: TokenUsage, delta: MessageDeltaUsage) -> TokenUsage:
    """`current` updated from a message_delta: its counts are cumulative, so they replace."""
    update: dict[str, int] = {"output_tokens": delta.output_tokens}
    if delta.input_tokens is not None:
        update["input_tokens"] = delta.input_tokens
    if delta.cache_read_input_tokens is not None:
        update["cache_read_tokens"] = delta.cache_read_input_tokens
    if delta.cache_creation_input_tokens is not None:
        update["cache_write_5m_tokens"] = (
            delta.cache_creation_input_tokens - current.cache_write_1h_tokens
        )
    return current.model_copy(update=update)


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
    ) -> None:
        # max_retries=0: `with_retries` decides, knowing whether text went out.
        self._client = AsyncAnthropic(
            api_key=api_key, base_url=base_url, max_retries=0, timeout=timeout
        )
        self._max_retries = max_retries
        self._sleep = sleep

    @traced
    async def complete(
        self, request: ProviderRequest, progress: Progress, on_text: OnText | None
    ) -> ProviderReply:
        params = build_params(request)

        async def attempt() -> ProviderReply:
            if on_text is None:
                message = await self._client.messages.create(**params)
                progress.current = usage_of(message.usage)
            else:
                message = await self._stream(params, progress, on_text)
            return ProviderReply(
                content=_content(message),
                stop_reason=message.stop_reason or "end_turn",
                model=message.model,
            )

        return await with_retries(attempt, failure_of, progress, self._max_retries, self._sleep)

    async def _stream(
        self, params: dict[str, Any], progress: Progress, on_text: OnText
    ) -> SdkMessage:
        texts, chars, stopped = 0, 0, False
        try:
            async with self._client.messages.stream(**params) as stream:
                async for event in stream:
                    if event.type == "message_stop":
                        stopped = True
                    elif event.type == "message_start":
                        progress.current = usage_of(event.message.usage)
                    elif event.type == "message_delta":
                        progress.current = with_delta(progress.current, event.usage)
                    elif event.type == "text":
                        texts += 1
                        chars += len(event.text)
                        await on_text(event.text, progress.text())
                if not stopped:
                    # A body that ended without message_stop was cut short somewhere.
                    raise ProviderError(
                        ErrorCode.PROVIDER_ERROR, "the provider's stream ended before message_stop"
                    )
                message = await stream.get_final_message()
        except BaseException:
            # Failed, or cancelled (shutdown, or `cmd.llm.cancel`: leaving the `async with`
            # closes the HTTP response, so the connection is closed, not drained).
            # Input and cache tokens are message_start's; output is what the last
            # message_delta said, unless the text received implies more (see below).
            estimate = estimate_output_tokens(texts, chars)
            if estimate > progress.current.output_tokens:
                progress.current = progress.current.model_copy(update={"output_tokens": estimate})
            raise
        progress.current = usage_of(message.usage)
        return message

    async def close(self) -> None:
        await self._client.close()
