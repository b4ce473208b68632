"""The handoff rules: `domain.handoff`, called directly, table by table.

ADR 0008 decisions 3-4 (the handoff table, the activation rule) and ADR 0182 (one
pending offer per target, `superseded`, `agente_ja_ativo`, activation supersedes),
with ADR 0038 for the catalogue. The last section drives a pure model of the
service's use cases with random operations and checks the ADR invariants after
every step.
"""

from __future__ import annotations

import itertools
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from contracts import handoff as wire
from contracts.common import ErrorCode
from contracts.events import EventType
from domain.errors import DomainError
from domain.handoff import (
    CATALOGUE,
    TRANSITIONS,
    USER_STARTED_AGENTS,
    OfferDecision,
    OfferOutcome,
    PendingOffer,
    SkipReason,
    Status,
    activation_refused,
    already_active,
    assert_transition,
    catalogue_agent,
    check_handoff_target,
    decide_offer,
    may_activate,
    skip_reason,
)

PROJECT = "p-receitas"
S1 = UUID("00000000-0000-4000-8000-000000000001")
S2 = UUID("00000000-0000-4000-8000-000000000002")
X = UUID("00000000-0000-4000-8000-0000000000a1")  # an artifact (e.g. a product brief)
Y = UUID("00000000-0000-4000-8000-0000000000a2")  # another one (the brief rewritten)
H1 = UUID("00000000-0000-4000-8000-000000000011")
H2 = UUID("00000000-0000-4000-8000-000000000012")
H3 = UUID("00000000-0000-4000-8000-000000000013")

# Hypothesis would otherwise write its example database into the working tree.
pure = settings(database=None, deadline=None)


def refusal(call: Callable[..., object], *args: Any, **kwargs: Any) -> DomainError:
    """The DomainError `call` raises; fails the test when it returns instead."""
    with pytest.raises(DomainError) as info:
        call(*args, **kwargs)
    return info.value


# --- the enums are the wire's ----------------------------------------------------------


@pytest.mark.parametrize(
    ("enum", "literal"),
    [
        (Status, wire.HandoffStatus),
        (OfferOutcome, wire.OfferOutcome),
        (SkipReason, wire.SkipReason),
    ],
    ids=["status", "outcome", "skip-reason"],
)
def test_domain_enums_spell_the_contract_literals(enum: type[Any], literal: Any) -> None:
    assert {member.value for member in enum} == set(typing.get_args(literal))


def test_outcomes_keep_the_adr_words_on_the_wire() -> None:
    # StrEnum members are these strings on the wire (compared by value for mypy).
    assert OfferOutcome.ALREADY_OFFERED.value == "ja_oferecido"
    assert OfferOutcome.SUPERSEDED_OFFER.value == "substituiu_oferta"
    assert SkipReason.ALREADY_OFFERED.value == "ja_oferecido"
    assert SkipReason.ALREADY_ACTIVE.value == "agente_ja_ativo" == ErrorCode.AGENTE_JA_ATIVO.value


# --- decide_offer (ADR 0182 decision 2) ----------------------------------------------------


@dataclass(frozen=True)
class OfferCase:
    """The target's pending offers (oldest first), a new offer, and the decision expected."""

    id: str
    pending: list[PendingOffer]
    session: UUID
    artifact: UUID | None
    outcome: OfferOutcome
    kept: UUID | None
    supersede: tuple[UUID, ...]


C, A, S = OfferOutcome.CREATED, OfferOutcome.ALREADY_OFFERED, OfferOutcome.SUPERSEDED_OFFER
P = PendingOffer
# One case per row reads better than one argument per line.
# fmt: off
OFFER_CASES = [
    OfferCase("none-pending", [], S1, None, C, None, ()),
    OfferCase("none-pending-with-artifact", [], S1, X, C, None, ()),
    # Same session, nothing new: a double click, two tabs, a repeated tool call.
    OfferCase("same-session-both-without-artifact", [P(H1, S1, None)], S1, None, A, H1, ()),
    OfferCase("same-session-new-offer-without-artifact", [P(H1, S1, X)], S1, None, A, H1, ()),
    OfferCase("same-session-same-artifact", [P(H1, S1, X)], S1, X, A, H1, ()),
    # A new artifact: the rewritten brief needs an offer that carries it.
    OfferCase("same-session-new-artifact", [P(H1, S1, X)], S1, Y, S, None, (H1,)),
    OfferCase("same-session-pending-without-artifact-new-one-with", [P(H1, S1, None)], S1, X,
              S, None, (H1,)),
    # Another session: the requester must have something to accept where it is.
    OfferCase("other-session-both-without-artifact", [P(H1, S2, None)], S1, None,
              S, None, (H1,)),
    OfferCase("other-session-same-artifact", [P(H1, S2, X)], S1, X, S, None, (H1,)),
    OfferCase("other-session-new-offer-without-artifact", [P(H1, S2, X)], S1, None,
              S, None, (H1,)),
    OfferCase("other-session-new-artifact", [P(H1, S2, X)], S1, Y, S, None, (H1,)),
    # Duplicates from before the rule converge on the next offer.
    OfferCase("duplicates-latest-match-kept", [P(H1, S1, X), P(H2, S2, None), P(H3, S1, X)],
              S1, X, A, H3, (H1, H2)),
    OfferCase("duplicates-without-artifact-latest-same-session-kept",
              [P(H1, S1, X), P(H2, S1, Y), P(H3, S2, None)], S1, None, A, H2, (H1, H3)),
    OfferCase("duplicates-only-the-matching-artifact-kept", [P(H1, S1, X), P(H2, S1, Y)],
              S1, X, A, H1, (H2,)),
    OfferCase("duplicates-all-in-another-session", [P(H1, S2, X), P(H2, S2, X)], S1, X,
              S, None, (H1, H2)),
    OfferCase("duplicates-same-session-none-matching", [P(H1, S1, X), P(H2, S1, None)], S1, Y,
              S, None, (H1, H2)),
]
# fmt: on


@pytest.mark.parametrize("case", OFFER_CASES, ids=lambda case: case.id)
def test_decide_offer(case: OfferCase) -> None:
    decision = decide_offer(case.pending, case.session, case.artifact)

    assert decision == OfferDecision(case.outcome, case.kept, case.supersede)
    # ja_oferecido writes no row; the other two write exactly one.
    assert decision.creates is (case.outcome is not OfferOutcome.ALREADY_OFFERED)


pending_offers = st.lists(
    st.builds(
        PendingOffer,
        id=st.uuids(),
        session_id=st.sampled_from([S1, S2]),
        artifact_id=st.sampled_from([None, X, Y]),
    ),
    max_size=6,
    unique_by=lambda p: p.id,
)


@pure
@given(
    pending=pending_offers,
    session=st.sampled_from([S1, S2]),
    artifact=st.sampled_from([None, X, Y]),
)
def test_decide_offer_leaves_exactly_one_offer_pending(
    pending: list[PendingOffer], session: UUID, artifact: UUID | None
) -> None:
    decision = decide_offer(pending, session, artifact)

    ids = [p.id for p in pending]
    matches = [p for p in pending if p.session_id == session and artifact in (None, p.artifact_id)]
    # Whatever is not kept is superseded, in the order given, each once.
    assert list(decision.supersede) == [i for i in ids if i != decision.kept]
    if not pending:
        assert decision.outcome is OfferOutcome.CREATED
    elif matches:
        assert decision.outcome is OfferOutcome.ALREADY_OFFERED
        assert decision.kept == matches[-1].id
    else:
        assert decision.outcome is OfferOutcome.SUPERSEDED_OFFER
    assert (decision.kept is None) == decision.creates


# --- status transitions (ADR 0008 decision 3, ADR 0182 decisions 1 and 5) --------------------

ALLOWED = {
    (Status.OFFERED, Status.ACCEPTED),
    (Status.OFFERED, Status.REJECTED),
    (Status.OFFERED, Status.SUPERSEDED),
    (Status.ACCEPTED, Status.COMPLETED),
}
TERMINAL = [Status.COMPLETED, Status.REJECTED, Status.SUPERSEDED]


def test_transitions_table_is_exactly_the_allowed_moves() -> None:
    assert set(TRANSITIONS) == set(Status)
    assert {(a, b) for a, targets in TRANSITIONS.items() for b in targets} == ALLOWED


@pytest.mark.parametrize(
    ("current", "target"),
    list(itertools.product(Status, Status)),
    ids=lambda s: s.value,
)
def test_assert_transition(current: Status, target: Status) -> None:
    if (current, target) in ALLOWED:
        assert_transition(H1, current, target)  # allowed: no DomainError
        return
    error = refusal(assert_transition, H1, current, target)

    assert error.code == ErrorCode.INVALID_TRANSITION
    assert error.details == {
        "handoff_id": str(H1),
        "status": current.value,
        "requested": target.value,
    }
    assert str(H1) in error.message
    assert f"is {current.value}" in error.message
    assert f"become {target.value}" in error.message


@pytest.mark.parametrize("status", TERMINAL, ids=str)
def test_terminal_status_has_no_way_out(status: Status) -> None:
    assert TRANSITIONS[status] == frozenset()


def test_accepted_is_never_superseded() -> None:
    # Activation supersedes the target's pending offers, never the accepted one.
    error = refusal(assert_transition, H1, Status.ACCEPTED, Status.SUPERSEDED)

    assert error.code == ErrorCode.INVALID_TRANSITION


# --- the activation rule (ADR 0008 decision 4) ------------------------------------------------


def test_only_criativo_is_started_by_the_person() -> None:
    assert frozenset({"criativo"}) == USER_STARTED_AGENTS


@pytest.mark.parametrize("has_accepted_handoff", [False, True], ids=["no-handoff", "handoff"])
def test_criativo_may_always_be_activated(has_accepted_handoff: bool) -> None:
    assert may_activate("criativo", has_accepted_handoff) is True


@pytest.mark.parametrize("agent", sorted(set(CATALOGUE) - {"criativo"}), ids=str)
@pytest.mark.parametrize("has_accepted_handoff", [False, True], ids=["no-handoff", "handoff"])
def test_other_agents_need_an_accepted_handoff(agent: str, has_accepted_handoff: bool) -> None:
    assert may_activate(agent, has_accepted_handoff) is has_accepted_handoff


def test_activation_refused_names_the_agent_and_the_rule() -> None:
    error = activation_refused("po", S1)

    assert error.code == ErrorCode.ACTIVATION_REFUSED
    assert error.details == {"agent": "po", "session_id": str(S1)}
    assert "'po'" in error.message
    assert str(S1) in error.message
    assert "accepted handoff" in error.message
    assert "criativo" in error.message


def test_execution_activates_a_dev_module_without_a_handoff() -> None:
    """ADR 0182 decision 5's third path: the execution activates its sub-agents."""
    allow: Callable[..., bool] = may_activate
    assert allow("dev-auth", False, via="execution") is True
    # The path is no loophole: the person still cannot start anyone but Criativo.
    assert allow("po", False, via="execution") is False
    assert allow("dev-auth", False, via="user") is False


# --- skip reasons and agente_ja_ativo (ADR 0182 decisions 4, 6 and 7) ---------------------------


@pytest.mark.parametrize(
    ("active", "pending", "expected"),
    [
        pytest.param(False, False, None, id="neither"),
        pytest.param(False, True, SkipReason.ALREADY_OFFERED, id="pending"),
        pytest.param(True, False, SkipReason.ALREADY_ACTIVE, id="active"),
        pytest.param(True, True, SkipReason.ALREADY_ACTIVE, id="active-wins-over-pending"),
    ],
)
def test_skip_reason(active: bool, pending: bool, expected: SkipReason | None) -> None:
    assert skip_reason(active, pending) is expected


@pytest.mark.parametrize("agent", ["po", "dev-lead", "criativo"], ids=str)
def test_already_active_tells_the_model_what_to_do_instead(agent: str) -> None:
    error = already_active(PROJECT, agent, S2)

    assert error.code == ErrorCode.AGENTE_JA_ATIVO
    assert error.details == {"project_id": PROJECT, "agent": agent, "active_session_id": str(S2)}
    # The tool forwards this text as is: the model must learn who, why and what next.
    assert f"'{agent}'" in error.message
    assert "already active" in error.message
    assert str(S2) in error.message
    assert "continue the work with it" in error.message
    assert "close the session" in error.message


# --- the catalogue and ADR 0038 -----------------------------------------------------------------


@pytest.mark.parametrize(
    "slug",
    ["ghost", "PO", "po ", "", "dev", "dev-", "dev-Auth", "dev--auth", "dev-auth!", "lead"],
    ids=repr,
)
def test_unknown_agent_is_refused_listing_the_known_ones(slug: str) -> None:
    error = refusal(catalogue_agent, slug)

    assert error.code == ErrorCode.UNKNOWN_AGENT
    assert error.details == {"agent": slug}
    assert f"'{slug}'" in error.message
    for known in CATALOGUE:
        assert known in error.message
    assert "dev-<module>" in error.message


@pytest.mark.parametrize("slug", ["dev-auth", "dev-billing", "dev-2fa", "dev-pay_v2"], ids=str)
def test_dev_module_is_a_sub_agent_of_the_development_area(slug: str) -> None:
    agent = catalogue_agent(slug)

    assert (agent.slug, agent.area, agent.lead) == (slug, "desenvolvimento", False)


def test_dev_lead_leads_the_development_area() -> None:
    agent = catalogue_agent("dev-lead")

    assert (agent.slug, agent.area, agent.lead) == ("dev-lead", "desenvolvimento", True)


@pytest.mark.parametrize("slug", sorted(CATALOGUE), ids=str)
def test_catalogue_agent_returns_the_catalogue_entry(slug: str) -> None:
    assert catalogue_agent(slug) is CATALOGUE[slug]


def test_every_area_has_exactly_one_lead() -> None:
    areas = {a.area for a in CATALOGUE.values() if a.area is not None}
    for area in areas:
        leads = [a.slug for a in CATALOGUE.values() if a.area == area and a.lead]
        assert len(leads) == 1, (area, leads)
    assert all(not a.lead for a in CATALOGUE.values() if a.area is None)


@pytest.mark.parametrize(
    ("source", "target", "lead"),
    [
        ("criativo", "staff", "arquiteto"),
        ("criativo", "dev-auth", "dev-lead"),
        ("po", "staff", "arquiteto"),
        ("arquiteto", "dev-auth", "dev-lead"),
        ("dev-auth", "staff", "arquiteto"),
        ("qa", "dev-billing", "dev-lead"),
        ("psicologo", "dev-auth", "dev-lead"),
        ("infra", "staff", "arquiteto"),
    ],
    ids=lambda v: v,
)
def test_external_handoff_to_a_non_lead_is_refused_naming_the_lead(
    source: str, target: str, lead: str
) -> None:
    error = refusal(check_handoff_target, source, target)

    assert error.code == ErrorCode.TARGET_NOT_ALLOWED
    assert error.details == {"from_agent": source, "to_agent": target, "lead": lead}
    assert f"'{target}'" in error.message
    assert f"({lead})" in error.message


@pytest.mark.parametrize("agent", ["criativo", "po", "dev-auth"])
def test_an_agent_cannot_hand_off_to_itself(agent: str) -> None:
    error = refusal(check_handoff_target, agent, agent)
    assert error.code == ErrorCode.TARGET_NOT_ALLOWED
    assert "itself" in error.message


@pytest.mark.parametrize(
    ("source", "target"),
    [
        # external, to a lead
        ("criativo", "po"),
        ("criativo", "arquiteto"),
        ("po", "dev-lead"),
        ("arquiteto", "infra"),
        ("arquiteto", "dev-lead"),
        ("appsec", "arquiteto"),
        ("appsec", "dev-lead"),
        ("appsec", "infra"),
        ("dev-auth", "qa"),
        # external, to an agent with no area
        ("po", "criativo"),
        ("criativo", "psicologo"),
        # internal, within one area
        ("dev-lead", "dev-auth"),
        ("dev-auth", "dev-billing"),
        ("dev-auth", "dev-lead"),
        ("arquiteto", "staff"),
        ("staff", "arquiteto"),
    ],
    ids=lambda v: v,
)
def test_allowed_handoff_targets(source: str, target: str) -> None:
    check_handoff_target(source, target)  # allowed: no DomainError


@pytest.mark.parametrize(
    ("source", "target"), [("ghost", "po"), ("criativo", "ghost")], ids=["source", "target"]
)
def test_handoff_between_unknown_agents_is_refused(source: str, target: str) -> None:
    error = refusal(check_handoff_target, source, target)

    assert error.code == ErrorCode.UNKNOWN_AGENT
    assert error.details == {"agent": "ghost"}


# --- a pure model of the lifecycle ---------------------------------------------------------------
#
# The model applies the domain exactly as the handoff service must: refuse an offer to an
# active agent, `decide_offer` over the target's offered rows oldest first, create or keep,
# supersede; accept moves to accepted and activates, which supersedes the target's other
# offers; a direct activation needs `may_activate`; a close ends the session's activations.
# Rows change status only through `_set_status` (the table); events are emitted by each use
# case, as the service does, so a missing or repeated event shows in the invariants.

TARGETS = ["po", "arquiteto", "dev-lead", "criativo"]
ARTIFACTS = [None, X, Y]
STATUS_OF_EVENT = {
    EventType.HANDOFF_OFFERED: Status.OFFERED,
    EventType.HANDOFF_ACCEPTED: Status.ACCEPTED,
    EventType.HANDOFF_REJECTED: Status.REJECTED,
    EventType.HANDOFF_COMPLETED: Status.COMPLETED,
    EventType.HANDOFF_SUPERSEDED: Status.SUPERSEDED,
}


@dataclass
class Row:
    """A row of the `handoffs` table; `history` is every status it has held."""

    id: UUID
    session: UUID
    target: str
    artifact: UUID | None
    status: Status = Status.OFFERED
    history: list[Status] = field(default_factory=lambda: [Status.OFFERED])


@dataclass(frozen=True)
class Event:
    """An event of the log, as much of it as the invariants read."""

    type: EventType
    session: UUID
    handoff_id: UUID | None = None
    agent: str | None = None
    motivo: str | None = None
    by: UUID | None = None


def _uuid(n: int) -> UUID:
    return UUID(int=(0x1 << 120) | n)


class HandoffLifecycle(RuleBasedStateMachine):
    """One project: its handoff rows, its sessions, its active agents and its log."""

    def __init__(self) -> None:
        super().__init__()
        self.ids = itertools.count(1)
        self.rows: list[Row] = []  # oldest first, as `pending` orders them
        self.sessions = [_uuid(next(self.ids)) for _ in range(3)]
        self.closed: set[UUID] = set()
        self.active: set[tuple[str, UUID]] = set()  # (agent, session)
        self.events: list[Event] = []
        # Targets left with duplicate offers by data from before the rule, until an offer
        # or an activation makes them converge (ADR 0182 decision 3).
        self.legacy: set[str] = set()

    # -- helpers ---------------------------------------------------------------------------

    def _row(self, handoff_id: UUID) -> Row:
        return next(r for r in self.rows if r.id == handoff_id)

    def _offered(self, target: str) -> list[Row]:
        return [r for r in self.rows if r.target == target and r.status is Status.OFFERED]

    def _open(self, pick: int) -> UUID | None:
        open_ = [s for s in self.sessions if s not in self.closed]
        return open_[pick % len(open_)] if open_ else None

    def _active_session(self, agent: str) -> UUID | None:
        return next((s for a, s in sorted(self.active, key=str) if a == agent), None)

    def _insert(self, session: UUID, target: str, artifact: UUID | None) -> Row:
        row = Row(_uuid(next(self.ids)), session, target, artifact)
        self.rows.append(row)
        return row

    def _set_status(self, row: Row, status: Status) -> None:
        assert_transition(row.id, row.status, status)
        row.status = status
        row.history.append(status)

    def _supersede(self, row: Row, motivo: str, by: UUID | None) -> None:
        self._set_status(row, Status.SUPERSEDED)
        # In the old offer's session, even a closed one (ADR 0182 decision 1).
        self.events.append(
            Event(EventType.HANDOFF_SUPERSEDED, row.session, row.id, row.target, motivo, by)
        )

    def _activate(self, agent: str, session: UUID, by: UUID | None) -> None:
        if (agent, session) in self.active:
            return
        has_accepted = any(
            r.session == session
            and r.target == agent
            and r.status in (Status.ACCEPTED, Status.COMPLETED)
            for r in self.rows
        )
        if not may_activate(agent, has_accepted):
            raise activation_refused(agent, session)
        for row in self._offered(agent):
            self._supersede(row, "agente_ativado", by)
        self.active.add((agent, session))
        self.events.append(Event(EventType.AGENT_ACTIVATED, session, by, agent))
        self.legacy.discard(agent)

    # -- rules -----------------------------------------------------------------------------

    @initialize(
        legacy=st.lists(
            st.tuples(st.sampled_from(TARGETS), st.integers(0, 2), st.sampled_from(ARTIFACTS)),
            max_size=5,
        )
    )
    def seed_legacy_duplicates(self, legacy: list[tuple[str, int, UUID | None]]) -> None:
        for target, s, artifact in legacy:
            row = self._insert(self.sessions[s], target, artifact)
            self.events.append(Event(EventType.HANDOFF_OFFERED, row.session, row.id, target))
        self.legacy = {t for t in TARGETS if len(self._offered(t)) > 1}

    @rule(
        to_agent=st.sampled_from(TARGETS),
        pick=st.integers(0, 9),
        artifact=st.sampled_from(ARTIFACTS),
    )
    def offer(self, to_agent: str, pick: int, artifact: UUID | None) -> None:
        target, session = to_agent, self._open(pick)
        if session is None:
            return
        check_handoff_target("po" if target == "criativo" else "criativo", target)
        active_in = self._active_session(target)
        if active_in is not None:
            # Refused before any decision: no row and no event (ADR 0182 decision 4).
            assert already_active(PROJECT, target, active_in).code == ErrorCode.AGENTE_JA_ATIVO
            return
        pending = self._offered(target)
        decision = decide_offer(
            [PendingOffer(r.id, r.session, r.artifact) for r in pending], session, artifact
        )
        if decision.creates:
            current = self._insert(session, target, artifact)
            self.events.append(Event(EventType.HANDOFF_OFFERED, session, current.id, target))
        else:
            assert decision.kept is not None
            current = self._row(decision.kept)
            assert current in pending
        for old in decision.supersede:
            self._supersede(self._row(old), "nova_oferta", current.id)
        self.legacy.discard(target)
        assert self._offered(target) == [current]

    @rule(pick=st.integers(0, 99))
    def accept(self, pick: int) -> None:
        # RN-581: nothing is accepted in a closed session.
        candidates = [
            r for r in self.rows if r.status is Status.OFFERED and r.session not in self.closed
        ]
        if not candidates:
            return
        row = candidates[pick % len(candidates)]
        self._set_status(row, Status.ACCEPTED)
        self.events.append(Event(EventType.HANDOFF_ACCEPTED, row.session, row.id, row.target))
        self._activate(row.target, row.session, row.id)

    @rule(pick=st.integers(0, 99))
    def reject(self, pick: int) -> None:
        candidates = [r for r in self.rows if r.status is Status.OFFERED]
        if candidates:
            row = candidates[pick % len(candidates)]
            self._set_status(row, Status.REJECTED)
            self.events.append(Event(EventType.HANDOFF_REJECTED, row.session, row.id, row.target))

    @rule(pick=st.integers(0, 99))
    def complete(self, pick: int) -> None:
        candidates = [r for r in self.rows if r.status is Status.ACCEPTED]
        if candidates:
            row = candidates[pick % len(candidates)]
            self._set_status(row, Status.COMPLETED)
            self.events.append(Event(EventType.HANDOFF_COMPLETED, row.session, row.id, row.target))

    @rule(pick=st.integers(0, 9))
    def activate_criativo(self, pick: int) -> None:
        session = self._open(pick)
        if session is not None:
            self._activate("criativo", session, None)

    @rule(agent=st.sampled_from([t for t in TARGETS if t != "criativo"]), pick=st.integers(0, 9))
    def activate_directly(self, agent: str, pick: int) -> None:
        session = self._open(pick)
        if session is None or (agent, session) in self.active:
            return
        before = (len(self.events), [r.status for r in self.rows])
        # An accepted handoff activates at once, so an open session without the agent
        # active holds none: the direct path is refused and changes nothing.
        error = refusal(self._activate, agent, session, None)
        assert error.code == ErrorCode.ACTIVATION_REFUSED
        assert (len(self.events), [r.status for r in self.rows]) == before

    @rule(pick=st.integers(0, 99), status=st.sampled_from(list(Status)))
    def illegal_move(self, pick: int, status: Status) -> None:
        if not self.rows:
            return
        row = self.rows[pick % len(self.rows)]
        if status in TRANSITIONS[row.status]:
            return
        error = refusal(self._set_status, row, status)
        assert error.code == ErrorCode.INVALID_TRANSITION
        assert row.history[-1] is row.status

    @rule(pick=st.integers(0, 9))
    def close(self, pick: int) -> None:
        session = self._open(pick)
        if session is None:
            return
        self.closed.add(session)
        self.events.append(Event(EventType.SESSION_CLOSED, session))
        self.active = {(a, s) for a, s in self.active if s != session}

    @precondition(lambda self: len(self.sessions) < 6)
    @rule()
    def open_session(self) -> None:
        self.sessions.append(_uuid(next(self.ids)))

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def at_most_one_offer_per_target(self) -> None:
        for target in set(TARGETS) - self.legacy:
            assert len(self._offered(target)) <= 1, target

    @invariant()
    def no_offer_pending_for_an_active_agent(self) -> None:
        for agent, _ in self.active:
            assert self._offered(agent) == [], agent

    @invariant()
    def statuses_move_only_along_transitions(self) -> None:
        for row in self.rows:
            assert row.history[0] is Status.OFFERED
            assert row.history[-1] is row.status
            for a, b in itertools.pairwise(row.history):
                assert (a, b) in ALLOWED, (row.id, a, b)

    @invariant()
    def every_status_change_is_one_event(self) -> None:
        for row in self.rows:
            changes = [
                STATUS_OF_EVENT[e.type]
                for e in self.events
                if e.handoff_id == row.id and e.type in STATUS_OF_EVENT
            ]
            assert changes == row.history, row.id
            assert all(e.session == row.session for e in self.events if e.handoff_id == row.id)
        activations = [(e.agent, e.session) for e in self.events if e.type == "agent.activated"]
        assert len(activations) == len(set(activations))

    @invariant()
    def the_log_replays_to_the_state(self) -> None:
        statuses: dict[UUID, Status] = {}
        active: set[tuple[str | None, UUID]] = set()
        for e in self.events:
            if e.type in STATUS_OF_EVENT:
                assert e.handoff_id is not None
                statuses[e.handoff_id] = STATUS_OF_EVENT[e.type]
            elif e.type == EventType.AGENT_ACTIVATED:
                active.add((e.agent, e.session))
            elif e.type == EventType.SESSION_CLOSED:
                active = {(a, s) for a, s in active if s != e.session}
        assert statuses == {r.id: r.status for r in self.rows}
        assert active == self.active

    @invariant()
    def a_superseded_offer_names_its_replacement(self) -> None:
        for e in self.events:
            if e.type != EventType.HANDOFF_SUPERSEDED:
                continue
            old = self._row(e.handoff_id) if e.handoff_id else None
            assert old is not None
            if e.motivo == "nova_oferta":
                assert e.by is not None
                assert self._row(e.by).target == old.target
            else:
                assert e.motivo == "agente_ativado"
                # By the accepted handoff, or by a direct activation (no handoff).
                assert e.by is None or self._row(e.by).history[:2] == [
                    Status.OFFERED,
                    Status.ACCEPTED,
                ]


HandoffLifecycle.TestCase.settings = settings(
    pure, max_examples=150, stateful_step_count=30, deadline=None
)
TestHandoffLifecycle = HandoffLifecycle.TestCase
