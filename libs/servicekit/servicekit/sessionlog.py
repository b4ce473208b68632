"""The session log as every other service asks it: one client, one page size, one
mapping of the log's refusals.

No service reads another's tables, so Criativo, handoff, the psychologist, the gateway
and the kit's own provenance check read and write the log through these commands. What
they share lives here once:
- reads of a whole session or of many ids are paged at the log's own limit
  (`EVENTS_PAGE_MAX`, from the contracts), with the longer timeout a full page needs;
  `pages()` hands them over a page at a time to a reader that sends as it reads;
- the requests and replies are the catalog's `Command`s, typed by their models, sent by
  `call` or by the service's own `Caller` (the gateway's maps silence to `unavailable`);
- a read is sent again while unanswered (`client.resent`): a replica of the log that
  dies holding a request never answers it, and the caller would wait out the whole
  timeout although the other replica could answer at once;
- the refusals a caller branches on are types: `SessionNotFound` and `SessionClosed`,
  both `DomainError`s, so a command handler that meets one replies with it unchanged.
  `session()` passes any other refusal on the same way (a handler asking "which session
  is this" answers with what the log said); the other calls raise `CommandFailed`,
  which carries the log's code, message and details as values.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from uuid import UUID

from nats.aio.client import Client

from contracts import catalog
from contracts.catalog import Command
from contracts.common import ErrorCode, Message
from contracts.events import Event, EventType
from contracts.session_events import (
    EVENTS_PAGE_MAX,
    AppendedReply,
    AppendEvent,
    CloseSession,
    GetEvents,
    HeartbeatReply,
    ListedSession,
    ListEvents,
    ListSessions,
    OpenSession,
    QueryEvents,
    SessionClosedReply,
    SessionOpenedReply,
    SessionRef,
    SessionView,
    TerminateSession,
)
from domain.errors import DomainError
from servicekit.client import Caller, CommandFailed, CRep, CReq, call, resent

# A page of `EVENTS_PAGE_MAX` events is a much larger reply than a command's usual one.
READ_TIMEOUT_SECONDS = 30.0
COMMAND_TIMEOUT_SECONDS = 5.0
# A read unanswered this long is sent again (then after twice as long): the log answers a
# read in milliseconds, a busy one in a few hundred.
RESEND_READ_AFTER_SECONDS = 2.0
# `TerminateSession.reason`'s limit: a longer reason (a crash's repr) is cut, not refused.
MAX_REASON_CHARS = 4000


class SessionNotFound(DomainError):
    """The log does not know the session (`session_not_found`)."""


class SessionClosed(DomainError):
    """The session is closed and the log refused what needs it open (`session_closed`)."""


_TYPED: dict[str, type[DomainError]] = {
    ErrorCode.SESSION_NOT_FOUND.value: SessionNotFound,
    ErrorCode.SESSION_CLOSED.value: SessionClosed,
}


def typed_refusal(failure: CommandFailed) -> DomainError | None:
    """The typed exception for a refusal callers branch on, or None for any other."""
    kind = _TYPED.get(failure.code)
    return None if kind is None else kind(failure.code, failure.message, **failure.details)


class SessionLogClient:
    """The commands of `session_events`, as the other services use them.

    `timeout` is a command's (a read of a page waits longer); `caller` sends a command,
    `call` on `nc` unless the service has its own door to the bus (the gateway's).
    """

    def __init__(
        self,
        nc: Client,
        *,
        timeout: float = COMMAND_TIMEOUT_SECONDS,
        caller: Caller | None = None,
    ) -> None:
        self._nc = nc
        self._timeout = timeout
        self._send: Caller = caller or self._request

    async def _request(self, command: Command[CReq, CRep], request: CReq, timeout: float) -> CRep:
        return await call(self._nc, command, request, timeout=timeout)

    async def _call(
        self, command: Command[CReq, CRep], request: CReq, timeout: float | None = None
    ) -> CRep:
        try:
            return await self._send(command, request, timeout or self._timeout)
        except CommandFailed as failure:
            typed = typed_refusal(failure)
            if typed is None:
                raise
            raise typed from None

    async def _read(
        self, command: Command[CReq, CRep], request: CReq, timeout: float | None = None
    ) -> CRep:
        """`_call` for a command that changes nothing, sent again while unanswered."""
        return await resent(
            lambda left: self._call(command, request, left),
            timeout=timeout or self._timeout,
            first_after=RESEND_READ_AFTER_SECONDS,
        )

    async def open(self, project_id: str, opened_by: str) -> SessionOpenedReply:
        """Open a session in a project."""
        return await self._call(
            catalog.SESSIONS_OPEN,
            OpenSession(project_id=project_id, opened_by=opened_by),
        )

    async def sessions(self, project_id: str) -> list[ListedSession]:
        """The project's sessions, newest first (as many as the log lists by default)."""
        reply = await self._read(catalog.SESSIONS_LIST, ListSessions(project_id=project_id))
        return reply.sessions

    async def heartbeat(self, session_id: UUID) -> HeartbeatReply:
        """Keep an open session alive; `SessionClosed` once it has ended."""
        return await self._call(catalog.SESSIONS_HEARTBEAT, SessionRef(session_id=session_id))

    async def session(self, session_id: UUID) -> SessionView:
        """The session's state; every refusal is raised as a `DomainError`."""
        try:
            return await self._read(catalog.SESSIONS_GET, SessionRef(session_id=session_id))
        except CommandFailed as failure:
            raise failure.refusal() from None

    async def close(self, session_id: UUID, closed_by: str | None = None) -> SessionClosedReply:
        """End the session normally; `SessionClosed` when it has already ended."""
        return await self._call(
            catalog.SESSIONS_CLOSE,
            CloseSession(session_id=session_id, closed_by=closed_by),
        )

    async def terminate(self, session_id: UUID, reason: str) -> SessionClosedReply:
        """End the session abnormally with `reason`; `SessionClosed` when it has already ended."""
        return await self._call(
            catalog.SESSIONS_TERMINATE,
            TerminateSession(session_id=session_id, reason=reason[:MAX_REASON_CHARS]),
        )

    async def append(
        self,
        session_id: UUID,
        event_type: EventType,
        actor: str,
        payload: Message,
        *,
        causation_id: UUID | None = None,
        idempotency_key: str | None = None,
    ) -> AppendedReply:
        """Append one event; a repeated idempotency key returns the event first written."""
        return await self._call(
            catalog.EVENTS_APPEND,
            AppendEvent(
                session_id=session_id,
                type=event_type.value,
                actor=actor,
                payload=payload.model_dump(mode="json"),
                causation_id=causation_id,
                idempotency_key=idempotency_key,
            ),
        )

    async def page(
        self, session_id: UUID, after_seq: int = 0, limit: int = EVENTS_PAGE_MAX
    ) -> list[Event]:
        """At most `limit` events of the session after `after_seq`, in `seq` order."""
        reply = await self._read(
            catalog.EVENTS_LIST,
            ListEvents(session_id=session_id, after_seq=after_seq, limit=limit),
            timeout=max(READ_TIMEOUT_SECONDS, self._timeout),
        )
        return reply.events

    async def pages(self, session_id: UUID, after_seq: int = 0) -> AsyncIterator[list[Event]]:
        """The session's events after `after_seq`, a page at a time, until the last page
        (a reader that sends as it reads stops when it has what it needs)."""
        while True:
            page = await self.page(session_id, after_seq)
            if page:
                yield page
            if len(page) < EVENTS_PAGE_MAX:
                return
            after_seq = page[-1].seq

    async def events(self, session_id: UUID, after_seq: int = 0) -> list[Event]:
        """Every event of the session after `after_seq`, in `seq` order, page by page."""
        return [event async for page in self.pages(session_id, after_seq) for event in page]

    async def get(
        self, event_ids: Sequence[UUID], *, timeout: float = READ_TIMEOUT_SECONDS
    ) -> list[Event]:
        """The events of these ids the log holds (unknown ids are left out), page by page."""
        events: list[Event] = []
        for start in range(0, len(event_ids), EVENTS_PAGE_MAX):
            reply = await self._read(
                catalog.EVENTS_GET,
                GetEvents(event_ids=list(event_ids[start : start + EVENTS_PAGE_MAX])),
                timeout=timeout,
            )
            events.extend(reply.events)
        return events

    async def query(self, project_id: str, types: Sequence[EventType]) -> list[Event]:
        """The project's events of these types, oldest first (the log's default limit)."""
        reply = await self._read(
            catalog.EVENTS_QUERY,
            QueryEvents(project_id=project_id, types=[t.value for t in types]),
            timeout=READ_TIMEOUT_SECONDS,
        )
        return reply.events
