"""Metrics and health of a kit service (servicekit.metrics), against a real NATS and a
real Postgres: `/metrics`, `/livez`, `/readyz` (false while Postgres or NATS is
unreachable, the process alive all along), and `$SRV.STATS` counting error replies and
the handlers' own time."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest_asyncio
from nats.aio.client import Client
from pydantic import BaseModel

from contracts.common import ErrorCode
from domain.errors import DomainError
from servicekit.cancellation import stop
from servicekit.metrics import value
from servicekit.runtime import Runtime
from servicekit.service import Service
from servicekit.settings import ServiceSettings
from testkit.probes import wait_for
from testkit.proxy import TcpProxy, through


class Divide(BaseModel):
    a: int
    b: int


class Quotient(BaseModel):
    q: int


def divider(name: str) -> Service:
    svc = Service(name, "0.1.0", "divides", schema="kit_metrics")
    handled: list[int] = []

    @svc.command("cmd.kitmetrics.divide")
    async def divide(cmd: Divide) -> Quotient:
        started = time.perf_counter_ns()
        if cmd.b == 0:
            raise DomainError(ErrorCode.INVALID_REQUEST, "cannot divide by zero\nsecond line")
        await asyncio.sleep(0.02)  # the handler's own work, which $SRV.STATS must include
        handled.append(time.perf_counter_ns() - started)
        return Quotient(q=cmd.a // cmd.b)

    svc.handled = handled  # type: ignore[attr-defined]
    return svc


@contextlib.asynccontextmanager
async def serving(svc: Service, settings: ServiceSettings) -> AsyncIterator[str]:
    """`svc` running for the block; yields the base URL of its metrics server."""
    runtimes: list[Runtime] = []

    async def run() -> None:
        async with svc.open(settings) as rt:
            runtimes.append(rt)
            await svc.serve(rt)

    task = asyncio.create_task(run())
    try:
        await wait_for(lambda: runtimes or (task.done() and task.result()), what="the runtime")
        [rt] = runtimes
        assert rt.metrics is not None
        yield rt.metrics.url
    finally:
        await stop(task)


@pytest_asyncio.fixture(loop_scope="session")
async def proxy(database_url: str) -> AsyncIterator[TcpProxy]:
    relay = TcpProxy(database_url)
    await relay.start()
    yield relay
    with contextlib.suppress(Exception):
        await relay.cut()


async def test_a_service_serves_metrics_liveness_and_readiness_that_follows_postgres(
    nats_url: str, database_url: str, proxy: TcpProxy, nc: Client
) -> None:
    name = f"kitmetrics{uuid.uuid4().hex[:6]}"
    svc = divider(name)
    settings = ServiceSettings(NATS_URL=nats_url, DATABASE_URL=through(database_url, proxy))
    async with serving(svc, settings) as base, httpx.AsyncClient(timeout=5) as http:

        async def ready() -> bool:
            return (await http.get(f"{base}/readyz")).status_code == 200

        await wait_for(ready, what="readiness")
        assert (await http.get(f"{base}/livez")).text == "ok\n"
        # the URL is announced where `agentbus up` reads it
        info = json.loads((await nc.request(f"$SRV.INFO.{name}", b"", timeout=2)).data)
        assert info["metadata"]["metrics"] == base

        ok = await nc.request("cmd.kitmetrics.divide", b'{"a": 7, "b": 2}', timeout=5)
        assert json.loads(ok.data) == {"q": 3}
        errors_before = value(
            "agentbus_command_errors_total", subject="cmd.kitmetrics.divide", code="invalid_request"
        )
        refused = await nc.request("cmd.kitmetrics.divide", b'{"a": 7, "b": 0}', timeout=5)
        # the error body every caller reads, and micro's error headers beside it
        assert json.loads(refused.data)["error"]["code"] == "invalid_request"
        assert refused.headers is not None
        assert refused.headers["Nats-Service-Error-Code"] == "invalid_request"
        assert refused.headers["Nats-Service-Error"] == "cannot divide by zero"

        scraped = (await http.get(f"{base}/metrics")).text
        assert (
            'agentbus_command_errors_total{code="invalid_request",subject="cmd.kitmetrics.divide"}'
            in scraped
        )
        assert (
            value(
                "agentbus_command_errors_total",
                subject="cmd.kitmetrics.divide",
                code="invalid_request",
            )
            == errors_before + 1
        )
        assert 'agentbus_outbox_rows{schema="kit_metrics"} 0.0' in scraped
        assert 'agentbus_outbox_oldest_row_age_seconds{schema="kit_metrics"} 0.0' in scraped

        # Postgres unreachable: not ready (but alive); reachable again: ready again
        await proxy.cut()
        assert (await http.get(f"{base}/readyz")).status_code == 503
        assert "postgres FAIL" in (await http.get(f"{base}/readyz")).text
        assert (await http.get(f"{base}/livez")).status_code == 200
        assert (await http.get(f"{base}/metrics")).status_code == 200  # sampling is bounded
        await proxy.start()
        await wait_for(ready, timeout=20, what="readiness once Postgres is back")


async def test_srv_stats_count_error_replies_and_the_handlers_time(
    nats_url: str, database_url: str, nc: Client
) -> None:
    name = f"kitstats{uuid.uuid4().hex[:6]}"
    svc = divider(name)
    settings = ServiceSettings(NATS_URL=nats_url, DATABASE_URL=database_url)
    async with serving(svc, settings):

        async def answers() -> bool:
            try:
                await nc.request(f"$SRV.PING.{name}", b"", timeout=0.5)
            except Exception:
                return False
            return True

        await wait_for(answers, what=f"{name} answering")
        await nc.request("cmd.kitmetrics.divide", b'{"a": 9, "b": 3}', timeout=5)
        await nc.request("cmd.kitmetrics.divide", b'{"a": 9, "b": 0}', timeout=5)
        await nc.request("cmd.kitmetrics.divide", b"{oops", timeout=5)

        async def two_errors() -> dict[str, Any] | None:
            reply = await nc.request(f"$SRV.STATS.{name}", b"", timeout=2)
            [endpoint] = json.loads(reply.data)["endpoints"]
            return endpoint if endpoint["num_errors"] == 2 else None

        endpoint = await wait_for(two_errors, what="$SRV.STATS counting the two errors")
        assert endpoint["num_requests"] == 3
        assert str(endpoint["last_error"]).startswith("malformed_json")
        # the handler's own time, not only the hand-off to its task
        [worked] = svc.handled  # type: ignore[attr-defined]
        assert endpoint["processing_time"] >= worked


async def test_readiness_follows_the_nats_connection(
    nats_url: str, database_url: str, nc: Client
) -> None:
    relay = TcpProxy(nats_url)
    await relay.start()
    svc = divider(f"kitnats{uuid.uuid4().hex[:6]}")
    settings = ServiceSettings(NATS_URL=through(nats_url, relay), DATABASE_URL=database_url)
    try:
        async with serving(svc, settings) as base, httpx.AsyncClient(timeout=5) as http:

            async def readiness() -> httpx.Response:
                return await http.get(f"{base}/readyz")

            await wait_for(lambda: _status(readiness(), 200), what="readiness")
            await relay.cut()
            unready = await wait_for(lambda: _status(readiness(), 503), what="unready without NATS")
            assert "nats FAIL" in unready.text and "postgres ok" in unready.text
            assert (await http.get(f"{base}/livez")).status_code == 200  # alive all along
            await relay.start()
            await wait_for(lambda: _status(readiness(), 200), timeout=20, what="ready again")
    finally:
        with contextlib.suppress(Exception):
            await relay.cut()


async def _status(response: Any, status: int) -> httpx.Response | None:
    answered: httpx.Response = await response
    return answered if answered.status_code == status else None
