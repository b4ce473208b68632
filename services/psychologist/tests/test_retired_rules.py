"""The analysis reads the project's rules as the log holds them: a rule the person took
back in an earlier session, or corrected in this one, is marked as no longer standing
(real NATS, real Postgres, metering's scripted provider)."""

from __future__ import annotations

import uuid

from contracts import subjects
from contracts.events import EventType
from contracts.session_events import AppendedReply, AppendEvent
from servicekit.client import call

from .conftest import Driver


async def appended(
    bus: Driver, session: uuid.UUID, kind: EventType, actor: str, payload: dict[str, object]
) -> uuid.UUID:
    request = AppendEvent(session_id=session, type=kind.value, actor=actor, payload=payload)
    return (await call(bus.nc, subjects.EVENTS_APPEND, request, AppendedReply)).event_id


async def recorded(bus: Driver, session: uuid.UUID, title: str) -> uuid.UUID:
    said = await bus.say(session, title)
    rule: dict[str, object] = {"title": title, "statement": f"{title}.", "origin": [str(said)]}
    return await appended(bus, session, EventType.ARTIFACT_BUSINESS_RULE, "agent:criativo", rule)


async def test_retracted_and_replaced_rules_reach_the_analysis_marked(bus: Driver) -> None:
    earlier = await bus.open()
    cash = await recorded(bus, earlier, "Cash only")
    session = await bus.open()
    await appended(
        bus,
        session,
        EventType.ARTIFACT_BUSINESS_RULE_RETRACTED,
        "user:ana",
        {"rule_id": str(cash), "reason": "cards are fine"},
    )
    hours = await recorded(bus, session, "Orders close at 18h")
    await appended(
        bus,
        session,
        EventType.ARTIFACT_BUSINESS_RULE,
        "user:ana",
        {
            "title": "Closing time",
            "statement": "19h.",
            "origin": [str(uuid.uuid4())],
            "replaces": str(hours),
        },
    )
    await recorded(bus, session, "Pickup only")
    asked = len(bus.provider.requests)
    await bus.close(session)
    await bus.outcome(session)

    first = bus.provider.requests[asked].messages[0].content
    assert isinstance(first, str)
    rules = first.split("# Business rules of the project\n")[1].split("\n\n")[0].splitlines()
    assert rules == [
        "- Cash only: Cash only. — NO LONGER STANDS: the person retracted it (cards are fine)",
        "- Orders close at 18h: Orders close at 18h. (recorded in this session) — NO LONGER "
        "STANDS: the person replaced it with 'Closing time'",
        "- Closing time: 19h. (recorded in this session) — the person's correction of an "
        "earlier rule",
        "- Pickup only: Pickup only. (recorded in this session)",
    ]
