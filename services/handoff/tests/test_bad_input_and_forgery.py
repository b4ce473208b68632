"""Issue 11 against the real handoff service and log: bad bytes refused at the door, a
poison outbox row dead-lettered without blocking its session, forged closings ignored."""

from __future__ import annotations

import json
import uuid

import pytest

from contracts import subjects
from contracts.common import ErrorCode
from contracts.events import EventType
from contracts.handoff import (
    ActiveAgents,
    ActiveAgentsReply,
    HandoffDecision,
    HandoffReply,
)
from handoff.handlers import CONSUMER
from servicekit import metrics, provenance
from servicekit.client import call
from testkit.forgeries import forged_closing, forgeries_acked, publish_forged
from testkit.probes import wait_for

from .conftest import Driver
from .test_offer_lifecycle import activate

VERBS = [subjects.HANDOFFS_ACCEPT, subjects.HANDOFFS_REJECT, subjects.HANDOFFS_COMPLETE]


@pytest.mark.parametrize("subject", VERBS)
async def test_a_nul_in_a_decisions_reason_is_refused_and_nothing_changes(
    bus: Driver, subject: str
) -> None:
    s = await bus.open()
    offer = await bus.offer(s, artifact=await bus.artifact(s))
    assert offer.handoff is not None
    request = {
        "handoff_id": str(offer.handoff.id),
        "session_id": str(s),
        "actor": "user:ana",
        "reason": "because\u0000",
    }

    reply = await bus.nc.request(subject, json.dumps(request).encode(), timeout=5)

    error = json.loads(reply.data)["error"]
    assert error["code"] == ErrorCode.INVALID_REQUEST
    assert "reason:" in error["message"] and "NUL" in error["message"]
    [row] = await bus.rows()
    assert row["status"] == "offered"
    transitions = [e.type for e in await bus.events(s, "handoff.")]
    assert transitions == [EventType.HANDOFF_OFFERED]


def dead_letters(subject: str) -> float:
    return metrics.value("agentbus_dead_letters_total", consumer="outbox", subject=subject)


async def test_a_poison_outbox_row_is_dead_lettered_and_later_events_of_its_session_flow(
    bus: Driver,
) -> None:
    s = await bus.open()
    offer = await bus.offer(s, artifact=await bus.artifact(s))
    assert offer.handoff is not None
    await bus.settled()
    # What an older build let through: a `handoff.rejected` whose reason the log refuses.
    poison = json.dumps(
        {
            "session_id": str(s),
            "type": EventType.HANDOFF_REJECTED.value,
            "actor": "user:ana",
            "payload": {
                "handoff_id": str(offer.handoff.id),
                "to_agent": "po",
                "reason": "x\u0000",
            },
            "idempotency_key": f"handoff:poison-{uuid.uuid4()}",
        }
    ).encode()
    before = dead_letters(subjects.EVENTS_APPEND)
    await bus.db.execute(
        "INSERT INTO handoff.outbox (subject, msg_id, body, ordering_key) VALUES ($1, $2, $3, $4)",
        subjects.EVENTS_APPEND,
        "poison",
        poison,
        str(s),
    )

    # A later event of the same session, written the ordinary way.
    rejected = await call(
        bus.nc,
        subjects.HANDOFFS_REJECT,
        HandoffDecision(handoff_id=offer.handoff.id, session_id=s, actor="user:ana"),
        HandoffReply,
    )

    assert rejected.handoff.status == "rejected"
    types = [e.type for e in await bus.events(s, "handoff.")]  # waits for the outbox to drain
    assert types == [EventType.HANDOFF_OFFERED, EventType.HANDOFF_REJECTED]
    [dead] = await bus.db.fetch(
        "SELECT consumer, subject, reason, body FROM handoff.dead_letters WHERE msg_id = 'poison'"
    )
    assert (dead["consumer"], dead["subject"]) == ("outbox", subjects.EVENTS_APPEND)
    assert dead["reason"].startswith(ErrorCode.INVALID_REQUEST)
    assert dead["body"] == poison
    assert dead_letters(subjects.EVENTS_APPEND) >= before + 1


async def active_agents(bus: Driver) -> list[tuple[uuid.UUID, str]]:
    reply = await call(
        bus.nc, subjects.AGENTS_ACTIVE, ActiveAgents(project_id=bus.project), ActiveAgentsReply
    )
    return [(a.session_id, a.agent) for a in reply.activations]


async def test_a_forged_closing_ends_nothing_and_a_real_one_after_it_does(bus: Driver) -> None:
    s = await bus.open()
    await activate(bus, s, "criativo", "user")
    real_opening = (await bus.events(s))[0]
    ignored = sum(provenance.FORGED_EVENTS.values())
    forgeries = [
        forged_closing(bus.project, s),  # the session is still open
        forged_closing(bus.project, uuid.uuid4()),  # no such session
        # a real event's id, retyped as a closing by another actor
        forged_closing(bus.project, s, id=real_opening.id, seq=1),
    ]

    for event in forgeries:
        await publish_forged(bus.nc, event)

    await wait_for(lambda: sum(provenance.FORGED_EVENTS.values()) >= ignored + len(forgeries))
    await forgeries_acked(bus.nc, bus.db, CONSUMER, "handoff")
    assert await active_agents(bus) == [(s, "criativo")]

    await bus.close(s)

    async def ended() -> bool:
        return await active_agents(bus) == []

    await wait_for(ended)
