"""The psychologist's settings: its knobs beside the kit's (`servicekit.settings`)."""

from __future__ import annotations

from pydantic import Field

from servicekit.settings import ServiceSettings


class PsychologistSettings(ServiceSettings):
    """The psychologist's own knobs (`AGENTBUS_ANALYSIS_WORKERS`, …)."""

    # Analyses run at once per replica: each worker pulls one closing at a time, so
    # nothing is over-fetched, as a `max_workers` pull pool would
    # (docs/decisions/0001-own-jetstream-consumer.md).
    analysis_workers: int = 4
    max_tokens: int = 4096
    # Redelivery delays; the first is also how long a killed replica's message waits.
    redelivery_backoff: list[float] = Field(default_factory=lambda: [3.0, 10.0, 30.0, 60.0])
    # A model turn with no reply this long lost its metering replica (SIGKILLed mid-call:
    # no reply will ever come): tried again under its next retry id instead of holding
    # the closing for the request's 600 s. Longer than a whole reply of `max_tokens` takes.
    turn_lost_seconds: float = 180.0
