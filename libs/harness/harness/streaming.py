"""A streaming turn for conversational agents (ADR 0008 decision 2): deltas go to the
session's `agent.delta.<project>.<session>` as the model writes, the whole message
comes back to the agent."""

from __future__ import annotations

from uuid import UUID

from contracts import subjects
from contracts.metering import ChatMessage, LlmStream, ToolSpec, TurnReply
from harness.client import MeteringClient


async def stream_turn(
    client: MeteringClient,
    *,
    run_id: str,
    turn_id: str,
    agent_slug: str,
    project_id: str,
    session_id: UUID,
    system: str,
    messages: list[ChatMessage],
    max_tokens: int,
    tools: list[ToolSpec] | None = None,
    budget_micros: int | None = None,
    delta_subject: str | None = None,
    causation_id: UUID | None = None,
) -> TurnReply:
    """Run one metered streaming turn; deltas go to the session's delta subject by default.

    A turn stopped with `MeteringClient.cancel` is not an error: its reply comes back
    as metering sent it, `stop_reason == "cancelled"` and the text written until then."""
    cmd = LlmStream(
        causation_id=causation_id,
        run_id=run_id,
        turn_id=turn_id,
        agent_slug=agent_slug,
        project_id=project_id,
        session_id=session_id,
        system=system,
        messages=messages,
        tools=tools or [],
        max_tokens=max_tokens,
        budget_micros=budget_micros,
        delta_subject=delta_subject or subjects.delta_subject(project_id, session_id),
    )
    return await client.stream(cmd)
