"""Commands and replies of the `handoff` service (ADR 0008 decisions 3-4, ADR 0182)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal
from uuid import UUID

from pydantic import Field, StringConstraints

from contracts.common import TEXT_CHECK, Actor, AgentSlug, Message, ProjectId

HandoffStatus = Literal["offered", "accepted", "completed", "rejected", "superseded"]
OfferOutcome = Literal["created", "ja_oferecido", "substituiu_oferta"]
# Why a target was not offered again (ADR 0182 decisions 6-7).
SkipReason = Literal["ja_oferecido", "agente_ja_ativo"]
ActivationPath = Literal["accept", "direct", "execution", "user"]


class Handoff(Message):
    """A handoff as the table holds it now; its history is in the log's `handoff.*` events."""

    id: UUID
    project_id: ProjectId
    session_id: UUID
    from_agent: AgentSlug
    to_agent: AgentSlug
    artifact_id: UUID | None
    status: HandoffStatus
    created_at: datetime
    updated_at: datetime
    superseded_by: UUID | None


class OfferHandoff(Message):
    """`cmd.handoffs.offer`: offer work to an agent.

    `replace` (the default) follows ADR 0182 decision 2; `if_absent` offers only when
    the target has no pending offer and is not active (decision 7) and says why not.
    """

    project_id: ProjectId
    session_id: UUID
    from_agent: AgentSlug
    to_agent: AgentSlug
    artifact_id: UUID | None = None
    mode: Literal["replace", "if_absent"] = "replace"


class OfferReply(Message):
    """The offer now pending for the target, and how it came to be.

    `skipped` is set only in `if_absent` mode: nothing was written, and `handoff` is
    the offer already pending (for `ja_oferecido`) or null (for `agente_ja_ativo`).
    """

    handoff: Handoff | None
    outcome: OfferOutcome
    skipped: SkipReason | None = None


class OfferTarget(Message):
    """One target of `cmd.handoffs.offer_many`."""

    to_agent: AgentSlug
    artifact_id: UUID | None = None


class OfferMany(Message):
    """`cmd.handoffs.offer_many`: offer to several targets; only the missing ones are offered."""

    project_id: ProjectId
    session_id: UUID
    from_agent: AgentSlug
    targets: list[OfferTarget] = Field(min_length=1, max_length=16)


class AlreadyServed(Message):
    """A target that was not offered again, and why."""

    to_agent: AgentSlug
    motivo: SkipReason
    handoff_id: UUID | None = None


class OfferManyReply(Message):
    """What was offered now, and what was already served (`jaAtendidos`, ADR 0182 decision 6)."""

    outcome: Literal["created", "ja_oferecido"]
    offered: list[Handoff]
    jaAtendidos: list[AlreadyServed]


class HandoffDecision(Message):
    """`cmd.handoffs.accept` / `.reject` / `.complete`: act on one handoff."""

    handoff_id: UUID
    session_id: UUID
    actor: Actor = "system:handoff-lifecycle"
    reason: Annotated[str, StringConstraints(max_length=2000), TEXT_CHECK] | None = None


class HandoffReply(Message):
    """The handoff after the transition."""

    handoff: Handoff


class ListHandoffs(Message):
    """`cmd.handoffs.list`: a project's handoffs, optionally of one session or status."""

    project_id: ProjectId
    session_id: UUID | None = None
    status: HandoffStatus | None = None


class HandoffsReply(Message):
    """Handoffs, oldest first."""

    handoffs: list[Handoff]


class ActivateAgent(Message):
    """`cmd.agents.activate`: make an agent active in a session (ADR 0008 decision 4)."""

    project_id: ProjectId
    session_id: UUID
    agent: AgentSlug
    via: ActivationPath
    handoff_id: UUID | None = None
    actor: Actor = "system:handoff-lifecycle"


class Activation(Message):
    """An agent active in an open session of a project."""

    project_id: ProjectId
    session_id: UUID
    agent: AgentSlug
    via: ActivationPath
    handoff_id: UUID | None
    activated_at: datetime


class ActivationReply(Message):
    """The activation, whether it already existed, and the offers it superseded."""

    activation: Activation
    already_active: bool
    superseded: list[UUID]


class AcceptReply(Message):
    """The accepted handoff and the activation of its target."""

    handoff: Handoff
    activation: Activation
    superseded: list[UUID]


class ActiveAgents(Message):
    """`cmd.agents.active`: who is active in a project's open sessions."""

    project_id: ProjectId


class ActiveAgentsReply(Message):
    """The project's current activations."""

    activations: list[Activation]
