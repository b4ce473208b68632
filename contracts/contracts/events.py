"""Event types of the session log and the payload model of each.

Every event type is two tokens, `<domain>.<name>`, and is published on
`<domain>.<name>.<project_id>.<session_id>`. A new type is added here, with its
payload model, and nowhere else: the log validates, the reference (docs/reference.md)
and AsyncAPI document are generated from this module.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal
from uuid import UUID

from pydantic import AfterValidator, Field, StringConstraints

from contracts.common import (
    MAX_TEXT_CHARS,
    TEXT_CHECK,
    Actor,
    AgentSlug,
    Int64,
    Key,
    Message,
    ProjectId,
    Text,
)

NonBlank = Annotated[
    str,
    StringConstraints(strip_whitespace=True, min_length=1, max_length=MAX_TEXT_CHARS),
    TEXT_CHECK,
]


def _not_blank(text: str) -> str:
    if not text.strip():
        raise ValueError("must contain more than whitespace")
    return text


# A person's words are kept as typed (no stripping), but cannot be only whitespace.
Utterance = Annotated[
    str,
    StringConstraints(min_length=1, max_length=20_000),
    TEXT_CHECK,
    AfterValidator(_not_blank),
]


class EventType(StrEnum):
    """Every event type the log accepts (ADRs 0008, 0015, 0182)."""

    SESSION_OPENED = "session.opened"
    SESSION_CLOSED = "session.closed"
    SESSION_CLOSED_ABNORMALLY = "session.closed_abnormally"
    SESSION_FORKED = "session.forked"
    CHAT_MESSAGE = "chat.message"
    AGENT_ACTIVATED = "agent.activated"
    AGENT_RESPONSE = "agent.response"
    AGENT_ERROR = "agent.error"
    ARTIFACT_BUSINESS_RULE = "artifact.business_rule"
    ARTIFACT_BUSINESS_RULE_RETRACTED = "artifact.business_rule_retracted"
    ARTIFACT_PRODUCT_BRIEF = "artifact.product_brief"
    CRIATIVO_READINESS_CONFIRMED = "criativo.readiness_confirmed"
    HANDOFF_OFFERED = "handoff.offered"
    HANDOFF_ACCEPTED = "handoff.accepted"
    HANDOFF_REJECTED = "handoff.rejected"
    HANDOFF_COMPLETED = "handoff.completed"
    HANDOFF_SUPERSEDED = "handoff.superseded"
    HYPOTHESIS_PROPOSED = "psychologist.hypothesis_proposed"
    HYPOTHESIS_ACCEPTED = "psychologist.hypothesis_accepted"
    HYPOTHESIS_DISMISSED = "psychologist.hypothesis_dismissed"
    HYPOTHESIS_ACCEPTED_FOR_ANAMNESE = "psychologist.hypothesis_accepted_for_anamnese"
    ANALYSIS_COMPLETED = "psychologist.analysis_completed"
    ANALYSIS_FAILED = "psychologist.analysis_failed"

    @property
    def domain(self) -> str:
        """The first token: `chat`, `agent`, `artifact`, `handoff`…"""
        return self.value.split(".", 1)[0]


# The events that end a session, for every consumer that follows closings (handoff ends
# activity, the psychologist analyses, Criativo evicts its actor). A tuple, so the
# consumers' filter lists keep one order.
SESSION_CLOSINGS: tuple[EventType, ...] = (
    EventType.SESSION_CLOSED,
    EventType.SESSION_CLOSED_ABNORMALLY,
)


# --- session lifecycle (written only by session_events itself) -------------


class SessionOpened(Message):
    """A session was opened in a project."""

    opened_by: Actor


class SessionClosed(Message):
    """A session ended normally; its termination reason stays null."""

    closed_by: Actor | None = None


class SessionClosedAbnormally(Message):
    """A session ended abnormally; `reason` is kept in `sessions.termination_reason`."""

    reason: NonBlank


class SessionForked(Message):
    """A branch began: the first event of a session forked from `parent_session_id`,
    followed by the parent's events up to `at_seq` (copies, each naming its original in
    `copied_from`) and then the person's new message."""

    parent_session_id: UUID
    at_seq: Int64 = Field(ge=1)
    forked_by: Actor


# --- conversation ------------------------------------------------------------


class ChatMessage(Message):
    """What a person said in the session."""

    text: Utterance
    client_msg_id: Key | None = None


class AgentActivated(Message):
    """An agent became active in the session (ADR 0008 decision 4)."""

    agent: AgentSlug
    via: Literal["accept", "direct", "execution", "user"]
    handoff_id: UUID | None = None


class TurnUsage(Message):
    """What one model turn consumed, as metering billed it."""

    model: Key
    input_tokens: Int64 = Field(ge=0)
    output_tokens: Int64 = Field(ge=0)
    cache_creation_input_tokens: Int64 = Field(default=0, ge=0)
    cache_read_input_tokens: Int64 = Field(default=0, ge=0)
    cost_micros: Int64 = Field(ge=0)


class AgentResponse(Message):
    """An agent's whole reply to a message (its `causation_id` is that message)."""

    agent: AgentSlug
    text: Text
    turn_id: Key | None = None
    usage: TurnUsage | None = None
    # The person pressed Stop: `text` is the part written before the stream was cut.
    stopped: bool = False


class AgentError(Message):
    """A turn that could not be answered; `reason` is written for the person."""

    agent: AgentSlug
    code: Key
    reason: NonBlank


class CriativoReadinessConfirmed(Message):
    """The person clicked "I'm ready to produce" (ADR 0008 decision 5)."""


# --- artifacts (ADR 0008 decision 6: artifacts are typed events) -----------


class BusinessRule(Message):
    """A business rule the model recorded; `origin` cites the conversation it came from.

    With `replaces`, the person's correction of a rule: it stands in the named rule's
    place, which stops standing (only a person may write one; the log's rules)."""

    title: NonBlank
    statement: NonBlank
    origin: list[UUID] = Field(min_length=1, description="ids of the chat messages it rests on")
    replaces: UUID | None = Field(
        default=None, description="the rule this one corrects, which stops standing"
    )


class BusinessRuleRetracted(Message):
    """The person took a business rule back: it no longer stands (only a person may)."""

    rule_id: UUID = Field(description="the `artifact.business_rule` event taken back")
    reason: Text | None = None


class ProductBrief(Message):
    """The consolidated brief, written only after the person confirmed readiness."""

    title: NonBlank
    summary: NonBlank
    details: Text = ""
    business_rule_ids: list[UUID] = Field(default_factory=list)


# --- handoffs (ADR 0008 decision 3, ADR 0182) --------------------------------


class HandoffOffered(Message):
    """An offer of work from one agent to another."""

    handoff_id: UUID
    from_agent: AgentSlug
    to_agent: AgentSlug
    artifact_id: UUID | None = None


class HandoffTransition(Message):
    """A handoff left `offered`: accepted, rejected or completed."""

    handoff_id: UUID
    to_agent: AgentSlug
    reason: Text | None = None


class HandoffSuperseded(Message):
    """An offer stopped being current (ADR 0182 decision 1; field names as the ADR)."""

    handoffId: UUID
    toAgent: AgentSlug
    motivo: Literal["agente_ativado", "nova_oferta"]
    substitutaId: UUID | None = None


# --- psychologist (ADR 0015) -------------------------------------------------


class HypothesisProposed(Message):
    """A hypothesis about an agent's behaviour, citing events of the analysed session."""

    hypothesis_id: UUID
    analysis_id: UUID
    target_agent: AgentSlug
    statement: NonBlank
    confidence: Int64 = Field(ge=0, le=100, strict=True)
    evidence_event_ids: list[UUID] = Field(min_length=1)
    termination_analysis: Text | None = None


class HypothesisDecided(Message):
    """A hypothesis was accepted or dismissed (or forwarded to the Anamnese)."""

    hypothesis_id: UUID
    target_agent: AgentSlug
    statement: Text | None = None


class AnalysisCompleted(Message):
    """An analysis produced its hypotheses."""

    analysis_id: UUID
    tier: Literal["leve", "pesada"]
    agent_slug: AgentSlug
    hypothesis_ids: list[UUID]
    triggered_by: Literal["auto", "manual"] = "auto"
    # The classified termination reason the analysis was given as a fact (decision 6).
    termination_class: Key | None = None
    # The analysis this one replaced on a manual reanalysis (kept, no longer current).
    superseded_analysis_id: UUID | None = None


class AnalysisFailed(Message):
    """An analysis ran out of iterations or budget without valid hypotheses."""

    tier: Literal["leve", "pesada"]
    reason: NonBlank
    triggered_by: Literal["auto", "manual"] = "auto"
    agent_slug: AgentSlug | None = None
    iterations: Int64 = Field(default=0, ge=0)
    cost_micros: Int64 = Field(default=0, ge=0)


PAYLOADS: dict[EventType, type[Message]] = {
    EventType.SESSION_OPENED: SessionOpened,
    EventType.SESSION_CLOSED: SessionClosed,
    EventType.SESSION_CLOSED_ABNORMALLY: SessionClosedAbnormally,
    EventType.SESSION_FORKED: SessionForked,
    EventType.CHAT_MESSAGE: ChatMessage,
    EventType.AGENT_ACTIVATED: AgentActivated,
    EventType.AGENT_RESPONSE: AgentResponse,
    EventType.AGENT_ERROR: AgentError,
    EventType.ARTIFACT_BUSINESS_RULE: BusinessRule,
    EventType.ARTIFACT_BUSINESS_RULE_RETRACTED: BusinessRuleRetracted,
    EventType.ARTIFACT_PRODUCT_BRIEF: ProductBrief,
    EventType.CRIATIVO_READINESS_CONFIRMED: CriativoReadinessConfirmed,
    EventType.HANDOFF_OFFERED: HandoffOffered,
    EventType.HANDOFF_ACCEPTED: HandoffTransition,
    EventType.HANDOFF_REJECTED: HandoffTransition,
    EventType.HANDOFF_COMPLETED: HandoffTransition,
    EventType.HANDOFF_SUPERSEDED: HandoffSuperseded,
    EventType.HYPOTHESIS_PROPOSED: HypothesisProposed,
    EventType.HYPOTHESIS_ACCEPTED: HypothesisDecided,
    EventType.HYPOTHESIS_DISMISSED: HypothesisDecided,
    EventType.HYPOTHESIS_ACCEPTED_FOR_ANAMNESE: HypothesisDecided,
    EventType.ANALYSIS_COMPLETED: AnalysisCompleted,
    EventType.ANALYSIS_FAILED: AnalysisFailed,
}


# The payload fields that name other events. A branch's copy of an
# event names the copies, not the parent's originals, so a rule's origin or a brief's
# rules stay inside the conversation that holds them (a handoff or a hypothesis id names
# a row of its service, not an event, and is kept).
EVENT_REFERENCES: dict[EventType, tuple[str, ...]] = {
    EventType.ARTIFACT_BUSINESS_RULE: ("origin", "replaces"),
    EventType.ARTIFACT_BUSINESS_RULE_RETRACTED: ("rule_id",),
    EventType.ARTIFACT_PRODUCT_BRIEF: ("business_rule_ids",),
    EventType.HANDOFF_OFFERED: ("artifact_id",),
    EventType.HYPOTHESIS_PROPOSED: ("evidence_event_ids",),
}


class Event(Message):
    """A committed event of the log, as stored, read back and published on JetStream."""

    id: UUID
    session_id: UUID
    project_id: ProjectId
    seq: Int64 = Field(ge=1)
    type: EventType
    actor: Actor
    payload: dict[str, Any]
    causation_id: UUID | None = None
    created_at: datetime
    # In a branch's prefix: the parent's event this one copies (`session.forked`).
    copied_from: UUID | None = None
