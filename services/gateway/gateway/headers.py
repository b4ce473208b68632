"""The headers every HTTP response of the gateway carries: the page loads only itself.

A model's answer is untrusted input rendered into the page. The sanitizer (web/common.js)
keeps it inert; the Content-Security-Policy is the second wall, so that whatever slips
past the sanitizer still cannot load anything from elsewhere, run inline code or apply
inline style, and the page cannot be framed.
"""

from __future__ import annotations

import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send

# `connect-src 'self'` matches ws:/wss: of the page's own host in browsers that follow
# CSP Level 3 (Chromium does); older Firefox and Safari do not, so the socket's origin is
# also named, from the request's Host. A Host that is not a plain host[:port] names none.
_HOST = re.compile(rb"^(?:[A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?$")
_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "font-src 'self'; media-src 'none'; object-src 'none'; frame-src 'none'; "
    "worker-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'; "
    "connect-src 'self'"
)
_FIXED: list[tuple[bytes, bytes]] = [
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    # frame-ancestors for browsers that predate it
    (b"x-frame-options", b"DENY"),
    (b"cross-origin-opener-policy", b"same-origin"),
    (b"cross-origin-resource-policy", b"same-origin"),
    (b"permissions-policy", b"camera=(), microphone=(), geolocation=(), payment=(), usb=()"),
]
# What a person's token reads is theirs: no shared cache keeps it.
_API = [(b"cache-control", b"no-store")]
# A deployment answers to a handful of host names; a client making up others gets the
# policy without the socket's origin rather than growing this.
_MAX_HOSTS = 64


def content_security_policy(host: bytes | None) -> bytes:
    """The policy for a page served under `host` (the request's Host header)."""
    if host is None or not _HOST.match(host):
        return _POLICY.encode()
    name = host.decode()
    return f"{_POLICY} ws://{name} wss://{name}".encode()


class SecurityHeaders:
    """Adds the security headers to every HTTP response of `app` (pure ASGI: a few list
    appends per response, no task or coroutine kept for the request's life)."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app
        self._policies: dict[bytes | None, list[tuple[bytes, bytes]]] = {}

    def _headers(self, scope: Scope) -> list[tuple[bytes, bytes]]:
        host = next((v for k, v in scope["headers"] if k == b"host"), None)
        headers = self._policies.get(host)
        if headers is None:
            csp = content_security_policy(host)
            headers = [(b"content-security-policy", csp), *_FIXED]
            if len(self._policies) < _MAX_HOSTS or host is None:
                self._policies[host] = headers
        if scope["path"].startswith("/api/"):
            return [*headers, *_API]
        return headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        added = self._headers(scope)

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), *added]
            await send(message)

        await self._app(scope, receive, send_with_headers)
