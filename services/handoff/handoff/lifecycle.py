"""The handoff use cases, each inside one transaction: lock, load, decide, persist + emit.

Locks, always taken in this order so two decisions never deadlock: the session's
(activations against its closing), then the target's
(`pg_advisory_xact_lock(hashtextextended('handoff:<project>:<target>', 0))`, ADR 0182
decision 3); several targets' in sorted (project, target) order. Every status change
of a handoff happens under its target's lock. Offers are decided many to a transaction
(`offer_together`, fed by `handoff.batching`), each as if it had had its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal
from uuid import UUID, uuid4

from contracts.common import ErrorCode
from contracts.events import (
    AgentActivated,
    EventType,
    HandoffOffered,
    HandoffSuperseded,
    HandoffTransition,
)
from contracts.handoff import (
    AcceptReply,
    ActivateAgent,
    Activation,
    ActivationReply,
    AlreadyServed,
    Handoff,
    HandoffDecision,
    OfferHandoff,
    OfferMany,
    OfferManyReply,
    OfferReply,
)
from domain.errors import DomainError
from domain.handoff import (
    PendingOffer,
    Status,
    activation_refused,
    already_active,
    assert_transition,
    decide_offer,
    may_activate,
    skip_reason,
)
from handoff.repository import HandoffTransaction, NewOffer, announcement
from servicekit.outbox import Announcement

LIFECYCLE_ACTOR = "system:handoff-lifecycle"


async def offer_together(
    tx: HandoffTransaction, cmds: Sequence[OfferHandoff], wait: bool = True
) -> list[OfferReply | DomainError | None]:
    """ADR 0182 decisions 2, 4 and 7 for offers (to any targets), under one hold of their
    targets' locks: the offers to a target are decided one after another in the order
    given, each against what the ones before it left, as if each had had its own
    transaction. Every row and event is written in one statement; a refused offer is
    answered its error and changes nothing. With `wait` false the targets whose lock is
    held elsewhere are not waited for: their offers are answered None, undecided."""
    # Sorted, so two transactions take the target locks in one order.
    keys = sorted({(cmd.project_id, cmd.to_agent) for cmd in cmds})
    states = await tx.lock_targets_state(keys, wait)
    writes = _Writes()
    targets = {
        key: _Target(*key, state.active, list(state.pending), writes)
        for key, state in states.items()
        if state is not None
    }
    answers: list[_Answer | DomainError | None] = []
    for cmd in cmds:
        target = targets.get((cmd.project_id, cmd.to_agent))
        try:
            answers.append(None if target is None else _offer_one(target, cmd))
        except DomainError as refusal:
            answers.append(refusal)
    written = await writes.write(tx)
    return [a.reply(written) if isinstance(a, _Answer) else a for a in answers]


@dataclass
class _Writes:
    """What the decisions of one transaction write, in the order decided."""

    new: list[NewOffer] = field(default_factory=list)
    superseded: list[tuple[UUID, UUID]] = field(default_factory=list)  # existing rows: (id, by)
    events: list[Announcement] = field(default_factory=list)

    async def write(self, tx: HandoffTransaction) -> dict[UUID, dict[str, Any]]:
        """Write it all in one statement (nothing when nothing was decided); the new rows."""
        if not self.events:
            return {}
        return await tx.write_offers(self.new, self.superseded, self.events)


@dataclass
class _Target:
    """One target as the offers of a transaction find it and leave it: its activation and
    its pending offers (oldest first)."""

    project_id: str
    agent: str
    active: Activation | None
    pending: list[Handoff | NewOffer]
    writes: _Writes

    def create(self, session_id: UUID, from_agent: str, artifact_id: UUID | None) -> NewOffer:
        """A new offer and its `handoff.offered` (the artifact is an event of the log: the
        offer is its consequence)."""
        new = NewOffer(uuid4(), self.project_id, session_id, from_agent, self.agent, artifact_id)
        payload = HandoffOffered(
            handoff_id=new.id,
            from_agent=new.from_agent,
            to_agent=new.to_agent,
            artifact_id=new.artifact_id,
        )
        self.writes.events.append(
            announcement(
                new.session_id,
                EventType.HANDOFF_OFFERED,
                f"agent:{new.from_agent}",
                payload,
                causation_id=new.artifact_id,
            )
        )
        self.writes.new.append(new)
        self.pending.append(new)
        return new

    def supersede(self, old: Handoff | NewOffer, by: UUID) -> None:
        """ADR 0182 decision 1 for `old`, superseded by a new or kept offer."""
        self.writes.events.append(superseded_event(old, "nova_oferta", by))
        self.pending.remove(old)
        if isinstance(old, NewOffer):
            old.status, old.superseded_by = Status.SUPERSEDED.value, by
        else:
            self.writes.superseded.append((old.id, by))


@dataclass(frozen=True)
class _Answer:
    """An offer's reply, but for the rows the transaction has yet to write."""

    outcome: str
    current: Handoff | NewOffer | None
    skipped: str | None = None

    def reply(self, written: Mapping[UUID, dict[str, Any]]) -> OfferReply:
        """The reply, naming the offer as it was when this one was decided: a row written
        now is `offered`, unchanged, even if a later offer of the same write superseded it."""
        current = self.current
        if isinstance(current, NewOffer):
            row = written[current.id]
            as_decided = {"status": Status.OFFERED.value, "superseded_by": None}
            current = Handoff.model_validate(row | as_decided | {"updated_at": row["created_at"]})
        return OfferReply(handoff=current, outcome=self.outcome, skipped=self.skipped)


def _offer_one(target: _Target, cmd: OfferHandoff) -> _Answer:
    """One offer's decision against the target as the offers before it left it."""
    pending = target.pending
    if cmd.mode == "if_absent":
        reason = skip_reason(target.active is not None, bool(pending))
        if reason is not None:
            return _Answer("ja_oferecido", pending[-1] if pending else None, reason.value)
    if target.active is not None:
        raise already_active(cmd.project_id, cmd.to_agent, target.active.session_id)
    by_id = {h.id: h for h in pending}
    decision = decide_offer(
        [PendingOffer(h.id, h.session_id, h.artifact_id) for h in pending],
        cmd.session_id,
        cmd.artifact_id,
    )
    current: Handoff | NewOffer
    if decision.creates:
        current = target.create(cmd.session_id, cmd.from_agent, cmd.artifact_id)
    else:
        assert decision.kept is not None
        current = by_id[decision.kept]
    for old in decision.supersede:
        target.supersede(by_id[old], current.id)
    return _Answer(decision.outcome.value, current)


async def offer_many(tx: HandoffTransaction, cmd: OfferMany) -> OfferManyReply:
    """ADR 0182 decision 6: only the targets not yet served are offered; idempotent."""
    served: list[AlreadyServed] = []
    # Sorted, so two concurrent multi-target offers take the target locks in one order.
    ordered = sorted(cmd.targets, key=lambda t: t.to_agent)
    states = await tx.lock_targets_state([(cmd.project_id, t.to_agent) for t in ordered])
    writes = _Writes()
    targets = {
        key: _Target(*key, state.active, list(state.pending), writes)
        for key, state in states.items()
        if state is not None  # all of them: waited for
    }
    created: list[NewOffer] = []
    for offer in ordered:
        # A target named twice finds the offer made to it the first time.
        target = targets[(cmd.project_id, offer.to_agent)]
        reason = skip_reason(target.active is not None, bool(target.pending))
        if reason is not None:
            served.append(
                AlreadyServed(
                    to_agent=offer.to_agent,
                    motivo=reason.value,
                    handoff_id=target.pending[-1].id if target.pending else None,
                )
            )
            continue
        created.append(target.create(cmd.session_id, cmd.from_agent, offer.artifact_id))
    written = await writes.write(tx)
    offered = [Handoff.model_validate(written[new.id]) for new in created]
    outcome: Literal["created", "ja_oferecido"] = "created" if offered else "ja_oferecido"
    return OfferManyReply(outcome=outcome, offered=offered, jaAtendidos=served)


async def accept(tx: HandoffTransaction, cmd: HandoffDecision) -> AcceptReply:
    """Accept an offer and activate its target, superseding the target's other offers."""
    await tx.lock_session(cmd.session_id)
    if await tx.is_closed(cmd.session_id):
        raise session_closed(cmd.session_id)
    handoff = await _decide(tx, cmd, Status.ACCEPTED, EventType.HANDOFF_ACCEPTED)
    activated = await activate(
        tx,
        ActivateAgent(
            project_id=handoff.project_id,
            session_id=handoff.session_id,
            agent=handoff.to_agent,
            via="accept",
            handoff_id=handoff.id,
            actor=cmd.actor,
        ),
    )
    return AcceptReply(
        handoff=handoff, activation=activated.activation, superseded=activated.superseded
    )


async def reject(tx: HandoffTransaction, cmd: HandoffDecision) -> Handoff:
    """The target declines the offer."""
    return await _decide(tx, cmd, Status.REJECTED, EventType.HANDOFF_REJECTED)


async def complete(tx: HandoffTransaction, cmd: HandoffDecision) -> Handoff:
    """The target finished the accepted work."""
    return await _decide(tx, cmd, Status.COMPLETED, EventType.HANDOFF_COMPLETED)


async def activate(tx: HandoffTransaction, cmd: ActivateAgent) -> ActivationReply:
    """ADR 0008 decision 4 and ADR 0182 decision 5: activate, superseding pending offers."""
    await tx.lock_session(cmd.session_id)
    if await tx.is_closed(cmd.session_id):
        raise session_closed(cmd.session_id)
    await tx.lock_target(cmd.project_id, cmd.agent)
    existing = await tx.activation_in(cmd.session_id, cmd.agent)
    if existing is not None:
        return ActivationReply(activation=existing, already_active=True, superseded=[])
    if not may_activate(cmd.agent, await tx.has_accepted(cmd.session_id, cmd.agent), cmd.via):
        raise activation_refused(cmd.agent, cmd.session_id)
    by = cmd.handoff_id if cmd.via == "accept" else None
    pending = await tx.pending(cmd.project_id, cmd.agent)
    for old in pending:
        await supersede(tx, old, "agente_ativado", by)
    payload = AgentActivated(agent=cmd.agent, via=cmd.via, handoff_id=cmd.handoff_id)
    activation = await tx.insert_activation(
        cmd.project_id,
        cmd.session_id,
        cmd.agent,
        cmd.via,
        cmd.handoff_id,
        announcement(cmd.session_id, EventType.AGENT_ACTIVATED, cmd.actor, payload),
    )
    return ActivationReply(
        activation=activation, already_active=False, superseded=[h.id for h in pending]
    )


async def supersede(
    tx: HandoffTransaction,
    old: Handoff,
    motivo: Literal["agente_ativado", "nova_oferta"],
    by: UUID | None,
) -> None:
    """ADR 0182 decision 1: the row changes status; the event lands in the old offer's
    session (even a closed one), from the lifecycle itself. The `handoff.offered` event
    that announced it is never touched."""
    announce = superseded_event(old, motivo, by)
    await tx.set_status(old.id, Status.SUPERSEDED, announce, superseded_by=by)


def superseded_event(
    old: Handoff | NewOffer, motivo: Literal["agente_ativado", "nova_oferta"], by: UUID | None
) -> Announcement:
    """The `handoff.superseded` of `old`, refused when `old` may not be superseded."""
    assert_transition(old.id, Status(old.status), Status.SUPERSEDED)
    payload = HandoffSuperseded(
        handoffId=old.id, toAgent=old.to_agent, motivo=motivo, substitutaId=by
    )
    return announcement(
        old.session_id,
        EventType.HANDOFF_SUPERSEDED,
        LIFECYCLE_ACTOR,
        payload,
    )


def session_closed(session_id: UUID) -> DomainError:
    """RN-581: nothing is accepted or activated in a closed session."""
    return DomainError(
        ErrorCode.SESSION_CLOSED,
        f"session {session_id} is closed; its handoffs can no longer be accepted and no "
        "agent can be activated in it",
        session_id=str(session_id),
    )


async def _decide(
    tx: HandoffTransaction, cmd: HandoffDecision, target: Status, event_type: EventType
) -> Handoff:
    """Move one handoff to `target` under its target's lock, with its event."""
    seen = await tx.handoff(cmd.handoff_id)
    await tx.lock_target(seen.project_id, seen.to_agent)
    current = await tx.handoff(cmd.handoff_id)
    if current.session_id != cmd.session_id:
        raise DomainError(
            ErrorCode.HANDOFF_NOT_IN_SESSION,
            f"handoff {current.id} belongs to session {current.session_id}, not {cmd.session_id}",
            handoff_id=str(current.id),
        )
    assert_transition(current.id, Status(current.status), target)
    payload = HandoffTransition(handoff_id=current.id, to_agent=current.to_agent, reason=cmd.reason)
    return await tx.set_status(
        current.id,
        target,
        announcement(current.session_id, event_type, cmd.actor, payload),
    )
