"""The beats of a client's streams (harness.client): one alive subject for all of them,
each beat naming its turn, so a stream is kept alive by its own turn's beats only."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from contracts import subjects
from contracts.metering import ChatMessage, LlmStream
from harness import MeteringClient
from harness.client import StreamSilent
from metering.providers.scripted import Script, ScriptedProvider, ScriptStep
from testkit.metering import Starter
from testkit.probes import subscribed, wait_for

# Long enough to beat a few times (every 0.25 s below): 12 words, one every 50 ms.
SLOW = Script(steps=[ScriptStep(text=" ".join(f"w{i}" for i in range(12)), token_delay_ms=50)])
SESSION = uuid.uuid4()


def streamed(turn_id: str) -> LlmStream:
    return LlmStream(
        run_id=f"run-{uuid.uuid4().hex[:10]}",
        turn_id=turn_id,
        agent_slug="talker",
        project_id="proj",
        session_id=SESSION,
        messages=[ChatMessage(role="user", content="Olá")],
        max_tokens=64,
        delta_subject=subjects.delta_subject("proj", SESSION),
    )


async def collect(nc: Client, subject: str) -> list[Msg]:
    seen: list[Msg] = []

    async def on_msg(msg: Msg) -> None:
        seen.append(msg)

    await nc.subscribe(subject, cb=on_msg)
    return seen


async def test_a_clients_streams_share_one_alive_subject_and_each_beat_names_its_turn(
    nc: Client, start_metering: Starter
) -> None:
    await start_metering(provider=ScriptedProvider(SLOW))
    # A copy of each request (outside the queue group) and every beat.
    requests = await collect(nc, subjects.LLM_STREAM)
    beats = await collect(nc, subjects.alive_subject("*"))
    await subscribed(nc)
    client = MeteringClient(nc, silence_seconds=1.0)
    first, second = (f"beats-{uuid.uuid4().hex[:8]}.{n}" for n in (1, 2))

    replies = await asyncio.gather(client.stream(streamed(first)), client.stream(streamed(second)))

    assert [r.turn_id for r in replies] == [first, second]
    await wait_for(lambda: len(requests) == 2, what="both requests")
    named = {json.loads(m.data)["alive_subject"] for m in requests}
    assert len(named) == 1  # one subject for the client, not one per turn
    assert {m.subject for m in beats} == named
    assert {m.data.decode() for m in beats} == {first, second}


async def test_a_silent_turn_is_given_up_while_another_turn_of_the_client_still_beats(
    nc: Client,
) -> None:
    """A metering replica (played by the test) that beats for one turn and stops beating
    for the other, replying to neither: the silent one is lost, whatever the other's beats."""
    beating: set[asyncio.Task[None]] = set()

    async def beat(subject: str, turn_id: bytes, times: int) -> None:
        for _ in range(times):
            await nc.publish(subject, turn_id)
            await asyncio.sleep(0.1)

    async def take(msg: Msg) -> None:  # never replies
        cmd = LlmStream.model_validate_json(msg.data)
        assert cmd.alive_subject is not None
        times = 1_000 if cmd.turn_id.endswith("lively") else 1
        task = asyncio.create_task(beat(cmd.alive_subject, cmd.turn_id.encode(), times))
        beating.add(task)

    # Its own subject: no metering replica of another test takes these requests.
    replica = await nc.subscribe(subjects.LLM_STREAM, queue="fake-metering", cb=take)
    await subscribed(nc)
    client = MeteringClient(nc, silence_seconds=1.0)
    prefix = uuid.uuid4().hex[:8]
    lively = asyncio.create_task(client.stream(streamed(f"{prefix}.lively")))
    try:
        with pytest.raises(StreamSilent):
            await asyncio.wait_for(client.stream(streamed(f"{prefix}.silent")), 30)
        assert not lively.done()  # still heard: still waited for
    finally:
        lively.cancel()
        for task in beating:
            task.cancel()
        await replica.unsubscribe()
