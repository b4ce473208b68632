"""Bindings and prices, cached in memory: no database round trip per call.

The tables are small, so each replica holds all of them. A binding change is
announced on `metering.bindings_changed` after its commit and every replica
reloads; a periodic reload covers a replica that missed the announcement (it was
reconnecting), so a stale cache lives at most `refresh_seconds`.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import date
from uuid import UUID

from nats.aio.client import Client
from nats.aio.msg import Msg

from contracts import subjects
from contracts.common import ErrorCode
from contracts.metering import Binding
from domain.errors import DomainError
from domain.metering import Price, price_on, resolve_binding
from metering.repository import MeteringRepository
from servicekit.logs import get_logger

log = get_logger(__name__)


class Catalog:
    """The cached bindings and prices of one replica."""

    def __init__(self, repo: MeteringRepository) -> None:
        self._repo = repo
        self._bindings: list[Binding] = []
        self._prices: list[Price] = []
        self._lock = asyncio.Lock()
        self.reloads = 0

    async def reload(self) -> None:
        """Read both tables again; reloads run one at a time, so the last read wins."""
        async with self._lock:
            bindings, prices = await self._repo.bindings(), await self._repo.prices()
            self._bindings, self._prices = bindings, prices
            self.reloads += 1

    def resolve(self, agent_slug: str, project_id: str, session_id: UUID | None) -> Binding:
        """The binding that decides this call's model, or `no_binding`."""
        binding = resolve_binding(self._bindings, agent_slug, project_id, session_id)
        if binding is None:
            raise DomainError(
                ErrorCode.NO_BINDING,
                f"no model is bound for agent {agent_slug} in project {project_id}, and there "
                "is no workspace default; set one with cmd.bindings.set",
                agent_slug=agent_slug,
                project_id=project_id,
            )
        return binding

    def price(self, model: str, day: date) -> Price:
        """The model's price in force on `day`, or `unknown_model`."""
        price = price_on(self._prices, model, day)
        if price is None:
            raise DomainError(
                ErrorCode.UNKNOWN_MODEL,
                f"model {model} has no price in force on {day}; it cannot be metered",
                model=model,
            )
        return price

    def knows(self, model: str, day: date) -> bool:
        return price_on(self._prices, model, day) is not None

    async def announce_change(self, nc: Client) -> None:
        """Tell every replica (this one included) that a binding changed."""
        await self.reload()
        await nc.publish(subjects.BINDINGS_CHANGED, b"")
        await nc.flush()

    async def watch(self, nc: Client, refresh_seconds: float) -> None:
        """Reload on every announcement and every `refresh_seconds`, until cancelled."""

        async def on_change(_: Msg) -> None:
            try:
                await self.reload()
            except Exception as exc:  # the periodic reload retries
                log.warning("binding_reload_failed", error=repr(exc))

        sub = await nc.subscribe(subjects.BINDINGS_CHANGED, cb=on_change)
        try:
            while True:
                await asyncio.sleep(refresh_seconds)
                try:
                    await self.reload()
                except Exception as exc:
                    log.warning("catalog_refresh_failed", error=repr(exc))
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
