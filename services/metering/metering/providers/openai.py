"""The `openai` provider: any OpenAI-compatible Chat Completions server (Ollama, vLLM,
LM Studio, or OpenAI itself) through the official `openai` SDK, behind metering only.

- One code path: every call streams, with `stream_options.include_usage`, so usage
  arrives in the last chunk (its `choices` empty) before `[DONE]`. Text is handed on
  only for a streaming turn; a whole turn just collects it. The chunks are read from
  the raw SSE body as plain JSON (orjson, `base.json_object`: a chunk that is not a JSON
  object fails the call): the SDK's stream builds a typed model of every chunk, which
  costs more CPU per token than the rest of metering.
- The request's JSON is written here, once per call (`build_params`,
  `base.request_body`), and sent through the SDK's client (`post`), which adds the key
  and its headers, resolves the base URL and raises an error status as its exceptions.
  Handed a dict (`chat.completions.create`), the SDK would transform the whole
  conversation by its types on every call before writing it (decision 0019). It sends
  and reads over aiohttp (`DefaultAioHttpClient`, the SDK's own), whose reads of a
  stream cost a fraction of httpx's (decision 0024).
- Translation: the harness speaks Anthropic's blocks (contracts.metering). A
  `tool_use` block becomes an assistant `tool_calls` entry, a `tool_result` block a
  `tool` message right after it, a tool spec a `function` tool; back, the streamed
  `tool_calls` pieces are joined by their `index` into `ToolUseBlock`s.
- Usage: `prompt_tokens` counts cached tokens too, so input is what is left once the
  cached reads (and writes, where a server reports them) are taken out. A stream cut
  short (a cancel, a dropped connection, an error chunk) never hears its usage: input
  is estimated from the prompt's size and output from the text received, so it is
  still billed: the provider charged for what it generated.
- Retries: the SDK's own are off (`max_retries=0`) so that the loop both providers use
  decides (`base.with_retries`), with this classification (`failure_of`): 429, 5xx,
  error chunks and connection failures are retried with backoff, honouring
  `retry-after-ms` / `retry-after`, but only while no text has been handed on — a
  retry after deltas went out would publish them twice.
- `base_url` and `api_key` are the SDK's `OPENAI_BASE_URL` / `OPENAI_API_KEY`; a local
  server needs no key, so one is made up when none is given.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx2
from openai import (
    APIConnectionError,
    APIError,
    APIStatusError,
    AsyncOpenAI,
    DefaultAioHttpClient,
    RequestOptions,
)
from pydantic import ValidationError

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

# Where a Chat Completions server answers, under its base URL.
COMPLETIONS_PATH = "/chat/completions"
# What the SDK sends when no key is configured: local servers ignore it.
NO_KEY = "no-key-needed"
# The harness's stop reasons are Anthropic's; a finish reason not listed passes through.
STOP_REASONS = {
    "stop": "end_turn",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "length": "max_tokens",
    "content_filter": "refusal",
}
# Bytes of prompt per input token assumed when a stream is cut before its usage.
PROMPT_BYTES_PER_TOKEN = 4


def usage_of(usage: Mapping[str, Any]) -> TokenUsage:
    """Our usage from a Chat Completions usage: cached prompt tokens priced apart."""
    details = usage.get("prompt_tokens_details") or {}
    read = details.get("cached_tokens") or 0
    written = details.get("cache_write_tokens") or 0
    return TokenUsage(
        input_tokens=max((usage.get("prompt_tokens") or 0) - read - written, 0),
        output_tokens=usage.get("completion_tokens") or 0,
        cache_write_5m_tokens=written,
        cache_read_tokens=read,
    )


def _text_of_blocks(message: ChatMessage) -> str:
    if isinstance(message.content, str):
        return message.content
    return "".join(b.text for b in message.content if isinstance(b, TextBlock))


def _messages(request: ProviderRequest) -> list[dict[str, Any]]:
    """The conversation in Chat Completions form (see the module's docstring)."""
    out: list[dict[str, Any]] = []
    if request.system:
        out.append({"role": "system", "content": request.system})
    for message in request.messages:
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        if message.role == "assistant":
            entry: dict[str, Any] = {"role": "assistant", "content": _text_of_blocks(message)}
            calls = [
                {
                    "id": b.id,
                    "type": "function",
                    "function": {"name": b.name, "arguments": json.dumps(b.input)},
                }
                for b in message.content
                if isinstance(b, ToolUseBlock)
            ]
            if calls:
                entry["tool_calls"] = calls
            out.append(entry)
            continue
        # A user message: its tool results first (they must follow the assistant
        # message that asked for them), then what the person or the harness wrote.
        for block in message.content:
            if block.type == "tool_result":
                content = f"error: {block.content}" if block.is_error else block.content
                out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
        text = _text_of_blocks(message)
        if text:
            out.append({"role": "user", "content": text})
    return out


def build_params(request: ProviderRequest) -> dict[str, Any]:
    """The Chat Completions request: always streamed, with usage in the last chunk."""
    params: dict[str, Any] = {
        "model": request.model,
        "max_tokens": request.max_tokens,
        "messages": _messages(request),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if request.tools:
        params["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.input_schema,
                },
            }
            for t in request.tools
        ]
    return params


def prompt_tokens_estimate(params: dict[str, Any]) -> int:
    """Input tokens of a request whose usage never arrived, from its size (rounded up)."""
    size = len(json.dumps([params["messages"], params.get("tools", [])]).encode())
    return -(-size // PROMPT_BYTES_PER_TOKEN)


@dataclass
class _ToolCall:
    id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)

    def block(self, index: int) -> ToolUseBlock:
        raw = "".join(self.arguments)
        try:
            parsed = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError:
            parsed = None
        # Arguments that are not a JSON object are handed to the tool as they came, so
        # that its validation tells the model what to correct, instead of failing the turn.
        args = parsed if isinstance(parsed, dict) else {"_unparsed_arguments": raw}
        return ToolUseBlock(id=self.id or f"call_{index}", name=self.name, input=args)


@dataclass
class _Reply:
    """A reply being assembled from chunks."""

    text: list[str] = field(default_factory=list)
    calls: dict[int, _ToolCall] = field(default_factory=dict)
    finish_reason: str | None = None
    usage: Mapping[str, Any] | None = None

    def add(self, chunk: Mapping[str, Any]) -> str | None:
        """Take one chunk in; returns its text, if any."""
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        piece: list[str] = []
        for choice in (chunk.get("choices") or [])[:1]:  # n=1: one choice
            delta = choice.get("delta") or {}
            if delta.get("content"):
                piece.append(delta["content"])
            for call in delta.get("tool_calls") or []:
                entry = self.calls.setdefault(call.get("index", 0), _ToolCall())
                entry.id = entry.id or (call.get("id") or "")
                function = call.get("function")
                if function is not None:
                    entry.name = entry.name or (function.get("name") or "")
                    if function.get("arguments"):
                        entry.arguments.append(function["arguments"])
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
        text = "".join(piece)
        if text:
            self.text.append(text)
        return text or None

    def content(self) -> list[ReplyBlock]:
        blocks: list[ReplyBlock] = []
        if self.text:
            blocks.append(TextBlock(text="".join(self.text)))
        for index in sorted(self.calls):
            if self.calls[index].name:
                blocks.append(self.calls[index].block(index))
        return blocks


def _error_detail(body: object) -> tuple[str | None, str | None]:
    """The `type`/`code` and `message` of an error body (`{"error": {...}}` or the inner
    object, as the SDK passes a mid-stream error chunk's)."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        body = body["error"]
    if not isinstance(body, dict):
        return None, None
    kind = body.get("type") or body.get("code")
    message = body.get("message")
    return (str(kind) if kind else None), (str(message) if message else None)


def classify(exc: APIError) -> tuple[str, bool]:
    """The ErrorCode a failed call is reported with, and whether a retry may cure it."""
    kind, _ = _error_detail(exc.body)
    if isinstance(exc, APIStatusError):
        if exc.status_code in (429, 529) or kind in ("rate_limit_exceeded", "overloaded_error"):
            return ErrorCode.PROVIDER_OVERLOADED, True
        return ErrorCode.PROVIDER_ERROR, exc.status_code >= 500
    # An error chunk in the middle of a 200 stream: the server failed while answering.
    if kind in ("rate_limit_exceeded", "overloaded_error", "overloaded"):
        return ErrorCode.PROVIDER_OVERLOADED, True
    return ErrorCode.PROVIDER_ERROR, True


def failure_of(exc: Exception) -> tuple[ProviderError, bool] | None:
    """A failed attempt as this provider reads it (`with_retries`)."""
    if isinstance(exc, APIStatusError):
        code, retryable = classify(exc)
        return ProviderError(code, _message_of(exc), retry_after(exc.response.headers)), retryable
    if isinstance(exc, APIConnectionError):
        return connection_failed(exc), True
    if isinstance(exc, APIError):  # an error chunk mid-stream
        code, retryable = classify(exc)
        return ProviderError(code, _message_of(exc)), retryable
    if isinstance(exc, httpx2.TransportError):
        return connection_failed(exc), True
    return None


def _message_of(exc: APIError) -> str:
    kind, message = _error_detail(exc.body)
    if message:
        return f"{kind or 'error'}: {message}"
    return str(exc)


def _stream_error(error: object, request: httpx2.Request) -> APIError:
    """An error chunk in a 200 stream, as the SDK raises it (`failure_of` classifies it)."""
    message = error.get("message") if isinstance(error, dict) else None
    if not isinstance(message, str) or not message:
        message = "An error occurred during streaming"
    return APIError(message, request, body=error)


class OpenAICompatibleProvider:
    """A Chat Completions server through the official `openai` SDK."""

    name = "openai"

    def __init__(
        self,
        api_key: str | None = None,
        base_url: str | None = None,
        max_retries: int = 4,
        timeout: float = 600.0,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        connections: int = DEFAULT_CONNECTIONS,
    ) -> None:
        # max_retries=0: `with_retries` decides, knowing whether text went out.
        self._client = AsyncOpenAI(
            api_key=api_key or NO_KEY,
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
        body = request_body(params)
        # The call's trace context, for a server that joins traces (vLLM can).
        options: RequestOptions = {"headers": inject_headers()}

        async def attempt() -> ProviderReply:
            reply = await self._stream(params, body, options, progress, on_text)
            try:
                content = reply.content()
            except ValidationError as exc:
                # A small model can name a tool that cannot exist; the reply cannot
                # be handed to the harness, and retrying would bill it again.
                raise ProviderError(
                    ErrorCode.PROVIDER_ERROR,
                    f"the model's reply does not fit the harness's blocks: {exc}"[:500],
                ) from exc
            return ProviderReply(
                content=content,
                stop_reason=STOP_REASONS.get(reply.finish_reason or "", reply.finish_reason)
                or "end_turn",
                model=request.model,
            )

        return await with_retries(attempt, failure_of, progress, self._max_retries, self._sleep)

    async def _stream(
        self,
        params: dict[str, Any],
        body: bytes,
        options: RequestOptions,
        progress: Progress,
        on_text: OnText | None,
    ) -> _Reply:
        reply = _Reply()
        texts, chars, opened = 0, 0, False
        try:
            # An HTTP error status is raised here. Leaving the `async with` early closes
            # the HTTP response: a cancel closes the connection, not drains it.
            async with contextlib.aclosing(await self._open(body, options)) as http:
                opened = True
                async for data in sse_data(http.aiter_bytes()):
                    if data.startswith(b"[DONE]"):
                        continue  # the body ends after it: read to the end, kept alive
                    chunk = json_object(data)
                    if chunk.get("error"):
                        raise _stream_error(chunk["error"], http.request)
                    text = reply.add(chunk)
                    if reply.usage is not None:
                        progress.current = usage_of(reply.usage)
                    if text is not None:
                        texts += 1
                        chars += len(text)
                        if on_text is not None:
                            await on_text(text, progress.text())
            if reply.finish_reason is None:
                # Without a finish reason the body ended early: a dropped connection.
                raise ProviderError(
                    ErrorCode.PROVIDER_ERROR, "the provider's stream ended before it finished"
                )
        except BaseException:
            # Failed or cancelled after the server began answering: bill what it consumed.
            if opened and reply.usage is None:
                progress.current = TokenUsage(
                    input_tokens=prompt_tokens_estimate(params),
                    output_tokens=estimate_output_tokens(texts, chars),
                )
            raise
        if reply.usage is None:
            # A server that ignores include_usage: bill from sizes rather than nothing.
            log.warning("provider_usage_missing", model=params["model"])
            progress.current = TokenUsage(
                input_tokens=prompt_tokens_estimate(params),
                output_tokens=estimate_output_tokens(texts, chars),
            )
        return reply

    async def _open(self, body: bytes, options: RequestOptions) -> httpx2.Response:
        """The response to a Chat Completions request (streamed), its body unread."""
        response: httpx2.Response = await self._client.post(
            COMPLETIONS_PATH, cast_to=httpx2.Response, content=body, options=options, stream=True
        )
        return response

    async def close(self) -> None:
        await self._client.close()
