"""Every service, as real processes, scraped after one chat turn with Criativo made by a
person through the gateway's HTTP API and WebSocket (issue 14): each answers `/livez`
and `/readyz`, and its `/metrics` holds the series of what happened, with the values the
store, the bus and the client agree on — the LLM series equal to the `token_usage` rows,
the commands each service answered, Criativo's live actor, the consumers' deliveries,
the outboxes drained, `$SRV.STATS` errors, and the gateway's connection, the frames the
client sent and received, no error frame and no slow-client close."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import asyncpg
import httpx
from nats.aio.client import Client
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from contracts import subjects
from contracts.events import EventType
from gateway.auth import mint
from testkit.probes import wait_for

SERVICES = ["session_events", "handoff", "metering", "criativo", "psychologist", "gateway"]
PROJECT = f"p-metrics-{uuid.uuid4().hex[:6]}"
SECRET = "metrics-secret-" + "x" * 40
FAST = {"AGENTBUS_OUTBOX_POLL_SECONDS": "0.2"}
# Any free port for the gateway's HTTP and WebSocket; its URL is read from its log.
GATEWAY = {"AGENTBUS_GATEWAY_PORT": "0", "AGENTBUS_GATEWAY_SECRET": SECRET}

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def matching(samples: Samples, name: str, **labels: str) -> dict[frozenset[Any], float]:
    """The samples of `name` whose labels include `labels`."""
    want = set(labels.items())
    return {lbl: v for (n, lbl), v in samples.items() if n == name and want <= lbl}


async def metrics_url(nc: Client, service: str) -> str:
    info = json.loads((await nc.request(f"$SRV.INFO.{service}", b"", timeout=5)).data)
    url: str = info["metadata"]["metrics"]
    assert url.startswith("http://127.0.0.1:")
    return url


def gateway_url(log_path: Path) -> str | None:
    """The URL the gateway announced in its (JSON) log, once it listens."""
    for line in log_path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if entry.get("event") == "gateway_listening":
                url: str = entry["url"]
                return url
    return None


class Person:
    """The web client's side of the turn: HTTP for the session, one WebSocket for the rest,
    every frame it received kept in order."""

    def __init__(self, url: str, ws: ClientConnection) -> None:
        self.url = url
        self.ws = ws
        self.sent: Counter[str] = Counter()
        self.frames: list[dict[str, Any]] = []
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for raw in self.ws:
                self.frames.append(json.loads(raw))

    def received(self) -> Counter[str]:
        return Counter(f["type"] for f in self.frames)

    async def request(self, frame: dict[str, Any]) -> dict[str, Any]:
        """Send `frame`; its `ack` (an `error` fails the test)."""
        ref = uuid.uuid4().hex
        await self.ws.send(json.dumps({**frame, "ref": ref}))
        self.sent[frame["type"]] += 1
        answer: dict[str, Any] = await wait_for(
            lambda: next((f for f in self.frames if f.get("ref") == ref), None),
            what=f"the answer to {frame['type']}",
        )
        assert answer["type"] == "ack", answer
        return answer

    def event_types(self) -> list[str]:
        return [f["event"]["type"] for f in self.frames if f["type"] == "event"]


async def chat_turn(person: Person) -> uuid.UUID:
    """Open a session over HTTP, then join, start Criativo and chat over the WebSocket."""
    token = mint(SECRET, PROJECT, "ana")
    async with httpx.AsyncClient(base_url=person.url, timeout=30) as http:
        opened = await http.post(
            f"/api/projects/{PROJECT}/sessions", headers={"authorization": f"Bearer {token}"}
        )
    assert opened.status_code == 201, opened.text
    session = uuid.UUID(opened.json()["session_id"])
    await person.request({"type": "join", "session_id": str(session)})
    await person.request({"type": "start_agent", "agent": "criativo"})
    # `agent.activated` reaches the log through handoff's outbox: a message appended
    # before it is (rightly) answered by the plain chat, which is not the turn measured.
    await wait_for(
        lambda: EventType.AGENT_ACTIVATED.value in person.event_types(),
        timeout=30,
        what="Criativo's activation in the log",
    )
    await person.request({"type": "chat", "text": "uma loja de bicicletas", "client_msg_id": "m1"})
    await wait_for(
        lambda: EventType.AGENT_RESPONSE.value in person.event_types(),
        timeout=60,
        what="Criativo's answer relayed to the person",
    )
    return session


async def test_every_service_serves_the_series_of_a_chat_turn(
    spawn: Any, nc: Client, database_url: str
) -> None:
    processes = {
        name: spawn(name, **FAST, **(GATEWAY if name == "gateway" else {})) for name in SERVICES
    }
    for name, process in processes.items():
        await process.wait_ready(nc, name)
    url = await wait_for(lambda: gateway_url(processes["gateway"].log_path), what="gateway's URL")
    token = mint(SECRET, PROJECT, "ana")
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        ticket = await http.post(
            f"/api/projects/{PROJECT}/ws-ticket", headers={"authorization": f"Bearer {token}"}
        )
    assert ticket.status_code == 200, ticket.text
    ws_url = url.replace("http://", "ws://") + f"/ws?ticket={ticket.json()['ticket']}"
    ws = await connect(ws_url, max_size=None)
    person = Person(url, ws)
    await chat_turn(person)
    refused = await nc.request(subjects.EVENTS_APPEND, b"{oops", timeout=5)
    assert refused.headers and refused.headers["Nats-Service-Error-Code"] == "malformed_json"

    db = await asyncpg.connect(database_url)
    try:
        usage = await db.fetch(
            """SELECT model, agent_slug, count(*) AS calls,
                      sum(input_tokens) AS input, sum(output_tokens) AS output,
                      sum(cache_read_tokens) AS cache_read,
                      sum(cache_write_5m_tokens + cache_write_1h_tokens) AS cache_write,
                      sum(cost_micros) AS cost, count(first_token_at) AS first_tokens
                 FROM metering.token_usage WHERE project_id = $1
                GROUP BY model, agent_slug""",
            PROJECT,
        )
        await wait_for(
            lambda: db.fetchval(
                "SELECT (SELECT count(*) FROM session_events.outbox)"
                " + (SELECT count(*) FROM handoff.outbox)"
                " = 0"
            ),
            what="the outboxes drained",
        )
    finally:
        await db.close()
    # Criativo's turn: a tool loop of two calls in the offline script (a rule, then the answer)
    assert [(r["agent_slug"], r["calls"]) for r in usage] == [("criativo", 2)]

    scraped: dict[str, Samples] = {}
    async with httpx.AsyncClient(timeout=10) as http:
        for name in SERVICES:
            base = await metrics_url(nc, name)
            assert (await http.get(f"{base}/livez")).status_code == 200
            ready = await http.get(f"{base}/readyz")
            assert ready.status_code == 200, f"{name}: {ready.text}"
            scraped[name] = parse((await http.get(f"{base}/metrics")).text)

    # metering: the calls of the turn's model and agent, their tokens and cost as billed
    metering = scraped["metering"]
    for row in usage:
        model, agent = row["model"], row["agent_slug"]
        assert sample(metering, "agentbus_llm_calls_total", model=model, agent=agent, status="ok")
        assert (
            sample(metering, "agentbus_llm_calls_total", model=model, agent=agent, status="ok")
            == row["calls"]
        )
        for kind in ("input", "output", "cache_read", "cache_write"):
            got = sample(metering, "agentbus_llm_tokens_total", model=model, agent=agent, kind=kind)
            assert got == row[kind], kind
        assert row["input"] > 0 and row["output"] > 0
        cost = sample(metering, "agentbus_llm_cost_micro_usd_total", model=model, agent=agent)
        assert cost == row["cost"]
        ttft = sample(
            metering, "agentbus_llm_time_to_first_token_seconds_count", model=model, agent=agent
        )
        assert ttft == row["first_tokens"] >= 1
        assert not matching(metering, "agentbus_llm_errors_total", model=model, agent=agent)
    assert sample(
        metering, "agentbus_command_duration_seconds_count", subject=subjects.LLM_STREAM
    ) + sample(metering, "agentbus_command_duration_seconds_count", subject=subjects.LLM_TURN) == (
        sum(r["calls"] for r in usage)
    )

    # the log: the commands it answered, the malformed one counted as an error
    log = scraped["session_events"]
    assert sample(log, "agentbus_command_duration_seconds_count", subject=subjects.SESSIONS_OPEN)
    assert sample(log, "agentbus_command_duration_seconds_count", subject=subjects.EVENTS_APPEND)
    assert (
        sample(
            log,
            "agentbus_command_errors_total",
            subject=subjects.EVENTS_APPEND,
            code="malformed_json",
        )
        == 1
    )
    assert sample(log, "agentbus_outbox_rows", schema="session_events") == 0
    assert sample(log, "agentbus_outbox_oldest_row_age_seconds", schema="session_events") == 0

    # handoff: the activation, its consumer and outbox
    handoff = scraped["handoff"]
    assert (
        sample(handoff, "agentbus_command_duration_seconds_count", subject=subjects.AGENTS_ACTIVATE)
        == 1
    )
    assert sample(handoff, "agentbus_outbox_rows", schema="handoff") == 0

    # Criativo: the session's actor is alive, its consumer took the activation and the message
    criativo = scraped["criativo"]
    assert sample(criativo, "agentbus_criativo_live_actors") == 1
    deliveries = matching(criativo, "agentbus_consumer_deliveries_total")
    assert sum(deliveries.values()) >= 2
    handled = matching(criativo, "agentbus_consumer_handler_duration_seconds_count", outcome="ack")
    assert sum(handled.values()) >= 2
    pending = matching(criativo, "agentbus_consumer_pending_messages")
    assert pending and all(v == 0 for v in pending.values())

    # the psychologist: its consumers are sampled (nothing closed, nothing pending)
    psychologist = scraped["psychologist"]
    lag = matching(psychologist, "agentbus_consumer_pending_messages")
    assert lag and all(v == 0 for v in lag.values())

    # nothing was dead-lettered anywhere
    for name, samples in scraped.items():
        assert not any(matching(samples, "agentbus_dead_letters_total").values()), name

    # `nats micro stats`: the malformed append counted as an error of its endpoint
    stats = json.loads((await nc.request("$SRV.STATS.session_events", b"", timeout=5)).data)
    [append] = [e for e in stats["endpoints"] if e["subject"] == subjects.EVENTS_APPEND]
    assert append["num_errors"] == 1 and append["num_requests"] >= 2

    # the gateway: the person's connection open and joined, the frames it sent counted by
    # type, the session opened over HTTP, no error frame, no slow-client close
    gateway = scraped["gateway"]
    assert sample(gateway, "agentbus_gateway_ws_connections") == 1
    assert sample(gateway, "agentbus_gateway_ws_joined_sessions") == 1
    received = matching(gateway, "agentbus_gateway_ws_frames_received_total")
    assert {dict(lbl)["type"]: v for lbl, v in received.items()} == person.sent
    assert person.sent == {"join": 1, "start_agent": 1, "chat": 1}
    assert not any(matching(gateway, "agentbus_gateway_ws_error_frames_total").values())
    assert sample(gateway, "agentbus_gateway_ws_slow_client_closes_total") == 0
    opened = sample(
        gateway,
        "agentbus_gateway_http_request_duration_seconds_count",
        route="/api/projects/{project}/sessions",
        method="POST",
        status="201",
    )
    assert opened == 1
    gateway_metrics = await metrics_url(nc, "gateway")

    async def gateway_now() -> Samples:
        async with httpx.AsyncClient(timeout=10) as http:
            return parse((await http.get(f"{gateway_metrics}/metrics")).text)

    async def sent_as_received() -> Samples | None:
        """The gateway's scrape once every frame it counted has reached the person (frames
        of the session may still be on their way: events after the answer, a `done`)."""
        now = await gateway_now()
        sent = matching(now, "agentbus_gateway_ws_frames_sent_total")
        by_type = {dict(lbl)["type"]: v for lbl, v in sent.items() if v}
        return now if by_type == person.received() else None

    settled: Samples = await wait_for(sent_as_received, what="the frames sent, all received")
    assert sample(settled, "agentbus_gateway_ws_frames_sent_total", type="ack") == 3
    assert sample(settled, "agentbus_gateway_ws_frames_sent_total", type="delta") >= 1
    assert sample(settled, "agentbus_gateway_ws_frames_sent_total", type="error") == 0
    assert person.received()["error"] == 0

    # the person leaves: no connection, no joined session
    await ws.close()
    await person.reader

    async def left() -> bool:
        now = await gateway_now()
        return (
            sample(now, "agentbus_gateway_ws_connections") == 0
            and sample(now, "agentbus_gateway_ws_joined_sessions") == 0
        )

    await wait_for(left, what="the gateway's gauges back to 0 after the close")
