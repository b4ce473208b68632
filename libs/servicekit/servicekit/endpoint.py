"""Command endpoints: request/reply on core NATS, discoverable through NATS micro.

Every command is validated against its contract model and answered with either
the reply model or `{"error": {"code", "message", "details"}}` — never silence and
never a crash. Endpoints are registered with `nats.micro`, so `$SRV.PING`,
`$SRV.INFO` and `$SRV.STATS` answer and `nats micro ls` lists the service; replicas
share the load through the service's queue group.

nats-py runs one subscription's callbacks one after another, so each request is
handled in its own task (bounded by `concurrency`); micro's per-endpoint timing
therefore measures hand-off, not the handler.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import asyncpg
from nats.aio.client import Client
from nats.micro import add_service
from nats.micro.request import Request
from nats.micro.service import EndpointConfig, Service
from pydantic import BaseModel, ValidationError

from contracts.common import ErrorBody, ErrorCode, ErrorReply, Message
from domain.errors import DomainError
from servicekit.logs import get_logger
from servicekit.telemetry import span_from_headers

log = get_logger(__name__)

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
    body = ErrorBody(code=str(code), message=message, details=details)
    return ErrorReply(error=body).model_dump_json().encode()


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

    async def start(self, nc: Client, concurrency: int = 256, instance: str = "") -> Service:
        """Subscribe every command in the service's queue group; return the micro service."""
        service = await add_service(
            nc,
            name=self.service,
            version=self.version,
            description=self.description,
            queue_group=self.service,
            # lets a supervisor or a test tell the replicas apart in $SRV.PING replies
            metadata={"instance": instance, "pid": str(os.getpid())},
        )
        limit = asyncio.Semaphore(concurrency)
        for command in self.commands:
            await service.add_endpoint(
                EndpointConfig(
                    name=command.name,
                    subject=command.subject,
                    handler=self._dispatcher(command, limit),
                    metadata={"request": command.request.__name__},
                )
            )
        return service

    async def drain(self) -> None:
        """Wait for the requests in flight (after the subscriptions stopped)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _dispatcher(
        self, command: Command, limit: asyncio.Semaphore
    ) -> Callable[[Request], Awaitable[None]]:
        async def dispatch(request: Request) -> None:
            await limit.acquire()  # back-pressure: stop reading when saturated
            task = asyncio.create_task(self._answer(command, request))
            self._tasks.add(task)

            def finished(t: asyncio.Task[None]) -> None:
                self._tasks.discard(t)
                limit.release()

            task.add_done_callback(finished)

        return dispatch

    async def _answer(self, command: Command, request: Request) -> None:
        with span_from_headers(command.subject, request.headers):
            body = await self.handle_raw(command, request.data)
        try:
            await request.respond(body)
        except Exception as exc:  # published without a reply subject, or the bus went away
            log.warning("command_reply_failed", subject=command.subject, error=repr(exc))

    async def handle_raw(self, command: Command, data: bytes) -> bytes:
        """Parse, validate, run and serialise one request; every failure becomes an error reply."""
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
            return reply.model_dump_json().encode()
        except DomainError as exc:
            log.info("command_refused", subject=command.subject, code=exc.code, reason=exc.message)
            return error_reply(exc.code, exc.message, **exc.details)
        except UNAVAILABLE_ERRORS as exc:
            log.warning("command_unavailable", subject=command.subject, error=repr(exc))
            return error_reply(ErrorCode.UNAVAILABLE, f"temporarily unavailable, retry: {exc!r}")
        except Exception as exc:
            log.exception("command_failed", subject=command.subject)
            return error_reply(ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}")
