"""The rendered context stays within one NATS message, however long the session, and
marks the business rules that no longer stand."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from contracts.events import Event, EventType
from contracts.session_events import SessionView
from domain.psychologist import classify_termination
from psychologist.context import AnalysisContext, fit_log, render

SESSION = uuid.uuid4()


def chat(seq: int, text: str = "x" * 80) -> Event:
    return Event(
        id=uuid.uuid4(),
        session_id=SESSION,
        project_id="p",
        seq=seq,
        type=EventType.CHAT_MESSAGE,
        actor="user:ana",
        payload={"text": text},
        created_at=datetime(2026, 11, 29, tzinfo=UTC),
    )


def test_a_log_that_fits_is_kept_whole() -> None:
    events = [chat(i) for i in range(1, 11)]
    lines = fit_log(events, 100_000)
    assert [str(e.id) in line for e, line in zip(events, lines, strict=True)] == [True] * 10


def test_a_long_log_keeps_its_beginning_and_end_and_says_what_it_left_out() -> None:
    events = [chat(i) for i in range(1, 10_001)]
    budget = 60_000
    lines = fit_log(events, budget)

    assert sum(len(line) + 1 for line in lines) <= budget + 300  # plus the summary line
    assert str(events[0].id) in lines[0] and str(events[-1].id) in lines[-1]
    [gap] = [line for line in lines if "omitted" in line]
    shown = len(lines) - 1
    assert f"{10_000 - shown} events omitted" in gap
    assert f"{10_000 - shown} chat.message" in gap


def event(kind: EventType, payload: dict[str, object], session: uuid.UUID = SESSION) -> Event:
    return Event(
        id=uuid.uuid4(),
        session_id=session,
        project_id="p",
        seq=1,
        type=kind,
        actor="user:ana",
        payload=payload,
        created_at=datetime(2026, 11, 29, tzinfo=UTC),
    )


def rule(title: str, replaces: Event | None = None, session: uuid.UUID = SESSION) -> Event:
    payload: dict[str, object] = {
        "title": title,
        "statement": f"{title}.",
        "origin": [str(SESSION)],
    }
    if replaces is not None:
        payload["replaces"] = str(replaces.id)
    return event(EventType.ARTIFACT_BUSINESS_RULE, payload, session)


def test_rules_the_person_retracted_or_replaced_are_marked_not_standing() -> None:
    earlier = uuid.uuid4()
    standing = rule("Pickup only", session=earlier)
    taken_back = rule("Cash only")
    replaced = rule("Orders close at 18h")
    correction = rule("Orders close at 19h", replaces=replaced)
    retraction = event(
        EventType.ARTIFACT_BUSINESS_RULE_RETRACTED,
        {"rule_id": str(taken_back.id), "reason": "cards are fine"},
    )
    session = SessionView(
        session_id=SESSION,
        project_id="p",
        opened_by="user:ana",
        status="closed",
        termination_reason=None,
        opened_at=datetime(2026, 11, 29, tzinfo=UTC),
        closed_at=datetime(2026, 11, 29, 1, tzinfo=UTC),
        last_heartbeat_at=None,
        event_count=0,
    )
    rules = [standing, taken_back, replaced, correction, retraction]
    ctx = AnalysisContext(session, [], rules, [], classify_termination(None))

    text = render(ctx)
    listed = text.split("# Business rules of the project\n")[1].split("\n\n")[0].splitlines()

    assert listed == [
        "- Pickup only: Pickup only.",
        "- Cash only: Cash only. (recorded in this session)"
        " — NO LONGER STANDS: the person retracted it (cards are fine)",
        "- Orders close at 18h: Orders close at 18h. (recorded in this session)"
        " — NO LONGER STANDS: the person replaced it with 'Orders close at 19h'",
        "- Orders close at 19h: Orders close at 19h. (recorded in this session)"
        " — the person's correction of an earlier rule",
    ]
