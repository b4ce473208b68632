"""A durable consumer reshaped behind its service's back is put back (servicekit.drift).

Each test reshapes a running consumer as `admin` (the one user left who can), then
waits for the owner to notice, log and count the drift, and to restore the declared
config; the messages published afterwards reach the handler whole.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import MutableMapping, Sequence
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from structlog.testing import capture_logs

from servicekit.consumer import ConsumerSpec, DurableConsumer
from servicekit.drift import keep_declared
from servicekit.metrics import value
from testkit.probes import wait_for

from .conftest import RunConsumer
from .test_kit_consumer import (
    consumer_info,
    publish,
    spec_for,
)


def watched(stream: tuple[str, str]) -> ConsumerSpec:
    """A consumer of the test's stream, checked for drift every fifth of a second."""
    return dataclasses.replace(spec_for(stream), drift_check_seconds=0.2)


async def started(
    js: JetStreamContext, run_consumer: RunConsumer, spec: ConsumerSpec, prefix: str
) -> tuple[DurableConsumer, list[Msg]]:
    """The consumer running, and the messages its handler got (a first one already)."""
    got: list[Msg] = []

    async def handle(msg: Msg) -> None:
        got.append(msg)

    consumer = run_consumer(spec, handle)
    await publish(js, f"{prefix}.first", "m1", b'{"n": 1}')
    await wait_for(lambda: got, what="the first message handled")
    return consumer, got


def drifts(logged: Sequence[MutableMapping[str, Any]], spec: ConsumerSpec) -> list[Any]:
    return [e for e in logged if e["event"] == "consumer_drift" and e["consumer"] == spec.durable]


async def test_a_consumer_made_headers_only_is_updated_back(
    js: JetStreamContext, stream: tuple[str, str], run_consumer: RunConsumer
) -> None:
    _, prefix = stream
    spec = watched(stream)
    with capture_logs() as logged:
        _, got = await started(js, run_consumer, spec, prefix)
        before = value("agentbus_consumer_drift_total", consumer=spec.durable)

        await js.add_consumer(spec.stream, dataclasses.replace(spec.config(), headers_only=True))

        async def bodies_again() -> bool:
            info = await consumer_info(js, spec)
            return info is not None and not info.config.headers_only

        await wait_for(bodies_again, what="the consumer to deliver bodies again")
        await publish(js, f"{prefix}.second", "m2", b'{"n": 2}')
        await wait_for(lambda: len(got) == 2, what="the second message handled")

    [drift] = drifts(logged, spec)[:1]
    assert "headers_only" in drift["fields"] and drift["repair"] == "update"
    assert value("agentbus_consumer_drift_total", consumer=spec.durable) >= before + 1
    assert got[1].data == b'{"n": 2}'


async def test_a_consumer_made_push_is_created_again_as_a_pull_consumer(
    js: JetStreamContext, stream: tuple[str, str], run_consumer: RunConsumer
) -> None:
    _, prefix = stream
    spec = watched(stream)
    with capture_logs() as logged:
        _, got = await started(js, run_consumer, spec, prefix)
        # a pull consumer cannot be updated into a push one: replaced by one of that name
        await js.delete_consumer(spec.stream, spec.durable)
        push = dataclasses.replace(spec.config(), deliver_subject=f"elsewhere.{uuid.uuid4().hex}")
        await js.add_consumer(spec.stream, push)

        async def pull_again() -> bool:
            info = await consumer_info(js, spec)
            return info is not None and not info.config.deliver_subject

        await wait_for(pull_again, what="the consumer back to pull")
        await publish(js, f"{prefix}.second", "m2", b'{"n": 2}')
        await wait_for(
            lambda: any(m.data == b'{"n": 2}' for m in got), what="the second message handled"
        )

    [drift] = drifts(logged, spec)[:1]
    assert "deliver_subject" in drift["fields"] and drift["repair"] == "recreate"
    assert "cannot be updated in place" in drift["why"]
    # created again from the declared start: the first comes again (idempotency's job)
    assert {m.data for m in got} == {b'{"n": 1}', b'{"n": 2}'}


async def test_a_consumer_as_declared_is_found_as_declared(
    nc: Client, js: JetStreamContext, stream: tuple[str, str]
) -> None:
    """Given a BackOff, the server keeps AckWait at its first step: a declaration asking
    for another one found the consumer drifted at every start and check, and updated it
    each time, logging an error."""
    spec = dataclasses.replace(spec_for(stream, backoff=(0.5, 1.0)), ack_wait=30.0)

    with capture_logs() as logged:
        assert await keep_declared(nc, js, spec.stream, spec.config()) is False  # created
        assert await keep_declared(nc, js, spec.stream, spec.config()) is False

    assert drifts(logged, spec) == []
    info = await consumer_info(js, spec)
    assert info is not None and info.config.ack_wait == 0.5
