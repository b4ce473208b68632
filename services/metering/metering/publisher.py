"""Publishing a streaming turn's text as it comes: the per-token path.

Nothing here may cost more than it must per piece of text (an await, an allocation, a
system call): it runs for every token of every streamed turn
(docs/decisions/0010-light-per-token-path.md).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from uuid import UUID

from nats.aio.client import Client

from contracts.metering import ReplyBlock, TextBlock, TurnDelta
from metering.cancels import RunningTurn
from servicekit.logs import get_logger

log = get_logger(__name__)


@dataclass(frozen=True)
class Coalescing:
    """How a stream's pieces are gathered into deltas (metering's settings).

    `window`: seconds a piece may wait for the ones after it (0: until the next turn of
    the event loop, the pieces of one read of the provider's stream). `max_chars`: a
    delta holding this many characters goes out without waiting for its window's end.
    """

    window: float = 0.040
    max_chars: int = 4096


@dataclass
class DeltaPublisher:
    """Publishes a streaming turn's text on its delta subject, numbered from 1, in order.

    Coalesced in time: a piece is published at once when no delta of this turn went out
    in the last window (so the turn's first piece is never held: the time to the first
    token is the provider's); otherwise it is held, with every piece after it, for one
    window from its arrival, or until what is held reaches the size bound, and they go
    out as one delta. A turn thus publishes at most about one delta per window, whatever
    the provider's pace: every hop after this one (NATS, the gateway, each client) wakes
    up per delta, not per token, and a token waits at most a window for it. A stream
    slower than the window has nothing to gather and gets a delta per piece, without
    waiting. `TurnDelta` is "a piece of text"; a held delta's `emitted_at` is its first
    piece's, so the latency it reports is its oldest's.

    Costs: per piece, a flag look-up or an append; per delta, a timer (the end of the
    window since it went out) and, for a held one, a second timer and a task.
    """

    nc: Client
    subject: str
    turn_id: str
    causation_id: UUID | None = None
    coalescing: Coalescing = field(default_factory=Coalescing)
    seq: int = 0
    # Set once the stream runs: after a stop nothing more is published.
    running: RunningTurn | None = None
    # What was published, the reply of a stopped stream (the SDK's own copy is lost
    # with the aborted call).
    pieces: list[str] = field(default_factory=list)
    # Whether a delta went out less than a window ago; the pieces held since, the time
    # of the first, their length, the timer that ends their window and the task that
    # publishes them then.
    _recent: bool = False
    _held: list[str] = field(default_factory=list)
    _held_at: float = 0.0
    _held_chars: int = 0
    _due: asyncio.TimerHandle | None = None
    _publishing: asyncio.Task[None] | None = None
    # Looked up once, where the publisher is made (in the turn's task), not per piece:
    # `asyncio.get_running_loop()` makes a getpid() system call each time (gateway.ws).
    _loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def content(self) -> list[ReplyBlock]:
        """The reply of a stream stopped by a cancel: the text published until the stop."""
        return [TextBlock(text=self.text)] if self.pieces else []

    @property
    def stopped(self) -> bool:
        return self.running is not None and self.running.stopped

    async def __call__(self, text: str, emitted_at: float) -> None:
        if self.stopped:
            return  # stopped: a flag look-up, no I/O on the per-token path
        if self._held:  # never ahead of a held piece
            self._held.append(text)
            self._held_chars += len(text)
        elif self._recent:
            self._held.append(text)
            self._held_at = emitted_at
            self._held_chars = len(text)
            if self.coalescing.window > 0:
                self._due = self._loop.call_later(self.coalescing.window, self._window_over)
            else:  # the next turn of the loop: the publishing task's first step
                self._window_over()
        else:
            await self._publish(text, emitted_at)
            return
        if self._held_chars >= self.coalescing.max_chars:
            await self._publish_held()

    async def flush(self) -> None:
        """Publish what is held now (the stream ended: its reply must not overtake it)."""
        if self._publishing is not None:
            await self._publishing
        await self._publish_held()

    def _quiet_after_window(self) -> None:
        if self.coalescing.window > 0:
            self._loop.call_later(self.coalescing.window, self._quiet, self.seq)
        else:
            self._loop.call_soon(self._quiet, self.seq)

    def _window_over(self) -> None:
        # A task: publishing awaits. What arrives before it runs joins what it publishes.
        self._publishing = self._loop.create_task(self._publish_held())

    def _quiet(self, seq: int) -> None:
        if seq == self.seq:  # no delta went out since the one that armed this timer
            self._recent = False

    async def _publish_held(self) -> None:
        if not self._held:
            return
        held, self._held = self._held, []
        if self._due is not None:  # cut by the size bound or the stream's end
            self._due.cancel()
            self._due = None
        if not self.stopped:  # a stop drops what was held: the reply holds what went out
            await self._publish("".join(held), self._held_at)

    async def _publish(self, text: str, emitted_at: float) -> None:
        self.seq += 1
        self._recent = True
        self._quiet_after_window()
        # Before the publish: nats-py queues the message before its first await, so a
        # piece recorded here is a piece that went out.
        self.pieces.append(text)
        # Built from values already checked (the command's turn id, our own count, the
        # provider's text): constructed, not validated again, on the per-token path.
        delta = TurnDelta.model_construct(
            turn_id=self.turn_id,
            seq=self.seq,
            text=text,
            emitted_at=emitted_at,
            causation_id=self.causation_id,
        )
        try:
            # Core NATS: no ack to wait for on the per-token path; the DELTAS stream
            # captures `agent.delta.>` for a client that reconnects.
            await self.nc.publish(self.subject, delta.model_dump_json().encode())
        except Exception as exc:  # the turn is still completed and billed
            log.warning("delta_publish_failed", turn_id=self.turn_id, error=repr(exc))
