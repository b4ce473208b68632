"""ADR 0015's acceptance criterion, end to end on real NATS and Postgres: three sessions
end — normally, by a kill (the client's heartbeats stop and the log reaps it), and by an
error — and all three are analysed into hypotheses whose evidence opens events of the
session; the light and heavy tiers' different costs are visible in metering."""

from __future__ import annotations

import pytest
from nats.aio.client import Client

from contracts import subjects
from contracts.events import EventType
from contracts.session_events import (
    EventsReply,
    GetEvents,
    HeartbeatReply,
    SessionRef,
    SessionView,
)
from servicekit.client import call

from .conftest import Driver


@pytest.fixture
def heartbeat_timeout() -> float:
    return 1.0


async def test_three_endings_three_analyses_with_navigable_evidence_and_visible_costs(
    bus: Driver, nc: Client
) -> None:
    normal = await bus.session_with(3)
    await bus.close(normal)
    killed = await bus.session_with(4)
    await call(nc, subjects.SESSIONS_HEARTBEAT, SessionRef(session_id=killed), HeartbeatReply)
    # ... and the client dies: no more heartbeats, the log's reaper ends the session.
    failed = await bus.session_with(24)  # 26 events: the heavy tier
    await bus.terminate(failed, "RuntimeError: the engine lost the model connection")

    expected = {
        normal: ("normal", "leve", "psicologo-leve"),
        killed: ("heartbeat_timeout", "leve", "psicologo-leve"),
        failed: ("exception", "pesada", "psicologo"),
    }
    for session_id, (termination, tier, slug) in expected.items():
        completed = await bus.outcome(session_id)
        assert completed.type == EventType.ANALYSIS_COMPLETED, completed.payload
        assert (
            completed.payload["termination_class"],
            completed.payload["tier"],
            completed.payload["agent_slug"],
        ) == (termination, tier, slug)
        view = await call(nc, subjects.SESSIONS_GET, SessionRef(session_id=session_id), SessionView)
        assert view.status == ("closed" if termination == "normal" else "closed_abnormally")
        hypotheses = await bus.hypotheses(session_id)
        assert hypotheses
        if termination != "normal":
            assert any(h["termination_analysis"] for h in hypotheses)
        # navigable: every evidence id opens an event of this very session
        for h in hypotheses:
            opened = await call(
                nc, subjects.EVENTS_GET, GetEvents(event_ids=h["evidence_event_ids"]), EventsReply
            )
            assert not opened.missing
            assert {e.session_id for e in opened.events} == {session_id}
        listed = [h.id for g in (await bus.listed()).groups for h in g.hypotheses]
        assert {h["id"] for h in hypotheses} <= set(listed)

    usage = {g.key["agent"]: g for g in (await bus.usage()).groups}
    light, heavy = usage["psicologo-leve"], usage["psicologo"]
    assert (light.key["model"], heavy.key["model"]) == ("claude-haiku-4-5", "claude-opus-4-8")
    assert (light.calls, heavy.calls) == (2, 1)
    # one heavy analysis costs more than both light ones together
    assert heavy.cost_micros > light.cost_micros > 0
