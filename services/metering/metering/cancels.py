"""Stopping a running stream: the person's Stop button.

`cmd.llm.cancel` reaches one replica (the queue group picks it), but the stream runs
on whichever replica took its `cmd.llm.stream`. So the receiving replica tells every
replica on `metering.turn_cancelled` (core NATS, like `bindings_changed`), and each
one looks the turn up among the streams it runs. Rules kept here:

- a cancel stops a turn only when turn id, project and session all match, so a cancel
  naming another project or session never touches a turn;
- a cancel that arrives before its stream has started (the broadcast overtook the
  stream request, or the hold was still being taken) is remembered for `ttl_seconds`,
  and the stream is stopped as it starts, before the provider is called;
- a stream the provider already finished is not stopped: it is reported as usual;
- nothing here runs per delta: a publisher checks `RunningTurn.stopped`, a flag.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pydantic import ValidationError

from contracts import subjects
from contracts.metering import CancelTurn
from servicekit.logs import get_logger

log = get_logger(__name__)

# A cancel is remembered only to win the race with its own stream's start: seconds, not
# minutes, would do; a minute covers a stream request queued behind a slow hold.
DEFAULT_TTL_SECONDS = 60.0
# Remembered cancels are bounded, so a flood of cancels for turns that never start
# cannot grow a replica's memory without limit (the oldest are forgotten first).
MAX_REMEMBERED = 10_000

TurnKey = tuple[str, str, UUID | None]


@dataclass(eq=False)
class RunningTurn:
    """A stream this replica runs: the task calling the provider, and whether it was stopped."""

    key: TurnKey
    task: asyncio.Future[Any]
    stopped: bool = False

    def stop(self) -> bool:
        """Abort the provider call; False when it had already finished (reported as usual)."""
        if self.task.done():
            return False
        # The flag first: no delta of this turn is published from here on, whatever the
        # provider does while it unwinds.
        self.stopped = True
        # Cancelling the task closes the provider's HTTP stream (the SDK closes the
        # response, it does not drain it) or interrupts the scripted emitter.
        self.task.cancel()
        return True


class Cancellations:
    """The streams one replica runs, and the cancels it heard for streams not yet started."""

    def __init__(
        self,
        ttl_seconds: float = DEFAULT_TTL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        max_remembered: int = MAX_REMEMBERED,
    ) -> None:
        self._ttl = ttl_seconds
        self._clock = clock
        self._max = max_remembered
        self._running: dict[str, RunningTurn] = {}
        # key -> when it is forgotten; insertion order is expiry order (one TTL for all)
        self._early: OrderedDict[TurnKey, float] = OrderedDict()
        self.heard = 0  # cancels this replica heard announced (for tests and logs)
        self.stopped = 0  # streams this replica stopped

    def start(
        self, turn_id: str, project_id: str, session_id: UUID | None, task: asyncio.Future[Any]
    ) -> RunningTurn:
        """Register a stream as it starts; stopped at once if its cancel came first."""
        turn = RunningTurn((turn_id, project_id, session_id), task)
        self._running[turn_id] = turn
        self._forget_expired()
        if self._early.pop(turn.key, None) is not None:
            log.info("turn_cancelled_before_start", turn_id=turn_id)
            self._stop(turn)
        return turn

    def finish(self, turn: RunningTurn) -> None:
        """The stream ended (finished, failed or stopped): a later cancel finds nothing."""
        if self._running.get(turn.key[0]) is turn:
            del self._running[turn.key[0]]

    def cancel(self, order: CancelTurn) -> None:
        """Stop the stream `order` names if it runs here; remember it if it runs nowhere yet.

        Every replica remembers a cancel for a turn it does not run: the one whose
        stream request is still on its way is not known in advance.
        """
        key: TurnKey = (order.turn_id, order.project_id, order.session_id)
        turn = self._running.get(order.turn_id)
        if turn is not None:
            if turn.key == key:
                self._stop(turn)
            else:
                log.warning(
                    "turn_cancel_mismatch",
                    turn_id=order.turn_id,
                    project_id=order.project_id,
                    session_id=str(order.session_id),
                )
            return
        self._forget_expired()
        self._early[key] = self._clock() + self._ttl
        self._early.move_to_end(key)
        while len(self._early) > self._max:
            self._early.popitem(last=False)

    def running(self, turn_id: str) -> bool:
        """Whether this replica runs the stream `turn_id` now."""
        return turn_id in self._running

    def _stop(self, turn: RunningTurn) -> None:
        if turn.stop():
            self.stopped += 1
            log.info("turn_cancelled", turn_id=turn.key[0])

    def _forget_expired(self) -> None:
        now = self._clock()
        while self._early:
            key, expires = next(iter(self._early.items()))
            if expires > now:
                return
            del self._early[key]

    async def announce(self, nc: Client, order: CancelTurn) -> None:
        """Tell every replica (this one included) to stop the turn `order` names."""
        await nc.publish(subjects.TURN_CANCELLED, order.model_dump_json().encode())

    async def subscribe(self, nc: Client) -> Subscription:
        """Listen to every replica's announcements (not a queue group: all of them hear it)."""

        async def on_cancel(msg: Msg) -> None:
            try:
                order = CancelTurn.model_validate_json(msg.data)
            except ValidationError as exc:  # only metering publishes here; never crash on it
                log.warning("turn_cancel_unreadable", error=str(exc)[:500])
                return
            self.heard += 1
            self.cancel(order)

        sub = await nc.subscribe(subjects.TURN_CANCELLED, cb=on_cancel)
        await nc.flush()  # the server knows the subscription before any cancel is served
        return sub
