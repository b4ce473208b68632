"""The session lease against a real NATS: taken again in one round trip by the replica
that released it, and never on the word of a revision someone wrote past."""

from __future__ import annotations

import uuid

from nats.aio.client import Client
from nats.aio.msg import Msg

from criativo.lease import BUCKET, SessionLeases


async def holder(nc: Client, session: uuid.UUID) -> bytes:
    kv = await nc.jetstream().key_value(BUCKET)
    return (await kv.get(str(session))).value or b""


async def test_a_replica_takes_a_session_it_released_again_without_reading_the_key(
    nc: Client,
) -> None:
    leases = SessionLeases(nc.jetstream(), "replica-a", ttl_seconds=30)
    await leases.open()
    session = uuid.uuid4()
    reads: list[str] = []

    async def on_read(msg: Msg) -> None:
        if msg.subject.endswith(f"KV_{BUCKET}") or str(session) in msg.subject:
            reads.append(msg.subject)

    sub = await nc.subscribe("$JS.API.>", cb=on_read)
    try:
        for _ in range(3):
            async with leases.hold(session):
                assert await holder(nc, session) == b"replica-a"
            await nc.flush()
        # `holder` reads too: one read per turn, and none to take the lease
        assert len([r for r in reads if "GET" in r]) == 3
    finally:
        await sub.unsubscribe()


async def test_a_session_another_replica_held_since_is_taken_from_the_key_as_it_is(
    nc: Client,
) -> None:
    a = SessionLeases(nc.jetstream(), "replica-a", ttl_seconds=30)
    b = SessionLeases(nc.jetstream(), "replica-b", ttl_seconds=30)
    await a.open()
    await b.open()
    session = uuid.uuid4()
    async with a.hold(session):
        pass
    async with b.hold(session):  # a's remembered revision is now stale
        assert await holder(nc, session) == b"replica-b"
    async with a.hold(session):
        assert await holder(nc, session) == b"replica-a"
