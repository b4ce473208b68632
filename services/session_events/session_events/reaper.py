"""Closes sessions whose heartbeats stopped, as `heartbeat_timeout` (ADR 0015 decision 6).

Only sessions that received at least one heartbeat are reaped: a session driven by
a script that never heartbeats is never timed out. Candidates are locked with
`FOR UPDATE SKIP LOCKED` and re-checked as `open` under the lock, so with several
replicas each silent session is closed exactly once.
"""

from __future__ import annotations

import asyncio

import asyncpg

from servicekit.logs import get_logger
from session_events.handlers import close_session
from session_events.repository import LogRepository

log = get_logger(__name__)

HEARTBEAT_TIMEOUT = "heartbeat_timeout"


async def reap_once(repo: LogRepository, timeout_seconds: float) -> int:
    """Close every silent session once; return how many were closed."""
    async with repo.silent_sessions(timeout_seconds) as (tx, sessions):
        for session in sessions:
            await close_session(tx, session, HEARTBEAT_TIMEOUT, None)
            log.info("session_reaped", session_id=str(session.id), project_id=session.project_id)
    return len(sessions)


async def run_reaper(repo: LogRepository, timeout_seconds: float, interval_seconds: float) -> None:
    """Reap every `interval_seconds` until cancelled; a database outage only delays it."""
    while True:
        try:
            await reap_once(repo, timeout_seconds)
        except (asyncpg.PostgresError, OSError) as exc:
            log.warning("reaper_failed", error=repr(exc))
        await asyncio.sleep(interval_seconds)
