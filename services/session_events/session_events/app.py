"""Wiring of the session_events service: the one place its parts are put together."""

from __future__ import annotations

from servicekit.outbox import JetStreamPublisher
from servicekit.runtime import run_service
from session_events.group_commit import GroupCommit
from session_events.handlers import SERVICE, svc
from session_events.reaper import run_reaper
from session_events.repository import LogRepository
from session_events.settings import LogSettings


async def main(settings: LogSettings | None = None) -> None:
    """Serve the log's commands, relay its outbox and reap silent sessions until stopped."""
    settings = settings or LogSettings()
    async with svc.open(settings) as rt:
        relay = rt.relay(JetStreamPublisher(rt.nc))
        repo = LogRepository(rt.pool, relay.wake)
        rt.background(
            run_reaper(repo, settings.heartbeat_timeout_seconds, settings.reaper_interval_seconds),
            "reaper",
        )
        await svc.serve(rt, repo=repo, appender=GroupCommit(repo))


def run() -> None:
    """Entry point: `python -m session_events`."""
    run_service(SERVICE, main())
