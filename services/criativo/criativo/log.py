"""What Criativo asks of the session log: read a session's events, append, terminate."""

from __future__ import annotations

from uuid import UUID

from nats.aio.client import Client

from contracts import subjects
from contracts.common import ErrorCode, Message
from contracts.events import Event, EventType
from contracts.session_events import (
    AppendedReply,
    AppendEvent,
    EventsReply,
    ListEvents,
    SessionClosedReply,
    TerminateSession,
)
from servicekit.client import CommandFailed, call

PAGE = 1000


class SessionLog:
    """The log's commands, as Criativo uses them."""

    def __init__(self, nc: Client) -> None:
        self._nc = nc

    async def events_after(self, session_id: UUID, after_seq: int) -> list[Event]:
        """Every event of the session after `after_seq`, in `seq` order (paged)."""
        events: list[Event] = []
        while True:
            reply = await call(
                self._nc,
                subjects.EVENTS_LIST,
                ListEvents(session_id=session_id, after_seq=after_seq, limit=PAGE),
                EventsReply,
            )
            events.extend(reply.events)
            if len(reply.events) < PAGE:
                return events
            after_seq = reply.events[-1].seq

    async def append(
        self,
        session_id: UUID,
        event_type: EventType,
        actor: str,
        payload: Message,
        causation_id: UUID | None,
        idempotency_key: str,
    ) -> UUID:
        """Append one event; a repeated key returns the event first written under it."""
        reply = await call(
            self._nc,
            subjects.EVENTS_APPEND,
            AppendEvent(
                session_id=session_id,
                type=event_type.value,
                actor=actor,
                payload=payload.model_dump(mode="json"),
                causation_id=causation_id,
                idempotency_key=idempotency_key,
            ),
            AppendedReply,
        )
        return reply.event_id

    async def terminate(self, session_id: UUID, reason: str) -> None:
        """End the session abnormally with `reason`; a session already closed stays as is."""
        try:
            await call(
                self._nc,
                subjects.SESSIONS_TERMINATE,
                TerminateSession(session_id=session_id, reason=reason[:4000]),
                SessionClosedReply,
            )
        except CommandFailed as exc:
            if exc.code != ErrorCode.SESSION_CLOSED:
                raise
