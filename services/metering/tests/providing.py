"""What the providers' tests (Anthropic, OpenAI-compatible) share: stand-ins for the
provider's sleep and its text callback, and a call that must fail."""

from __future__ import annotations

import pytest

from metering.providers.base import Progress, Provider, ProviderError, ProviderRequest


class Sleeps:
    """Records the waits the provider asks for instead of sleeping through them."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)


class Texts:
    """The text the provider handed on, piece by piece."""

    def __init__(self) -> None:
        self.pieces: list[str] = []

    async def __call__(self, text: str, emitted_at: float) -> None:
        self.pieces.append(text)


async def failed_call(
    llm: Provider, request: ProviderRequest
) -> tuple[ProviderError, Progress, Texts]:
    """One call that must fail, then `llm` closed: its error, and what it billed and handed
    on before it failed."""
    progress, texts = Progress(), Texts()
    with pytest.raises(ProviderError) as failed:
        await llm.complete(request, progress, texts)
    await llm.close()
    return failed.value, progress, texts
