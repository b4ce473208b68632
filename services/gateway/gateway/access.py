"""What a principal may touch: sessions of its own project only."""

from __future__ import annotations

import uuid

from contracts.common import ErrorCode
from contracts.session_events import SessionView
from domain.errors import DomainError
from gateway.auth import Principal
from servicekit.sessionlog import SessionLogClient


async def own_session(
    session_log: SessionLogClient, principal: Principal, session_id: uuid.UUID
) -> SessionView:
    """The session, if it belongs to the token's project; `forbidden` otherwise."""
    view = await session_log.session(session_id)
    if view.project_id != principal.project_id:
        raise DomainError(
            ErrorCode.FORBIDDEN,
            f"session {session_id} is not in project {principal.project_id!r}",
        )
    return view
