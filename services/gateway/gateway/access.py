"""What a principal may touch: sessions of its own project only."""

from __future__ import annotations

import uuid

from contracts import subjects
from contracts.common import ErrorCode
from contracts.session_events import SessionRef, SessionView
from domain.errors import DomainError
from gateway.auth import Principal
from gateway.bus import Commands


async def own_session(
    commands: Commands, principal: Principal, session_id: uuid.UUID
) -> SessionView:
    """The session, if it belongs to the token's project; `forbidden` otherwise."""
    view = await commands(subjects.SESSIONS_GET, SessionRef(session_id=session_id), SessionView)
    if view.project_id != principal.project_id:
        raise DomainError(
            ErrorCode.FORBIDDEN,
            f"session {session_id} is not in project {principal.project_id!r}",
        )
    return view
