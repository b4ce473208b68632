"""The sender of queued commands: each row is a request to the service that owns its
subject — the session log's `cmd.events.append`, the handoff service's
`cmd.handoffs.offer` — and the reply says what became of it.

A failure a later attempt may cure (a timeout, no responders, the log `unavailable`) is
retried by the relay with backoff for as long as it takes; a coded refusal that can never
succeed (`invalid_request`, `invalid_payload`, `malformed_json`…) is permanent, and the
relay dead-letters the row, so it neither blocks its key for ever nor disappears. An
`internal` answer is a bug of the receiver that a retry may or may not cure: retried
`MAX_INTERNAL_ATTEMPTS` times, then permanent like a refusal, so one poison row cannot
stall its session for good.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from nats.aio.client import Client
from nats.errors import NoRespondersError

from contracts import subjects
from contracts.common import ErrorBody, ErrorCode
from contracts.session_events import APPEND_MANY_MAX
from servicekit.outbox.delivery import (
    DELIVERED,
    HELD_BACK,
    SEND_TIMEOUT_SECONDS,
    Delivery,
    OutboxRow,
    in_key_order,
    key_chains,
    one_after_another,
)
from servicekit.telemetry import request_span

# Error codes of the log that a later attempt may not get.
TRANSIENT_CODES = frozenset({ErrorCode.UNAVAILABLE.value, ErrorCode.INTERNAL.value})
# How often a row the log answers `internal` is tried before it is dead-lettered.
MAX_INTERNAL_ATTEMPTS = 8
# A `cmd.events.append_many` request's events, in bytes: under the log's request limit
# (servicekit.endpoint.MAX_REQUEST_BYTES) and the server's max_payload, with room to
# spare for the envelope and the headers.
MAX_APPEND_MANY_BYTES = 1024 * 1024 - 16 * 1024
APPEND_MANY_SLACK_BYTES = 16 * 1024


class CommandSender:
    """Sends rows as the commands they name and reads the replies: each key's rows in the
    order written, keys in parallel.

    Events for the log (`cmd.events.append` rows) go many to a request,
    `cmd.events.append_many`: a claim costs one round trip and one group commit of the
    log instead of one of each per row. The log writes them in the order sent, answers
    each on its own (a refused row is dead-lettered with its code, the rest go in), and
    holds a session's later events back behind one it failed to write, so a key's order
    holds as with one request per row. Requests go one after another, and a key that
    failed in one sends nothing more in the next. (The log cannot know that a row it
    answered `internal` is given up here, `MAX_INTERNAL_ATTEMPTS`: the rows it held back
    behind it go at their retry.) The request continues the trace of its
    first row. A key that also holds other commands (Criativo's offers) sends one request
    per row, in order; so do all when no log serves `append_many` (an older one).
    """

    def __init__(self, nc: Client) -> None:
        self._nc = nc

    async def send(self, rows: Sequence[OutboxRow]) -> list[Delivery]:
        results: list[Delivery] = [HELD_BACK] * len(rows)
        together: list[int] = []
        one_by_one: list[list[int]] = []
        for chain in key_chains(rows):
            if all(rows[i].subject == subjects.EVENTS_APPEND for i in chain):
                together += chain
            else:
                one_by_one.append(chain)

        async def deliver(
            indexes: list[int], how: Callable[..., Awaitable[list[Delivery]]]
        ) -> None:
            for i, delivery in zip(indexes, await how([rows[i] for i in indexes]), strict=True):
                results[i] = delivery

        together.sort()  # the order written, which keeps each key's
        await asyncio.gather(
            deliver(together, self._append_many),
            *(deliver(chain, self._one_after_another) for chain in one_by_one),
        )
        return results

    async def _one_after_another(self, chain: Sequence[OutboxRow]) -> list[Delivery]:
        return await one_after_another(chain, self._request)

    async def _append_many(self, rows: Sequence[OutboxRow]) -> list[Delivery]:
        results: list[Delivery] = [HELD_BACK] * len(rows)
        failed: set[str] = set()  # keys whose later rows wait for a retry
        for piece in self._pieces(rows):
            sent = [i for i in piece if _key(rows[i]) not in failed]
            if not sent:
                continue
            delivered = await self._append_piece([rows[i] for i in sent])
            for i, delivery in zip(sent, delivered, strict=True):
                results[i] = delivery
                if delivery.error is not None and not delivery.permanent:
                    failed.add(_key(rows[i]))
        return results

    def _pieces(self, rows: Sequence[OutboxRow]) -> list[list[int]]:
        """`rows` in order, cut into requests the log takes: at most `APPEND_MANY_MAX`
        events and `MAX_APPEND_MANY_BYTES` (a larger row goes alone, and is answered
        `payload_too_large` as its own request would be)."""
        limit = min(MAX_APPEND_MANY_BYTES, self._nc.max_payload - APPEND_MANY_SLACK_BYTES)
        pieces: list[list[int]] = []
        size = 0
        for i, row in enumerate(rows):
            if not pieces or len(pieces[-1]) >= APPEND_MANY_MAX or size + len(row.body) > limit:
                pieces.append([])
                size = 0
            pieces[-1].append(i)
            size += len(row.body) + 1
        return pieces

    async def _append_piece(self, rows: Sequence[OutboxRow]) -> list[Delivery]:
        body = b'{"events":[' + b",".join(r.body for r in rows) + b"]}"
        try:
            with request_span(subjects.EVENTS_APPEND_MANY, rows[0].headers) as headers:
                reply = await self._nc.request(
                    subjects.EVENTS_APPEND_MANY,
                    body,
                    timeout=SEND_TIMEOUT_SECONDS,
                    headers=headers,
                )
        except NoRespondersError:  # no log serves it (an older one): a request per row
            return await in_key_order(rows, self._one_after_another)
        except Exception as exc:
            return [Delivery(repr(exc) or type(exc).__name__)] * len(rows)
        answer = json.loads(reply.data)
        if "error" in answer:
            if answer["error"]["code"] in TRANSIENT_CODES:
                return [_answered(row, answer["error"]) for row in rows]
            # Refused whole (a row that is not even JSON): one request per row finds
            # the one to dead-letter, and the others go in.
            return await in_key_order(rows, self._one_after_another)
        return [
            DELIVERED if outcome.get("error") is None else _answered(row, outcome["error"])
            for row, outcome in zip(rows, answer["results"], strict=True)
        ]

    async def _request(self, row: OutboxRow) -> Delivery:
        try:
            with request_span(row.subject, row.headers) as headers:
                reply = await self._nc.request(
                    row.subject, row.body, timeout=SEND_TIMEOUT_SECONDS, headers=headers
                )
        except Exception as exc:
            return Delivery(repr(exc) or type(exc).__name__)
        if not reply.data.startswith(b'{"error":'):
            return DELIVERED
        return _answered(row, json.loads(reply.data)["error"])


def _key(row: OutboxRow) -> str:
    return row.ordering_key or f"#{row.id}"


def _answered(row: OutboxRow, error: dict[str, Any]) -> Delivery:
    """What the receiver's coded error means for `row`: retry, or never (dead letter)."""
    code = error["code"]
    gave_up = code == ErrorCode.INTERNAL and row.attempts + 1 >= MAX_INTERNAL_ATTEMPTS
    return Delivery(
        f"{code}: {error['message']}",
        permanent=code not in TRANSIENT_CODES or gave_up,
        refusal=ErrorBody(code=code, message=error["message"], details=error.get("details") or {}),
    )
