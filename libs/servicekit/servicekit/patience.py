"""Waiting out a dependency that is restarting, instead of failing on it.

A service asks another over NATS; while the other restarts (a deploy, a crash the
supervisor is curing), the request fails with `NoRespondersError` at once, or times
out, or the other answers `unavailable` (its own store is away). None of these says
anything about the request: the same request will succeed in a few seconds. So the
caller waits, with backoff, for as long as a person would wait (`dependency_wait_seconds`),
and only then reports the outage — as an outage, never as a fault of the work at hand:
counted as crashes, they would end healthy sessions.

A dependency already down for longer than the wait when a new request starts gets one
try: the person who sent it is told at once instead of after another full wait.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors
import nats.js.errors

from contracts.common import ErrorCode
from domain.errors import DomainError
from servicekit.client import CommandFailed
from servicekit.logs import get_logger

log = get_logger(__name__)

T = TypeVar("T")

# The bus's ways of saying "nobody is there right now" (not: "your request is wrong").
_UNREACHABLE: tuple[type[BaseException], ...] = (
    nats.errors.NoRespondersError,
    nats.js.errors.ServiceUnavailableError,  # JetStream not (yet) answering: a 503
    nats.js.errors.NoStreamResponseError,  # a publish no stream acknowledged (a node down)
    nats.errors.TimeoutError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    TimeoutError,
    ConnectionError,
)

FIRST_BACKOFF_SECONDS = 0.25
MAX_BACKOFF_SECONDS = 5.0


def is_unavailable(exc: BaseException) -> bool:
    """Whether `exc` means a dependency is restarting or unreachable, not a fault: the
    bus's own errors, or an `unavailable` answer, as sent (`CommandFailed`) or as a
    caller's door raises it (`DomainError`: the gateway's maps silence to one)."""
    if isinstance(exc, CommandFailed | DomainError):
        return exc.code == ErrorCode.UNAVAILABLE
    return isinstance(exc, _UNREACHABLE)


class Patience:
    """Retries what fails only because a dependency is away, for up to `wait_seconds`.

    One instance is shared by everything a service does, so what it learnt (the
    dependency has been away for a while) serves the next request too.
    """

    def __init__(
        self,
        wait_seconds: float,
        *,
        first_backoff: float = FIRST_BACKOFF_SECONDS,
        max_backoff: float = MAX_BACKOFF_SECONDS,
    ) -> None:
        self.wait_seconds = wait_seconds
        self._first = first_backoff
        self._max = max_backoff
        self._down_since: float | None = None
        # A wait ran out since the dependency last answered: it is known to be away.
        self._gave_up = False

    async def retry(self, attempt: Callable[[], Awaitable[T]], what: str) -> T:
        """`attempt()`'s result; an unavailable dependency is asked again with backoff
        until the wait is over, then its last exception is raised."""
        start = time.monotonic()
        long_down = self._gave_up or (
            self._down_since is not None and start - self._down_since > self.wait_seconds
        )
        deadline = start if long_down else start + self.wait_seconds
        delay = self._first
        while True:
            try:
                result = await attempt()
            except Exception as exc:
                if not is_unavailable(exc):
                    raise
                now = time.monotonic()
                if self._down_since is None:
                    self._down_since = now
                if now + delay > deadline:
                    self._gave_up = True
                    log.warning(
                        "dependency_unavailable_gave_up",
                        what=what,
                        waited=round(now - start, 1),
                        error=repr(exc),
                    )
                    raise
                log.info("dependency_unavailable_waiting", what=what, error=repr(exc))
                await asyncio.sleep(delay)  # backoff against a restarting service
                delay = min(delay * 2, self._max)
                continue
            self._down_since, self._gave_up = None, False
            return result
