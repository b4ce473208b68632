"""The handoff service's rules about what the log holds: the session must be open and of
the project, an offer's artifact must be an event of the project (artifacts are events).
The asking is the kit's `SessionLogClient`; an unknown session is its `SessionNotFound`.

What the log said of a session is remembered (`SessionMemory`), so that the offers of a
busy session do not each cost the log a `cmd.sessions.get` (bench/handoff.py: a sixth of
the log's CPU during offers). Its project never changes and a closed session never opens
again: both are kept. That it is open is trusted for `OPEN_FOR_SECONDS` only, so an offer
may be taken up to that long after the session closed, as if it had come just before
the close (its offer stays pending in a closed session, like any offer made before a
close; accepting it asks the log, RN-581, and is refused).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from uuid import UUID

from contracts.common import ErrorCode
from domain.errors import DomainError
from handoff.lifecycle import session_closed
from servicekit.sessionlog import COMMAND_TIMEOUT_SECONDS, SessionLogClient

# How long the log's "open" is trusted for an offer.
OPEN_FOR_SECONDS = 1.0
# How many sessions are remembered (the least recently asked about are forgotten).
REMEMBERED_SESSIONS = 10_000


@dataclass(frozen=True)
class Seen:
    """What the log said of a session, and when."""

    project_id: str
    open: bool
    at: float


class SessionMemory:
    """The last answer of the log per session, bounded (least recently used goes)."""

    def __init__(
        self, size: int = REMEMBERED_SESSIONS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._seen: OrderedDict[UUID, Seen] = OrderedDict()
        self._size = size
        self.clock = clock

    def fresh(self, session_id: UUID, open_for: float) -> Seen | None:
        """The remembered answer while it still holds: closed, or open for `open_for` s."""
        seen = self._seen.get(session_id)
        if seen is None or (seen.open and self.clock() - seen.at >= open_for):
            return None
        self._seen.move_to_end(session_id)
        return seen

    def remember(self, session_id: UUID, project_id: str, is_open: bool) -> None:
        self._seen[session_id] = Seen(project_id, is_open, self.clock())
        self._seen.move_to_end(session_id)
        if len(self._seen) > self._size:
            self._seen.popitem(last=False)


class SessionDirectory:
    """The log's answers, turned into this service's refusals."""

    def __init__(self, log: SessionLogClient, memory: SessionMemory | None = None) -> None:
        self._log = log
        self._memory = memory or SessionMemory()

    async def open_session(
        self, session_id: UUID, project_id: str | None = None, open_for: float = 0.0
    ) -> None:
        """Refuse a session that is unknown, closed, or of another project. With `open_for`
        (an offer), a remembered "open" younger than that many seconds is enough."""
        seen = self._memory.fresh(session_id, open_for)
        if seen is None:
            view = await self._log.session(session_id)
            seen = Seen(view.project_id, view.status == "open", 0.0)
            self._memory.remember(session_id, seen.project_id, seen.open)
        if project_id is not None and seen.project_id != project_id:
            raise DomainError(
                ErrorCode.SESSION_NOT_IN_PROJECT,
                f"session {session_id} belongs to project {seen.project_id}, not {project_id}",
                session_id=str(session_id),
            )
        if not seen.open:
            raise session_closed(session_id)

    async def require_artifact(self, artifact_id: UUID, project_id: str) -> None:
        """An offer's artifact must be an event of the project's log (artifacts are events)."""
        found = await self._log.get([artifact_id], timeout=COMMAND_TIMEOUT_SECONDS)
        if not found or found[0].project_id != project_id:
            raise DomainError(
                ErrorCode.ARTIFACT_NOT_FOUND,
                f"artifact {artifact_id} is not an event of project {project_id}",
                artifact_id=str(artifact_id),
            )
