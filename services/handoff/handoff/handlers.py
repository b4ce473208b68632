"""The handoff commands: check the request against the catalogue and the log, then run
one lifecycle use case in one transaction."""

from __future__ import annotations

from uuid import UUID

from nats.aio.client import Client

from contracts import catalog, streams
from contracts.catalog import SESSION_CLOSINGS_FILTER
from contracts.common import ErrorCode
from contracts.events import SESSION_CLOSINGS, Event
from contracts.handoff import (
    AcceptReply,
    ActivateAgent,
    ActivationReply,
    ActiveAgents,
    ActiveAgentsReply,
    HandoffDecision,
    HandoffReply,
    HandoffsReply,
    ListHandoffs,
    OfferHandoff,
    OfferMany,
    OfferManyReply,
    OfferReply,
)
from domain.errors import DomainError
from domain.handoff import catalogue_agent, check_handoff_target
from handoff import lifecycle
from handoff.batching import OfferBatcher
from handoff.directory import OPEN_FOR_SECONDS, SessionDirectory
from handoff.repository import HandoffRepository
from servicekit.consumer import ConsumerSpec
from servicekit.outbox import OutboxRelay
from servicekit.provenance import confirm
from servicekit.service import Service

# How long an activation waits for the log to confirm its announcement (under the
# callers' 5 s request timeout).
ANNOUNCE_TIMEOUT_SECONDS = 4.0
SERVICE = "handoff"
VERSION = "0.1.0"
svc = Service(
    SERVICE,
    VERSION,
    "Handoffs between agents and the activation rule.",
    schema="handoff",
    migrations=["handoff.migrations"],
)


@svc.command(catalog.HANDOFFS_OFFER)
async def offer(cmd: OfferHandoff, offers: OfferBatcher, sessions: SessionDirectory) -> OfferReply:
    check_handoff_target(cmd.from_agent, cmd.to_agent)
    await sessions.open_session(cmd.session_id, cmd.project_id, open_for=OPEN_FOR_SECONDS)
    if cmd.artifact_id is not None:
        await sessions.require_artifact(cmd.artifact_id, cmd.project_id)
    return await offers.offer(cmd)


@svc.command(catalog.HANDOFFS_OFFER_MANY)
async def offer_many(
    cmd: OfferMany, repo: HandoffRepository, sessions: SessionDirectory
) -> OfferManyReply:
    for target in cmd.targets:
        check_handoff_target(cmd.from_agent, target.to_agent)
    await sessions.open_session(cmd.session_id, cmd.project_id, open_for=OPEN_FOR_SECONDS)
    for artifact_id in {t.artifact_id for t in cmd.targets if t.artifact_id is not None}:
        await sessions.require_artifact(artifact_id, cmd.project_id)
    async with repo.transaction() as tx:
        return await lifecycle.offer_many(tx, cmd)


async def in_the_log(relay: OutboxRelay, session_id: UUID) -> None:
    """Return once the session's events this service committed are in the log.

    An activation is answered only when its `agent.activated` is in the log: a message
    typed right after "Start Criativo" must find the agent active there, not be answered
    by the plain chat. The rows are delivered now, in order, and the log's reply to each
    append is its confirmation; the relay stays the backstop."""
    if not await relay.deliver_now(str(session_id), ANNOUNCE_TIMEOUT_SECONDS):
        raise DomainError(
            ErrorCode.UNAVAILABLE,
            f"the activation in session {session_id} is committed but the log has not "
            "confirmed its announcement yet; retry (a repeat is answered already_active)",
            session_id=str(session_id),
        )


@svc.command(catalog.HANDOFFS_ACCEPT)
async def accept(
    cmd: HandoffDecision, repo: HandoffRepository, sessions: SessionDirectory, relay: OutboxRelay
) -> AcceptReply:
    await sessions.open_session(cmd.session_id)  # RN-581, asked of the log itself
    async with repo.transaction() as tx:
        reply = await lifecycle.accept(tx, cmd)
    await in_the_log(relay, reply.handoff.session_id)
    return reply


@svc.command(catalog.HANDOFFS_REJECT)
async def reject(cmd: HandoffDecision, repo: HandoffRepository) -> HandoffReply:
    async with repo.transaction() as tx:
        return HandoffReply(handoff=await lifecycle.reject(tx, cmd))


@svc.command(catalog.HANDOFFS_COMPLETE)
async def complete(cmd: HandoffDecision, repo: HandoffRepository) -> HandoffReply:
    async with repo.transaction() as tx:
        return HandoffReply(handoff=await lifecycle.complete(tx, cmd))


@svc.command(catalog.HANDOFFS_LIST)
async def list_handoffs(cmd: ListHandoffs, repo: HandoffRepository) -> HandoffsReply:
    return HandoffsReply(
        handoffs=await repo.list_handoffs(cmd.project_id, cmd.session_id, cmd.status)
    )


@svc.command(catalog.AGENTS_ACTIVATE)
async def activate(
    cmd: ActivateAgent, repo: HandoffRepository, sessions: SessionDirectory, relay: OutboxRelay
) -> ActivationReply:
    catalogue_agent(cmd.agent)
    await sessions.open_session(cmd.session_id, cmd.project_id)
    async with repo.transaction() as tx:
        reply = await lifecycle.activate(tx, cmd)
    await in_the_log(relay, cmd.session_id)
    return reply


@svc.command(catalog.AGENTS_ACTIVE)
async def active(cmd: ActiveAgents, repo: HandoffRepository) -> ActiveAgentsReply:
    return ActiveAgentsReply(activations=await repo.active_in_project(cmd.project_id))


CONSUMER = "handoff-session-closings"
CLOSINGS = ConsumerSpec(
    durable=CONSUMER,
    stream=streams.EVENTS.name,
    filter_subjects=list(SESSION_CLOSINGS_FILTER),
)


@svc.subscribe(CLOSINGS)
async def session_closed(event: Event, repo: HandoffRepository, nc: Client) -> None:
    """The consumer of `session.closed*`: activity in a closed session ends.

    Only a closing the log confirms ends anything: a forged one on the bus is acked and
    ignored (`servicekit.provenance`), as is a real event of another type replayed on a
    closing subject.
    """
    if event.type not in SESSION_CLOSINGS or await confirm(nc, event, consumer=CONSUMER) is None:
        return
    async with repo.transaction() as tx:
        await tx.lock_session(event.session_id)
        await tx.end_session(event.session_id)
