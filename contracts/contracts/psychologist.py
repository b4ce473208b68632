"""Commands, replies and the tool input of the `psychologist` service (ADR 0015)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal
from uuid import UUID

from pydantic import Field, StringConstraints

from contracts.common import TEXT_CHECK, Actor, AgentSlug, Int64, Message, ProjectId

HypothesisStatus = Literal["proposed", "accepted", "dismissed"]
Tier = Literal["leve", "pesada"]
TriggeredBy = Literal["auto", "manual"]
Statement = Annotated[
    str, StringConstraints(strip_whitespace=True, min_length=1, max_length=4000), TEXT_CHECK
]

# Bounds of one `emit_hypotheses` call: enough for a session's behaviour, small enough
# that resolving the evidence is one `cmd.events.get` (≤ 1,000 ids).
MAX_HYPOTHESES_PER_BATCH = 20
MAX_EVIDENCE_PER_HYPOTHESIS = 40


class ProposedHypothesis(Message):
    """One hypothesis as the model emits it with `emit_hypotheses` (before validation)."""

    target_agent: AgentSlug
    statement: Statement
    confidence: Int64 = Field(ge=0, le=100, strict=True)
    evidence_event_ids: list[UUID] = Field(min_length=1, max_length=MAX_EVIDENCE_PER_HYPOTHESIS)
    termination_analysis: Statement | None = None


class Hypothesis(Message):
    """A hypothesis as the table holds it; `current` is false once its analysis was superseded."""

    id: UUID
    analysis_id: UUID
    project_id: ProjectId
    session_id: UUID
    target_agent: AgentSlug
    statement: str
    confidence: int = Field(ge=0, le=100)
    evidence_event_ids: list[UUID]
    termination_analysis: str | None
    status: HypothesisStatus
    current: bool
    created_at: datetime
    decided_at: datetime | None = None
    decided_by: Actor | None = None


class Reanalyze(Message):
    """`cmd.psychologist.reanalyze`: analyse a closed session again (manual trigger).

    Always runs: a current analysis is superseded (never deleted) when the new one
    completes. Answered when the analysis ended, so callers wait as long as a tool loop.
    """

    project_id: ProjectId
    session_id: UUID
    # Who asked (their limits apply beside the project's); None: the session's opener.
    requested_by: Actor | None = None


class AnalysisOutcome(Message):
    """How an analysis ended: its hypotheses, or why it failed (then nothing was written)."""

    session_id: UUID
    status: Literal["completed", "failed", "already_analyzed"]
    analysis_id: UUID | None = None
    superseded_analysis_id: UUID | None = None
    tier: Tier
    agent_slug: AgentSlug
    hypotheses: list[Hypothesis] = Field(default_factory=list)
    reason: str | None = None
    iterations: int = 0
    cost_micros: int = 0


class HypothesisDecision(Message):
    """`cmd.hypotheses.accept` / `.dismiss`: decide one proposed hypothesis."""

    hypothesis_id: UUID
    actor: Actor = "system:psychologist"


class HypothesisReply(Message):
    """The hypothesis after the transition."""

    hypothesis: Hypothesis


class ListHypotheses(Message):
    """`cmd.hypotheses.list`: a project's hypotheses for the insights page."""

    project_id: ProjectId
    status: HypothesisStatus | None = None
    # Hypotheses of superseded analyses stay in the table (history); hidden by default.
    include_superseded: bool = False


class HypothesisGroup(Message):
    """The hypotheses about one agent, newest first."""

    target_agent: AgentSlug
    hypotheses: list[Hypothesis]


class HypothesesReply(Message):
    """Hypotheses grouped by target agent, agents in alphabetical order."""

    groups: list[HypothesisGroup]
