"""Offers decided together: one transaction for the offers that wait while another runs.

Every offer takes its target's advisory lock (ADR 0182 decision 3) and commits, so
offers one at a time cost a transaction each, and concurrent offers to one target hold
its lock one after another, each for its own round trips and commit (bench/handoff.py:
at one target the lock is the throughput, at many the transactions are the CPU). Here
the offers that arrive while a transaction runs go together in the next one:
`lifecycle.offer_together` decides each target's offers one after another in arrival
order under one hold of its lock, and writes them all in one statement. The rules are
those of separate transactions in that order; a refused offer is answered its own error.

That transaction waits for no lock: a target whose lock is held elsewhere (another
replica, an accept) is left out, and its offers wait for the lock in a transaction of
their own, one per target, as do the later offers to it meanwhile, so an offer to one
target never waits for another target's lock.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from contracts.handoff import OfferHandoff, OfferReply
from handoff import lifecycle
from handoff.repository import HandoffRepository

# The most offers one transaction decides (the rest go in the next).
MAX_OFFERS_TOGETHER = 128

Waiting = tuple[OfferHandoff, asyncio.Future[OfferReply]]


@dataclass
class _Queue:
    """Offers waiting for the transaction in flight to end, and the task deciding them."""

    waiting: list[Waiting] = field(default_factory=list)
    runner: asyncio.Task[None] | None = None


class OfferBatcher:
    """The offers of this process, decided a transaction at a time, plus one queue per
    target whose lock was found held elsewhere."""

    def __init__(self, repo: HandoffRepository) -> None:
        self._repo = repo
        self._all = _Queue()
        self._held: dict[tuple[str, str], _Queue] = {}

    async def offer(self, cmd: OfferHandoff) -> OfferReply:
        """The reply to `cmd`, once the transaction that decided it committed."""
        answer: asyncio.Future[OfferReply] = asyncio.get_running_loop().create_future()
        held = self._held.get((cmd.project_id, cmd.to_agent))
        if held is not None:  # behind the earlier offers to its target
            held.waiting.append((cmd, answer))
        else:
            self._enqueue(self._all, (cmd, answer), self._decide_all)
        return await answer

    @staticmethod
    def _enqueue(
        queue: _Queue, offer: Waiting, runner: Callable[[], Coroutine[Any, Any, None]]
    ) -> None:
        queue.waiting.append(offer)
        if queue.runner is None:
            queue.runner = asyncio.create_task(runner())

    async def _decide_all(self) -> None:
        """Decide the waiting offers, a transaction at a time, without waiting for locks."""
        try:
            while batch := _take(self._all):
                for cmd, answer in await self._decide(batch, wait=False):
                    key = (cmd.project_id, cmd.to_agent)
                    held = self._held.setdefault(key, _Queue())
                    self._enqueue(held, (cmd, answer), partial(self._decide_held, key, held))
        finally:
            self._all.runner = None

    async def _decide_held(self, key: tuple[str, str], queue: _Queue) -> None:
        """Decide the offers to one target, a transaction at a time, waiting for its lock."""
        try:
            while batch := _take(queue):
                await self._decide(batch, wait=True)
        finally:
            del self._held[key]

    async def _decide(self, batch: list[Waiting], wait: bool) -> list[Waiting]:
        """Decide and answer `batch` in one transaction; return the offers left undecided
        (their target's lock was held, and `wait` false)."""
        replies: list[OfferReply | Exception | None]
        try:
            async with self._repo.transaction() as tx:
                replies = [*await lifecycle.offer_together(tx, [c for c, _ in batch], wait)]
        except Exception as exc:  # nothing was committed: each offer gets the error
            replies = [exc] * len(batch)
        undecided: list[Waiting] = []
        for (cmd, answer), reply in zip(batch, replies, strict=True):
            if reply is None:
                undecided.append((cmd, answer))
            elif answer.done():  # its request was cancelled
                continue
            elif isinstance(reply, Exception):
                answer.set_exception(reply)
            else:
                answer.set_result(reply)
        return undecided


def _take(queue: _Queue) -> list[Waiting]:
    batch = queue.waiting[:MAX_OFFERS_TOGETHER]
    del queue.waiting[:MAX_OFFERS_TOGETHER]
    return batch
