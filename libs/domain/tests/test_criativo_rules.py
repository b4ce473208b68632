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
from contracts.metering import ChatMessage
from domain.criativo import (
    NO_TEXT,
    NOT_ANSWERED,
    STOPPED,
    Action,
    Admission,
    Conversation,
    Inbound,
    Outcome,
    admit,
    apply,
    brief_from_reply,
    check_artifact,
    consolidation_messages,
    decide,
    known,
    model_messages,
    readable_reason,
    rebuild,
    rules_digest,
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
    assert [u.event_id for u in conv.said] == [M1, M2]
    assert conv.outcomes == {M1: Outcome(R1, text="for whom?")}
    assert conv.answered == {M1}
    assert conv.chat_ids == {M1, M2}
    assert [r.event_id for r in conv.rules] == [RULE]
    # an event already folded in changes nothing (catch-up overlap, redelivery)
    assert apply(conv, LOG[1]) is conv


def test_only_a_messages_first_outcome_counts() -> None:
    log = [
        *LOG,
        ev(6, R2, EventType.AGENT_RESPONSE, {"agent": "criativo", "text": "noted"}, M2),
        ev(7, FOREIGN, EventType.AGENT_ERROR, {"agent": "criativo", "code": "x"}, M2),
    ]
    assert rebuild(SESSION, log).outcomes[M2] == Outcome(R2, text="noted")


def U(event_id: UUID, text: str) -> ChatMessage:
    return ChatMessage(role="user", content=f"[message {event_id}]\n{text}")


def A(text: str) -> ChatMessage:
    return ChatMessage(role="assistant", content=text)


def said(seq: int, event_id: UUID, text: str) -> Event:
    return ev(seq, event_id, EventType.CHAT_MESSAGE, {"text": text})


def answer(seq: int, event_id: UUID, cause: UUID, text: str, **extra: Any) -> Event:
    payload = {"agent": "criativo", "text": text, **extra}
    return ev(seq, event_id, EventType.AGENT_RESPONSE, payload, cause, "agent:criativo")


def failure(seq: int, event_id: UUID, cause: UUID, code: str) -> Event:
    payload = {"agent": "criativo", "code": code, "reason": "failed"}
    return ev(seq, event_id, EventType.AGENT_ERROR, payload, cause, "agent:criativo")


R2 = UUID("00000000-0000-4000-8000-000000000022")
R3 = UUID("00000000-0000-4000-8000-000000000023")

# (log, message answered, the prompt the model reads)
PROMPTS: list[tuple[str, list[Event], UUID, list[ChatMessage]]] = [
    ("first message", [said(1, M1, "a")], M1, [U(M1, "a")]),
    (
        "waited for the answer",
        [said(1, M1, "a"), answer(2, R1, M1, "ra"), said(3, M2, "b")],
        M2,
        [U(M1, "a"), A("ra"), U(M2, "b")],
    ),
    (
        "typed during the running turn: its answer comes later in the log",
        [said(1, M1, "a"), said(2, M2, "b"), answer(3, R1, M1, "ra")],
        M2,
        [U(M1, "a"), A("ra"), U(M2, "b")],
    ),
    (
        "a later message already in the log is not shown",
        [said(1, M1, "a"), said(2, M2, "b"), said(3, M3, "c"), answer(4, R1, M1, "ra")],
        M2,
        [U(M1, "a"), A("ra"), U(M2, "b")],
    ),
    (
        "nor is the answer to the message itself (a redelivery after it was answered)",
        [said(1, M1, "a"), answer(2, R1, M1, "ra")],
        M1,
        [U(M1, "a")],
    ),
    (
        "an error keeps the message, with a note, and roles alternating",
        [said(1, M1, "a"), failure(2, R1, M1, "provider_error"), said(3, M2, "b")],
        M2,
        [U(M1, "a"), A(NOT_ANSWERED.format(code="provider_error")), U(M2, "b")],
    ),
    (
        "a stopped answer is read as far as it went",
        [said(1, M1, "a"), answer(2, R1, M1, "half", stopped=True), said(3, M2, "b")],
        M2,
        [U(M1, "a"), A(f"half\n\n{STOPPED}"), U(M2, "b")],
    ),
    (
        "stopped before any text",
        [said(1, M1, "a"), answer(2, R1, M1, "", stopped=True), said(3, M2, "b")],
        M2,
        [U(M1, "a"), A(STOPPED), U(M2, "b")],
    ),
    (
        "an answer made of tool calls only",
        [said(1, M1, "a"), answer(2, R1, M1, ""), said(3, M2, "b")],
        M2,
        [U(M1, "a"), A(NO_TEXT), U(M2, "b")],
    ),
    (
        "rules and other events are not conversation",
        [*LOG, answer(6, R2, M2, "rb"), said(7, M3, "c")],
        M3,
        [U(M1, "a bakery app"), A("for whom?"), U(M2, "orders close at 6pm"), A("rb"), U(M3, "c")],
    ),
]


@pytest.mark.parametrize(
    ("log", "message", "prompt"), [p[1:] for p in PROMPTS], ids=[p[0] for p in PROMPTS]
)
def test_model_messages(log: list[Event], message: UUID, prompt: list[ChatMessage]) -> None:
    assert model_messages(rebuild(SESSION, log), message) == prompt


def test_model_messages_keep_whole_recent_exchanges_within_the_limit() -> None:
    ids = [UUID(int=i) for i in range(1, 11)]
    log: list[Event] = []
    for i, mid in enumerate(ids):
        log += [said(2 * i + 1, mid, f"m{i}"), answer(2 * i + 2, UUID(int=100 + i), mid, f"r{i}")]
    prompt = model_messages(rebuild(SESSION, log), ids[-1], limit=5)
    assert prompt == [U(ids[7], "m7"), A("r7"), U(ids[8], "m8"), A("r8"), U(ids[9], "m9")]


def test_consolidation_reads_what_was_said_before_readiness_then_the_ask() -> None:
    log = [
        said(1, M1, "a"),
        said(2, M2, "b"),
        answer(3, R1, M1, "ra"),
        ev(4, READY, EventType.CRIATIVO_READINESS_CONFIRMED),
        answer(5, R2, M2, "rb"),
        said(6, M3, "after readiness"),
    ]
    prompt = consolidation_messages(rebuild(SESSION, log), 4, "ASK")
    assert prompt == [
        U(M1, "a"),
        A("ra"),
        U(M2, "b"),
        A("rb"),
        ChatMessage(role="user", content="ASK"),
    ]
    assert consolidation_messages(rebuild(SESSION, []), 1, "ASK") == [
        ChatMessage(role="user", content="ASK")
    ]


# A session's log under real use: the person types whenever they like; Criativo answers
# the messages one at a time, in order, each with a reply, a stopped reply or an error,
# and records rules on the way. Drawn as a sequence of moves over a growing log.


@st.composite
def session_logs(draw: st.DrawFn) -> list[Event]:
    moves = draw(
        st.lists(st.sampled_from(["say", "answer", "rule", "other"]), min_size=1, max_size=40)
    )
    log: list[Event] = []
    waiting: list[UUID] = []
    n = 0

    def next_id() -> UUID:
        nonlocal n
        n += 1
        return UUID(int=n)

    for move in [*moves, *["answer"] * 40]:
        seq = len(log) + 1
        if move == "say":
            mid = next_id()
            log.append(said(seq, mid, f"text of {mid}"))
            waiting.append(mid)
        elif move == "answer" and waiting:
            cause = waiting.pop(0)
            how = draw(st.sampled_from(["reply", "stopped", "error"]))
            if how == "error":
                log.append(failure(seq, next_id(), cause, "provider_error"))
            else:
                log.append(
                    answer(seq, next_id(), cause, f"reply to {cause}", stopped=how == "stopped")
                )
        elif move == "rule" and waiting:
            payload = {"title": "t", "statement": "s", "origin": [str(waiting[0])]}
            log.append(ev(seq, next_id(), EventType.ARTIFACT_BUSINESS_RULE, payload, waiting[0]))
        elif move == "other":
            log.append(ev(seq, next_id(), EventType.CRIATIVO_READINESS_CONFIRMED))
    return log


@settings(database=None, deadline=None, max_examples=300)
@given(session_logs())
def test_the_prompt_for_a_message_is_every_earlier_exchange_then_the_message(
    log: list[Event],
) -> None:
    whole = rebuild(SESSION, log)
    messages = [e for e in log if e.type is EventType.CHAT_MESSAGE]
    outcome_of = {
        e.causation_id: e
        for e in log
        if e.type in (EventType.AGENT_RESPONSE, EventType.AGENT_ERROR)
    }
    for i, message in enumerate(messages):
        expected: list[ChatMessage] = []
        for earlier in messages[:i]:
            expected.append(U(earlier.id, earlier.payload["text"]))
            got = outcome_of[earlier.id]
            if got.type is EventType.AGENT_ERROR:
                expected.append(A(NOT_ANSWERED.format(code="provider_error")))
            elif got.payload["stopped"]:
                expected.append(A(f"{got.payload['text']}\n\n{STOPPED}"))
            else:
                expected.append(A(got.payload["text"]))
        expected.append(U(message.id, message.payload["text"]))
        prompt = model_messages(whole, message.id)
        assert prompt == expected
        # the same prompt as when the message was answered: the log up to its answer
        answered_at = outcome_of[message.id].seq
        then = rebuild(SESSION, [e for e in log if e.seq < answered_at])
        assert model_messages(then, message.id) == prompt
        # roles alternate, starting and ending with the person
        assert [m.role for m in prompt] == ["user", "assistant"] * i + ["user"]
        later = {str(m.id) for m in messages[i + 1 :]}
        assert not any(mid in str(m.content) for m in prompt for mid in later)


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


def copied(event: Event) -> Event:
    """`event` as a branch holds it: a copy of its parent's (`session.forked`)."""
    return event.model_copy(update={"copied_from": FOREIGN})


# A branch of a session whose second message (M2, unanswered) and a readiness with its
# brief are copied history, then the person's new message M3.
BRANCH = rebuild(
    SESSION,
    [
        *(copied(e) for e in LOG),
        copied(ev(6, READY, EventType.CRIATIVO_READINESS_CONFIRMED)),
        copied(ev(7, BRIEF, EventType.ARTIFACT_PRODUCT_BRIEF, {}, READY, "agent:criativo")),
        ev(8, M3, EventType.CHAT_MESSAGE, {"text": "a café instead"}),
    ],
)


def test_a_branch_answers_only_its_own_message() -> None:
    assert BRANCH.criativo_active  # the parent's activation, copied, carries over
    assert BRANCH.pending_before(4) == []  # the copied M2 is history
    assert BRANCH.pending_before(8) == [M3]


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
        # a branch's copies were acted on in its parent: not answered, no brief offered
        (BRANCH, EventType.CHAT_MESSAGE, M2, Action.NOTHING),
        (BRANCH, EventType.CRIATIVO_READINESS_CONFIRMED, READY, Action.NOTHING),
        (BRANCH, EventType.CHAT_MESSAGE, M3, Action.ANSWER_WITH_CRIATIVO),
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


@pytest.mark.parametrize(
    ("details", "words"),
    [
        (
            {
                "scope": "project",
                "metric": "micros",
                "window": "day",
                "resets_at": "2026-12-05T00:00:00+00:00",
            },
            "This project has used up its daily spending limit, so I cannot answer right now. "
            "It resets at 00:00 UTC on Dec 05",
        ),
        (
            {
                "scope": "person",
                "metric": "micros",
                "window": "month",
                "resets_at": "2027-01-01T00:00:00+00:00",
            },
            "Your account has used up its monthly spending limit",
        ),
        (
            {
                "scope": "person",
                "metric": "requests",
                "window": "minute",
                "resets_at": "2026-12-04T10:31:00+00:00",
            },
            "Your account has reached its limit of model calls per minute, so I cannot answer "
            "right now. It resets at 10:31 UTC; send",
        ),
    ],
)
def test_a_limits_refusal_says_whose_which_and_when_it_resets(
    details: dict[str, str], words: str
) -> None:
    code = "rate_limited" if details["window"] == "minute" else "budget_exceeded"
    assert words in readable_reason(code, details)


# --- standing rules: what the person retracted or corrected leaves the conversation ----

RULE_2 = UUID("00000000-0000-4000-8000-000000000032")
RULE_3 = UUID("00000000-0000-4000-8000-000000000033")
FIXED = UUID("00000000-0000-4000-8000-000000000034")
TAKEN_BACK = UUID("00000000-0000-4000-8000-000000000035")
EARLIER_SESSION_RULE = UUID("00000000-0000-4000-8000-000000000036")
RULES = [
    *LOG,  # RULE: "cutoff: 6pm"
    ev(6, RULE_2, EventType.ARTIFACT_BUSINESS_RULE, {"title": "pickup", "statement": "only"}, M2),
    ev(7, RULE_3, EventType.ARTIFACT_BUSINESS_RULE, {"title": "cash", "statement": "no cards"}, M2),
]


def rule_event(seq: int, event_id: UUID, title: str, statement: str, replaces: UUID) -> Event:
    payload = {"title": title, "statement": statement, "origin": [str(M2)]}
    return ev(
        seq, event_id, EventType.ARTIFACT_BUSINESS_RULE, payload | {"replaces": str(replaces)}
    )


def retraction(seq: int, event_id: UUID, rule_id: UUID) -> Event:
    return ev(seq, event_id, EventType.ARTIFACT_BUSINESS_RULE_RETRACTED, {"rule_id": str(rule_id)})


@pytest.mark.parametrize(
    ("later", "digest"),
    [
        pytest.param(
            [],
            [f"[{RULE}] cutoff: 6pm", f"[{RULE_2}] pickup: only", f"[{RULE_3}] cash: no cards"],
            id="all-standing",
        ),
        pytest.param(
            [retraction(8, TAKEN_BACK, RULE_2)],
            [f"[{RULE}] cutoff: 6pm", f"[{RULE_3}] cash: no cards"],
            id="retracted-leaves",
        ),
        pytest.param(
            [rule_event(8, FIXED, "cutoff", "7pm", RULE)],
            [f"[{FIXED}] cutoff: 7pm", f"[{RULE_2}] pickup: only", f"[{RULE_3}] cash: no cards"],
            id="correction-takes-its-place",
        ),
        pytest.param(
            [rule_event(8, FIXED, "cutoff", "7pm", RULE), retraction(9, TAKEN_BACK, FIXED)],
            [f"[{RULE_2}] pickup: only", f"[{RULE_3}] cash: no cards"],
            id="correction-retracted",
        ),
        pytest.param(
            [rule_event(8, FIXED, "delivery", "by noon", EARLIER_SESSION_RULE)],
            [
                f"[{RULE}] cutoff: 6pm",
                f"[{RULE_2}] pickup: only",
                f"[{RULE_3}] cash: no cards",
                f"[{FIXED}] delivery: by noon",
            ],
            id="correction-of-an-earlier-sessions-rule-comes-last",
        ),
        pytest.param(
            [retraction(8, TAKEN_BACK, EARLIER_SESSION_RULE)],
            [f"[{RULE}] cutoff: 6pm", f"[{RULE_2}] pickup: only", f"[{RULE_3}] cash: no cards"],
            id="retraction-of-a-rule-not-held",
        ),
        pytest.param(
            [
                retraction(8, TAKEN_BACK, RULE),
                retraction(9, TAKEN_BACK, RULE_2),
                retraction(10, FIXED, RULE_3),
            ],
            ["(none yet)"],
            id="all-retracted",
        ),
    ],
)
def test_prompts_and_the_brief_read_only_standing_rules(
    later: list[Event], digest: list[str]
) -> None:
    conv = rebuild(SESSION, [*RULES, *later])

    assert rules_digest(conv).splitlines() == [f"- {d}" if d.startswith("[") else d for d in digest]
    standing = [UUID(d[1:37]) for d in digest if d.startswith("[")]
    assert brief_from_reply('{"title": "B", "summary": "s"}', conv).business_rule_ids == standing


def test_the_model_cannot_replace_a_rule_through_the_tool() -> None:
    with pytest.raises(DomainError) as info:
        check_artifact({**GOOD_RULE, "replaces": str(RULE)}, ACTIVE)
    assert info.value.code == ErrorCode.INVALID_ARTIFACT
    assert "person" in info.value.message
