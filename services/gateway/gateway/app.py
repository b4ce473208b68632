"""Wiring of the gateway: the one place its parts are put together.

The gateway keeps nothing durable (DESIGN.md): it needs NATS but no Postgres. It
serves the web client, the HTTP API and the WebSocket with uvicorn, and registers an
empty NATS micro service so `$SRV.PING` / `nats micro ls` (and `make up`) find it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket

from contracts import subjects
from contracts.session_events import HeartbeatReply, SessionRef
from gateway.auth import load_secret
from gateway.bus import Commands
from gateway.http import routes
from gateway.presence import Presence
from gateway.settings import GatewaySettings
from gateway.ws import Hub, websocket_endpoint
from servicekit.bus import connect_service
from servicekit.endpoint import Endpoints
from servicekit.logs import get_logger
from servicekit.runtime import require_streams, run_service

SERVICE = "gateway"
VERSION = "0.1.0"
WEB = Path(__file__).resolve().parent.parent / "web"
# Far above `max_frame_bytes`: a frame between the two gets an `error` frame and the
# connection stays usable; only a frame past this one closes it (1009).
WS_MAX_BYTES = 1024 * 1024

log = get_logger(__name__)


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


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the service entry point owns SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


async def main(
    settings: GatewaySettings | None = None, on_listening: Callable[[str], None] | None = None
) -> None:
    """Serve HTTP and WebSocket until stopped; `on_listening` gets the base URL once bound."""
    settings = settings or GatewaySettings()
    nc = await connect_service(settings, SERVICE)
    await require_streams(nc.jetstream(), SERVICE, settings.stream_replicas)
    commands = Commands(nc, settings.command_timeout_seconds)

    async def beat(session_id: uuid.UUID) -> HeartbeatReply:
        return await commands(
            subjects.SESSIONS_HEARTBEAT, SessionRef(session_id=session_id), HeartbeatReply
        )

    presence = Presence(beat, settings.heartbeat_interval_seconds)
    hub = Hub(settings, load_secret(settings.gateway_secret), commands, presence)
    sock = _listen(settings.gateway_host, settings.gateway_port)
    host, port = sock.getsockname()[:2]
    url = f"http://{host}:{port}"
    server = _Server(
        uvicorn.Config(
            build_app(hub),
            ws="websockets-sansio",
            ws_max_size=WS_MAX_BYTES,
            lifespan="off",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=5,
        )
    )
    serving = asyncio.create_task(server.serve(sockets=[sock]), name="uvicorn")
    endpoints = Endpoints(SERVICE, VERSION, f"The web gateway: HTTP and WebSocket on {url}.")
    service = await endpoints.start(nc, settings.endpoint_concurrency, settings.instance_id)
    log.info("gateway_listening", url=url)
    if on_listening is not None:
        on_listening(url)
    try:
        # shielded: a cancellation (SIGTERM) lets uvicorn close its connections in order
        await asyncio.shield(serving)
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await serving
        await presence.stop()
        await service.stop()
        with contextlib.suppress(Exception):
            await nc.drain()
        sock.close()


def run() -> None:
    """Entry point: `python -m gateway`."""
    run_service(SERVICE, main())
