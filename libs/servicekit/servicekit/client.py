"""Calling a command: send the request model, get the reply model or a `CommandFailed`."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from nats.aio.client import Client
from pydantic import BaseModel

from servicekit.telemetry import inject_headers

Rep = TypeVar("Rep", bound=BaseModel)


class CommandFailed(Exception):
    """The service answered with an error reply."""

    def __init__(self, code: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.details = details or {}


def parse_reply(data: bytes, reply_model: type[Rep]) -> Rep:
    """The reply model, or `CommandFailed` when the reply is an error."""
    if data.startswith(b'{"error":'):
        error = json.loads(data)["error"]
        raise CommandFailed(error["code"], error["message"], error.get("details"))
    return reply_model.model_validate_json(data)


async def call(
    nc: Client, subject: str, request: BaseModel, reply_model: type[Rep], timeout: float = 5.0
) -> Rep:
    """Send a command and wait for its reply, carrying the trace context."""
    msg = await nc.request(
        subject, request.model_dump_json().encode(), timeout=timeout, headers=inject_headers()
    )
    return parse_reply(msg.data, reply_model)
