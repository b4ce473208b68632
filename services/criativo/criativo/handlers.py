"""Criativo's bus surface: one durable consumer of the log, per-session ordered.

Every input of a session (its messages, readiness, Criativo's activation, the closing)
goes to the session's actor (`criativo.actors`), one at a time and in stream order;
different sessions' inputs are handled concurrently. The kit does the rest by the
consumer rules: ack once the actor is done with the input, nak with backoff when it
failed, dead-letter what can never succeed, and keep a message in progress while it
waits behind its session's earlier inputs or its turn runs, so the server does not
redeliver it to another replica meanwhile. Criativo serves no commands: it is
registered so `$SRV.PING` and `nats micro ls` find each replica. What a session does
with each input is `criativo.session`.
"""

from __future__ import annotations

from pydantic import Field

from contracts import streams
from contracts.catalog import SESSION_CLOSINGS_FILTER
from contracts.events import SESSION_CLOSINGS, Event, EventType
from contracts.subjects import event_filter
from criativo.actors import Actors
from criativo.session import CONSUMER as CONSUMER  # re-exported: the durable of this service
from domain.criativo import CRIATIVO
from servicekit.consumer import ConsumerSpec
from servicekit.service import Attempt, Service
from servicekit.settings import ServiceSettings

SERVICE = "criativo"
VERSION = "0.1.0"
# Criativo keeps no state of its own (the log is its memory); its schema holds only
# servicekit's tables: the offers' outbox, the claims that make them once-only, dead
# letters.
svc = Service(SERVICE, VERSION, "Criativo: the conversational ideation agent.", schema="criativo")
INPUTS = [
    event_filter(EventType.CHAT_MESSAGE),
    event_filter(EventType.CRIATIVO_READINESS_CONFIRMED),
    event_filter(EventType.AGENT_ACTIVATED),
    *SESSION_CLOSINGS_FILTER,
]
# Inputs that start or feed an actor; anything else on the subjects is acknowledged.
ROUTED = frozenset(
    {
        EventType.CHAT_MESSAGE,
        EventType.CRIATIVO_READINESS_CONFIRMED,
        *SESSION_CLOSINGS,
    }
)


class CriativoSettings(ServiceSettings):
    """Criativo's own knobs (`AGENTBUS_IDLE_SECONDS`, `AGENTBUS_CRASH_LIMIT`, …)."""

    idle_seconds: float = 300.0
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
    # waited for before it is tried again under a retry id. Past a minute its metering
    # replica is taken for dead too (when both replicas are killed, the person waits this
    # long plus the lease's TTL); a live turn that long is answered by its retry, and
    # billed twice.
    turn_in_progress_wait_seconds: float = 60.0
    # An answer stream whose metering replica neither beats nor replies for this long lost
    # that replica (SIGKILLed mid-turn, before or after the first delta): tried again under
    # its next retry id rather than waiting out the request's 600 s (harness.client). The
    # replica is asked to beat every quarter of it; a model that thinks long keeps it beating.
    stream_silence_seconds: float = 30.0
    # A stream that no metering replica beat for at all this long after the request (its
    # replica killed before the first beat) is tried again under its retry id too.
    stream_unheard_seconds: float = 60.0
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
        ack_wait=settings.ack_wait_seconds,
    )


@svc.subscribe(inputs_spec, per_session=True)
async def session_input(event: Event, attempt: Attempt, actors: Actors) -> None:
    """Hand the input to its session's actor and wait until the actor is done with it."""
    starts_criativo = (
        event.type is EventType.AGENT_ACTIVATED and event.payload.get("agent") == CRIATIVO
    )
    if starts_criativo or event.type in ROUTED:
        await actors.post(event, attempt.number)
