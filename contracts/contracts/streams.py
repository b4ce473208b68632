"""JetStream streams the services need, provisioned idempotently at start."""

from __future__ import annotations

from dataclasses import dataclass, field

from contracts import subjects
from contracts.events import EventType


@dataclass(frozen=True)
class StreamSpec:
    """A stream's name, subjects and retention, independent of the client library."""

    name: str
    subjects: list[str]
    description: str
    max_age_seconds: float = 0  # 0 = keep forever
    duplicate_window_seconds: float = 120
    max_msg_size: int = -1
    storage: str = "file"
    extra: dict[str, str] = field(default_factory=dict)


# The log of record: every committed event. The Nats-Msg-Id is the event id, so a
# relay that republishes inside the duplicate window is deduplicated by the server;
# beyond it consumers' idempotency takes over (DESIGN.md, rules learned the hard way).
EVENTS = StreamSpec(
    name="EVENTS",
    subjects=[subjects.event_filter(t) for t in EventType],
    description="Every event committed to the session log, by type, project and session.",
    max_msg_size=1024 * 1024,
)

# Short-lived: lets a reconnecting client catch up on the turn in flight.
DELTAS = StreamSpec(
    name="DELTAS",
    subjects=[subjects.delta_subject("*", "*"), subjects.done_subject("*", "*")],
    description="Streaming text deltas and turn ends, kept for a few minutes.",
    max_age_seconds=15 * 60,
    storage="memory",
)

# Dead letters announced by consumers, kept for operators to read and replay.
DEAD_LETTERS = StreamSpec(
    name="DEADLETTERS",
    subjects=[f"{subjects.DEAD_LETTER_PREFIX}.>"],
    description="Messages a consumer gave up on, with the reason.",
    max_age_seconds=30 * 24 * 3600,
)

ALL = [EVENTS, DELTAS, DEAD_LETTERS]
