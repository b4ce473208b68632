"""Spend and rate limits per project and per person, held at the one door (metering).

Against real NATS and real Postgres: a call is admitted only if its worst case fits under
every limit in force, in the statement that holds it, so concurrent calls never spend the
last cents twice; a refusal is coded (`budget_exceeded`, `rate_limited`) with what ran
out and when it resets; only an operator sets limits.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import UTC, date, datetime, timedelta
from typing import Any

import pytest
from nats.aio.client import Client

from contracts import subjects
from contracts.common import ErrorCode
from contracts.metering import (
    ChatMessage,
    LimitsSetReply,
    LimitsStatus,
    LimitsStatusRequest,
    LlmTurn,
    SetLimits,
    SpendLimits,
    TurnReply,
)
from domain.metering import Price, estimate_input_tokens, window_start, worst_case_micros
from domain.metering_turn import prompt_bytes
from metering.providers.base import OnText, Progress, Provider, ProviderReply, ProviderRequest
from metering.providers.scripted import ScriptedProvider
from servicekit.client import CommandFailed, call
from testkit.metering import TEST_SCRIPT, Metering, Starter
from testkit.probes import wait_for

LONG = 60.0
# The seeded workspace model's list price (µUSD per million tokens).
SONNET = Price(
    "claude-sonnet-4-6", date(2026, 5, 29), 3_000_000, 15_000_000, 3_750_000, 6_000_000, 300_000
)
NO_LIMITS = SpendLimits()


def turn(project: str, person: str | None = None, **fields: Any) -> LlmTurn:
    values: dict[str, Any] = {
        "run_id": f"run-{uuid.uuid4().hex[:8]}",
        "turn_id": f"turn-{uuid.uuid4().hex}",
        "agent_slug": "cheap",
        "project_id": project,
        "person": person,
        "messages": [ChatMessage(role="user", content="Hello")],
        "max_tokens": 100,
        **fields,
    }
    return LlmTurn.model_validate(values)


def hold_of(cmd: LlmTurn) -> int:
    """The worst case metering holds for `cmd` (the seeded workspace model: Sonnet)."""
    tokens = estimate_input_tokens(prompt_bytes(cmd), len(cmd.messages))
    return worst_case_micros(tokens, cmd.max_tokens, SONNET)


async def set_limits(nc: Client, scope: str, name: str, **limits: int | None) -> LimitsSetReply:
    cmd = SetLimits.model_validate({"scope": scope, "name": name, "limits": limits})
    return await call(nc, subjects.LIMITS_SET, cmd, LimitsSetReply)


async def status(nc: Client, project: str, person: str | None = None) -> LimitsStatus:
    request = LimitsStatusRequest(project_id=project, person=person)
    return await call(nc, subjects.LIMITS_STATUS, request, LimitsStatus)


async def outcome(nc: Client, cmd: LlmTurn) -> TurnReply | CommandFailed:
    try:
        return await call(nc, subjects.LLM_TURN, cmd, TurnReply, timeout=LONG)
    except CommandFailed as exc:
        return exc


class Gated:
    """The scripted provider behind a gate: calls wait inside the provider until it opens,
    so every admitted call holds its worst case at the same time."""

    def __init__(self, inner: Provider) -> None:
        self.inner = inner
        self.name = inner.name
        self.inside = 0
        self.gate = asyncio.Event()

    async def complete(
        self, request: ProviderRequest, progress: Progress, on_text: OnText | None
    ) -> ProviderReply:
        self.inside += 1
        await self.gate.wait()
        return await self.inner.complete(request, progress, on_text)

    async def close(self) -> None:
        await self.inner.close()


async def counters(metering: Metering, scope: str, name: str) -> dict[str, tuple[int, int]]:
    rows = await metering.db.fetch(
        "SELECT metric, win, used, held FROM usage_counters WHERE scope = $1 AND name = $2",
        scope,
        name,
    )
    return {f"{r['metric']}/{r['win']}": (r["used"], r["held"]) for r in rows}


async def test_concurrent_calls_never_spend_a_projects_last_cents_twice(
    start_metering: Starter, nc: Client
) -> None:
    provider = Gated(ScriptedProvider(TEST_SCRIPT))
    metering = await start_metering(provider=provider)
    calls = [turn("race") for _ in range(24)]
    hold = hold_of(calls[0])
    # Room for five worst cases and a half: the sixth must not get the last cents.
    limit = 5 * hold + hold // 2
    await set_limits(nc, "project", "race", micros_per_day=limit)

    racing = [asyncio.ensure_future(outcome(nc, c)) for c in calls]
    await wait_for(lambda: provider.inside == 5 and sum(t.done() for t in racing) == 19)
    refused = [t.result() for t in racing if t.done()]
    provider.gate.set()
    answered = await asyncio.gather(*racing)

    ok = [r for r in answered if isinstance(r, TurnReply)]
    assert len(ok) == 5 and provider.inside == 5
    assert all(isinstance(r, CommandFailed) for r in refused)
    tomorrow = window_start("day", datetime.now(UTC)) + timedelta(days=1)
    for failure in refused:
        assert isinstance(failure, CommandFailed)
        assert failure.code == ErrorCode.BUDGET_EXCEEDED
        assert failure.details["scope"] == "project"
        assert failure.details["name"] == "race"
        assert failure.details["window"] == "day"
        assert failure.details["limit"] == limit
        assert failure.details["resets_at"] == tomorrow.isoformat()
        assert "nothing was called" in failure.message
    spent = sum(r.cost_micros for r in ok)
    used = await counters(metering, "project", "race")
    assert used["micros/day"] == (spent, 0) and used["micros/month"] == (spent, 0)
    assert spent <= limit
    billed = await metering.db.fetchval(
        "SELECT sum(cost_micros) FROM token_usage WHERE project_id = 'race'"
    )
    assert billed == spent


async def test_a_persons_limit_applies_across_their_calls_and_not_to_others(
    metering: Metering, nc: Client
) -> None:
    first = turn("shared", "ana")
    await set_limits(nc, "person", "ana", micros_per_day=hold_of(first) + 1)
    assert isinstance(await outcome(nc, first), TurnReply)

    again = await outcome(nc, turn("shared", "ana"))
    assert isinstance(again, CommandFailed) and again.code == ErrorCode.BUDGET_EXCEEDED
    assert again.details["scope"] == "person" and again.details["name"] == "ana"
    # the project and another person are not held back by Ana's limit
    assert isinstance(await outcome(nc, turn("shared", "bia")), TurnReply)
    assert isinstance(await outcome(nc, turn("shared")), TurnReply)
    assert metering.calls == 3


async def test_requests_per_minute_refuse_with_a_retry_after(
    metering: Metering, nc: Client
) -> None:
    await set_limits(nc, "project", "busy", requests_per_minute=2)
    assert isinstance(await outcome(nc, turn("busy")), TurnReply)
    assert isinstance(await outcome(nc, turn("busy")), TurnReply)
    third = await outcome(nc, turn("busy"))
    if isinstance(third, TurnReply):  # the minute turned between the calls: fill this one
        await metering.db.execute(
            """UPDATE usage_counters SET used = 2 WHERE name = 'busy' AND metric = 'requests'
                  AND starts = date_trunc('minute', now(), 'UTC')"""
        )
        third = await outcome(nc, turn("busy"))
    assert isinstance(third, CommandFailed)
    assert third.code == ErrorCode.RATE_LIMITED
    assert third.details["metric"] == "requests" and third.details["window"] == "minute"
    assert 1 <= third.details["retry_after_seconds"] <= 60
    assert "nothing was called" in third.message


async def test_tokens_per_minute_count_the_worst_case_then_what_was_used(
    metering: Metering, nc: Client
) -> None:
    cmd = turn("wordy", max_tokens=1000)
    worst = estimate_input_tokens(prompt_bytes(cmd), len(cmd.messages)) + 1000
    await set_limits(nc, "project", "wordy", tokens_per_minute=worst)
    reply = await outcome(nc, cmd)
    assert isinstance(reply, TurnReply)
    used = await counters(metering, "project", "wordy")
    assert used["tokens/minute"] == (reply.usage.input_tokens + reply.usage.output_tokens, 0)


async def test_a_window_that_ended_does_not_count(metering: Metering, nc: Client) -> None:
    cmd = turn("daily")
    await set_limits(nc, "project", "daily", micros_per_day=hold_of(cmd))
    # yesterday's spend, at the limit: today starts afresh
    await metering.db.execute(
        """INSERT INTO usage_counters (scope, name, metric, win, starts, used, "limit")
           VALUES ('project', 'daily', 'micros', 'day',
                   date_trunc('day', now(), 'UTC') - interval '1 day', $1, $1)""",
        hold_of(cmd),
    )
    assert isinstance(await outcome(nc, cmd), TurnReply)


async def test_limits_fall_back_to_the_default_field_by_field(
    metering: Metering, nc: Client
) -> None:
    await set_limits(nc, "project", "*", micros_per_day=50, requests_per_minute=7)
    await set_limits(nc, "project", "own", micros_per_day=900)
    seen = await status(nc, "own")
    by_kind = {(u.metric, u.window): u.limit for u in seen.limits if u.scope == "project"}
    # its own daily figure and the default's rate; setting a level replaces it whole, so
    # the default now limits neither the month nor the tokens
    assert by_kind == {("micros", "day"): 900, ("requests", "minute"): 7}
    assert seen.exhausted == []


async def test_status_shows_what_a_window_used_and_what_is_exhausted(
    metering: Metering, nc: Client
) -> None:
    cmd = turn("shown", "caio")
    await set_limits(nc, "person", "caio", micros_per_day=hold_of(cmd) + 1)
    reply = await outcome(nc, cmd)
    assert isinstance(reply, TurnReply)
    seen = await status(nc, "shown", "caio")
    kinds = {(u.scope, u.metric, u.window): u for u in seen.limits}
    day = kinds[("person", "micros", "day")]
    assert (day.used, day.held, day.name) == (reply.cost_micros, 0, "caio")
    assert day.resets_at == window_start("day", datetime.now(UTC)) + timedelta(days=1)
    await set_limits(nc, "person", "caio", micros_per_day=reply.cost_micros)
    assert [u.window for u in (await status(nc, "shown", "caio")).exhausted] == ["day"]


async def test_lifting_the_defaults_leaves_no_limit(metering: Metering, nc: Client) -> None:
    await set_limits(nc, "project", "*", **NO_LIMITS.model_dump())
    await set_limits(nc, "person", "*", **NO_LIMITS.model_dump())
    assert (await status(nc, "free", "dora")).limits == []
    assert isinstance(await outcome(nc, turn("free", "dora")), TurnReply)


@pytest.mark.parametrize(
    "request_body",
    [
        {"scope": "project", "name": "a.b", "limits": {}},
        {"scope": "project", "name": "x", "limits": {"micros_per_day": -1}},
        {"scope": "team", "name": "x", "limits": {}},
        {"scope": "person", "name": "bad name", "limits": {}},
        {"scope": "person", "name": "x", "limits": {"per_year": 5}},
    ],
)
async def test_bad_limits_are_refused_and_nothing_is_written(
    metering: Metering, nc: Client, request_body: dict[str, Any]
) -> None:
    before = await metering.db.fetchval("SELECT count(*) FROM limits")
    reply = await nc.request(subjects.LIMITS_SET, json.dumps(request_body).encode(), timeout=LONG)
    error = json.loads(reply.data)["error"]
    assert error["code"] in (ErrorCode.INVALID_REQUEST, ErrorCode.INVALID_LIMITS), error
    assert await metering.db.fetchval("SELECT count(*) FROM limits") == before


async def test_a_turn_id_reused_by_another_request_is_refused_with_a_code(
    metering: Metering, nc: Client
) -> None:
    first = turn("proj", turn_id="not-a-uuid")
    assert isinstance(await outcome(nc, first), TurnReply)
    for other in (
        turn("proj", turn_id="not-a-uuid"),  # another run
        turn("elsewhere", run_id=first.run_id, turn_id="not-a-uuid"),  # another project
        turn("proj", "eva", run_id=first.run_id, turn_id="not-a-uuid"),  # another person
    ):
        refused = await outcome(nc, other)
        assert isinstance(refused, CommandFailed)
        assert refused.code == ErrorCode.TURN_ID_REUSED
        assert refused.details["turn_id"] == "not-a-uuid"
    # the same request again is a retry: its first reply, nothing called
    repeat = await outcome(nc, first)
    assert isinstance(repeat, TurnReply) and repeat.duplicate
    assert metering.calls == 1
