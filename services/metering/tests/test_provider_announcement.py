"""Metering names its provider in its NATS micro info (`$SRV.INFO.metering`), where the
gateway reads the "offline model" notice instead of holding the provider key itself."""

from __future__ import annotations

import pytest
from nats.aio.client import Client

from metering.app import build_provider
from metering.settings import MeteringSettings
from servicekit.client import announced
from testkit.metering import Starter


async def metering_announces(nc: Client) -> dict[str, str]:
    metadata = await announced(nc, "metering", timeout=5)
    assert metadata is not None, "no metering replica answered $SRV.INFO.metering"
    return metadata


@pytest.mark.parametrize(
    ("configured", "provider", "offline"),
    [
        # auto without a key: the offline script
        ({}, "scripted", "true"),
        ({"provider": "scripted", "anthropic_api_key": "sk-ant-test-unused"}, "scripted", "true"),
        # a key of its own, never used here: no turn is asked for
        ({"anthropic_api_key": "sk-ant-test-unused"}, "anthropic", "false"),
    ],
)
async def test_its_info_names_the_provider_and_whether_it_is_the_offline_script(
    nc: Client,
    start_metering: Starter,
    monkeypatch: pytest.MonkeyPatch,
    configured: dict[str, str],
    provider: str,
    offline: str,
) -> None:
    for key in ("ANTHROPIC_API_KEY", "AGENTBUS_PROVIDER"):
        monkeypatch.delenv(key, raising=False)
    settings = MeteringSettings.model_validate({"provider": "auto", **configured})
    await start_metering(provider=build_provider(settings))

    metadata = await metering_announces(nc)

    assert (metadata["provider"], metadata["offline"]) == (provider, offline)
    assert metadata["instance"]  # the kit's own metadata stays beside it
