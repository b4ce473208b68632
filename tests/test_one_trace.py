"""One chat message, one trace (issue 14): a person sends a message through the gateway's
WebSocket, and the spans every process exported form one trace — gateway → session_events
(the append, then the outbox's publish) → Criativo (the consumer, then `cmd.llm.stream`)
→ metering (the command, then the provider call) — with every parent link intact across
the processes, and the log lines written on the way carry the trace's id.

Each service runs as a real process exporting its spans to a JSON-lines file of its own
(`OTEL_TRACES_EXPORTER=jsonl`, servicekit.telemetry): processes share no memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from nats.aio.client import Client
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from contracts.events import EventType
from gateway.auth import mint
from testkit.probes import wait_for

SERVICES = ["session_events", "handoff", "metering", "criativo", "gateway"]
PROJECT = f"p-trace-{uuid.uuid4().hex[:6]}"
SECRET = "trace-secret-" + "x" * 40
# DEBUG: the kit's line for each command answered and each message handled.
FAST = {"AGENTBUS_OUTBOX_POLL_SECONDS": "0.2", "AGENTBUS_LOG_LEVEL": "DEBUG"}
GATEWAY = {"AGENTBUS_GATEWAY_PORT": "0", "AGENTBUS_GATEWAY_SECRET": SECRET}

Span = dict[str, Any]


def json_lines(path: Path) -> Iterator[dict[str, Any]]:
    """The JSON objects of a file, one a line; a line still being written is skipped."""
    if not path.exists():
        return
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            yield json.loads(line)


def gateway_url(log_path: Path) -> str | None:
    """The URL the gateway announced in its JSON log, once it listens."""
    return next(
        (e["url"] for e in json_lines(log_path) if e.get("event") == "gateway_listening"), None
    )


class Person:
    """The web client: one WebSocket, every frame it received kept in order."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.frames: list[dict[str, Any]] = []
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for raw in self.ws:
                self.frames.append(json.loads(raw))

    async def request(self, frame: dict[str, Any]) -> None:
        ref = uuid.uuid4().hex
        await self.ws.send(json.dumps({**frame, "ref": ref}))
        answer = await wait_for(
            lambda: next((f for f in self.frames if f.get("ref") == ref), None),
            what=f"the answer to {frame['type']}",
        )
        assert answer["type"] == "ack", answer

    def has_event(self, event_type: EventType) -> bool:
        return any(
            f["type"] == "event" and f["event"]["type"] == event_type.value for f in self.frames
        )


def one(spans: list[Span], service: str, name: str) -> Span:
    [span] = [s for s in spans if s["service"] == service and s["name"] == name]
    return span


def every(spans: list[Span], service: str, name: str) -> list[Span]:
    return [s for s in spans if s["service"] == service and s["name"] == name]


def descends_from(span: Span, ancestor: Span, by_id: dict[str, Span]) -> bool:
    """Whether `ancestor` is on the chain of parents of `span`."""
    parent = span["parent_span_id"]
    while parent is not None:
        if parent == ancestor["span_id"]:
            return True
        parent = by_id[parent]["parent_span_id"] if parent in by_id else None
    return False


def whole_trace(files: list[Path], trace_id: str) -> list[Span] | None:
    """The trace's spans once every parent named is among them (each span is written
    when it ends, and a parent ends after its children), else None."""
    spans = [s for f in files for s in json_lines(f) if s["trace_id"] == trace_id]
    ids = {s["span_id"] for s in spans}
    complete = all(s["parent_span_id"] in ids for s in spans if s["parent_span_id"])
    return spans if spans and complete else None


async def test_one_chat_message_is_one_trace_across_every_process(
    spawn: Any, nc: Client, tmp_path: Path
) -> None:
    span_files = {name: tmp_path / f"{name}.spans.jsonl" for name in SERVICES}
    processes = {
        name: spawn(
            name,
            OTEL_TRACES_EXPORTER="jsonl",
            AGENTBUS_TRACES_FILE=str(span_files[name]),
            **FAST,
            **(GATEWAY if name == "gateway" else {}),
        )
        for name in SERVICES
    }
    for name, process in processes.items():
        await process.wait_ready(nc, name, timeout=120)  # five start at once, on 2 cores
    url = await wait_for(lambda: gateway_url(processes["gateway"].log_path), what="gateway's URL")
    token = mint(SECRET, PROJECT, "ana")
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        opened = await http.post(
            f"/api/projects/{PROJECT}/sessions", headers={"authorization": f"Bearer {token}"}
        )
        ticket = await http.post(
            f"/api/projects/{PROJECT}/ws-ticket", headers={"authorization": f"Bearer {token}"}
        )
    assert opened.status_code == 201, opened.text
    assert ticket.status_code == 200, ticket.text
    ws_url = url.replace("http://", "ws://") + f"/ws?ticket={ticket.json()['ticket']}"
    ws = await connect(ws_url, max_size=None)
    person = Person(ws)
    try:
        await person.request({"type": "join", "session_id": opened.json()["session_id"]})
        await person.request({"type": "start_agent", "agent": "criativo"})
        await wait_for(
            lambda: person.has_event(EventType.AGENT_ACTIVATED),
            timeout=30,
            what="Criativo's activation in the log",
        )
        await person.request(
            {"type": "chat", "text": "uma loja de bicicletas", "client_msg_id": "m1"}
        )
        await wait_for(
            lambda: person.has_event(EventType.AGENT_RESPONSE),
            timeout=60,
            what="Criativo's answer relayed to the person",
        )
    finally:
        await ws.close()
        person.reader.cancel()

    # The chat frame starts the trace, at the gateway.
    [chat] = [s for s in json_lines(span_files["gateway"]) if s["name"] == "ws chat"]
    assert chat["kind"] == "SERVER" and chat["parent_span_id"] is None
    files = list(span_files.values())
    spans: list[Span] = await wait_for(
        lambda: whole_trace(files, chat["trace_id"]), timeout=30, what="the whole trace"
    )
    by_id = {s["span_id"]: s for s in spans}

    append = one(spans, "gateway", "send cmd.events.append")
    [appended] = [  # the gateway's append, served by the log
        s
        for s in spans
        if s["service"] == "session_events"
        and s["name"] == "cmd.events.append"
        and s["parent_span_id"] == append["span_id"]
    ]
    published = one(spans, "session_events", "publish chat.message")
    # more than one when the bus redelivered it (a loaded machine); each copy is a child
    # of the publish, and the turn runs under one of them
    consumed = every(spans, "criativo", "process chat.message")
    # Criativo's tool loop may call the model more than once for one message
    streamed = every(spans, "criativo", "send cmd.llm.stream")
    metered = every(spans, "metering", "cmd.llm.stream")
    providers = [s for s in spans if s["service"] == "metering" and s["name"].startswith("chat ")]
    assert streamed and len(metered) == len(streamed) == len(providers)

    # each hop's parent is the hop before it, across the process boundaries
    assert descends_from(append, chat, by_id)
    assert appended["remote_parent"]
    assert descends_from(published, appended, by_id)  # through the outbox row
    for copy in consumed:
        assert copy["parent_span_id"] == published["span_id"] and copy["remote_parent"]
    for call in streamed:  # through Criativo's session actor
        assert any(descends_from(call, copy, by_id) for copy in consumed)
        [served] = [s for s in metered if s["parent_span_id"] == call["span_id"]]
        assert served["remote_parent"]
        [provider] = [s for s in providers if descends_from(s, served, by_id)]

    # kinds and the semantic conventions
    kinds = {
        "ws chat": "SERVER",
        "send cmd.events.append": "CLIENT",
        "cmd.events.append": "SERVER",
        "publish chat.message": "PRODUCER",
        "process chat.message": "CONSUMER",
        "send cmd.llm.stream": "CLIENT",
        "cmd.llm.stream": "SERVER",
    }
    hops: list[Span] = [append, appended, published, *consumed, *streamed, *metered]
    for span in hops:
        assert span["kind"] == kinds[span["name"]], span
        assert span["attributes"]["messaging.system"] == "nats"
    delivery: dict[str, str] = consumed[0]["attributes"]
    assert delivery["messaging.destination.name"].startswith("chat.message.")
    assert delivery["messaging.consumer.group.name"] == "criativo-inputs"
    for provider in providers:
        assert provider["kind"] == "CLIENT"
        gen_ai = provider["attributes"]
        assert gen_ai["gen_ai.provider.name"] == "scripted"
        assert gen_ai["gen_ai.request.model"] == provider["name"].removeprefix("chat ")
        assert gen_ai["gen_ai.usage.input_tokens"] > 0
        assert gen_ai["gen_ai.usage.output_tokens"] > 0
    # asyncpg is instrumented: the log's statements are spans of the append
    statements = [
        s for s in spans if s["service"] == "session_events" and descends_from(s, appended, by_id)
    ]
    assert any(s["attributes"].get("db.system") == "postgresql" for s in statements)
    # and the gateway's Starlette app: the session was opened under an HTTP server span
    gateway = list(json_lines(span_files["gateway"]))
    [opened_span] = [s for s in gateway if s["name"] == "POST /api/projects/{project}/sessions"]
    assert opened_span["kind"] == "SERVER"
    assert opened_span["attributes"]["http.status_code"] == 201
    # the WebSocket's token (in its URL) is in no span
    assert not [s for s in gateway if token in json.dumps(s)]

    # the log lines written on the way carry the trace's id
    for name in ("gateway", "session_events", "criativo", "metering"):
        traced = [
            e for e in json_lines(processes[name].log_path) if e.get("trace_id") == chat["trace_id"]
        ]
        assert traced, f"no log line of {name} carries the trace id"
        assert all(e["span_id"] in by_id for e in traced)
