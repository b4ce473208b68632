"""The handoff to `po` after the brief, through an outbox (ADR 0008 decision 5).

Why an outbox and not a direct call: the offer must happen exactly once per
readiness even if this process dies anywhere between writing the brief and hearing
the handoff service's answer. The brief itself is appended with an idempotency key
derived from the readiness event (a retry gets the same event back), so after a crash
the redelivered readiness finds its brief in the log and only queues the offer. The
offer is queued in this service's schema together with a `processed_messages` claim
on the readiness id, in one transaction: a second attempt finds the claim and queues
nothing. The relay then calls `cmd.handoffs.offer` until it gets an answer; a repeat
of that call (a crash after the call, before the row's delete) is answered by ADR
0182's rules with the pending offer (`ja_oferecido`: same session, same brief) and
writes nothing. A repeated confirmation is a new readiness, hence a new brief, hence
a new offer that supersedes the pending one (`substituiu_oferta`).

An offer refused because PO is already active in the project (`agente_ja_ativo`) is
not a failure to retry: the person is told in the session (an `agent.error` with the
handoff service's message) and the brief stays in the log (ADR 0182, consequences).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from uuid import UUID

import asyncpg
from nats.aio.client import Client

from contracts import subjects
from contracts.handoff import OfferHandoff
from contracts.session_events import AppendEvent
from domain.criativo import CRIATIVO, offer_refused
from servicekit.consumer import claim_once
from servicekit.outbox import DELIVERED, CommandSender, Delivery, OutboxRow, Wake, with_outbox

OFFER_TARGET = "po"
CLAIMS = "criativo-offers"


async def queue_offer(
    pool: asyncpg.Pool,
    wake: Wake | None,
    project_id: str,
    session_id: UUID,
    readiness_id: UUID,
    brief_id: UUID,
) -> bool:
    """Queue the offer of `brief_id` to PO, once per readiness; False when already queued.
    `wake`: wakes the offer relay of this process once the offer is committed
    (`servicekit.outbox.with_outbox`)."""
    offer = OfferHandoff(
        project_id=project_id,
        session_id=session_id,
        from_agent=CRIATIVO,
        to_agent=OFFER_TARGET,
        artifact_id=brief_id,
    )
    async with with_outbox(pool, wake) as (conn, outbox):
        if not await claim_once(conn, CLAIMS, f"offer:{readiness_id}"):
            return False
        await outbox.send(
            subjects.HANDOFFS_OFFER,
            f"criativo:offer:{readiness_id}",
            offer.model_dump_json().encode(),
            ordering_key=str(session_id),
        )
    return True


class OfferSender:
    """Delivers queued offers (`cmd.handoffs.offer`); tells the person about a refusal."""

    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self._requests = CommandSender(nc)

    async def send(self, rows: Sequence[OutboxRow]) -> list[Delivery]:
        results = await self._requests.send(rows)
        return [await self._settle(row, result) for row, result in zip(rows, results, strict=True)]

    async def _settle(self, row: OutboxRow, result: Delivery) -> Delivery:
        refusal = result.refusal
        if not (result.permanent and refusal):
            return result
        offer = OfferHandoff.model_validate_json(row.body)
        told = offer_refused(offer.artifact_id, refusal.code, refusal.message, row.msg_id)
        if told is None:
            return result
        notice = AppendEvent(
            session_id=offer.session_id,
            type=told.type.value,
            actor=told.actor,
            payload=told.payload.model_dump(mode="json"),
            causation_id=told.causation_id,
            idempotency_key=told.idempotency_key,
        )
        sent = await self._requests.send([_as_row(row, notice)])
        return DELIVERED if sent[0].error is None else sent[0]


def _as_row(row: OutboxRow, event: AppendEvent) -> OutboxRow:
    return OutboxRow(
        id=row.id,
        subject=subjects.EVENTS_APPEND,
        msg_id=event.idempotency_key or row.msg_id,
        body=json.dumps(event.model_dump(mode="json")).encode(),
        headers=row.headers,
        attempts=row.attempts,
        ordering_key=None,
    )
