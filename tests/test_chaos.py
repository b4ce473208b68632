"""The CI-sized chaos run (issue 13): `bench/chaos.py` with 10 people through the gateway
WebSocket, on a 3-node JetStream cluster with two replicas of every service, while every
service loses a replica to SIGKILL once, one NATS node is SIGKILLed and started again,
both gateways restart and Postgres pauses. The script checks the invariants itself (every
message answered once, the WebSocket equal to the log, one brief and one offer, every
closed session analysed once, usage rows equal to the model's calls, no overspend,
outboxes drained, no dead letter) and exits non-zero with the evidence when one breaks.
`make chaos` runs the same at N = 100.

Opt-in for now (`AGENTBUS_CHAOS_TEST=1`, or `make chaos`): on a fresh clone after the
session-13 merges the chaos round hung once in two runs (a person waiting past the test's
bound for an answer, cause not found yet; issue 13's note). A person now gives up after
`--patience` seconds, so a hang fails here with the script's evidence instead of a
timeout that hides it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CHAOS = Path(__file__).resolve().parents[1] / "bench" / "chaos.py"


@pytest.mark.skipif(
    os.environ.get("AGENTBUS_CHAOS_TEST") != "1",
    reason="opt-in until the chaos round's intermittent hang is found (AGENTBUS_CHAOS_TEST=1)",
)
@pytest.mark.timeout(480)  # ~2 min alone; the margin is for a machine shared with others
def test_ten_people_keep_every_invariant_while_replicas_nats_and_postgres_fail() -> None:
    argv = [sys.executable, str(CHAOS), "--people", "10", "--kills", "1", "--gap", "1.0"]
    argv += ["--patience", "240"]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=450, check=False)
    report = run.stdout + run.stderr[-4000:]
    assert run.returncode == 0, report
    assert "all invariants held" in run.stdout, report
    assert "1 NATS node" in run.stdout, report
    # every service lost a replica: six SIGKILLs, the supervisor restarted each
    assert "6 replica SIGKILLs" in run.stdout, report
