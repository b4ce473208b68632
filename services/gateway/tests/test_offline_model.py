"""The "offline model" notice comes from metering, not from the gateway's environment.

The gateway holds no provider key: `GET /api/projects/{p}` says `offline_model` as
metering announces it in `$SRV.INFO.metering`, which the gateway's own NATS user asks
(the embedded server is secured as a deployment is). Metering here runs in this process
on the provider each test names; the gateway's environment has no provider key.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack

import pytest
import pytest_asyncio
from nats.aio.client import Client

from gateway.app import main as gateway_main
from gateway.settings import GatewaySettings
from metering.app import build_provider
from metering.settings import MeteringSettings
from testkit.metering import Starter
from testkit.services import running_service

from .conftest import SECRET, Gateway

StartGateway = Callable[[], Awaitable[Gateway]]


@pytest.fixture(autouse=True)
def no_provider_key(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("ANTHROPIC_API_KEY", "OPENAI_API_KEY", "AGENTBUS_PROVIDER"):
        monkeypatch.delenv(key, raising=False)


@pytest_asyncio.fixture(loop_scope="session")
async def start_gateway(nats_url: str, nc: Client) -> AsyncIterator[StartGateway]:
    """The gateway alone, on its own NATS user; whatever metering the test started."""
    async with AsyncExitStack() as stack:

        async def start() -> Gateway:
            urls: list[str] = []
            settings = GatewaySettings(
                nats_url=nats_url, gateway_port=0, gateway_secret=SECRET, model_notice_seconds=30
            )
            main = gateway_main(settings, on_listening=urls.append)
            await stack.enter_async_context(running_service(main, nc, "gateway"))
            return Gateway(urls[0], f"p-{uuid.uuid4().hex[:8]}")

        yield start


async def offline_model(gateway: Gateway) -> bool:
    async with gateway.http() as http:
        me = await http.get(f"/api/projects/{gateway.project}")
    assert me.status_code == 200, me.text
    answer = me.json()["offline_model"]
    assert isinstance(answer, bool)
    return answer


async def test_metering_on_the_offline_script_shows_the_notice(
    start_metering: Starter, start_gateway: StartGateway
) -> None:
    await start_metering()  # the scripted provider

    assert await offline_model(await start_gateway()) is True


async def test_metering_on_a_real_provider_shows_none(
    start_metering: Starter, start_gateway: StartGateway
) -> None:
    # A key of metering's own (never used: no turn is asked for), none in the gateway's.
    anthropic = MeteringSettings(provider="anthropic", anthropic_api_key="sk-ant-test-unused")
    await start_metering(provider=build_provider(anthropic))
    gateway = await start_gateway()

    assert await offline_model(gateway) is False
    # asked again, answered from what it remembers, the same
    assert await offline_model(gateway) is False


async def test_without_metering_the_page_still_loads_without_the_notice(
    start_gateway: StartGateway,
) -> None:
    assert await offline_model(await start_gateway()) is False
