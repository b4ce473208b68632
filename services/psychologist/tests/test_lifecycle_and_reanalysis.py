"""Decisions 4 and 5 against the real service: the hypothesis lifecycle, the insights
list, reanalysis superseding (never deleting), and redelivery spending nothing."""

from __future__ import annotations

import json
import uuid

import pytest

from contracts import catalog, streams, subjects
from contracts.common import ErrorCode
from contracts.events import EventType
from contracts.metering import SetLimits, SpendLimits
from contracts.psychologist import HypothesisDecision, HypothesisReply, Reanalyze
from contracts.subjects import event_subject
from metering.providers.scripted import ScriptedToolCall, ScriptStep
from servicekit.client import CommandFailed, call
from testkit.probes import wait_for

from .conftest import Driver
from .test_analysis import emit, hypothesis, script


async def decide(bus: Driver, verb: str, hypothesis_id: uuid.UUID) -> HypothesisReply:
    subject = subjects.HYPOTHESES_ACCEPT if verb == "accept" else subjects.HYPOTHESES_DISMISS
    return await call(
        bus.nc,
        subject,
        HypothesisDecision(hypothesis_id=hypothesis_id, actor="user:ana"),
        HypothesisReply,
    )


async def analysed_with(bus: Driver, *batch: ScriptedToolCall) -> tuple[uuid.UUID, list[uuid.UUID]]:
    """A closed, analysed session whose analysis emitted `batch`; its hypothesis ids."""
    s = await bus.open()
    said = await bus.say(s, "quero receitas")
    bus.provider.script = script(
        ScriptStep(
            has_tool="emit_hypotheses",
            iteration=0,
            tool_calls=list(batch)
            or [
                emit(
                    hypothesis(said, target_agent="criativo", statement="criativo one"),
                    hypothesis(said, target_agent="po", statement="po one"),
                    hypothesis(said, target_agent="criativo", statement="criativo two"),
                )
            ],
        )
    )
    await bus.close(s)
    assert (await bus.outcome(s)).type == EventType.ANALYSIS_COMPLETED
    return s, [r["id"] for r in await bus.hypotheses(s)]


async def test_accept_and_dismiss_only_from_proposed_each_with_its_events(bus: Driver) -> None:
    s, [h1, h2, _] = await analysed_with(bus)

    accepted = await decide(bus, "accept", h1)
    assert (accepted.hypothesis.status, accepted.hypothesis.decided_by) == ("accepted", "user:ana")
    assert (await decide(bus, "dismiss", h2)).hypothesis.status == "dismissed"
    for verb, h in [("accept", h1), ("dismiss", h1), ("accept", h2)]:
        with pytest.raises(CommandFailed) as info:
            await decide(bus, verb, h)
        assert info.value.code == ErrorCode.INVALID_TRANSITION
    with pytest.raises(CommandFailed) as info:
        await decide(bus, "accept", uuid.uuid4())
    assert info.value.code == ErrorCode.HYPOTHESIS_NOT_FOUND

    decided = [
        (e.type.value, e.payload["hypothesis_id"], e.actor)
        for e in await bus.events(s, "psychologist.hypothesis_")
        if e.type != EventType.HYPOTHESIS_PROPOSED
    ]
    assert decided == [
        (EventType.HYPOTHESIS_ACCEPTED.value, str(h1), "user:ana"),
        (EventType.HYPOTHESIS_ACCEPTED_FOR_ANAMNESE.value, str(h1), "user:ana"),
        (EventType.HYPOTHESIS_DISMISSED.value, str(h2), "user:ana"),
    ]
    statuses = {r["id"]: r["status"] for r in await bus.hypotheses(s)}
    assert [statuses[h1], statuses[h2]] == ["accepted", "dismissed"]


async def test_a_malformed_decision_is_refused_with_a_code_and_writes_nothing(bus: Driver) -> None:
    reply = await bus.nc.request(subjects.HYPOTHESES_ACCEPT, b'{"hypothesis_id": 7}', timeout=5)
    assert json.loads(reply.data)["error"]["code"] == ErrorCode.INVALID_REQUEST
    reply = await bus.nc.request(subjects.HYPOTHESES_LIST, b"not json", timeout=5)
    assert json.loads(reply.data)["error"]["code"] == ErrorCode.MALFORMED_JSON
    assert await bus.db.fetchval("SELECT count(*) FROM psychologist.outbox") == 0


async def test_list_groups_the_project_hypotheses_by_target_agent(bus: Driver) -> None:
    _, [h1, h2, h3] = await analysed_with(bus)
    await decide(bus, "dismiss", h3)

    groups = {g.target_agent: [h.id for h in g.hypotheses] for g in (await bus.listed()).groups}
    assert groups == {"criativo": [h1, h3], "po": [h2]}
    dismissed = (await bus.listed(status="dismissed")).groups
    assert [(g.target_agent, [h.id for h in g.hypotheses]) for g in dismissed] == [
        ("criativo", [h3])
    ]


async def test_earlier_non_dismissed_hypotheses_are_part_of_the_next_context(bus: Driver) -> None:
    _, [_, _, h3] = await analysed_with(bus)
    await decide(bus, "dismiss", h3)
    bus.provider.requests.clear()
    bus.provider.script = script()
    later = await bus.session_with(1)
    await bus.close(later)
    await bus.outcome(later)

    prompt = bus.provider.requests[0].messages[0].content
    assert isinstance(prompt, str)
    assert "criativo one" in prompt and "po one" in prompt
    assert "criativo two" not in prompt  # dismissed


async def test_reanalysis_supersedes_the_current_analysis_and_keeps_it(bus: Driver) -> None:
    s, old_ids = await analysed_with(bus)
    [old] = await bus.analyses(s)
    bus.provider.script = script()

    outcome = await bus.reanalyze(s)

    assert outcome.status == "completed" and outcome.superseded_analysis_id == old["id"]
    rows = {r["id"]: r for r in await bus.analyses(s)}
    assert rows[old["id"]]["superseded"] and rows[old["id"]]["superseded_by"] == outcome.analysis_id
    assert rows[outcome.analysis_id]["triggered_by"] == "manual"
    assert not rows[outcome.analysis_id]["superseded"]
    assert len(await bus.hypotheses(s)) == len(old_ids) + len(outcome.hypotheses)
    listed = [h.id for g in (await bus.listed()).groups for h in g.hypotheses]
    assert listed == [h.id for h in outcome.hypotheses]
    everything = [
        h.id for g in (await bus.listed(include_superseded=True)).groups for h in g.hypotheses
    ]
    assert set(everything) == set(old_ids) | set(listed)
    completions = await bus.events(s, EventType.ANALYSIS_COMPLETED.value)
    assert [c.payload["triggered_by"] for c in completions] == ["auto", "manual"]
    assert completions[1].payload["superseded_analysis_id"] == str(old["id"])
    # and again: always runs
    again = await bus.reanalyze(s)
    assert again.superseded_analysis_id == outcome.analysis_id
    assert sum(not r["superseded"] for r in await bus.analyses(s)) == 1


async def test_reanalysis_is_refused_for_an_open_unknown_or_foreign_session(bus: Driver) -> None:
    s = await bus.open()
    for session_id, project, code in [
        (s, None, ErrorCode.SESSION_NOT_CLOSED),
        (uuid.uuid4(), None, ErrorCode.SESSION_NOT_FOUND),
        (s, "another-project", ErrorCode.SESSION_NOT_IN_PROJECT),
    ]:
        with pytest.raises(CommandFailed) as info:
            await bus.reanalyze(session_id, project)
        assert info.value.code == code
    assert bus.provider.requests == []


async def test_a_duplicate_delivery_after_success_spends_nothing(bus: Driver) -> None:
    s = await bus.session_with(2)
    await bus.close(s)
    await bus.outcome(s)
    calls = bus.metering.calls
    [closing] = await bus.events(s, EventType.SESSION_CLOSED.value)

    # The same event again, as a relay retrying after the duplicate window would send it.
    js = bus.nc.jetstream()
    ack = await js.publish(
        event_subject(closing.type, closing.project_id, s),
        closing.model_dump_json().encode(),
        headers={"Nats-Msg-Id": f"again-{uuid.uuid4()}"},
    )

    async def consumed() -> bool:
        info = await js.consumer_info(streams.EVENTS.name, "psychologist-session-closings")
        return bool(info.ack_floor.stream_seq >= ack.seq and info.num_ack_pending == 0)

    await wait_for(consumed, what="the duplicate closing to be acknowledged")
    assert bus.metering.calls == calls
    assert len(await bus.analyses(s)) == 1
    assert len(await bus.events(s, EventType.ANALYSIS_COMPLETED.value)) == 1


async def test_a_reanalysis_over_a_limit_is_refused_up_front_not_queued(bus: Driver) -> None:
    s, _ = await analysed_with(bus)
    calls, before = bus.metering.calls, await bus.analyses(s)
    # the person who asks has used up their month
    await call(
        bus.nc,
        catalog.LIMITS_SET,
        SetLimits(scope="person", name="rui", limits=SpendLimits(micros_per_month=0)),
    )
    with pytest.raises(CommandFailed) as refused:
        await call(
            bus.nc,
            catalog.PSYCHOLOGIST_REANALYZE,
            Reanalyze(project_id=bus.project, session_id=s, requested_by="user:rui"),
            timeout=30,
        )
    assert refused.value.code == ErrorCode.BUDGET_EXCEEDED
    assert refused.value.details["scope"] == "person" and refused.value.details["name"] == "rui"
    assert refused.value.details["window"] == "month"
    assert bus.metering.calls == calls and await bus.analyses(s) == before
    # someone else may still ask: the run is the project's, under their own limits
    bus.provider.script = script()
    outcome = await call(
        bus.nc,
        catalog.PSYCHOLOGIST_REANALYZE,
        Reanalyze(project_id=bus.project, session_id=s, requested_by="user:sol"),
        timeout=30,
    )
    assert outcome.status == "completed"
    held = await bus.db.fetch(
        "SELECT DISTINCT person FROM metering.budget_holds WHERE run_id LIKE $1", f"%{s}%"
    )
    assert "sol" in {r["person"] for r in held}
