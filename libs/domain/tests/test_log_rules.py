"""What the session log accepts: `domain.log_rules`, called directly, table by table.

The tables that enumerate event types are checked against `EventType` itself, so a
new type without a valid payload, an invalid case or a closed-session decision makes
this file fail until someone decides what the rule is for it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from uuid import UUID

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.common import ErrorBody, ErrorCode
from contracts.events import PAYLOADS, BusinessRule, EventType
from contracts.session_events import MAX_EVENT_PAYLOAD_BYTES
from domain.errors import DomainError
from domain.log_rules import (
    CausationFacts,
    RuleFacts,
    check_append,
    check_payload_size,
    check_retirement,
    known_event_type,
    parse_event_type,
    retired_rule,
    session_not_found,
    validate_payload,
)

SESSION = UUID("00000000-0000-4000-8000-000000000001")
OTHER_SESSION = UUID("00000000-0000-4000-8000-000000000002")
READINESS_ID = UUID("00000000-0000-4000-8000-0000000000a1")
MISSING_ID = UUID("00000000-0000-4000-8000-0000000000ff")
ID_1 = "00000000-0000-4000-8000-000000000011"
ID_2 = "00000000-0000-4000-8000-000000000012"
ID_3 = "00000000-0000-4000-8000-000000000013"

CRIATIVO = "agent:criativo"
# A person's readiness click in this session: the one cause a product brief accepts.
READINESS = CausationFacts(
    event_id=READINESS_ID,
    session_id=SESSION,
    type=EventType.CRIATIVO_READINESS_CONFIRMED.value,
    actor="user:ana",
)

# Hypothesis would otherwise write its example database into the working tree.
pure = settings(database=None, deadline=None)


def refusal(call: Callable[..., object], *args: Any, **kwargs: Any) -> DomainError:
    """The DomainError `call` raises; fails the test when it returns instead."""
    with pytest.raises(DomainError) as info:
        call(*args, **kwargs)
    return info.value


def append(
    event_type: EventType,
    *,
    actor: str = CRIATIVO,
    session_is_open: bool = True,
    causation_id: UUID | None = READINESS_ID,
    causation: CausationFacts | None = READINESS,
) -> None:
    """`check_append` in this session, by default with every argument a brief needs."""
    check_append(event_type, actor, SESSION, session_is_open, causation_id, causation)


# --- event types -------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        "chat.mesage",
        "",
        "chat",
        "chat.message.extra",
        "CHAT.MESSAGE",
        " chat.message",
        "chat.*",
        "artifact.>",
        "psychologist.hypothesis",  # the phase-1 stub's type (ADR 0015), gone
        "hypothesis.proposed",
        "artifact.story",
    ],
    ids=repr,
)
@pytest.mark.parametrize("parse", [known_event_type, parse_event_type], ids=lambda f: f.__name__)
def test_unknown_event_type_is_refused_listing_the_known_ones(
    parse: Callable[[str], EventType], raw: str
) -> None:
    error = refusal(parse, raw)

    assert error.code == ErrorCode.UNKNOWN_EVENT_TYPE
    assert error.details == {"type": raw}
    assert repr(raw) in error.message
    # The message is what a model reads to correct itself: every type it may append is
    # in it, and none of those the log writes itself.
    for known in EventType:
        assert (known.value in error.message) == (known.domain != "session")


@pytest.mark.parametrize("event_type", list(EventType), ids=str)
def test_known_event_type_accepts_every_contract_type(event_type: EventType) -> None:
    assert known_event_type(event_type.value) is event_type


@pytest.mark.parametrize("event_type", list(EventType), ids=str)
def test_parse_event_type_reserves_the_session_domain(event_type: EventType) -> None:
    if event_type.domain != "session":
        assert parse_event_type(event_type.value) is event_type
        return
    error = refusal(parse_event_type, event_type.value)
    assert error.code == ErrorCode.RESERVED_EVENT_TYPE
    assert error.details == {"type": event_type.value}
    assert "cmd.sessions" in error.message


def test_the_log_writes_its_own_lifecycle_types() -> None:
    reserved = {t for t in EventType if t.domain == "session"}
    assert reserved == {
        EventType.SESSION_OPENED,
        EventType.SESSION_CLOSED,
        EventType.SESSION_CLOSED_ABNORMALLY,
        EventType.SESSION_FORKED,
    }


# --- payload size --------------------------------------------------------------


@pytest.mark.parametrize(
    "size",
    [0, 1, MAX_EVENT_PAYLOAD_BYTES - 1, MAX_EVENT_PAYLOAD_BYTES],
    ids=["empty", "one-byte", "limit-minus-1", "exactly-the-limit"],
)
def test_payload_up_to_the_limit_is_accepted(size: int) -> None:
    check_payload_size(size)


@pytest.mark.parametrize(
    "size",
    [MAX_EVENT_PAYLOAD_BYTES + 1, 2 * MAX_EVENT_PAYLOAD_BYTES],
    ids=["limit-plus-1", "twice-the-limit"],
)
def test_payload_over_the_limit_is_refused(size: int) -> None:
    error = refusal(check_payload_size, size)

    assert error.code == ErrorCode.PAYLOAD_TOO_LARGE
    assert error.details == {"size_bytes": size, "limit_bytes": MAX_EVENT_PAYLOAD_BYTES}
    assert str(size) in error.message
    assert str(MAX_EVENT_PAYLOAD_BYTES) in error.message


@pure
@given(size=st.integers(min_value=0, max_value=4 * MAX_EVENT_PAYLOAD_BYTES))
def test_payload_size_limit_is_a_single_threshold(size: int) -> None:
    if size <= MAX_EVENT_PAYLOAD_BYTES:
        check_payload_size(size)
    else:
        assert refusal(check_payload_size, size).code == ErrorCode.PAYLOAD_TOO_LARGE


# --- payload contracts -----------------------------------------------------------

USAGE = {
    "model": "claude-haiku-4-5",
    "input_tokens": 812,
    "output_tokens": 95,
    "cache_read_input_tokens": 600,
    "cost_micros": 1234,
}

VALID_PAYLOADS: dict[EventType, dict[str, Any]] = {
    EventType.SESSION_OPENED: {"opened_by": "user:ana"},
    EventType.SESSION_CLOSED: {"closed_by": "user:ana"},
    EventType.SESSION_CLOSED_ABNORMALLY: {"reason": "heartbeat_timeout"},
    EventType.SESSION_FORKED: {"parent_session_id": ID_1, "at_seq": 3, "forked_by": "user:ana"},
    EventType.CHAT_MESSAGE: {"text": "Quero um app de receitas", "client_msg_id": "c-1"},
    EventType.AGENT_ACTIVATED: {"agent": "criativo", "via": "user"},
    EventType.AGENT_RESPONSE: {"agent": "criativo", "text": "Para quem?", "usage": USAGE},
    EventType.AGENT_ERROR: {
        "agent": "criativo",
        "code": "budget_exceeded",
        "reason": "o orçamento da sessão acabou",
    },
    EventType.ARTIFACT_BUSINESS_RULE: {
        "title": "Receitas públicas",
        "statement": "Toda receita publicada é visível sem login.",
        "origin": [ID_1, ID_2],
    },
    EventType.ARTIFACT_BUSINESS_RULE_RETRACTED: {"rule_id": ID_3, "reason": "not what I meant"},
    EventType.ARTIFACT_PRODUCT_BRIEF: {
        "title": "App de receitas",
        "summary": "Um caderno de receitas compartilhado.",
        "business_rule_ids": [ID_1],
    },
    EventType.CRIATIVO_READINESS_CONFIRMED: {},
    EventType.HANDOFF_OFFERED: {
        "handoff_id": ID_1,
        "from_agent": "criativo",
        "to_agent": "po",
        "artifact_id": ID_2,
    },
    EventType.HANDOFF_ACCEPTED: {"handoff_id": ID_1, "to_agent": "po"},
    EventType.HANDOFF_REJECTED: {"handoff_id": ID_1, "to_agent": "po", "reason": "not now"},
    EventType.HANDOFF_COMPLETED: {"handoff_id": ID_1, "to_agent": "po"},
    EventType.HANDOFF_SUPERSEDED: {
        "handoffId": ID_1,
        "toAgent": "po",
        "motivo": "nova_oferta",
        "substitutaId": ID_2,
    },
    EventType.HYPOTHESIS_PROPOSED: {
        "hypothesis_id": ID_1,
        "analysis_id": ID_2,
        "target_agent": "criativo",
        "statement": "Criativo emitted rules before the person stated the audience.",
        "confidence": 70,
        "evidence_event_ids": [ID_3],
    },
    EventType.HYPOTHESIS_ACCEPTED: {"hypothesis_id": ID_1, "target_agent": "criativo"},
    EventType.HYPOTHESIS_DISMISSED: {"hypothesis_id": ID_1, "target_agent": "criativo"},
    EventType.HYPOTHESIS_ACCEPTED_FOR_ANAMNESE: {
        "hypothesis_id": ID_1,
        "target_agent": "criativo",
        "statement": "asks too many questions",
    },
    EventType.ANALYSIS_COMPLETED: {
        "analysis_id": ID_2,
        "tier": "leve",
        "agent_slug": "psicologo-leve",
        "hypothesis_ids": [ID_1],
    },
    EventType.ANALYSIS_FAILED: {"tier": "pesada", "reason": "max_iterations"},
}


@dataclass(frozen=True)
class Invalid:
    """A payload its contract refuses, and the one problem the refusal must name."""

    id: str
    type: EventType
    payload: dict[str, Any]
    loc: tuple[str | int, ...]
    error: str  # pydantic's error type


def _with(event_type: EventType, **changes: Any) -> dict[str, Any]:
    return {**VALID_PAYLOADS[event_type], **changes}


def _without(event_type: EventType, field: str) -> dict[str, Any]:
    return {k: v for k, v in VALID_PAYLOADS[event_type].items() if k != field}


T = EventType
# One case per row reads better than one argument per line.
# fmt: off
INVALID_PAYLOADS = [
    Invalid("opened-no-actor", T.SESSION_OPENED, {}, ("opened_by",), "missing"),
    Invalid("opened-bare-name", T.SESSION_OPENED, {"opened_by": "ana"}, ("opened_by",),
            "string_pattern_mismatch"),
    Invalid("closed-bad-actor", T.SESSION_CLOSED, {"closed_by": "bot:x"}, ("closed_by",),
            "string_pattern_mismatch"),
    Invalid("closed-abnormally-blank-reason", T.SESSION_CLOSED_ABNORMALLY, {"reason": "   "},
            ("reason",), "string_too_short"),
    Invalid("forked-at-zero", T.SESSION_FORKED, _with(T.SESSION_FORKED, at_seq=0), ("at_seq",),
            "greater_than_equal"),
    Invalid("chat-empty", T.CHAT_MESSAGE, {"text": ""}, ("text",), "string_too_short"),
    Invalid("chat-too-long", T.CHAT_MESSAGE, {"text": "x" * 20_001}, ("text",),
            "string_too_long"),
    Invalid("chat-unknown-field", T.CHAT_MESSAGE, _with(T.CHAT_MESSAGE, author="ana"),
            ("author",), "extra_forbidden"),
    Invalid("activated-bad-via", T.AGENT_ACTIVATED, _with(T.AGENT_ACTIVATED, via="magic"),
            ("via",), "literal_error"),
    Invalid("activated-bad-slug", T.AGENT_ACTIVATED, _with(T.AGENT_ACTIVATED, agent="Criativo"),
            ("agent",), "string_pattern_mismatch"),
    Invalid("response-negative-tokens", T.AGENT_RESPONSE,
            _with(T.AGENT_RESPONSE, usage={**USAGE, "input_tokens": -1}),
            ("usage", "input_tokens"), "greater_than_equal"),
    Invalid("response-no-text", T.AGENT_RESPONSE, _without(T.AGENT_RESPONSE, "text"),
            ("text",), "missing"),
    Invalid("error-blank-reason", T.AGENT_ERROR, _with(T.AGENT_ERROR, reason=""),
            ("reason",), "string_too_short"),
    Invalid("rule-empty-origin", T.ARTIFACT_BUSINESS_RULE,
            _with(T.ARTIFACT_BUSINESS_RULE, origin=[]), ("origin",), "too_short"),
    Invalid("rule-no-origin", T.ARTIFACT_BUSINESS_RULE,
            _without(T.ARTIFACT_BUSINESS_RULE, "origin"), ("origin",), "missing"),
    Invalid("rule-null-origin", T.ARTIFACT_BUSINESS_RULE,
            _with(T.ARTIFACT_BUSINESS_RULE, origin=None), ("origin",), "list_type"),
    Invalid("rule-origin-not-uuid", T.ARTIFACT_BUSINESS_RULE,
            _with(T.ARTIFACT_BUSINESS_RULE, origin=[ID_1, "message 3"]), ("origin", 1),
            "uuid_parsing"),
    Invalid("rule-blank-statement", T.ARTIFACT_BUSINESS_RULE,
            _with(T.ARTIFACT_BUSINESS_RULE, statement=" \n"), ("statement",), "string_too_short"),
    Invalid("rule-replaces-not-uuid", T.ARTIFACT_BUSINESS_RULE,
            _with(T.ARTIFACT_BUSINESS_RULE, replaces="rule 3"), ("replaces",), "uuid_parsing"),
    Invalid("retraction-no-rule", T.ARTIFACT_BUSINESS_RULE_RETRACTED,
            _without(T.ARTIFACT_BUSINESS_RULE_RETRACTED, "rule_id"), ("rule_id",), "missing"),
    Invalid("retraction-rule-not-uuid", T.ARTIFACT_BUSINESS_RULE_RETRACTED,
            _with(T.ARTIFACT_BUSINESS_RULE_RETRACTED, rule_id="the second rule"), ("rule_id",),
            "uuid_parsing"),
    Invalid("brief-no-summary", T.ARTIFACT_PRODUCT_BRIEF,
            _without(T.ARTIFACT_PRODUCT_BRIEF, "summary"), ("summary",), "missing"),
    Invalid("brief-rule-id-not-uuid", T.ARTIFACT_PRODUCT_BRIEF,
            _with(T.ARTIFACT_PRODUCT_BRIEF, business_rule_ids=["RN-1"]),
            ("business_rule_ids", 0), "uuid_parsing"),
    Invalid("readiness-unknown-field", T.CRIATIVO_READINESS_CONFIRMED, {"confirmed": True},
            ("confirmed",), "extra_forbidden"),
    Invalid("offered-bad-target", T.HANDOFF_OFFERED, _with(T.HANDOFF_OFFERED, to_agent="PO!"),
            ("to_agent",), "string_pattern_mismatch"),
    Invalid("accepted-no-handoff-id", T.HANDOFF_ACCEPTED, {"to_agent": "po"},
            ("handoff_id",), "missing"),
    Invalid("rejected-handoff-id-not-uuid", T.HANDOFF_REJECTED,
            _with(T.HANDOFF_REJECTED, handoff_id="h-1"), ("handoff_id",), "uuid_parsing"),
    Invalid("completed-no-target", T.HANDOFF_COMPLETED, {"handoff_id": ID_1},
            ("to_agent",), "missing"),
    # ADR 0182 fixes camelCase wire names: the snake_case spelling is not accepted.
    Invalid("superseded-snake-case", T.HANDOFF_SUPERSEDED,
            {"handoff_id": ID_1, "to_agent": "po", "motivo": "nova_oferta"},
            ("handoffId",), "missing"),
    Invalid("superseded-unknown-motivo", T.HANDOFF_SUPERSEDED,
            _with(T.HANDOFF_SUPERSEDED, motivo="agent_activated"), ("motivo",), "literal_error"),
    Invalid("proposed-confidence-over-100", T.HYPOTHESIS_PROPOSED,
            _with(T.HYPOTHESIS_PROPOSED, confidence=101), ("confidence",), "less_than_equal"),
    Invalid("proposed-confidence-fraction", T.HYPOTHESIS_PROPOSED,
            _with(T.HYPOTHESIS_PROPOSED, confidence=70.5), ("confidence",), "int_type"),
    Invalid("proposed-no-evidence", T.HYPOTHESIS_PROPOSED,
            _with(T.HYPOTHESIS_PROPOSED, evidence_event_ids=[]), ("evidence_event_ids",),
            "too_short"),
    Invalid("accepted-no-target", T.HYPOTHESIS_ACCEPTED, {"hypothesis_id": ID_1},
            ("target_agent",), "missing"),
    Invalid("dismissed-id-not-uuid", T.HYPOTHESIS_DISMISSED,
            _with(T.HYPOTHESIS_DISMISSED, hypothesis_id="H1"), ("hypothesis_id",),
            "uuid_parsing"),
    Invalid("anamnese-no-hypothesis", T.HYPOTHESIS_ACCEPTED_FOR_ANAMNESE,
            _without(T.HYPOTHESIS_ACCEPTED_FOR_ANAMNESE, "hypothesis_id"), ("hypothesis_id",),
            "missing"),
    Invalid("completed-unknown-tier", T.ANALYSIS_COMPLETED,
            _with(T.ANALYSIS_COMPLETED, tier="heavy"), ("tier",), "literal_error"),
    Invalid("completed-unknown-trigger", T.ANALYSIS_COMPLETED,
            _with(T.ANALYSIS_COMPLETED, triggered_by="cron"), ("triggered_by",), "literal_error"),
    Invalid("failed-blank-reason", T.ANALYSIS_FAILED, _with(T.ANALYSIS_FAILED, reason=""),
            ("reason",), "string_too_short"),
]
# fmt: on


def test_every_event_type_has_a_valid_and_an_invalid_payload_case() -> None:
    assert set(VALID_PAYLOADS) == set(EventType)
    assert {case.type for case in INVALID_PAYLOADS} == set(EventType)


@pytest.mark.parametrize("event_type", list(EventType), ids=str)
def test_valid_payload_is_parsed_by_its_contract_model(event_type: EventType) -> None:
    parsed = validate_payload(event_type, VALID_PAYLOADS[event_type])

    assert type(parsed) is PAYLOADS[event_type]


@pytest.mark.parametrize("case", INVALID_PAYLOADS, ids=lambda case: case.id)
def test_invalid_payload_is_refused_naming_the_bad_field(case: Invalid) -> None:
    error = refusal(validate_payload, case.type, case.payload)

    assert error.code == ErrorCode.INVALID_PAYLOAD
    problems = error.details["errors"]
    assert (list(case.loc), case.error) in [(p["loc"], p["type"]) for p in problems]
    assert all(set(p) == {"loc", "msg", "type"} for p in problems)
    assert error.message.startswith(f"invalid {case.type.value} payload: ")
    assert f"{'.'.join(map(str, case.loc))}: " in error.message
    # The refusal travels as an error reply: it must serialise as it is.
    ErrorBody(code=error.code, message=error.message, details=json.loads(json.dumps(error.details)))


def test_invalid_payload_lists_every_problem_not_only_the_first() -> None:
    payload = {"title": "", "statement": "ok", "origin": [], "extra": 1}

    error = refusal(validate_payload, EventType.ARTIFACT_BUSINESS_RULE, payload)

    assert sorted(tuple(p["loc"]) for p in error.details["errors"]) == [
        ("extra",),
        ("origin",),
        ("title",),
    ]
    for field in ("title: ", "origin: ", "extra: "):
        assert field in error.message


def test_invalid_payload_does_not_echo_the_input() -> None:
    secret = "x" * 20_001

    error = refusal(validate_payload, EventType.CHAT_MESSAGE, {"text": secret})

    assert secret not in error.message
    assert secret not in json.dumps(error.details)


@pure
@given(origin=st.lists(st.uuids(), min_size=1, max_size=20))
def test_any_non_empty_list_of_uuids_is_a_valid_origin(origin: list[UUID]) -> None:
    payload = {"title": "Regra", "statement": "Vale.", "origin": [str(u) for u in origin]}

    parsed = validate_payload(EventType.ARTIFACT_BUSINESS_RULE, payload)

    assert isinstance(parsed, BusinessRule)
    assert parsed.origin == origin


# --- closed sessions ---------------------------------------------------------------

# Conversation is refused in a closed session; system facts about it are still
# recorded (ADR 0182 decision 1, RN-581). `session.*` is not in the log's table, so
# the default (refuse) applies; the log writes those itself, without `check_append`.
WHEN_CLOSED = {
    "chat": "refuse",
    "agent": "refuse",
    "artifact": "refuse",
    "criativo": "refuse",
    "handoff": "accept",
    "psychologist": "accept",
    "session": "refuse",
}
# Types that differ from their domain: a failed turn is recorded even after the close.
WHEN_CLOSED_BY_TYPE = {"agent.error": "accept"}
# Types only a person writes (ADR 0008 decision 5: readiness is the person's action).
PERSON = "user:ana"
PERSON_ONLY = {
    EventType.CHAT_MESSAGE,
    EventType.CRIATIVO_READINESS_CONFIRMED,
    EventType.ARTIFACT_BUSINESS_RULE_RETRACTED,
}


def author_of(event_type: EventType) -> str:
    return PERSON if event_type in PERSON_ONLY else CRIATIVO


@pytest.mark.parametrize("event_type", list(EventType), ids=str)
def test_closed_session_refuses_conversation_and_accepts_system_facts(
    event_type: EventType,
) -> None:
    if event_type.domain not in WHEN_CLOSED:
        pytest.fail(f"new domain {event_type.domain!r}: is it conversation or a system fact?")
    policy = WHEN_CLOSED_BY_TYPE.get(event_type.value, WHEN_CLOSED[event_type.domain])
    if policy == "accept":
        append(event_type, actor=author_of(event_type), session_is_open=False)
        return
    error = refusal(append, event_type, actor=author_of(event_type), session_is_open=False)
    assert error.code == ErrorCode.SESSION_CLOSED
    assert error.details == {"session_id": str(SESSION)}
    assert str(SESSION) in error.message
    assert event_type.value in error.message


@pytest.mark.parametrize("event_type", list(EventType), ids=str)
def test_open_session_accepts_every_type_from_an_allowed_author(event_type: EventType) -> None:
    append(event_type, actor=author_of(event_type), session_is_open=True)


# --- causation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("event_type", "actor"),
    [
        (EventType.AGENT_RESPONSE, CRIATIVO),
        (EventType.ARTIFACT_BUSINESS_RULE, CRIATIVO),
        (EventType.HANDOFF_OFFERED, CRIATIVO),
        (EventType.ARTIFACT_PRODUCT_BRIEF, CRIATIVO),
    ],
    ids=str,
)
def test_causation_id_of_an_event_that_does_not_exist_is_refused(
    event_type: EventType, actor: str
) -> None:
    error = refusal(append, event_type, actor=actor, causation_id=MISSING_ID, causation=None)

    assert error.code == ErrorCode.CAUSATION_NOT_FOUND
    assert error.details == {"causation_id": str(MISSING_ID)}
    assert str(MISSING_ID) in error.message


def test_no_causation_is_fine_for_an_ordinary_event() -> None:
    append(EventType.CHAT_MESSAGE, actor="user:ana", causation_id=None, causation=None)


# --- the product brief (ADR 0008 decision 5) ---------------------------------------------


@pytest.mark.parametrize(
    "actor",
    [
        "user:ana",
        "agent:po",
        "agent:psicologo",
        "system:criativo",
        "agent:criativo-2",
        "agent:Criativo",
        "agent:criativo ",
        "criativo",
    ],
    ids=repr,
)
def test_product_brief_from_anyone_but_criativo_is_refused(actor: str) -> None:
    error = refusal(append, EventType.ARTIFACT_PRODUCT_BRIEF, actor=actor)

    assert error.code == ErrorCode.ACTOR_NOT_ALLOWED
    assert error.details == {"actor": actor}
    assert CRIATIVO in error.message


@pure
@given(actor=st.text().filter(lambda a: a != CRIATIVO))
def test_any_actor_other_than_criativo_is_refused_for_a_brief(actor: str) -> None:
    assert refusal(append, EventType.ARTIFACT_PRODUCT_BRIEF, actor=actor).code == (
        ErrorCode.ACTOR_NOT_ALLOWED
    )


def test_product_brief_caused_by_the_persons_readiness_is_accepted() -> None:
    append(EventType.ARTIFACT_PRODUCT_BRIEF, actor=CRIATIVO, causation=READINESS)


@pytest.mark.parametrize(
    ("causation_id", "causation"),
    [
        pytest.param(None, None, id="no-causation"),
        pytest.param(
            READINESS_ID,
            CausationFacts(READINESS_ID, SESSION, EventType.CHAT_MESSAGE.value, "user:ana"),
            id="cause-is-a-chat-message",
        ),
        pytest.param(
            READINESS_ID,
            CausationFacts(READINESS_ID, SESSION, EventType.ARTIFACT_BUSINESS_RULE.value, CRIATIVO),
            id="cause-is-a-business-rule",
        ),
        pytest.param(
            READINESS_ID,
            CausationFacts(READINESS_ID, SESSION, READINESS.type, CRIATIVO),
            id="readiness-by-an-agent",
        ),
        pytest.param(
            READINESS_ID,
            CausationFacts(READINESS_ID, SESSION, READINESS.type, "system:criativo"),
            id="readiness-by-the-system",
        ),
        pytest.param(
            READINESS_ID,
            CausationFacts(READINESS_ID, OTHER_SESSION, READINESS.type, "user:ana"),
            id="readiness-in-another-session",
        ),
    ],
)
def test_product_brief_requires_a_persons_readiness_in_the_same_session(
    causation_id: UUID | None, causation: CausationFacts | None
) -> None:
    error = refusal(
        append,
        EventType.ARTIFACT_PRODUCT_BRIEF,
        actor=CRIATIVO,
        causation_id=causation_id,
        causation=causation,
    )

    assert error.code == ErrorCode.BRIEF_REQUIRES_READINESS
    assert error.details == {"causation_id": str(causation_id) if causation_id else None}
    assert EventType.CRIATIVO_READINESS_CONFIRMED.value in error.message


def test_product_brief_with_a_missing_cause_says_the_cause_is_missing() -> None:
    # The more precise refusal wins: the id names nothing, rather than "not a readiness".
    error = refusal(
        append,
        EventType.ARTIFACT_PRODUCT_BRIEF,
        actor=CRIATIVO,
        causation_id=MISSING_ID,
        causation=None,
    )

    assert error.code == ErrorCode.CAUSATION_NOT_FOUND


# --- session_not_found ---------------------------------------------------------------


def test_session_not_found_names_the_session() -> None:
    error = session_not_found(SESSION)

    assert error.code == ErrorCode.SESSION_NOT_FOUND
    assert error.details == {"session_id": str(SESSION)}
    assert str(SESSION) in error.message


# --- rules found missing by these tests, now kept ---------------------------------------


@pytest.mark.parametrize("actor", [CRIATIVO, "system:criativo"], ids=str)
def test_readiness_from_anyone_but_a_person_is_refused(actor: str) -> None:
    error = refusal(
        append,
        EventType.CRIATIVO_READINESS_CONFIRMED,
        actor=actor,
        causation_id=None,
        causation=None,
    )
    assert error.code == ErrorCode.ACTOR_NOT_ALLOWED


def test_boolean_confidence_is_refused() -> None:
    payload = _with(EventType.HYPOTHESIS_PROPOSED, confidence=True)

    assert refusal(validate_payload, EventType.HYPOTHESIS_PROPOSED, payload).code == (
        ErrorCode.INVALID_PAYLOAD
    )


def test_whitespace_only_chat_message_is_refused() -> None:
    error = refusal(validate_payload, EventType.CHAT_MESSAGE, {"text": " \n "})

    assert error.code == ErrorCode.INVALID_PAYLOAD


# --- retracting and correcting a business rule ------------------------------------------

PROJECT = "recipes"
RULE_ID = UUID(ID_3)
RETRACTION_ID = UUID("00000000-0000-4000-8000-0000000000b1")
RULE = RuleFacts(RULE_ID, PROJECT, EventType.ARTIFACT_BUSINESS_RULE.value)
RETRACT = EventType.ARTIFACT_BUSINESS_RULE_RETRACTED
CORRECT = EventType.ARTIFACT_BUSINESS_RULE


@pytest.mark.parametrize("event_type", [RETRACT, CORRECT], ids=str)
def test_a_person_retires_a_standing_rule_of_the_project(event_type: EventType) -> None:
    # Whichever session of the project recorded it: the log holds only what came before.
    check_retirement(event_type, PERSON, PROJECT, RULE_ID, RULE)


@pytest.mark.parametrize("event_type", [RETRACT, CORRECT], ids=str)
@pytest.mark.parametrize("actor", [CRIATIVO, "system:criativo", "agent:po", "service:x"], ids=str)
def test_only_a_person_retires_a_rule(event_type: EventType, actor: str) -> None:
    error = refusal(check_retirement, event_type, actor, PROJECT, RULE_ID, RULE)

    assert error.code == ErrorCode.ACTOR_NOT_ALLOWED
    assert error.details == {"actor": actor}


@pytest.mark.parametrize("event_type", [RETRACT, CORRECT], ids=str)
@pytest.mark.parametrize(
    "rule",
    [
        pytest.param(None, id="no-such-event"),
        pytest.param(RuleFacts(RULE_ID, "another-project", CORRECT.value), id="other-project"),
        pytest.param(RuleFacts(RULE_ID, PROJECT, EventType.CHAT_MESSAGE.value), id="a-message"),
        pytest.param(RuleFacts(RULE_ID, PROJECT, RETRACT.value), id="a-retraction"),
    ],
)
def test_retiring_what_is_not_a_rule_of_the_project_is_refused_as_not_found(
    event_type: EventType, rule: RuleFacts | None
) -> None:
    error = refusal(check_retirement, event_type, PERSON, PROJECT, RULE_ID, rule)

    assert error.code == ErrorCode.RULE_NOT_FOUND
    assert error.details == {"rule_id": str(RULE_ID)}
    # Refused alike whether the id exists elsewhere or nowhere: nothing about another project.
    assert "another-project" not in error.message


@pytest.mark.parametrize("event_type", [RETRACT, CORRECT], ids=str)
def test_a_rule_already_retracted_or_replaced_is_not_standing(event_type: EventType) -> None:
    retired = RuleFacts(RULE_ID, PROJECT, CORRECT.value, retired_by=RETRACTION_ID)

    error = refusal(check_retirement, event_type, PERSON, PROJECT, RULE_ID, retired)

    assert error.code == ErrorCode.RULE_NOT_STANDING
    assert error.details == {"rule_id": str(RULE_ID), "retired_by": str(RETRACTION_ID)}


@pytest.mark.parametrize(
    ("event_type", "payload", "retires"),
    [
        pytest.param(RETRACT, {"rule_id": ID_3}, RULE_ID, id="retraction"),
        pytest.param(CORRECT, {"replaces": ID_3}, RULE_ID, id="correction"),
        pytest.param(CORRECT, {"replaces": None}, None, id="new-rule"),
        pytest.param(CORRECT, {}, None, id="new-rule-without-field"),
        pytest.param(EventType.CHAT_MESSAGE, {"rule_id": ID_3}, None, id="other-type"),
    ],
)
def test_retired_rule_names_what_a_retraction_or_correction_retires(
    event_type: EventType, payload: dict[str, Any], retires: UUID | None
) -> None:
    assert retired_rule(event_type, payload) == retires
