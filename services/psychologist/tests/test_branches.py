"""A branch (`cmd.sessions.fork`) is analysed as its own session: its hypotheses cite
the branch's events, never the parent's it copied."""

from __future__ import annotations

import uuid

from contracts import subjects
from contracts.events import EventType
from contracts.session_events import EventsReply, ForkSession, GetEvents, SessionForkedReply
from servicekit.client import call

from .conftest import Driver


async def test_a_branch_is_analysed_with_evidence_from_its_own_log(bus: Driver) -> None:
    parent = await bus.session_with(3)
    branched = await call(
        bus.nc,
        subjects.SESSIONS_FORK,
        ForkSession(
            session_id=parent,
            project_id=bus.project,
            at_seq=3,
            text="outra ideia",
            forked_by="user:ana",
            fork_id=uuid.uuid4().hex,
        ),
        SessionForkedReply,
    )
    branch = branched.session_id
    await bus.close(branch)

    completed = await bus.outcome(branch)
    assert completed.type is EventType.ANALYSIS_COMPLETED
    rows = await bus.hypotheses(branch)
    assert rows
    cited = [e for r in rows for e in r["evidence_event_ids"]]
    found = await call(bus.nc, subjects.EVENTS_GET, GetEvents(event_ids=cited), EventsReply)
    assert not found.missing and {e.session_id for e in found.events} == {branch}
    # The model read the branch's events, none of the parent's ids.
    prompt = str(bus.provider.requests[-1].messages[0].content)
    assert all(str(e.id) in prompt for e in await bus.events(branch) if e.seq <= 5)
    assert not [e for e in await bus.events(parent) if str(e.id) in prompt]
    # The parent is open and was not analysed.
    assert await bus.analyses(parent) == []
    assert not await bus.events(parent, "psychologist.")
