"""A model-based test of Criativo's conversation (issue 10), against the real services
as processes: session_events, handoff, metering (scripted provider, recording every
prompt) and Criativo.

Each seeded schedule is what a person who does not wait does: messages 0–300 ms
apart (some stating a RULE), "I'm ready to produce" clicked while a turn streams,
Criativo SIGKILLed mid-turn and restarted while the person keeps typing, and an
already handled message delivered again. The pauses between inputs *are* the
schedule; every wait for an effect is on the event that proves it.

Invariants once the session has settled:
- every message is answered exactly once, in the order it was sent;
- every prompt ends with the message it answers, and before it holds every earlier
  message, each followed by the answer it got, in order (nothing said after it);
- one rule per RULE message, none twice; one brief for the readiness, one offer.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg

from contracts import subjects
from contracts.events import Event, EventType
from contracts.handoff import ActivateAgent, ActivationReply
from contracts.metering import TurnDelta
from contracts.session_events import (
    AppendedReply,
    AppendEvent,
    OpenSession,
    SessionOpenedReply,
)
from servicekit.client import call
from testkit.probes import log_events, wait_for

HERE = Path(__file__).parent
SEEDS = [7, 1234, 99991]
MESSAGES = 7
PROJECT = f"p-model-{uuid.uuid4().hex[:6]}"
FAST = {
    "AGENTBUS_RETRY_BACKOFF_SECONDS": "[0.2, 0.4, 0.8]",
    "AGENTBUS_OUTBOX_POLL_SECONDS": "0.2",
}
QUOTED = re.compile(r"^\[message ([0-9a-f-]{36})\]\n")


@dataclass
class Run:
    """One schedule's inputs, and what was seen streaming."""

    session: uuid.UUID
    sent: list[tuple[uuid.UUID, str]] = field(default_factory=list)
    readiness: uuid.UUID | None = None
    deltas: int = 0


async def append(nc: Client, session: uuid.UUID, kind: EventType, **payload: Any) -> uuid.UUID:
    reply = await call(
        nc,
        subjects.EVENTS_APPEND,
        AppendEvent(session_id=session, type=kind.value, actor="user:ana", payload=payload),
        AppendedReply,
    )
    return reply.event_id


async def open_with_criativo(nc: Client) -> uuid.UUID:
    opened = await call(
        nc,
        subjects.SESSIONS_OPEN,
        OpenSession(project_id=PROJECT, opened_by="user:ana"),
        SessionOpenedReply,
    )
    session = opened.session_id
    await call(
        nc,
        subjects.AGENTS_ACTIVATE,
        ActivateAgent(
            project_id=PROJECT, session_id=session, agent="criativo", via="user", actor="user:ana"
        ),
        ActivationReply,
    )
    await wait_for(
        lambda: log_events(nc, session, EventType.AGENT_ACTIVATED.value),
        what="agent.activated in the log",
    )
    return session


async def a_turn_streams(nc: Client, run: Run) -> None:
    """Until a new delta arrives: some turn of the session is streaming right now."""
    seen = run.deltas
    await wait_for(lambda: run.deltas > seen, timeout=30, what="a turn streaming")


async def redeliver(nc: Client, run: Run, rng: random.Random) -> None:
    """An already committed message, published again (a relay retrying past dedup)."""
    message, _ = rng.choice(run.sent)
    original = next(e for e in await log_events(nc, run.session) if e.id == message)
    await nc.jetstream().publish(
        subjects.event_subject(EventType.CHAT_MESSAGE, PROJECT, run.session),
        original.model_dump_json().encode(),
        headers={"Nats-Msg-Id": f"again-{message}-{uuid.uuid4().hex[:6]}"},
    )


async def schedule(nc: Client, criativo: Any, seed: int) -> Run:
    rng = random.Random(seed)
    run = Run(await open_with_criativo(nc))

    async def on_delta(msg: Msg) -> None:
        TurnDelta.model_validate_json(msg.data)
        run.deltas += 1

    sub = await nc.subscribe(subjects.delta_subject(PROJECT, run.session), cb=on_delta)
    ready_after, kill_after = rng.randrange(MESSAGES), rng.randrange(MESSAGES - 1)
    again_after = rng.randrange(1, MESSAGES)
    restarting: asyncio.Task[None] | None = None
    for i in range(MESSAGES):
        text = f"RULE: regra {i} da semente {seed}" if rng.random() < 0.4 else f"mensagem {i}"
        run.sent.append((await append(nc, run.session, EventType.CHAT_MESSAGE, text=text), text))
        if i == ready_after:
            await a_turn_streams(nc, run)
            run.readiness = await append(nc, run.session, EventType.CRIATIVO_READINESS_CONFIRMED)
        if i == kill_after:
            await a_turn_streams(nc, run)
            criativo.kill()  # SIGKILL mid-turn: nothing acknowledged, the lease still held
            criativo.start(**FAST)
            restarting = asyncio.create_task(criativo.wait_ready(nc, "criativo"))
        if i == again_after:
            await redeliver(nc, run, rng)
        await asyncio.sleep(rng.uniform(0, 0.3))  # the person's pace: the schedule itself
    if restarting is not None:
        await restarting
    await settle(nc, run)
    await sub.unsubscribe()
    return run


async def settle(nc: Client, run: Run) -> None:
    """Every message answered, the brief offered, Criativo's consumer idle."""

    async def answered() -> bool:
        causes = {e.causation_id for e in await log_events(nc, run.session, "agent.")}
        return all(m in causes for m, _ in run.sent)

    await wait_for(answered, timeout=60, what="every message answered")
    await wait_for(
        lambda: log_events(nc, run.session, EventType.HANDOFF_OFFERED.value),
        timeout=30,
        what="the brief's offer",
    )
    js = nc.jetstream()

    async def idle() -> bool:
        info = await js.consumer_info("EVENTS", "criativo-inputs")
        return bool(info.num_pending == 0 and info.num_ack_pending == 0)

    await wait_for(idle, timeout=30, what="criativo's inputs all handled")


def prompts_of(
    path: Path, run: Run
) -> tuple[dict[uuid.UUID, list[list[dict[str, Any]]]], list[Any]]:
    """The recorded first-call prompts of each message of the run, and its consolidations."""
    mine = {m for m, _ in run.sent}
    answers: dict[uuid.UUID, list[list[dict[str, Any]]]] = {}
    briefs: list[Any] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        messages = record["messages"]
        last = messages[-1]["content"]
        if record["agent"] != "criativo" or not isinstance(last, str):
            continue  # a tool loop's later call (its last message holds tool results)
        if "product_brief" in last and str(run.readiness) in last:
            briefs.append(messages)
            continue
        found = QUOTED.match(last)
        if found and uuid.UUID(found.group(1)) in mine:
            answers.setdefault(uuid.UUID(found.group(1)), []).append(messages)
    return answers, briefs


def exchanges(run: Run, events: list[Event], before_seq: int) -> list[dict[str, Any]]:
    """What the model must read before `before_seq`: each message, then its answer."""
    seq_of = {e.id: e.seq for e in events}
    answer_of = {
        e.causation_id: e.payload["text"] for e in events if e.type is EventType.AGENT_RESPONSE
    }
    expected: list[dict[str, Any]] = []
    for message, text in run.sent:
        if seq_of[message] < before_seq:
            expected.append({"role": "user", "content": f"[message {message}]\n{text}"})
            expected.append({"role": "assistant", "content": answer_of[message]})
    return expected


def check(run: Run, events: list[Event], prompts: Path) -> None:
    sent = [m for m, _ in run.sent]
    outcomes = [e for e in events if e.type in (EventType.AGENT_RESPONSE, EventType.AGENT_ERROR)]
    # every message answered exactly once, in the order it was sent, and never with an error
    assert [o.causation_id for o in outcomes] == sent
    assert {o.type for o in outcomes} == {EventType.AGENT_RESPONSE}
    # one rule per RULE message, citing it; none twice
    rules = [e for e in events if e.type is EventType.ARTIFACT_BUSINESS_RULE]
    said_rules = [[str(m)] for m, text in run.sent if text.startswith("RULE")]
    assert [r.payload["origin"] for r in rules] == said_rules
    # one brief for the readiness, offered once
    briefs = [e for e in events if e.type is EventType.ARTIFACT_PRODUCT_BRIEF]
    assert [b.causation_id for b in briefs] == [run.readiness]
    assert len([e for e in events if e.type is EventType.HANDOFF_OFFERED]) == 1
    # every prompt: every earlier exchange in order, then the message it answers, last
    answers, consolidations = prompts_of(prompts, run)
    assert set(answers) == set(sent), "a message never reached the model as the one to answer"
    seq_of = {e.id: e.seq for e in events}
    for message, text in run.sent:
        expected = [
            *exchanges(run, events, seq_of[message]),
            {"role": "user", "content": f"[message {message}]\n{text}"},
        ]
        for prompt in answers[message]:
            assert prompt == expected, f"the prompt for {message}"
    # the consolidation read what was said before the readiness, each with its answer
    assert consolidations
    assert run.readiness is not None
    for prompt in consolidations:
        assert prompt[:-1] == exchanges(run, events, seq_of[run.readiness])


def overlapping(run: Run, events: list[Event]) -> int:
    """How many messages reached the log before the previous one's answer."""
    seq_of = {e.id: e.seq for e in events}
    answered_at = {e.causation_id: e.seq for e in events if e.type is EventType.AGENT_RESPONSE}
    sent = [m for m, _ in run.sent]
    return sum(1 for a, b in itertools.pairwise(sent) if seq_of[b] < answered_at[a])


async def test_random_schedules_keep_the_conversation_causal_and_exactly_once(
    spawn: Any, nc: Client, tmp_path: Path
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.touch()
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    services = [
        (spawn("session_events", **FAST), "session_events"),
        (spawn("handoff", **FAST), "handoff"),
        (
            spawn(
                "conversation_model_metering",
                PYTHONPATH=path,
                AGENTBUS_TEST_PROMPTS_PATH=str(prompts),
            ),
            "metering",
        ),
    ]
    for process, name in services:
        await process.wait_ready(nc, name)
    criativo = spawn("criativo", **FAST)
    await criativo.wait_ready(nc, "criativo")

    typed_during_a_turn = 0
    for seed in SEEDS:
        run = await schedule(nc, criativo, seed)
        events = await log_events(nc, run.session)
        check(run, events, prompts)
        typed_during_a_turn += overlapping(run, events)
    # the schedules did exercise the case: messages typed while a turn was running
    assert typed_during_a_turn > 0
