"""Criativo's pure rules (`domain.criativo`), called directly, table by table."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.common import ErrorCode
from contracts.events import Event, EventType
from domain.criativo import (
    Action,
    Admission,
    Conversation,
    Inbound,
    admit,
    apply,
    brief_from_reply,
    check_artifact,
    decide,
    known,
    model_messages,
    readable_reason,
    rebuild,
)
from domain.errors import DomainError

SESSION = UUID("00000000-0000-4000-8000-000000000001")
M1 = UUID("00000000-0000-4000-8000-000000000011")
M2 = UUID("00000000-0000-4000-8000-000000000012")
M3 = UUID("00000000-0000-4000-8000-000000000013")
R1 = UUID("00000000-0000-4000-8000-000000000021")
RULE = UUID("00000000-0000-4000-8000-000000000031")
READY = UUID("00000000-0000-4000-8000-000000000041")
BRIEF = UUID("00000000-0000-4000-8000-000000000051")
ACT = UUID("00000000-0000-4000-8000-000000000061")
FOREIGN = UUID("00000000-0000-4000-8000-0000000000ff")
NOW = datetime(2026, 7, 24, tzinfo=UTC)


def ev(
    seq: int,
    event_id: UUID,
    kind: EventType,
    payload: dict[str, Any] | None = None,
    cause: UUID | None = None,
    actor: str = "user:ana",
) -> Event:
    return Event(
        id=event_id,
        session_id=SESSION,
        project_id="p",
        seq=seq,
        type=kind,
        actor=actor,
        payload=payload or {},
        causation_id=cause,
        created_at=NOW,
    )


LOG = [
    ev(1, ACT, EventType.AGENT_ACTIVATED, {"agent": "criativo", "via": "user"}),
    ev(2, M1, EventType.CHAT_MESSAGE, {"text": "a bakery app"}),
    ev(3, R1, EventType.AGENT_RESPONSE, {"agent": "criativo", "text": "for whom?"}, M1),
    ev(4, M2, EventType.CHAT_MESSAGE, {"text": "orders close at 6pm"}),
    ev(5, RULE, EventType.ARTIFACT_BUSINESS_RULE, {"title": "cutoff", "statement": "6pm"}, M2),
]


def test_rebuild_is_the_fold_of_the_log_in_seq_order() -> None:
    conv = rebuild(SESSION, list(reversed(LOG)))
    assert conv.last_seq == 5 and conv.criativo_active
    assert [u.role for u in conv.utterances] == ["user", "assistant", "user"]
    assert conv.answered == {M1}
    assert conv.chat_ids == {M1, M2}
    assert [r.event_id for r in conv.rules] == [RULE]
    # an event already folded in changes nothing (catch-up overlap, redelivery)
    assert apply(conv, LOG[1]) is conv


def test_model_messages_alternate_and_quote_ids() -> None:
    conv = rebuild(SESSION, LOG)
    messages = model_messages(conv)
    assert [m.role for m in messages] == ["user", "assistant", "user"]
    assert f"[message {M2}]" in str(messages[-1].content)
    # a turn sees only what was said up to its message
    assert len(model_messages(conv, upto_seq=2)) == 1


def test_consecutive_messages_of_one_role_are_merged() -> None:
    log = [*LOG, ev(6, M3, EventType.CHAT_MESSAGE, {"text": "and delivery"})]
    messages = model_messages(rebuild(SESSION, log))
    assert [m.role for m in messages] == ["user", "assistant", "user"]
    assert str(M2) in str(messages[-1].content) and str(M3) in str(messages[-1].content)


@pytest.mark.parametrize(
    ("log", "seq", "pending"),
    [
        (LOG, 4, [M2]),  # the current message
        (LOG, 2, []),  # already answered
        ([*LOG, ev(6, M3, EventType.CHAT_MESSAGE, {"text": "x"})], 6, [M2, M3]),  # a backlog
        ([*LOG, ev(6, M3, EventType.CHAT_MESSAGE, {"text": "x"})], 4, [M2]),  # not later ones
        (
            [
                *LOG,
                ev(6, M3, EventType.CHAT_MESSAGE, {"text": "x"}),
                ev(7, FOREIGN, EventType.AGENT_ERROR, {}, M3, "agent:criativo"),
            ],
            6,
            [],  # an error is an outcome too: nothing before the last outcome is pending
        ),
    ],
)
def test_pending_before(log: list[Event], seq: int, pending: list[UUID]) -> None:
    assert rebuild(SESSION, log).pending_before(seq) == pending


ACTIVE = rebuild(SESSION, LOG)
INACTIVE = rebuild(SESSION, LOG[1:])
CLOSED = apply(ACTIVE, ev(9, FOREIGN, EventType.SESSION_CLOSED, {}))
WITH_BRIEF = rebuild(
    SESSION,
    [
        *LOG,
        ev(6, READY, EventType.CRIATIVO_READINESS_CONFIRMED),
        ev(7, BRIEF, EventType.ARTIFACT_PRODUCT_BRIEF, {}, READY, "agent:criativo"),
    ],
)


@pytest.mark.parametrize(
    ("conv", "kind", "event_id", "action"),
    [
        (ACTIVE, EventType.CHAT_MESSAGE, M2, Action.ANSWER_WITH_CRIATIVO),
        (ACTIVE, EventType.CHAT_MESSAGE, M1, Action.ALREADY_ANSWERED),
        (INACTIVE, EventType.CHAT_MESSAGE, M2, Action.ANSWER_PLAINLY),
        (CLOSED, EventType.CHAT_MESSAGE, M2, Action.SESSION_CLOSED),
        (ACTIVE, EventType.CRIATIVO_READINESS_CONFIRMED, READY, Action.CONSOLIDATE),
        (
            INACTIVE,
            EventType.CRIATIVO_READINESS_CONFIRMED,
            READY,
            Action.READINESS_WITHOUT_CRIATIVO,
        ),
        (WITH_BRIEF, EventType.CRIATIVO_READINESS_CONFIRMED, READY, Action.OFFER_EXISTING_BRIEF),
        (CLOSED, EventType.CRIATIVO_READINESS_CONFIRMED, READY, Action.SESSION_CLOSED),
        (ACTIVE, EventType.AGENT_ACTIVATED, ACT, Action.NOTHING),
    ],
)
def test_decide(conv: Conversation, kind: EventType, event_id: UUID, action: Action) -> None:
    assert decide(conv, kind, event_id) is action


def test_known_excludes_the_brief() -> None:
    assert known() == ["business_rule"]
    assert "product_brief" not in known()


GOOD_RULE = {"type": "business_rule", "title": "cutoff", "statement": "6pm", "origin": [str(M2)]}


@pytest.mark.parametrize(
    ("raw", "code", "hint"),
    [
        ({**GOOD_RULE, "type": "product_brief"}, ErrorCode.ARTIFACT_NOT_EMITTABLE, "ready"),
        ({**GOOD_RULE, "type": "epic"}, ErrorCode.UNKNOWN_ARTIFACT_TYPE, "business_rule"),
        ({k: v for k, v in GOOD_RULE.items() if k != "type"}, ErrorCode.UNKNOWN_ARTIFACT_TYPE, ""),
        ({**GOOD_RULE, "origin": []}, ErrorCode.INVALID_ARTIFACT, "origin"),
        ({**GOOD_RULE, "title": "  "}, ErrorCode.INVALID_ARTIFACT, "title"),
        ({**GOOD_RULE, "origin": ["not-a-uuid"]}, ErrorCode.INVALID_ARTIFACT, "origin"),
        (
            {**GOOD_RULE, "origin": [str(FOREIGN)]},
            ErrorCode.ORIGIN_NOT_IN_CONVERSATION,
            str(FOREIGN),
        ),
        ({**GOOD_RULE, "extra": 1}, ErrorCode.INVALID_ARTIFACT, "extra"),
    ],
)
def test_check_artifact_refusals_tell_the_model_what_to_fix(
    raw: dict[str, Any], code: ErrorCode, hint: str
) -> None:
    with pytest.raises(DomainError) as info:
        check_artifact(raw, ACTIVE)
    assert info.value.code == code
    assert hint in info.value.message


def test_check_artifact_accepts_a_rule_citing_the_conversation() -> None:
    rule = check_artifact(GOOD_RULE, ACTIVE)
    assert rule.origin == [M2] and rule.title == "cutoff"


@pytest.mark.parametrize(
    ("text", "title", "summary"),
    [
        (json.dumps({"title": "Bakery", "summary": "orders", "details": "d"}), "Bakery", "orders"),
        ('Here it is:\n```json\n{"title": "B", "summary": "s"}\n```', "B", "s"),
        ("just prose about the product", "Product brief", "just prose about the product"),
        ("{broken json", "Product brief", "{broken json"),
        ("", "Product brief", "The brief of the conversation."),
    ],
)
def test_brief_from_reply(text: str, title: str, summary: str) -> None:
    brief = brief_from_reply(text, ACTIVE)
    assert (brief.title, brief.summary) == (title, summary)
    assert brief.business_rule_ids == [RULE]  # the rules it rests on


def test_admit_queues_in_seq_order_and_drops_nothing() -> None:
    queue: list[Inbound] = []
    for seq in (3, 1, 2):
        queue, admission = admit(queue, Inbound(UUID(int=seq), seq))
        assert admission is Admission.QUEUED
    assert [q.seq for q in queue] == [1, 2, 3]
    again, admission = admit(queue, Inbound(UUID(int=2), 2))
    assert admission is Admission.DUPLICATE and again == queue


@settings(database=None, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=50)))
def test_admit_keeps_every_distinct_input_once_sorted(seqs: list[int]) -> None:
    queue: list[Inbound] = []
    for seq in seqs:
        queue, _ = admit(queue, Inbound(UUID(int=seq), seq))
    assert [q.seq for q in queue] == sorted(set(seqs))


@pytest.mark.parametrize(
    ("code", "words"),
    [
        ("budget_exceeded", "budget"),
        ("provider_overloaded", "overloaded"),
        ("provider_error", "failed"),
        ("something_new", "something_new"),
    ],
)
def test_readable_reason(code: str, words: str) -> None:
    assert words in readable_reason(code)
