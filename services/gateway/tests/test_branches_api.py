"""Branches over HTTP: `POST …/sessions/{s}/fork` opens one, `GET …/sessions/{s}/branches`
lists them; a bad fork gets its code and status, and nothing is written."""

from __future__ import annotations

import uuid
from typing import Any

from testkit.probes import wait_for

from .conftest import Gateway


def path(gateway: Gateway, rest: str) -> str:
    return f"/api/projects/{gateway.project}{rest}"


async def answered_session(gateway: Gateway) -> tuple[uuid.UUID, list[dict[str, Any]]]:
    """A session with a message and the plain chat's answer to it, and its events."""
    session_id = await gateway.open_session()
    client = await gateway.ws()
    assert (await client.request({"type": "join", "session_id": str(session_id)}))["type"] == "ack"
    sent = await client.request({"type": "chat", "text": "oi", "client_msg_id": "m-1"})
    assert sent["type"] == "ack", sent
    await client.ws.close()

    async def answered() -> list[dict[str, Any]] | None:
        async with gateway.http() as http:
            r = await http.get(path(gateway, f"/sessions/{session_id}/events"))
        events: list[dict[str, Any]] = r.json()["events"]
        return events if any(e["type"] == "agent.response" for e in events) else None

    return session_id, await wait_for(answered, what="the answer")


async def test_a_fork_opens_a_branch_the_parent_lists(gateway: Gateway) -> None:
    session_id, events = await answered_session(gateway)
    message = next(e for e in events if e["type"] == "chat.message")
    body = {"at_seq": message["seq"] - 1, "text": "olá", "fork_id": "edit-1"}
    async with gateway.http() as http:
        r = await http.post(path(gateway, f"/sessions/{session_id}/fork"), json=body)
        assert r.status_code == 201, r.text
        branch = r.json()
        again = await http.post(path(gateway, f"/sessions/{session_id}/fork"), json=body)
        assert again.status_code == 201 and again.json()["session_id"] == branch["session_id"]

        listed = await http.get(path(gateway, f"/sessions/{session_id}/branches"))
        assert [s["session_id"] for s in listed.json()["sessions"]] == [branch["session_id"]]
        view = (await http.get(path(gateway, f"/sessions/{branch['session_id']}"))).json()
        assert (view["parent_session_id"], view["forked_at_seq"]) == (str(session_id), 1)
        log = (await http.get(path(gateway, f"/sessions/{branch['session_id']}/events"))).json()
        assert [e["type"] for e in log["events"]][:3] == [
            "session.forked",
            "session.opened",
            "chat.message",
        ]
        assert log["events"][2]["payload"]["text"] == "olá"
        assert log["events"][1]["copied_from"] == events[0]["id"]
        # The sessions page shows the branch with its parent.
        sessions = (await http.get(path(gateway, "/sessions"))).json()["sessions"]
        [shown] = [s for s in sessions if s["session_id"] == branch["session_id"]]
        assert shown["parent_session_id"] == str(session_id)


async def test_bad_forks_get_their_code_and_write_nothing(gateway: Gateway) -> None:
    session_id, events = await answered_session(gateway)
    elsewhere = await gateway.open_session(f"q-{uuid.uuid4().hex[:8]}")
    fork = f"/sessions/{session_id}/fork"
    good = {"at_seq": 1, "text": "olá", "fork_id": "f-1"}
    cases: list[tuple[str, dict[str, Any], tuple[int, str]]] = [
        (fork, {**good, "at_seq": 99}, (422, "fork_point_not_found")),
        (fork, {**good, "at_seq": 0}, (422, "invalid_request")),
        (fork, {**good, "text": " "}, (422, "invalid_request")),
        (fork, {"at_seq": 1, "text": "olá"}, (422, "invalid_request")),
        (f"/sessions/{uuid.uuid4()}/fork", good, (404, "session_not_found")),
        (f"/sessions/{elsewhere}/fork", good, (403, "forbidden")),
    ]
    async with gateway.http() as http:
        for rest, body, expected in cases:
            r = await http.post(path(gateway, rest), json=body)
            assert (r.status_code, r.json()["error"]["code"]) == expected, (rest, body, r.text)
        r = await http.post(path(gateway, fork), content=b"[1")
        assert (r.status_code, r.json()["error"]["code"]) == (422, "malformed_json")
        listed = await http.get(path(gateway, f"/sessions/{session_id}/branches"))
        assert listed.json()["sessions"] == []
        after = await http.get(path(gateway, f"/sessions/{session_id}/events"))
        assert after.json()["events"] == events
