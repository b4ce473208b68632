"""The Stop button, gateway side: a `stop_turn` frame becomes `cmd.llm.cancel` for the joined
session's turn, answered with an `ack` carrying metering's `CancelReply`, or an `error`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest_asyncio
from nats.aio.client import Client
from nats.aio.msg import Msg

from contracts import subjects
from contracts.metering import CancelReply, CancelTurn

from .conftest import Gateway

REFUSED = "t-refused"


@pytest_asyncio.fixture(loop_scope="session")
async def cancels(gateway: Gateway, nc: Client) -> AsyncIterator[list[CancelTurn]]:
    """A stand-in for metering's `cmd.llm.cancel`, keeping what it was asked (until the
    metering branch that serves it is merged: then the real one answers)."""
    asked: list[CancelTurn] = []

    async def answer(msg: Msg) -> None:
        request = CancelTurn.model_validate_json(msg.data)
        asked.append(request)
        if request.turn_id == REFUSED:
            body = {"error": {"code": "forbidden", "message": "not yours", "details": {}}}
            await msg.respond(json.dumps(body).encode())
            return
        reply = CancelReply(turn_id=request.turn_id, status="cancelling")
        await msg.respond(reply.model_dump_json().encode())

    sub = await nc.subscribe(subjects.LLM_CANCEL, cb=answer)
    await nc.flush()
    yield asked
    await sub.unsubscribe()


async def test_stop_turn_cancels_the_joined_sessions_turn(
    gateway: Gateway, cancels: list[CancelTurn]
) -> None:
    client = await gateway.ws()
    refused = await client.request({"type": "stop_turn", "turn_id": "criativo.x.1.1"})
    assert refused["type"] == "error" and refused["code"] == "not_joined"
    assert cancels == []

    session_id = await gateway.open_session()
    await client.request({"type": "join", "session_id": str(session_id)})
    stopped = await client.request({"type": "stop_turn", "turn_id": "criativo.x.1.1"})
    assert stopped["type"] == "ack" and stopped["of"] == "stop_turn", stopped
    assert stopped["result"] == {"turn_id": "criativo.x.1.1", "status": "cancelling"}
    assert cancels == [
        CancelTurn(turn_id="criativo.x.1.1", project_id=gateway.project, session_id=session_id)
    ]

    bad = await client.request({"type": "stop_turn", "turn_id": "no spaces allowed"})
    assert bad["type"] == "error" and bad["code"] == "invalid_request"
    error = await client.request({"type": "stop_turn", "turn_id": REFUSED})
    assert error["type"] == "error" and error["code"] == "forbidden", error
    assert len(cancels) == 2  # the invalid one never reached metering
