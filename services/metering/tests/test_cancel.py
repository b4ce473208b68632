"""`cmd.llm.cancel`: the person's Stop button, against real NATS and real Postgres.

The scripted provider and the SDK against the local fake Messages API are both
stopped mid-stream; the reply, the deltas, the usage row and the run's budget are
checked after each stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.aio.msg import Msg

from contracts import subjects
from contracts.metering import (
    CancelReply,
    CancelTurn,
    ChatMessage,
    LlmStream,
    TokenUsage,
    TurnDelta,
    TurnReply,
    UsageSummaryReply,
    UsageSummaryRequest,
)
from domain.metering import cost_micros
from metering.cancels import Cancellations
from metering.catalog import Catalog
from metering.providers.anthropic import AnthropicProvider
from metering.providers.base import (
    OnText,
    Progress,
    ProviderReply,
    ProviderRequest,
    estimate_output_tokens,
)
from metering.providers.scripted import Script, ScriptedProvider, ScriptStep
from metering.repository import MeteringRepository
from metering.turns import TurnRunner
from servicekit.client import call
from servicekit.db import create_pool
from testkit.fake_messages_api import (
    MESSAGE_STOP,
    FakeMessagesApi,
    Reply,
    message_delta,
    message_start,
)
from testkit.fake_messages_api import text_block as sse_text_block
from testkit.metering import Metering, Starter
from testkit.probes import subscribed, wait_for

from .test_metering_service import SONNET

LONG = 60.0
# 400 words at 25 ms: ten seconds, far longer than any cancel takes to arrive.
LONG_TEXT = " ".join(f"palavra{i}" for i in range(400))
SHORT_TEXT = "uma resposta curta e inteira"

SCRIPT = Script(
    steps=[
        ScriptStep(
            agent="long",
            text=LONG_TEXT,
            token_delay_ms=25,
            input_tokens=500,
            cache_read_tokens=1000,
        ),
        ScriptStep(agent="short", text=SHORT_TEXT, input_tokens=40),
    ]
)


class Watched(ScriptedProvider):
    """The scripted model, counting the calls that were aborted mid-way."""

    def __init__(self) -> None:
        super().__init__(SCRIPT)
        self.aborted = 0

    async def complete(
        self, request: ProviderRequest, progress: Progress, on_text: OnText | None
    ) -> ProviderReply:
        try:
            return await super().complete(request, progress, on_text)
        except asyncio.CancelledError:
            self.aborted += 1
            raise


class Gated(ScriptedProvider):
    """Writes two words, then waits for the test to open the gate before the rest."""

    def __init__(self) -> None:
        super().__init__(SCRIPT)
        self.gate = asyncio.Event()

    async def complete(
        self, request: ProviderRequest, progress: Progress, on_text: OnText | None
    ) -> ProviderReply:
        assert on_text is not None
        words = 0

        async def gated(text: str, at: float) -> None:
            nonlocal words
            words += 1
            if words == 3:
                await self.gate.wait()
            await on_text(text, at)

        return await super().complete(request, progress, gated)


@dataclass
class Deltas:
    """Every delta published on one subject, in arrival order."""

    items: list[TurnDelta] = field(default_factory=list)

    async def collect(self, msg: Msg) -> None:
        self.items.append(TurnDelta.model_validate_json(msg.data))

    def of(self, turn_id: str) -> list[TurnDelta]:
        return [d for d in self.items if d.turn_id == turn_id]

    def text(self, turn_id: str) -> str:
        return "".join(d.text for d in self.of(turn_id))


def stream(agent: str, session: uuid.UUID | None = None, **fields: Any) -> LlmStream:
    session = session or uuid.uuid4()
    return LlmStream(
        run_id=f"run-{uuid.uuid4().hex[:8]}",
        turn_id=f"turn-{uuid.uuid4().hex}",
        agent_slug=agent,
        project_id="proj",
        session_id=session,
        messages=[ChatMessage(role="user", content="Fale bastante.")],
        max_tokens=1000,
        delta_subject=subjects.delta_subject("proj", session),
        **fields,
    )


def order(cmd: LlmStream, **override: Any) -> CancelTurn:
    assert cmd.session_id is not None
    fields = {"turn_id": cmd.turn_id, "project_id": cmd.project_id, "session_id": cmd.session_id}
    return CancelTurn(**{**fields, **override})


async def cancel(nc: Client, request: CancelTurn) -> CancelReply:
    return await call(nc, subjects.LLM_CANCEL, request, CancelReply)


async def watch(nc: Client, cmd: LlmStream) -> Deltas:
    deltas = Deltas()
    await nc.subscribe(cmd.delta_subject, cb=deltas.collect)
    await subscribed(nc)
    return deltas


def start(nc: Client, cmd: LlmStream) -> asyncio.Task[TurnReply]:
    return asyncio.create_task(call(nc, subjects.LLM_STREAM, cmd, TurnReply, timeout=LONG))


async def billed(db: asyncpg.Connection, cmd: LlmStream) -> tuple[Any, Any, Any]:
    """The turn's usage row, its hold and its run's budget row."""
    row = await db.fetchrow("SELECT * FROM token_usage WHERE turn_id = $1", cmd.turn_id)
    hold = await db.fetchrow("SELECT * FROM budget_holds WHERE turn_id = $1", cmd.turn_id)
    run = await db.fetchrow("SELECT * FROM run_budgets WHERE run_id = $1", cmd.run_id)
    return row, hold, run


def usage_of(row: Any) -> TokenUsage:
    return TokenUsage(**{k: row[k] for k in TokenUsage.model_fields})


async def no_more_deltas_after(nc: Client, deltas: Deltas, first: LlmStream) -> None:
    """A second, short turn on the same subject, run to its end: one replica publishes
    both turns' deltas in order, so any delta of `first` still coming would show up
    before the second turn's last one."""
    second = stream("short", session=first.session_id)
    reply = await call(nc, subjects.LLM_STREAM, second, TurnReply, timeout=LONG)
    assert reply.stop_reason == "end_turn"
    await wait_for(lambda: deltas.text(second.turn_id) == SHORT_TEXT, what="the second turn")


# --- the scripted provider ------------------------------------------------------------


async def test_a_cancel_stops_a_scripted_stream_and_bills_what_it_wrote(
    nc: Client, start_metering: Starter
) -> None:
    provider = Watched()
    running = await start_metering(provider=provider)
    cmd = stream("long", budget_micros=1_000_000)
    deltas = await watch(nc, cmd)
    reply_task = start(nc, cmd)
    await wait_for(lambda: len(deltas.of(cmd.turn_id)) >= 3, what="three deltas")

    answer = await cancel(nc, order(cmd))
    assert answer == CancelReply(turn_id=cmd.turn_id, status="cancelling")
    reply = await reply_task

    assert reply.stop_reason == "cancelled" and not reply.duplicate
    assert provider.aborted == 1  # the provider stopped emitting
    [block] = reply.content
    assert block.type == "text"
    written = block.text.split()
    assert 3 <= len(written) < 400 and LONG_TEXT.startswith(block.text)
    await no_more_deltas_after(nc, deltas, cmd)
    published = deltas.of(cmd.turn_id)
    assert "".join(d.text for d in published) == block.text  # no delta after the stop
    assert [d.seq for d in published] == list(range(1, len(published) + 1))

    row, hold, run = await billed(running.db, cmd)
    # Billed: every word the model produced, the reply: those published. They differ by
    # the words held for the next delta when the stop came, which never go out.
    assert len(written) <= reply.usage.output_tokens < 400
    usage = TokenUsage(
        input_tokens=500, output_tokens=reply.usage.output_tokens, cache_read_tokens=1000
    )
    assert (row["status"], row["error_code"]) == ("cancelled", None)
    assert usage_of(row) == usage == reply.usage
    assert row["cost_micros"] == reply.cost_micros == cost_micros(usage, SONNET)
    assert (hold["status"], hold["cost_micros"]) == ("settled", reply.cost_micros)
    assert (run["spent_micros"], run["reserved_micros"]) == (reply.cost_micros, 0)
    assert reply.budget_remaining_micros == 1_000_000 - reply.cost_micros
    assert not running.cancels.running(cmd.turn_id)
    summary = await call(
        nc,
        subjects.USAGE_SUMMARY,
        UsageSummaryRequest(group_by=["run"], run_id=cmd.run_id),
        UsageSummaryReply,
    )
    [group] = summary.groups  # billed, and not counted as an error
    assert (group.calls, group.errors, group.cost_micros) == (1, 0, reply.cost_micros)

    # The stopped turn is over: asked again, it is its stored reply, nothing is called.
    calls = running.calls
    again = await call(nc, subjects.LLM_STREAM, cmd, TurnReply, timeout=LONG)
    assert again.duplicate and again.stop_reason == "cancelled" and again.content == reply.content
    assert running.calls == calls
    assert (await cancel(nc, order(cmd))).status == "finished"


async def test_a_cancel_of_a_finished_turn_says_so_and_changes_nothing(
    nc: Client, start_metering: Starter
) -> None:
    running = await start_metering(provider=Watched())
    cmd = stream("short", budget_micros=1_000_000)
    reply = await call(nc, subjects.LLM_STREAM, cmd, TurnReply, timeout=LONG)
    before = await billed(running.db, cmd)

    assert await cancel(nc, order(cmd)) == CancelReply(turn_id=cmd.turn_id, status="finished")
    assert await billed(running.db, cmd) == before
    row, _, _ = before
    assert (row["status"], reply.stop_reason) == ("ok", "end_turn")
    assert running.cancels.heard == 0  # nothing was announced


async def test_a_cancel_naming_another_session_or_project_never_touches_the_turn(
    nc: Client, start_metering: Starter
) -> None:
    provider = Gated()
    running = await start_metering(provider=provider)
    cmd = stream("short")
    deltas = await watch(nc, cmd)
    reply_task = start(nc, cmd)
    # the two words before the gate (handed on back to back: one delta or two)
    first_two = SHORT_TEXT.split()[:2]
    await wait_for(
        lambda: deltas.text(cmd.turn_id).split() == first_two, what="the turn to be running"
    )

    for wrong in (order(cmd, session_id=uuid.uuid4()), order(cmd, project_id="other")):
        assert (await cancel(nc, wrong)).status == "cancelling"
    # Both announcements reached the replica running the turn while it was running.
    await wait_for(lambda: running.cancels.heard == 2, what="both cancels to be heard")
    assert running.cancels.running(cmd.turn_id)
    provider.gate.set()

    reply = await reply_task
    assert reply.stop_reason == "end_turn"
    assert reply.content[0].type == "text" and reply.content[0].text == SHORT_TEXT
    row, _, _ = await billed(running.db, cmd)
    assert row["status"] == "ok"
    assert running.cancels.stopped == 0


async def test_a_cancel_that_arrives_before_its_stream_stops_it_before_the_provider_is_called(
    nc: Client, start_metering: Starter
) -> None:
    running = await start_metering(provider=Watched())
    cmd = stream("long", budget_micros=1_000_000)
    deltas = await watch(nc, cmd)
    assert (await cancel(nc, order(cmd))).status == "cancelling"
    await wait_for(lambda: running.cancels.heard == 1, what="the cancel to be heard")
    calls = running.calls

    reply = await call(nc, subjects.LLM_STREAM, cmd, TurnReply, timeout=LONG)
    assert (reply.stop_reason, reply.content, reply.cost_micros) == ("cancelled", [], 0)
    assert running.calls == calls  # the provider was never called
    await no_more_deltas_after(nc, deltas, cmd)
    assert deltas.of(cmd.turn_id) == []
    row, hold, run = await billed(running.db, cmd)
    assert (row["status"], row["cost_micros"], usage_of(row)) == ("cancelled", 0, TokenUsage())
    assert (hold["status"], hold["cost_micros"]) == ("settled", 0)
    assert (run["spent_micros"], run["reserved_micros"]) == (0, 0)


async def test_a_cancel_of_another_session_heard_early_does_not_stop_the_stream(
    nc: Client, start_metering: Starter
) -> None:
    running = await start_metering(provider=Watched())
    cmd = stream("short")
    await cancel(nc, order(cmd, session_id=uuid.uuid4()))
    await wait_for(lambda: running.cancels.heard == 1, what="the cancel to be heard")
    reply = await call(nc, subjects.LLM_STREAM, cmd, TurnReply, timeout=LONG)
    assert reply.stop_reason == "end_turn"


@pytest_asyncio.fixture(loop_scope="session")
async def runner_elsewhere(
    nats_url: str, database_url: str, metering: Metering
) -> AsyncIterator[tuple[TurnRunner, Watched]]:
    """A second replica's turn runner and cancels, on its own connection, serving no
    commands: the queue group can then only hand `cmd.llm.cancel` to `metering`."""
    conn = await nats.connect(nats_url)
    pool = await create_pool(database_url, "metering")
    try:
        repo = MeteringRepository(pool)
        catalog = Catalog(repo)
        await catalog.reload()
        cancels = Cancellations()
        sub = await cancels.subscribe(conn)
        provider = Watched()
        yield TurnRunner(repo, catalog, provider, conn, cancels), provider
        await sub.unsubscribe()
    finally:
        await pool.close()
        await conn.close()


async def test_a_cancel_served_by_one_replica_stops_the_stream_another_runs(
    nc: Client, metering: Metering, runner_elsewhere: tuple[TurnRunner, Watched]
) -> None:
    serving = metering
    runner, provider = runner_elsewhere
    cmd = stream("long", budget_micros=1_000_000)
    deltas = await watch(nc, cmd)
    reply_task = asyncio.create_task(runner.run(cmd))
    await wait_for(lambda: len(deltas.of(cmd.turn_id)) >= 2, what="the stream to run elsewhere")
    assert not serving.cancels.running(cmd.turn_id)

    assert (await cancel(nc, order(cmd))).status == "cancelling"
    reply = await reply_task
    assert reply.stop_reason == "cancelled" and provider.aborted == 1
    assert (runner.cancels.stopped, serving.cancels.stopped) == (1, 0)
    [block] = reply.content
    assert block.type == "text"
    await wait_for(lambda: deltas.text(cmd.turn_id) == block.text, what="the deltas sent")
    row, _, run = await billed(serving.db, cmd)
    # Billed: every word produced; the reply: those published (held ones never go out).
    assert (row["status"], row["output_tokens"]) == ("cancelled", reply.usage.output_tokens)
    assert len(block.text.split()) <= row["output_tokens"]
    assert (run["spent_micros"], run["reserved_micros"]) == (row["cost_micros"], 0)


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"{not json", "malformed_json"),
        (b"[]", "invalid_request"),
        (json.dumps({"turn_id": "t-1", "project_id": "proj"}).encode(), "invalid_request"),
        (
            json.dumps({"turn_id": "t 1", "project_id": "proj", "session_id": str(uuid.uuid4())}),
            "invalid_request",
        ),
        (
            json.dumps({"turn_id": "t-1", "project_id": "a.b", "session_id": str(uuid.uuid4())}),
            "invalid_request",
        ),
        (
            json.dumps({"turn_id": "t-1", "project_id": "proj", "session_id": "not-a-uuid"}),
            "invalid_request",
        ),
        (
            json.dumps(
                {"turn_id": "t-1", "project_id": "p", "session_id": str(uuid.uuid4()), "x": 1}
            ),
            "invalid_request",
        ),
    ],
)
async def test_a_malformed_cancel_gets_a_coded_error_and_announces_nothing(
    nc: Client, metering: Metering, body: bytes | str, code: str
) -> None:
    data = body.encode() if isinstance(body, str) else body
    msg = await nc.request(subjects.LLM_CANCEL, data, timeout=5)
    assert json.loads(msg.data)["error"]["code"] == code
    # a well-formed cancel after it is heard first: the malformed one announced nothing
    await cancel(nc, CancelTurn(turn_id="t-probe", project_id="proj", session_id=uuid.uuid4()))
    await wait_for(lambda: metering.cancels.heard >= 1, what="the probe")
    assert metering.cancels.heard == 1


# --- the anthropic provider, through the SDK, against the fake Messages API -----------


@pytest_asyncio.fixture(loop_scope="session")
async def fake() -> AsyncIterator[FakeMessagesApi]:
    server = await FakeMessagesApi().start()
    yield server
    await server.stop()


async def test_a_cancel_closes_the_providers_connection_and_bills_the_partial_stream(
    nc: Client, start_metering: Starter, fake: FakeMessagesApi
) -> None:
    pieces = [f"palavra{i} " for i in range(200)]
    events = [
        message_start(120, cache_read=3000, cache_5m=60),
        *sse_text_block(0, pieces),
        message_delta(400),
        MESSAGE_STOP,
    ]
    # message_start, content_block_start, ping and three text deltas at once; then one
    # event every 50 ms, as a long answer is written: ten seconds for the rest.
    fake.replies.append(Reply(events=events, pace_after=6, pace_seconds=0.05))
    llm = AnthropicProvider(api_key="test-key", base_url=fake.base_url, max_retries=0)
    running = await start_metering(provider=llm)
    cmd = stream("criativo", budget_micros=1_000_000)
    deltas = await watch(nc, cmd)
    reply_task = start(nc, cmd)
    await wait_for(lambda: len(deltas.of(cmd.turn_id)) >= 3, what="three deltas")

    assert (await cancel(nc, order(cmd))).status == "cancelling"
    reply = await reply_task
    await asyncio.wait_for(fake.client_left.wait(), LONG)  # the connection was closed
    assert fake.events_sent[-1] < len(events) - 2  # not drained: the rest never went out

    assert reply.stop_reason == "cancelled"
    [block] = reply.content
    assert block.type == "text"
    await wait_for(lambda: deltas.text(cmd.turn_id) == block.text, what="every delta sent")
    received = len(block.text.split())  # pieces: those that came together, fewer deltas
    assert 3 <= len(deltas.of(cmd.turn_id)) <= received < len(pieces)
    assert block.text == "".join(pieces[:received])
    # input and cache from message_start; output estimated from the text received, as
    # the stream was cut before its message_delta
    # (at least: a piece held for the next delta when the stop came is billed, not shown)
    assert reply.usage.output_tokens >= estimate_output_tokens(received, len(block.text))
    assert reply.usage.output_tokens > received  # the characters, not the events, decided
    usage = TokenUsage(
        input_tokens=120,
        cache_read_tokens=3000,
        cache_write_5m_tokens=60,
        output_tokens=reply.usage.output_tokens,
    )
    row, hold, run = await billed(running.db, cmd)
    assert (row["status"], row["provider"]) == ("cancelled", "anthropic")
    assert usage_of(row) == usage == reply.usage
    assert row["cost_micros"] == reply.cost_micros == cost_micros(usage, SONNET)
    assert (hold["status"], hold["cost_micros"]) == ("settled", reply.cost_micros)
    assert (run["spent_micros"], run["reserved_micros"]) == (reply.cost_micros, 0)

    # The connection is gone, the deltas stopped: the fake sent nothing more, and a
    # delta of the stopped turn published later would be counted here.
    fake.replies.append(
        Reply(
            events=[
                message_start(10),
                *sse_text_block(0, [SHORT_TEXT]),
                message_delta(5),
                MESSAGE_STOP,
            ]
        )
    )
    second = stream("criativo", session=cmd.session_id)
    await call(nc, subjects.LLM_STREAM, second, TurnReply, timeout=LONG)
    await wait_for(lambda: deltas.text(second.turn_id) == SHORT_TEXT, what="the second turn")
    assert deltas.text(cmd.turn_id) == block.text


# --- the cancels of one replica, without the bus ----------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def forever() -> None:
    await asyncio.Event().wait()


async def test_an_early_cancel_is_forgotten_after_its_ttl() -> None:
    clock = Clock()
    cancels = Cancellations(ttl_seconds=5, clock=clock)
    session = uuid.uuid4()
    cancels.cancel(CancelTurn(turn_id="t-1", project_id="p", session_id=session))
    cancels.cancel(CancelTurn(turn_id="t-2", project_id="p", session_id=session))
    clock.now += 6

    task = asyncio.ensure_future(forever())
    turn = cancels.start("t-1", "p", session, task)
    assert not turn.stopped and not task.cancelled()
    cancels.cancel(CancelTurn(turn_id="t-1", project_id="p", session_id=session))
    assert turn.stopped
    with pytest.raises(asyncio.CancelledError):
        await task
    cancels.finish(turn)
    assert not cancels.running("t-1")


async def test_a_stream_that_already_finished_is_not_stopped() -> None:
    cancels = Cancellations()
    session = uuid.uuid4()
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    done.set_result(None)
    turn = cancels.start("t-1", "p", session, done)
    cancels.cancel(CancelTurn(turn_id="t-1", project_id="p", session_id=session))
    assert not turn.stopped and cancels.stopped == 0


async def test_remembered_cancels_are_bounded() -> None:
    cancels = Cancellations(max_remembered=2)
    session = uuid.uuid4()
    for i in range(3):
        cancels.cancel(CancelTurn(turn_id=f"t-{i}", project_id="p", session_id=session))
    tasks = [asyncio.ensure_future(forever()) for _ in range(3)]
    turns = [cancels.start(f"t-{i}", "p", session, t) for i, t in enumerate(tasks)]
    assert [t.stopped for t in turns] == [False, True, True]  # the oldest was forgotten
    tasks[0].cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.parametrize(
    ("events", "chars", "tokens"), [(3, 6, 3), (3, 40, 10), (0, 0, 0), (1, 1, 1), (2, 9, 3)]
)
def test_a_cut_streams_output_is_estimated_from_its_text(
    events: int, chars: int, tokens: int
) -> None:
    assert estimate_output_tokens(events, chars) == tokens


# --- two replicas as real processes -------------------------------------------------------


async def ping_pids(nc: Client) -> set[str]:
    """The pids of the metering replicas that answer `$SRV.PING` (serving commands)."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish("$SRV.PING.metering", b"", reply=inbox)
    pids: set[str] = set()
    with contextlib.suppress(TimeoutError, nats.errors.TimeoutError):
        while True:
            msg = await sub.next_msg(timeout=0.3)
            if msg.data:
                pids.add((json.loads(msg.data).get("metadata") or {}).get("pid", ""))
    await sub.unsubscribe()
    return pids


# SCRIPT's long answer at 150 ms a word: a minute (LONG). The answer must outlast a second
# replica's start and the first one's drain, which SCRIPT's ten seconds do not always do on
# a loaded machine (two processes start, under a suite running beside them).
ROLLING_SCRIPT = Script(
    steps=[SCRIPT.steps[0].model_copy(update={"token_delay_ms": 150}), *SCRIPT.steps[1:]]
)


async def test_a_replica_shutting_down_still_stops_its_stream_when_another_serves_the_cancel(
    nc: Client, spawn: Any, database_url: str, tmp_path: Path
) -> None:
    script = tmp_path / "script.json"
    script.write_text(ROLLING_SCRIPT.model_dump_json(), encoding="utf-8")
    env = {"AGENTBUS_PROVIDER": "scripted", "AGENTBUS_SCRIPT_PATH": str(script)}
    first = spawn("metering", **env)
    await first.wait_ready(nc, "metering")
    cmd = stream("long", budget_micros=1_000_000)
    deltas = await watch(nc, cmd)
    reply_task = start(nc, cmd)  # the only replica runs it
    await wait_for(lambda: len(deltas.of(cmd.turn_id)) >= 2, what="the stream to run")

    second = spawn("metering", **env)
    await second.wait_ready(nc, "metering")
    # A rolling restart: the first replica stops taking commands and finishes its turns
    # in flight, so the cancel can only be served by the second one.
    first.process.send_signal(signal.SIGTERM)

    async def only_second() -> bool:
        return await ping_pids(nc) == {str(second.pid)}

    await wait_for(only_second, what="the first replica to stop serving", timeout=LONG)
    assert not reply_task.done()

    assert (await cancel(nc, order(cmd))).status == "cancelling"
    reply = await reply_task
    assert reply.stop_reason == "cancelled"
    [block] = reply.content
    assert block.type == "text" and len(block.text.split()) < 400
    assert await asyncio.to_thread(first.wait_exit) == 0
    await wait_for(lambda: deltas.text(cmd.turn_id) == block.text, what="the deltas sent")

    db = await asyncpg.connect(database_url, server_settings={"search_path": "metering"})
    try:
        row, hold, run = await billed(db, cmd)
    finally:
        await db.close()
    assert (row["status"], row["output_tokens"]) == ("cancelled", len(block.text.split()))
    assert (hold["status"], run["spent_micros"], run["reserved_micros"]) == (
        "settled",
        row["cost_micros"],
        0,
    )
