"""Connections following one session share its subscription (issue 12): each gets every
frame of the session, in order, as a connection of its own would, and the subscription
lasts as long as the last of them."""

from __future__ import annotations

from typing import Any

from servicekit.metrics import value
from testkit.probes import wait_for

from .conftest import Gateway, WsClient

FOLLOWED = "agentbus_gateway_followed_sessions"
JOINED = "agentbus_gateway_ws_joined_sessions"


def turn_frames(client: WsClient, message_id: str) -> list[dict[str, Any]]:
    """The deltas and the done of the turn that answers `message_id`, as received."""
    return [
        f
        for f in client.frames
        if f["type"] in ("delta", "done") and f.get("message_id") == message_id
    ]


def turn_ended(client: WsClient, message_id: str) -> bool:
    frames = turn_frames(client, message_id)
    return bool(frames) and frames[-1]["type"] == "done"


async def chat(client: WsClient, text: str, msg_id: str) -> str:
    ack = await client.request({"type": "chat", "text": text, "client_msg_id": msg_id})
    message_id: str = ack["result"]["event_id"]
    return message_id


async def test_clients_of_one_session_share_a_subscription_and_each_get_every_frame(
    gateway: Gateway,
) -> None:
    followed, joined = value(FOLLOWED), value(JOINED)
    session_id = await gateway.open_session()
    clients = [await gateway.ws() for _ in range(3)]
    for client in clients:
        await client.request({"type": "join", "session_id": str(session_id)})
    assert value(JOINED) == joined + 3
    assert value(FOLLOWED) == followed + 1, "one subscription for the three connections"

    speaker = clients[0]
    await speaker.request({"type": "start_agent", "agent": "criativo"})
    first = await chat(speaker, "Um app para padarias", "f-1")
    for client in clients:
        await wait_for(lambda c=client: turn_ended(c, first), what="the turn at every client")
    expected = turn_frames(speaker, first)
    assert [f["seq"] for f in expected if f["type"] == "delta"][:1] == [1]
    for client in clients[1:]:
        assert turn_frames(client, first) == expected  # the same frames, in the same order
        assert client.event_seqs() == speaker.event_seqs()

    await clients[2].ws.close()  # one leaves: the others keep the subscription
    await wait_for(lambda: value(JOINED) == joined + 2, what="the leave")
    assert value(FOLLOWED) == followed + 1
    second = await chat(speaker, "E entregas?", "f-2")
    await wait_for(lambda: turn_ended(clients[1], second), what="the second turn")
    assert turn_frames(clients[1], second) == turn_frames(speaker, second)

    for client in clients[:2]:
        await client.ws.close()
    await wait_for(lambda: value(FOLLOWED) == followed, what="the subscription ended")
    assert value(JOINED) == joined


async def test_clients_of_two_sessions_each_get_their_own_the_message_before_its_turn(
    gateway: Gateway,
) -> None:
    followed = value(FOLLOWED)
    sessions = [await gateway.open_session() for _ in range(2)]
    clients = [await gateway.ws() for _ in sessions]
    for client, session_id in zip(clients, sessions, strict=True):
        await client.request({"type": "join", "session_id": str(session_id)})
    assert value(FOLLOWED) == followed + 2

    for k, speaker in enumerate(clients):
        await speaker.request({"type": "start_agent", "agent": "criativo"})
        message = await chat(speaker, "Um app para padarias", f"p-{k}")
        await wait_for(lambda c=speaker, m=message: turn_ended(c, m), what="the turn")
        frames = speaker.frames
        said = next(i for i, f in enumerate(frames) if f.get("event", {}).get("id") == message)
        first_delta = next(
            i for i, f in enumerate(frames) if f["type"] == "delta" and f["message_id"] == message
        )
        assert said < first_delta, "the message is shown before the turn that answers it"
        other = clients[1 - k]
        assert turn_frames(other, message) == []
    for client, session_id in zip(clients, sessions, strict=True):
        assert {f["event"]["session_id"] for f in client.of("event")} == {str(session_id)}
