"""Criativo completes the whole story on a local model (issue 16): session_events, handoff,
metering and Criativo as real processes, Criativo bound to an `openai` model served by a
local fake of the Chat Completions API (HTTP + SSE on loopback), as Ollama would serve it.

The fake answers like a small model would: a message stating a RULE gets a short reply
and an `emit_artifact` tool call streamed in pieces; the tool's result gets an
acknowledgement; the consolidation request gets the brief as JSON. The story holds when
the rule is recorded citing its message, every message is answered from the stream,
the readiness yields a brief and the brief's offer to `po`, and every call was metered
as `openai` at the catalogue's price (0 for a local model).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest_asyncio
from nats.aio.client import Client
from nats.aio.msg import Msg

from contracts import subjects
from contracts.events import EventType
from contracts.handoff import ActivateAgent, ActivationReply
from contracts.metering import (
    BindingSetReply,
    SetBinding,
    TurnDelta,
    UsageSummaryReply,
    UsageSummaryRequest,
)
from contracts.session_events import AppendedReply, AppendEvent, OpenSession, SessionOpenedReply
from servicekit.client import call
from testkit.fake_chat_api import (
    FakeChatApi,
    Reply,
    finish,
    text_chunks,
    tool_call_chunks,
    usage_chunk,
)
from testkit.probes import log_events, wait_for

PROJECT = f"p-local-{uuid.uuid4().hex[:6]}"
MODEL = "llama3.2"  # seeded at price 0
FAST = {
    "AGENTBUS_RETRY_BACKOFF_SECONDS": "[0.2, 0.4, 0.8]",
    "AGENTBUS_OUTBOX_POLL_SECONDS": "0.2",
}
QUOTED = re.compile(r"\[message ([0-9a-f-]{36})\]\n(.*)", re.DOTALL)


def _content(message: dict[str, Any]) -> str:
    content = message.get("content") or ""
    return content if isinstance(content, str) else json.dumps(content)


def local_model(body: dict[str, Any]) -> Reply:
    """What the fake model answers to one Chat Completions request."""
    messages = body["messages"]
    last = messages[-1]
    tools = {t["function"]["name"] for t in body.get("tools", [])}
    said = _content(last)
    usage = usage_chunk(prompt=len(json.dumps(messages)) // 4, completion=12)
    if last["role"] == "tool":
        text = text_chunks(["Anotei ", "essa ", "regra. ", "O que mais?"])
        return Reply(chunks=[*text, finish("stop"), usage])
    if "product_brief" in said:
        brief = {"title": "Padaria", "summary": "Encomendas até as 18h.", "details": "Local."}
        encoded = json.dumps(brief, ensure_ascii=False)
        pieces = [encoded[i : i + 12] for i in range(0, len(encoded), 12)]
        return Reply(chunks=[*text_chunks(pieces), finish("stop"), usage])
    quoted = QUOTED.search(said)
    if quoted is not None and "RULE" in said and "emit_artifact" in tools:
        arguments = json.dumps(
            {
                "type": "business_rule",
                "title": "Horário das encomendas",
                "statement": quoted.group(2).strip(),
                "origin": [quoted.group(1)],
            },
            ensure_ascii=False,
        )
        parts = [arguments[i : i + 10] for i in range(0, len(arguments), 10)]
        return Reply(
            chunks=[
                *text_chunks(["Entendi, ", "vou registrar."]),
                *tool_call_chunks(0, "call_rule_1", "emit_artifact", parts),
                finish("tool_calls"),
                usage,
            ]
        )
    text = text_chunks(["Entendi. ", "Conte-me ", "mais."])
    return Reply(chunks=[*text, finish("stop"), usage])


@pytest_asyncio.fixture(loop_scope="session")
async def fake() -> AsyncIterator[FakeChatApi]:
    server = await FakeChatApi(local_model).start()
    yield server
    await server.stop()


async def append(nc: Client, session: uuid.UUID, kind: EventType, **payload: Any) -> uuid.UUID:
    reply = await call(
        nc,
        subjects.EVENTS_APPEND,
        AppendEvent(session_id=session, type=kind.value, actor="user:ana", payload=payload),
        AppendedReply,
    )
    return reply.event_id


async def caused_by(nc: Client, session: uuid.UUID, kind: EventType, cause: uuid.UUID) -> Any:
    """The event of `kind` caused by `cause`, once it is in the log."""

    async def found() -> Any:
        events = await log_events(nc, session, kind.value)
        return next((e for e in events if e.causation_id == cause), None)

    return await wait_for(found, timeout=60, what=f"{kind.value} caused by {cause}")


async def test_criativo_completes_the_whole_story_on_an_openai_compatible_model(
    spawn: Any, nc: Client, fake: FakeChatApi
) -> None:
    services = [
        (spawn("session_events", **FAST), "session_events"),
        (spawn("handoff", **FAST), "handoff"),
        (
            spawn(
                "metering",
                AGENTBUS_PROVIDER="scripted",
                OPENAI_BASE_URL=fake.base_url,
                OPENAI_API_KEY="local",
            ),
            "metering",
        ),
        (spawn("criativo", **FAST), "criativo"),
    ]
    for process, name in services:
        await process.wait_ready(nc, name)
    bound = await call(
        nc,
        subjects.BINDINGS_SET,
        SetBinding(
            scope="agent", project_id=PROJECT, agent_slug="criativo", model=MODEL, provider="openai"
        ),
        BindingSetReply,
    )
    assert bound.binding is not None and bound.binding.provider == "openai"

    opened = await call(
        nc,
        subjects.SESSIONS_OPEN,
        OpenSession(project_id=PROJECT, opened_by="user:ana"),
        SessionOpenedReply,
    )
    session = opened.session_id
    deltas: list[TurnDelta] = []

    async def on_delta(msg: Msg) -> None:
        deltas.append(TurnDelta.model_validate_json(msg.data))

    sub = await nc.subscribe(subjects.delta_subject(PROJECT, session), cb=on_delta)
    await call(
        nc,
        subjects.AGENTS_ACTIVATE,
        ActivateAgent(
            project_id=PROJECT, session_id=session, agent="criativo", via="user", actor="user:ana"
        ),
        ActivationReply,
    )
    # Until Criativo's activation is in the log, a message gets the plain chat's answer.
    await wait_for(
        lambda: log_events(nc, session, EventType.AGENT_ACTIVATED.value),
        what="agent.activated in the log",
    )

    # A rule: answered, and recorded by the tool call streamed in pieces.
    rule_message = await append(
        nc, session, EventType.CHAT_MESSAGE, text="RULE: encomendas fecham às 18h"
    )
    answer = await caused_by(nc, session, EventType.AGENT_RESPONSE, rule_message)
    assert "Entendi, vou registrar." in answer.payload["text"]
    [rule] = await wait_for(
        lambda: log_events(nc, session, EventType.ARTIFACT_BUSINESS_RULE.value),
        timeout=60,
        what="the business rule",
    )
    assert rule.payload["origin"] == [str(rule_message)]
    assert rule.payload["statement"] == "RULE: encomendas fecham às 18h"
    # the tool's result went back to the model as a `tool` message after its call
    followed = [
        r.body["messages"] for r in fake.requests if r.body["messages"][-1]["role"] == "tool"
    ]
    assert followed and followed[0][-2]["tool_calls"][0]["id"] == "call_rule_1"

    # A plain message, answered from the stream.
    plain = await append(nc, session, EventType.CHAT_MESSAGE, text="Quero vender pão.")
    reply = await caused_by(nc, session, EventType.AGENT_RESPONSE, plain)
    assert reply.payload["text"] == "Entendi. Conte-me mais."
    await wait_for(
        lambda: "".join(d.text for d in deltas if d.causation_id == plain) == reply.payload["text"],
        what="the plain answer's deltas",
    )

    # Readiness: the brief, then its offer to the PO.
    readiness = await append(nc, session, EventType.CRIATIVO_READINESS_CONFIRMED)
    brief = await caused_by(nc, session, EventType.ARTIFACT_PRODUCT_BRIEF, readiness)
    assert brief.payload["title"] == "Padaria"
    assert brief.payload["business_rule_ids"] == [str(rule.id)]
    [offer] = await wait_for(
        lambda: log_events(nc, session, EventType.HANDOFF_OFFERED.value),
        timeout=60,
        what="the brief's offer",
    )
    assert (offer.payload["to_agent"], offer.payload["artifact_id"]) == ("po", str(brief.id))
    await sub.unsubscribe()

    # Every model call of the story went to the local model, metered at its price.
    summary = await call(
        nc,
        subjects.USAGE_SUMMARY,
        UsageSummaryRequest(group_by=["model"], project_id=PROJECT),
        UsageSummaryReply,
    )
    [group] = summary.groups
    assert group.key == {"model": MODEL}
    assert group.calls == len(fake.requests) >= 4 and group.errors == 0
    assert group.cost_micros == 0 and group.usage.output_tokens == 12 * group.calls
    assert all(r.path == "/v1/chat/completions" for r in fake.requests)
