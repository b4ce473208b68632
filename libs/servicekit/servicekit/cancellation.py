"""Cancellation that is not lost.

On Python 3.11, `asyncio.wait_for` — used inside nats-py's `fetch` and `request` —
swallows a cancellation that arrives together with its result. A loop that only
relies on `CancelledError` being raised then runs on after it was told to stop, and
a shutdown waits for ever. Loops call `raise_if_cancelling()` at each turn.
"""

from __future__ import annotations

import asyncio


def raise_if_cancelling() -> None:
    """Raise `CancelledError` if the current task was asked to stop, even if the request
    was swallowed by a `wait_for` below us."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def stop(task: asyncio.Task[object], grace: float = 5.0) -> None:
    """Cancel `task` and wait for it to end, cancelling again if a cancellation was lost."""
    task.cancel()
    while not task.done():
        await asyncio.wait({task}, timeout=grace)
        if not task.done():
            task.cancel()
