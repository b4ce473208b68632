"""Trust the log, not the bus: an event delivered by JetStream is acted on only as the
log confirms it.

Any client of the bus may publish anything on an event subject, so a consumer that is
about to spend money or write (the psychologist on a closing, Criativo on a message,
handoff on a closing) first asks the log for the event by id and compares what it was
told with what was committed. A forged or stale copy is acked, counted and logged as
`forged_event_ignored`; it is never acted on, never dead-lettered and never a crash.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from uuid import UUID

from nats.aio.client import Client

from contracts.common import Message
from contracts.events import Event, EventType
from contracts.session_events import EVENTS_PAGE_MAX, AppendedReply
from servicekit.logs import get_logger
from servicekit.sessionlog import COMMAND_TIMEOUT_SECONDS, SessionLogClient

log = get_logger(__name__)

# What a replica ignored, by reason, since it started (read by tests and, later, metrics).
FORGED_EVENTS: Counter[str] = Counter()

# The fields the log decides; `payload` is compared too, as a forged payload on a real
# id is as dangerous as a forged id.
_CHECKED = ("session_id", "project_id", "seq", "type", "actor", "causation_id", "payload")


def _checked(event: Event) -> tuple[object, ...]:
    return tuple(getattr(event, name) for name in _CHECKED)


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


class Confirmations:
    """Confirms delivered events against the log, the events waiting read together.

    For a reader that confirms each event as it arrives, whatever its session (the
    gateway, before it shows one): an event is asked for at once (`cmd.events.get` by
    id) with every other one waiting, in up to `max_reads` reads at a time; once that
    many are under way, the events that arrive wait for the first to end and go in the
    next read together. A read per event, as the gateway first did, made two of the
    log's three reads per turn in bench/gateway.py; one read at a time made every event
    wait for the read under way before its own, and a busy log's round trip is long:
    at 500 clients its deltas waited longer than with a read each (per-token p99).

    A read that fails is tried again `attempts` times, `retry_seconds` apart; the events
    it was for are then answered None, as unconfirmed (not counted as forgeries).

    An event the reader appended itself needs no read: the log's reply to the append
    (`appended`) already says what it committed, at which id and `seq`, and a delivered
    copy equal to that in every field the log decides is confirmed by comparison. At 500
    clients in bench/gateway.py the person's message waited ~0.3 s for the busy log's
    read, and the first deltas of its answer behind it. A copy that differs is read from
    the log as any other event: a forgery is still judged, and counted, by the log.
    At most `max_appended` such answers are kept (an event never delivered to this
    reader, its followers gone, is forgotten with the oldest).
    """

    def __init__(
        self,
        session_log: SessionLogClient,
        *,
        consumer: str,
        max_reads: int = 8,
        attempts: int = 3,
        retry_seconds: float = 0.5,
        max_appended: int = 4096,
    ) -> None:
        self._log = session_log
        self._consumer = consumer
        self._max_reads = max_reads
        self._attempts = attempts
        self._retry_seconds = retry_seconds
        self._max_appended = max_appended
        # The log's answers to this reader's appends, by event id: the checked fields.
        self._appended: dict[UUID, tuple[object, ...]] = {}
        self._waiting: list[tuple[Event, asyncio.Future[Event | None]]] = []
        self._readers: set[asyncio.Task[None]] = set()
        # A reader was started and has not taken the waiting events yet: it will take
        # those that arrive meanwhile too.
        self._starting = False

    def appended(
        self,
        reply: AppendedReply,
        *,
        project_id: str,
        session_id: UUID,
        event_type: EventType,
        actor: str,
        payload: Message,
        causation_id: UUID | None = None,
    ) -> None:
        """The log's reply to this reader's own append of that event (as
        `SessionLogClient.append` sent it): its delivery will be confirmed without a read."""
        committed = {
            "session_id": session_id,
            "project_id": project_id,
            "seq": reply.seq,
            "type": event_type,
            "actor": actor,
            "causation_id": causation_id,
            "payload": payload.model_dump(mode="json"),  # as the log stores it
        }
        if len(self._appended) >= self._max_appended:
            del self._appended[next(iter(self._appended))]
        self._appended[reply.event_id] = tuple(committed[name] for name in _CHECKED)

    async def confirm(self, delivered: Event) -> Event | None:
        """The log's copy of `delivered`; None when the log denies it (logged and counted,
        as `confirm`) or did not answer."""
        committed = self._appended.pop(delivered.id, None)
        if committed is not None and committed == _checked(delivered):
            return delivered
        answer: asyncio.Future[Event | None] = asyncio.get_running_loop().create_future()
        self._waiting.append((delivered, answer))
        if not self._starting and len(self._readers) < self._max_reads:
            self._starting = True
            reader = asyncio.create_task(self._read_waiting())
            self._readers.add(reader)
            reader.add_done_callback(self._readers.discard)
        return await answer

    async def _read_waiting(self) -> None:
        batch: list[tuple[Event, asyncio.Future[Event | None]]] = []
        try:
            while self._waiting:
                self._starting = False
                batch = self._waiting[:EVENTS_PAGE_MAX]
                del self._waiting[:EVENTS_PAGE_MAX]
                logged = await self._read([delivered.id for delivered, _ in batch])
                for delivered, answer in batch:
                    if answer.done():
                        continue  # its waiter gave up
                    if logged is None:
                        answer.set_result(None)
                    else:
                        found = logged.get(delivered.id)
                        answer.set_result(judged(delivered, found, consumer=self._consumer))
        finally:
            self._starting = False
            # Only a reader stopped midway (its task cancelled) leaves any unanswered.
            for _, answer in batch:
                if not answer.done():
                    answer.set_result(None)

    async def _read(self, event_ids: list[UUID]) -> dict[UUID, Event] | None:
        for attempt in range(1, self._attempts + 1):
            try:
                # a read's patience, as the one-event reads had: a busy log is slow, not gone
                found = await self._log.get(event_ids)
                return {event.id: event for event in found}
            except Exception as exc:
                log.warning(
                    "events_unconfirmed",
                    consumer=self._consumer,
                    events=len(event_ids),
                    attempt=attempt,
                    error=repr(exc),
                )
                if attempt < self._attempts:
                    await asyncio.sleep(self._retry_seconds)
        return None
