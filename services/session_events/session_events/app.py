"""Wiring of the session_events service: the one place its parts are put together."""

from __future__ import annotations

from servicekit.outbox import JetStreamPublisher, OutboxRelay
from servicekit.runtime import open_runtime, run_service, wait_until_stopped
from servicekit.settings import ServiceSettings
from session_events.handlers import SERVICE, build_endpoints
from session_events.reaper import run_reaper
from session_events.repository import LogRepository

SCHEMA = "session_events"


class LogSettings(ServiceSettings):
    """The log's own knobs (`AGENTBUS_HEARTBEAT_TIMEOUT_SECONDS`, …)."""

    heartbeat_timeout_seconds: float = 60.0
    reaper_interval_seconds: float = 5.0


async def main(settings: LogSettings | None = None) -> None:
    """Serve the log's commands, relay its outbox and reap silent sessions until stopped."""
    settings = settings or LogSettings()
    async with open_runtime(SERVICE, SCHEMA, ["session_events.migrations"], settings) as rt:
        repo = LogRepository(rt.pool)
        endpoints = build_endpoints(repo)
        service = await endpoints.start(rt.nc, settings.endpoint_concurrency, settings.instance_id)
        relay = OutboxRelay(
            rt.pool, JetStreamPublisher(rt.js), settings.outbox_batch, settings.outbox_poll_seconds
        )
        rt.background(relay.run(), "outbox-relay")
        rt.background(
            run_reaper(repo, settings.heartbeat_timeout_seconds, settings.reaper_interval_seconds),
            "reaper",
        )
        try:
            await wait_until_stopped(rt)
        finally:
            await service.stop()
            await endpoints.drain()


def run() -> None:
    """Entry point: `python -m session_events`."""
    run_service(SERVICE, main())
