"""The Psicólogo's rules: triage, the termination classifier, batch validation, lifecycle.

ADR 0015 decisions 3, 4, 6 and 7. Invariants this module keeps, so the service only
loads, decides and persists:
- triage depends on the event count alone: fewer than `LIGHT_BELOW_EVENTS` events is
  the light tier, anything else the heavy one; a tier names an agent slug, never a
  model (metering's bindings choose the model);
- the termination reason is classified by pattern, never by a model: the first row of
  `TERMINATION_PATTERNS` that matches decides, and a reason no row matches is
  `unclassified`, never an error;
- a batch of hypotheses is accepted whole or not at all: one invalid hypothesis
  rejects the batch, and the refusal lists every problem (the model corrects them all
  in its next iteration);
- every evidence id of an accepted hypothesis is an event of the analysed session;
- a session that ended abnormally gets at least one hypothesis with a
  `termination_analysis`;
- a hypothesis leaves `proposed` once, to `accepted` or `dismissed`, and never moves
  again (a second accept loses the race instead of accepting twice).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any
from uuid import UUID

from pydantic import ValidationError

from contracts.common import ErrorCode
from contracts.psychologist import MAX_HYPOTHESES_PER_BATCH, ProposedHypothesis
from domain.errors import DomainError
from domain.handoff import catalogue_agent

# --- triage (decision 7) ---------------------------------------------------------------


class Tier(StrEnum):
    """How much analysis a session gets (the names are the wire's)."""

    LEVE = "leve"
    PESADA = "pesada"


@dataclass(frozen=True)
class TriagePlan:
    """What a tier spends: the agent slug metering binds to a model, iterations, budget."""

    tier: Tier
    agent_slug: str
    max_iterations: int
    budget_micros: int


# Below this many events a session is usually someone who opened it and exchanged two
# messages: not enough behavioural signal to justify a strong model.
LIGHT_BELOW_EVENTS = 20

TIERS: dict[Tier, TriagePlan] = {
    Tier.LEVE: TriagePlan(Tier.LEVE, "psicologo-leve", max_iterations=4, budget_micros=50_000),
    Tier.PESADA: TriagePlan(Tier.PESADA, "psicologo", max_iterations=8, budget_micros=300_000),
}


def triage(event_count: int) -> TriagePlan:
    """The tier of a session of `event_count` events (decision 7)."""
    if event_count < 0:
        raise ValueError("an event count is never negative")
    return TIERS[Tier.LEVE if event_count < LIGHT_BELOW_EVENTS else Tier.PESADA]


# --- termination classifier (decision 6) -----------------------------------------------


class TerminationClass(StrEnum):
    """Why a session ended, as a deterministic class of `sessions.termination_reason`."""

    NORMAL = "normal"
    HEARTBEAT_TIMEOUT = "heartbeat_timeout"
    KILLED = "killed"
    EXCEPTION = "exception"
    UNCLASSIFIED = "unclassified"


# First match wins, so the specific rows come first: a reason naming a signal is a
# kill even when it also says "error". Matched case-insensitively against the reason.
TERMINATION_PATTERNS: tuple[tuple[re.Pattern[str], TerminationClass], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE), kind)
    for pattern, kind in [
        (r"^\s*(normal|closed|shutdown)?\s*$", TerminationClass.NORMAL),
        (r"^\s*heartbeat[_ ]timeout\b", TerminationClass.HEARTBEAT_TIMEOUT),
        (
            r"\bSIG(KILL|TERM|INT|HUP|QUIT|ABRT|SEGV)\b|\bkill(ed)?\b|\bsignal\s+\d+\b"
            r"|\bexit(ed)?\s+(code|status)\s+(137|143)\b|\boom[-_ ]?kill",
            TerminationClass.KILLED,
        ),
        (
            r"\b[A-Z]?\w*(Error|Exception)\b|\btraceback\b|^\s*\*\*\s*\(|\bpanic\b"
            r"|\bexception\b|\bcrash(ed)?\b",
            TerminationClass.EXCEPTION,
        ),
    ]
)

FACTS: dict[TerminationClass, str] = {
    TerminationClass.NORMAL: "The session was closed normally (no termination reason).",
    TerminationClass.HEARTBEAT_TIMEOUT: (
        "The session ended abnormally: its client stopped sending heartbeats "
        "(heartbeat_timeout), so the platform closed it."
    ),
    TerminationClass.KILLED: "The session ended abnormally: the process running it was killed.",
    TerminationClass.EXCEPTION: "The session ended abnormally: an exception ended it.",
    TerminationClass.UNCLASSIFIED: (
        "The session ended abnormally for a reason no known pattern describes."
    ),
}


@dataclass(frozen=True)
class Termination:
    """A classified termination: the class, and the reason as the log kept it."""

    kind: TerminationClass
    reason: str | None

    @property
    def abnormal(self) -> bool:
        """Whether the hypotheses must analyse the ending (decision 3)."""
        return self.kind is not TerminationClass.NORMAL

    def fact(self) -> str:
        """The classification as a fact for the prompt: the model analyses its consequences."""
        text = FACTS[self.kind]
        return text if self.reason is None else f"{text} Recorded reason: {self.reason!r}."


def classify_termination(reason: str | None) -> Termination:
    """Classify `sessions.termination_reason` (null is a normal close) by `TERMINATION_PATTERNS`."""
    for pattern, kind in TERMINATION_PATTERNS:
        if pattern.search(reason or ""):
            return Termination(kind, reason)
    return Termination(TerminationClass.UNCLASSIFIED, reason)


# --- lifecycle (decision 4) --------------------------------------------------------------


class HypothesisStatus(StrEnum):
    """Where a hypothesis stands (the names are the wire's)."""

    PROPOSED = "proposed"
    ACCEPTED = "accepted"
    DISMISSED = "dismissed"


# Only `proposed` may be left: deciding twice (two clicks, two reviewers) is refused.
HYPOTHESIS_TRANSITIONS: dict[HypothesisStatus, frozenset[HypothesisStatus]] = {
    HypothesisStatus.PROPOSED: frozenset({HypothesisStatus.ACCEPTED, HypothesisStatus.DISMISSED}),
    HypothesisStatus.ACCEPTED: frozenset(),
    HypothesisStatus.DISMISSED: frozenset(),
}


def assert_hypothesis_transition(
    hypothesis_id: UUID, current: HypothesisStatus, target: HypothesisStatus
) -> None:
    """Refuse a status change `HYPOTHESIS_TRANSITIONS` does not allow."""
    if target not in HYPOTHESIS_TRANSITIONS[current]:
        raise DomainError(
            ErrorCode.INVALID_TRANSITION,
            f"hypothesis {hypothesis_id} is {current.value}; only a proposed hypothesis can "
            f"become {target.value}",
            hypothesis_id=str(hypothesis_id),
            status=current.value,
            requested=target.value,
        )


# --- batch validation (decision 3) -----------------------------------------------------


@dataclass(frozen=True)
class ValidHypothesis:
    """A hypothesis of an accepted batch, evidence deduplicated in the order cited."""

    target_agent: str
    statement: str
    confidence: int
    evidence_event_ids: tuple[UUID, ...]
    termination_analysis: str | None


@dataclass(frozen=True)
class Problem:
    """One reason a batch was rejected: a code, where in the batch, and what to do."""

    code: ErrorCode
    at: str
    message: str


def cited_event_ids(batch: Any) -> list[UUID]:
    """Every evidence id of `batch` that parses as a UUID, once: what the service looks up."""
    seen: dict[UUID, None] = {}
    items = batch.get("hypotheses") if isinstance(batch, Mapping) else None
    for item in items if isinstance(items, list) else []:
        ids = item.get("evidence_event_ids") if isinstance(item, Mapping) else None
        for raw in ids if isinstance(ids, list) else []:
            try:
                seen.setdefault(UUID(str(raw)), None)
            except ValueError:
                continue
    return list(seen)


def _shape_problems(index: int, exc: ValidationError) -> list[Problem]:
    problems = []
    for error in exc.errors(include_url=False, include_input=False):
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error["loc"])
        problems.append(
            Problem(ErrorCode.INVALID_HYPOTHESIS, f"hypotheses[{index}]{path}", error["msg"])
        )
    return problems


def _evidence_problems(
    index: int, draft: ProposedHypothesis, session_id: UUID, found: Mapping[UUID, UUID]
) -> list[Problem]:
    problems = []
    for position, event_id in enumerate(draft.evidence_event_ids):
        at = f"hypotheses[{index}].evidence_event_ids[{position}]"
        owner = found.get(event_id)
        if owner is None:
            problems.append(
                Problem(
                    ErrorCode.EVIDENCE_NOT_FOUND,
                    at,
                    f"event {event_id} does not exist; cite only ids shown in the session log",
                )
            )
        elif owner != session_id:
            problems.append(
                Problem(
                    ErrorCode.EVIDENCE_NOT_IN_SESSION,
                    at,
                    f"event {event_id} belongs to session {owner}, not to the analysed session "
                    f"{session_id}; cite only events of the analysed session's log",
                )
            )
    return problems


def _agent_problems(index: int, draft: ProposedHypothesis) -> list[Problem]:
    try:
        catalogue_agent(draft.target_agent)
    except DomainError as exc:
        return [Problem(ErrorCode.UNKNOWN_AGENT, f"hypotheses[{index}].target_agent", exc.message)]
    return []


def validate_hypothesis_batch(
    batch: Any, session_id: UUID, found: Mapping[UUID, UUID], termination: Termination
) -> tuple[ValidHypothesis, ...]:
    """Accept the whole `emit_hypotheses` input or refuse it, listing every problem.

    `found` maps each cited event id the log knows to its session id (ids absent from it
    do not exist). The refusal's message goes back to the model verbatim.
    """
    items = batch.get("hypotheses") if isinstance(batch, Mapping) else None
    if not isinstance(items, list) or not items:
        raise _rejected(
            [
                Problem(
                    ErrorCode.INVALID_HYPOTHESIS,
                    "hypotheses",
                    "expected a non-empty list of hypotheses",
                )
            ],
            0,
        )
    problems: list[Problem] = []
    if len(items) > MAX_HYPOTHESES_PER_BATCH:
        problems.append(
            Problem(
                ErrorCode.INVALID_HYPOTHESIS,
                "hypotheses",
                f"{len(items)} hypotheses; at most {MAX_HYPOTHESES_PER_BATCH} per batch",
            )
        )
    drafts: list[ProposedHypothesis] = []
    for index, item in enumerate(items):
        try:
            draft = ProposedHypothesis.model_validate(item)
        except ValidationError as exc:
            problems.extend(_shape_problems(index, exc))
            continue
        problems.extend(_agent_problems(index, draft))
        problems.extend(_evidence_problems(index, draft, session_id, found))
        drafts.append(draft)
    analysed_ending = any(
        isinstance(item, Mapping)
        and isinstance(item.get("termination_analysis"), str)
        and item["termination_analysis"].strip()
        for item in items
    )
    if termination.abnormal and not analysed_ending:
        problems.append(
            Problem(
                ErrorCode.TERMINATION_ANALYSIS_REQUIRED,
                "hypotheses",
                f"the session ended abnormally ({termination.kind.value}); at least one "
                "hypothesis must carry a termination_analysis explaining how the agents' "
                "behaviour relates to that ending",
            )
        )
    if problems:
        raise _rejected(problems, len(items))
    return tuple(
        ValidHypothesis(
            target_agent=d.target_agent,
            statement=d.statement,
            confidence=d.confidence,
            evidence_event_ids=tuple(dict.fromkeys(d.evidence_event_ids)),
            termination_analysis=d.termination_analysis,
        )
        for d in drafts
    )


def _rejected(problems: list[Problem], size: int) -> DomainError:
    """One refusal for the whole batch: nothing of it was recorded (decision 3)."""
    lines = "\n".join(f"- {p.at}: {p.message}" for p in problems)
    return DomainError(
        problems[0].code,
        f"The batch of {size} hypotheses was rejected as a whole; none of it was recorded. "
        f"Fix every problem below and call emit_hypotheses again with the complete batch:\n"
        f"{lines}",
        problems=[{"code": p.code.value, "at": p.at, "message": p.message} for p in problems],
    )
