"""Wiring of the psychologist service: the one place its parts are put together."""

from __future__ import annotations

from pydantic import Field

from contracts import streams
from contracts.events import EventType
from contracts.subjects import event_filter
from harness import MeteringClient
from psychologist.analysis import Analyst
from psychologist.handlers import CONSUMER, SERVICE, build_endpoints, session_closings
from psychologist.repository import PsychologistRepository
from servicekit.consumer import ConsumerSpec, DurableConsumer
from servicekit.outbox import LogAppender, OutboxRelay
from servicekit.runtime import open_runtime, run_service, wait_until_stopped
from servicekit.sessionlog import SessionLogClient
from servicekit.settings import ServiceSettings

SCHEMA = "psychologist"
# ADR 0015 decision 1: the original ran as a job with max_attempts 5.
MAX_DELIVER = 5


class PsychologistSettings(ServiceSettings):
    """The psychologist's own knobs (`AGENTBUS_ANALYSIS_WORKERS`, …)."""

    # Analyses run at once per replica: each worker pulls one closing at a time, so
    # nothing is over-fetched (DESIGN.md: no `max_workers` pull pool).
    analysis_workers: int = 4
    max_tokens: int = 4096
    # Redelivery delays; the first is also how long a killed replica's message waits.
    redelivery_backoff: list[float] = Field(default_factory=lambda: [3.0, 10.0, 30.0, 60.0])


def closings_spec(settings: PsychologistSettings) -> ConsumerSpec:
    return ConsumerSpec(
        durable=CONSUMER,
        stream=streams.EVENTS.name,
        filter_subjects=[
            event_filter(EventType.SESSION_CLOSED),
            event_filter(EventType.SESSION_CLOSED_ABNORMALLY),
        ],
        max_deliver=MAX_DELIVER,
        backoff=list(settings.redelivery_backoff),
        batch=1,
    )


async def main(settings: PsychologistSettings | None = None) -> None:
    """Serve the commands, relay its events to the log, analyse every closed session."""
    settings = settings or PsychologistSettings()
    async with open_runtime(SERVICE, SCHEMA, ["psychologist.migrations"], settings) as rt:
        repo = PsychologistRepository(rt.pool)
        log_ = SessionLogClient(rt.nc)
        analyst = Analyst(repo, log_, MeteringClient(rt.nc), settings.max_tokens)
        endpoints = build_endpoints(repo, log_, analyst)
        service = await endpoints.start(rt.nc, settings.endpoint_concurrency, settings.instance_id)
        relay = OutboxRelay(
            rt.pool, LogAppender(rt.nc), settings.outbox_batch, settings.outbox_poll_seconds
        )
        rt.background(relay.run(), "outbox-relay")
        spec = closings_spec(settings)
        # Created once here, so the workers below only bind to it.
        await rt.js.add_consumer(spec.stream, spec.config())
        handler = session_closings(repo, analyst, rt.nc, MAX_DELIVER, spec.backoff[0] / 3)
        for worker in range(settings.analysis_workers):
            consumer = DurableConsumer(rt.nc, rt.js, rt.pool, spec, handler)
            rt.background(consumer.run(), f"session-closings-{worker}")
        try:
            await wait_until_stopped(rt)
        finally:
            await service.stop()
            await endpoints.drain()


def run() -> None:
    """Entry point: `python -m psychologist`."""
    run_service(SERVICE, main())
