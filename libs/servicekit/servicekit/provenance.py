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
from collections.abc import Awaitable
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


class LogUnanswered(Exception):
    """The log did not answer whether it holds the event: neither confirmed nor denied.

    Not a forgery (nothing is counted), and not to be dropped as one: the event may be
    real, and the reader reads it from the log once the log answers again."""

    def __init__(self, event: Event) -> None:
        super().__init__(f"the log did not answer for event {event.id} (seq {event.seq})")
        self.event = event


# A copy being confirmed, and its answer.
_Asked = tuple[Event, asyncio.Future[Event | None]]


class Confirmations:
    """Confirms delivered events against the log, the events waiting read together.

    For a reader that confirms each event as it arrives, whatever its session (the
    gateway, before it shows one): an event is asked for at once (`cmd.events.get` by
    id) with every other one waiting, in up to `max_reads` reads at a time; once that
    many are under way, the events that arrive wait for the first to end and go in the
    next read together. A read per event makes two of the log's three reads per turn
    (bench/gateway.py); one read at a time makes every event wait for the read under way
    before its own, and a busy log's round trip is long: at 500 clients its deltas wait
    longer than with a read each (docs/decisions/0004-trust-the-log.md).

    A read that fails, or is not answered within `read_timeout` (a command's), is tried
    again, `attempts` times in all, `retry_seconds` apart; the events it was for are then
    `LogUnanswered` (not counted as forgeries, not denied either), which the reader
    reads from the log later rather than drop. A read waits no longer than a command:
    the replica that took it may have been killed holding it, and it never answers;
    asked again, a live replica does. Within each read, a copy goes out after 2 s
    (`SessionLogClient`'s reads are `resent`).

    An event the reader appends itself (`own_append`) needs no read: the log's reply to
    the append already says what it committed, at which id and `seq`, and a delivered
    copy equal to that in every field the log decides is confirmed by comparison: read,
    the person's message would wait for a busy log's read (~0.3 s at 500 clients in
    bench/gateway.py), and the first deltas of its answer behind it. The copy often comes before the
    reply (the log's relay publishes as it answers): a copy of the session, type and
    actor of an append under way waits for its reply, and is read only if the reply
    does not match it. A copy that differs is read from the log as any other event: a
    forgery is still judged, and counted, by the log. At most `max_appended` replies
    are kept for copies still to come (one never delivered to this reader, its
    followers gone, is forgotten with the oldest).
    """

    def __init__(
        self,
        session_log: SessionLogClient,
        *,
        consumer: str,
        max_reads: int = 8,
        attempts: int = 3,
        retry_seconds: float = 0.5,
        read_timeout: float = COMMAND_TIMEOUT_SECONDS,
        max_appended: int = 4096,
    ) -> None:
        self._log = session_log
        self._consumer = consumer
        self._max_reads = max_reads
        self._attempts = attempts
        self._retry_seconds = retry_seconds
        self._read_timeout = read_timeout
        self._max_appended = max_appended
        # The log's replies to this reader's appends whose copy has not come yet, by
        # event id: the checked fields.
        self._appended: dict[UUID, tuple[object, ...]] = {}
        # This reader's appends under way, by what their copy will be: (session, type,
        # actor) -> how many; and the copies that came first, waiting for the replies.
        self._appending: Counter[tuple[UUID, EventType, str]] = Counter()
        self._early: dict[tuple[UUID, EventType, str], list[_Asked]] = {}
        # Every copy being confirmed now, by event id.
        self._asked: dict[UUID, _Asked] = {}
        self._waiting: list[_Asked] = []
        self._readers: set[asyncio.Task[None]] = set()
        # A reader was started and has not taken the waiting events yet: it will take
        # those that arrive meanwhile too.
        self._starting = False

    async def own_append(
        self,
        append: Awaitable[AppendedReply],
        *,
        project_id: str,
        session_id: UUID,
        event_type: EventType,
        actor: str,
        payload: Message,
        causation_id: UUID | None = None,
    ) -> AppendedReply:
        """Await this reader's own `append` of that event (as `SessionLogClient.append`
        sends it); its copy is then confirmed by the log's reply, with no read."""
        key = (session_id, event_type, actor)
        self._appending[key] += 1
        try:
            reply = await append
            committed = {
                "session_id": session_id,
                "project_id": project_id,
                "seq": reply.seq,
                "type": event_type,
                "actor": actor,
                "causation_id": causation_id,
                "payload": payload.model_dump(mode="json"),  # as the log stores it
            }
            self._committed(reply.event_id, tuple(committed[name] for name in _CHECKED))
            return reply
        finally:
            self._appending[key] -= 1
            if not self._appending[key]:
                del self._appending[key]
                # Copies no reply matched (a forgery, a failed append) are read after all.
                for early in self._early.pop(key, []):
                    if not early[1].done():
                        self._read_later(early)

    def _committed(self, event_id: UUID, checked: tuple[object, ...]) -> None:
        """What the log replied it committed: the copy that came first is confirmed now,
        one still to come when it comes."""
        asked = self._asked.get(event_id)
        if asked is not None and not asked[1].done() and _checked(asked[0]) == checked:
            asked[1].set_result(asked[0])
            return
        if len(self._appended) >= self._max_appended:
            del self._appended[next(iter(self._appended))]
        self._appended[event_id] = checked

    async def confirm(self, delivered: Event) -> Event | None:
        """The log's copy of `delivered` (`delivered` itself when the reply to this
        reader's own append vouches for it); None when the log denies it (logged and
        counted, as `confirm`); `LogUnanswered` when the log did not answer."""
        committed = self._appended.pop(delivered.id, None)
        if committed is not None and committed == _checked(delivered):
            return delivered
        answer: asyncio.Future[Event | None] = asyncio.get_running_loop().create_future()
        asked = (delivered, answer)
        self._asked[delivered.id] = asked
        key = (delivered.session_id, delivered.type, delivered.actor)
        if key in self._appending:
            self._early.setdefault(key, []).append(asked)  # the reply is on its way
        else:
            self._read_later(asked)
        try:
            return await answer
        finally:
            if self._asked.get(delivered.id) is asked:
                del self._asked[delivered.id]

    def _read_later(self, asked: _Asked) -> None:
        """Read it with the others waiting, as soon as a reader is free."""
        self._waiting.append(asked)
        if not self._starting and len(self._readers) < self._max_reads:
            self._starting = True
            reader = asyncio.create_task(self._read_waiting())
            self._readers.add(reader)
            reader.add_done_callback(self._readers.discard)

    async def _read_waiting(self) -> None:
        batch: list[_Asked] = []
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
                        answer.set_exception(LogUnanswered(delivered))
                    else:
                        found = logged.get(delivered.id)
                        answer.set_result(judged(delivered, found, consumer=self._consumer))
        finally:
            self._starting = False
            # Only a reader stopped midway (its task cancelled) leaves any unanswered.
            for delivered, answer in batch:
                if not answer.done():
                    answer.set_exception(LogUnanswered(delivered))

    async def _read(self, event_ids: list[UUID]) -> dict[UUID, Event] | None:
        for attempt in range(1, self._attempts + 1):
            try:
                found = await self._log.get(event_ids, timeout=self._read_timeout)
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
