"""A metering replica SIGKILLed mid-turn (issue 13): its beats stop, no reply ever comes,
and Criativo does not wait out the request's 600 s: a turn whose replica is silent for
`stream_silence_seconds` is tried again under the turn's retry id, on the replica that
is back, and the message is answered once — whether the replica died mid-stream or
before the first delta (issue 12: the beat, not the deltas, is the liveness)."""

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
# A model that thinks for ten minutes before its first word, then one that answers at once.
THINKING = {"steps": [{"text": "Pensei muito.", "token_delay_ms": 600_000}]}
QUICK = {"steps": [{"text": "Resposta rápida."}]}


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


async def test_metering_sigkilled_before_the_first_delta_the_turn_is_retried_and_answered_once(
    without_metering: Driver,
    spawn: Any,
    nc: Client,
    nats_url: str,
    database_url: str,
    tmp_path: Path,
) -> None:
    driver = without_metering
    scripts = {}
    for name, script in (("thinking", THINKING), ("quick", QUICK)):
        scripts[name] = tmp_path / f"{name}.json"
        scripts[name].write_text(json.dumps(script))
    metering = spawn(
        "metering", AGENTBUS_PROVIDER="scripted", AGENTBUS_SCRIPT_PATH=str(scripts["thinking"])
    )
    await metering.wait_ready(nc, "metering")
    async with AsyncExitStack() as stack:
        await start_criativo(stack, nc, nats_url, database_url, stream_silence_seconds=2.0)
        session = await driver.open()
        deltas: list[dict[str, Any]] = []
        beats: list[str] = []

        async def on_delta(msg: Msg) -> None:
            deltas.append(json.loads(msg.data))

        async def on_beat(msg: Msg) -> None:
            beats.append(msg.subject)

        for subject, cb in (
            (subjects.delta_subject(driver.project, str(session)), on_delta),
            (subjects.alive_subject("*"), on_beat),
        ):
            sub = await nc.subscribe(subject, cb=cb)
            stack.push_async_callback(sub.unsubscribe)
        said = await driver.say(session, "Um app para padarias de bairro")
        first = f"criativo.{said}.1"
        # Metering has the turn (its hold is taken) and the model has not written a word.
        await wait_for(
            lambda: driver.db.fetchval(
                "SELECT true FROM metering.budget_holds WHERE turn_id = $1", first
            ),
            what="metering to take the turn",
        )
        await wait_for(lambda: len(beats) >= 2, what="metering to beat while the model thinks")
        assert deltas == []

        metering.kill()  # SIGKILL before the first delta: no reply will ever come
        metering.start(AGENTBUS_PROVIDER="scripted", AGENTBUS_SCRIPT_PATH=str(scripts["quick"]))
        await metering.wait_ready(nc, "metering")

        # Well inside the request's 600 s: the silence gives the replica up.
        answer = await driver.outcome(session, said)
        assert answer.type.value == "agent.response"
        assert answer.payload["turn_id"] == f"{first}.r1"
        assert answer.payload["text"] == QUICK["steps"][0]["text"]
        assert {d["turn_id"] for d in deltas} == {f"{first}.r1"}
        outcomes = [e for e in await driver.events(session, "agent.") if e.causation_id == said]
        assert [e.type.value for e in outcomes] == ["agent.response"]
