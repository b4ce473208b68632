"""Trust the log, not the bus: an event delivered by JetStream is acted on only as the
log confirms it.

Any client of the bus may publish anything on an event subject, so a consumer that is
about to spend money or write (the psychologist on a closing, Criativo on a message,
handoff on a closing) first asks the log for the event by id and compares what it was
told with what was committed. A forged or stale copy is acked, counted and logged as
`forged_event_ignored`; it is never acted on, never dead-lettered and never a crash.
"""

from __future__ import annotations

from collections import Counter

from nats.aio.client import Client

from contracts.events import Event
from servicekit.logs import get_logger
from servicekit.sessionlog import COMMAND_TIMEOUT_SECONDS, SessionLogClient

log = get_logger(__name__)

# What a replica ignored, by reason, since it started (read by tests and, later, metrics).
FORGED_EVENTS: Counter[str] = Counter()

# The fields the log decides; `payload` is compared too, as a forged payload on a real
# id is as dangerous as a forged id.
_CHECKED = ("session_id", "project_id", "seq", "type", "actor", "causation_id", "payload")


def mismatch(delivered: Event, logged: Event | None) -> str | None:
    """Why the delivered copy is not the committed event, or None when it is."""
    if logged is None:
        return "not_in_log"
    for name in _CHECKED:
        if getattr(delivered, name) != getattr(logged, name):
            return f"{name}_differs"
    return None


async def confirm(nc: Client, delivered: Event, *, consumer: str) -> Event | None:
    """The log's copy of `delivered`, or None (logged and counted) when the log denies it.

    A failure to reach the log raises: the message is then redelivered, as for any
    transient fault, rather than trusted or dropped.
    """
    found = await SessionLogClient(nc).get([delivered.id], timeout=COMMAND_TIMEOUT_SECONDS)
    logged = next((e for e in found if e.id == delivered.id), None)
    return judged(delivered, logged, consumer=consumer)


def judged(delivered: Event, logged: Event | None, *, consumer: str) -> Event | None:
    """`logged` when it is the delivered event as committed; else None, logged and
    counted as a forgery."""
    reason = mismatch(delivered, logged)
    if reason is None:
        return logged
    FORGED_EVENTS[reason] += 1
    log.warning(
        "forged_event_ignored",
        consumer=consumer,
        event_id=str(delivered.id),
        event_type=delivered.type.value,
        session_id=str(delivered.session_id),
        reason=reason,
    )
    return None
