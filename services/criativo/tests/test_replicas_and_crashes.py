"""Criativo across processes: killed mid-turn and restarted (rehydration, exactly one
answer), and two replicas sharing the sessions (one place at a time per session)."""

from __future__ import annotations

import asyncio
import itertools
import json
import uuid
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg

from testkit.probes import wait_for

from .conftest import Driver, StartCriativo

FAST_RETRIES = {
    "AGENTBUS_RETRY_BACKOFF_SECONDS": "[0.2, 0.4, 0.8]",
    "AGENTBUS_OUTBOX_POLL_SECONDS": "0.2",
}


async def test_killed_mid_turn_it_answers_once_after_restart_with_the_whole_thread(
    driver: Driver, spawn: Any, nc: Client
) -> None:
    criativo = spawn("criativo", **FAST_RETRIES)
    await criativo.wait_ready(nc, "criativo")
    session = await driver.open()
    first = await driver.say(session, "Um app para padarias de bairro")
    await driver.outcome(session, first)

    seen = await driver.watch(session)
    cut = await driver.say(session, "KILLME agora, no meio da resposta")
    await wait_for(lambda: seen.deltas, what="the turn to start streaming")
    criativo.kill()  # SIGKILL: no clean-up, the message is not acknowledged

    criativo.start(**FAST_RETRIES)
    await criativo.wait_ready(nc, "criativo")
    answer = await driver.outcome(session, cut)
    assert answer.type.value == "agent.response"
    responses = [e for e in await driver.events(session, "agent.response")]
    assert [r.causation_id for r in responses] == [first, cut]  # answered exactly once

    # The new process rehydrated the conversation from the log: its turn read the
    # first message and the answer to it.
    rerun = [r for r in driver.provider.requests if "KILLME" in str(r.messages)][-1]
    history = "\n".join(str(m.content) for m in rerun.messages)
    assert str(first) in history and "padarias de bairro" in history
    assert responses[0].payload["text"] in history
    later = await driver.say(session, "e o que mais?")
    assert (await driver.outcome(session, later)).payload["agent"] == "criativo"


async def _replicas_answering(nc: Client, count: int) -> bool:
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish("$SRV.PING.criativo", b"", reply=inbox)
    instances = set()
    try:
        while True:
            msg = await sub.next_msg(timeout=0.3)
            instances.add(json.loads(msg.data)["metadata"]["instance"])
    except Exception:
        pass
    finally:
        await sub.unsubscribe()
    return len(instances) >= count


async def test_two_replicas_run_each_sessions_turns_in_one_place_at_a_time(
    driver: Driver, start_criativo: StartCriativo, nc: Client
) -> None:
    # One message per fetch, so both replicas get messages of the same sessions.
    await start_criativo(instance_id="replica-a", consumer_batch=1)
    await start_criativo(instance_id="replica-b", consumer_batch=1)
    await wait_for(lambda: _replicas_answering(nc, 2), what="both replicas")
    holders: list[str] = []

    async def on_lease(msg: Msg) -> None:
        if msg.data:  # a delete marker has no value
            holders.append(msg.data.decode().partition("/")[0])  # the instance named

    await nc.subscribe("$KV.criativo_leases.>", cb=on_lease)
    sessions = [await driver.open() for _ in range(4)]

    async def burst(session: uuid.UUID) -> list[uuid.UUID]:
        return [await driver.say(session, f"ideia {i}") for i in range(5)]

    bursts = await asyncio.gather(*(burst(s) for s in sessions))
    for session, messages in zip(sessions, bursts, strict=True):
        for message in messages:
            await driver.outcome(session, message)
        responses = await driver.events(session, "agent.response")
        assert [r.causation_id for r in responses] == messages  # once each, in order
        turns = await driver.usage(session)
        for before, after in itertools.pairwise(turns):
            assert before["finished_at"] <= after["started_at"], "a session ran in two places"
    assert set(holders) == {"replica-a", "replica-b"}


async def test_a_turn_replayed_after_a_crash_records_its_rule_once(
    driver: Driver, spawn: Any, nc: Client
) -> None:
    # Killed right after the rule's append, before the turn's next call and its answer.
    criativo = spawn("criativo", AGENTBUS_FAULT_POINTS="criativo.after_rule", **FAST_RETRIES)
    await criativo.wait_ready(nc, "criativo")
    session = await driver.open()
    message = await driver.say(session, "Pedidos fecham às 18h")
    await asyncio.to_thread(criativo.wait_exit)
    assert len(await driver.events(session, "artifact.business_rule")) == 1
    assert await driver.events(session, "agent.response") == []

    criativo.start(**FAST_RETRIES)
    await criativo.wait_ready(nc, "criativo")
    answer = await driver.outcome(session, message)
    assert answer.type.value == "agent.response"
    rules = await driver.events(session, "artifact.business_rule")
    assert [r.payload["origin"] for r in rules] == [[str(message)]]
    # The redelivered turn replayed the call metering had already answered (same
    # tool_use id, so the same rule event), and the model was asked once.
    asked = [
        r
        for r in driver.provider.requests
        if isinstance(r.messages[-1].content, str) and str(message) in r.messages[-1].content
    ]
    assert len(asked) == 1
    turns = [row["turn_id"] for row in await driver.usage(session)]
    assert turns == [f"criativo.{message}.1", f"criativo.{message}.2"]


async def _lost_by_metering(driver: Driver, session: uuid.UUID, turn_id: str, ended: bool) -> None:
    """What a metering replica killed mid-call leaves: the turn's hold, never settled
    (the turn id looks in progress for ever), or a row without a reply (it ended
    `cancelled`, as metering records a call cut by its own shutdown)."""
    run_id = f"criativo.{session}"
    async with driver.db.acquire() as conn, conn.transaction():
        await conn.execute(
            "INSERT INTO metering.run_budgets (run_id) VALUES ($1) ON CONFLICT DO NOTHING", run_id
        )
        await conn.execute(
            "INSERT INTO metering.budget_holds (turn_id, run_id, hold_micros, status) "
            "VALUES ($1, $2, 0, $3)",
            turn_id,
            run_id,
            "settled" if ended else "held",
        )
        if ended:
            await conn.execute(
                """INSERT INTO metering.token_usage (turn_id, run_id, kind, provider, model,
                       agent_slug, project_id, session_id, input_tokens, output_tokens,
                       cache_write_5m_tokens, cache_write_1h_tokens, cache_read_tokens,
                       cost_micros, status, error_code, started_at, finished_at)
                   VALUES ($1, $2, 'stream', 'scripted', 'claude-sonnet-4-6', 'criativo', $3,
                       $4, 0, 0, 0, 0, 0, 0, 'cancelled', 'unavailable',
                       now() - interval '1 minute', now() - interval '1 minute')""",
                turn_id,
                run_id,
                driver.project,
                session,
            )


async def test_a_turn_metering_lost_is_tried_again_under_a_retry_id(
    driver: Driver, start_criativo: StartCriativo
) -> None:
    # Messages waiting while Criativo is down; metering lost their first call.
    stuck, cut = await driver.open(), await driver.open()
    stuck_message = await driver.say(stuck, "Um app para padarias")
    cut_message = await driver.say(cut, "Um app para feiras")
    await _lost_by_metering(driver, stuck, f"criativo.{stuck_message}.1", ended=False)
    await _lost_by_metering(driver, cut, f"criativo.{cut_message}.1", ended=True)

    await start_criativo(turn_in_progress_wait_seconds=0.5)
    for session, message in ((stuck, stuck_message), (cut, cut_message)):
        answer = await driver.outcome(session, message)
        assert answer.type.value == "agent.response"
        calls = [row["turn_id"] for row in await driver.usage(session)]
        assert f"criativo.{message}.1.r1" in calls and f"criativo.{message}.2" in calls
        assert len(await driver.events(session, "artifact.business_rule")) == 1
