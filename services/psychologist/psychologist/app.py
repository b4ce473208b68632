"""Wiring of the psychologist service: the one place its parts are put together."""

from __future__ import annotations

from harness import MeteringClient
from psychologist.analysis import Analyst
from psychologist.handlers import SERVICE, closings_spec, svc
from psychologist.repository import PsychologistRepository
from psychologist.settings import PsychologistSettings
from servicekit.outbox import CommandSender
from servicekit.runtime import run_service
from servicekit.sessionlog import SessionLogClient

__all__ = ["closings_spec", "main", "run"]


async def main(settings: PsychologistSettings | None = None) -> None:
    """Serve the commands, relay its events to the log, analyse every closed session."""
    settings = settings or PsychologistSettings()
    async with svc.open(settings) as rt:
        relay = rt.relay(CommandSender(rt.nc))
        repo = PsychologistRepository(rt.pool, relay.wake)
        session_log = SessionLogClient(rt.nc)
        metering = MeteringClient(rt.nc, timeout=settings.turn_lost_seconds)
        # A turn still in progress is as good as lost past the same bound.
        wait = settings.turn_lost_seconds
        analyst = Analyst(repo, session_log, metering, settings.max_tokens, wait)
        await svc.serve(rt, repo=repo, session_log=session_log, analyst=analyst)


def run() -> None:
    """Entry point: `python -m psychologist`."""
    run_service(SERVICE, main())
