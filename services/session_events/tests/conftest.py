"""Fixtures: the log service running in-process against this test's real servers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest_asyncio
from nats.aio.client import Client

from contracts import subjects
from contracts.session_events import OpenSession, SessionOpenedReply
from servicekit.client import call
from session_events.app import main
from session_events.settings import LogSettings
from testkit.services import running_service


@pytest_asyncio.fixture(loop_scope="session")
async def log_service(nats_url: str, database_url: str, nc: Client) -> AsyncIterator[LogSettings]:
    """The session_events service, in this process, ready to answer."""
    settings = LogSettings(
        nats_url=nats_url,
        database_url=database_url,
        heartbeat_timeout_seconds=1.0,
        reaper_interval_seconds=0.2,
        outbox_poll_seconds=0.2,
    )
    async with running_service(main(settings), nc, "session_events"):
        yield settings


@pytest_asyncio.fixture(loop_scope="session")
async def open_session(nc: Client, log_service: LogSettings) -> Callable[..., Awaitable[Any]]:
    """Open a session in a project; returns the reply."""

    async def opener(project_id: str = "proj-1", opened_by: str = "user:ana") -> SessionOpenedReply:
        return await call(
            nc,
            subjects.SESSIONS_OPEN,
            OpenSession(project_id=project_id, opened_by=opened_by),
            SessionOpenedReply,
        )

    return opener
