"""The HTTP JSON API: `/api/projects/{project}/…`, each route one command.

Every route needs a token for the project in its path, in `Authorization: Bearer …`
only: a token in a URL ends up in access logs. A refusal keeps the service's code and
gets the HTTP status a client expects (`STATUS`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from contracts import catalog
from contracts.common import ErrorBody, ErrorCode, ErrorReply
from contracts.gateway import ClientConfig, ForkRequest
from contracts.handoff import ListHandoffs
from contracts.metering import (
    LimitsStatusRequest,
    ListBindings,
    UsageSummaryRequest,
)
from contracts.psychologist import (
    HypothesisDecision,
    ListHypotheses,
    Reanalyze,
)
from contracts.session_events import EventsReply, ForkSession, ListEvents, ListSessions
from domain.errors import DomainError
from gateway.access import own_session
from gateway.auth import Principal, require_project, verify
from gateway.metrics import HTTP_SECONDS
from gateway.model import OfflineModel
from gateway.views import sessions_of
from gateway.ws import Hub

NOT_FOUND = {
    ErrorCode.SESSION_NOT_FOUND,
    ErrorCode.HANDOFF_NOT_FOUND,
    ErrorCode.HYPOTHESIS_NOT_FOUND,
    ErrorCode.ARTIFACT_NOT_FOUND,
    ErrorCode.UNKNOWN_AGENT,
    ErrorCode.NO_BINDING,
}
CONFLICT = {
    ErrorCode.AGENTE_JA_ATIVO,
    ErrorCode.INVALID_TRANSITION,
    ErrorCode.SESSION_CLOSED,
    ErrorCode.SESSION_NOT_CLOSED,
    ErrorCode.IDEMPOTENCY_CONFLICT,
    ErrorCode.TURN_IN_PROGRESS,
}
UNPROCESSABLE = {
    ErrorCode.MALFORMED_JSON,
    ErrorCode.INVALID_REQUEST,
    ErrorCode.INVALID_PAYLOAD,
    ErrorCode.INVALID_BINDING,
    # a model named in the request body that has no price: a refused value, not a path
    ErrorCode.UNKNOWN_MODEL,
    ErrorCode.UNKNOWN_EVENT_TYPE,
    ErrorCode.FORK_POINT_NOT_FOUND,
}
FIXED = {
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.FORBIDDEN: 403,
    ErrorCode.ACTOR_NOT_ALLOWED: 403,
    ErrorCode.ACTIVATION_REFUSED: 403,
    ErrorCode.PAYLOAD_TOO_LARGE: 413,
    ErrorCode.RATE_LIMITED: 429,
    ErrorCode.INTERNAL: 500,
    ErrorCode.UNAVAILABLE: 503,
}


def status_of(code: str) -> int:
    """The HTTP status of a service's error code."""
    if code in FIXED:
        return FIXED[ErrorCode(code)]
    if code in NOT_FOUND:
        return 404
    if code in CONFLICT:
        return 409
    if code in UNPROCESSABLE:
        return 422
    return 400


class BodyLimit:
    """Refuses a request whose body is over `limit` bytes with 413 `payload_too_large`,
    before the app sees any of it (and so before anything is written).

    A declared `Content-Length` over the limit is refused without reading the body. A
    chunked body is read up to the limit, counting, and handed on whole only if it fits:
    a handler that never reads its body (opening a session) would otherwise act first.
    Pure ASGI: a request that declares its length costs one pass over its headers.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self._app = app
        self._limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        length = chunked = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                length = value
            elif name == b"transfer-encoding":
                chunked = value
        if length is not None:
            # the server refused a malformed length already; it delivers no more than it
            if int(length) > self._limit:
                await self._refuse(send)
                return
        elif chunked is not None:
            try:
                body = await self._read(receive)
            except _ClientGone:
                return  # no one to answer, and nothing whole to act on
            if body is None:
                await self._refuse(send)
                return
            receive = _replay(body, receive)
        await self._app(scope, receive, send)

    async def _read(self, receive: Receive) -> bytes | None:
        """The whole body, or None once it passes the limit (the rest is left unread)."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self._limit:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _refuse(self, send: Send) -> None:
        error = ErrorBody(
            code=ErrorCode.PAYLOAD_TOO_LARGE,
            message=f"a request body may be {self._limit} bytes at most",
            details={"limit_bytes": self._limit},
        )
        body = ErrorReply(error=error).model_dump_json().encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        status = status_of(ErrorCode.PAYLOAD_TOO_LARGE)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class _ClientGone(Exception):
    """The client disconnected before its body was whole."""


def _replay(body: bytes, receive: Receive) -> Receive:
    """`receive` that gives `body` (already read) first, then what the server sends next
    (the disconnect)."""
    pending = [body]

    async def replayed() -> Message:
        if pending:
            return {"type": "http.request", "body": pending.pop(), "more_body": False}
        return await receive()

    return replayed


def _json(model: BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


def _token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip()
    return None


M = TypeVar("M", bound=BaseModel)
Handler = Callable[[Request, Principal], Awaitable[BaseModel]]


def guarded(
    hub: Hub, handler: Handler, status: int = 200
) -> Callable[[Request], Awaitable[Response]]:
    """Authenticate, check the project, run `handler`, turn a refusal into its status."""

    async def endpoint(request: Request) -> Response:
        try:
            principal = verify(hub.secret, _token(request))
            require_project(principal, request.path_params["project"])
            return _json(await handler(request, principal), status)
        except DomainError as exc:
            body = ErrorReply(
                error=ErrorBody(code=exc.code, message=exc.message, details=exc.details)
            )
            return _json(body, status_of(exc.code))

    return endpoint


def timed(
    route: str, method: str, endpoint: Callable[[Request], Awaitable[Response]]
) -> Callable[[Request], Awaitable[Response]]:
    """`endpoint`, its latency observed by route template (never the concrete path, whose
    ids would make a series per session) and status."""

    async def observed(request: Request) -> Response:
        started = time.perf_counter()
        status = "500"  # what Starlette answers if the endpoint raises
        try:
            response = await endpoint(request)
            status = str(response.status_code)
            return response
        finally:
            HTTP_SECONDS.labels(route, method, status).observe(time.perf_counter() - started)

    return observed


def _uuid(request: Request, name: str) -> uuid.UUID:
    try:
        return uuid.UUID(request.path_params[name])
    except ValueError:
        raise DomainError(ErrorCode.INVALID_REQUEST, f"{name} is not a uuid") from None


def _parse(model: type[M], data: dict[str, Any]) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
            for e in exc.errors(include_url=False, include_input=False)
        )
        raise DomainError(ErrorCode.INVALID_REQUEST, f"invalid request: {problems}") from None


async def _body(request: Request) -> dict[str, Any]:
    """The request's JSON object body, or `malformed_json`."""
    try:
        data = await request.json()
    except ValueError:
        raise DomainError(ErrorCode.MALFORMED_JSON, "the body is not JSON") from None
    if not isinstance(data, dict):
        raise DomainError(ErrorCode.MALFORMED_JSON, "the body must be a JSON object")
    return data


def routes(hub: Hub) -> list[Route]:
    """The API's routes, each a few lines over one command."""
    c, session_log = hub.commands, hub.session_log
    offline_model = OfflineModel(c.announced, hub.settings.model_notice_seconds)

    async def ws_ticket(_: Request, p: Principal) -> BaseModel:
        return hub.tickets.issue(p)

    async def whoami(_: Request, p: Principal) -> BaseModel:
        return ClientConfig(
            project_id=p.project_id, user=p.user, offline_model=await offline_model()
        )

    async def list_sessions(_: Request, p: Principal) -> BaseModel:
        return sessions_of(await session_log.sessions(p.project_id))

    async def open_session(_: Request, p: Principal) -> BaseModel:
        return await session_log.open(p.project_id, p.actor)

    async def get_session(r: Request, p: Principal) -> BaseModel:
        return await own_session(session_log, p, _uuid(r, "session"))

    async def session_events(r: Request, p: Principal) -> BaseModel:
        session_id = _uuid(r, "session")
        await own_session(session_log, p, session_id)
        params = {k: v for k, v in r.query_params.items() if k in ("after_seq", "limit")}
        query = _parse(ListEvents, {"session_id": session_id, **params})
        page = await session_log.page(session_id, query.after_seq, query.limit)
        return EventsReply(events=page)

    async def fork(r: Request, p: Principal) -> BaseModel:
        session_id = _uuid(r, "session")
        await own_session(session_log, p, session_id)
        body = _parse(ForkRequest, await _body(r))
        request = ForkSession(
            session_id=session_id,
            project_id=p.project_id,
            at_seq=body.at_seq,
            text=body.text,
            forked_by=p.actor,
            fork_id=body.fork_id,
        )
        return await c(catalog.SESSIONS_FORK, request)

    async def branches(r: Request, p: Principal) -> BaseModel:
        session_id = _uuid(r, "session")
        await own_session(session_log, p, session_id)
        listed = await c(
            catalog.SESSIONS_LIST, ListSessions(project_id=p.project_id, forked_from=session_id)
        )
        return sessions_of(listed.sessions)

    async def handoffs(r: Request, p: Principal) -> BaseModel:
        session = r.query_params.get("session_id")
        request = _parse(ListHandoffs, {"project_id": p.project_id, "session_id": session})
        return await c(catalog.HANDOFFS_LIST, request)

    async def insights(r: Request, p: Principal) -> BaseModel:
        status = r.query_params.get("status")
        request = _parse(ListHypotheses, {"project_id": p.project_id, "status": status})
        return await c(catalog.HYPOTHESES_LIST, request)

    async def decide(r: Request, p: Principal) -> BaseModel:
        hypothesis_id = _uuid(r, "hypothesis")
        if r.path_params["decision"] not in ("accept", "dismiss"):
            raise DomainError(ErrorCode.INVALID_REQUEST, "decide with accept or dismiss")
        listed = await c(
            catalog.HYPOTHESES_LIST,
            ListHypotheses(project_id=p.project_id, include_superseded=True),
        )
        if not any(h.id == hypothesis_id for g in listed.groups for h in g.hypotheses):
            raise DomainError(
                ErrorCode.HYPOTHESIS_NOT_FOUND, f"no hypothesis {hypothesis_id} in this project"
            )
        command = (
            catalog.HYPOTHESES_ACCEPT
            if r.path_params["decision"] == "accept"
            else catalog.HYPOTHESES_DISMISS
        )
        decision = HypothesisDecision(hypothesis_id=hypothesis_id, actor=p.actor)
        return await c(command, decision)

    async def reanalyze(r: Request, p: Principal) -> BaseModel:
        session_id = _uuid(r, "session")
        await own_session(session_log, p, session_id)
        request = Reanalyze(project_id=p.project_id, session_id=session_id, requested_by=p.actor)
        return await c(catalog.PSYCHOLOGIST_REANALYZE, request, timeout=120)

    async def bindings(_: Request, p: Principal) -> BaseModel:
        return await c(catalog.BINDINGS_LIST, ListBindings(project_id=p.project_id))

    async def set_binding(_: Request, p: Principal) -> BaseModel:
        # Which model answers decides what a call costs: an operator's choice, like the
        # limits, never a token holder's (a token could bind the dearest model).
        raise DomainError(
            ErrorCode.FORBIDDEN,
            "bindings are set by an operator (agentbus bindings set …), not with a token",
        )

    async def limits(_: Request, p: Principal) -> BaseModel:
        request = LimitsStatusRequest(project_id=p.project_id, person=p.user)
        return await c(catalog.LIMITS_STATUS, request)

    async def usage(r: Request, p: Principal) -> BaseModel:
        group_by = (r.query_params.get("group_by") or "session,agent,model").split(",")
        session = r.query_params.get("session_id")
        request = _parse(
            UsageSummaryRequest,
            {"group_by": group_by, "project_id": p.project_id, "session_id": session},
        )
        return await c(catalog.USAGE_SUMMARY, request)

    base = "/api/projects/{project}"

    def route(path: str, handler: Handler, method: str = "GET", status: int = 200) -> Route:
        endpoint = timed(base + path, method, guarded(hub, handler, status))
        return Route(base + path, endpoint, methods=[method])

    return [
        route("", whoami),
        route("/ws-ticket", ws_ticket, "POST"),
        route("/sessions", list_sessions),
        route("/sessions", open_session, "POST", 201),
        route("/sessions/{session}", get_session),
        route("/sessions/{session}/events", session_events),
        route("/sessions/{session}/reanalyze", reanalyze, "POST"),
        route("/sessions/{session}/fork", fork, "POST", 201),
        route("/sessions/{session}/branches", branches),
        route("/handoffs", handoffs),
        route("/insights", insights),
        route("/hypotheses/{hypothesis}/{decision:str}", decide, "POST"),
        route("/bindings", bindings),
        route("/bindings", set_binding, "PUT"),
        route("/usage", usage),
        route("/limits", limits),
    ]
