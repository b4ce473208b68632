"""What metering asks of a provider, and what a provider tells back — including when it fails.

A provider fills a `Progress` as the call goes (usage from the first event,
cumulative usage from every later one, the time of the first token), so that a
call that fails or is cancelled halfway is still billed for what the provider
produced: a client that drops mid-stream still cost what the provider generated.
"""

from __future__ import annotations

import functools
import json
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, cast

import httpx2
import orjson
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai
from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.util.types import AttributeValue

from contracts.common import ErrorCode
from contracts.metering import ChatMessage, ReplyBlock, TokenUsage, ToolSpec
from servicekit.logs import get_logger
from servicekit.telemetry import tracer, tracing_on

# A server asking for a longer wait than this is answered with an error now.
MAX_RETRY_AFTER_SECONDS = 60.0

# The provider connections a replica opens at most (the SDKs' own limit).
MAX_CONNECTIONS = 1000
# Calls a replica runs at once, unless told: a metering endpoint's default concurrency.
DEFAULT_CONNECTIONS = 256
# How long an idle connection to the provider is kept: a person answers in tens of
# seconds, and a connection opened per turn costs a TLS handshake (CPU and round trips)
# before the turn's first token.
KEEPALIVE_SECONDS = 60.0

log = get_logger(__name__)

# Awaited with each piece of text as the provider produces it, and the time it did;
# awaited in order, so deltas are published in the order they were produced.
OnText = Callable[[str, float], Awaitable[None]]


@dataclass(frozen=True)
class ProviderRequest:
    """One call: the model the cascade chose and the conversation."""

    model: str
    agent_slug: str
    system: str
    messages: list[ChatMessage]
    tools: list[ToolSpec]
    max_tokens: int


@dataclass(frozen=True)
class ProviderReply:
    """The whole message the provider returned."""

    content: list[ReplyBlock]
    stop_reason: str
    model: str


@dataclass
class Progress:
    """What a call consumed so far: finished attempts plus the one in flight."""

    earlier: TokenUsage = field(default_factory=TokenUsage)
    current: TokenUsage = field(default_factory=TokenUsage)
    first_token_at: float | None = None
    texts: int = 0

    @property
    def usage(self) -> TokenUsage:
        """Everything billed for this call, every attempt included."""
        a, b = self.earlier, self.current
        return TokenUsage(
            input_tokens=a.input_tokens + b.input_tokens,
            output_tokens=a.output_tokens + b.output_tokens,
            cache_write_5m_tokens=a.cache_write_5m_tokens + b.cache_write_5m_tokens,
            cache_write_1h_tokens=a.cache_write_1h_tokens + b.cache_write_1h_tokens,
            cache_read_tokens=a.cache_read_tokens + b.cache_read_tokens,
        )

    def next_attempt(self) -> None:
        """A retry starts: what the failed attempt consumed stays billed."""
        self.earlier = self.usage
        self.current = TokenUsage()

    def text(self, emitted_at: float | None = None) -> float:
        """Note that a piece of text was produced; returns its time."""
        at = time.time() if emitted_at is None else emitted_at
        if self.first_token_at is None:
            self.first_token_at = at
        self.texts += 1
        return at


class ProviderError(Exception):
    """The provider could not answer; `code` is a contracts ErrorCode, `message` for the caller."""

    def __init__(self, code: str, message: str, retry_after: float | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retry_after = retry_after


Complete = TypeVar("Complete", bound=Callable[..., Coroutine[Any, Any, "ProviderReply"]])


def traced(complete: Complete) -> Complete:
    """A provider's `complete` as a CLIENT span with the GenAI semantic conventions:
    provider, model, and the tokens the call was billed for (set even when it failed or
    was cancelled: `progress` holds what the provider produced until then)."""

    @functools.wraps(complete)
    async def call(
        self: Provider, request: ProviderRequest, progress: Progress, on_text: OnText | None
    ) -> ProviderReply:
        if not tracing_on():
            return await complete(self, request, progress, on_text)
        attributes: dict[str, AttributeValue] = {
            gen_ai.GEN_AI_OPERATION_NAME: "chat",
            gen_ai.GEN_AI_PROVIDER_NAME: self.name,
            gen_ai.GEN_AI_REQUEST_MODEL: request.model,
            gen_ai.GEN_AI_REQUEST_MAX_TOKENS: request.max_tokens,
            "gen_ai.agent.name": request.agent_slug,
        }
        with tracer.start_as_current_span(
            f"chat {request.model}", kind=SpanKind.CLIENT, attributes=attributes
        ) as span:
            try:
                reply = await complete(self, request, progress, on_text)
            except ProviderError as exc:
                span.set_attribute("error.type", exc.code)
                span.set_status(StatusCode.ERROR, exc.code)
                raise
            finally:
                if span.is_recording():
                    usage = progress.usage
                    span.set_attributes(
                        {
                            gen_ai.GEN_AI_USAGE_INPUT_TOKENS: usage.input_tokens,
                            gen_ai.GEN_AI_USAGE_OUTPUT_TOKENS: usage.output_tokens,
                            gen_ai.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: usage.cache_read_tokens,
                            gen_ai.GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS: (
                                usage.cache_write_5m_tokens + usage.cache_write_1h_tokens
                            ),
                        }
                    )
            span.set_attribute(gen_ai.GEN_AI_RESPONSE_MODEL, reply.model)
            span.set_attribute(gen_ai.GEN_AI_RESPONSE_FINISH_REASONS, [reply.stop_reason])
            return reply

    return cast(Complete, call)


class Provider(Protocol):
    """An LLM behind metering: `anthropic`, `openai` (OpenAI-compatible) or `scripted`."""

    name: str

    async def complete(
        self, request: ProviderRequest, progress: Progress, on_text: OnText | None
    ) -> ProviderReply:
        """Run the call, streaming text to `on_text` when given; fill `progress` as it goes."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...


def http_limits(keep_alive: int) -> httpx2.Limits:
    """The connection pool of a provider's SDK client: `keep_alive` idle connections kept
    (the calls a replica runs at once), so that a burst of turns as large as a burst before
    it reuses that one's connections. The SDKs keep 100, for five seconds.

    The client is the SDK's aiohttp one (`DefaultAioHttpClient`), whose pool hands out an
    idle connection without looking at the others: the default one (httpx2's) checks every
    idle connection's socket on each request and each response's end, so with the
    connections of a burst kept, every later call paid for all of them (decision 0024).
    aiohttp keeps every idle connection up to `max_connections`, for `keepalive_expiry`.
    """
    return httpx2.Limits(
        max_connections=max(MAX_CONNECTIONS, keep_alive),
        max_keepalive_connections=keep_alive,
        keepalive_expiry=KEEPALIVE_SECONDS,
    )


def request_body(params: Mapping[str, Any]) -> bytes:
    """A request's JSON, written as the SDKs write it (compact, UTF-8 as it is, no NaN), to
    hand them as the body's bytes.

    Given a dict, an SDK walks and copies all of it on every call (looking for files to
    read, applying its types' transforms) before writing it: per call, a walk of the whole
    conversation, paid one call after another by a burst of turns starting at once. The
    body metering builds is plain JSON already; the SDK still sends it (auth, base URL,
    headers) and maps the answer's status to its exceptions.
    """
    return json.dumps(params, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


# Characters per output token assumed when a stream is cut before its usage arrives.
CHARS_PER_TOKEN = 4


def estimate_output_tokens(text_events: int, chars: int) -> int:
    """Output tokens of a stream cut short, from the text received.

    Providers report output usage only at the end (Anthropic in its last `message_delta`,
    an OpenAI-compatible server in the usage chunk before `[DONE]`), so a stream aborted
    mid-way (a cancel, a dropped connection) never hears its count. It is estimated,
    rounding up: one token per `CHARS_PER_TOKEN` characters, and never fewer than one per
    text event (each text delta carries at least one token). The text of a tool call's
    JSON is not counted: it is under-billed, never over-billed.
    """
    return max(text_events, -(-chars // CHARS_PER_TOKEN))


def retry_after(headers: Any) -> float | None:
    """The wait the server asked for, in seconds (`retry-after-ms` wins, as in the SDK)."""
    if headers is None:
        return None
    for name, scale in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        raw = headers.get(name)
        if raw is not None:
            try:
                return max(float(raw) / scale, 0.0)
            except ValueError:
                continue
    return None


def next_retry_delay(
    error: ProviderError, retryable: bool, progress: Progress, attempt: int, max_retries: int
) -> float:
    """How long to wait before attempt `attempt + 1`; raises `error` when there is none.

    One policy for every provider: only retryable failures, never once text was handed
    on (a retry would publish it twice), at most `max_retries`, the server's
    `retry-after` when it gave one (unless it asks for more than a person would wait),
    otherwise exponential backoff with jitter.
    """
    if not retryable or progress.texts > 0 or attempt >= max_retries:
        raise error
    delay = error.retry_after
    if delay is None:
        delay = min(0.5 * 2**attempt, 8.0) * random.uniform(0.75, 1.0)
    elif delay > MAX_RETRY_AFTER_SECONDS:
        raise error
    log.warning("provider_retry", attempt=attempt + 1, code=error.code, delay=round(delay, 3))
    return delay


# A failed attempt as its provider reads it: the error to report and whether a retry may
# cure it; None for a failure that is not the provider's answer (it propagates as it is).
Classify = Callable[[Exception], tuple[ProviderError, bool] | None]

Answer = TypeVar("Answer")


def connection_failed(exc: Exception) -> ProviderError:
    """The error of an attempt that never reached the provider, or lost it mid-answer."""
    return ProviderError(ErrorCode.PROVIDER_ERROR, f"connection to the provider failed: {exc!r}")


async def with_retries(
    attempt: Callable[[], Awaitable[Answer]],
    classify: Classify,
    progress: Progress,
    max_retries: int,
    sleep: Callable[[float], Awaitable[None]],
) -> Answer:
    """Run `attempt` until it answers, retrying the failures `classify` calls retryable
    as `next_retry_delay` allows; what each failed attempt consumed stays in `progress`
    (it is billed). The SDKs' own retries are off: only this loop knows whether text was
    handed on, after which a retry would publish it twice."""
    attempts = 0
    while True:
        try:
            return await attempt()
        except Exception as exc:
            failure = classify(exc)
            if failure is None:
                raise
            error, retryable = failure
        delay = next_retry_delay(error, retryable, progress, attempts, max_retries)
        progress.next_attempt()
        attempts += 1
        await sleep(delay)


async def sse_data(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The `data` of each server-sent event in a body read as `chunks` (its lines joined
    by newlines, as the spec joins them); events without data are skipped, and so is an
    event the body ends in the middle of (the spec drops it).

    Event names are not kept: both providers' data say what they are (Anthropic's carry
    their `type`, OpenAI's events have no names). The SDKs' decoders make an object of
    every event, line by line; this splits on the blank lines between events, which
    costs a fraction of that per token.
    """
    pending = b""
    async for chunk in chunks:
        pending += chunk
        if b"\r" in pending:
            # The spec allows CR LF and a lone CR too; a CR that ends a read waits for the
            # next one, as it may be the start of a CR LF split across them.
            held = pending.endswith(b"\r")
            pending = _lf_only(pending[:-1] if held else pending) + (b"\r" if held else b"")
        if b"\n\n" in pending:
            *events, pending = pending.split(b"\n\n")
            for event in events:
                if (data := _data_of(event)) is not None:
                    yield data
    last = _lf_only(pending)  # a CR held back that ended the body ends a line
    if last.endswith(b"\n\n") and (data := _data_of(last[:-2])) is not None:
        yield data


def _lf_only(text: bytes) -> bytes:
    return text.replace(b"\r\n", b"\n").replace(b"\r", b"\n")


def _data_of(event: bytes) -> bytes | None:
    """The data of one event's lines (comments and other fields skipped)."""
    if event.startswith(b"data: ") and b"\n" not in event:
        return event[6:]  # the common case: one line, the data alone
    lines = [
        line[5:].removeprefix(b" ") if line != b"data" else b""
        for line in event.split(b"\n")
        if line.startswith(b"data:") or line == b"data"
    ]
    return b"\n".join(lines) if lines else None


def json_object(data: bytes) -> dict[str, Any]:
    """An event's data, which both providers send as a JSON object, parsed by orjson
    (`json.loads` decodes the bytes to text, then parses: ten times orjson's time per
    event). A provider that sends anything else has broken its stream: the call fails
    with `provider_error`, billed for what it consumed until then, and is not retried,
    as a stream that ends before its last event is not."""
    try:
        event = orjson.loads(data)
    except orjson.JSONDecodeError:
        event = None
    if not isinstance(event, dict):
        raise ProviderError(
            ErrorCode.PROVIDER_ERROR,
            f"the provider sent an event that is not a JSON object: "
            f"{data[:200].decode(errors='replace')!r}",
        )
    return event


class Providers:
    """The providers one replica can call: the configured default, which serves every
    binding that names no provider, and the others configured beside it, which serve the
    bindings that name them (a binding names provider and model)."""

    def __init__(self, default: Provider, *others: Provider) -> None:
        self.default = default
        self._by_name = {p.name: p for p in others}
        self._by_name.setdefault(default.name, default)

    @property
    def names(self) -> list[str]:
        return sorted(self._by_name)

    def get(self, name: str | None) -> Provider | None:
        """The provider a binding names (None: the default), or None when not configured."""
        return self.default if name is None else self._by_name.get(name)

    async def close(self) -> None:
        for provider in {id(p): p for p in self._by_name.values()}.values():
            await provider.close()
