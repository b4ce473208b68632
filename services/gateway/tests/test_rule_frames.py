"""Remove and Edit through the gateway: the person's retraction and correction are
appended as the person, and the log's refusals reach the page as coded error frames."""

from __future__ import annotations

import uuid

from nats.aio.client import Client

from contracts import subjects
from contracts.events import EventType
from contracts.session_events import AppendedReply, AppendEvent, EventsReply, ListEvents
from servicekit.client import call

from .conftest import Gateway


async def recorded_rule(nc: Client, session: uuid.UUID, title: str) -> uuid.UUID:
    """A rule Criativo recorded in `session`, resting on a message of the person."""

    async def appended(kind: EventType, actor: str, payload: dict[str, object]) -> uuid.UUID:
        request = AppendEvent(session_id=session, type=kind.value, actor=actor, payload=payload)
        return (await call(nc, subjects.EVENTS_APPEND, request, AppendedReply)).event_id

    said = await appended(EventType.CHAT_MESSAGE, "user:ana", {"text": title})
    rule: dict[str, object] = {"title": title, "statement": f"{title}.", "origin": [str(said)]}
    return await appended(EventType.ARTIFACT_BUSINESS_RULE, "agent:criativo", rule)


async def test_remove_and_edit_append_as_the_person_and_refusals_come_back_coded(
    gateway: Gateway, nc: Client
) -> None:
    mine = await gateway.open_session()
    theirs = await gateway.open_session(project=f"q-{uuid.uuid4().hex[:8]}")
    pickup = await recorded_rule(nc, mine, "Pickup only")
    hours = await recorded_rule(nc, mine, "Orders close at 18h")
    their_rule = await recorded_rule(nc, theirs, "Their rule")
    client = await gateway.ws()
    assert (await client.request({"type": "join", "session_id": str(mine)}))["type"] == "ack"

    removed = await client.request(
        {"type": "retract_rule", "rule_id": str(pickup), "reason": "we deliver"}
    )
    edited = await client.request(
        {
            "type": "correct_rule",
            "rule_id": str(hours),
            "title": "Closing time",
            "statement": "Orders close at 19h.",
            "origin": [str(uuid.uuid4())],
        }
    )
    assert (removed["type"], edited["type"]) == ("ack", "ack")

    refusals = [
        ({"type": "retract_rule", "rule_id": str(pickup)}, "rule_not_standing"),
        ({"type": "retract_rule", "rule_id": str(hours)}, "rule_not_standing"),
        ({"type": "retract_rule", "rule_id": str(their_rule)}, "rule_not_found"),
        ({"type": "retract_rule", "rule_id": str(uuid.uuid4())}, "rule_not_found"),
        # an Edit must carry a text and what the rule rested on
        (
            {"type": "correct_rule", "rule_id": str(hours), "title": "t", "statement": " "},
            "invalid_request",
        ),
    ]
    for frame, code in refusals:
        refused = await client.request(frame)
        assert (refused["type"], refused["code"]) == ("error", code), refused
        assert refused["message"]

    log = await call(nc, subjects.EVENTS_LIST, ListEvents(session_id=mine), EventsReply)
    changes = [
        (e.type.value, e.actor, e.payload.get("rule_id") or e.payload.get("replaces"))
        for e in log.events
        if e.actor.startswith("user:") and e.type.domain == "artifact"
    ]
    assert changes == [
        (EventType.ARTIFACT_BUSINESS_RULE_RETRACTED.value, "user:ana", str(pickup)),
        (EventType.ARTIFACT_BUSINESS_RULE.value, "user:ana", str(hours)),
    ]


async def test_a_readiness_sent_again_with_its_key_is_confirmed_once(
    gateway: Gateway, nc: Client
) -> None:
    # A person whose socket dropped as they confirmed cannot tell whether it went in; sent
    # again under its key, it is the same readiness: one brief, one offer, none superseded.
    session = await gateway.open_session()
    client = await gateway.ws()
    assert (await client.request({"type": "join", "session_id": str(session)}))["type"] == "ack"

    first = await client.request({"type": "confirm_readiness", "client_msg_id": "ready-1"})
    again = await client.request({"type": "confirm_readiness", "client_msg_id": "ready-1"})
    later = await client.request({"type": "confirm_readiness", "client_msg_id": "ready-2"})
    empty = await client.request({"type": "confirm_readiness", "client_msg_id": ""})

    assert (first["type"], first["client_msg_id"]) == ("ack", "ready-1")
    assert again["result"] == {**first["result"], "duplicate": True}
    assert later["result"]["event_id"] != first["result"]["event_id"]  # another click
    assert (empty["type"], empty["code"]) == ("error", "invalid_request")
    listed = await call(nc, subjects.EVENTS_LIST, ListEvents(session_id=session), EventsReply)
    confirmed = [e for e in listed.events if e.type is EventType.CRIATIVO_READINESS_CONFIRMED]
    assert [str(e.id) for e in confirmed] == [
        first["result"]["event_id"],
        later["result"]["event_id"],
    ]
