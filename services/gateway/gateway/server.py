"""uvicorn inside the service: the gateway's HTTP and WebSocket server, run as one of
the service's background tasks and stopped in order when the service stops."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Iterator

import uvicorn
from starlette.types import ASGIApp

from gateway.settings import GatewaySettings
from gateway.wire import PreparedFramesProtocol
from servicekit.runtime import Runtime

# Far above `max_frame_bytes`: a frame between the two gets an `error` frame and the
# connection stays usable; only a frame past this one closes it (1009).
WS_MAX_BYTES = 1024 * 1024


class _WithoutQuery(logging.Filter):
    """uvicorn writes a request's path with its query string into its lines (`"WebSocket
    /ws?ticket=…" [accepted]`, and its access lines were it turned on): the query is cut,
    as it may hold a credential."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(
                arg.split("?", 1)[0] if isinstance(arg, str) and arg.startswith("/") else arg
                for arg in record.args
            )
        return True


WITHOUT_QUERY = _WithoutQuery()


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


@contextlib.asynccontextmanager
async def serving_http(rt: Runtime, app: ASGIApp, settings: GatewaySettings) -> AsyncIterator[str]:
    """uvicorn on the configured address for the life of the block; yields its base URL.

    It runs as one of the service's background tasks, so its crash stops the service;
    on the way out (SIGTERM included) it closes its connections in order first.
    """
    for name in ("uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).addFilter(WITHOUT_QUERY)  # once: a filter is added once
    sock = _listen(settings.gateway_host, settings.gateway_port)
    host, port = sock.getsockname()[:2]
    server = _Server(
        uvicorn.Config(
            app,
            ws=PreparedFramesProtocol,
            ws_max_size=WS_MAX_BYTES,
            # No permessage-deflate: prepared frames are the same bytes for every client
            # (gateway.wire). It would also cost a compression per frame per connection and
            # ~30 KiB of zlib state per connection, to save a few dozen bytes of a
            # ~150-byte delta frame (bench/gateway.py).
            ws_per_message_deflate=False,
            lifespan="off",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=5,
        )
    )
    serving = rt.background(server.serve(sockets=[sock]), "uvicorn")
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await serving
        sock.close()
