"""What every HTTP response of the gateway says to the browser (the page loads only
itself), and request bodies over the limit refused with 413 before they are read, with
nothing written."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httpx

from gateway.settings import GatewaySettings

from .conftest import Gateway

LIMIT = GatewaySettings.model_fields["max_body_bytes"].default
POLICY = {
    "default-src": ["'self'"],
    "script-src": ["'self'"],
    "style-src": ["'self'"],
    "img-src": ["'self'", "data:"],
    "font-src": ["'self'"],
    "object-src": ["'none'"],
    "base-uri": ["'none'"],
    "form-action": ["'self'"],
    "frame-ancestors": ["'none'"],
}
FIXED = {
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",
    "cross-origin-opener-policy": "same-origin",
}


def directives(policy: str) -> dict[str, list[str]]:
    parsed: dict[str, list[str]] = {}
    for part in policy.split(";"):
        name, *values = part.split()
        assert name not in parsed, f"{name} twice in {policy}"
        parsed[name] = values
    return parsed


def assert_guarded(r: httpx.Response, host: str) -> None:
    """`r` carries the policy (the socket's origin included) and the other headers."""
    what = f"{r.request.method} {r.request.url.path} ({r.status_code})"
    policy = r.headers.get("content-security-policy")
    assert policy is not None, f"{what}: no Content-Security-Policy"
    found = directives(policy)
    for name, values in POLICY.items():
        assert found.get(name) == values, f"{what}: {name} is {found.get(name)}"
    assert found["connect-src"] == ["'self'", f"ws://{host}", f"wss://{host}"], what
    for name, value in FIXED.items():
        assert r.headers.get(name) == value, f"{what}: {name} is {r.headers.get(name)}"


async def test_every_kind_of_response_carries_the_security_headers(gateway: Gateway) -> None:
    host = urlsplit(gateway.url).netloc
    api = f"/api/projects/{gateway.project}"
    async with gateway.http() as http:
        session = (await http.post(f"{api}/sessions")).json()["session_id"]
        responses = [
            (await http.get("/"), 200),  # a page
            (await http.get("/session.html"), 200),
            (await http.get("/session.js"), 200),  # static files
            (await http.get("/style.css"), 200),
            (await http.get("/vendor/purify.es.mjs"), 200),
            (await http.get("/healthz"), 200),
            (await http.get(api), 200),  # the API
            (await http.get(f"{api}/sessions/{session}/events"), 200),
            (await http.get(f"{api}/sessions/not-a-uuid"), 422),  # its refusals
            (await http.put(f"{api}/bindings", json={}), 403),
            (await http.get(f"/api/projects/{gateway.project}-other"), 403),
            (await http.get("/no-such-page.html"), 404),  # 404s
            (await http.get(f"{api}/no-such-route"), 404),
            (await http.post("/healthz"), 405),
        ]
        async with httpx.AsyncClient(base_url=gateway.url) as anonymous:
            responses.append((await anonymous.get(api), 401))
    for r, status in responses:
        assert r.status_code == status, (r.request.url, r.status_code)
        assert_guarded(r, host)
    for r, _ in responses:  # what a token reads is kept by no cache
        if r.request.url.path.startswith("/api/"):
            assert r.headers.get("cache-control") == "no-store", r.request.url


async def test_a_host_header_cannot_write_into_the_policy(gateway: Gateway) -> None:
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        r = await http.get("/", headers={"host": "evil.example; script-src *"})
    policy = directives(r.headers["content-security-policy"])
    assert policy["script-src"] == ["'self'"]
    assert policy["connect-src"] == ["'self'"]  # no socket origin named from such a Host


# --- request bodies over the limit -------------------------------------------------


async def raw_request(gateway: Gateway, head: str, body: AsyncIterator[bytes] | None) -> bytes:
    """Sends `head` (and `body`, as it comes) on a socket of its own; the response whole.
    A refused body may be cut short: the response is read either way."""
    split = urlsplit(gateway.url)
    reader, writer = await asyncio.open_connection(split.hostname, split.port)
    try:
        writer.write(head.encode())
        if body is not None:
            async for chunk in body:
                writer.write(chunk)
                await writer.drain()
        await writer.drain()
        response = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in response.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        return response + await reader.readexactly(length)
    finally:
        writer.close()


def parsed(raw: bytes) -> tuple[int, dict[str, str], dict[str, object]]:
    head, body = raw.split(b"\r\n\r\n", 1)
    status_line, *lines = head.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    return int(status_line.split()[1]), headers, json.loads(body)


def open_session_head(gateway: Gateway, framing: str) -> str:
    host = urlsplit(gateway.url).netloc
    return (
        f"POST /api/projects/{gateway.project}/sessions HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: Bearer {gateway.token()}\r\nContent-Type: application/json\r\n"
        f"{framing}\r\n\r\n"
    )


async def sessions(gateway: Gateway) -> list[object]:
    async with gateway.http() as http:
        r = await http.get(f"/api/projects/{gateway.project}/sessions")
        assert r.status_code == 200, r.text
        listed: list[object] = r.json()["sessions"]
        return listed


def assert_too_large(raw: bytes) -> None:
    status, headers, body = parsed(raw)
    assert status == 413, raw[:300]
    assert body == {
        "error": {
            "code": "payload_too_large",
            "message": f"a request body may be {LIMIT} bytes at most",
            "details": {"limit_bytes": LIMIT},
        }
    }
    assert headers["content-type"] == "application/json"
    assert "script-src 'self'" in headers["content-security-policy"]


async def test_a_declared_body_over_the_limit_is_refused_unread_and_nothing_is_opened(
    gateway: Gateway,
) -> None:
    """A gigabyte announced, none of it sent: the refusal comes at once, so the gateway
    did not wait for (or hold) the body; the route, which never reads its body, did not
    open a session."""
    head = open_session_head(gateway, "Content-Length: 1000000000")
    assert_too_large(await raw_request(gateway, head, None))
    assert await sessions(gateway) == []


async def test_a_chunked_body_over_the_limit_is_refused_and_nothing_is_opened(
    gateway: Gateway,
) -> None:
    chunk = b"x" * 16384

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(LIMIT // len(chunk) + 1):  # one chunk more than the limit holds
            yield b"%x\r\n%s\r\n" % (len(chunk), chunk)
        yield b"0\r\n\r\n"

    head = open_session_head(gateway, "Transfer-Encoding: chunked")
    assert_too_large(await raw_request(gateway, head, chunks()))
    assert await sessions(gateway) == []


async def test_bodies_up_to_the_limit_declared_or_chunked_are_read_whole(
    gateway: Gateway,
) -> None:
    body = json.dumps({"title": "a session"}).encode()
    at_limit = body + b" " * (LIMIT - len(body))
    api = f"/api/projects/{gateway.project}/sessions"

    async def chunked() -> AsyncIterator[bytes]:
        for start in range(0, LIMIT, 4096):
            yield at_limit[start : start + 4096]

    async with gateway.http() as http:
        r = await http.post(api, content=at_limit)
        assert r.status_code == 201, r.text
        r = await http.post(api, content=chunked())
        assert r.request.headers.get("transfer-encoding") == "chunked"
        assert r.status_code == 201, r.text
        r = await http.post(api, content=at_limit + b" ")
        assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
    assert len(await sessions(gateway)) == 2
