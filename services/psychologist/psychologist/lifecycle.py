"""Deciding a hypothesis (ADR 0015 decision 4): the row moves, the event is written.

Everything announced goes through the outbox, `hypothesis_accepted_for_anamnese`
included. ADR 0015 sent that one outside the outbox because its worker had no consumer
to name; here the log is the truth (docs/architecture.md) and the relay needs no
consumer, so this is a deliberate deviation: the event is never lost between the commit
and the append.
"""

from __future__ import annotations

from contracts.events import EventType, HypothesisDecided
from contracts.psychologist import Hypothesis, HypothesisDecision
from domain.psychologist import HypothesisStatus, assert_hypothesis_transition
from psychologist.repository import PsychologistTransaction

EVENTS: dict[HypothesisStatus, list[EventType]] = {
    # The Anamnese's event is its own type, not a flag in the payload, so a future
    # consumer filters on the subject alone (ADR 0015, consequences).
    HypothesisStatus.ACCEPTED: [
        EventType.HYPOTHESIS_ACCEPTED,
        EventType.HYPOTHESIS_ACCEPTED_FOR_ANAMNESE,
    ],
    HypothesisStatus.DISMISSED: [EventType.HYPOTHESIS_DISMISSED],
}


async def decide(
    tx: PsychologistTransaction, cmd: HypothesisDecision, target: HypothesisStatus
) -> Hypothesis:
    """Move a proposed hypothesis to `target` (row locked: two decisions never both win)."""
    current = await tx.hypothesis(cmd.hypothesis_id, for_update=True)
    assert_hypothesis_transition(current.id, HypothesisStatus(current.status), target)
    updated = await tx.set_status(current.id, target, cmd.actor)
    for event_type in EVENTS[target]:
        payload = HypothesisDecided(
            hypothesis_id=updated.id,
            target_agent=updated.target_agent,
            statement=updated.statement,
        )
        await tx.emit(
            updated.session_id,
            event_type,
            cmd.actor,
            payload.model_dump(mode="json"),
            f"psychologist:{updated.id}:{event_type.value}",
        )
    return updated
