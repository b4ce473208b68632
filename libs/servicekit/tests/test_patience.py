"""`Patience`: a dependency that is away is asked again until the wait is over; any
other failure is raised at once; a dependency long away gets one try."""

from __future__ import annotations

import nats.errors
import nats.js.errors
import pytest

from contracts.common import ErrorCode
from domain.errors import DomainError
from servicekit.client import CommandFailed
from servicekit.patience import Patience, is_unavailable


class Flaky:
    """Fails with `error` the first `failures` calls, then answers."""

    def __init__(self, failures: int, error: Exception) -> None:
        self.failures = failures
        self.error = error
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return "answered"


@pytest.mark.parametrize(
    ("exc", "unavailable"),
    [
        (nats.errors.NoRespondersError(), True),
        (nats.errors.TimeoutError(), True),
        (nats.js.errors.ServiceUnavailableError(), True),
        (CommandFailed(ErrorCode.UNAVAILABLE, "db away"), True),
        (CommandFailed(ErrorCode.INVALID_REQUEST, "bad"), False),
        (DomainError(ErrorCode.UNAVAILABLE, "cmd.events.list did not answer"), True),
        (DomainError(ErrorCode.SESSION_NOT_FOUND, "no such session"), False),
        (ValueError("a bug"), False),
    ],
)
def test_what_counts_as_a_dependency_away(exc: Exception, unavailable: bool) -> None:
    assert is_unavailable(exc) is unavailable


async def test_a_dependency_back_within_the_wait_is_answered() -> None:
    patience = Patience(10.0, first_backoff=0.01, max_backoff=0.02)
    flaky = Flaky(3, nats.errors.NoRespondersError())
    assert await patience.retry(flaky, "test") == "answered"
    assert flaky.calls == 4


async def test_a_fault_is_raised_at_once() -> None:
    patience = Patience(10.0, first_backoff=0.01)
    flaky = Flaky(5, ValueError("a bug"))
    with pytest.raises(ValueError):
        await patience.retry(flaky, "test")
    assert flaky.calls == 1


async def test_away_past_the_wait_it_gives_up_then_tries_once_while_still_away() -> None:
    patience = Patience(0.05, first_backoff=0.01, max_backoff=0.01)
    away = Flaky(10_000, nats.errors.NoRespondersError())
    with pytest.raises(nats.errors.NoRespondersError):
        await patience.retry(away, "first")
    assert away.calls > 1
    before = away.calls
    with pytest.raises(nats.errors.NoRespondersError):
        await patience.retry(away, "second")
    assert away.calls == before + 1  # already away longer than the wait: one try

    # Back: answered, and the next outage is waited for in full again.
    away.failures = 0
    assert await patience.retry(away, "third") == "answered"
    again = Flaky(2, nats.errors.NoRespondersError())
    assert await patience.retry(again, "fourth") == "answered"
