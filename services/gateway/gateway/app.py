"""Wiring of the gateway: the one place its parts are put together.

The gateway keeps nothing durable (the process a browser reaches holds no database
credentials): it runs on the kit like every service, with no schema, so it gets NATS
but no Postgres. Its bus surface is empty: it calls the others' commands and serves
none, so the kit registers it as a NATS micro service with no endpoints, which
`$SRV.PING` / `nats micro ls` (and `make up`) find. It serves the web client, the HTTP
API and the WebSocket with uvicorn, inside the service.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from opentelemetry.trace import Span
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Match, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket

from gateway.auth import load_secret
from gateway.bus import Commands
from gateway.fanout import Fanout
from gateway.headers import SecurityHeaders
from gateway.http import BodyLimit, routes
from gateway.presence import Presence
from gateway.server import serving_http
from gateway.settings import GatewaySettings
from gateway.ws import Hub, websocket_endpoint
from servicekit.bus import on_reconnected
from servicekit.logs import get_logger
from servicekit.provenance import Confirmations
from servicekit.runtime import run_service
from servicekit.service import Service
from servicekit.sessionlog import SessionLogClient
from servicekit.telemetry import tracing_on

SERVICE = "gateway"
VERSION = "0.1.0"
WEB = Path(__file__).resolve().parent.parent / "web"
log = get_logger(__name__)

svc = Service(
    SERVICE, VERSION, "The web gateway: the web client, its HTTP API and WebSocket.", schema=None
)


WS_PATH = "/ws"


class _Sockets:
    """`/ws` straight to its connection, every other request to Starlette.

    A WebSocket's request lives as long as the connection, and with it every coroutine
    of Starlette's middleware and router it passed through, suspended: ~5 KiB a
    connection (tracemalloc), for routing done once. The endpoint needs none of them.
    """

    def __init__(self, hub: Hub, app: ASGIApp) -> None:
        self._hub = hub
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket" and scope["path"] == WS_PATH:
            await websocket_endpoint(self._hub, WebSocket(scope, receive, send))
        else:
            await self._app(scope, receive, send)


def build_app(hub: Hub) -> ASGIApp:
    """The ASGI application: WebSocket, API, and the web client's static files.

    Every HTTP response, the errors and 404s included, carries the security headers;
    a body over the limit is refused before Starlette sees the request.
    """

    async def healthz(_: Request) -> Response:
        return JSONResponse({"ok": True})

    app = Starlette(
        routes=[
            *routes(hub),
            Route("/healthz", healthz),
            Mount("/", StaticFiles(directory=WEB, html=True), name="web"),
        ]
    )
    guarded = SecurityHeaders(BodyLimit(app, hub.settings.max_body_bytes))
    served: ASGIApp = _Sockets(hub, guarded)
    if tracing_on():
        # Only when spans are recorded: the middleware costs time on every request even
        # unrecorded, and its import a tenth of a second of every start (a restarted
        # gateway's people wait for it). A span per request and per WebSocket connection,
        # none per message sent or received (a token's frame must stay cheap).
        from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware

        served = OpenTelemetryMiddleware(
            served,
            exclude_spans=["receive", "send"],
            default_span_details=_route_of(app),
            server_request_hook=_without_token,
        )
    return served


def _route_of(app: Starlette) -> Callable[[dict[str, Any]], tuple[str, dict[str, Any]]]:
    """A request's span name and `http.route` by its route's template, not its path: the
    path holds ids, which would make every span name unique."""

    def details(scope: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        if scope.get("type") == "websocket" and scope.get("path") == WS_PATH:
            return WS_PATH, {"http.route": WS_PATH}
        for route in app.routes:
            if route.matches(scope)[0] is Match.FULL:
                template = getattr(route, "path", "") or "/"
                method = scope.get("method")
                return (f"{method} {template}" if method else template), {"http.route": template}
        return scope.get("method") or "HTTP", {}

    return details


def _without_token(span: Span, scope: dict[str, Any]) -> None:
    """The WebSocket's ticket rides in its query string (`/ws?ticket=`): keep it out of
    the span's URL attributes (the instrumentation redacts only a few cloud signatures)."""
    recorded = getattr(span, "attributes", None)
    if not span.is_recording() or not scope.get("query_string") or recorded is None:
        return
    for name in ("http.url", "url.full"):
        if name in recorded:
            span.set_attribute(name, str(recorded[name]).split("?", 1)[0])
    if "url.query" in recorded:
        span.set_attribute("url.query", "REDACTED")


async def main(
    settings: GatewaySettings | None = None, on_listening: Callable[[str], None] | None = None
) -> None:
    """Serve HTTP and WebSocket until stopped; `on_listening` gets the base URL once bound."""
    settings = settings or GatewaySettings()
    async with svc.open(settings) as rt:
        commands = Commands(rt.nc, settings.command_timeout_seconds)
        session_log = SessionLogClient(
            rt.nc, timeout=settings.command_timeout_seconds, caller=commands
        )
        presence = Presence(session_log.heartbeat, settings.heartbeat_interval_seconds)
        secret = load_secret(settings.gateway_secret)
        confirmations = Confirmations(session_log, consumer=SERVICE)
        fanout = Fanout(rt.nc, confirmations)
        on_reconnected(rt.nc, fanout.reconnected)
        hub = Hub(settings, secret, commands, session_log, presence, fanout, confirmations)
        try:
            async with serving_http(rt, build_app(hub), settings) as url:
                log.info("gateway_listening", url=url)
                if on_listening is not None:
                    on_listening(url)
                await svc.serve(rt)
        finally:
            await presence.stop()


def run() -> None:
    """Entry point: `python -m gateway`."""
    run_service(SERVICE, main())
