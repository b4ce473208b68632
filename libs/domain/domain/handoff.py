"""Handoffs: the offer lifecycle and the agent activation rule.

ADR 0008 decisions 3-4 and ADR 0182. Invariants this module keeps, so the service
only loads, decides and persists:
- at most one `offered` handoff per (project, target): a new offer either returns
  the pending one (same session, no new artifact) or supersedes every pending one;
- an offer to an agent already active in the project is refused (`agente_ja_ativo`);
- an agent becomes active only through an accepted handoff to it in the session,
  except the agents a person starts (Criativo);
- an external handoff goes only to an area's lead or to an agent with no area
  (ADR 0038);
- a status only moves along `TRANSITIONS`; terminal statuses never move again.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from uuid import UUID

from contracts.common import ErrorCode
from domain.errors import DomainError


class Status(StrEnum):
    """Where a handoff stands."""

    OFFERED = "offered"
    ACCEPTED = "accepted"
    COMPLETED = "completed"
    REJECTED = "rejected"
    SUPERSEDED = "superseded"


# current status -> the statuses it may move to. An accepted handoff is never
# superseded: activation leaves it as it is (ADR 0182 decision 5).
TRANSITIONS: dict[Status, frozenset[Status]] = {
    Status.OFFERED: frozenset({Status.ACCEPTED, Status.REJECTED, Status.SUPERSEDED}),
    Status.ACCEPTED: frozenset({Status.COMPLETED}),
    Status.COMPLETED: frozenset(),
    Status.REJECTED: frozenset(),
    Status.SUPERSEDED: frozenset(),
}


def assert_transition(handoff_id: UUID, current: Status, target: Status) -> None:
    """Refuse a status change the table does not allow."""
    if target not in TRANSITIONS[current]:
        raise DomainError(
            ErrorCode.INVALID_TRANSITION,
            f"handoff {handoff_id} is {current.value}; it cannot become {target.value}",
            handoff_id=str(handoff_id),
            status=current.value,
            requested=target.value,
        )


class OfferOutcome(StrEnum):
    """How an offer ended (the `desfecho` of ADR 0182)."""

    CREATED = "created"
    ALREADY_OFFERED = "ja_oferecido"
    SUPERSEDED_OFFER = "substituiu_oferta"


@dataclass(frozen=True)
class PendingOffer:
    """An `offered` handoff to the same target in the same project."""

    id: UUID
    session_id: UUID
    artifact_id: UUID | None


@dataclass(frozen=True)
class OfferDecision:
    """What to write: a new row or not, which pending offer stays, which are superseded."""

    outcome: OfferOutcome
    kept: UUID | None  # the pending offer returned as is (ALREADY_OFFERED)
    supersede: tuple[UUID, ...]

    @property
    def creates(self) -> bool:
        return self.outcome is not OfferOutcome.ALREADY_OFFERED


def decide_offer(
    pending: Sequence[PendingOffer], session_id: UUID, artifact_id: UUID | None
) -> OfferDecision:
    """ADR 0182 decision 2, given the target's pending offers oldest first.

    - none pending: create;
    - one pending in the same session and no new artifact (none, or the same): return
      it, write nothing — a double click, two tabs, a repeated tool call;
    - anything else (a new artifact, or the pending one in another session): create and
      supersede, so a rewritten brief always has an offer that carries it.
    Duplicates left from before the rule (several pending) converge here: whatever is
    not kept is superseded.
    """
    if not pending:
        return OfferDecision(OfferOutcome.CREATED, None, ())
    same = [
        p
        for p in pending
        if p.session_id == session_id and (artifact_id is None or artifact_id == p.artifact_id)
    ]
    if same:
        kept = same[-1]
        return OfferDecision(
            OfferOutcome.ALREADY_OFFERED, kept.id, tuple(p.id for p in pending if p != kept)
        )
    return OfferDecision(OfferOutcome.SUPERSEDED_OFFER, None, tuple(p.id for p in pending))


class SkipReason(StrEnum):
    """Why `if_absent` / `offer_many` did not offer to a target."""

    ALREADY_OFFERED = "ja_oferecido"
    ALREADY_ACTIVE = "agente_ja_ativo"


def skip_reason(target_active: bool, has_pending: bool) -> SkipReason | None:
    """ADR 0182 decisions 6-7: a target already served is not offered again."""
    if target_active:
        return SkipReason.ALREADY_ACTIVE
    if has_pending:
        return SkipReason.ALREADY_OFFERED
    return None


def already_active(project_id: str, agent: str, session_id: UUID) -> DomainError:
    """The refusal of an offer to an active agent; a tool forwards the message to the model."""
    return DomainError(
        ErrorCode.AGENTE_JA_ATIVO,
        f"The agent '{agent}' is already active in this project (session {session_id}), so "
        "it cannot be offered a handoff. Its artifacts are in the log and it reads them "
        "there; continue the work with it, or close the session where it is active before "
        "offering it a new round.",
        project_id=project_id,
        agent=agent,
        active_session_id=str(session_id),
    )


# Started by the person's own command, not by a handoff (ADR 0008 decision 4).
USER_STARTED_AGENTS = frozenset({"criativo"})


def may_activate(agent: str, has_accepted_handoff: bool, via: str = "accept") -> bool:
    """ADR 0008 decision 4: active only through an accepted handoff to it in the session,
    except the agents the person starts. ADR 0182 decision 5's third path, the execution
    activating its `dev-<module>` sub-agents, needs none: sub-agents never receive an
    external handoff (ADR 0038)."""
    if agent in USER_STARTED_AGENTS or has_accepted_handoff:
        return True
    return via == "execution" and is_sub_agent(agent)


def activation_refused(agent: str, session_id: UUID) -> DomainError:
    """The refusal of an activation `may_activate` does not allow."""
    return DomainError(
        ErrorCode.ACTIVATION_REFUSED,
        f"agent '{agent}' has no accepted handoff in session {session_id}; an agent becomes "
        "active only by accepting one (the person starts only "
        f"{', '.join(sorted(USER_STARTED_AGENTS))})",
        agent=agent,
        session_id=str(session_id),
    )


@dataclass(frozen=True)
class Agent:
    """An agent of the catalogue: its area, and whether it leads that area."""

    slug: str
    area: str | None
    lead: bool = False


CATALOGUE: dict[str, Agent] = {
    a.slug: a
    for a in [
        Agent("criativo", None),
        Agent("psicologo", None),
        Agent("po", "produto", lead=True),
        Agent("arquiteto", "arquitetura", lead=True),
        Agent("staff", "arquitetura"),
        Agent("dev-lead", "desenvolvimento", lead=True),
        Agent("infra", "infraestrutura", lead=True),
        Agent("appsec", "seguranca", lead=True),
        Agent("qa", "qualidade", lead=True),
    ]
}
# Sub-agents per module (`dev-<module>`), all in the lead's area (ADR 0038).
_DEV_MODULE = re.compile(r"^dev-(?!lead$)[a-z0-9][a-z0-9_-]*$")


def catalogue_agent(slug: str) -> Agent:
    """The agent named `slug`, refused when the catalogue does not know it."""
    if slug in CATALOGUE:
        return CATALOGUE[slug]
    if _DEV_MODULE.match(slug):
        return Agent(slug, "desenvolvimento")
    raise DomainError(
        ErrorCode.UNKNOWN_AGENT,
        f"unknown agent '{slug}'; known agents: {', '.join(sorted(CATALOGUE))}, dev-<module>",
        agent=slug,
    )


def is_sub_agent(slug: str) -> bool:
    """A `dev-<module>` agent, which its area's execution activates (ADR 0038)."""
    return bool(_DEV_MODULE.match(slug))


def check_handoff_target(from_agent: str, to_agent: str) -> None:
    """ADR 0038: a handoff from outside an area goes only to its lead or to an agent of no area."""
    source, target = catalogue_agent(from_agent), catalogue_agent(to_agent)
    if source == target:
        raise DomainError(
            ErrorCode.TARGET_NOT_ALLOWED,
            f"'{from_agent}' cannot hand off to itself",
            from_agent=from_agent,
            to_agent=to_agent,
        )
    internal = target.area is not None and source.area == target.area
    if not (internal or target.area is None or target.lead):
        lead = next((a.slug for a in CATALOGUE.values() if a.area == target.area and a.lead), None)
        raise DomainError(
            ErrorCode.TARGET_NOT_ALLOWED,
            f"'{to_agent}' is not the lead of area '{target.area}'; a handoff from outside the "
            f"area goes to its lead{f' ({lead})' if lead else ''}",
            from_agent=from_agent,
            to_agent=to_agent,
            lead=lead,
        )
