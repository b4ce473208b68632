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

from contracts import streams
from contracts.catalog import SESSION_CLOSINGS_FILTER
from contracts.events import SESSION_CLOSINGS, Event, EventType
from contracts.subjects import event_filter
from criativo.actors import Actors
from criativo.session import CONSUMER as CONSUMER  # re-exported: the durable of this service
from criativo.settings import CriativoSettings
from domain.criativo import CRIATIVO
from servicekit.consumer import ConsumerSpec
from servicekit.service import Attempt, Service

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


def inputs_spec(settings: CriativoSettings) -> ConsumerSpec:
    """The durable consumer every replica shares."""
    return ConsumerSpec(
        durable=CONSUMER,
        stream=streams.EVENTS.name,
        filter_subjects=INPUTS,
        max_deliver=settings.max_deliver,
        backoff=list(settings.retry_backoff_seconds),
        batch=settings.consumer_batch,
        redeliver_held_after=settings.redeliver_held_input_after_seconds,
    )


@svc.subscribe(inputs_spec, per_session=True)
async def session_input(event: Event, attempt: Attempt, actors: Actors) -> None:
    """Hand the input to its session's actor and wait until the actor is done with it."""
    starts_criativo = (
        event.type is EventType.AGENT_ACTIVATED and event.payload.get("agent") == CRIATIVO
    )
    if starts_criativo or event.type in ROUTED:
        await actors.post(event, attempt.number)
