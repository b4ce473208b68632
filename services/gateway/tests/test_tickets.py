"""The token stays out of URLs and logs: a socket opens with a single-use ticket (from any
replica, for any replica), a token in the socket's URL is refused with 4401, no log line or
span of the gateway holds the token or a ticket, and a socket whose token expires is
closed with 4401 "token expired", which the page shows without retrying."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
from nats.aio.client import Client
from playwright.async_api import Browser, Request, WebSocket

from gateway.auth import mint
from testkit.probes import wait_for

from .conftest import SECRET, Gateway, WsClient


def gateway_url(log_path: Path) -> str | None:
    """The URL a gateway process announced in its JSON log, once it listens."""
    for line in log_path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("event") == "gateway_listening":
            return str(entry["url"])
    return None


async def closed(client: WsClient) -> tuple[int | None, str | None]:
    """The close code and reason, once the gateway closed the socket."""
    await wait_for(lambda: client.reader is not None and client.reader.done(), what="the close")
    return client.ws.close_code, client.ws.close_reason


@pytest.mark.timeout(180)
async def test_a_ticket_opens_one_socket_on_any_replica_and_no_log_holds_a_credential(
    gateway: Gateway, spawn: Any, nc: Client, tmp_path: Path
) -> None:
    spans = tmp_path / "gateway.spans.jsonl"
    replica = spawn(
        "gateway",
        AGENTBUS_GATEWAY_PORT="0",
        AGENTBUS_GATEWAY_SECRET=SECRET,
        AGENTBUS_PROVIDER="scripted",
        AGENTBUS_LOG_LEVEL="DEBUG",  # every line it has, uvicorn's included
        OTEL_TRACES_EXPORTER="jsonl",
        AGENTBUS_TRACES_FILE=str(spans),
    )
    await replica.wait_ready(nc, "gateway", timeout=60)
    other_url = await wait_for(lambda: gateway_url(replica.log_path), what="the replica's URL")
    other = Gateway(other_url, gateway.project)
    token = gateway.token()
    tickets: list[str] = []

    # The page's whole use of the replica: the API with the token in its header…
    async with other.http() as http:
        assert (await http.get(f"/api/projects/{other.project}")).status_code == 200
        opened = await http.post(f"/api/projects/{other.project}/sessions")
        assert opened.status_code == 201, opened.text
        session = opened.json()["session_id"]
        listed = await http.get(f"/api/projects/{other.project}/sessions/{session}/events")
        assert listed.status_code == 200

    # …and a socket opened with a ticket the other replica gave.
    tickets.append(await gateway.ticket())
    client = await other.ws(query=f"ticket={tickets[-1]}")
    assert (await client.request({"type": "join", "session_id": session}))["type"] == "ack"
    await client.request({"type": "chat", "text": "hello", "client_msg_id": "m-1"})
    await wait_for(lambda: "agent.response" in client.event_types(), timeout=30)
    # and the other way round
    tickets.append(await other.ticket())
    back = await gateway.ws(query=f"ticket={tickets[-1]}")
    assert (await back.request({"type": "join", "session_id": session}))["type"] == "ack"

    # A ticket opens one socket on a replica; a token opens none (an old page's URL).
    again = await other.ws(query=f"ticket={tickets[0]}")
    assert await closed(again) == (4401, "ticket refused")
    assert again.frames[0]["code"] == "unauthorized" and "used" in again.frames[0]["message"]
    old = await other.ws(query=f"token={token}")
    assert await closed(old) == (4401, "ticket refused")
    assert "ws-ticket" in old.frames[0]["message"], old.frames[0]
    await client.ws.close()
    await back.ws.close()

    replica.kill(signal.SIGTERM)  # its spans are written out as it stops
    logged = replica.log_path.read_text()
    lines = [json.loads(line) for line in logged.splitlines() if line.startswith("{")]
    # uvicorn's lines are among them, with the path the socket asked for
    assert any(e["event"].endswith('"WebSocket /ws" [accepted]') for e in lines), logged
    assert "gateway_listening" in logged and spans.read_text()
    for name, text in {"log": logged, "spans": spans.read_text()}.items():
        # Tokens and tickets are JWTs: a JSON header, `{"`, base64url-encoded.
        assert "eyJ" not in text, f"a JWT in the replica's {name}"
        assert token not in text, f"the token in the replica's {name}"
        for ticket in tickets:
            assert ticket not in text, f"a ticket in the replica's {name}"


async def test_a_socket_is_closed_with_4401_when_its_token_expires(gateway: Gateway) -> None:
    session = await gateway.open_session()
    short = mint(SECRET, gateway.project, "ana", ttl_seconds=2)
    client = await gateway.ws(short)
    assert (await client.request({"type": "join", "session_id": str(session)}))["type"] == "ack"
    assert await closed(client) == (4401, "token expired")
    # and its token no longer gets a ticket for the next one
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        r = await http.post(
            f"/api/projects/{gateway.project}/ws-ticket",
            headers={"authorization": f"Bearer {short}"},
        )
    assert r.status_code == 401 and "expired" in r.json()["error"]["message"]


@pytest.mark.timeout(90)
async def test_the_page_says_its_link_expired_and_stops_trying(
    gateway: Gateway, browser: Browser
) -> None:
    session = await gateway.open_session()
    token = mint(SECRET, gateway.project, "ana", ttl_seconds=6)
    page = await browser.new_page()
    requests: list[Request] = []
    sockets: list[WebSocket] = []
    page.on("request", lambda r: requests.append(r))
    page.on("websocket", lambda s: sockets.append(s))
    await page.goto(f"{gateway.url}/session.html?id={session}#token={token}")
    await page.locator('#connection[data-state="live"]').wait_for(state="attached")
    await page.locator('#connection[data-state="expired"]').wait_for(
        state="attached", timeout=20_000
    )
    assert "expired" in await page.locator("#connection").inner_text()
    # One ticket, one socket, and no try waiting: the page stopped.
    assert len([r for r in requests if r.url.endswith("/ws-ticket")]) == 1
    assert len(sockets) == 1 and "ticket=" in sockets[0].url
    assert await page.evaluate("window.agentbusConnection.nextTry") is None
    assert not [u for u in [r.url for r in requests] + [s.url for s in sockets] if token in u]

    # A link that had expired before the page opened: said at once, no socket tried.
    stale = mint(SECRET, gateway.project, "ana", ttl_seconds=-60)
    late = await browser.new_page()
    late_sockets: list[WebSocket] = []
    late.on("websocket", lambda s: late_sockets.append(s))
    await late.goto(f"{gateway.url}/session.html?id={session}#token={stale}")
    await late.locator('#connection[data-state="expired"]').wait_for(state="attached")
    assert late_sockets == []
    assert await late.evaluate("window.agentbusConnection.nextTry") is None
