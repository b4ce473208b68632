"""What the psychologist asks the session log: the session, its events, the evidence's
owners and the project's business rules. No service reads another's tables."""

from __future__ import annotations

from collections.abc import Sequence
from uuid import UUID

from nats.aio.client import Client

from contracts import subjects
from contracts.common import ErrorCode
from contracts.events import Event, EventType
from contracts.session_events import (
    EventsReply,
    GetEvents,
    ListEvents,
    QueryEvents,
    SessionRef,
    SessionView,
)
from domain.errors import DomainError
from domain.log_rules import session_not_found
from servicekit.client import CommandFailed, call

PAGE = 1000  # the log's largest page (`cmd.events.list` and `cmd.events.get`)
# Reads of whole pages are larger than a command's usual reply.
READ_TIMEOUT_SECONDS = 30.0


class SessionLog:
    """The log's answers, turned into this service's refusals."""

    def __init__(self, nc: Client) -> None:
        self._nc = nc

    async def session(self, session_id: UUID) -> SessionView:
        try:
            return await call(
                self._nc, subjects.SESSIONS_GET, SessionRef(session_id=session_id), SessionView
            )
        except CommandFailed as exc:
            if exc.code == ErrorCode.SESSION_NOT_FOUND:
                raise session_not_found(session_id) from None
            raise DomainError(exc.code, exc.message, **exc.details) from None

    async def events(self, session_id: UUID) -> list[Event]:
        """The whole log of the session, in `seq` order, page by page."""
        events: list[Event] = []
        while True:
            reply = await call(
                self._nc,
                subjects.EVENTS_LIST,
                ListEvents(session_id=session_id, after_seq=len(events), limit=PAGE),
                EventsReply,
                timeout=READ_TIMEOUT_SECONDS,
            )
            events.extend(reply.events)
            if len(reply.events) < PAGE:
                return events

    async def owners(self, event_ids: Sequence[UUID]) -> dict[UUID, UUID]:
        """The session of each event id the log knows; unknown ids are absent."""
        found: dict[UUID, UUID] = {}
        for start in range(0, len(event_ids), PAGE):
            reply = await call(
                self._nc,
                subjects.EVENTS_GET,
                GetEvents(event_ids=list(event_ids[start : start + PAGE])),
                EventsReply,
                timeout=READ_TIMEOUT_SECONDS,
            )
            found.update({e.id: e.session_id for e in reply.events})
        return found

    async def business_rules(self, project_id: str) -> list[Event]:
        """The project's `artifact.business_rule` events, oldest first."""
        reply = await call(
            self._nc,
            subjects.EVENTS_QUERY,
            QueryEvents(project_id=project_id, types=[EventType.ARTIFACT_BUSINESS_RULE.value]),
            EventsReply,
            timeout=READ_TIMEOUT_SECONDS,
        )
        return reply.events
