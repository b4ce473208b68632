"""The supervisor restarts a process that ran a while at once, and one that keeps dying
young with a growing delay: a replica SIGKILLed under load is back as soon as it can
start, a broken one does not spin."""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from devstack import stack
from devstack.services import ServiceSpec
from devstack.stack import RESTART_MAX_DELAY, SETTLED_AFTER, Supervised, restart_delay
from testkit.probes import wait_for

# Runs a while the first time (a replica that started and served, then died), and dies
# at once every time after (a start-up that fails).
DIES = """
from pathlib import Path
runs = Path(__file__).with_name("runs")
n = len(runs.read_text()) if runs.exists() else 0
runs.write_text("x" * (n + 1))
if n == 0:
    import time
    time.sleep(3)
raise SystemExit(3)
"""


@pytest.mark.timeout(60)
async def test_a_process_that_ran_a_while_restarts_at_once_and_a_crash_loop_backs_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the first run's three seconds count as a while; a start that fails (an interpreter
    # starting, on a loaded machine) does not
    monkeypatch.setattr(stack, "SETTLED_AFTER", 2.5)
    (tmp_path / "dies.py").write_text(DIES)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    supervised = Supervised(ServiceSpec("dies", "dies"), env)
    with capture_logs() as logged:
        running = asyncio.create_task(supervised.run())
        try:
            await wait_for(lambda: supervised.restarts >= 3, timeout=30, what="three restarts")
        finally:
            await supervised.stop()
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running
    delays = [e["restart_in"] for e in logged if e["event"] == "service_died_restarting"]
    assert delays[:3] == [0.0, 1.0, 2.0]


def test_the_delay_grows_only_while_a_process_keeps_dying_young() -> None:
    young, settled = SETTLED_AFTER / 2, SETTLED_AFTER
    assert restart_delay(settled, 0.0) == 0.0  # a death after a good run
    delays = [0.0]
    for _ in range(8):
        delays.append(restart_delay(young, delays[-1]))
    assert delays[1:5] == [1.0, 2.0, 4.0, 8.0]
    assert delays[-1] == RESTART_MAX_DELAY  # capped
    assert restart_delay(settled, RESTART_MAX_DELAY) == 0.0  # a good run forgives the loop
