"""Wiring of the criativo service: the one place its parts are put together."""

from __future__ import annotations

from pydantic import Field

from contracts import streams
from contracts.events import EventType
from contracts.subjects import event_filter
from criativo.actors import Actors
from criativo.consumer import SessionInputs
from criativo.handlers import CONSUMER, SessionWork
from criativo.lease import SessionLeases
from criativo.offers import OfferSender
from criativo.turns import Turns
from harness import MeteringClient
from servicekit.consumer import ConsumerSpec
from servicekit.endpoint import Endpoints
from servicekit.outbox import OutboxRelay
from servicekit.runtime import open_runtime, run_service, wait_until_stopped
from servicekit.sessionlog import SessionLogClient
from servicekit.settings import ServiceSettings

SERVICE = "criativo"
VERSION = "0.1.0"
# Criativo keeps no state of its own (DESIGN.md); its schema holds only servicekit's
# tables: the offers' outbox, the claims that make them once-only, dead letters.
SCHEMA = "criativo"
INPUTS = [
    event_filter(EventType.CHAT_MESSAGE),
    event_filter(EventType.CRIATIVO_READINESS_CONFIRMED),
    event_filter(EventType.AGENT_ACTIVATED),
    event_filter(EventType.SESSION_CLOSED),
    event_filter(EventType.SESSION_CLOSED_ABNORMALLY),
]


class CriativoSettings(ServiceSettings):
    """Criativo's own knobs (`AGENTBUS_IDLE_SECONDS`, `AGENTBUS_LEASE_TTL_SECONDS`, …)."""

    idle_seconds: float = 300.0
    # A replica that dies holding a session frees it after this long.
    lease_ttl_seconds: float = 15.0
    # Deliveries of one input that fail before the session is terminated abnormally.
    crash_limit: int = 3
    max_deliver: int = 8
    retry_backoff_seconds: list[float] = Field(
        default_factory=lambda: [1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0]
    )
    ack_wait_seconds: float = 30.0
    consumer_batch: int = 32
    max_tool_iterations: int = 4
    max_tokens: int = 2048
    # How long a turn id still running in metering (an earlier delivery's call) is
    # waited for before it is tried again under a retry id.
    turn_in_progress_wait_seconds: float = 120.0
    # µUSD a session's Criativo turns may spend in all (metering enforces it); none: no cap.
    session_budget_micros: int | None = 2_000_000


def inputs_spec(settings: CriativoSettings) -> ConsumerSpec:
    """The durable consumer every replica shares."""
    return ConsumerSpec(
        durable=CONSUMER,
        stream=streams.EVENTS.name,
        filter_subjects=INPUTS,
        max_deliver=settings.max_deliver,
        backoff=list(settings.retry_backoff_seconds),
        batch=settings.consumer_batch,
    )


async def main(settings: CriativoSettings | None = None) -> None:
    """Run the session actors, fed by the log, until stopped."""
    settings = settings or CriativoSettings()
    async with open_runtime(SERVICE, SCHEMA, [], settings) as rt:
        leases = SessionLeases(rt.js, settings.instance_id, settings.lease_ttl_seconds)
        await leases.open(settings.stream_replicas)
        turns = Turns(
            MeteringClient(rt.nc),
            max_iterations=settings.max_tool_iterations,
            max_tokens=settings.max_tokens,
            budget_micros=settings.session_budget_micros,
            in_progress_wait_seconds=settings.turn_in_progress_wait_seconds,
        )
        work = SessionWork(
            rt.nc, rt.pool, SessionLogClient(rt.nc), leases, turns, settings.crash_limit
        )
        actors = Actors(work, settings.idle_seconds)
        relay = OutboxRelay(
            rt.pool, OfferSender(rt.nc), settings.outbox_batch, settings.outbox_poll_seconds
        )
        rt.background(relay.run(), "offer-relay")
        inputs = SessionInputs(
            rt.nc,
            rt.js,
            rt.pool,
            inputs_spec(settings),
            actors=actors,
            ack_wait=settings.ack_wait_seconds,
        )
        rt.background(inputs.run(), "session-inputs")
        # No commands: registered so `$SRV.PING` and `nats micro ls` find each replica.
        endpoints = Endpoints(SERVICE, VERSION, "Criativo: the conversational ideation agent.")
        service = await endpoints.start(rt.nc, settings.endpoint_concurrency, settings.instance_id)
        try:
            await wait_until_stopped(rt)
        finally:
            await service.stop()
            await actors.stop()


def run() -> None:
    """Entry point: `python -m criativo`."""
    run_service(SERVICE, main())
