"""Command endpoints: request/reply on core NATS, discoverable through NATS micro.

Every command is validated against its contract model and answered with either
the reply model or `{"error": {"code", "message", "details"}}` — never silence and
never a crash. Endpoints are registered with `nats.micro`, so `$SRV.PING`,
`$SRV.INFO` and `$SRV.STATS` answer and `nats micro ls` lists the service; replicas
share the load through the service's queue group.

nats-py runs one subscription's callbacks one after another, so each request is
handled in its own task (bounded by `concurrency`). micro counts an error and times a
request only around its handler callback, which here returns at hand-off: so the
kit adds each answered request's own time and its error to the endpoint's `$SRV.STATS`
itself (`_MicroStats`), and sends error replies with micro's error headers
(`Nats-Service-Error`, `Nats-Service-Error-Code`: the code) besides the error body
every caller reads. Each command is also timed and its errors counted in Prometheus
(servicekit.metrics).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import asyncpg
from nats.aio.client import Client
from nats.micro.request import Request
from nats.micro.service import Endpoint, EndpointConfig, Service, ServiceConfig
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import Histogram
from pydantic import BaseModel, ValidationError

from contracts.common import ErrorBody, ErrorCode, ErrorReply, Message
from domain.errors import DomainError
from servicekit.logs import get_logger
from servicekit.metrics import COMMAND_ERRORS, COMMAND_SECONDS
from servicekit.patience import is_unavailable
from servicekit.telemetry import handling_span

log = get_logger(__name__)
_stdlib_log = logging.getLogger(__name__)  # what structlog's level filter asks

Req = TypeVar("Req", bound=BaseModel)
# A request larger than this is refused before parsing (the server may allow more).
MAX_REQUEST_BYTES = 1024 * 1024

# Failures of the store or the bus that a retry may cure.
UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (
    asyncpg.exceptions.CannotConnectNowError,
    asyncpg.exceptions.TooManyConnectionsError,
    asyncpg.exceptions.ConnectionDoesNotExistError,
    asyncpg.exceptions.InterfaceError,
    asyncpg.exceptions.SerializationError,
    asyncpg.exceptions.DeadlockDetectedError,
    ConnectionError,
    TimeoutError,
)


@dataclass(frozen=True)
class Command:
    """One command: its subject, its request model and the handler that answers it."""

    subject: str
    request: type[BaseModel]
    handler: Callable[[Any], Awaitable[Message]]

    @property
    def name(self) -> str:
        return self.subject.replace(".", "_")


def error_reply(code: ErrorCode | str, message: str, **details: Any) -> bytes:
    """The serialised error reply every caller knows how to read."""
    return _error(code, message, **details).body


@dataclass(frozen=True)
class Answer:
    """A serialised reply, and its error code when it is an error reply."""

    body: bytes
    error: ErrorBody | None = None


def _error(code: ErrorCode | str, message: str, **details: Any) -> Answer:
    body = ErrorBody(code=str(code), message=message, details=details)
    return Answer(ErrorReply(error=body).model_dump_json().encode(), body)


class _MicroStats:
    """Adds a handled request's time and error to its micro endpoint's `$SRV.STATS`.

    nats-py keeps those numbers in the endpoint's private fields and updates them only
    around the callback (the hand-off here); there is no public way to report a
    request answered later. The kit's test of `$SRV.STATS` breaks if they change.
    """

    def __init__(self) -> None:
        self.endpoint: Endpoint | None = None  # exists once micro added it

    def record(self, elapsed_ns: int, error: ErrorBody | None) -> None:
        ep = self.endpoint
        if ep is None:
            return
        ep._processing_time += elapsed_ns
        if ep._num_requests:
            ep._average_processing_time = int(ep._processing_time / ep._num_requests)
        if error is not None:
            ep._num_errors += 1
            ep._last_error = f"{error.code}: {error.message}"  # type: ignore[assignment]


def error_body(exc: Exception, subject: str) -> ErrorBody:
    """The coded error a command answers for `exc` (logged): a refusal keeps its code, a
    failure of the store or the bus is `unavailable`, anything else `internal`. Also
    what a command answering many items gives each failed one (`cmd.events.append_many`).

    A service this handler asked that is away (no responders, no answer in time, or its
    own `unavailable`), once the handler's patience ran out, is an outage too: the caller
    may retry the same request, where `internal` would tell it the request is at fault."""
    if isinstance(exc, DomainError):
        log.info("command_refused", subject=subject, code=exc.code, reason=exc.message)
        return ErrorBody(code=exc.code, message=exc.message, details=exc.details)
    if isinstance(exc, UNAVAILABLE_ERRORS) or is_unavailable(exc):
        log.warning("command_unavailable", subject=subject, error=repr(exc))
        message = f"temporarily unavailable, retry: {exc!r}"
        return ErrorBody(code=ErrorCode.UNAVAILABLE.value, message=message)
    log.error("command_failed", subject=subject, exc_info=exc)
    return ErrorBody(code=ErrorCode.INTERNAL.value, message=f"internal error: {type(exc).__name__}")


def _invalid_request(exc: ValidationError) -> DomainError:
    errors = exc.errors(include_url=False, include_input=False)
    if any(e["type"] == "json_invalid" for e in errors):
        return DomainError(
            ErrorCode.MALFORMED_JSON, f"request is not valid JSON: {errors[0]['msg']}"
        )
    problems = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in errors]
    summary = "; ".join(
        f"{'.'.join(map(str, p['loc'])) or 'request'}: {p['msg']}" for p in problems
    )
    return DomainError(ErrorCode.INVALID_REQUEST, f"invalid request: {summary}", errors=problems)


@functools.cache
def _command_seconds(subject: str) -> Histogram:
    """The histogram child timing `subject`: looked up once, not under the metric's lock
    at every request."""
    return COMMAND_SECONDS.labels(subject)


class Endpoints:
    """The commands of one service, served as a NATS micro service."""

    def __init__(self, service: str, version: str, description: str) -> None:
        self.service = service
        self.version = version
        self.description = description
        self.commands: list[Command] = []
        self._tasks: set[asyncio.Task[None]] = set()

    def command(
        self, subject: str, request: type[Req]
    ) -> Callable[[Callable[[Req], Awaitable[Message]]], Callable[[Req], Awaitable[Message]]]:
        """Register `handler` as the answer to `subject`, its request parsed as `request`."""

        def register(
            handler: Callable[[Req], Awaitable[Message]],
        ) -> Callable[[Req], Awaitable[Message]]:
            self.commands.append(Command(subject, request, handler))
            return handler

        return register

    async def start(
        self,
        nc: Client,
        concurrency: int = 256,
        instance: str = "",
        metrics_url: str = "",
        metadata: Mapping[str, str] | None = None,
    ) -> Service:
        """Subscribe every command in the service's queue group; return the micro service.
        `metrics_url` is announced in its metadata, where `agentbus up` finds it, with
        the service's own `metadata` (what `$SRV.INFO.<service>` tells its callers)."""
        # Endpoints first, `$SRV.PING` last (`start`): a replica that answers a ping
        # answers its commands too, so a caller told it is up never finds no responders.
        service = Service(
            nc,
            ServiceConfig(
                name=self.service,
                version=self.version,
                description=self.description,
                queue_group=self.service,
                # lets a supervisor or a test tell the replicas apart in $SRV.PING replies
                metadata={
                    **(metadata or {}),
                    "instance": instance,
                    "pid": str(os.getpid()),
                    "metrics": metrics_url,
                },
            ),
        )
        limit = asyncio.Semaphore(concurrency)
        for command in self.commands:
            stats = _MicroStats()
            await service.add_endpoint(
                EndpointConfig(
                    name=command.name,
                    subject=command.subject,
                    handler=self._dispatcher(command, limit, stats),
                    metadata={"request": command.request.__name__},
                )
            )
            stats.endpoint = service._endpoints[-1]
        await service.start()
        return service

    async def drain(self) -> None:
        """Wait for the requests in flight (after the subscriptions stopped)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _dispatcher(
        self, command: Command, limit: asyncio.Semaphore, stats: _MicroStats
    ) -> Callable[[Request], Awaitable[None]]:
        async def dispatch(request: Request) -> None:
            await limit.acquire()  # back-pressure: stop reading when saturated
            task = asyncio.create_task(self._answer(command, request, stats))
            self._tasks.add(task)

            def finished(t: asyncio.Task[None]) -> None:
                self._tasks.discard(t)
                limit.release()

            task.add_done_callback(finished)

        return dispatch

    async def _answer(self, command: Command, request: Request, stats: _MicroStats) -> None:
        started = time.perf_counter_ns()
        with handling_span(
            command.subject, request.headers, SpanKind.SERVER, command.subject
        ) as span:
            answer = await self.answer(command, request.data)
            if answer.error is not None:
                span.set_attribute("error.type", answer.error.code)
                span.set_status(StatusCode.ERROR, answer.error.code)
            await self._reply(command, request, answer)
            # Asked of the stdlib logger first: a dropped structlog line still costs each
            # request microseconds on its way to the level filter.
            if _stdlib_log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "command_answered",
                    subject=command.subject,
                    error=answer.error.code if answer.error else None,
                )
        stats.record(time.perf_counter_ns() - started, answer.error)

    async def _reply(self, command: Command, request: Request, answer: Answer) -> None:
        try:
            if answer.error is None:
                await request.respond(answer.body)
            else:
                # Header values are one line; the body keeps the whole message.
                description = (
                    answer.error.message.splitlines()[0][:200] if answer.error.message else ""
                )
                await request.respond_error(answer.error.code, description, answer.body)
        except Exception as exc:  # published without a reply subject, or the bus went away
            log.warning("command_reply_failed", subject=command.subject, error=repr(exc))

    async def handle_raw(self, command: Command, data: bytes) -> bytes:
        """Parse, validate, run and serialise one request; every failure becomes an error reply."""
        return (await self.answer(command, data)).body

    async def answer(self, command: Command, data: bytes) -> Answer:
        """`handle_raw`, with the error code of an error reply, timed and counted."""
        started = time.perf_counter()
        answer = await self._run(command, data)
        _command_seconds(command.subject).observe(time.perf_counter() - started)
        if answer.error is not None:
            COMMAND_ERRORS.labels(command.subject, answer.error.code).inc()
        return answer

    async def _run(self, command: Command, data: bytes) -> Answer:
        try:
            if len(data) > MAX_REQUEST_BYTES:
                raise DomainError(
                    ErrorCode.PAYLOAD_TOO_LARGE,
                    f"request is {len(data)} bytes; the limit is {MAX_REQUEST_BYTES}",
                    size_bytes=len(data),
                    limit_bytes=MAX_REQUEST_BYTES,
                )
            try:
                parsed = command.request.model_validate_json(data)
            except ValidationError as exc:
                raise _invalid_request(exc) from None
            reply = await command.handler(parsed)
            return Answer(reply.model_dump_json().encode())
        except Exception as exc:
            body = error_body(exc, command.subject)
            return Answer(ErrorReply(error=body).model_dump_json().encode(), body)
