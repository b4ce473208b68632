"""The log's settings: its knobs beside the kit's (`servicekit.settings`)."""

from __future__ import annotations

from servicekit.settings import ServiceSettings


class LogSettings(ServiceSettings):
    """The log's own knobs (`AGENTBUS_HEARTBEAT_TIMEOUT_SECONDS`, …)."""

    heartbeat_timeout_seconds: float = 60.0
    reaper_interval_seconds: float = 5.0
