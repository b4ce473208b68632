"""Messages of the `criativo` service that are not events of the log."""

from __future__ import annotations

from uuid import UUID

from pydantic import Field

from contracts.common import AgentSlug, Message
from contracts.metering import TurnId


class AgentDone(Message):
    """Published on `agent.done.<project>.<session>` when an agent's turn ends.

    Closes the deltas a client saw on `agent.delta.<project>.<session>` for the turns
    listed in `turn_ids` (one per model call of the turn, each numbering its deltas
    from 1). `response_id` is the `agent.response` event, or `error_code` says why
    there is none (an `agent.error` event then tells the person).
    """

    agent: AgentSlug
    causation_id: UUID
    turn_ids: list[TurnId] = Field(default_factory=list)
    response_id: UUID | None = None
    error_code: str | None = None
