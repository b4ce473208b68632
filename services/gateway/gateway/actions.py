"""What each client frame does: one command each, in the joined session, as the person.

Thin on purpose: the rules (who may start which agent, what a closed session accepts,
the brief's causation) live in the services that own them; the gateway only says who
is asking and in which session.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel

from contracts import catalog
from contracts.common import Message
from contracts.events import (
    BusinessRule,
    BusinessRuleRetracted,
    ChatMessage,
    CriativoReadinessConfirmed,
    EventType,
)
from contracts.gateway import (
    AcceptHandoff,
    Chat,
    CloseSessionFrame,
    ConfirmReadiness,
    CorrectRule,
    Heartbeat,
    RejectHandoff,
    RetractRule,
    StartAgent,
    StopTurn,
)
from contracts.handoff import (
    AcceptReply,
    ActivateAgent,
    ActivationReply,
    HandoffDecision,
    HandoffReply,
)
from contracts.metering import CancelReply, CancelTurn
from contracts.session_events import AppendedReply, HeartbeatReply, SessionClosedReply
from gateway.auth import Principal
from gateway.bus import Commands
from servicekit.provenance import Confirmations
from servicekit.sessionlog import SessionLogClient


class SessionActions:
    """The frames that act on the joined session, for one principal."""

    def __init__(
        self,
        commands: Commands,
        session_log: SessionLogClient,
        confirmations: Confirmations,
        principal: Principal,
        session_id: uuid.UUID,
    ) -> None:
        self._c = commands
        self._log = session_log
        self._confirmations = confirmations
        self._p = principal
        self._s = session_id

    def handler(self, frame: BaseModel) -> Callable[[], Awaitable[BaseModel]]:
        """The coroutine function that carries `frame` out."""
        table: dict[type[BaseModel], Callable[[Any], Awaitable[BaseModel]]] = {
            Chat: self.chat,
            StartAgent: self.start_agent,
            ConfirmReadiness: self.confirm_readiness,
            AcceptHandoff: self.accept_handoff,
            RejectHandoff: self.reject_handoff,
            CloseSessionFrame: self.close,
            Heartbeat: self.heartbeat,
            StopTurn: self.stop_turn,
            RetractRule: self.retract_rule,
            CorrectRule: self.correct_rule,
        }
        act = table[type(frame)]
        return lambda: act(frame)

    async def _append(
        self, event_type: EventType, payload: Message, idempotency_key: str | None = None
    ) -> AppendedReply:
        """Append as the person; the log's reply confirms the event's copy on the bus, so
        its followers (and the deltas of its answer) do not wait for a read of the log."""
        actor = self._p.actor
        return await self._confirmations.own_append(
            self._log.append(self._s, event_type, actor, payload, idempotency_key=idempotency_key),
            project_id=self._p.project_id,
            session_id=self._s,
            event_type=event_type,
            actor=actor,
            payload=payload,
        )

    async def chat(self, frame: Chat) -> AppendedReply:
        return await self._append(
            EventType.CHAT_MESSAGE,
            ChatMessage(text=frame.text, client_msg_id=frame.client_msg_id),
            # a resend after a reconnect appends nothing new
            idempotency_key=f"gateway-chat:{self._s}:{frame.client_msg_id}",
        )

    async def start_agent(self, frame: StartAgent) -> ActivationReply:
        return await self._c(
            catalog.AGENTS_ACTIVATE,
            ActivateAgent(
                project_id=self._p.project_id,
                session_id=self._s,
                agent=frame.agent,
                via="user",
                actor=self._p.actor,
            ),
        )

    async def confirm_readiness(self, frame: ConfirmReadiness) -> AppendedReply:
        key = frame.client_msg_id
        return await self._append(
            EventType.CRIATIVO_READINESS_CONFIRMED,
            CriativoReadinessConfirmed(),
            # as a chat's: a resend after a reconnect appends nothing new
            idempotency_key=None if key is None else f"gateway-ready:{self._s}:{key}",
        )

    # Retracting and correcting are the person's events like a message: whether the rule
    # is of the project and still stands is the log's to say (`rule_not_found`,
    # `rule_not_standing`), and its refusal goes back to the page as it is.
    async def retract_rule(self, frame: RetractRule) -> AppendedReply:
        return await self._append(
            EventType.ARTIFACT_BUSINESS_RULE_RETRACTED,
            BusinessRuleRetracted(rule_id=frame.rule_id, reason=frame.reason),
        )

    async def correct_rule(self, frame: CorrectRule) -> AppendedReply:
        return await self._append(
            EventType.ARTIFACT_BUSINESS_RULE,
            BusinessRule(
                title=frame.title,
                statement=frame.statement,
                origin=frame.origin,
                replaces=frame.rule_id,
            ),
        )

    async def accept_handoff(self, frame: AcceptHandoff) -> AcceptReply:
        return await self._c(
            catalog.HANDOFFS_ACCEPT,
            HandoffDecision(handoff_id=frame.handoff_id, session_id=self._s, actor=self._p.actor),
        )

    async def reject_handoff(self, frame: RejectHandoff) -> HandoffReply:
        return await self._c(
            catalog.HANDOFFS_REJECT,
            HandoffDecision(handoff_id=frame.handoff_id, session_id=self._s, actor=self._p.actor),
        )

    async def close(self, _: CloseSessionFrame) -> SessionClosedReply:
        return await self._log.close(self._s, self._p.actor)

    async def heartbeat(self, _: Heartbeat) -> HeartbeatReply:
        return await self._log.heartbeat(self._s)

    async def stop_turn(self, frame: StopTurn) -> CancelReply:
        # Scoped to the joined session: metering never touches a turn of another one.
        return await self._c(
            catalog.LLM_CANCEL,
            CancelTurn(turn_id=frame.turn_id, project_id=self._p.project_id, session_id=self._s),
        )
