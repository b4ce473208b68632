"""Metering against real NATS and real Postgres, with the scripted provider."""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import date
from typing import Any

import asyncpg
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from contracts import subjects
from contracts.metering import (
    BindingSetReply,
    BindingsReply,
    ChatMessage,
    ListBindings,
    LlmStream,
    LlmTurn,
    ResolveBinding,
    ResolvedBinding,
    SetBinding,
    TokenUsage,
    TurnDelta,
    TurnReply,
    UsageSummaryReply,
    UsageSummaryRequest,
)
from domain.metering import Price, cost_micros, estimate_input_tokens, worst_case_micros
from domain.metering_turn import prompt_bytes
from metering.cancels import RunningTurn
from metering.catalog import Catalog
from metering.publisher import Coalescing, DeltaPublisher
from metering.repository import MeteringRepository
from servicekit.client import CommandFailed, call
from servicekit.db import create_pool
from testkit.metering import Metering, Starter
from testkit.probes import subscribed, wait_for

# The seeded list prices (µUSD per million tokens).
SEEDED = date(2026, 5, 29)
SONNET = Price("claude-sonnet-4-6", SEEDED, 3_000_000, 15_000_000, 3_750_000, 6_000_000, 300_000)
HAIKU = Price("claude-haiku-4-5", SEEDED, 1_000_000, 5_000_000, 1_250_000, 2_000_000, 100_000)
LONG = 60.0


def turn(agent: str = "writer", **fields: Any) -> LlmTurn:
    values: dict[str, Any] = {
        "run_id": f"run-{uuid.uuid4().hex[:8]}",
        "turn_id": f"turn-{uuid.uuid4().hex}",
        "agent_slug": agent,
        "project_id": "proj",
        "messages": [ChatMessage(role="user", content="Hello")],
        "max_tokens": 100,
        **fields,
    }
    return LlmTurn.model_validate(values)


async def run_turn(nc: Client, cmd: LlmTurn, subject: str = subjects.LLM_TURN) -> TurnReply:
    return await call(nc, subject, cmd, TurnReply, timeout=LONG)


async def resolve(nc: Client, agent: str, project: str = "proj", **kw: Any) -> str:
    reply = await call(
        nc,
        subjects.BINDINGS_RESOLVE,
        ResolveBinding(agent_slug=agent, project_id=project, **kw),
        ResolvedBinding,
    )
    return reply.model


async def bind(nc: Client, **fields: Any) -> BindingSetReply:
    return await call(nc, subjects.BINDINGS_SET, SetBinding(**fields), BindingSetReply)


async def run_row(db: asyncpg.Connection, run_id: str) -> asyncpg.Record:
    row = await db.fetchrow("SELECT * FROM run_budgets WHERE run_id = $1", run_id)
    assert row is not None
    return row


async def usage_rows(db: asyncpg.Connection, **where: str) -> list[asyncpg.Record]:
    ((column, value),) = where.items()
    sql = {
        "turn_id": "SELECT * FROM token_usage WHERE turn_id = $1",
        "run_id": "SELECT * FROM token_usage WHERE run_id = $1 ORDER BY turn_id",
    }[column]
    return list(await db.fetch(sql, value))


# --- bindings -------------------------------------------------------------------


async def test_seeded_bindings_pick_the_adr_models(nc: Client, metering: Metering) -> None:
    assert await resolve(nc, "psicologo") == "claude-opus-4-8"
    assert await resolve(nc, "psicologo-leve") == "claude-haiku-4-5"
    assert await resolve(nc, "criativo") == "claude-sonnet-4-6"
    assert await resolve(nc, "po") == "claude-sonnet-4-6"  # the workspace default


async def test_each_level_of_the_cascade_overrides_the_next(nc: Client, metering: Metering) -> None:
    session = uuid.uuid4()
    await bind(nc, scope="workspace", model="claude-haiku-4-5")
    assert await resolve(nc, "po") == "claude-haiku-4-5"
    await bind(nc, scope="project", project_id="proj", model="claude-opus-4-8")
    assert await resolve(nc, "po") == "claude-opus-4-8"
    assert await resolve(nc, "po", project="other") == "claude-haiku-4-5"
    await bind(nc, scope="agent", agent_slug="po", model="claude-sonnet-4-6")
    assert await resolve(nc, "po") == "claude-sonnet-4-6"
    await bind(nc, scope="agent", agent_slug="po", project_id="proj", model="claude-haiku-4-5")
    assert await resolve(nc, "po") == "claude-haiku-4-5"
    assert await resolve(nc, "po", project="other") == "claude-sonnet-4-6"
    await bind(nc, scope="session", session_id=session, model="claude-opus-4-8")
    assert await resolve(nc, "po", session_id=session) == "claude-opus-4-8"
    assert await resolve(nc, "po", session_id=uuid.uuid4()) == "claude-haiku-4-5"

    removed = await bind(nc, scope="session", session_id=session, model=None)
    assert removed.removed
    assert await resolve(nc, "po", session_id=session) == "claude-haiku-4-5"

    listed = await call(nc, subjects.BINDINGS_LIST, ListBindings(project_id="proj"), BindingsReply)
    levels = ["session", "agent", "project", "workspace"]
    ranks = [levels.index(b.scope) for b in listed.bindings]
    assert ranks == sorted(ranks)  # most specific level first
    assert {"workspace", "project", "agent"} == {b.scope for b in listed.bindings}


async def test_a_binding_change_reaches_every_replica_without_waiting_for_a_refresh(
    nc: Client, start_metering: Starter, database_url: str
) -> None:
    await start_metering(catalog_refresh_seconds=3600)
    # A second replica's cache, watching the announcements; its periodic refresh is
    # an hour away, so only the announcement can update it within the test.
    pool = await create_pool(database_url, "metering")
    other = Catalog(MeteringRepository(pool))
    await other.reload()
    watcher = asyncio.create_task(other.watch(nc, refresh_seconds=3600))
    try:
        assert other.resolve("criativo", "proj", None).model == "claude-sonnet-4-6"
        await wait_for(lambda: other.reloads >= 1, what="the watcher")
        await bind(nc, scope="agent", agent_slug="criativo", model="claude-haiku-4-5")
        await wait_for(
            lambda: other.resolve("criativo", "proj", None).model == "claude-haiku-4-5",
            what="the other replica to see the new binding",
        )
    finally:
        watcher.cancel()
        await pool.close()


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        ({"scope": "session", "model": "claude-haiku-4-5"}, "invalid_binding"),
        ({"scope": "project", "agent_slug": "x", "model": "claude-haiku-4-5"}, "invalid_binding"),
        ({"scope": "workspace", "model": "gpt-9"}, "unknown_model"),
    ],
)
async def test_a_bad_binding_is_refused_and_changes_nothing(
    nc: Client, metering: Metering, fields: dict[str, Any], code: str
) -> None:
    before = await metering.db.fetch("SELECT * FROM bindings ORDER BY id")
    with pytest.raises(CommandFailed) as refused:
        await bind(nc, **fields)
    assert refused.value.code == code
    assert await metering.db.fetch("SELECT * FROM bindings ORDER BY id") == before


# --- turns ----------------------------------------------------------------------


async def test_a_turn_is_priced_with_cache_tokens_and_written_once(
    nc: Client, metering: Metering
) -> None:
    cmd = turn("writer", budget_micros=1_000_000)
    reply = await run_turn(nc, cmd)

    usage = TokenUsage(
        input_tokens=1200, output_tokens=30, cache_write_5m_tokens=500, cache_read_tokens=4000
    )
    # 1200*3 + 30*15 + 500*3.75 + 4000*0.3 = 3600 + 450 + 1875 + 1200
    assert reply.cost_micros == cost_micros(usage, SONNET) == 7125
    assert reply.usage == usage
    assert reply.model == "claude-sonnet-4-6"
    assert reply.content[0].type == "text" and reply.content[0].text == "Three words here."
    assert reply.budget_remaining_micros == 1_000_000 - 7125
    [row] = await usage_rows(metering.db, turn_id=cmd.turn_id)
    assert (row["status"], row["kind"], row["cost_micros"]) == ("ok", "turn", 7125)
    assert (row["cache_write_5m_tokens"], row["cache_read_tokens"]) == (500, 4000)
    assert row["provider"] == "scripted" and row["finished_at"] >= row["started_at"]
    holds = await metering.db.fetch("SELECT status, cost_micros FROM budget_holds")
    assert [tuple(h) for h in holds] == [("settled", 7125)]
    run = await run_row(metering.db, cmd.run_id)
    assert (run["spent_micros"], run["reserved_micros"]) == (7125, 0)


async def test_repeating_a_turn_id_returns_the_stored_reply_and_calls_nothing(
    nc: Client, metering: Metering
) -> None:
    cmd = turn("writer")
    first = await run_turn(nc, cmd)
    calls = metering.calls
    again = await run_turn(nc, cmd)
    assert again.duplicate and not first.duplicate
    assert again.content == first.content and again.cost_micros == first.cost_micros
    assert metering.calls == calls
    assert len(await usage_rows(metering.db, turn_id=cmd.turn_id)) == 1


async def test_a_stream_publishes_its_text_in_numbered_deltas_then_replies_whole(
    nc: Client, metering: Metering
) -> None:
    subject = f"agent.delta.proj.{uuid.uuid4()}"
    deltas: list[TurnDelta] = []

    async def collect(msg: Msg) -> None:
        deltas.append(TurnDelta.model_validate_json(msg.data))

    sub = await nc.subscribe(subject, cb=collect)
    await subscribed(nc)
    cmd = LlmStream(**turn("streamer").model_dump(), delta_subject=subject)
    reply = await run_turn(nc, cmd, subjects.LLM_STREAM)
    text = "one two three four five six seven eight nine ten"
    # Published before the reply: they are all here once it is (one connection, in order).
    await wait_for(lambda: "".join(d.text for d in deltas) == text, what="the whole text")
    await sub.unsubscribe()

    assert [d.seq for d in deltas] == list(range(1, len(deltas) + 1))
    assert {d.turn_id for d in deltas} == {cmd.turn_id}
    assert reply.content[0].type == "text" and reply.content[0].text == text
    assert reply.usage.output_tokens == 10
    [row] = await usage_rows(metering.db, turn_id=cmd.turn_id)
    assert (row["kind"], row["status"]) == ("stream", "ok")
    assert row["first_token_at"] is not None


async def published(nc: Client, subject: str) -> list[TurnDelta]:
    """The deltas published on `subject` from now on, as they arrive."""
    deltas: list[TurnDelta] = []

    async def collect(msg: Msg) -> None:
        deltas.append(TurnDelta.model_validate_json(msg.data))

    await nc.subscribe(subject, cb=collect)
    await subscribed(nc)
    return deltas


async def test_without_a_window_pieces_handed_on_together_after_the_first_go_as_one_delta(
    nc: Client,
) -> None:
    """Window 0: the first piece of a read of the provider's stream is published at once;
    the rest of that read is published as one delta once the provider waits again (its
    first piece's time): fewer messages for every hop after metering when text arrives
    faster than it is read, a delta per piece when it is read as it comes."""
    subject = f"agent.delta.proj.{uuid.uuid4()}"
    deltas = await published(nc, subject)
    publish = DeltaPublisher(nc, subject, "turn-coalesced", coalescing=Coalescing(window=0))
    for at, piece in enumerate(["Bom ", "dia", ", ", "Ana"]):  # one read: no wait between
        await publish(piece, float(at))
    await asyncio.sleep(0)  # the provider waits for its next read
    await publish(".", 9.0)
    await publish.flush()  # the stream ended
    await wait_for(lambda: len(deltas) == 3, what="three deltas")

    got = [(d.seq, d.text, d.emitted_at, d.turn_id) for d in deltas]
    assert got == [
        (1, "Bom ", 0.0, "turn-coalesced"),
        (2, "dia, Ana", 1.0, "turn-coalesced"),
        (3, ".", 9.0, "turn-coalesced"),
    ]
    assert publish.text == "Bom dia, Ana."


async def test_pieces_held_when_the_stream_is_stopped_are_never_published(nc: Client) -> None:
    subject = f"agent.delta.proj.{uuid.uuid4()}"
    deltas = await published(nc, subject)
    provider_call = asyncio.get_running_loop().create_future()
    publish = DeltaPublisher(nc, subject, "turn-stopped")
    publish.running = RunningTurn(("turn-stopped", "proj", None), provider_call)
    await publish("one ", 1.0)  # published at once
    await publish("two ", 2.0)  # the same read: held until the provider waits
    assert publish.running.stop()  # `cmd.llm.cancel`, before the provider waited again
    await publish.flush()
    await publish("three", 3.0)
    await publish.flush()
    await nc.flush()
    await wait_for(lambda: len(deltas) == 1, what="the delta before the stop")
    await asyncio.sleep(0.1)  # anything published later would have arrived by now

    assert [(d.seq, d.text) for d in deltas] == [(1, "one ")]
    assert publish.text == "one "  # the stopped stream's reply: what went out


async def test_a_turn_that_does_not_fit_is_refused_before_any_provider_call(
    nc: Client, metering: Metering
) -> None:
    cmd = turn("writer", budget_micros=100, max_tokens=1000)  # 1000 output tokens = 15,000 µUSD
    calls = metering.calls
    with pytest.raises(CommandFailed) as refused:
        await run_turn(nc, cmd)
    assert refused.value.code == "budget_exceeded"
    assert refused.value.details["remaining_micros"] == 100
    assert refused.value.details["required_micros"] > 100
    assert metering.calls == calls
    assert await usage_rows(metering.db, turn_id=cmd.turn_id) == []
    assert await metering.db.fetchval("SELECT count(*) FROM budget_holds") == 0


async def test_twenty_parallel_turns_of_one_run_never_spend_more_than_its_budget(
    nc: Client, metering: Metering
) -> None:
    # Each turn really spends most of what it holds (200 output tokens of 200), so
    # checking-then-calling without a reservation would let all 20 through.
    probe = turn("spender", max_tokens=200)
    hold = worst_case_micros(
        estimate_input_tokens(prompt_bytes(probe), 1), probe.max_tokens, SONNET
    )
    budget = 7 * hold + hold // 2
    cmds = [
        turn("spender", run_id=probe.run_id, max_tokens=200, budget_micros=budget)
        for _ in range(20)
    ]
    results = await asyncio.gather(*(run_turn(nc, c) for c in cmds), return_exceptions=True)

    refused = [r for r in results if isinstance(r, CommandFailed)]
    answered = [r for r in results if isinstance(r, TurnReply)]
    assert {r.code for r in refused} == {"budget_exceeded"}
    assert len(answered) + len(refused) == 20
    assert len(answered) >= 7  # seven holds always fit; settled turns may free room for more
    rows = await usage_rows(metering.db, run_id=probe.run_id)
    assert len(rows) == len(answered)
    spent = sum(r["cost_micros"] for r in rows)
    assert spent <= budget < 20 * min(r["cost_micros"] for r in rows)
    run = await run_row(metering.db, probe.run_id)
    assert (run["spent_micros"], run["reserved_micros"]) == (spent, 0)


async def test_a_run_changed_behind_the_replica_is_decided_on_its_row_as_it_is(
    nc: Client, metering: Metering
) -> None:
    # The replica reserves a run's next turn on the row as it last wrote it (one round
    # trip); a row written since by someone else (another replica, the sweeper) must be
    # read again, both when it now refuses and when it now allows.
    first = turn("writer", budget_micros=1_000_000)
    await run_turn(nc, first)
    spent_elsewhere = """UPDATE run_budgets SET spent_micros = $2, version = version + 1
                          WHERE run_id = $1"""
    await metering.db.execute(spent_elsewhere, first.run_id, 1_000_000)
    calls = metering.calls
    with pytest.raises(CommandFailed) as refused:
        await run_turn(nc, turn("writer", run_id=first.run_id, budget_micros=1_000_000))
    assert refused.value.code == "budget_exceeded"
    assert metering.calls == calls

    await metering.db.execute(spent_elsewhere, first.run_id, 0)
    third = turn("writer", run_id=first.run_id, budget_micros=1_000_000)
    reply = await run_turn(nc, third)
    run = await run_row(metering.db, first.run_id)
    assert (run["spent_micros"], run["reserved_micros"]) == (reply.cost_micros, 0)


async def test_a_provider_failure_is_billed_and_reported(nc: Client, metering: Metering) -> None:
    cmd = turn("failer", budget_micros=1_000_000)
    with pytest.raises(CommandFailed) as failed:
        await run_turn(nc, cmd)
    assert failed.value.code == "provider_overloaded"
    [row] = await usage_rows(metering.db, turn_id=cmd.turn_id)
    assert (row["status"], row["error_code"]) == ("error", "provider_overloaded")
    # billed for the input and the three words produced before the failure
    assert (row["input_tokens"], row["output_tokens"]) == (800, 3)
    assert row["cost_micros"] == cost_micros(TokenUsage(input_tokens=800, output_tokens=3), SONNET)
    assert failed.value.details["cost_micros"] == row["cost_micros"]
    run = await run_row(metering.db, cmd.run_id)
    assert (run["spent_micros"], run["reserved_micros"]) == (row["cost_micros"], 0)

    with pytest.raises(CommandFailed) as again:
        await run_turn(nc, cmd)
    assert again.value.code == "turn_already_failed"


async def test_a_stream_whose_caller_went_away_is_still_billed_in_full(
    nc: Client, metering: Metering
) -> None:
    cmd = LlmStream(
        **turn("slowpoke").model_dump(), delta_subject=f"agent.delta.proj.{uuid.uuid4()}"
    )
    with pytest.raises(TimeoutError):  # the caller gives up after 50 ms of a 400 ms stream
        await call(nc, subjects.LLM_STREAM, cmd, TurnReply, timeout=0.05)
    [row] = await wait_for(
        lambda: usage_rows(metering.db, turn_id=cmd.turn_id), what="the abandoned stream's row"
    )
    assert (row["status"], row["output_tokens"], row["input_tokens"]) == ("ok", 40, 300)
    assert row["cost_micros"] == cost_micros(TokenUsage(input_tokens=300, output_tokens=40), SONNET)


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"{not json", "malformed_json"),
        (json.dumps({"run_id": "r"}).encode(), "invalid_request"),
        (
            json.dumps(
                {
                    **turn().model_dump(mode="json"),
                    "delta_subject": "cmd.events.append",
                }
            ).encode(),
            "invalid_request",
        ),
        (
            json.dumps(
                {
                    **turn().model_dump(mode="json"),
                    "messages": [{"role": "assistant", "content": "x"}],
                }
            ).encode(),
            "invalid_request",
        ),
    ],
)
async def test_bad_requests_get_a_coded_error_and_write_nothing(
    nc: Client, metering: Metering, body: bytes, code: str
) -> None:
    msg = await nc.request(subjects.LLM_STREAM, body, timeout=5)
    assert json.loads(msg.data)["error"]["code"] == code
    assert await metering.db.fetchval("SELECT count(*) FROM token_usage") == 0
    assert await metering.db.fetchval("SELECT count(*) FROM run_budgets") == 0


async def test_a_run_keeps_the_budget_its_first_turn_named(nc: Client, metering: Metering) -> None:
    first = turn("writer", budget_micros=1_000_000)
    await run_turn(nc, first)
    with pytest.raises(CommandFailed) as refused:
        await run_turn(nc, turn("writer", run_id=first.run_id, budget_micros=5))
    assert refused.value.code == "budget_mismatch"
    later = await run_turn(nc, turn("writer", run_id=first.run_id))  # no figure: the run's
    assert later.budget_remaining_micros == 1_000_000 - 2 * 7125


async def test_usage_summary_groups_by_agent_model_and_day(nc: Client, metering: Metering) -> None:
    await bind(nc, scope="agent", agent_slug="cheap", model="claude-haiku-4-5")
    await run_turn(nc, turn("writer"))
    await run_turn(nc, turn("writer", project_id="other"))
    await run_turn(nc, turn("cheap"))
    with pytest.raises(CommandFailed):
        await run_turn(nc, turn("failer"))

    summary = await call(
        nc,
        subjects.USAGE_SUMMARY,
        UsageSummaryRequest(group_by=["agent", "model", "day"]),
        UsageSummaryReply,
    )
    today = (await metering.db.fetchval("SELECT (now() AT TIME ZONE 'UTC')::date")).isoformat()
    by_agent = {g.key["agent"]: g for g in summary.groups if g.key["agent"] is not None}
    assert by_agent["writer"].key == {"agent": "writer", "model": "claude-sonnet-4-6", "day": today}
    assert (by_agent["writer"].calls, by_agent["writer"].cost_micros) == (2, 2 * 7125)
    assert by_agent["cheap"].key["model"] == "claude-haiku-4-5"
    assert by_agent["cheap"].cost_micros == cost_micros(
        TokenUsage(input_tokens=100, output_tokens=100), HAIKU
    )
    assert (by_agent["failer"].calls, by_agent["failer"].errors) == (1, 1)
    assert summary.total_calls == 4
    assert summary.total_cost_micros == sum(g.cost_micros for g in summary.groups)

    of_project = await call(
        nc,
        subjects.USAGE_SUMMARY,
        UsageSummaryRequest(group_by=["project"], project_id="other"),
        UsageSummaryReply,
    )
    assert [(g.key, g.calls) for g in of_project.groups] == [({"project": "other"}, 1)]
