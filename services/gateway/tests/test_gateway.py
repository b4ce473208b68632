"""The gateway against the whole platform: resume, auth scope, bad frames, heartbeats,
streaming."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from contracts import subjects
from contracts.gateway import DeltaFrame
from contracts.session_events import AppendedReply, AppendEvent, SessionRef, SessionView
from gateway.auth import mint
from servicekit.client import call
from servicekit.metrics import value
from testkit.forgeries import forged_closing, publish_forged
from testkit.probes import wait_for

from .conftest import Gateway

ERROR_FRAMES = "agentbus_gateway_ws_error_frames_total"
RECEIVED = "agentbus_gateway_ws_frames_received_total"


async def _say(nc: Client, session_id: uuid.UUID, text: str) -> int:
    reply = await call(
        nc,
        subjects.EVENTS_APPEND,
        AppendEvent(
            session_id=session_id, type="chat.message", actor="user:ana", payload={"text": text}
        ),
        AppendedReply,
    )
    return reply.seq


async def test_resume_replays_then_goes_live_without_gap_or_duplicate(
    gateway: Gateway, nc: Client
) -> None:
    session_id = await gateway.open_session()
    for i in range(5):  # criativo never started: each gets the plain chat's answer too
        await _say(nc, session_id, f"antes {i}")

    # Events keep arriving while the client joins: the seam must hold under traffic.
    async def writer() -> int:
        last = 0
        for i in range(40):
            last = await _say(nc, session_id, f"durante {i}")
        return last

    writing = asyncio.create_task(writer())
    client = await gateway.ws()
    joined = await client.request({"type": "join", "session_id": str(session_id), "after_seq": 2})
    assert joined["type"] == "ack", joined
    last = await writing

    def total() -> int:
        return len(client.of("event"))

    async def log_count() -> int:
        view = await call(nc, subjects.SESSIONS_GET, SessionRef(session_id=session_id), SessionView)
        return view.event_count

    # The plain chat keeps answering: wait until the client holds everything the log has.
    await wait_for(lambda: client.event_seqs() and client.event_seqs()[-1] >= last)
    expected = await log_count()
    await wait_for(lambda: total() >= expected - 2, what="every event after seq 2")
    seqs = client.event_seqs()
    assert seqs == list(range(3, 3 + len(seqs))), "a gap or a duplicate at the seam"


async def test_a_token_for_one_project_can_do_nothing_in_another(gateway: Gateway) -> None:
    other = f"q-{uuid.uuid4().hex[:8]}"
    theirs = await gateway.open_session(project=other)
    async with gateway.http() as http:
        r = await http.get(f"/api/projects/{other}/sessions")
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
        r = await http.post(f"/api/projects/{other}/sessions")
        assert r.status_code == 403
        # their session, addressed through my project's path
        r = await http.get(f"/api/projects/{gateway.project}/sessions/{theirs}/events")
        assert r.status_code == 403
        r = await http.get(f"/api/projects/{gateway.project}/sessions")
        assert r.status_code == 200 and r.json()["sessions"] == []
    async with httpx_without_token(gateway) as anonymous:
        r = await anonymous.get(f"/api/projects/{gateway.project}/sessions")
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
    forged = mint("another-secret-" + "y" * 40, gateway.project, "ana")
    async with httpx_without_token(gateway, forged) as forger:
        r = await forger.get(f"/api/projects/{gateway.project}/sessions")
        assert r.status_code == 401

    client = await gateway.ws()
    refused = await client.request({"type": "join", "session_id": str(theirs)})
    assert refused["type"] == "error" and refused["code"] == "forbidden"
    refused = await client.request({"type": "chat", "text": "oi", "client_msg_id": "m1"})
    assert refused["code"] == "not_joined"
    assert client.of("event") == []
    mine = await gateway.open_session()
    ok = await client.request({"type": "join", "session_id": str(mine)})
    assert ok["type"] == "ack"  # the connection stayed usable


def httpx_without_token(gateway: Gateway, token: str | None = None) -> Any:
    import httpx

    headers = {"authorization": f"Bearer {token}"} if token else {}
    return httpx.AsyncClient(base_url=gateway.url, headers=headers)


async def test_a_bad_ticket_closes_the_websocket(gateway: Gateway) -> None:
    refused = value(ERROR_FRAMES, code="unauthorized")
    client = await gateway.ws(query="ticket=not-a-ticket")
    await wait_for(lambda: client.reader is not None and client.reader.done())
    assert client.frames[0]["code"] == "unauthorized"
    assert client.ws.close_code == 4401
    assert value(ERROR_FRAMES, code="unauthorized") == refused + 1


async def test_malformed_oversized_and_flooding_frames_get_errors(gateway: Gateway) -> None:
    session_id = await gateway.open_session()
    watched = ("malformed_json", "invalid_request", "payload_too_large", "rate_limited")
    errors = {code: value(ERROR_FRAMES, code=code) for code in watched}
    rejected, heartbeats = value(RECEIVED, type="rejected"), value(RECEIVED, type="heartbeat")
    client = await gateway.ws()
    await client.send("this is not json")
    await client.send(json.dumps({"type": "teleport", "ref": "t1"}))
    await client.send(
        json.dumps({"type": "chat", "ref": "c1", "text": "   ", "client_msg_id": "x"})
    )
    await client.send(json.dumps({"type": "join", "ref": "big", "pad": "x" * 100_000}))
    await wait_for(lambda: len(client.of("error")) >= 4, what="four errors")
    codes = [f["code"] for f in client.of("error")]
    assert codes == ["malformed_json", "invalid_request", "invalid_request", "payload_too_large"]
    for code, before in errors.items():  # each error frame counted by its code (issue 14)
        assert value(ERROR_FRAMES, code=code) == before + codes.count(code), code
    assert value(RECEIVED, type="rejected") == rejected + 4
    assert (await client.request({"type": "join", "session_id": str(session_id)}))["type"] == "ack"

    for i in range(120):
        await client.send(json.dumps({"type": "heartbeat", "ref": f"h{i}"}))

    def answers() -> list[dict[str, Any]]:
        return [f for f in client.frames if (f.get("ref") or "").startswith("h")]

    await wait_for(lambda: len(answers()) == 120, what="every heartbeat answered")
    got = answers()
    assert any(f["type"] == "error" and f["code"] == "rate_limited" for f in got)
    assert any(f["type"] == "ack" for f in got)
    assert not client.reader or not client.reader.done(), "the connection survived the flood"
    limited = sum(f["type"] == "error" for f in got)
    assert value(ERROR_FRAMES, code="rate_limited") == errors["rate_limited"] + limited
    assert value(RECEIVED, type="rejected") == rejected + 4 + limited
    assert value(RECEIVED, type="heartbeat") == heartbeats + 120 - limited


@pytest.fixture
def heartbeat_timeout() -> float:
    return 1.5


@pytest.fixture
def gateway_overrides() -> dict[str, Any]:
    return {"heartbeat_interval_seconds": 0.3}


async def test_heartbeats_keep_a_followed_session_open_and_stop_when_the_client_leaves(
    gateway: Gateway, nc: Client
) -> None:
    session_id = await gateway.open_session()
    client = await gateway.ws()
    await client.request({"type": "join", "session_id": str(session_id)})

    async def view() -> SessionView:
        return await call(nc, subjects.SESSIONS_GET, SessionRef(session_id=session_id), SessionView)

    opened = (await view()).opened_at

    async def alive_past_timeout() -> bool:
        v = await view()
        assert v.status == "open", "reaped while a client was connected"
        beat = v.last_heartbeat_at
        return beat is not None and (beat - opened).total_seconds() > 2 * 1.5

    await wait_for(alive_past_timeout, timeout=15, what="heartbeats past the timeout")
    await client.ws.close()

    async def reaped() -> SessionView | None:
        v = await view()
        return v if v.status != "open" else None

    ended = await wait_for(reaped, timeout=15, what="the reaper to close the session")
    assert ended.status == "closed_abnormally"
    assert ended.termination_reason == "heartbeat_timeout"


async def test_chat_streams_deltas_and_a_late_joiner_catches_up_on_the_turn(
    gateway: Gateway,
) -> None:
    session_id = await gateway.open_session()
    first = await gateway.ws()
    await first.request({"type": "join", "session_id": str(session_id)})
    started = await first.request({"type": "start_agent", "agent": "criativo"})
    assert started["type"] == "ack", started
    await wait_for(lambda: "agent.activated" in first.event_types())
    words = " ".join(f"palavra{i}" for i in range(80))
    sent = await first.request({"type": "chat", "text": words, "client_msg_id": "m-1"})
    assert sent["type"] == "ack" and sent["client_msg_id"] == "m-1"
    message_id = sent["result"]["event_id"]
    await wait_for(lambda: len(first.of("delta")) >= 2, what="the reply streaming")

    late = await gateway.ws()
    await late.request({"type": "join", "session_id": str(session_id)})
    await wait_for(lambda: "agent.response" in first.event_types(), timeout=30)
    await wait_for(lambda: "agent.response" in late.event_types(), timeout=30)
    assert first.of("done") and first.of("done")[0]["message_id"] == message_id

    for client in (first, late):
        deltas = [d for d in client.of("delta") if d["message_id"] == message_id]
        assert all(DeltaFrame.model_validate(d).emitted_at for d in deltas)  # the contract
        keys = [(d["turn_id"], d["seq"]) for d in deltas]
        assert len(keys) == len(set(keys)), "a delta sent twice"
        per_turn: dict[str, list[int]] = {}
        for turn, seq in keys:
            per_turn.setdefault(turn, []).append(seq)
        # the late joiner got the turn in flight from its first delta, in order
        assert all(seqs == list(range(1, len(seqs) + 1)) for seqs in per_turn.values())
        assert len(deltas) > 1
    resent = await first.request({"type": "chat", "text": words, "client_msg_id": "m-1"})
    assert resent["result"]["duplicate"] is True


async def test_an_event_forged_on_the_bus_is_never_shown_nor_displaces_the_real_one(
    gateway: Gateway, nc: Client
) -> None:
    session = await gateway.open_session()
    client = await gateway.ws()
    await client.request({"type": "join", "session_id": str(session)})
    next_seq = max(client.event_seqs(), default=0) + 1
    # A closing the log never committed, at the very seq the next real event takes.
    forged = forged_closing(gateway.project, session, seq=next_seq)
    await publish_forged(nc, forged)
    said = AppendEvent(
        session_id=session, type="chat.message", actor="user:ana", payload={"text": "oi"}
    )
    real = await call(nc, subjects.EVENTS_APPEND, said, AppendedReply)
    assert real.seq == next_seq

    await wait_for(lambda: real.seq in client.event_seqs() or None, what="the real event")
    at_seq = [f["event"] for f in client.of("event") if f["event"]["seq"] == next_seq]
    assert [(e["id"], e["type"]) for e in at_seq] == [(str(real.event_id), "chat.message")]
    assert str(forged.id) not in {f["event"]["id"] for f in client.of("event")}


async def test_the_persons_message_is_shown_as_the_log_answered_its_append_without_a_read(
    gateway: Gateway, nc: Client
) -> None:
    asked: list[str] = []  # the event ids every reader asked the log for by id

    async def on_read(msg: Msg) -> None:
        asked.extend(json.loads(msg.data)["event_ids"])

    reads = await nc.subscribe(subjects.EVENTS_GET, cb=on_read)
    await nc.flush()
    session_id = await gateway.open_session()
    client = await gateway.ws()
    await client.request({"type": "join", "session_id": str(session_id)})
    sent = await client.request({"type": "chat", "text": "oi", "client_msg_id": "m-1"})
    message_id = sent["result"]["event_id"]
    await wait_for(lambda: client.of("done"), what="the answer's turn")

    shown = [f["event"]["id"] for f in client.of("event")]
    assert message_id in shown
    first_delta = next(i for i, f in enumerate(client.frames) if f["type"] == "delta")
    assert client.frames.index(client.of("event")[shown.index(message_id)]) < first_delta
    await nc.flush()
    assert message_id not in asked, "the append's reply confirmed it: the log was not read"
    await reads.unsubscribe()
