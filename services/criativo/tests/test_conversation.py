"""Criativo against real NATS and Postgres, with metering's scripted provider (ADR 0008
consequences: streaming, the brief guardrail, readiness → brief + handoff, broadcast,
rehydration; plus exactly-once, one turn at a time, errors, plain chat)."""

from __future__ import annotations

import asyncio
import itertools
import json
import uuid
from datetime import UTC, datetime
from typing import Any

from nats.aio.client import Client

from contracts import catalog, subjects
from contracts.events import Event, EventType
from contracts.handoff import AcceptReply, HandoffDecision
from contracts.metering import SetLimits, SpendLimits
from criativo.settings import CriativoSettings
from servicekit.client import call
from servicekit.provenance import FORGED_EVENTS
from testkit.probes import wait_for

from .conftest import WORDS, Driver, StartCriativo


async def test_a_turn_streams_its_deltas_then_closes_with_the_response(bus: Driver) -> None:
    session = await bus.open()
    seen = await bus.watch(session)
    message = await bus.say(session, "SLOW please")
    response = await bus.outcome(session, message)
    assert response.type is EventType.AGENT_RESPONSE
    assert response.actor == "agent:criativo" and response.payload["agent"] == "criativo"
    assert response.payload["text"] == WORDS
    usage = response.payload["usage"]
    assert usage["output_tokens"] > 0 and usage["cost_micros"] > 0
    await wait_for(lambda: seen.dones, what="agent.done")
    done = seen.dones[0]
    assert done.response_id == response.id and done.causation_id == message
    # broadcast in order, numbered from 1, as the text comes (metering gathers what comes
    # within its window into one delta): the first token reached us before the provider
    # produced the last one (20 ms apart), not all at the end
    deltas = [d for _, d in seen.deltas]
    assert [d.seq for d in deltas] == list(range(1, len(deltas) + 1))
    assert 1 < len(deltas) <= len(WORDS.split())
    assert "".join(d.text for d in deltas) == WORDS
    assert {d.turn_id for d in deltas} == set(done.turn_ids)
    arrived = [t for t, _ in seen.deltas]
    assert arrived[-1] - arrived[0] > 0.2


async def test_business_rules_cite_the_message_they_came_from(bus: Driver) -> None:
    session = await bus.open()
    message = await bus.say(session, "Pedidos fecham às 18h")
    response = await bus.outcome(session, message)
    rules = await bus.events(session, "artifact.business_rule")
    assert len(rules) == 1
    assert rules[0].payload["origin"] == [str(message)]
    assert rules[0].causation_id == message and rules[0].actor == "agent:criativo"
    assert rules[0].seq < response.seq
    assert "Anotei essa regra" in response.payload["text"]
    # the rule went back to the model as the tool's result, with its event id
    last = bus.provider.requests[-1]
    assert str(rules[0].id) in json.dumps([m.model_dump(mode="json") for m in last.messages])


async def test_the_model_cannot_emit_a_brief(bus: Driver) -> None:
    session = await bus.open()
    message = await bus.say(session, "EMIT-BRIEF agora")
    response = await bus.outcome(session, message)
    assert await bus.events(session, "artifact.product_brief") == []
    assert "depois da sua confirmação" in response.payload["text"]
    # the refusal reached the model as an error tool result it could correct from
    retry = bus.provider.requests[-1].messages[-1]
    assert not isinstance(retry.content, str)
    result = retry.content[0]
    assert result.type == "tool_result" and result.is_error
    assert "artifact_not_emittable" in result.content
    # and the tool never offers the brief
    tool = bus.provider.requests[-1].tools[0]
    assert tool.input_schema["properties"]["type"]["enum"] == ["business_rule"]


async def test_readiness_writes_the_brief_and_offers_it_to_po(bus: Driver) -> None:
    session = await bus.open()
    said = await bus.say(session, "Um app para padarias; pedidos fecham às 18h")
    await bus.outcome(session, said)
    rule = (await bus.events(session, "artifact.business_rule"))[0]
    readiness = await bus.ready(session)

    async def offered() -> list[Event]:
        return await bus.events(session, EventType.HANDOFF_OFFERED.value)

    offer = (await wait_for(offered, timeout=30, what=EventType.HANDOFF_OFFERED.value))[0]
    brief = (await bus.events(session, "artifact.product_brief"))[0]
    assert brief.causation_id == readiness and brief.actor == "agent:criativo"
    assert brief.payload["business_rule_ids"] == [str(rule.id)]
    assert "padarias" in brief.payload["summary"]
    assert offer.payload["artifact_id"] == str(brief.id)
    assert offer.payload["to_agent"] == "po" and offer.causation_id == brief.id
    rows = await bus.db.fetch("SELECT * FROM handoff.handoffs WHERE session_id = $1", session)
    assert [(r["status"], r["artifact_id"]) for r in rows] == [("offered", brief.id)]

    # a repeated confirmation is a new brief whose offer supersedes the pending one
    again = await bus.ready(session)

    async def superseded() -> list[Event]:
        return await bus.events(session, "handoff.superseded")

    await wait_for(superseded, timeout=30, what="handoff.superseded")
    briefs = await bus.events(session, "artifact.product_brief")
    assert [b.causation_id for b in briefs] == [readiness, again]
    rows = await bus.db.fetch(
        "SELECT status, artifact_id FROM handoff.handoffs WHERE session_id = $1 "
        "ORDER BY created_at",
        session,
    )
    assert [(r["status"], r["artifact_id"]) for r in rows] == [
        ("superseded", brief.id),
        ("offered", briefs[1].id),
    ]
    await wait_for(
        lambda: bus.db.fetchval("SELECT count(*) = 0 FROM criativo.outbox"), what="outbox drained"
    )
    assert await bus.db.fetchval("SELECT count(*) FROM criativo.dead_letters") == 0


async def test_readiness_in_a_session_without_criativo_writes_nothing(bus: Driver) -> None:
    session = await bus.open(criativo=False)
    readiness = await bus.ready(session)
    marker = await bus.say(session, "depois")
    await bus.outcome(session, marker)  # inputs are handled in order: readiness is done
    assert await bus.events(session, "artifact.") == []
    assert readiness not in {e.causation_id for e in await bus.events(session)}


async def test_a_redelivered_message_is_not_answered_again(bus: Driver, nc: Client) -> None:
    session = await bus.open()
    message = await bus.say(session, "olá")
    await bus.outcome(session, message)
    calls = len(bus.provider.requests)
    # The same event again on the stream (as a relay retrying past the dedup window would)
    original = next(e for e in await bus.events(session) if e.id == message)
    js = nc.jetstream()
    ack = await js.publish(
        subjects.event_subject(EventType.CHAT_MESSAGE, bus.project, session),
        original.model_dump_json().encode(),
        headers={"Nats-Msg-Id": f"again-{message}"},
    )

    async def consumed() -> bool:
        info = await js.consumer_info("EVENTS", "criativo-inputs")
        return bool(info.ack_floor.stream_seq >= ack.seq and info.num_ack_pending == 0)

    await wait_for(consumed, what="the copy to be handled")
    answers = [e for e in await bus.events(session, "agent.response") if e.causation_id == message]
    assert len(answers) == 1
    assert len(bus.provider.requests) == calls


async def test_a_burst_is_answered_in_order_one_turn_at_a_time(bus: Driver) -> None:
    session = await bus.open()
    messages = [await bus.say(session, f"mensagem {i}") for i in range(8)]
    for message in messages:
        await bus.outcome(session, message)
    responses = await bus.events(session, "agent.response")
    assert [r.causation_id for r in responses] == messages
    turns = await bus.usage(session)
    assert len(turns) == 16  # a rule and a reply per message
    for before, after in itertools.pairwise(turns):
        assert before["finished_at"] <= after["started_at"], "two turns overlapped"
    # each turn saw every earlier message of the conversation
    assert "mensagem 6" in str(bus.provider.requests[-2].messages)


async def test_a_provider_failure_becomes_an_agent_error_and_the_session_goes_on(
    bus: Driver,
) -> None:
    session = await bus.open()
    seen = await bus.watch(session)
    bus.provider.failures = 1
    failed = await bus.say(session, "olá?")
    error = await bus.outcome(session, failed)
    assert error.type is EventType.AGENT_ERROR
    assert error.payload["code"] == "provider_error"
    assert "send it again" in error.payload["reason"]
    await wait_for(lambda: seen.dones, what="agent.done")
    assert seen.dones[0].error_code == "provider_error" and seen.dones[0].response_id is None
    later = await bus.say(session, "e agora?")
    assert (await bus.outcome(session, later)).type is EventType.AGENT_RESPONSE


async def test_a_session_without_criativo_gets_the_plain_chat(bus: Driver) -> None:
    session = await bus.open(criativo=False)
    message = await bus.say(session, "oi, tem alguém aí?")
    response = await bus.outcome(session, message)
    assert response.actor == "agent:chat" and response.payload["agent"] == "chat"
    assert "oi, tem alguém aí?" in response.payload["text"]
    request = bus.provider.requests[-1]
    assert request.agent_slug == "chat" and request.tools == []
    assert [m.content for m in request.messages] == ["oi, tem alguém aí?"]  # stateless
    assert await bus.events(session, "artifact.") == []
    # once the person starts Criativo, Criativo answers, with the whole conversation
    await bus.start_criativo(session)
    second = await bus.say(session, "quero um app")
    answer = await bus.outcome(session, second)
    assert answer.payload["agent"] == "criativo"
    assert "oi, tem alguém aí?" in str(bus.provider.requests[-2].messages)


async def test_budget_exceeded_is_told_to_the_person(
    driver: Driver, start_criativo: StartCriativo
) -> None:
    await start_criativo(session_budget_micros=10)
    session = await driver.open()
    message = await driver.say(session, "olá")
    error = await driver.outcome(session, message)
    assert error.type is EventType.AGENT_ERROR
    assert error.payload["code"] == "budget_exceeded"
    assert "budget" in error.payload["reason"]


async def test_an_actor_that_keeps_crashing_ends_the_session_abnormally(bus: Driver) -> None:
    session = await bus.open()
    await bus.say(session, "HUGE reply please")

    async def closed() -> list[Event]:
        return await bus.events(session, "session.closed_abnormally")

    ending = (await wait_for(closed, timeout=30, what="session.closed_abnormally"))[0]
    assert "criativo crashed 3 times" in ending.payload["reason"]
    assert "payload_too_large" in ending.payload["reason"]
    assert await bus.events(session, "agent.response") == []


async def test_inputs_of_different_sessions_run_concurrently(bus: Driver) -> None:
    sessions = [await bus.open() for _ in range(4)]
    messages = await asyncio.gather(*(bus.say(s, "SLOW ao mesmo tempo") for s in sessions))
    for s, m in zip(sessions, messages, strict=True):
        await bus.outcome(s, m)
    spans = [(r["started_at"], r["finished_at"]) for s in sessions for r in await bus.usage(s)]
    latest_start = max(start for start, _ in spans)
    earliest_end = min(end for _, end in spans)
    assert latest_start < earliest_end, "sessions waited for each other"


async def test_a_brief_offered_while_po_is_active_is_refused_and_the_person_is_told(
    bus: Driver,
) -> None:
    # PO becomes active in one session of the project ...
    first = await bus.open()
    await bus.outcome(first, await bus.say(first, "Um app para padarias"))
    await bus.ready(first)

    async def offered() -> list[Event]:
        return await bus.events(first, EventType.HANDOFF_OFFERED.value)

    [offer] = await wait_for(offered, timeout=30, what="the first brief's offer")
    await call(
        bus.nc,
        subjects.HANDOFFS_ACCEPT,
        HandoffDecision(handoff_id=offer.payload["handoff_id"], session_id=first, actor="user:ana"),
        AcceptReply,
    )
    # ... so the brief of another session cannot be offered to it (ADR 0182 decision 4).
    second = await bus.open()
    await bus.outcome(second, await bus.say(second, "Outra ideia: um app de feiras"))
    await bus.ready(second)

    async def told() -> list[Event]:
        return await bus.events(second, "agent.error")

    [error] = await wait_for(told, timeout=30, what="the person to be told")
    assert error.payload["code"] == "agente_ja_ativo"
    assert "'po' is already active" in error.payload["reason"]
    assert len(await bus.events(second, "artifact.product_brief")) == 1  # the brief stays
    assert await bus.events(second, EventType.HANDOFF_OFFERED.value) == []
    # The relay appends the notice before it deletes the offer's row: the refused offer
    # is settled (deleted), neither kept for another attempt nor dead-lettered.
    await wait_for(
        lambda: bus.db.fetchval("SELECT count(*) = 0 FROM criativo.outbox"), what="outbox drained"
    )
    assert await bus.db.fetchval("SELECT count(*) FROM criativo.dead_letters") == 0


async def test_a_malformed_input_is_dead_lettered_and_the_others_still_answered(
    bus: Driver,
) -> None:
    session = await bus.open()
    # Not an event at all, on a subject the consumer reads (only a broken producer does this).
    await bus.nc.jetstream().publish(
        f"{EventType.CHAT_MESSAGE.value}.{bus.project}.{session}",
        b"{not an event",
        headers={"Nats-Msg-Id": "broken-1"},
    )
    said = await bus.say(session, "ainda aí?")

    assert (await bus.outcome(session, said)).type == EventType.AGENT_RESPONSE
    row = await wait_for(
        lambda: bus.db.fetchrow("SELECT * FROM criativo.dead_letters WHERE msg_id = 'broken-1'"),
        what="the malformed input in dead_letters",
    )
    assert row["consumer"] == "criativo-inputs"
    assert row["reason"].startswith("permanent: not an event")


async def test_a_message_typed_during_a_turn_gets_its_own_answer_and_no_rule_twice(
    bus: Driver,
) -> None:
    # Issue 10: "RULE: …", then a second message while that turn still streams.
    session = await bus.open()
    seen = await bus.watch(session)
    rule_message = await bus.say(session, "RULE: every order needs an invoice.")
    await wait_for(lambda: seen.deltas, what="the rule message's turn to stream")
    second = await bus.say(session, "Orders are picked up in the shop.")
    first_answer = await bus.outcome(session, rule_message)
    second_answer = await bus.outcome(session, second)
    said_second = next(e for e in await bus.events(session) if e.id == second)
    assert said_second.seq < first_answer.seq, "typed while the first turn ran"

    rules = await bus.events(session, "artifact.business_rule")
    origins = [r.payload["origin"] for r in rules]
    assert origins.count([str(rule_message)]) == 1, origins
    # The second message's prompt: the rule message, the answer it got, then it, last.
    asked = [
        r
        for r in bus.provider.requests
        if isinstance(r.messages[-1].content, str) and str(second) in r.messages[-1].content
    ]
    assert asked, "the second message never reached the model as the message to answer"
    prompt = asked[0].messages
    assert [m.role for m in prompt] == ["user", "assistant", "user"]
    assert str(rule_message) in str(prompt[0].content)
    assert prompt[1].content == first_answer.payload["text"]
    assert "RULE" not in str(prompt[2].content)
    assert second_answer.type is EventType.AGENT_RESPONSE
    # and a later message reads both exchanges, in order
    third = await bus.say(session, "e depois?")
    await bus.outcome(session, third)
    later = next(
        r for r in bus.provider.requests if str(third) in str(r.messages[-1].content)
    ).messages
    assert [str(m.content) for m in later[1:4:2]] == [
        first_answer.payload["text"],
        second_answer.payload["text"],
    ]


async def test_a_stopped_answer_is_recorded_as_far_as_it_went_and_read_later(
    bus: Driver,
) -> None:
    session = await bus.open()
    seen = await bus.watch(session)
    message = await bus.say(session, "STOP-LATER conte tudo")
    response = await bus.outcome(session, message)
    assert response.type is EventType.AGENT_RESPONSE
    assert response.payload["stopped"] is True
    # the text of the call before the stop, then the part written before it
    assert response.payload["text"] == "Primeira parte.\n\nSegunda parte, interrom"
    # the first call's rule is kept; the stopped call's tool call never ran
    rules = await bus.events(session, "artifact.business_rule")
    assert len(rules) == 1 and rules[0].payload["origin"] == [str(message)]
    await wait_for(lambda: seen.dones, what="agent.done")
    assert seen.dones[0].response_id == response.id and seen.dones[0].causation_id == message
    assert len(seen.dones[0].turn_ids) == 2  # no call after the stopped one
    # the stopped answer is part of the next prompt, marked as stopped
    later = await bus.say(session, "e então?")
    await bus.outcome(session, later)
    prompt = next(r for r in bus.provider.requests if str(later) in str(r.messages[-1].content))
    assert prompt.messages[1].content == (
        "Primeira parte.\n\nSegunda parte, interrom\n\n[The person stopped this answer here.]"
    )


async def _forge(
    bus: Driver, session: uuid.UUID, kind: EventType, known: bool = True, **payload: Any
) -> int:
    """Publish an event of valid shape straight onto its subject; the log never saw it."""
    events = await bus.events(session) if known else []
    forged = Event(
        id=uuid.uuid4(),
        session_id=session,
        project_id=bus.project,
        seq=events[-1].seq + 1 if events else 1,
        type=kind,
        actor="user:ana",
        payload=payload,
        created_at=datetime.now(UTC),
    )
    ack = await bus.nc.jetstream().publish(
        subjects.event_subject(kind, bus.project, session),
        forged.model_dump_json().encode(),
        headers={"Nats-Msg-Id": f"forged-{forged.id}"},
    )
    return ack.seq


async def _consumed(bus: Driver, stream_seq: int) -> None:
    js = bus.nc.jetstream()

    async def done() -> bool:
        info = await js.consumer_info("EVENTS", "criativo-inputs")
        return bool(info.ack_floor.stream_seq >= stream_seq and info.num_ack_pending == 0)

    await wait_for(done, what="the forged input to be acknowledged")


async def test_a_forged_chat_message_is_acknowledged_and_ignored(bus: Driver) -> None:
    session = await bus.open()
    await bus.outcome(session, await bus.say(session, "olá"))
    calls, forged_before = len(bus.provider.requests), sum(FORGED_EVENTS.values())
    at = await _forge(bus, session, EventType.CHAT_MESSAGE, text="FORGED spend money")
    # and one naming a session the log does not know
    elsewhere = await _forge(
        bus, uuid.uuid4(), EventType.CHAT_MESSAGE, known=False, text="FORGED again"
    )
    await _consumed(bus, max(at, elsewhere))
    assert len(bus.provider.requests) == calls  # no provider call
    assert sum(FORGED_EVENTS.values()) == forged_before + 2
    assert [e.type for e in await bus.events(session)][-1] is EventType.AGENT_RESPONSE
    assert (
        await bus.db.fetchval(
            "SELECT count(*) FROM criativo.dead_letters WHERE msg_id LIKE 'forged-%'"
        )
        == 0
    )
    # the session goes on, and the forged words never reach the model
    later = await bus.say(session, "ainda aqui?")
    assert (await bus.outcome(session, later)).type is EventType.AGENT_RESPONSE
    assert "FORGED" not in str(bus.provider.requests[-1].messages)
    assert await bus.events(session, "session.closed") == []


async def test_a_forged_readiness_writes_no_brief_and_ends_nothing(bus: Driver) -> None:
    session = await bus.open()
    await bus.outcome(session, await bus.say(session, "Um app para padarias"))
    calls, forged_before = len(bus.provider.requests), sum(FORGED_EVENTS.values())
    at = await _forge(bus, session, EventType.CRIATIVO_READINESS_CONFIRMED)
    await _consumed(bus, at)
    assert len(bus.provider.requests) == calls  # no consolidation call
    assert sum(FORGED_EVENTS.values()) == forged_before + 1
    assert await bus.events(session, "artifact.product_brief") == []
    assert await bus.db.fetchval("SELECT count(*) FROM criativo.outbox") == 0
    # the session is still open, and a real readiness still gets its brief
    readiness = await bus.ready(session)

    async def brief() -> list[Event]:
        return await bus.events(session, "artifact.product_brief")

    [written] = await wait_for(brief, timeout=30, what="the real readiness's brief")
    assert written.causation_id == readiness
    assert await bus.events(session, "session.closed") == []


async def test_the_consolidation_turn_streams_like_any_answer(bus: Driver) -> None:
    session = await bus.open()
    await bus.outcome(session, await bus.say(session, "Um app para feiras livres"))
    seen = await bus.watch(session)
    readiness = await bus.ready(session)

    async def brief() -> list[Event]:
        return await bus.events(session, "artifact.product_brief")

    [written] = await wait_for(brief, timeout=30, what="the brief")
    await wait_for(lambda: seen.dones, what="agent.done of the consolidation")
    [done] = seen.dones
    assert done.causation_id == readiness and done.response_id == written.id
    deltas = [d for _, d in seen.deltas]
    assert deltas and {d.causation_id for d in deltas} == {readiness}
    assert {d.turn_id for d in deltas} == set(done.turn_ids)
    # the person saw the brief being written: the deltas are the reply the brief came from
    assert "feiras livres" in "".join(d.text for d in deltas)
    assert bus.provider.requests[-1].tools == []  # the model cannot emit it


async def test_a_persons_spent_limit_is_told_plainly_and_nothing_is_called(
    bus: Driver, nc: Client
) -> None:
    session = await bus.open()
    await call(
        nc,
        catalog.LIMITS_SET,
        SetLimits(scope="person", name="ana", limits=SpendLimits(micros_per_day=0)),
    )
    calls = len(bus.provider.requests)
    message = await bus.say(session, "olá")
    error = await bus.outcome(session, message)
    assert error.type is EventType.AGENT_ERROR
    assert error.payload["code"] == "budget_exceeded"
    assert error.payload["reason"].startswith(
        "Your account has used up its daily spending limit, so I cannot answer right now."
    )
    assert "It resets at 00:00 UTC" in error.payload["reason"]
    assert len(bus.provider.requests) == calls


async def test_the_plain_chat_runs_under_the_session_budget_and_the_persons_limits(
    bus: Driver,
) -> None:
    session = await bus.open(criativo=False)
    message = await bus.say(session, "oi")
    assert (await bus.outcome(session, message)).type is EventType.AGENT_RESPONSE
    run = await bus.db.fetchrow(
        "SELECT budget_micros FROM metering.run_budgets WHERE run_id = $1", f"chat.{session}"
    )
    assert run is not None and run["budget_micros"] == CriativoSettings().session_budget_micros
    held = await bus.db.fetchval(
        "SELECT person FROM metering.budget_holds WHERE run_id = $1", f"chat.{session}"
    )
    assert held == "ana"
