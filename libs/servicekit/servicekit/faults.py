"""Crash points for the reliability tests.

`AGENTBUS_FAULT_POINTS=outbox.before_publish` makes the process SIGKILL itself the
first time it reaches that point, so a test can prove that a crash between two
steps loses and duplicates nothing. Unset (always, outside tests) it costs one
set lookup.
"""

from __future__ import annotations

import os
import signal

_ARMED = frozenset(p for p in os.environ.get("AGENTBUS_FAULT_POINTS", "").split(",") if p)


def crash_point(name: str) -> None:
    """Die at once, as `kill -9` would, if the tests armed this point."""
    if name in _ARMED:
        os.kill(os.getpid(), signal.SIGKILL)
