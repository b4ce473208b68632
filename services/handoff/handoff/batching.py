"""Offers to one target decided together: one transaction, one hold of the target's lock.

Every offer to a (project, target) takes the target's advisory lock (ADR 0182 decision
3), so concurrent offers to one target queue on it, each holding it for its own round
trips and commit (bench/handoff.py offer-1t: the lock is the throughput). Here the
offers to a target that arrive while a transaction for it is running wait for it to
end, then go together in the next one: `lifecycle.offer_together` decides them one
after another in arrival order, each against what the ones before it left, under one
hold of the lock, and writes them in one statement. The rules are those of separate
transactions in that order; a refused offer is answered its own error. Offers to other
targets never wait for this one (each target has its own queue).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from contracts.handoff import OfferHandoff, OfferReply
from handoff import lifecycle
from handoff.repository import HandoffRepository

# The most offers one transaction decides (the rest go in the next).
MAX_OFFERS_TOGETHER = 128


@dataclass
class _Queue:
    """The offers to one target waiting for the transaction in flight to end."""

    waiting: list[tuple[OfferHandoff, asyncio.Future[OfferReply]]] = field(default_factory=list)
    runner: asyncio.Task[None] | None = None


class OfferBatcher:
    """One queue per (project, target), drained by one transaction at a time."""

    def __init__(self, repo: HandoffRepository) -> None:
        self._repo = repo
        self._queues: dict[tuple[str, str], _Queue] = {}

    async def offer(self, cmd: OfferHandoff) -> OfferReply:
        """The reply to `cmd`, once the transaction that decided it committed."""
        key = (cmd.project_id, cmd.to_agent)
        queue = self._queues.setdefault(key, _Queue())
        answer: asyncio.Future[OfferReply] = asyncio.get_running_loop().create_future()
        queue.waiting.append((cmd, answer))
        if queue.runner is None:
            queue.runner = asyncio.create_task(self._drain(key, queue))
        return await answer

    async def _drain(self, key: tuple[str, str], queue: _Queue) -> None:
        """Decide the target's waiting offers, a transaction at a time, until none is left."""
        try:
            while queue.waiting:
                batch = queue.waiting[:MAX_OFFERS_TOGETHER]
                del queue.waiting[:MAX_OFFERS_TOGETHER]
                await self._decide([cmd for cmd, _ in batch], [a for _, a in batch])
        finally:
            del self._queues[key]

    async def _decide(
        self, cmds: list[OfferHandoff], answers: list[asyncio.Future[OfferReply]]
    ) -> None:
        replies: list[OfferReply | Exception]
        try:
            async with self._repo.transaction() as tx:
                replies = [*await lifecycle.offer_together(tx, cmds)]
        except Exception as exc:  # nothing was committed: each offer gets the error
            replies = [exc] * len(cmds)
        for answer, reply in zip(answers, replies, strict=True):
            if answer.done():  # its request was cancelled
                continue
            if isinstance(reply, Exception):
                answer.set_exception(reply)
            else:
                answer.set_result(reply)
