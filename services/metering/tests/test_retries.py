"""The providers' one retry loop (`providers.base.with_retries`), called directly: which
failures it retries, how often, and what each failed attempt leaves billed."""

from __future__ import annotations

import pytest

from contracts.common import ErrorCode
from contracts.metering import TokenUsage
from metering.providers.base import Progress, ProviderError, with_retries

OVERLOADED = ProviderError(ErrorCode.PROVIDER_OVERLOADED, "overloaded")
REFUSED = ProviderError(ErrorCode.PROVIDER_ERROR, "bad request")


class Flaky(Exception):
    """What an SDK raises; `retryable` as the provider's classification reads it."""

    def __init__(self, error: ProviderError, retryable: bool) -> None:
        super().__init__(error.message)
        self.error, self.retryable = error, retryable


def read(exc: Exception) -> tuple[ProviderError, bool] | None:
    return (exc.error, exc.retryable) if isinstance(exc, Flaky) else None


class Attempts:
    """Fails with `failures` in turn, each after consuming 10 input tokens, then answers."""

    def __init__(self, progress: Progress, *failures: Exception, texts: int = 0) -> None:
        self.progress, self.failures, self.texts, self.calls = progress, list(failures), texts, 0

    async def __call__(self) -> str:
        self.calls += 1
        self.progress.current = TokenUsage(input_tokens=10)
        self.progress.texts += self.texts
        if self.failures:
            raise self.failures.pop(0)
        return "answer"


async def test_retryable_failures_are_retried_and_every_attempt_stays_billed() -> None:
    progress = Progress()
    sleeps: list[float] = []

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)

    attempt = Attempts(progress, Flaky(OVERLOADED, True), Flaky(OVERLOADED, True))
    assert await with_retries(attempt, read, progress, 4, sleep) == "answer"
    assert attempt.calls == 3 and len(sleeps) == 2
    assert progress.usage.input_tokens == 30


@pytest.mark.parametrize(
    ("failures", "max_retries", "texts", "raised", "calls"),
    [
        # not curable by a retry: reported at once
        ([Flaky(REFUSED, False)], 4, 0, REFUSED, 1),
        # retried until the retries run out, then reported
        ([Flaky(OVERLOADED, True)] * 3, 2, 0, OVERLOADED, 3),
        # once text was handed on, a retry would publish it twice
        ([Flaky(OVERLOADED, True)], 4, 1, OVERLOADED, 1),
    ],
)
async def test_a_failure_a_retry_cannot_cure_is_reported(
    failures: list[Exception], max_retries: int, texts: int, raised: ProviderError, calls: int
) -> None:
    progress = Progress()

    async def sleep(seconds: float) -> None:
        pass

    attempt = Attempts(progress, *failures, texts=texts)
    with pytest.raises(ProviderError) as reported:
        await with_retries(attempt, read, progress, max_retries, sleep)
    assert reported.value is raised and attempt.calls == calls


async def test_a_failure_the_provider_does_not_classify_propagates_as_it_is() -> None:
    progress = Progress()
    odd = ValueError("not the provider's answer")

    async def sleep(seconds: float) -> None:
        raise AssertionError("nothing to wait for")

    with pytest.raises(ValueError) as raised:
        await with_retries(Attempts(progress, odd), read, progress, 4, sleep)
    assert raised.value is odd
