"""What metering asks of a provider, and what a provider tells back — including when it fails.

A provider fills a `Progress` as the call goes (usage from the first event,
cumulative usage from every later one, the time of the first token), so that a
call that fails or is cancelled halfway is still billed for what the provider
produced (DESIGN.md: streaming usage).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from contracts.metering import ChatMessage, ReplyBlock, TokenUsage, ToolSpec

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


class Provider(Protocol):
    """An LLM behind metering: `anthropic` or `scripted`."""

    name: str

    async def complete(
        self, request: ProviderRequest, progress: Progress, on_text: OnText | None
    ) -> ProviderReply:
        """Run the call, streaming text to `on_text` when given; fill `progress` as it goes."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...
