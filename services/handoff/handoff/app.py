"""Wiring of the handoff service: the one place its parts are put together."""

from __future__ import annotations

from contracts import streams
from contracts.events import EventType
from contracts.subjects import event_filter
from handoff.directory import SessionDirectory
from handoff.handlers import CONSUMER, SERVICE, build_endpoints, session_closings
from handoff.repository import HandoffRepository
from servicekit.consumer import ConsumerSpec, DurableConsumer
from servicekit.outbox import LogAppender, OutboxRelay
from servicekit.runtime import open_runtime, run_service, wait_until_stopped
from servicekit.sessionlog import SessionLogClient
from servicekit.settings import ServiceSettings

SCHEMA = "handoff"
CLOSINGS = ConsumerSpec(
    durable=CONSUMER,
    stream=streams.EVENTS.name,
    filter_subjects=[
        event_filter(EventType.SESSION_CLOSED),
        event_filter(EventType.SESSION_CLOSED_ABNORMALLY),
    ],
)


async def main(settings: ServiceSettings | None = None) -> None:
    """Serve the handoff commands, relay its events to the log, follow session closings."""
    settings = settings or ServiceSettings()
    async with open_runtime(SERVICE, SCHEMA, ["handoff.migrations"], settings) as rt:
        repo = HandoffRepository(rt.pool)
        endpoints = build_endpoints(repo, SessionDirectory(SessionLogClient(rt.nc)))
        service = await endpoints.start(rt.nc, settings.endpoint_concurrency, settings.instance_id)
        relay = OutboxRelay(
            rt.pool, LogAppender(rt.nc), settings.outbox_batch, settings.outbox_poll_seconds
        )
        rt.background(relay.run(), "outbox-relay")
        closings = DurableConsumer(rt.nc, rt.js, rt.pool, CLOSINGS, session_closings(repo, rt.nc))
        rt.background(closings.run(), "session-closings")
        try:
            await wait_until_stopped(rt)
        finally:
            await service.stop()
            await endpoints.drain()


def run() -> None:
    """Entry point: `python -m handoff`."""
    run_service(SERVICE, main())
