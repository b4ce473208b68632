"""Who may fork a session, where, and what a branch's copies name: `domain.log_rules`,
called directly, table by table."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import pytest

from contracts.common import ErrorCode
from contracts.events import EVENT_REFERENCES, PAYLOADS, Event, EventType
from domain.errors import DomainError
from domain.log_rules import ForkFacts, check_fork, copy_prefix

PARENT = UUID("00000000-0000-4000-8000-000000000001")
ELSEWHERE = UUID("00000000-0000-4000-8000-0000000000ee")
PROJECT = "bakery"
ANA = "user:ana"

OPEN = ForkFacts(PARENT, PROJECT, last_seq=6, closing_seq=None)
# Closed at seq 5; the psychologist recorded seq 6 after it.
CLOSED = ForkFacts(PARENT, PROJECT, last_seq=6, closing_seq=5)


@dataclass(frozen=True)
class Case:
    name: str
    parent: ForkFacts | None
    actor: str = ANA
    project: str = PROJECT
    at_seq: int = 3
    refused: ErrorCode | None = None


# fmt: off
CASES = [
    Case("person-forks-open-session", OPEN),
    Case("person-forks-closed-session", CLOSED),
    Case("fork-at-first-event", OPEN, at_seq=1),
    Case("fork-at-last-event-of-open-session", OPEN, at_seq=6),
    Case("fork-at-last-event-before-closing", CLOSED, at_seq=4),
    Case("agent-may-not-fork", OPEN, actor="agent:criativo", refused=ErrorCode.ACTOR_NOT_ALLOWED),
    Case("system-may-not-fork", OPEN, actor="system:handoff",
         refused=ErrorCode.ACTOR_NOT_ALLOWED),
    Case("unknown-session", None, refused=ErrorCode.SESSION_NOT_FOUND),
    Case("session-of-another-project", OPEN, project="other",
         refused=ErrorCode.SESSION_NOT_IN_PROJECT),
    Case("fork-point-past-the-log", OPEN, at_seq=7, refused=ErrorCode.FORK_POINT_NOT_FOUND),
    Case("fork-point-zero", OPEN, at_seq=0, refused=ErrorCode.FORK_POINT_NOT_FOUND),
    Case("fork-at-the-closing", CLOSED, at_seq=5, refused=ErrorCode.FORK_POINT_NOT_FOUND),
    Case("fork-after-the-closing", CLOSED, at_seq=6, refused=ErrorCode.FORK_POINT_NOT_FOUND),
]
# fmt: on


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_who_may_fork_and_where(case: Case) -> None:
    def fork() -> ForkFacts:
        return check_fork(case.parent, PARENT, case.project, case.actor, case.at_seq)

    if case.refused is None:
        assert fork() == case.parent
        return
    with pytest.raises(DomainError) as info:
        fork()
    assert info.value.code == case.refused
    assert info.value.message


def test_a_refused_fork_point_names_the_conversation_it_may_take() -> None:
    with pytest.raises(DomainError) as info:
        check_fork(CLOSED, PARENT, PROJECT, ANA, 5)
    assert info.value.details == {"session_id": str(PARENT), "at_seq": 5, "last_seq": 4}


# --- the copies ----------------------------------------------------------------

AT = datetime(2026, 1, 1, tzinfo=UTC)


def uid(n: int) -> UUID:
    return UUID(int=n)


def event(n: int, type_: EventType, payload: dict[str, Any], cause: UUID | None = None) -> Event:
    return Event(
        id=uid(n),
        session_id=PARENT,
        project_id=PROJECT,
        seq=n,
        type=type_,
        actor=ANA if type_.domain in ("chat", "session") else "agent:criativo",
        payload=payload,
        causation_id=cause,
        created_at=AT,
    )


def copies_of(events: list[Event]) -> dict[UUID, Any]:
    return {c.copied_from: c for c in copy_prefix(events, iter(uid(1000 + i) for i in range(99)))}


def test_copies_take_new_ids_and_keep_type_actor_and_order() -> None:
    events = [
        event(1, EventType.SESSION_OPENED, {"opened_by": ANA}),
        event(2, EventType.AGENT_ACTIVATED, {"agent": "criativo", "via": "user"}),
        event(3, EventType.CHAT_MESSAGE, {"text": "bread"}),
    ]
    copies = copy_prefix(events, iter([uid(101), uid(102), uid(103)]))
    assert [(c.id, c.copied_from, c.type, c.actor) for c in copies] == [
        (uid(101), uid(1), EventType.SESSION_OPENED, ANA),
        (uid(102), uid(2), EventType.AGENT_ACTIVATED, "agent:criativo"),
        (uid(103), uid(3), EventType.CHAT_MESSAGE, ANA),
    ]
    assert [c.payload for c in copies] == [e.payload for e in events]


def test_causes_inside_the_prefix_name_the_copies_and_outside_ones_are_kept() -> None:
    message = event(2, EventType.CHAT_MESSAGE, {"text": "bread"})
    answer = event(3, EventType.AGENT_RESPONSE, {"agent": "criativo", "text": "ok"}, uid(2))
    foreign = event(4, EventType.AGENT_RESPONSE, {"agent": "criativo", "text": "x"}, ELSEWHERE)
    copies = copies_of([message, answer, foreign])
    assert copies[uid(3)].causation_id == copies[uid(2)].id
    assert copies[uid(4)].causation_id == ELSEWHERE
    assert copies[uid(2)].causation_id is None


def test_event_references_in_payloads_name_the_copies() -> None:
    message = event(1, EventType.CHAT_MESSAGE, {"text": "bread"})
    rule = event(
        2,
        EventType.ARTIFACT_BUSINESS_RULE,
        {"title": "t", "statement": "s", "origin": [str(uid(1)), str(ELSEWHERE)]},
    )
    brief = event(
        3,
        EventType.ARTIFACT_PRODUCT_BRIEF,
        {"title": "b", "summary": "s", "details": "", "business_rule_ids": [str(uid(2))]},
    )
    handoff_id = str(uid(77))
    offer = event(
        4,
        EventType.HANDOFF_OFFERED,
        {
            "handoff_id": handoff_id,
            "from_agent": "criativo",
            "to_agent": "po",
            "artifact_id": str(uid(3)),
        },
    )
    copies = copies_of([message, rule, brief, offer])
    assert copies[uid(2)].payload["origin"] == [str(copies[uid(1)].id), str(ELSEWHERE)]
    assert copies[uid(3)].payload["business_rule_ids"] == [str(copies[uid(2)].id)]
    assert copies[uid(4)].payload["artifact_id"] == str(copies[uid(3)].id)
    # A handoff id names the handoff service's row, not an event: kept.
    assert copies[uid(4)].payload["handoff_id"] == handoff_id
    # The originals are left as they were.
    assert rule.payload["origin"] == [str(uid(1)), str(ELSEWHERE)]


@pytest.mark.parametrize("event_type", sorted(EVENT_REFERENCES), ids=str)
def test_every_event_reference_is_a_field_of_its_payload(event_type: EventType) -> None:
    fields = PAYLOADS[event_type].model_fields
    assert set(EVENT_REFERENCES[event_type]) <= set(fields)
