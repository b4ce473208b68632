"""What the handoff service asks the session log: is this session open, is this artifact real."""

from __future__ import annotations

from uuid import UUID

from nats.aio.client import Client

from contracts import subjects
from contracts.common import ErrorCode
from contracts.session_events import EventsReply, GetEvents, SessionRef, SessionView
from domain.errors import DomainError
from domain.log_rules import session_not_found
from handoff.lifecycle import session_closed
from servicekit.client import CommandFailed, call


class SessionDirectory:
    """The log's answers, turned into this service's refusals."""

    def __init__(self, nc: Client) -> None:
        self._nc = nc

    async def open_session(self, session_id: UUID, project_id: str | None = None) -> SessionView:
        """The session, refused when unknown, closed, or of another project."""
        try:
            view = await call(
                self._nc, subjects.SESSIONS_GET, SessionRef(session_id=session_id), SessionView
            )
        except CommandFailed as exc:
            if exc.code == ErrorCode.SESSION_NOT_FOUND:
                raise session_not_found(session_id) from None
            raise DomainError(exc.code, exc.message, **exc.details) from None
        if project_id is not None and view.project_id != project_id:
            raise DomainError(
                ErrorCode.SESSION_NOT_IN_PROJECT,
                f"session {session_id} belongs to project {view.project_id}, not {project_id}",
                session_id=str(session_id),
            )
        if view.status != "open":
            raise session_closed(session_id)
        return view

    async def require_artifact(self, artifact_id: UUID, project_id: str) -> None:
        """An offer's artifact must be an event of the project's log (artifacts are events)."""
        reply = await call(
            self._nc, subjects.EVENTS_GET, GetEvents(event_ids=[artifact_id]), EventsReply
        )
        if not reply.events or reply.events[0].project_id != project_id:
            raise DomainError(
                ErrorCode.ARTIFACT_NOT_FOUND,
                f"artifact {artifact_id} is not an event of project {project_id}",
                artifact_id=str(artifact_id),
            )
