"""ADR 0015 against the real psychologist service, real NATS, real Postgres, and metering
running the scripted provider."""

from __future__ import annotations

import uuid
from typing import Any

from contracts import subjects
from contracts.common import ErrorCode
from contracts.events import EventType
from contracts.metering import ToolResultBlock
from contracts.session_events import EventsReply, GetEvents
from domain.errors import DomainError
from domain.psychologist import classify_termination, validate_hypothesis_batch
from metering.providers.scripted import DEFAULT_SCRIPT, Script, ScriptedToolCall, ScriptStep
from servicekit.client import call

from .conftest import Driver

PROPOSED = EventType.HYPOTHESIS_PROPOSED.value
COMPLETED = EventType.ANALYSIS_COMPLETED
FAILED = EventType.ANALYSIS_FAILED


def emit(*hypotheses: dict[str, Any]) -> ScriptedToolCall:
    return ScriptedToolCall(name="emit_hypotheses", input={"hypotheses": list(hypotheses)})


def hypothesis(*evidence: uuid.UUID, **changes: Any) -> dict[str, Any]:
    return {
        "target_agent": "criativo",
        "statement": "Criativo answered without asking who the users are.",
        "confidence": 55,
        "evidence_event_ids": [str(e) for e in evidence],
        **changes,
    }


def script(*first: ScriptStep) -> Script:
    """Steps tried before the offline demo's own (which then closes the loop)."""
    return Script(steps=[*first, *DEFAULT_SCRIPT.steps])


def tool_results(bus: Driver, request: int) -> list[ToolResultBlock]:
    last = bus.provider.requests[request].messages[-1]
    assert not isinstance(last.content, str)
    return [b for b in last.content if isinstance(b, ToolResultBlock)]


async def test_a_closed_session_is_analysed_into_hypotheses_with_navigable_evidence(
    bus: Driver,
) -> None:
    s = await bus.session_with(3)
    await bus.close(s)

    completed = await bus.outcome(s)
    assert completed.type == COMPLETED
    assert completed.actor == "agent:psicologo-leve"
    assert completed.payload["tier"] == "leve" and completed.payload["triggered_by"] == "auto"
    assert completed.payload["termination_class"] == "normal"
    [analysis] = await bus.analyses(s)
    assert (analysis["tier"], analysis["agent_slug"], analysis["superseded"]) == (
        "leve",
        "psicologo-leve",
        False,
    )
    rows = await bus.hypotheses(s)
    assert rows and {r["status"] for r in rows} == {"proposed"}
    assert completed.payload["hypothesis_ids"] == [str(r["id"]) for r in rows]
    proposed = await bus.events(s, PROPOSED)
    assert [e.payload["hypothesis_id"] for e in proposed] == [str(r["id"]) for r in rows]
    # every evidence id opens an event of the analysed session
    cited = [e for r in rows for e in r["evidence_event_ids"]]
    found = await call(bus.nc, subjects.EVENTS_GET, GetEvents(event_ids=cited), EventsReply)
    assert not found.missing and {e.session_id for e in found.events} == {s}
    # the model read the whole log, the classified ending and the tool
    [request] = bus.provider.requests
    assert request.agent_slug == "psicologo-leve"
    prompt = request.messages[0].content
    assert isinstance(prompt, str)
    assert all(str(e.id) in prompt for e in await bus.events(s) if e.seq <= 5)
    assert "Termination (normal)" in prompt
    assert [t.name for t in request.tools] == ["emit_hypotheses"]


async def test_one_invalid_hypothesis_rejects_the_batch_and_the_model_corrects_it(
    bus: Driver,
) -> None:
    elsewhere = await bus.open()
    foreign = await bus.say(elsewhere, "outra sessão")
    s = await bus.open()
    first, second = await bus.say(s, "um"), await bus.say(s, "dois")
    bad_batch = emit(
        hypothesis(first, statement="kept only if the batch passes"), hypothesis(foreign)
    )
    good_batch = emit(hypothesis(first, second, statement="the corrected batch"))
    bus.provider.script = script(
        ScriptStep(has_tool="emit_hypotheses", iteration=0, tool_calls=[bad_batch]),
        ScriptStep(has_tool="emit_hypotheses", iteration=1, tool_calls=[good_batch]),
    )
    await bus.close(s)

    assert (await bus.outcome(s)).type == COMPLETED
    [row] = await bus.hypotheses(s)
    assert row["statement"] == "the corrected batch"  # nothing of the rejected batch
    assert row["evidence_event_ids"] == [first, second]
    # the domain's refusal reached the model verbatim, as an error tool result
    [refusal] = tool_results(bus, 1)
    assert refusal.is_error
    try:
        validate_hypothesis_batch(
            bad_batch.input, s, {first: s, foreign: elsewhere}, classify_termination(None)
        )
    except DomainError as exc:
        assert refusal.content == exc.message
        assert exc.code == ErrorCode.EVIDENCE_NOT_IN_SESSION
    else:
        raise AssertionError("the batch citing another session was accepted")
    assert f"event {foreign} belongs to session {elsewhere}" in refusal.content
    assert len(bus.provider.requests) == 2  # refused, corrected; the hook halted the loop


async def test_triage_chooses_the_slug_and_light_and_heavy_cost_differently(bus: Driver) -> None:
    light = await bus.session_with(17)  # 1 opened + 17 + 1 closed = 19 events
    heavy = await bus.session_with(18)  # 20 events
    await bus.close(light)
    await bus.close(heavy)

    assert (await bus.outcome(light)).payload["agent_slug"] == "psicologo-leve"
    assert (await bus.outcome(heavy)).payload["agent_slug"] == "psicologo"
    assert [r["event_count"] for r in await bus.analyses(light)] == [19]
    assert [r["tier"] for r in await bus.analyses(heavy)] == ["pesada"]
    summary = await bus.usage()
    by_agent = {g.key["agent"]: g for g in summary.groups}
    assert by_agent["psicologo-leve"].key["model"] == "claude-haiku-4-5"
    assert by_agent["psicologo"].key["model"] == "claude-opus-4-8"
    # similar prompts, the heavy tier's model is dearer: the bill shows it
    assert by_agent["psicologo"].cost_micros > 2 * by_agent["psicologo-leve"].cost_micros > 0


async def test_budget_exhaustion_announces_the_failure_and_writes_no_row(bus: Driver) -> None:
    s = await bus.session_with(2)
    # Each refused attempt bills 8,000 output tokens of Haiku (40,000 µUSD of 50,000):
    # the next turn's worst case no longer fits the light tier's budget.
    bus.provider.script = Script(
        steps=[
            ScriptStep(
                has_tool="emit_hypotheses",
                tool_calls=[emit(hypothesis(uuid.uuid4()))],
                output_tokens=8000,
            )
        ]
    )
    await bus.close(s)

    failed = await bus.outcome(s)
    assert failed.type == FAILED
    assert failed.payload["reason"].startswith("budget_exceeded")
    assert "does not exist" in failed.payload["reason"]  # the last refusal, kept for audit
    assert failed.payload["tier"] == "leve" and failed.payload["iterations"] == 1
    assert await bus.analyses(s) == [] and await bus.hypotheses(s) == []
    assert len(bus.provider.requests) == 1


async def test_running_out_of_iterations_announces_the_failure_and_writes_no_row(
    bus: Driver,
) -> None:
    s = await bus.session_with(2)
    bus.provider.script = Script(
        steps=[ScriptStep(has_tool="emit_hypotheses", tool_calls=[emit(hypothesis(uuid.uuid4()))])]
    )
    await bus.close(s)

    failed = await bus.outcome(s)
    assert failed.type == FAILED
    assert failed.payload["reason"].startswith("max_iterations: 4 iterations")
    assert await bus.analyses(s) == []
    assert len(bus.provider.requests) == 4  # the light tier's M


async def test_an_abnormal_end_requires_a_termination_analysis(bus: Driver) -> None:
    s = await bus.open()
    said = await bus.say(s, "vou sair")
    bus.provider.script = script(
        ScriptStep(has_tool="emit_hypotheses", iteration=0, tool_calls=[emit(hypothesis(said))]),
        ScriptStep(
            has_tool="emit_hypotheses",
            iteration=1,
            tool_calls=[
                emit(
                    hypothesis(said, termination_analysis="The engine failed mid-answer."),
                    hypothesis(said, target_agent="po", statement="PO was never reached."),
                )
            ],
        ),
    )
    await bus.terminate(s, "RuntimeError: the model client crashed")

    completed = await bus.outcome(s)
    assert completed.type == COMPLETED
    assert completed.payload["termination_class"] == "exception"
    [refusal] = tool_results(bus, 1)
    assert refusal.is_error and "ended abnormally (exception)" in refusal.content
    rows = await bus.hypotheses(s)
    assert [r["termination_analysis"] for r in rows] == ["The engine failed mid-answer.", None]
    prompt = bus.provider.requests[0].messages[0].content
    assert isinstance(prompt, str)
    assert "Termination (exception)" in prompt and "the model client crashed" in prompt
