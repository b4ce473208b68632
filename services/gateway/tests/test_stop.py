"""The Stop button, gateway side, against the real metering and Criativo: a `stop_turn`
frame becomes `cmd.llm.cancel` for the joined session's turn, answered with an `ack`
carrying metering's `CancelReply`, or an `error`; only a turn of the joined session stops."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from contracts.events import EventType
from metering.providers.scripted import DEFAULT_SCRIPT, Script, ScriptStep
from testkit.probes import wait_for

from .conftest import Gateway, WsClient

# About four seconds of answer: stopped long before its end.
LONG_ANSWER = " ".join(f"w{i}" for i in range(200))


@pytest.fixture
def script() -> Script:
    slow = ScriptStep(contains="SLOW", text=LONG_ANSWER, token_delay_ms=20)
    return DEFAULT_SCRIPT.model_copy(
        update={"token_delay_ms": 5.0, "steps": [slow, *DEFAULT_SCRIPT.steps]}
    )


async def streaming(gateway: Gateway) -> tuple[WsClient, str, str]:
    """A client joined to a new session whose Criativo streams a long answer: the client,
    the message answered, and the turn streaming."""
    session_id = await gateway.open_session()
    client = await gateway.ws()
    await client.request({"type": "join", "session_id": str(session_id)})
    await client.request({"type": "start_agent", "agent": "criativo"})
    await wait_for(lambda: EventType.AGENT_ACTIVATED.value in client.event_types())
    sent = await client.request({"type": "chat", "text": "SLOW", "client_msg_id": "m-1"})
    message_id = sent["result"]["event_id"]
    await wait_for(lambda: len(client.of("delta")) >= 3, what="the answer streaming")
    return client, message_id, client.of("delta")[0]["turn_id"]


async def response(client: WsClient, message_id: str) -> dict[str, Any]:
    def found() -> dict[str, Any] | None:
        for f in client.of("event"):
            event: dict[str, Any] = f["event"]
            if event["type"] == EventType.AGENT_RESPONSE.value and (
                event["causation_id"] == message_id
            ):
                return event
        return None

    got: dict[str, Any] = await wait_for(found, timeout=30, what="the answer")
    return got


def deltas_after_response(client: WsClient, turn_id: str) -> list[dict[str, Any]]:
    after: list[dict[str, Any]] = []
    answered = False
    for f in client.frames:
        if f["type"] == "event" and f["event"]["type"] == EventType.AGENT_RESPONSE.value:
            answered = True
        elif answered and f["type"] == "delta" and f["turn_id"] == turn_id:
            after.append(f)
    return after


@pytest.mark.timeout(120)
async def test_stop_turn_stops_the_joined_sessions_turn_and_no_other(gateway: Gateway) -> None:
    idle = await gateway.ws()
    refused = await idle.request({"type": "stop_turn", "turn_id": "criativo.x.1.1"})
    assert refused["type"] == "error" and refused["code"] == "not_joined"

    mine, my_message, my_turn = await streaming(gateway)
    theirs, their_message, their_turn = await streaming(gateway)

    # Another session's turn, named from my connection: metering cannot tell it from a
    # turn not started yet, so it answers `cancelling`, and touches nothing.
    ack = await mine.request({"type": "stop_turn", "turn_id": their_turn})
    assert ack["type"] == "ack" and ack["result"]["status"] == "cancelling", ack
    ack = await mine.request({"type": "stop_turn", "turn_id": my_turn})
    assert ack["type"] == "ack" and ack["of"] == "stop_turn", ack
    assert ack["result"] == {"turn_id": my_turn, "status": "cancelling"}

    stopped = await response(mine, my_message)
    assert stopped["payload"]["stopped"] is True
    partial = stopped["payload"]["text"]
    assert partial and LONG_ANSWER.startswith(partial) and partial != LONG_ANSWER
    assert deltas_after_response(mine, my_turn) == [], "a delta after the stop's answer"

    whole = await response(theirs, their_message)
    assert whole["payload"]["stopped"] is False and whole["payload"]["text"] == LONG_ANSWER

    again = await mine.request({"type": "stop_turn", "turn_id": my_turn})
    assert again["result"]["status"] == "finished", again
    bad = await mine.request({"type": "stop_turn", "turn_id": "no spaces allowed"})
    assert bad["type"] == "error" and bad["code"] == "invalid_request"
    unknown_session = await mine.request(
        {"type": "stop_turn", "turn_id": f"criativo.{uuid.uuid4()}.1.1"}
    )
    assert unknown_session["type"] == "ack"  # nothing to stop: harmless
