"""The handoff service's rules about what the log holds: the session must be open and of
the project, an offer's artifact must be an event of the project (artifacts are events).
The asking is the kit's `SessionLogClient`; an unknown session is its `SessionNotFound`."""

from __future__ import annotations

from uuid import UUID

from contracts.common import ErrorCode
from contracts.session_events import SessionView
from domain.errors import DomainError
from handoff.lifecycle import session_closed
from servicekit.sessionlog import COMMAND_TIMEOUT_SECONDS, SessionLogClient


class SessionDirectory:
    """The log's answers, turned into this service's refusals."""

    def __init__(self, log: SessionLogClient) -> None:
        self._log = log

    async def open_session(self, session_id: UUID, project_id: str | None = None) -> SessionView:
        """The session, refused when unknown, closed, or of another project."""
        view = await self._log.session(session_id)
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
        found = await self._log.get([artifact_id], timeout=COMMAND_TIMEOUT_SECONDS)
        if not found or found[0].project_id != project_id:
            raise DomainError(
                ErrorCode.ARTIFACT_NOT_FOUND,
                f"artifact {artifact_id} is not an event of project {project_id}",
                artifact_id=str(artifact_id),
            )
