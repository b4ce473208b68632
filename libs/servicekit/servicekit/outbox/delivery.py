"""What a relay hands its sender and hears back: claimed rows (`OutboxRow`), what became
of each (`Delivery`), and the per-key order every sender keeps — a key's rows go in the
order they were written, and a failure holds back the rows of its key behind it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from contracts.common import ErrorBody

# How long a sender waits for a receiver's answer; a row unanswered by then is retried.
SEND_TIMEOUT_SECONDS = 5.0


@dataclass(frozen=True)
class OutboxRow:
    """A claimed outbox row."""

    id: int
    subject: str
    msg_id: str
    body: bytes
    headers: dict[str, str]
    attempts: int
    ordering_key: str | None


@dataclass(frozen=True)
class Delivery:
    """What became of one row: delivered (no error), to retry, or never deliverable."""

    error: str | None = None
    permanent: bool = False
    # The receiver's error reply, when it answered with one: its code is branched on
    # as a value, never parsed back out of `error`.
    refusal: ErrorBody | None = None


DELIVERED = Delivery()
HELD_BACK = Delivery("waiting for an earlier row of the same key")


# Delivers rows (a key's, or many keys'), a Delivery each, in the order given.
DeliverRows = Callable[[Sequence[OutboxRow]], Awaitable[list[Delivery]]]


class Sender(Protocol):
    """Delivers claimed rows, in order, and says what became of each."""

    async def send(self, rows: Sequence[OutboxRow]) -> list[Delivery]: ...


def key_chains(rows: Sequence[OutboxRow]) -> list[list[int]]:
    """The indexes of `rows` by ordering key, each key's in the order written; a row
    without a key is a chain of its own."""
    chains: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        chains.setdefault(row.ordering_key or f"#row{i}", []).append(i)
    return list(chains.values())


async def one_after_another(
    chain: Sequence[OutboxRow], deliver: Callable[[OutboxRow], Awaitable[Delivery]]
) -> list[Delivery]:
    """Deliver a key's rows one after another; a row that failed (and may succeed later)
    holds the rest back, so the receiver sees them in the order they were written."""
    results: list[Delivery] = [HELD_BACK] * len(chain)
    for i, row in enumerate(chain):
        results[i] = await deliver(row)
        if results[i].error is not None and not results[i].permanent:
            break  # the rest stay HELD_BACK, retried after this one
    return results


async def in_key_order(
    rows: Sequence[OutboxRow],
    deliver_chain: DeliverRows,
) -> list[Delivery]:
    """Deliver each key's rows with `deliver_chain` (which keeps their order and holds
    back what follows a failure) and different keys in parallel; a stalled receiver
    costs one timeout per batch, not one per row."""
    results: list[Delivery] = [HELD_BACK] * len(rows)

    async def deliver(indexes: list[int]) -> None:
        delivered = await deliver_chain([rows[i] for i in indexes])
        for i, delivery in zip(indexes, delivered, strict=True):
            results[i] = delivery

    await asyncio.gather(*(deliver(chain) for chain in key_chains(rows)))
    return results
