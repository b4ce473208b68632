"""Wiring of the handoff service: the one place its parts are put together."""

from __future__ import annotations

from handoff.batching import OfferBatcher
from handoff.directory import SessionDirectory
from handoff.handlers import CLOSINGS, SERVICE, svc
from handoff.repository import HandoffRepository
from handoff.settings import HandoffSettings
from servicekit.outbox import CommandSender
from servicekit.runtime import run_service
from servicekit.sessionlog import SessionLogClient
from servicekit.settings import ServiceSettings

__all__ = ["CLOSINGS", "main", "run"]


async def main(settings: ServiceSettings | None = None) -> None:
    """Serve the handoff commands, relay its events to the log, follow session closings."""
    async with svc.open(settings or HandoffSettings()) as rt:
        relay = rt.relay(CommandSender(rt.nc))
        repo = HandoffRepository(rt.pool, relay.wake)
        await svc.serve(
            rt,
            repo=repo,
            offers=OfferBatcher(repo),
            sessions=SessionDirectory(SessionLogClient(rt.nc)),
            relay=relay,
        )


def run() -> None:
    """Entry point: `python -m handoff`."""
    run_service(SERVICE, main())
