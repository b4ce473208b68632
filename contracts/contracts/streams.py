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
    max_bytes: int = -1  # -1 = no limit; past it the oldest messages go
    duplicate_window_seconds: float = 120
    max_msg_size: int = -1
    storage: str = "file"
    # Takes JetStream's atomic batches (nats-server >= 2.12): the outbox relay publishes a
    # session's events as one, so they land in order, all or none (servicekit.outbox).
    allow_atomic: bool = False
    # Answers `$JS.API.DIRECT.GET`: how an operator reads a stream without a consumer
    # (`nats stream get`, `nats sub --stream S --direct`). Any consumer ops could create
    # could be made to push the stream to any subject, so ops has none
    # (docs/decisions/0007-ops-reads-by-direct-get.md).
    allow_direct: bool = True
    extra: dict[str, str] = field(default_factory=dict)


# Every committed event. The Nats-Msg-Id is the event id, so a relay that republishes
# inside the duplicate window is deduplicated by the server; beyond it consumers'
# idempotency takes over (each records what it handled with its effect).
# Bounded: the log in Postgres is the record, the stream only carries it to
# the consumers, and `agentbus republish` sends the log's events again. A week covers a
# consumer down over a long weekend; the bytes bound keeps a flood from filling the
# disk, and fits under the servers' `max_file_store` (deploy/nats, deploy/k8s: 10 GB,
# 16 GB), which JetStream reserves it against. Consumers' claims are kept this max_age
# plus a margin (servicekit.retention).
EVENTS_MAX_AGE_SECONDS = 7 * 24 * 3600
EVENTS_MAX_BYTES = 2 * 1024**3
EVENTS = StreamSpec(
    name="EVENTS",
    subjects=[subjects.event_filter(t) for t in EventType],
    description="Every event committed to the session log, by type, project and session.",
    max_age_seconds=EVENTS_MAX_AGE_SECONDS,
    max_bytes=EVENTS_MAX_BYTES,
    max_msg_size=1024 * 1024,
    allow_atomic=True,
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


@dataclass(frozen=True)
class BucketSpec:
    """A NATS KV bucket: created and configured by `agentbus provision` alone, like the
    streams, so its owner cannot reshape its stream (`subjects`, `republish`)."""

    name: str
    description: str
    ttl_seconds: float  # a key lives this long unless written again
    history: int = 1

    @property
    def stream(self) -> str:
        """The stream that holds the bucket."""
        return f"KV_{self.name}"


# Criativo's per-session leases: a replica that dies holding one frees it in one TTL.
LEASES = BucketSpec(
    name="criativo_leases",
    description="Which Criativo replica holds each session, expiring unless renewed.",
    ttl_seconds=15.0,
)

BUCKETS = [LEASES]
