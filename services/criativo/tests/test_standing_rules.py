"""Criativo reads only the rules that stand: what the person retracted or corrected is
gone from its later prompts and from the brief, against real NATS and Postgres."""

from __future__ import annotations

import uuid

from contracts.events import Event, EventType
from testkit.probes import wait_for

from .conftest import Driver


async def rules_of(bus: Driver, session: uuid.UUID) -> list[Event]:
    """The session's `artifact.business_rule` events (not the retractions the prefix
    `artifact.business_rule` also matches)."""
    kind = EventType.ARTIFACT_BUSINESS_RULE
    return [e for e in await bus.events(session, kind.value) if e.type is kind]


async def test_a_retracted_and_a_replaced_rule_leave_the_prompt_and_the_brief(
    bus: Driver,
) -> None:
    session = await bus.open()
    for said in ("RULE: Pickup only at the shop", "RULE: Orders close at 18h"):
        await bus.outcome(session, await bus.say(session, said))
    pickup, hours = await rules_of(bus, session)
    assert (pickup.payload["statement"], hours.payload["statement"]) == (
        "Pickup only at the shop",
        "Orders close at 18h",
    )

    # The person takes one rule back and corrects the other (the gateway's Remove and Edit).
    await bus.append(
        session, EventType.ARTIFACT_BUSINESS_RULE_RETRACTED.value, rule_id=str(pickup.id)
    )
    corrected = await bus.append(
        session,
        EventType.ARTIFACT_BUSINESS_RULE.value,
        title="Closing time",
        statement="Orders close at 19h on weekdays",
        origin=hours.payload["origin"],
        replaces=str(hours.id),
    )
    asked = len(bus.provider.requests)
    await bus.outcome(session, await bus.say(session, "What do we know so far?"))

    prompts = [r.system for r in bus.provider.requests[asked:]]  # each call of the turn
    assert prompts
    for prompt in prompts:
        assert f"[{corrected}] Closing time: Orders close at 19h on weekdays" in prompt
        for gone in (pickup, hours):
            assert str(gone.id) not in prompt
            assert str(gone.payload["statement"]) not in prompt

    await bus.ready(session)
    [brief] = await wait_for(
        lambda: bus.events(session, EventType.ARTIFACT_PRODUCT_BRIEF.value),
        timeout=30,
        what="brief",
    )
    # The brief rests on the rules standing: every rule in the log but the two retired
    # (the answer above may have recorded one more).
    recorded = [str(r.id) for r in await rules_of(bus, session)]
    standing = [r for r in recorded if r not in (str(pickup.id), str(hours.id))]
    assert str(corrected) in standing
    assert brief.payload["business_rule_ids"] == standing
