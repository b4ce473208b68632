"""ToolLoop, whole-reply and streaming, against the real metering service (scripted model)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from contracts import subjects
from contracts.common import ErrorCode
from contracts.metering import (
    ChatMessage,
    ToolResultBlock,
    ToolUseBlock,
    TurnDelta,
    UsageSummaryReply,
    UsageSummaryRequest,
)
from harness import Halt, LoopContext, MeteringClient, Tool, ToolLoop, ToolResult
from metering.providers.base import ProviderError
from metering.providers.scripted import Script, ScriptedProvider, ScriptedToolCall, ScriptStep
from servicekit.client import call
from testkit.metering import Metering, Starter
from testkit.probes import subscribed, wait_for

NUMBER_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}

SCRIPT = Script(
    steps=[
        # corrector: a bad call first, the corrected one after seeing the error, then done
        ScriptStep(
            agent="corrector",
            iteration=0,
            tool_calls=[ScriptedToolCall(name="record", input={"n": -1})],
        ),
        ScriptStep(
            agent="corrector",
            after_tool_error=True,
            tool_calls=[ScriptedToolCall(name="record", input={"n": 5})],
        ),
        ScriptStep(agent="corrector", text="Recorded 5."),
        # halter: calls `finish`, whose post hook halts the loop
        ScriptStep(agent="halter", tool_calls=[ScriptedToolCall(name="finish", input={"n": 1})]),
        # looper: never stops calling tools
        ScriptStep(
            agent="looper",
            text="again",
            tool_calls=[ScriptedToolCall(name="record", input={"n": 1})],
        ),
        # spender: each turn really spends its max_tokens of output
        ScriptStep(
            agent="spender",
            output_tokens=2000,
            tool_calls=[ScriptedToolCall(name="record", input={"n": 1})],
        ),
        ScriptStep(
            agent="talker", text="Olá! Vamos desenhar a sua padaria juntos.", token_delay_ms=1
        ),
        # narrator: says what it does while calling a tool, then sums up
        ScriptStep(
            agent="narrator",
            iteration=0,
            text="Vou anotar o 7.",
            tool_calls=[ScriptedToolCall(name="record", input={"n": 7})],
            token_delay_ms=1,
        ),
        ScriptStep(agent="narrator", text="Anotado.", token_delay_ms=1),
        # stopped: a call the person stopped, whose tool calls must never run
        ScriptStep(
            agent="stopped",
            text="Vou anotar",
            stop_reason="cancelled",
            tool_calls=[ScriptedToolCall(name="record", input={"n": 3})],
        ),
        # slowpoke: a whole-reply turn long enough to be met while still running
        ScriptStep(agent="slowpoke", text=" ".join(f"s{i}" for i in range(40)), token_delay_ms=25),
        # chatterbox: 400 words at 25 ms, long enough to be stopped
        ScriptStep(
            agent="chatterbox", text=" ".join(f"w{i}" for i in range(400)), token_delay_ms=25
        ),
    ]
)


@pytest.fixture
async def scripted(start_metering: Starter) -> Metering:
    return await start_metering(provider=ScriptedProvider(SCRIPT))


def record_tool(seen: list[int]) -> Tool:
    async def record(call: ToolUseBlock) -> ToolResult:
        n = call.input.get("n")
        if not isinstance(n, int) or n < 0:
            return ToolResult.error(f"n must be a whole number ≥ 0; you sent {n!r}. Send it again.")
        seen.append(n)
        return ToolResult.ok(f"recorded {n}", data=n)

    return Tool("record", "Record a number.", NUMBER_SCHEMA, record)


def context(agent: str, **fields: Any) -> LoopContext:
    return LoopContext(
        run_id=f"run-{uuid.uuid4().hex[:10]}",
        agent_slug=agent,
        project_id="proj",
        system="You record numbers.",
        messages=[ChatMessage(role="user", content="Record a number.")],
        **fields,
    )


async def run_cost(nc: Client, run_id: str) -> tuple[int, int]:
    summary = await call(
        nc,
        subjects.USAGE_SUMMARY,
        UsageSummaryRequest(group_by=["run"], run_id=run_id),
        UsageSummaryReply,
    )
    return summary.total_calls, summary.total_cost_micros


async def test_a_tool_error_goes_back_verbatim_and_the_model_corrects_itself(
    nc: Client, scripted: Metering
) -> None:
    seen: list[int] = []
    loop = ToolLoop(MeteringClient(nc), [record_tool(seen)], max_iterations=4)
    ctx = context("corrector")
    result = await loop.run(ctx)

    assert (result.status, result.iterations, result.final_text) == ("completed", 3, "Recorded 5.")
    assert seen == [5]
    [first, second] = [outcome for _, outcome in result.tool_calls]
    assert first.is_error and not second.is_error
    # the second turn's prompt carried the tool's message exactly as the tool wrote it
    feedback = result.messages[2].content
    assert isinstance(feedback, list) and isinstance(feedback[0], ToolResultBlock)
    assert feedback[0].is_error
    assert feedback[0].content == "n must be a whole number ≥ 0; you sent -1. Send it again."
    assert (await run_cost(nc, ctx.run_id)) == (3, result.cost_micros)
    assert result.cost_micros > 0 and result.usage.input_tokens > 0


async def test_a_post_tool_hook_halts_the_loop(nc: Client, scripted: Metering) -> None:
    async def finish(call: ToolUseBlock) -> ToolResult:
        return ToolResult.ok("finished", data={"accepted": call.input["n"]})

    async def stop_when_finished(call: ToolUseBlock, outcome: ToolResult) -> Halt | None:
        if call.name == "finish" and not outcome.is_error:
            return Halt("finish accepted", outcome.data)
        return None

    loop = ToolLoop(
        MeteringClient(nc),
        [Tool("finish", "Finish.", NUMBER_SCHEMA, finish)],
        max_iterations=5,
        post_tool_hooks=[stop_when_finished],
    )
    result = await loop.run(context("halter"))
    assert (result.status, result.iterations) == ("halted", 1)
    assert result.halt == Halt("finish accepted", {"accepted": 1})


async def test_a_pre_tool_hook_refuses_a_call_and_the_model_hears_why(
    nc: Client, scripted: Metering
) -> None:
    seen: list[int] = []

    async def no_records(call: ToolUseBlock) -> str | None:
        return "recording is closed for today" if call.name == "record" else None

    loop = ToolLoop(
        MeteringClient(nc), [record_tool(seen)], max_iterations=2, pre_tool_hooks=[no_records]
    )
    result = await loop.run(context("looper"))
    assert seen == []
    assert [o.content for _, o in result.tool_calls] == ["recording is closed for today"] * 2


async def test_the_loop_stops_at_max_iterations(nc: Client, scripted: Metering) -> None:
    loop = ToolLoop(MeteringClient(nc), [record_tool([])], max_iterations=3)
    ctx = context("looper")
    result = await loop.run(ctx)
    assert (result.status, result.iterations) == ("max_iterations", 3)
    assert (await run_cost(nc, ctx.run_id))[0] == 3


async def test_the_budget_runs_out_mid_loop_and_nothing_more_is_called(
    nc: Client, scripted: Metering
) -> None:
    # max_tokens 2000 of Sonnet output = 30,000 µUSD per turn at most; 2.5 turns of budget.
    loop = ToolLoop(MeteringClient(nc), [record_tool([])], max_iterations=10, max_tokens=2000)
    ctx = context("spender", budget_micros=78_000)
    calls_before = scripted.calls
    result = await loop.run(ctx)

    assert result.status == "budget_exceeded"
    assert result.error_code == "budget_exceeded"
    assert result.iterations == 2
    assert scripted.calls - calls_before == 2  # the third turn was refused before the provider
    calls, cost = await run_cost(nc, ctx.run_id)
    assert (calls, cost) == (2, result.cost_micros)
    assert cost <= 78_000


async def collect_deltas(nc: Client, subject: str) -> tuple[list[TurnDelta], Any]:
    deltas: list[TurnDelta] = []

    async def collect(msg: Msg) -> None:
        deltas.append(TurnDelta.model_validate_json(msg.data))

    sub = await nc.subscribe(subject, cb=collect)
    await subscribed(nc)
    return deltas, sub


async def test_a_streaming_loop_publishes_every_turn_s_deltas_under_its_turn_ids(
    nc: Client, scripted: Metering
) -> None:
    session, message = uuid.uuid4(), uuid.uuid4()
    deltas, sub = await collect_deltas(nc, subjects.delta_subject("proj", session))
    seen: list[int] = []
    loop = ToolLoop(MeteringClient(nc), [record_tool(seen)], max_iterations=4)
    ctx = context(
        "narrator",
        session_id=session,
        stream=True,
        causation_id=message,
        turn_id=lambda n: f"answer.{message}.{n}",
    )
    result = await loop.run(ctx)
    await wait_for(
        lambda: "".join(d.text for d in deltas) == "Vou anotar o 7.Anotado.", what="every delta"
    )
    await sub.unsubscribe()

    ids = [f"answer.{message}.1", f"answer.{message}.2"]
    assert (result.status, result.iterations, seen) == ("completed", 2, [7])
    assert result.turn_ids == ids
    assert result.texts == ["Vou anotar o 7.", "Anotado."]
    assert result.final_text == "Anotado."
    assert sorted({d.turn_id for d in deltas}) == ids
    assert {d.causation_id for d in deltas} == {message}
    for turn_id in ids:
        assert [d.seq for d in deltas if d.turn_id == turn_id] == list(
            range(1, 1 + sum(d.turn_id == turn_id for d in deltas))
        )
    # usage and cost are summed once, over both calls, as metering billed them
    assert (await run_cost(nc, ctx.run_id)) == (2, result.cost_micros)
    assert result.model and result.usage.output_tokens > 0

    # the same input again: the very same turns are replayed, nothing is streamed or billed
    again = await loop.run(ctx)
    assert (again.turn_ids, again.texts, seen) == (ids, result.texts, [7, 7])
    assert (await run_cost(nc, ctx.run_id))[0] == 2


async def test_a_stopped_call_ends_the_loop_and_its_tool_calls_never_run(
    nc: Client, scripted: Metering
) -> None:
    seen: list[int] = []
    loop = ToolLoop(MeteringClient(nc), [record_tool(seen)], max_iterations=4)
    result = await loop.run(context("stopped"))
    assert (result.status, result.iterations) == ("stopped", 1)
    assert seen == [] and result.tool_calls == []
    assert result.texts == ["Vou anotar"]


async def test_a_streaming_loop_the_person_stops_ends_with_the_text_written_so_far(
    nc: Client, scripted: Metering
) -> None:
    session = uuid.uuid4()
    deltas, sub = await collect_deltas(nc, subjects.delta_subject("proj", session))
    client = MeteringClient(nc)
    ctx = context("chatterbox", session_id=session, stream=True)
    running = asyncio.create_task(ToolLoop(client, [], max_iterations=3, max_tokens=1000).run(ctx))
    await wait_for(lambda: len(deltas) >= 2, what="the turn to stream")
    turn_id = ctx.turn_id_of(1)
    assert (await client.cancel(turn_id, "proj", session)).status == "cancelling"
    result = await running
    await sub.unsubscribe()

    assert (result.status, result.iterations, result.turn_ids) == ("stopped", 1, [turn_id])
    [text] = result.texts
    assert 2 <= len(text.split()) < 400
    # Billed: every word the provider wrote, the ones held in metering's delta window when
    # the stop came too; the text is what the person was shown.
    assert result.usage.output_tokens >= len(text.split()) and result.cost_micros > 0
    assert (await client.cancel(turn_id, "proj", session)).status == "finished"


async def test_a_streaming_run_needs_its_session(nc: Client, scripted: Metering) -> None:
    loop = ToolLoop(MeteringClient(nc), [], max_iterations=1)
    with pytest.raises(ValueError, match="session"):
        await loop.run(context("talker", stream=True))


async def test_a_turn_still_running_is_waited_for_and_replayed_when_the_loop_may_wait(
    nc: Client, scripted: Metering
) -> None:
    ctx = context("slowpoke")
    calls_before = scripted.calls
    first = asyncio.create_task(ToolLoop(MeteringClient(nc), [], max_iterations=1).run(ctx))
    await wait_for(lambda: scripted.calls > calls_before, what="the first run's call")

    impatient = await ToolLoop(MeteringClient(nc), [], max_iterations=1).run(ctx)
    assert (impatient.status, impatient.error_code) == ("error", "turn_in_progress")
    assert impatient.turn_ids == [ctx.turn_id_of(1)]

    patient = ToolLoop(MeteringClient(nc), [], max_iterations=1, in_progress_wait_seconds=60)
    waited = await patient.run(ctx)
    done = await first
    assert (waited.status, done.status) == ("completed", "completed")
    assert waited.final_text == done.final_text and len(done.final_text.split()) == 40
    assert waited.turn_ids == done.turn_ids == [ctx.turn_id_of(1)]
    assert scripted.calls - calls_before == 1
    assert (await run_cost(nc, ctx.run_id))[0] == 1


async def test_a_turn_given_up_while_its_replica_still_runs_it_is_replayed_not_run_again(
    nc: Client, scripted: Metering
) -> None:
    """A replica that only seems lost (here: slower than the client's timeout) still runs
    the turn: asked for again, metering says so, and its reply is replayed when it comes;
    the turn is called and billed once."""
    ctx = context("slowpoke")
    calls_before = scripted.calls
    hasty = MeteringClient(nc, timeout=0.3)  # gives the turn up while the model writes
    loop = ToolLoop(hasty, [], max_iterations=1, in_progress_wait_seconds=60)

    result = await loop.run(ctx)

    assert result.status == "completed" and len(result.final_text.split()) == 40
    assert result.turn_ids == [ctx.turn_id_of(1)]
    assert scripted.calls - calls_before == 1
    assert (await run_cost(nc, ctx.run_id))[0] == 1


class FailsOnce(ScriptedProvider):
    """The scripted model, whose very first call fails as a provider outage would."""

    def __init__(self) -> None:
        super().__init__(SCRIPT)
        self.attempts = 0

    async def complete(self, request: Any, progress: Any, on_text: Any = None) -> Any:
        self.attempts += 1
        if self.attempts == 1:
            raise ProviderError(ErrorCode.PROVIDER_ERROR, "the provider fell over")
        return await super().complete(request, progress, on_text)


async def test_a_rerun_retries_a_failed_turn_under_a_retry_id_and_then_replays_it(
    nc: Client, start_metering: Starter
) -> None:
    provider = FailsOnce()
    await start_metering(provider=provider)
    loop = ToolLoop(MeteringClient(nc), [], max_iterations=2)
    ctx = context("talker")

    failed = await loop.run(ctx)
    assert (failed.status, failed.error_code) == ("error", "provider_error")
    assert failed.turn_ids == [f"{ctx.run_id}.1"]
    retried = await loop.run(ctx)  # the same run: iteration 1's id already failed in metering
    assert (retried.status, retried.final_text) == (
        "completed",
        "Olá! Vamos desenhar a sua padaria juntos.",
    )
    assert retried.turn_ids == [f"{ctx.run_id}.1.r1"]
    replayed = await loop.run(ctx)  # once more: the successful retry is replayed, not re-billed
    assert replayed.status == "completed"
    assert replayed.turn_ids == [f"{ctx.run_id}.1.r1"]
    assert provider.attempts == 2
    calls, _ = await run_cost(nc, ctx.run_id)
    assert calls == 2  # the failed call and its retry, each billed once


async def test_a_crashing_tool_is_told_to_the_model_unless_the_loop_lets_it_raise(
    nc: Client, scripted: Metering
) -> None:
    async def broken(call: ToolUseBlock) -> ToolResult:
        raise ConnectionError("the log is unreachable")

    tool = Tool("record", "Record a number.", NUMBER_SCHEMA, broken)
    told = await ToolLoop(MeteringClient(nc), [tool], max_iterations=1).run(context("looper"))
    [(_, outcome)] = told.tool_calls
    assert outcome.is_error
    assert outcome.content == "the tool record failed: ConnectionError: the log is unreachable"

    strict = ToolLoop(MeteringClient(nc), [tool], max_iterations=1, report_tool_crashes=False)
    with pytest.raises(ConnectionError, match="unreachable"):
        await strict.run(context("looper"))


class NeverAnswers(ScriptedProvider):
    """The scripted model whose first call is taken and never answered (as if its
    metering replica were killed mid-call: a whole-reply turn has no beat), until
    `released`."""

    def __init__(self) -> None:
        super().__init__(SCRIPT)
        self.released = asyncio.Event()
        self.attempts = 0

    async def complete(self, request: Any, progress: Any, on_text: Any = None) -> Any:
        self.attempts += 1
        if self.attempts == 1:
            await self.released.wait()
        return await super().complete(request, progress, on_text)


async def test_a_whole_reply_turn_with_no_reply_in_the_timeout_is_retried_under_its_retry_id(
    nc: Client, start_metering: Starter
) -> None:
    provider = NeverAnswers()
    await start_metering(provider=provider)
    # Without TurnLost the request's timeout ends the run with an exception.
    loop = ToolLoop(MeteringClient(nc, timeout=2.0), [], max_iterations=1)
    ctx = context("talker")
    try:
        result = await loop.run(ctx)
        assert (result.status, result.final_text) == (
            "completed",
            "Olá! Vamos desenhar a sua padaria juntos.",
        )
        assert result.turn_ids == [f"{ctx.run_id}.1.r1"]
        # a re-run skips the lost id (still claimed in metering) and replays the retry
        again = await loop.run(ctx)
        assert again.turn_ids == [f"{ctx.run_id}.1.r1"]
        assert provider.attempts == 2
    finally:
        provider.released.set()  # the lost call ends, and metering bills it
