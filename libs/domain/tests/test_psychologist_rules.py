"""The Psicólogo's rules: `domain.psychologist`, called directly, table by table.

ADR 0015 decisions 3 (atomic batch validation with evidence), 4 (lifecycle),
6 (termination classifier) and 7 (triage).
"""

from __future__ import annotations

import typing
from typing import Any
from uuid import UUID

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts import psychologist as wire
from contracts.common import ErrorCode
from domain.errors import DomainError
from domain.psychologist import (
    HYPOTHESIS_TRANSITIONS,
    LIGHT_BELOW_EVENTS,
    TIERS,
    HypothesisStatus,
    Termination,
    TerminationClass,
    Tier,
    assert_hypothesis_transition,
    cited_event_ids,
    classify_termination,
    triage,
    validate_hypothesis_batch,
)

pure = settings(database=None, deadline=None)

SESSION = UUID("00000000-0000-4000-8000-000000000001")
OTHER = UUID("00000000-0000-4000-8000-000000000002")
E1 = UUID("00000000-0000-4000-8000-0000000000e1")
E2 = UUID("00000000-0000-4000-8000-0000000000e2")
E_OTHER = UUID("00000000-0000-4000-8000-0000000000f1")
MISSING = UUID("00000000-0000-4000-8000-0000000000ff")
H = UUID("00000000-0000-4000-8000-000000000011")
FOUND = {E1: SESSION, E2: SESSION, E_OTHER: OTHER}
NORMAL = classify_termination(None)
KILLED = classify_termination("SIGKILL")


def refusal(batch: Any, termination: Termination = NORMAL) -> DomainError:
    with pytest.raises(DomainError) as info:
        validate_hypothesis_batch(batch, SESSION, FOUND, termination)
    return info.value


def hypothesis(**changes: Any) -> dict[str, Any]:
    return {
        "target_agent": "criativo",
        "statement": "Criativo wrote rules before asking who the users are.",
        "confidence": 70,
        "evidence_event_ids": [str(E1)],
        **changes,
    }


# --- the enums are the wire's ------------------------------------------------------------


@pytest.mark.parametrize(
    ("enum", "literal"),
    [(Tier, wire.Tier), (HypothesisStatus, wire.HypothesisStatus)],
)
def test_domain_names_are_the_wire_names(enum: Any, literal: Any) -> None:
    assert {m.value for m in enum} == set(typing.get_args(literal))


# --- triage (decision 7) -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("events", "tier", "slug", "iterations", "budget"),
    [
        (0, Tier.LEVE, "psicologo-leve", 4, 50_000),
        (1, Tier.LEVE, "psicologo-leve", 4, 50_000),
        (19, Tier.LEVE, "psicologo-leve", 4, 50_000),
        (20, Tier.PESADA, "psicologo", 8, 300_000),
        (21, Tier.PESADA, "psicologo", 8, 300_000),
        (10_000, Tier.PESADA, "psicologo", 8, 300_000),
    ],
)
def test_triage_boundaries(
    events: int, tier: Tier, slug: str, iterations: int, budget: int
) -> None:
    plan = triage(events)
    assert (plan.tier, plan.agent_slug, plan.max_iterations, plan.budget_micros) == (
        tier,
        slug,
        iterations,
        budget,
    )


def test_triage_refuses_a_negative_count() -> None:
    with pytest.raises(ValueError):
        triage(-1)


@pure
@given(st.integers(min_value=0, max_value=10**7))
def test_triage_is_monotonic_and_names_slugs_not_models(events: int) -> None:
    plan = triage(events)
    assert plan == TIERS[Tier.LEVE if events < LIGHT_BELOW_EVENTS else Tier.PESADA]
    assert "claude" not in plan.agent_slug  # metering's bindings choose the model
    assert triage(events + 1).budget_micros >= plan.budget_micros


# --- termination classifier (decision 6) -------------------------------------------------


@pytest.mark.parametrize(
    ("reason", "kind"),
    [
        (None, TerminationClass.NORMAL),
        ("", TerminationClass.NORMAL),
        ("normal", TerminationClass.NORMAL),
        ("heartbeat_timeout", TerminationClass.HEARTBEAT_TIMEOUT),
        ("SIGKILL", TerminationClass.KILLED),
        ("killed by the supervisor (signal 9)", TerminationClass.KILLED),
        ("engine exited with exit code 137", TerminationClass.KILLED),
        ("SIGTERM received; RuntimeError while shutting down", TerminationClass.KILLED),
        ("RuntimeError: the model client crashed", TerminationClass.EXCEPTION),
        ("** (ArgumentError) argument error", TerminationClass.EXCEPTION),
        ("Traceback (most recent call last): ...", TerminationClass.EXCEPTION),
        ("the user walked away", TerminationClass.UNCLASSIFIED),
        ("budget of the project exhausted", TerminationClass.UNCLASSIFIED),
    ],
)
def test_classifier_recognises_each_reason(reason: str | None, kind: TerminationClass) -> None:
    termination = classify_termination(reason)
    assert termination.kind is kind
    assert termination.reason == reason
    assert termination.abnormal is (kind is not TerminationClass.NORMAL)


def test_the_fact_for_the_prompt_names_the_class_and_the_recorded_reason() -> None:
    fact = classify_termination("heartbeat_timeout").fact()
    assert "heartbeat_timeout" in fact and "abnormally" in fact
    assert "normally" in NORMAL.fact() and "Recorded reason" not in NORMAL.fact()


@pure
@given(st.one_of(st.none(), st.text(max_size=200)))
def test_every_reason_gets_exactly_one_class_and_never_raises(reason: str | None) -> None:
    assert classify_termination(reason).kind in set(TerminationClass)


# --- lifecycle (decision 4) --------------------------------------------------------------


@pytest.mark.parametrize(
    ("current", "target", "allowed"),
    [
        (current, target, target in HYPOTHESIS_TRANSITIONS[current])
        for current in HypothesisStatus
        for target in HypothesisStatus
    ],
)
def test_lifecycle_only_leaves_proposed(
    current: HypothesisStatus, target: HypothesisStatus, allowed: bool
) -> None:
    expected = current is HypothesisStatus.PROPOSED and target is not HypothesisStatus.PROPOSED
    assert allowed is expected
    if allowed:
        assert_hypothesis_transition(H, current, target)
        return
    with pytest.raises(DomainError) as info:
        assert_hypothesis_transition(H, current, target)
    assert info.value.code == ErrorCode.INVALID_TRANSITION
    assert str(H) in info.value.message and current.value in info.value.message


@pure
@given(st.lists(st.sampled_from(list(HypothesisStatus)), max_size=8))
def test_a_hypothesis_is_decided_at_most_once(attempts: list[HypothesisStatus]) -> None:
    status, moves = HypothesisStatus.PROPOSED, 0
    for target in attempts:
        try:
            assert_hypothesis_transition(H, status, target)
        except DomainError:
            continue
        status, moves = target, moves + 1
    assert moves <= 1
    assert status is HypothesisStatus.PROPOSED or moves == 1


# --- batch validation (decision 3) -------------------------------------------------------


def test_a_valid_batch_is_accepted_with_evidence_deduplicated() -> None:
    [valid] = validate_hypothesis_batch(
        {"hypotheses": [hypothesis(evidence_event_ids=[str(E2), str(E1), str(E2)])]},
        SESSION,
        FOUND,
        NORMAL,
    )
    assert valid.evidence_event_ids == (E2, E1)
    assert (valid.target_agent, valid.confidence) == ("criativo", 70)


@pytest.mark.parametrize(
    ("name", "batch", "code", "at", "says"),
    [
        (
            "non-existent id",
            {"hypotheses": [hypothesis(evidence_event_ids=[str(E1), str(MISSING)])]},
            ErrorCode.EVIDENCE_NOT_FOUND,
            "hypotheses[0].evidence_event_ids[1]",
            f"event {MISSING} does not exist",
        ),
        (
            "an id of another session",
            {"hypotheses": [hypothesis(evidence_event_ids=[str(E_OTHER)])]},
            ErrorCode.EVIDENCE_NOT_IN_SESSION,
            "hypotheses[0].evidence_event_ids[0]",
            f"event {E_OTHER} belongs to session {OTHER}, not to the analysed session {SESSION}",
        ),
        (
            "no evidence",
            {"hypotheses": [hypothesis(evidence_event_ids=[])]},
            ErrorCode.INVALID_HYPOTHESIS,
            "hypotheses[0].evidence_event_ids",
            "at least 1 item",
        ),
        (
            "a confidence above 100",
            {"hypotheses": [hypothesis(confidence=101)]},
            ErrorCode.INVALID_HYPOTHESIS,
            "hypotheses[0].confidence",
            "less than or equal to 100",
        ),
        (
            "a fractional confidence",
            {"hypotheses": [hypothesis(confidence=70.5)]},
            ErrorCode.INVALID_HYPOTHESIS,
            "hypotheses[0].confidence",
            "valid integer",
        ),
        (
            "a confidence as text",
            {"hypotheses": [hypothesis(confidence="70")]},
            ErrorCode.INVALID_HYPOTHESIS,
            "hypotheses[0].confidence",
            "valid integer",
        ),
        (
            "a blank statement",
            {"hypotheses": [hypothesis(statement="   ")]},
            ErrorCode.INVALID_HYPOTHESIS,
            "hypotheses[0].statement",
            "at least 1 character",
        ),
        (
            "an unknown agent",
            {"hypotheses": [hypothesis(target_agent="gardener")]},
            ErrorCode.UNKNOWN_AGENT,
            "hypotheses[0].target_agent",
            "unknown agent 'gardener'",
        ),
        (
            "no hypotheses at all",
            {"hypotheses": []},
            ErrorCode.INVALID_HYPOTHESIS,
            "hypotheses",
            "non-empty list",
        ),
        (
            "not a batch",
            {"hypothesis": hypothesis()},
            ErrorCode.INVALID_HYPOTHESIS,
            "hypotheses",
            "non-empty list",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) and " " in v else "",
)
def test_each_invalid_hypothesis_is_refused_precisely(
    name: str, batch: Any, code: ErrorCode, at: str, says: str
) -> None:
    error = refusal(batch)
    assert error.code == code
    assert f"- {at}: " in error.message and says in error.message
    assert "rejected as a whole" in error.message


def test_missing_termination_analysis_on_an_abnormal_end() -> None:
    batch = {"hypotheses": [hypothesis()]}
    error = refusal(batch, KILLED)
    assert error.code == ErrorCode.TERMINATION_ANALYSIS_REQUIRED
    assert "ended abnormally (killed)" in error.message
    # a normal close does not need it; one hypothesis carrying it is enough
    validate_hypothesis_batch(batch, SESSION, FOUND, NORMAL)
    both = {"hypotheses": [hypothesis(), hypothesis(termination_analysis="It was killed.")]}
    assert len(validate_hypothesis_batch(both, SESSION, FOUND, KILLED)) == 2
    blank = {"hypotheses": [hypothesis(termination_analysis=" ")]}
    assert refusal(blank, KILLED).code == ErrorCode.INVALID_HYPOTHESIS


def test_one_bad_hypothesis_rejects_the_batch_and_every_problem_is_listed() -> None:
    batch = {
        "hypotheses": [
            hypothesis(),
            hypothesis(evidence_event_ids=[str(E_OTHER)], confidence=-1),
            hypothesis(evidence_event_ids=[str(MISSING)]),
        ]
    }
    error = refusal(batch, classify_termination("heartbeat_timeout"))
    ats = [p["at"] for p in error.details["problems"]]
    assert ats == [
        "hypotheses[1].confidence",
        "hypotheses[2].evidence_event_ids[0]",
        "hypotheses",
    ]
    assert "The batch of 3 hypotheses was rejected" in error.message


def test_cited_event_ids_are_the_parseable_ones_once() -> None:
    batch = {
        "hypotheses": [
            hypothesis(evidence_event_ids=[str(E1), "not-an-id", str(E1)]),
            {"evidence_event_ids": str(E2)},
            "junk",
            hypothesis(evidence_event_ids=[str(E_OTHER)]),
        ]
    }
    assert cited_event_ids(batch) == [E1, E_OTHER]
    assert cited_event_ids(None) == []


EVENT_IDS = st.sampled_from([E1, E2, E_OTHER, MISSING])


@pure
@given(
    st.lists(
        st.fixed_dictionaries(
            {
                "evidence": st.lists(EVENT_IDS, min_size=1, max_size=4),
                "confidence": st.integers(min_value=-5, max_value=105),
                "analysis": st.sampled_from([None, "", "The client vanished."]),
            }
        ),
        min_size=1,
        max_size=5,
    ),
    st.sampled_from([None, "heartbeat_timeout", "SIGKILL", "ValueError: x", "gone"]),
)
def test_a_batch_is_accepted_whole_exactly_when_every_rule_holds(
    drafts: list[dict[str, Any]], reason: str | None
) -> None:
    termination = classify_termination(reason)
    batch = {
        "hypotheses": [
            hypothesis(
                evidence_event_ids=[str(e) for e in d["evidence"]],
                confidence=d["confidence"],
                **({} if d["analysis"] is None else {"termination_analysis": d["analysis"]}),
            )
            for d in drafts
        ]
    }
    every_rule_holds = (
        all(FOUND.get(e) == SESSION for d in drafts for e in d["evidence"])
        and all(0 <= d["confidence"] <= 100 for d in drafts)
        and all(d["analysis"] != "" for d in drafts)
        and (not termination.abnormal or any(d["analysis"] for d in drafts))
    )
    try:
        accepted = validate_hypothesis_batch(batch, SESSION, FOUND, termination)
    except DomainError as exc:
        assert not every_rule_holds
        assert exc.details["problems"]
        return
    assert every_rule_holds
    assert len(accepted) == len(drafts)  # all of it, never a part
    assert all(FOUND[e] == SESSION for h in accepted for e in h.evidence_event_ids)
