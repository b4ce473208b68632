"""One actor per session (ADR 0008 decision 1): an asyncio task with its mailbox.

The actor is created when an input for its session arrives (an `agent.activated`
of Criativo creates it ahead of the first message), rehydrates its conversation
from the log, handles its mailbox one input at a time in `seq` order, and is
evicted after `idle_seconds` with an empty mailbox or once its session is closed.

The mailbox policy is `domain.criativo.admit`: an input that arrives during a turn
is queued behind it, never dropped and never merged into the running turn; a second
copy of an input already queued (a redelivery racing its first copy) shares the
first copy's outcome. Different sessions' actors run concurrently.

The kit's per-session subscription (`criativo.handlers`) already hands a session's
inputs over one at a time, in stream order; the mailbox keeps the policy true for any
caller of `post`, and keeps the conversation between inputs.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from uuid import UUID

from opentelemetry.context import Context

from contracts.events import Event
from criativo.session import SessionWork
from domain import criativo as rules
from domain.criativo import Admission, Conversation, Inbound
from servicekit.logs import get_logger
from servicekit.metrics import Gauge
from servicekit.telemetry import current_trace, within

log = get_logger(__name__)

# Summed over the replica's `Actors` (one per process, but tests run several).
LIVE_ACTORS = Gauge("agentbus_criativo_live_actors", "Session actors alive in this replica.")


@dataclass
class Letter:
    """An input in the mailbox, with how many times the bus delivered it."""

    event: Event
    deliveries: int
    outcome: asyncio.Future[None]
    # The trace of the delivery that posted it: the turn continues it (the actor's
    # task was started by another input, in another trace).
    trace: Context = field(default_factory=current_trace)


class SessionActor:
    """The actor of one session."""

    def __init__(self, session_id: UUID, work: SessionWork, actors: Actors) -> None:
        self.session_id = session_id
        self._work = work
        self._actors = actors
        self._queue: list[Inbound] = []
        self._letters: dict[UUID, list[Letter]] = {}
        self._wake = asyncio.Event()
        self.conv = Conversation(session_id)
        self.task: asyncio.Task[None] | None = None

    def post(self, event: Event, deliveries: int) -> asyncio.Future[None]:
        """Put an input in the mailbox; the future resolves when it has been handled."""
        letter = Letter(event, deliveries, asyncio.get_running_loop().create_future())
        self._queue, admission = rules.admit(self._queue, Inbound(event.id, event.seq))
        self._letters.setdefault(event.id, []).append(letter)
        if admission is Admission.QUEUED:
            self._wake.set()
        return letter.outcome

    async def run(self) -> None:
        """Rehydrate, then handle the mailbox until idle or the session closes."""
        try:
            self.conv = await self._work.catch_up(self.conv)
        except Exception as exc:  # the log is unreachable: fail this mailbox, start afresh
            self._fail_all(exc)
            self._actors.evict(self)
            return
        while True:
            if not self._queue:
                # Closed, or a session the log does not know (only forged inputs named it).
                if self.conv.closed or self.conv.last_seq == 0:
                    self._actors.evict(self)
                    return
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), self._actors.idle_seconds)
                except TimeoutError:
                    if not self._queue:  # nothing can have arrived since: evict now
                        self._actors.evict(self)
                        return
                continue
            inbound = self._queue.pop(0)
            letters = self._letters.pop(inbound.event_id)
            first = letters[0]
            try:
                with within(first.trace):
                    self.conv = await self._work.handle(
                        self.conv, first.event, max(x.deliveries for x in letters)
                    )
            except Exception as exc:
                log.warning(
                    "session_input_failed",
                    session_id=str(self.session_id),
                    event_id=str(inbound.event_id),
                    error=repr(exc),
                )
                for letter in letters:
                    _settle(letter.outcome, exc)
            else:
                for letter in letters:
                    _settle(letter.outcome, None)

    def _fail_all(self, exc: BaseException) -> None:
        for letters in self._letters.values():
            for letter in letters:
                _settle(letter.outcome, exc)
        self._letters.clear()
        self._queue.clear()


def _settle(future: asyncio.Future[None], exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)


class Actors:
    """The live actors of this replica, by session."""

    def __init__(self, work: SessionWork, idle_seconds: float) -> None:
        self._work = work
        self.idle_seconds = idle_seconds
        self._live: dict[UUID, SessionActor] = {}

    def __len__(self) -> int:
        return len(self._live)

    def post(self, event: Event, deliveries: int) -> asyncio.Future[None]:
        """Route an input to its session's actor, starting the actor on demand."""
        actor = self._live.get(event.session_id)
        if actor is None:
            actor = SessionActor(event.session_id, self._work, self)
            self._live[event.session_id] = actor
            LIVE_ACTORS.inc()
            actor.task = asyncio.create_task(actor.run(), name=f"criativo:{event.session_id}")
        return actor.post(event, deliveries)

    def evict(self, actor: SessionActor) -> None:
        """Forget an actor that ended (its mailbox is empty)."""
        if self._live.get(actor.session_id) is actor:
            del self._live[actor.session_id]
            LIVE_ACTORS.dec()

    async def stop(self) -> None:
        """Cancel every actor (shutting down: unacknowledged inputs are redelivered)."""
        tasks = [a.task for a in self._live.values() if a.task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        LIVE_ACTORS.dec(len(self._live))
        self._live.clear()
