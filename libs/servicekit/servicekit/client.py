"""Calling a command: send the request model, get the reply model or a `CommandFailed`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar, overload

import nats.errors
from nats.aio.client import Client
from pydantic import BaseModel, ValidationError

from contracts.catalog import Command
from contracts.common import ErrorReply, Message
from domain.errors import DomainError
from servicekit.telemetry import request_span

Rep = TypeVar("Rep", bound=BaseModel)
T = TypeVar("T")
# A command's models, as the catalog types them.
CReq = TypeVar("CReq", bound=Message)
CRep = TypeVar("CRep", bound=Message)


class CommandFailed(Exception):
    """The service answered with an error reply: its `code`, `message` and `details`."""

    def __init__(self, code: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.details = details or {}

    def refusal(self) -> DomainError:
        """The same refusal, raised on by a command handler as its own reply."""
        return DomainError(self.code, self.message, **self.details)


def parse_reply(data: bytes, reply_model: type[Rep]) -> Rep:
    """The reply model, or `CommandFailed` when the reply is an error.

    Every contract model forbids unknown fields, so an error reply never passes for a
    result: it is read as the contract's `ErrorReply` only when the result fails.
    """
    try:
        return reply_model.model_validate_json(data)
    except ValidationError:
        try:
            error = ErrorReply.model_validate_json(data).error
        except ValidationError:
            error = None
        if error is None:
            raise
        raise CommandFailed(error.code, error.message, dict(error.details)) from None


@overload
async def call(
    nc: Client, command: Command[CReq, CRep], request: CReq, *, timeout: float = 5.0
) -> CRep: ...


@overload
async def call(
    nc: Client, command: str, request: BaseModel, reply_model: type[Rep], timeout: float = 5.0
) -> Rep: ...


async def call(
    nc: Client,
    command: Command[Any, Any] | str,
    request: BaseModel,
    reply_model: type[BaseModel] | None = None,
    timeout: float = 5.0,
) -> BaseModel:
    """Send a command and wait for its reply, carrying the trace context.

    Given the catalog's `Command`, the request and the reply are typed by it; given a
    subject, the caller names the reply model.
    """
    if isinstance(command, Command):
        subject, reply_model = command.subject, command.reply
    else:
        subject = command
    if reply_model is None:
        raise TypeError(f"call({subject!r}): name the reply model, or pass the catalog's Command")
    with request_span(subject) as headers:
        msg = await nc.request(
            subject, request.model_dump_json().encode(), timeout=timeout, headers=headers
        )
    return parse_reply(msg.data, reply_model)


async def resent(
    send: Callable[[float], Awaitable[T]], *, timeout: float, first_after: float, copies: int = 3
) -> T:
    """The first answer to an idempotent request, `send(timeout)`, sent again while
    unanswered: after `first_after` seconds, then twice as long each time, up to
    `copies` in all, every copy within the first one's `timeout`. The first copy to end
    decides: its reply, or its error (no responders, a refusal, the timeout); the others
    are dropped.

    NATS hands a request to one replica of the service. One that dies before answering
    leaves no trace the caller could see: no error, no reply, only the timeout, which for
    a read of the log is 30 s (a page is a large reply from a busy log). Sent again, the
    request goes to a replica that is there, so a dead one costs `first_after`, and a
    slow but live one costs a second copy of an idempotent request. Copies are bounded so
    that an overloaded service is not sent ever more of them.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    pending: set[asyncio.Future[T]] = {asyncio.ensure_future(send(timeout))}
    wait = first_after
    try:
        for _ in range(copies - 1):
            done, pending = await asyncio.wait(
                pending, timeout=wait, return_when=asyncio.FIRST_COMPLETED
            )
            if done:
                return _first(done)
            left = deadline - loop.time()
            if left <= 0:
                break
            pending.add(asyncio.ensure_future(send(left)))
            wait *= 2
        # Each copy ends by the deadline (its own timeout), so this wait does too.
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        return _first(done)
    finally:
        for task in pending:
            task.cancel()


def _first(done: set[asyncio.Future[T]]) -> T:
    """The answer of one copy that ended; the others that ended with it are dropped (their
    errors read, so that none is reported as never retrieved)."""
    first, *others = done
    for other in others:
        other.exception()
    return first.result()


async def announced(nc: Client, service: str, timeout: float = 1.0) -> dict[str, str] | None:
    """The metadata one replica of `service` announces in its NATS micro info
    (`$SRV.INFO.<service>`, `Service.serve(metadata=…)`); None when none answers."""
    try:
        msg = await nc.request(f"$SRV.INFO.{service}", b"", timeout=timeout)
        info = json.loads(msg.data)
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError, ValueError):
        return None
    metadata = info.get("metadata") if isinstance(info, dict) else None
    return metadata if isinstance(metadata, dict) else {}


async def listened(nc: Client, subject: str, timeout: float) -> bool | None:
    """Whether anyone listens on `subject`, asked with an empty request: False when NATS
    says no responders (no connection subscribes there), True when one answered, None
    when it is not known (no answer in time, or this connection is down)."""
    try:
        await nc.request(subject, b"", timeout=timeout)
    except nats.errors.NoRespondersError:
        return False
    except Exception:
        return None
    return True


class Caller(Protocol):
    """How a client sends a command: `call` on a connection, or a caller's own door that
    adds its policy (the gateway's turns every failure into a `DomainError`)."""

    async def __call__(
        self, command: Command[CReq, CRep], request: CReq, timeout: float
    ) -> CRep: ...
