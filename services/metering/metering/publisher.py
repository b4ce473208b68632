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


@dataclass
class DeltaPublisher:
    """Publishes a streaming turn's text on its delta subject, numbered from 1, in order.

    Coalesced under load: a piece is published at once, unless one already went out in
    this turn of the event loop (the provider handed on several without waiting: the
    events of one read of its stream). Those are held and go out as one delta once the
    provider waits for its next read. A stream read as fast as it comes gives a delta per
    piece, at the price of a callback each; one that arrives faster than this replica
    reads it (the events pile up in the socket) gives fewer, larger deltas, so every hop
    after this one (NATS, the gateway, each client) handles fewer messages just when it
    is loaded. `TurnDelta` is "a piece of text"; a held delta's `emitted_at`
    is its first piece's, so the latency it reports is its oldest's.
    """

    nc: Client
    subject: str
    turn_id: str
    causation_id: UUID | None = None
    seq: int = 0
    # Set once the stream runs: after a stop nothing more is published.
    running: RunningTurn | None = None
    # What was published, the reply of a stopped stream (the SDK's own copy is lost
    # with the aborted call).
    pieces: list[str] = field(default_factory=list)
    # Whether a piece went out in this turn of the loop; the pieces held since, the time
    # of the first, and the task that publishes them once the provider waits.
    _sent_this_turn: bool = False
    _held: list[str] = field(default_factory=list)
    _held_at: float = 0.0
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
        if self._held or self._sent_this_turn:  # never ahead of a held piece
            if not self._held:
                self._held_at = emitted_at
                self._publishing = asyncio.create_task(self._publish_held())
            self._held.append(text)
            return
        self._sent_this_turn = True
        self._loop.call_soon(self._next_turn)
        await self._publish(text, emitted_at)

    async def flush(self) -> None:
        """Publish what is held now (the stream ended: its reply must not overtake it)."""
        if self._publishing is not None:
            await self._publishing

    def _next_turn(self) -> None:
        self._sent_this_turn = False

    async def _publish_held(self) -> None:
        held, self._held = self._held, []
        if not self.stopped:  # a stop drops what was held: the reply holds what went out
            await self._publish("".join(held), self._held_at)

    async def _publish(self, text: str, emitted_at: float) -> None:
        self.seq += 1
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
