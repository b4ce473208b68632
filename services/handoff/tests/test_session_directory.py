"""The offer path's session check: what the log said is remembered, "open" only briefly."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from contracts.session_events import SessionView
from domain.errors import DomainError
from handoff.directory import OPEN_FOR_SECONDS, SessionDirectory, SessionMemory
from servicekit.sessionlog import SessionLogClient


class AskedLog(SessionLogClient):
    """The real client to the log, counting how often it is asked about a session."""

    asked = 0

    async def session(self, session_id: uuid.UUID) -> SessionView:
        self.asked += 1
        return await super().session(session_id)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_an_offers_session_check_trusts_open_briefly_and_closed_for_good(
    bus: Any,
) -> None:
    log, clock = AskedLog(bus.nc), Clock()
    directory = SessionDirectory(log, SessionMemory(clock=clock))
    s = await bus.open()

    for _ in range(3):
        await directory.open_session(s, bus.project, open_for=OPEN_FOR_SECONDS)
    assert log.asked == 1  # the busy session's offers ask once

    await bus.close(s)
    await directory.open_session(s, bus.project, open_for=OPEN_FOR_SECONDS)  # within the window
    assert log.asked == 1
    with pytest.raises(DomainError) as fresh:  # an acceptance or activation always asks
        await directory.open_session(s, bus.project)
    assert fresh.value.code == "session_closed" and log.asked == 2

    clock.now += OPEN_FOR_SECONDS + 0.1
    for _ in range(2):  # closed is remembered for good
        with pytest.raises(DomainError) as closed:
            await directory.open_session(s, bus.project, open_for=OPEN_FOR_SECONDS)
        assert closed.value.code == "session_closed"
    assert log.asked == 2


async def test_a_remembered_session_of_another_project_is_refused(bus: Any) -> None:
    log = AskedLog(bus.nc)
    directory = SessionDirectory(log)
    s = await bus.open()
    await directory.open_session(s, bus.project, open_for=OPEN_FOR_SECONDS)

    with pytest.raises(DomainError) as refused:
        await directory.open_session(s, "another-project", open_for=OPEN_FOR_SECONDS)

    assert refused.value.code == "session_not_in_project"
    assert log.asked == 1


def test_the_memory_forgets_the_least_recently_asked_session_first() -> None:
    memory = SessionMemory(size=2)
    a, b, c = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    memory.remember(a, "p", is_open=False)
    memory.remember(b, "p", is_open=False)
    assert memory.fresh(a, 0.0) is not None  # a is asked about again: b is now the oldest
    memory.remember(c, "p", is_open=False)
    assert memory.fresh(b, 0.0) is None
    assert memory.fresh(a, 0.0) is not None and memory.fresh(c, 0.0) is not None
