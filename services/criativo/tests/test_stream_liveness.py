"""A metering replica SIGKILLed mid-turn (issue 13): its beats stop, no reply ever comes,
and Criativo does not wait out the request's 600 s: a turn whose replica is silent for
`stream_silence_seconds` is tried again under the turn's retry id, on the replica that
is back, and the message is answered once — whether the replica died mid-stream or
before the first delta (issue 12: the beat, not the deltas, is the liveness)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest_asyncio
from nats.aio.client import Client
from nats.aio.msg import Msg

from contracts import subjects
from contracts.events import Event
from testkit.probes import wait_for
from testkit.services import ServiceProcess

from .conftest import Driver
from .test_dependency_restarting import start_criativo, without_metering

__all__ = ["without_metering"]  # the fixture, shared with the restarting-dependency tests

# Slow enough to be killed mid-stream: 40 words, one every 100 ms.
SLOW = {"steps": [{"text": " ".join(f"w{i}" for i in range(40)), "token_delay_ms": 100}]}
# A model that thinks for ten minutes before its first word, then one that answers at once.
THINKING = {"steps": [{"text": "Pensei muito.", "token_delay_ms": 600_000}]}
QUICK = {"steps": [{"text": "Resposta rápida."}]}
# A model slower than Criativo's silence window (2 s here), writing a word every 1.5 s.
PONDERING = {"steps": [{"text": "Uma resposta pensada bem devagar.", "token_delay_ms": 1500}]}


@dataclass
class Scene:
    """Criativo quick to give a silent replica up; metering, a real process, the test's to
    start on a script, kill and start again; what the bus carried, by kind."""

    driver: Driver
    nc: Client
    spawn: Any
    tmp_path: Path
    stack: AsyncExitStack
    metering: ServiceProcess | None = None

    def scripted(self, name: str, script: dict[str, Any]) -> dict[str, str]:
        path = self.tmp_path / f"{name}.json"
        path.write_text(json.dumps(script))
        return {"AGENTBUS_PROVIDER": "scripted", "AGENTBUS_SCRIPT_PATH": str(path)}

    async def start_metering(self, env: dict[str, str]) -> None:
        if self.metering is None:
            self.metering = self.spawn("metering", **env)
        else:
            self.metering.start(**env)
        await self.metering.wait_ready(self.nc, "metering")

    async def collect(self, subject: str) -> list[Msg]:
        """Every message on `subject` from now on."""
        seen: list[Msg] = []

        async def on_msg(msg: Msg) -> None:
            seen.append(msg)

        sub = await self.nc.subscribe(subject, cb=on_msg)
        self.stack.push_async_callback(sub.unsubscribe)
        return seen

    async def answered_once(self, session: uuid.UUID, said: uuid.UUID) -> Event:
        """The message's one outcome, once it exists: an `agent.response`."""
        answer = await self.driver.outcome(session, said)
        events = await self.driver.events(session, "agent.")
        assert [e.type.value for e in events if e.causation_id == said] == ["agent.response"]
        return answer


@pytest_asyncio.fixture(loop_scope="session")
async def scene(
    without_metering: Driver,
    spawn: Any,
    nc: Client,
    nats_url: str,
    database_url: str,
    tmp_path: Path,
) -> AsyncIterator[Scene]:
    async with AsyncExitStack() as stack:
        await start_criativo(stack, nc, nats_url, database_url, stream_silence_seconds=2.0)
        yield Scene(without_metering, nc, spawn, tmp_path, stack)


def turn_ids(deltas: list[Msg]) -> set[str]:
    return {json.loads(m.data)["turn_id"] for m in deltas}


async def test_metering_sigkilled_mid_stream_the_turn_is_retried_and_answered_once(
    scene: Scene,
) -> None:
    slow = scene.scripted("slow", SLOW)
    await scene.start_metering(slow)
    session = await scene.driver.open()
    deltas = await scene.collect(subjects.delta_subject(scene.driver.project, str(session)))
    said = await scene.driver.say(session, "Um app para padarias de bairro")
    await wait_for(lambda: deltas, what="the answer to start streaming")

    assert scene.metering is not None
    scene.metering.kill()  # SIGKILL mid-stream: no reply will ever come for this turn id
    await scene.start_metering(slow)

    # Well inside the request's 600 s: the silence gives the replica up.
    answer = await scene.answered_once(session, said)
    first = f"criativo.{said}.1"
    assert answer.payload["turn_id"] == f"{first}.r1"
    assert answer.payload["text"] == SLOW["steps"][0]["text"]
    assert turn_ids(deltas) == {first, f"{first}.r1"}
    assert uuid.UUID(str(answer.causation_id)) == said


async def test_metering_sigkilled_before_the_first_delta_the_turn_is_retried_and_answered_once(
    scene: Scene,
) -> None:
    await scene.start_metering(scene.scripted("thinking", THINKING))
    session = await scene.driver.open()
    deltas = await scene.collect(subjects.delta_subject(scene.driver.project, str(session)))
    beats = await scene.collect(subjects.alive_subject("*"))
    said = await scene.driver.say(session, "Um app para padarias de bairro")
    first = f"criativo.{said}.1"
    # Metering has the turn (its hold is taken) and the model has not written a word.
    await wait_for(
        lambda: scene.driver.db.fetchval(
            "SELECT true FROM metering.budget_holds WHERE turn_id = $1", first
        ),
        what="metering to take the turn",
    )
    await wait_for(lambda: len(beats) >= 2, what="metering to beat while the model thinks")
    assert deltas == []

    assert scene.metering is not None
    scene.metering.kill()  # SIGKILL before the first delta: no reply will ever come
    await scene.start_metering(scene.scripted("quick", QUICK))

    # Well inside the request's 600 s: the silence gives the replica up.
    answer = await scene.answered_once(session, said)
    assert answer.payload["turn_id"] == f"{first}.r1"
    assert answer.payload["text"] == QUICK["steps"][0]["text"]
    assert turn_ids(deltas) == {f"{first}.r1"}


async def test_a_live_replica_slower_than_the_silence_window_runs_and_bills_the_turn_once(
    scene: Scene,
) -> None:
    """A replica that beats is never given up, however long its model takes: the turn is
    not run again under a retry id, so it is not billed twice."""
    await scene.start_metering(scene.scripted("pondering", PONDERING))
    session = await scene.driver.open()
    said = await scene.driver.say(session, "Um app para padarias de bairro")

    answer = await scene.answered_once(session, said)
    first = f"criativo.{said}.1"
    assert answer.payload["turn_id"] == first
    billed = await scene.driver.db.fetch(
        "SELECT turn_id FROM metering.token_usage WHERE turn_id LIKE $1", f"{first}%"
    )
    assert [r["turn_id"] for r in billed] == [first]
