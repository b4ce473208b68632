"""Metering names its provider in its NATS micro info (`$SRV.INFO.metering`), where the
gateway reads the "offline model" notice instead of holding the provider key itself."""

from __future__ import annotations

import json

import pytest
from nats.aio.client import Client

from metering.app import MeteringSettings, build_provider
from metering.testing import Starter


async def announced(nc: Client) -> dict[str, str]:
    msg = await nc.request("$SRV.INFO.metering", b"", timeout=5)
    metadata: dict[str, str] = json.loads(msg.data)["metadata"]
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

    metadata = await announced(nc)

    assert (metadata["provider"], metadata["offline"]) == (provider, offline)
    assert metadata["instance"]  # the kit's own metadata stays beside it
