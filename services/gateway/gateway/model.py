"""Whether the model is the offline script, as metering announces it.

The gateway holds no provider key: metering, the one service that reaches a provider,
names the provider it answers with in its NATS micro metadata (`$SRV.INFO.metering`),
and the page's "offline model" notice comes from there. The answer is kept a while, so
loading a page does not ask metering each time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from contracts import catalog
from contracts.metering import METADATA_OFFLINE
from servicekit.logs import get_logger

# Metering, the owner of the model turn, announces its provider in its micro info.
METERING = catalog.LLM_TURN.service
log = get_logger(__name__)

# What a replica of a service announces (`servicekit.client.announced`); None: no answer.
Announced = Callable[[str], Awaitable[dict[str, str] | None]]


class OfflineModel:
    """`await offline_model()`: True when metering answers from its offline script.

    Until metering has answered once, False: the notice is left out rather than shown
    wrongly. A silence after that keeps the last answer.
    """

    def __init__(self, announced: Announced, remember_seconds: float) -> None:
        self._announced = announced
        self._remember = remember_seconds
        self._offline = False
        self._fresh_until: float | None = None
        # One question at a time: the pages loading together share its answer.
        self._asking = asyncio.Lock()

    def _fresh(self) -> bool:
        return self._fresh_until is not None and time.monotonic() < self._fresh_until

    async def __call__(self) -> bool:
        if self._fresh():
            return self._offline
        async with self._asking:
            if not self._fresh():
                announced = await self._ask()
                if announced is not None:
                    self._offline = announced
                    self._fresh_until = time.monotonic() + self._remember
        return self._offline

    async def _ask(self) -> bool | None:
        """What a metering replica announces; None when none answers."""
        metadata = await self._announced(METERING)
        if metadata is None:
            log.info("metering_info_unanswered")
            return None
        return metadata.get(METADATA_OFFLINE) == "true"
