"""A property over random histories, against the real service: whatever the order of
offers, accepts, activations and closings, a target never has two pending offers and
every status a row went through is in the log exactly once."""

from __future__ import annotations

import uuid
from collections import Counter
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from contracts import subjects
from contracts.handoff import (
    AcceptReply,
    ActivateAgent,
    ActivationReply,
    HandoffDecision,
    HandoffReply,
)
from servicekit.client import CommandFailed, call

from .conftest import Driver

TARGETS = ["po", "criativo"]
# Refusals a random history runs into by design; anything else fails the property.
EXPECTED_REFUSALS = {"agente_ja_ativo", "session_closed", "invalid_transition"}
# The event each status is announced by, besides the `handoff.offered` of every row.
EVENT_OF_STATUS = {
    "superseded": "handoff.superseded",
    "accepted": "handoff.accepted",
    "rejected": "handoff.rejected",
    "completed": "handoff.accepted",  # plus handoff.completed, checked below
}

operations = st.lists(
    st.one_of(
        st.tuples(
            st.just("offer"),
            st.sampled_from(TARGETS),
            st.integers(0, 2),
            st.sampled_from([None, 0, 1]),
        ),
        st.tuples(st.just("accept"), st.integers(0, 5)),
        st.tuples(st.just("reject"), st.integers(0, 5)),
        st.tuples(st.just("activate"), st.integers(0, 2)),
        st.tuples(st.just("close"), st.integers(0, 2)),
    ),
    min_size=3,
    max_size=12,
)


@settings(
    max_examples=20,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(history=operations)
# Histories that must always be among those tried: a new session, a new artifact,
# an accept over pending offers, a closed session in between.
@example(history=[("offer", "po", 0, None), ("offer", "po", 1, None), ("offer", "po", 1, 0)])
@example(history=[("offer", "po", 0, 0), ("offer", "po", 0, 1), ("accept", 0)])
@example(
    history=[
        ("offer", "po", 0, None),
        ("close", 0),
        ("offer", "po", 1, None),
        ("offer", "criativo", 2, None),
        ("activate", 1),
        ("accept", 0),
    ]
)
async def test_one_pending_offer_per_target_and_an_event_per_change(
    bus: Driver, history: list[tuple[Any, ...]]
) -> None:
    bus.project = f"prop-{uuid.uuid4().hex[:8]}"  # a fresh project per example
    sessions = [await bus.open() for _ in range(3)]
    artifacts = [await bus.artifact(sessions[0], f"brief {i}") for i in range(2)]
    for op in history:
        try:
            await _apply(bus, op, sessions, artifacts)
        except CommandFailed as refused:
            assert refused.code in EXPECTED_REFUSALS, refused

    rows = await bus.db.fetch("SELECT * FROM handoff.handoffs WHERE project_id = $1", bus.project)
    offered = Counter(r["to_agent"] for r in rows if r["status"] == "offered")
    assert all(n == 1 for n in offered.values()), offered

    events = [e for s in sessions for e in await bus.events(s, "handoff.")]
    announced = Counter(
        (e.type.value, str(e.payload.get("handoff_id") or e.payload["handoffId"])) for e in events
    )
    for row in rows:
        hid = str(row["id"])
        assert announced[("handoff.offered", hid)] == 1, row
        if row["status"] in EVENT_OF_STATUS:
            assert announced[(EVENT_OF_STATUS[row["status"]], hid)] == 1, row
        if row["status"] == "completed":
            assert announced[("handoff.completed", hid)] == 1, row
    assert sum(announced.values()) == len(events)
    assert sum(n for (kind, _), n in announced.items() if kind == "handoff.superseded") == sum(
        r["status"] == "superseded" for r in rows
    )


async def _apply(
    bus: Driver, op: tuple[Any, ...], sessions: list[uuid.UUID], artifacts: list[uuid.UUID]
) -> None:
    kind = op[0]
    if kind == "offer":
        _, target, s, artifact = op
        source = "po" if target == "criativo" else "criativo"
        await bus.offer(
            sessions[s], target, None if artifact is None else artifacts[artifact], src=source
        )
    elif kind in ("accept", "reject"):
        pending = await bus.db.fetch(
            "SELECT id, session_id FROM handoff.handoffs WHERE project_id = $1 "
            "AND status = 'offered' ORDER BY created_at, id",
            bus.project,
        )
        if pending:
            row = pending[op[1] % len(pending)]
            decision = HandoffDecision(handoff_id=row["id"], session_id=row["session_id"])
            if kind == "accept":
                await call(bus.nc, subjects.HANDOFFS_ACCEPT, decision, AcceptReply)
            else:
                await call(bus.nc, subjects.HANDOFFS_REJECT, decision, HandoffReply)
    elif kind == "activate":
        await call(
            bus.nc,
            subjects.AGENTS_ACTIVATE,
            ActivateAgent(
                project_id=bus.project, session_id=sessions[op[1]], agent="criativo", via="user"
            ),
            ActivationReply,
        )
    else:
        try:
            await bus.close(sessions[op[1]])
        except CommandFailed as already:
            assert already.code == "session_closed"
