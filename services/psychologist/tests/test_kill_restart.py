"""Kill → restart → completes (ADR 0015 decision 5 and its acceptance case): the
psychologist runs as a real process, SIGKILLed after the model turns were billed and
before anything was recorded; the restarted process completes the analysis from the
redelivered closing, replaying the billed turns instead of paying for them again."""

from __future__ import annotations

import asyncio
from typing import Any

from nats.aio.client import Client

from contracts.events import EventType

from .conftest import Driver

FAST = {
    "AGENTBUS_REDELIVERY_BACKOFF": "[1.0, 2.0, 2.0, 2.0]",
    "AGENTBUS_OUTBOX_POLL_SECONDS": "0.2",
}


async def test_a_killed_analysis_completes_after_restart_without_paying_twice(
    bare: Driver, spawn: Any, nc: Client
) -> None:
    doomed = spawn("psychologist", AGENTBUS_FAULT_POINTS="psychologist.before_outcome", **FAST)
    await doomed.wait_ready(nc, "psychologist")
    s = await bare.session_with(3)
    await bare.close(s)

    assert await asyncio.to_thread(doomed.wait_exit) == -9  # died at the crash point
    assert bare.metering.calls == 1  # the turn ran and was billed
    assert await bare.analyses(s) == []  # and nothing was recorded

    restarted = spawn("psychologist", **FAST)
    await restarted.wait_ready(nc, "psychologist")
    completed = await bare.outcome(s)

    assert completed.type == EventType.ANALYSIS_COMPLETED
    [analysis] = await bare.analyses(s)
    assert analysis["run_id"] == f"psychologist.{s}.auto"
    assert len(await bare.events(s, EventType.HYPOTHESIS_PROPOSED.value)) == len(
        await bare.hypotheses(s)
    )
    # metering answered the replayed turn from its row: one call, one bill
    assert bare.metering.calls == 1
    usage = await bare.usage(run_id=analysis["run_id"])
    assert usage.total_calls == 1
