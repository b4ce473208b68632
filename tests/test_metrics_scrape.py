"""Every service but the gateway, as real processes, scraped after one chat turn with
Criativo (issue 14): each answers `/livez` and `/readyz`, and its `/metrics` holds the
series of what happened, with the values the store and the bus agree on — the LLM
series equal to the `token_usage` rows, the commands each service answered, Criativo's
live actor, the consumers' deliveries, the outboxes drained, `$SRV.STATS` errors."""

from __future__ import annotations

import json
import uuid
from typing import Any

import asyncpg
import httpx
from nats.aio.client import Client
from prometheus_client.parser import text_string_to_metric_families

from contracts import subjects
from contracts.events import EventType
from contracts.handoff import ActivateAgent, ActivationReply
from contracts.session_events import AppendedReply, AppendEvent, OpenSession, SessionOpenedReply
from servicekit.client import call
from servicekit.testing import log_events, wait_for

SERVICES = ["session_events", "handoff", "metering", "criativo", "psychologist"]
PROJECT = f"p-metrics-{uuid.uuid4().hex[:6]}"
FAST = {"AGENTBUS_OUTBOX_POLL_SECONDS": "0.2"}

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


async def chat_turn(nc: Client) -> uuid.UUID:
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
    await call(
        nc,
        subjects.EVENTS_APPEND,
        AppendEvent(
            session_id=session,
            type=EventType.CHAT_MESSAGE.value,
            actor="user:ana",
            payload={"text": "uma loja de bicicletas"},
        ),
        AppendedReply,
    )
    await wait_for(
        lambda: log_events(nc, session, EventType.AGENT_RESPONSE.value),
        timeout=60,
        what="Criativo's answer in the log",
    )
    return session


async def test_every_service_serves_the_series_of_a_chat_turn(
    spawn: Any, nc: Client, database_url: str
) -> None:
    processes = [(spawn(name, **FAST), name) for name in SERVICES]
    for process, name in processes:
        await process.wait_ready(nc, name)
    await chat_turn(nc)
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
