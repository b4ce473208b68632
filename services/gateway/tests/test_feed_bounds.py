"""A feed is bounded by the session's log and confined to the session: a join claiming
more than the log holds is answered at once and gets the live turn; a message filed
under the joined session that carries another session's event never reaches the socket."""

from __future__ import annotations

import json
from typing import Any

import pytest

from contracts import subjects
from contracts.events import EventType
from metering.providers.scripted import DEFAULT_SCRIPT, Script, ScriptStep
from testkit.probes import wait_for

from .conftest import Gateway, WsClient

# Six seconds of answer: the join below is answered long before its end.
LONG_ANSWER = " ".join(f"w{i}" for i in range(300))
INT64_MAX = 2**63 - 1


@pytest.fixture
def script() -> Script:
    slow = ScriptStep(contains="SLOW", text=LONG_ANSWER, token_delay_ms=20)
    return DEFAULT_SCRIPT.model_copy(
        update={"token_delay_ms": 5.0, "steps": [slow, *DEFAULT_SCRIPT.steps]}
    )


def outcome_index(client: WsClient, message_id: str) -> int | None:
    """Where the answer to `message_id` is among the client's frames, once it came."""
    for i, f in enumerate(client.frames):
        event = f.get("event") or {}
        if event.get("type") == EventType.AGENT_RESPONSE.value and (
            event["causation_id"] == message_id
        ):
            return i
    return None


@pytest.mark.timeout(120)
async def test_a_join_past_the_log_is_answered_at_once_and_gets_the_live_turn(
    gateway: Gateway,
) -> None:
    session_id = await gateway.open_session()
    observer = await gateway.ws()
    await observer.request({"type": "join", "session_id": str(session_id)})
    await observer.request({"type": "start_agent", "agent": "criativo"})
    await wait_for(lambda: EventType.AGENT_ACTIVATED.value in observer.event_types())
    sent = await observer.request({"type": "chat", "text": "SLOW", "client_msg_id": "m-1"})
    message_id = sent["result"]["event_id"]
    await wait_for(lambda: len(observer.of("delta")) >= 3, what="the answer streaming")

    # A claim of every seq there could be, while the turn streams: the turn's cause has
    # no outcome yet, which is what made the feed look for it below `after_seq`.
    joiner = await gateway.ws()
    joined = await joiner.request(
        {"type": "join", "session_id": str(session_id), "after_seq": INT64_MAX}
    )
    beat = await joiner.request({"type": "heartbeat"})
    assert joined["type"] == "ack" and beat["type"] == "ack", (joined, beat)
    # Both answered while the turn was still streaming: its outcome came after them.
    assert outcome_index(observer, message_id) is None, "the turn ended before the join"
    clamped = joined["result"]["seq"]
    assert sent["result"]["seq"] <= clamped < INT64_MAX

    outcome = await wait_for(lambda: outcome_index(joiner, message_id), timeout=30)
    assert joiner.frames.index(joined) < joiner.frames.index(beat) < outcome
    # Nothing it claimed to have was replayed; what came after the log's last seq did.
    seqs = joiner.event_seqs()
    assert seqs == list(range(clamped + 1, clamped + 1 + len(seqs))), seqs
    # The live turn: its deltas, whole from the first and each once, before its outcome.
    turn = [f["seq"] for f in joiner.frames[:outcome] if f["type"] == "delta"]
    assert turn == list(range(1, len(turn) + 1)) and len(turn) >= 3, turn
    assert not [f for f in joiner.frames[outcome:] if f["type"] == "delta"]

    # A negative claim is refused with a code, and the connection stays usable.
    refused = await joiner.request({"type": "join", "session_id": str(session_id), "after_seq": -1})
    assert refused["type"] == "error" and refused["code"] == "invalid_request", refused


async def test_another_sessions_event_on_the_joined_sessions_subject_never_reaches_the_socket(
    gateway: Gateway, connect_as: Any
) -> None:
    admin = await connect_as("admin")  # what an operator's push consumer could deliver
    mine, theirs = await gateway.open_session(), await gateway.open_session()
    client, other = await gateway.ws(), await gateway.ws()
    await client.request({"type": "join", "session_id": str(mine)})
    await other.request({"type": "join", "session_id": str(theirs)})
    await other.request({"type": "chat", "text": "theirs", "client_msg_id": "t-1"})
    # A real event of theirs (the log confirms it), right after my last seq.
    [their_event] = await wait_for(
        lambda: [f["event"] for f in other.of("event") if f["event"]["type"] == "chat.message"]
    )
    assert their_event["seq"] == client.event_seqs()[-1] + 1
    my_subject = subjects.event_subject(EventType.CHAT_MESSAGE, gateway.project, mine)
    await admin.publish(my_subject, json.dumps(their_event).encode())
    await admin.flush()

    # Then a real event of mine: the socket is listening, and its seq is not taken.
    await client.request({"type": "chat", "text": "mine", "client_msg_id": "m-1"})

    def said() -> list[dict[str, Any]]:
        return [f["event"] for f in client.of("event") if f["event"]["type"] == "chat.message"]

    await wait_for(said, what="a chat message at my socket")
    assert [e["session_id"] for e in said()] == [str(mine)], said()
    assert said()[0]["payload"]["text"] == "mine"
    assert all(f["event"]["session_id"] == str(mine) for f in client.of("event"))
