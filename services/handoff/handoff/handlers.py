"""The handoff commands: check the request against the catalogue and the log, then run
one lifecycle use case in one transaction."""

from __future__ import annotations

from nats.aio.client import Client
from nats.aio.msg import Msg

from contracts import subjects
from contracts.events import Event, EventType
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
from domain.handoff import catalogue_agent, check_handoff_target
from handoff import lifecycle
from handoff.directory import SessionDirectory
from handoff.repository import HandoffRepository
from servicekit.consumer import Handler, Permanent
from servicekit.endpoint import Endpoints
from servicekit.provenance import confirm

SERVICE = "handoff"
VERSION = "0.1.0"


def build_endpoints(repo: HandoffRepository, sessions: SessionDirectory) -> Endpoints:
    """Every command of the handoff service, wired to `repo` and the log."""
    api = Endpoints(SERVICE, VERSION, "Handoffs between agents and the activation rule.")

    @api.command(subjects.HANDOFFS_OFFER, OfferHandoff)
    async def offer(cmd: OfferHandoff) -> OfferReply:
        check_handoff_target(cmd.from_agent, cmd.to_agent)
        await sessions.open_session(cmd.session_id, cmd.project_id)
        if cmd.artifact_id is not None:
            await sessions.require_artifact(cmd.artifact_id, cmd.project_id)
        async with repo.transaction() as tx:
            return await lifecycle.offer(tx, cmd)

    @api.command(subjects.HANDOFFS_OFFER_MANY, OfferMany)
    async def offer_many(cmd: OfferMany) -> OfferManyReply:
        for target in cmd.targets:
            check_handoff_target(cmd.from_agent, target.to_agent)
        await sessions.open_session(cmd.session_id, cmd.project_id)
        for artifact_id in {t.artifact_id for t in cmd.targets if t.artifact_id is not None}:
            await sessions.require_artifact(artifact_id, cmd.project_id)
        async with repo.transaction() as tx:
            return await lifecycle.offer_many(tx, cmd)

    @api.command(subjects.HANDOFFS_ACCEPT, HandoffDecision)
    async def accept(cmd: HandoffDecision) -> AcceptReply:
        await sessions.open_session(cmd.session_id)  # RN-581, asked of the log itself
        async with repo.transaction() as tx:
            return await lifecycle.accept(tx, cmd)

    @api.command(subjects.HANDOFFS_REJECT, HandoffDecision)
    async def reject(cmd: HandoffDecision) -> HandoffReply:
        async with repo.transaction() as tx:
            return HandoffReply(handoff=await lifecycle.reject(tx, cmd))

    @api.command(subjects.HANDOFFS_COMPLETE, HandoffDecision)
    async def complete(cmd: HandoffDecision) -> HandoffReply:
        async with repo.transaction() as tx:
            return HandoffReply(handoff=await lifecycle.complete(tx, cmd))

    @api.command(subjects.HANDOFFS_LIST, ListHandoffs)
    async def list_handoffs(cmd: ListHandoffs) -> HandoffsReply:
        return HandoffsReply(
            handoffs=await repo.list_handoffs(cmd.project_id, cmd.session_id, cmd.status)
        )

    @api.command(subjects.AGENTS_ACTIVATE, ActivateAgent)
    async def activate(cmd: ActivateAgent) -> ActivationReply:
        catalogue_agent(cmd.agent)
        await sessions.open_session(cmd.session_id, cmd.project_id)
        async with repo.transaction() as tx:
            return await lifecycle.activate(tx, cmd)

    @api.command(subjects.AGENTS_ACTIVE, ActiveAgents)
    async def active(cmd: ActiveAgents) -> ActiveAgentsReply:
        return ActiveAgentsReply(activations=await repo.active_in_project(cmd.project_id))

    return api


CLOSINGS = frozenset({EventType.SESSION_CLOSED, EventType.SESSION_CLOSED_ABNORMALLY})
CONSUMER = "handoff-session-closings"


def session_closings(repo: HandoffRepository, nc: Client) -> Handler:
    """The consumer of `session.closed*`: activity in a closed session ends.

    Only a closing the log confirms ends anything: a forged one on the bus is acked and
    ignored (`servicekit.provenance`), as is a real event of another type replayed on a
    closing subject.
    """

    async def on_closed(msg: Msg) -> None:
        try:
            event = Event.model_validate_json(msg.data)
        except ValueError as exc:
            raise Permanent(f"not an event: {exc}") from None
        if event.type not in CLOSINGS or await confirm(nc, event, consumer=CONSUMER) is None:
            return
        async with repo.transaction() as tx:
            await tx.lock_session(event.session_id)
            await tx.end_session(event.session_id)

    return on_closed
