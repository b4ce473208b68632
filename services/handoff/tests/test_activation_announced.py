"""An activation is answered only once its `agent.activated` is in the log.

Otherwise a message typed right after "Start Criativo" can reach Criativo's consumer
and the plain chat before the log says Criativo is active, and be answered by the
plain chat. Nothing here waits for the outbox to drain: the log is read right after
the reply.
"""

from __future__ import annotations

from contracts import subjects
from contracts.handoff import AcceptReply, ActivateAgent, ActivationReply, HandoffDecision
from servicekit.client import call
from testkit.probes import log_events

from .conftest import Driver, offered_id

ACTIVATED = "agent.activated"


async def test_after_the_reply_to_activate_the_log_already_shows_the_activation(
    bus: Driver,
) -> None:
    for _ in range(5):  # several sessions: one lucky race would not make it pass
        session = await bus.open()
        reply = await call(
            bus.nc,
            subjects.AGENTS_ACTIVATE,
            ActivateAgent(project_id=bus.project, session_id=session, agent="criativo", via="user"),
            ActivationReply,
        )
        assert not reply.already_active
        [activated] = await log_events(bus.nc, session, ACTIVATED)
        assert activated.payload["agent"] == "criativo"
        # Asked again: already active, still one announcement.
        again = await call(
            bus.nc,
            subjects.AGENTS_ACTIVATE,
            ActivateAgent(project_id=bus.project, session_id=session, agent="criativo", via="user"),
            ActivationReply,
        )
        assert again.already_active
        assert len(await log_events(bus.nc, session, ACTIVATED)) == 1
        await bus.close(session)  # criativo is active in one session of a project at a time


async def test_after_the_reply_to_accept_the_log_already_shows_the_activation(
    bus: Driver,
) -> None:
    session = await bus.open()
    offer = await bus.offer(session, "po")
    reply = await call(
        bus.nc,
        subjects.HANDOFFS_ACCEPT,
        HandoffDecision(handoff_id=offered_id(offer), session_id=session, actor="user:ana"),
        AcceptReply,
    )
    assert reply.activation.agent == "po"
    types = [e.type.value for e in await log_events(bus.nc, session)]
    # In the order they were committed: the offer, its acceptance, the activation.
    assert types[-3:] == ["handoff.offered", "handoff.accepted", ACTIVATED]
