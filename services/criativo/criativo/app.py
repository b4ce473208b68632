"""Wiring of the criativo service: the one place its parts are put together."""

from __future__ import annotations

from criativo.actors import Actors
from criativo.handlers import SERVICE, inputs_spec, svc
from criativo.lease import open_leases
from criativo.offers import OfferSender
from criativo.session import SessionWork
from criativo.settings import CriativoSettings
from criativo.turns import Turns
from harness import MeteringClient
from servicekit.runtime import run_service
from servicekit.sessionlog import SessionLogClient

__all__ = ["inputs_spec", "main", "run"]


async def main(settings: CriativoSettings | None = None) -> None:
    """Run the session actors, fed by the log, until stopped."""
    settings = settings or CriativoSettings()
    async with svc.open(settings) as rt:
        leases = await open_leases(rt.nc, rt.js, settings.instance_id)
        turns = Turns(
            MeteringClient(
                rt.nc,
                silence_seconds=settings.stream_silence_seconds,
                unheard_seconds=settings.stream_unheard_seconds,
            ),
            max_iterations=settings.max_tool_iterations,
            max_tokens=settings.max_tokens,
            budget_micros=settings.session_budget_micros,
            in_progress_wait_seconds=settings.turn_in_progress_wait_seconds,
        )
        offer_relay = rt.relay(OfferSender(rt.nc), "offer-relay")
        work = SessionWork(
            rt.nc,
            rt.pool,
            SessionLogClient(rt.nc),
            leases,
            turns,
            settings.crash_limit,
            settings.dependency_wait_seconds,
            offer_relay.wake,
        )
        actors = Actors(work, settings.idle_seconds)
        try:
            await svc.serve(rt, actors=actors)
        finally:
            await actors.stop()


def run() -> None:
    """Entry point: `python -m criativo`."""
    run_service(SERVICE, main())
