"""Criativo's settings: its knobs beside the kit's (`servicekit.settings`)."""

from __future__ import annotations

from pydantic import Field

from contracts import streams
from servicekit.settings import ServiceSettings


class CriativoSettings(ServiceSettings):
    """Criativo's own knobs (`AGENTBUS_IDLE_SECONDS`, `AGENTBUS_CRASH_LIMIT`, …)."""

    idle_seconds: float = 300.0
    # Deliveries of one input that fail before the session is terminated abnormally.
    crash_limit: int = 3
    max_deliver: int = 8
    retry_backoff_seconds: list[float] = Field(
        default_factory=lambda: [1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0]
    )
    # The least time an input stays with the replica that took it before JetStream hands
    # it to another: how long the input of a replica that died mid-turn waits (the lease
    # it left is taken at once, `criativo.presence`). The holder reports it in progress
    # every third of this, one message each: a turn of a few seconds costs one report or
    # none, not one per third of the first retry step (which a nak's delay still follows).
    redeliver_held_input_after_seconds: float = streams.LEASES.ttl_seconds / 3
    consumer_batch: int = 32
    max_tool_iterations: int = 4
    max_tokens: int = 2048
    # How long a turn id still running in metering (an earlier delivery's call) is
    # waited for before it is tried again under a retry id. A turn whose metering replica
    # died ends sooner: a surviving replica bills it at its hold within seconds
    # (`metering.sweeper`), and its id is then retried at once; so this bounds only a live
    # turn, which past it is answered by its retry, and billed twice.
    turn_in_progress_wait_seconds: float = 60.0
    # An answer stream whose metering replica neither beats nor replies for this long lost
    # that replica (SIGKILLed mid-turn, before or after the first delta): tried again under
    # its next retry id rather than waiting out the request's 600 s (harness.client). The
    # replica is asked to beat every quarter of it (every 1.25 s): a model that thinks long
    # keeps it beating. A live replica that only seemed silent (stalled, or cut off from
    # NATS that long) is not run twice: the turn is asked for again under its own id first,
    # and metering answers it "in progress" (harness.loop).
    stream_silence_seconds: float = 5.0
    # A stream that no metering replica beat for at all this long after the request (its
    # replica killed before the first beat) is tried again under its retry id too. A replica
    # beats as soon as it takes a request, which it does at once unless it runs
    # `endpoint_concurrency` (256) turns already: only then does a live one stay unheard,
    # and its turn is asked for again, not run twice, as above.
    stream_unheard_seconds: float = 10.0
    # µUSD a session's Criativo turns may spend in all (metering enforces it); none: no cap.
    session_budget_micros: int | None = 2_000_000
