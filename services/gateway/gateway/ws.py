"""One WebSocket connection: authenticate, read frames, follow the joined session.

Every frame is answered: an `ack` with the service's reply, or an `error` with a code
(malformed JSON, an unknown or invalid frame, an oversized one, a flood, a refusal of
the service). None of them closes the connection; only a bad ticket does, or the
token's expiry (both 4401: the page needs a new link, retrying cannot help), or a client
so slow that `max_queued_frames` frames wait for it (close code 1013: come back and
resume with `after_seq`).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.trace import SpanKind
from pydantic import TypeAdapter, ValidationError
from starlette.websockets import WebSocket, WebSocketDisconnect

from contracts.common import ErrorCode
from contracts.gateway import AckFrame, ClientFrame, ErrorFrame, Join
from domain.errors import DomainError
from gateway.access import own_session
from gateway.actions import SessionActions
from gateway.auth import Principal
from gateway.bus import Commands
from gateway.fanout import Fanout
from gateway.feed import SessionFeed
from gateway.metrics import (
    WS_CONNECTIONS,
    WS_ERROR_FRAMES,
    WS_JOINED_SESSIONS,
    WS_SLOW_CLIENT_CLOSES,
    frame_received,
    frame_sent,
)
from gateway.presence import Presence
from gateway.ratelimit import TokenBucket
from gateway.settings import GatewaySettings
from gateway.tickets import Tickets
from gateway.wire import EXTENSION, FrameWriter, model_frame
from servicekit.logs import get_logger
from servicekit.patience import is_unavailable
from servicekit.provenance import Confirmations
from servicekit.sessionlog import SessionLogClient
from servicekit.telemetry import new_trace

log = get_logger(__name__)
FRAMES: TypeAdapter[Any] = TypeAdapter(ClientFrame)
# Close codes in the application range: the browser sees them, unlike an HTTP status.
# 4401: the credentials do not (or no longer) let this client in; the reason says which.
CLOSE_UNAUTHORIZED = 4401
TOKEN_EXPIRED = "token expired"
# "Try again later": the client fell too far behind; it reconnects and resumes.
CLOSE_TOO_SLOW = 1013


@dataclass
class Hub:
    """What every connection shares."""

    settings: GatewaySettings
    secret: str
    commands: Commands
    session_log: SessionLogClient
    presence: Presence
    fanout: Fanout
    confirmations: Confirmations
    tickets: Tickets = field(init=False)

    def __post_init__(self) -> None:
        self.tickets = Tickets(self.secret)


class Connection:
    """A client's connection: at most one joined session at a time."""

    def __init__(self, hub: Hub, ws: WebSocket, principal: Principal, writer: FrameWriter) -> None:
        self._hub = hub
        self._ws = ws
        self._principal = principal
        # Frames go out in order, once per loop tick, all of a tick's frames in one write;
        # senders never wait on the socket. While the transport is over its high-water
        # mark they wait here, and the writer calls back once it drained.
        self._writer = writer
        # Looked up once, not per frame: `asyncio.get_running_loop()` makes a getpid()
        # system call each time (docs/decisions/0010-light-per-token-path.md).
        self._loop = asyncio.get_running_loop()
        self._outgoing: list[bytes] = []
        self._flush_scheduled = False
        writer.on_writable = self._flush
        self._closing = False
        self._closer: asyncio.Task[None] | None = None
        # The one timer a connection holds: its token's expiry closes it.
        self._expiry: asyncio.TimerHandle | None = None
        self._bucket = TokenBucket(hub.settings.rate_per_second, hub.settings.rate_burst)
        self._feed: SessionFeed | None = None
        self._actions: SessionActions | None = None
        # The session this connection keeps alive (only an open one is).
        self._present: uuid.UUID | None = None

    def send(self, kind: str, frame: bytes) -> bool:
        """Queue a prepared frame for the client (False: dropped); disconnect a client
        that stopped reading.

        Never waits: a session's messages are offered to all its connections in one go.
        """
        if self._closing:
            return False
        if len(self._outgoing) >= self._hub.settings.max_queued_frames:
            self._closing = True
            WS_SLOW_CLIENT_CLOSES.inc()
            log.warning("client_too_slow", user=self._principal.user, queued=len(self._outgoing))
            # A task of its own: the close may wait on the very socket that is stuck.
            self._closer = asyncio.create_task(self._ws.close(CLOSE_TOO_SLOW))
            return False
        self._outgoing.append(frame)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)
        frame_sent(kind)
        return True

    def _answer(self, frame: AckFrame | ErrorFrame) -> None:
        if self.send(frame.type, model_frame(frame)) and isinstance(frame, ErrorFrame):
            WS_ERROR_FRAMES.labels(frame.code).inc()

    def _flush(self) -> None:
        """Write every queued frame in one go, unless the client's transport is full (the
        writer calls this again once it drained)."""
        self._flush_scheduled = False
        outgoing = self._outgoing
        if not outgoing or self._closing or not self._writer.ready():
            return
        self._outgoing = []
        # A client that is gone writes nothing: the reader sees the disconnect, cleans up.
        self._writer.write_frames(outgoing[0] if len(outgoing) == 1 else b"".join(outgoing))

    def _expire(self) -> None:
        """The token expired: nothing more in its name, and the page asks for a new link."""
        self._expiry = None
        if self._closing:
            return
        self._closing = True
        log.info("token_expired", user=self._principal.user)
        self._closer = asyncio.create_task(self._ws.close(CLOSE_UNAUTHORIZED, TOKEN_EXPIRED))

    async def serve(self) -> None:
        WS_CONNECTIONS.inc()
        expires_at = self._principal.expires_at
        if math.isfinite(expires_at):
            # On the loop's clock, from the wall clock's distance to `exp`.
            at = self._loop.time() + max(0.0, expires_at - time.time())
            self._expiry = self._loop.call_at(at, self._expire)
        try:
            while True:
                message = await self._ws.receive()
                if message["type"] == "websocket.disconnect":
                    return
                raw = message.get("text")
                if raw is None:
                    data = message.get("bytes") or b""
                    raw = data.decode("utf-8", errors="replace")
                await self._frame(raw)
        except WebSocketDisconnect:
            return
        finally:
            WS_CONNECTIONS.dec()
            if self._expiry is not None:
                self._expiry.cancel()
                self._expiry = None
            self._closing = True
            self._writer.on_writable = None
            await self._leave()

    async def _frame(self, raw: str) -> None:
        ref: str | None = None
        kind = "rejected"  # until it validates as a frame
        try:
            if len(raw.encode()) > self._hub.settings.max_frame_bytes:
                raise DomainError(
                    ErrorCode.PAYLOAD_TOO_LARGE,
                    f"a frame may be {self._hub.settings.max_frame_bytes} bytes at most",
                )
            allowed = self._bucket.take()  # every frame counts, even a malformed one
            try:
                body = json.loads(raw)
            except ValueError as exc:
                raise DomainError(ErrorCode.MALFORMED_JSON, f"not JSON: {exc}") from None
            if isinstance(body, dict) and isinstance(body.get("ref"), str):
                ref = body["ref"][:100]
            if not allowed:
                raise DomainError(ErrorCode.RATE_LIMITED, "too many frames; slow down")
            try:
                frame = FRAMES.validate_python(body)
            except ValidationError as exc:
                problems = "; ".join(
                    f"{'.'.join(map(str, e['loc'])) or 'frame'}: {e['msg']}"
                    for e in exc.errors(include_url=False, include_input=False)
                )
                raise DomainError(ErrorCode.INVALID_REQUEST, f"invalid frame: {problems}") from None
            kind = frame.type
            # Each frame its own trace (linked to the connection's): a chat message's
            # trace runs from here through the log, Criativo and metering.
            with new_trace(f"ws {frame.type}", SpanKind.SERVER, **{"websocket.frame": kind}):
                result = await self._dispatch(frame)
                log.debug("frame_handled", frame=kind)
            ack = AckFrame(
                of=frame.type,
                ref=ref,
                client_msg_id=getattr(frame, "client_msg_id", None),
                result=result,
            )
            self._answer(ack)
        except DomainError as exc:
            self._answer(ErrorFrame(code=exc.code, message=exc.message, ref=ref))
        except Exception as exc:
            # NATS or JetStream not answering (a node down, leaders being elected: a
            # join's DELTAS read can get a 503 under load on a replicated stream) is an
            # outage the client waits out, not the end of its connection.
            if not is_unavailable(exc):
                raise
            log.warning("frame_unavailable", frame=kind, error=repr(exc))
            message = "a part of the platform is restarting; send the frame again shortly"
            self._answer(ErrorFrame(code=ErrorCode.UNAVAILABLE, message=message, ref=ref))
        finally:
            frame_received(kind)

    async def _dispatch(self, frame: Any) -> dict[str, Any]:
        if isinstance(frame, Join):
            return await self._join(frame)
        if self._actions is None:
            raise DomainError(ErrorCode.NOT_JOINED, "join a session first")
        reply = await self._actions.handler(frame)()
        result: dict[str, Any] = reply.model_dump(mode="json")
        return result

    async def _join(self, frame: Join) -> dict[str, Any]:
        hub = self._hub
        view = await own_session(hub.session_log, self._principal, frame.session_id)
        await self._leave()
        feed = SessionFeed(
            hub.commands.nc,
            hub.fanout,
            hub.session_log,
            self._principal.project_id,
            frame.session_id,
            self.send,
        )
        try:
            await feed.start(frame.after_seq, view.event_count)
        except BaseException:
            await feed.close()
            raise
        self._feed = feed
        WS_JOINED_SESSIONS.inc()
        self._actions = SessionActions(
            hub.commands, hub.session_log, hub.confirmations, self._principal, frame.session_id
        )
        if view.status == "open":
            self._hub.presence.enter(frame.session_id)
            self._present = frame.session_id
        return {"session_id": str(frame.session_id), "status": view.status, "seq": feed.last_seq}

    async def _leave(self) -> None:
        feed, self._feed, self._actions = self._feed, None, None
        present, self._present = self._present, None
        if feed is not None:
            WS_JOINED_SESSIONS.dec()
            await feed.close()
        if present is not None:
            await self._hub.presence.leave(present)


async def websocket_endpoint(hub: Hub, ws: WebSocket) -> None:
    """`/ws?ticket=…`: browsers cannot set headers on a WebSocket, so what admits one is
    in its URL, and URLs get logged: a single-use ticket of seconds (`gateway.tickets`),
    never the token. A client that sends a token there (or nothing) gets an `error`
    frame saying how to get a ticket and is closed with 4401."""
    await ws.accept()
    writer: FrameWriter = ws.scope["extensions"][EXTENSION]["writer"]
    try:
        principal = hub.tickets.redeem(ws.query_params.get("ticket"))
    except DomainError as exc:
        await ws.send_text(ErrorFrame(code=exc.code, message=exc.message).model_dump_json())
        frame_sent("error")
        WS_ERROR_FRAMES.labels(exc.code).inc()
        await ws.close(CLOSE_UNAUTHORIZED, "ticket refused")
        return
    await Connection(hub, ws, principal, writer).serve()
