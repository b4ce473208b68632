"""The gateway's door to the other services: commands with the gateway's timeout.

The session log's commands go through the kit's `SessionLogClient` with this door as
its caller, so a refusal or a silence of the log reaches the client the same way as
any other service's.
"""

from __future__ import annotations

from typing import TypeVar

import nats.errors
from nats.aio.client import Client

from contracts.catalog import Command
from contracts.common import ErrorCode, Message
from domain.errors import DomainError
from servicekit.client import CommandFailed, announced, call
from servicekit.sessionlog import typed_refusal

CReq = TypeVar("CReq", bound=Message)
CRep = TypeVar("CRep", bound=Message)


class Commands:
    """Sends a command and turns a refusal or a silent service into a `DomainError`
    (a servicekit `Caller`)."""

    def __init__(self, nc: Client, timeout: float) -> None:
        self.nc = nc
        self._timeout = timeout

    async def __call__(
        self, command: Command[CReq, CRep], request: CReq, timeout: float | None = None
    ) -> CRep:
        """Send the catalog's `command`; its reply, typed by it, or a `DomainError`."""
        try:
            return await call(self.nc, command, request, timeout=timeout or self._timeout)
        except CommandFailed as exc:
            raise typed_refusal(exc) or exc.refusal() from None
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as exc:
            raise DomainError(
                ErrorCode.UNAVAILABLE,
                f"{command.subject} did not answer ({type(exc).__name__}); retry",
            ) from None

    async def announced(self, service: str) -> dict[str, str] | None:
        """What a replica of `service` announces in its micro info; None when none answers."""
        return await announced(self.nc, service)
