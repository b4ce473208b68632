"""The beat of a streaming turn: a caller waiting on `cmd.llm.stream` hears that a replica
is still handling its turn (`LlmStream.alive_subject`), from the moment the handler takes
it (before the reservation) to the reply — before the first delta too, while the provider
thinks. Each beat's body is the turn's id, so a caller hears all its streams on one
subject. A replica SIGKILLed mid-turn stops beating, and the caller retries the turn
without waiting out its request's timeout, and without reading the turn's deltas to find
out (harness.client).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from nats.aio.client import Client

from contracts.metering import LlmStream, LlmTurn
from servicekit.logs import get_logger

log = get_logger(__name__)


@contextlib.asynccontextmanager
async def beating(nc: Client, cmd: LlmTurn) -> AsyncIterator[None]:
    """Beat on the turn's alive subject, if it names one, while the block runs."""
    if not isinstance(cmd, LlmStream) or cmd.alive_subject is None:
        yield
        return
    beat = asyncio.create_task(
        _beat(nc, cmd.alive_subject, cmd.turn_id.encode(), cmd.alive_every_seconds),
        name=f"beat:{cmd.turn_id}",
    )
    try:
        yield
    finally:
        # Not awaited: a cancelled block (shutting down) must not wait on, or swallow the
        # cancellation of, its beat.
        beat.cancel()


async def _beat(nc: Client, subject: str, turn_id: bytes, every_seconds: float) -> None:
    while True:
        try:
            # The turn id: a caller's streams share one alive subject (harness.client).
            await nc.publish(subject, turn_id)
        except Exception as exc:  # the next beat tries again; the turn is not affected
            log.warning("beat_failed", subject=subject, error=repr(exc))
        await asyncio.sleep(every_seconds)
