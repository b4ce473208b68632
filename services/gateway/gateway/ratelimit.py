"""A token bucket per connection: a flood gets `rate_limited` errors, not a crash."""

from __future__ import annotations

import time


class TokenBucket:
    """`burst` frames at once, refilled at `rate` per second."""

    def __init__(self, rate: float, burst: int) -> None:
        self._rate = rate
        self._burst = float(burst)
        self._tokens = float(burst)
        self._at = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self._tokens = min(self._burst, self._tokens + (now - self._at) * self._rate)
        self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False
