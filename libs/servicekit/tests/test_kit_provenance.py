"""`mismatch`: a delivered event is the committed one only when every decided field agrees."""

from __future__ import annotations

from datetime import UTC, datetime
from uuid import uuid4

import pytest

from contracts.events import Event, EventType
from servicekit.provenance import mismatch

COMMITTED = Event(
    id=uuid4(),
    session_id=uuid4(),
    project_id="p1",
    seq=7,
    type=EventType.SESSION_CLOSED,
    actor="user:ana",
    payload={"reason": "done"},
    created_at=datetime(2026, 11, 30, tzinfo=UTC),
)


def test_the_committed_event_is_confirmed() -> None:
    assert mismatch(COMMITTED, COMMITTED) is None


def test_an_event_the_log_does_not_hold_is_refused() -> None:
    assert mismatch(COMMITTED, None) == "not_in_log"


@pytest.mark.parametrize(
    ("field", "forged"),
    [
        ("session_id", uuid4()),
        ("project_id", "p2"),
        ("seq", 8),
        ("type", EventType.SESSION_CLOSED_ABNORMALLY),
        ("actor", "agent:criativo"),
        ("causation_id", uuid4()),
        ("payload", {"reason": "forged"}),
    ],
)
def test_a_copy_differing_in_any_field_the_log_decides_is_refused(
    field: str, forged: object
) -> None:
    delivered = COMMITTED.model_copy(update={field: forged})
    assert mismatch(delivered, COMMITTED) == f"{field}_differs"


def test_the_publication_time_is_not_part_of_the_check() -> None:
    # created_at is the log's clock; a republished copy carries the same, but it decides nothing.
    delivered = COMMITTED.model_copy(update={"created_at": datetime(2027, 1, 1, tzinfo=UTC)})
    assert mismatch(delivered, COMMITTED) is None
