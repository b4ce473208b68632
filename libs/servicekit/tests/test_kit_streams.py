"""`bus.provision_streams` (what `agentbus provision` runs) against a real JetStream:
idempotent, concurrent, updating; and `bus.stored_messages`, a stream's messages on a
subject read once."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable

import nats
import pytest_asyncio
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import StorageType
from nats.js.errors import NotFoundError

from contracts import streams
from contracts.streams import StreamSpec
from servicekit.bus import provision_streams, stored_messages, stream_config

# A spec of this test's own (name and subjects unique), deleted afterwards.
NewSpec = Callable[..., StreamSpec]


@pytest_asyncio.fixture(loop_scope="session")
async def new_spec(js: JetStreamContext) -> AsyncIterator[NewSpec]:
    names: list[str] = []

    def make(
        name: str | None = None, subjects: list[str] | None = None, max_age_seconds: float = 3600
    ) -> StreamSpec:
        token = uuid.uuid4().hex[:10]
        if name is None:
            names.append(f"PROV_{token}")
        return StreamSpec(
            name=name or names[-1],
            subjects=subjects or [f"prov{token}.>"],
            description="a stream of servicekit's tests",
            max_age_seconds=max_age_seconds,
            storage="memory",
        )

    yield make
    for name in names:
        with contextlib.suppress(NotFoundError):
            await js.delete_stream(name)


async def assert_provisioned(js: JetStreamContext, spec: StreamSpec) -> None:
    config = (await js.stream_info(spec.name)).config
    assert config.subjects == spec.subjects
    assert config.description == spec.description
    assert config.max_age == spec.max_age_seconds
    assert config.duplicate_window == spec.duplicate_window_seconds
    assert config.storage == StorageType.MEMORY


async def test_provisioning_twice_creates_then_changes_nothing(
    js: JetStreamContext, new_spec: NewSpec
) -> None:
    spec = new_spec()

    await provision_streams(js, [spec])
    created = (await js.stream_info(spec.name)).created
    await provision_streams(js, [spec])

    await assert_provisioned(js, spec)
    assert (await js.stream_info(spec.name)).created == created  # not re-created


async def test_replicas_provisioning_at_once_all_succeed(nats_url: str, new_spec: NewSpec) -> None:
    specs = [new_spec(), new_spec()]
    replicas: list[Client] = [await nats.connect(nats_url) for _ in range(4)]
    try:
        await asyncio.gather(*(provision_streams(r.jetstream(), specs) for r in replicas))

        for spec in specs:
            await assert_provisioned(replicas[0].jetstream(), spec)
    finally:
        for replica in replicas:
            await replica.close()


async def test_a_changed_spec_is_applied_to_the_existing_stream_keeping_its_messages(
    js: JetStreamContext, new_spec: NewSpec
) -> None:
    spec = new_spec()
    await provision_streams(js, [spec])
    prefix = spec.subjects[0].removesuffix(".>")
    await js.publish(f"{prefix}.kept", b"{}")

    changed = StreamSpec(
        name=spec.name,
        subjects=[*spec.subjects, f"{prefix}x.>"],
        description="retention doubled",
        max_age_seconds=7200,
        storage="memory",
    )
    await provision_streams(js, [changed])

    await assert_provisioned(js, changed)
    assert (await js.stream_info(spec.name)).state.messages == 1


async def test_replicas_provisioning_a_changed_spec_at_once_all_succeed(
    nats_url: str, js: JetStreamContext, new_spec: NewSpec
) -> None:
    spec = new_spec()
    await provision_streams(js, [spec])
    changed = new_spec(name=spec.name, subjects=spec.subjects, max_age_seconds=600)
    replicas: list[Client] = [await nats.connect(nats_url) for _ in range(4)]
    try:
        await asyncio.gather(*(provision_streams(r.jetstream(), [changed]) for r in replicas))
    finally:
        for replica in replicas:
            await replica.close()

    await assert_provisioned(js, changed)


async def test_the_agentbus_streams_have_their_declared_configuration(js: JetStreamContext) -> None:
    # The `nats_url` fixture provisioned them, as `agentbus provision` does.
    for spec in streams.ALL:
        expected = stream_config(spec)
        config = (await js.stream_info(spec.name)).config
        assert (config.subjects, config.max_age, config.max_msg_size, config.storage) == (
            expected.subjects,
            expected.max_age,
            expected.max_msg_size,
            expected.storage,
        )


async def test_stored_messages_are_a_subjects_messages_in_order(
    nc: Client, js: JetStreamContext, new_spec: NewSpec
) -> None:
    spec = new_spec()
    await provision_streams(js, [spec])
    prefix = spec.subjects[0].removesuffix(".>")
    for i in range(3):
        await js.publish(f"{prefix}.mine", f"m{i}".encode())
        await js.publish(f"{prefix}.other", b"x")

    stored = await stored_messages(nc, spec.name, f"{prefix}.mine", timeout=2)
    nothing = await stored_messages(nc, spec.name, f"{prefix}.none", timeout=2)

    assert [m.data for m in stored] == [b"m0", b"m1", b"m2"]
    assert nothing == []
