"""The rendered context stays within one NATS message, however long the session."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from contracts.events import Event, EventType
from psychologist.context import fit_log

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
