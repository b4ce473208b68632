"""Wiring of the gateway: the one place its parts are put together.

The gateway keeps nothing durable (DESIGN.md): it runs on the kit like every service,
with no schema, so it gets NATS but no Postgres. Its bus surface is empty: it calls the
others' commands and serves none, so the kit registers it as a NATS micro service
with no endpoints, which `$SRV.PING` / `nats micro ls` (and `make up`) find. It serves
the web client, the HTTP API and the WebSocket with uvicorn, inside the service.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket

from gateway.auth import load_secret
from gateway.bus import Commands
from gateway.fanout import Fanout
from gateway.http import routes
from gateway.presence import Presence
from gateway.server import serving_http
from gateway.settings import GatewaySettings
from gateway.ws import Hub, websocket_endpoint
from servicekit.logs import get_logger
from servicekit.runtime import run_service
from servicekit.service import Service
from servicekit.sessionlog import SessionLogClient

SERVICE = "gateway"
VERSION = "0.1.0"
WEB = Path(__file__).resolve().parent.parent / "web"
log = get_logger(__name__)

svc = Service(
    SERVICE, VERSION, "The web gateway: the web client, its HTTP API and WebSocket.", schema=None
)


def build_app(hub: Hub) -> Starlette:
    """The ASGI application: API, WebSocket, and the web client's static files."""

    async def ws(websocket: WebSocket) -> None:
        await websocket_endpoint(hub, websocket)

    async def healthz(_: Request) -> Response:
        return JSONResponse({"ok": True})

    return Starlette(
        routes=[
            *routes(hub),
            WebSocketRoute("/ws", ws),
            Route("/healthz", healthz),
            Mount("/", StaticFiles(directory=WEB, html=True), name="web"),
        ]
    )


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
        hub = Hub(settings, secret, commands, session_log, presence, Fanout(rt.nc))
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
