"""Metering SIGKILLed mid-analysis (issue 13: a closed session still had no analysis
when the N = 100 chaos run's 300 s settle ended). The turn's metering replica never
replies; the psychologist, whose whole-reply turns have no other sign of life, gives
the turn up after `turn_lost_seconds` instead of holding the closing for the request's
600 s, and runs it again under its retry id on the replica that is back: the session is
analysed once, and the lost turn is billed once, at its hold."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest_asyncio
from nats.aio.client import Client

from contracts.events import EventType
from psychologist.app import main as psychologist_main
from session_events.app import main as log_main
from session_events.settings import LogSettings
from testkit.probes import wait_for
from testkit.services import running_service

from .conftest import FINISHED, LogDriver, psychologist_settings

# The first turn writes for ~3 s (time to be killed in), then offers an empty batch,
# which the tool refuses; the second emits valid hypotheses.
SLOW_FIRST_TURN = {
    "steps": [
        {
            "has_tool": "emit_hypotheses",
            "after_tool_result": False,
            "text": " ".join(f"w{i}" for i in range(30)),
            "token_delay_ms": 100,
            "tool_calls": [{"name": "emit_hypotheses", "input": {"hypotheses": []}}],
        },
        {
            "has_tool": "emit_hypotheses",
            "after_tool_error": True,
            "responder": "psychologist_hypotheses",
        },
        {"has_tool": "emit_hypotheses", "text": "Analysis complete."},
    ]
}
# Well past the healthy turn's ~3 s, well short of the request's 600 s.
TURN_LOST_SECONDS = 10.0


@pytest_asyncio.fixture(loop_scope="session")
async def log_only(nats_url: str, database_url: str, nc: Client) -> AsyncIterator[asyncpg.Pool]:
    """The log in this process; metering and the psychologist are the test's to start."""
    settings = LogSettings(nats_url=nats_url, database_url=database_url, outbox_poll_seconds=0.2)
    async with running_service(log_main(settings), nc, "session_events"):
        pool = await asyncpg.create_pool(database_url, min_size=1, max_size=4)
        assert pool is not None
        try:
            yield pool
        finally:
            await pool.close()


async def killed_mid_turn(pool: asyncpg.Pool, run_id: str, *killed: Any) -> None:
    """SIGKILL `killed` once metering has taken the run's first turn: no reply will ever
    come for that turn id, and its hold stays open until a live replica settles it."""
    await wait_for(
        lambda: pool.fetchval(
            "SELECT true FROM metering.budget_holds WHERE turn_id = $1", f"{run_id}.1"
        ),
        timeout=30,
        what="the analysis's first turn taken by metering",
    )
    for process in killed:
        process.kill()


async def analysed_once_under_the_retry_id(driver: LogDriver, session: uuid.UUID) -> None:
    run_id = f"psychologist.{session}.auto"
    # Well inside the request's 600 s: the lost turn is given up and retried.
    outcome = await driver.outcome(session, timeout=120)
    assert outcome.type == EventType.ANALYSIS_COMPLETED, outcome.payload
    outcomes = [e for e in await driver.events(session) if e.type.value in FINISHED]
    assert outcomes == [outcome]  # analysed exactly once
    billed = await driver.db.fetch(
        "SELECT turn_id, billed_at_hold FROM metering.token_usage WHERE run_id = $1"
        " ORDER BY turn_id",
        run_id,
    )
    # the killed turn is billed once, at its hold (its real usage died with its replica),
    # by the replica restarted under its instance id before it serves; its retry and the
    # second iteration one bill each
    assert [(r["turn_id"], r["billed_at_hold"]) for r in billed] == [
        (f"{run_id}.1", True),
        (f"{run_id}.1.r1", False),
        (f"{run_id}.2", False),
    ]


def slow_metering(spawn: Any, tmp_path: Path) -> tuple[Any, dict[str, str]]:
    script = tmp_path / "slow.json"
    script.write_text(json.dumps(SLOW_FIRST_TURN))
    env = {"AGENTBUS_PROVIDER": "scripted", "AGENTBUS_SCRIPT_PATH": str(script)}
    return spawn("metering", **env), env


async def test_metering_sigkilled_mid_turn_the_analysis_completes_once_under_the_retry_id(
    log_only: asyncpg.Pool,
    spawn: Any,
    nc: Client,
    nats_url: str,
    database_url: str,
    tmp_path: Path,
) -> None:
    metering, env = slow_metering(spawn, tmp_path)
    await metering.wait_ready(nc, "metering")
    settings = psychologist_settings(nats_url, database_url, turn_lost_seconds=TURN_LOST_SECONDS)
    async with running_service(psychologist_main(settings), nc, "psychologist"):
        driver = LogDriver(nc, log_only, f"p-{uuid.uuid4().hex[:8]}")
        session = await driver.session_with(3)
        await driver.close(session)
        await killed_mid_turn(log_only, f"psychologist.{session}.auto", metering)
        metering.start(**env)
        await metering.wait_ready(nc, "metering")
        await analysed_once_under_the_retry_id(driver, session)


async def test_metering_and_the_psychologist_sigkilled_mid_turn_the_redelivery_waits_it_out(
    log_only: asyncpg.Pool, spawn: Any, nc: Client, tmp_path: Path
) -> None:
    """The closing is redelivered to a psychologist that never saw the turn: metering says
    it is still in progress (its dead replica's hold), which is waited for as long as a
    live turn could take, then given up for its retry id — not failed by redelivery."""
    metering, env = slow_metering(spawn, tmp_path)
    mind = {
        "AGENTBUS_TURN_LOST_SECONDS": str(TURN_LOST_SECONDS),
        "AGENTBUS_REDELIVERY_BACKOFF": "[1.0, 2.0, 2.0, 2.0]",
        "AGENTBUS_OUTBOX_POLL_SECONDS": "0.2",
    }
    psychologist = spawn("psychologist", **mind)
    await metering.wait_ready(nc, "metering")
    await psychologist.wait_ready(nc, "psychologist")
    driver = LogDriver(nc, log_only, f"p-{uuid.uuid4().hex[:8]}")
    session = await driver.session_with(3)
    await driver.close(session)
    await killed_mid_turn(log_only, f"psychologist.{session}.auto", metering, psychologist)
    metering.start(**env)
    psychologist.start(**mind)
    await metering.wait_ready(nc, "metering")
    await psychologist.wait_ready(nc, "psychologist")
    await analysed_once_under_the_retry_id(driver, session)
