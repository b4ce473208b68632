"""A metering replica SIGKILLed mid-turn (issue 13): the stream's deltas stop, no reply
ever comes, and Criativo does not wait out the request's 600 s: a started stream silent
for `stream_silence_seconds` is tried again under the turn's retry id, on the replica
that is back, and the message is answered once."""

from __future__ import annotations

import json
import uuid
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg

from contracts import subjects
from servicekit.testing import wait_for

from .conftest import Driver
from .test_dependency_restarting import start_criativo, without_metering

__all__ = ["without_metering"]  # the fixture, shared with the restarting-dependency tests

# Slow enough to be killed mid-stream: 40 words, one every 100 ms.
SLOW = {"steps": [{"text": " ".join(f"w{i}" for i in range(40)), "token_delay_ms": 100}]}


async def test_metering_sigkilled_mid_stream_the_turn_is_retried_and_answered_once(
    without_metering: Driver,
    spawn: Any,
    nc: Client,
    nats_url: str,
    database_url: str,
    tmp_path: Path,
) -> None:
    driver = without_metering
    script = tmp_path / "slow.json"
    script.write_text(json.dumps(SLOW))
    env = {"AGENTBUS_PROVIDER": "scripted", "AGENTBUS_SCRIPT_PATH": str(script)}
    metering = spawn("metering", **env)
    await metering.wait_ready(nc, "metering")
    async with AsyncExitStack() as stack:
        await start_criativo(stack, nc, nats_url, database_url, stream_silence_seconds=2.0)
        session = await driver.open()
        deltas: list[dict[str, Any]] = []

        async def on_delta(msg: Msg) -> None:
            deltas.append(json.loads(msg.data))

        sub = await nc.subscribe(subjects.delta_subject(driver.project, str(session)), cb=on_delta)
        stack.push_async_callback(sub.unsubscribe)
        said = await driver.say(session, "Um app para padarias de bairro")
        await wait_for(lambda: deltas, what="the answer to start streaming")

        metering.kill()  # SIGKILL mid-stream: no reply will ever come for this turn id
        metering.start(**env)
        await metering.wait_ready(nc, "metering")

        # Well inside the request's 600 s: the silence gives the replica up.
        answer = await driver.outcome(session, said)
        assert answer.type.value == "agent.response"
        first = f"criativo.{said}.1"
        assert answer.payload["turn_id"] == f"{first}.r1"
        assert answer.payload["text"] == SLOW["steps"][0]["text"]
        assert {d["turn_id"] for d in deltas} == {first, f"{first}.r1"}
        outcomes = [e for e in await driver.events(session, "agent.") if e.causation_id == said]
        assert [e.type.value for e in outcomes] == ["agent.response"]
        assert uuid.UUID(str(answer.causation_id)) == said
