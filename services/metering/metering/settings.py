"""Metering's settings: its knobs beside the kit's (`servicekit.settings`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from metering.cancels import DEFAULT_TTL_SECONDS
from metering.publisher import Coalescing
from servicekit.settings import ServiceSettings


class MeteringSettings(ServiceSettings):
    """Metering's own knobs (`AGENTBUS_PROVIDER`, `AGENTBUS_SCRIPT_PATH`, …).

    `ANTHROPIC_API_KEY`, `ANTHROPIC_BASE_URL`, `OPENAI_BASE_URL` and `OPENAI_API_KEY` are
    read unprefixed, as the SDKs name them. The `openai` provider (any OpenAI-compatible
    server) is configured when either OpenAI variable is set, and serves the bindings
    that name it; `AGENTBUS_PROVIDER` serves the others.
    """

    # auto: `anthropic` when ANTHROPIC_API_KEY is set, `scripted` otherwise.
    provider: Literal["auto", "anthropic", "scripted"] = "auto"
    script_path: str | None = None
    anthropic_api_key: str | None = Field(default=None, validation_alias="ANTHROPIC_API_KEY")
    anthropic_base_url: str | None = Field(default=None, validation_alias="ANTHROPIC_BASE_URL")
    openai_api_key: str | None = Field(default=None, validation_alias="OPENAI_API_KEY")
    openai_base_url: str | None = Field(default=None, validation_alias="OPENAI_BASE_URL")
    provider_max_retries: int = 4
    provider_timeout_seconds: float = 600.0
    # Safety net behind the change announcements: the longest a replica's cache is stale.
    catalog_refresh_seconds: float = 30.0
    # A hold older than this has lost its call (the replica died): settle it at its
    # worst case. Longer than any call: the provider timeout and every retry.
    abandoned_hold_seconds: float = 1800.0
    hold_sweep_interval_seconds: float = 60.0
    # How often the holds of replicas that died (their lock is free) are looked for and
    # settled: the budget a dead replica's call held is back within this.
    orphan_sweep_seconds: float = 2.0
    # How long a cancel is remembered for a stream that has not started yet (the
    # announcement can overtake the stream request it stops).
    cancel_memory_seconds: float = DEFAULT_TTL_SECONDS
    # A stream's text is gathered into one delta per window after its first (0: one per
    # read of the provider's stream), or per this many characters if that comes first
    # (`metering.publisher.Coalescing`).
    delta_window_ms: float = Field(default=40.0, ge=0)
    delta_max_chars: int = Field(default=4096, ge=1)

    @property
    def coalescing(self) -> Coalescing:
        return Coalescing(self.delta_window_ms / 1000, self.delta_max_chars)
