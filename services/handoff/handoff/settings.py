"""Handoff's settings: the kit's (`servicekit.settings`), as it has no knobs of its own;
a knob of handoff's goes here, so every service's settings are found in one place."""

from __future__ import annotations

from servicekit.settings import ServiceSettings


class HandoffSettings(ServiceSettings):
    """Handoff's knobs: those of every service."""
