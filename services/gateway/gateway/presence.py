"""Heartbeats: a session is kept alive while at least one client follows it.

The first client to join a session starts its heartbeat; the last to leave stops it,
and the log's reaper then closes the session as `heartbeat_timeout` once its timeout
passes (ADR 0015 classifies that ending).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Awaitable, Callable

from domain.errors import DomainError
from servicekit.logs import get_logger

log = get_logger(__name__)

Beat = Callable[[uuid.UUID], Awaitable[object]]


class Presence:
    """Counts the clients of each session and runs one heartbeat loop per followed session."""

    def __init__(self, beat: Beat, interval_seconds: float) -> None:
        self._beat = beat
        self._interval = interval_seconds
        self._clients: dict[uuid.UUID, int] = {}
        self._loops: dict[uuid.UUID, asyncio.Task[None]] = {}

    def followed(self) -> set[uuid.UUID]:
        """The sessions that have a client now."""
        return set(self._clients)

    def enter(self, session_id: uuid.UUID) -> None:
        self._clients[session_id] = self._clients.get(session_id, 0) + 1
        if session_id not in self._loops:
            self._loops[session_id] = asyncio.create_task(
                self._keep_alive(session_id), name=f"heartbeat-{session_id}"
            )

    async def leave(self, session_id: uuid.UUID) -> None:
        left = self._clients.get(session_id, 0) - 1
        if left > 0:
            self._clients[session_id] = left
            return
        self._clients.pop(session_id, None)
        loop = self._loops.pop(session_id, None)
        if loop is not None:
            loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop

    async def stop(self) -> None:
        for session_id in list(self._loops):
            self._clients[session_id] = 1
            await self.leave(session_id)

    async def _keep_alive(self, session_id: uuid.UUID) -> None:
        while True:
            try:
                await self._beat(session_id)
            except DomainError as exc:
                # A closed or unknown session needs no heartbeat; anything else is retried.
                log.info("heartbeat_refused", session_id=str(session_id), code=exc.code)
                if exc.code in ("session_closed", "session_not_found"):
                    return
            # Pacing, not synchronisation: the next beat is due one interval later.
            await asyncio.sleep(self._interval)
