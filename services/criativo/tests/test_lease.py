"""The session lease against a real NATS: taken again in one round trip by the replica
that released it, and never on the word of a revision someone wrote past."""

from __future__ import annotations

import asyncio
import tempfile
import uuid
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import BadRequestError, KeyNotFoundError, KeyWrongLastSequenceError
from structlog.testing import capture_logs

from contracts import streams
from criativo.app import inputs_spec
from criativo.lease import BUCKET, SessionLeases, open_leases
from criativo.settings import CriativoSettings
from servicekit.bus import Bucket, server_urls
from servicekit.embedded import start_nats_cluster
from testkit.probes import wait_for

from .conftest import provisioned_leases


async def holder(nc: Client, session: uuid.UUID) -> bytes:
    kv = await nc.jetstream().key_value(BUCKET)
    return (await kv.get(str(session))).value or b""


async def test_a_replica_takes_a_session_it_released_again_without_reading_the_key(
    nc: Client,
) -> None:
    leases = await open_leases(await provisioned_leases(nc.jetstream(), 30), "replica-a")
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
    a = await open_leases(await provisioned_leases(nc.jetstream(), 30), "replica-a")
    b = await open_leases(await provisioned_leases(nc.jetstream(), 30), "replica-b")
    session = uuid.uuid4()
    async with a.hold(session):
        pass
    async with b.hold(session):  # a's remembered revision is now stale
        assert await holder(nc, session) == b"replica-b"
    async with a.hold(session):
        assert await holder(nc, session) == b"replica-a"


async def test_a_renewal_that_landed_but_went_unanswered_keeps_the_lease(nc: Client) -> None:
    """A renewal JetStream wrote but whose answer was lost leaves the key past the
    holder's revision, in the holder's name: the next renewal finds it so and keeps the
    lease (it was taken for lost, freeing the session under a running turn), and the
    release still deletes it."""
    leases = await open_leases(await provisioned_leases(nc.jetstream(), 3), "replica-a")
    session = uuid.uuid4()
    kv = await nc.jetstream().key_value(BUCKET)
    with capture_logs() as logged:
        async with leases.hold(session):
            await kv.put(str(session), b"replica-a")  # the write whose answer was lost
            await wait_for(
                lambda: any(e["event"] == "lease_renewal_found_applied" for e in logged),
                timeout=20,
                what="a renewal after the unanswered one",
            )
            await kv.put(str(session), b"replica-b")  # taken over meanwhile: lost
            await wait_for(
                lambda: any(e["event"] == "lease_lost" for e in logged),
                timeout=20,
                what="the renewal that finds another holder",
            )
    assert await holder(nc, session) == b"replica-b"  # never deleted someone else's lease
    events = [e["event"] for e in logged]
    assert events.count("lease_lost") == 1


async def test_a_release_after_a_write_that_went_unanswered_still_frees_the_session(
    nc: Client,
) -> None:
    """The key moved past the holder's revision by its own write whose answer was lost (a
    renewal in its name, or the release itself): the release frees the session all the
    same, and says nothing failed."""
    leases = await open_leases(await provisioned_leases(nc.jetstream(), 30), "replica-a")
    kv = await nc.jetstream().key_value(BUCKET)
    renewed, released = uuid.uuid4(), uuid.uuid4()
    with capture_logs() as logged:
        async with leases.hold(renewed):
            await kv.put(str(renewed), b"replica-a")  # a renewal whose answer was lost
        async with leases.hold(released):
            await kv.delete(str(released))  # the release, landed before its retry
    for session in (renewed, released):
        with pytest.raises(KeyNotFoundError):
            await kv.get(str(session))
    assert not [e for e in logged if e["event"] == "lease_release_failed"]


class InFlightRefusals(Bucket):
    """The bucket as a cluster just back from losing quorum answered it: every write
    conditioned on a revision refused with nats-server's in-flight `wrong last sequence`
    (err_code 10164), while the leader shows the key as it is."""

    async def update(self, key: str, value: bytes, last: int) -> int:
        raise KeyWrongLastSequenceError(description="wrong last sequence")

    async def delete(self, key: str, last: int | None) -> int:
        if last is not None:
            raise BadRequestError(code=400, err_code=10164, description="wrong last sequence")
        return await super().delete(key, last)


async def test_a_release_refused_while_the_key_is_still_ours_deletes_it_unconditionally(
    nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seen in CI after a cluster regained quorum: the release was refused on every attempt
    and the lease was left for its TTL to free, holding the session's next input."""
    monkeypatch.setattr("criativo.lease.RETRY_SECONDS", 0.001)
    leases = SessionLeases(
        await InFlightRefusals.open(await provisioned_leases(nc.jetstream(), 30), BUCKET),
        "replica-a",
    )
    session = uuid.uuid4()
    with capture_logs() as logged:
        async with leases.hold(session):
            assert await holder(nc, session) == b"replica-a"
    with pytest.raises(KeyNotFoundError):
        await (await nc.jetstream().key_value(BUCKET)).get(str(session))
    events = [e["event"] for e in logged]
    assert "lease_released_unconditionally" in events and "lease_release_failed" not in events
    [freed] = [e for e in logged if e["event"] == "lease_released_unconditionally"]
    assert "err_code=10164" in freed["last_refusal"]
    other = await open_leases(await provisioned_leases(nc.jetstream(), 30), "replica-b")
    async with other.hold(session):
        assert await holder(nc, session) == b"replica-b"  # free for the next replica


async def test_a_renewal_refused_while_the_key_is_still_ours_renews_it_unconditionally(
    nc: Client,
) -> None:
    """Taking a refused renewal for one that landed (the key is ours, at the revision we
    left it) wrote nothing: the TTL ran on, and the lease would expire under the turn."""
    ttl = 1.5  # renewed every 0.5 s: a second to spare on a loaded machine
    leases = SessionLeases(
        await InFlightRefusals.open(await provisioned_leases(nc.jetstream(), ttl), BUCKET),
        "replica-a",
    )
    try:
        session = uuid.uuid4()
        with capture_logs() as logged:
            async with leases.hold(session):
                await asyncio.sleep(ttl * 2.5)  # expired twice over, unless renewed
                assert await holder(nc, session) == b"replica-a"
        renewals = [e for e in logged if e["event"] == "lease_renewed_unconditionally"]
        assert len(renewals) >= 3
        assert not [e for e in logged if e["event"] in ("lease_lost", "lease_release_failed")]
    finally:  # the bucket's TTL is shared: back to the other tests'
        await open_leases(await provisioned_leases(nc.jetstream(), 30), "replica-a")


async def test_a_lease_outlives_a_cluster_without_quorum_shorter_than_its_ttl() -> None:
    """Issue 13: a renewal JetStream does not answer (two of three nodes SIGKILLed) is
    tried again, not taken for a lost lease: the lease stays held through the outage and
    its release still finds it (the chaos runs logged `lease_lost`, then
    `lease_release_failed`, with the lease free for another replica meanwhile)."""
    with tempfile.TemporaryDirectory(prefix="agentbus-lease-") as folder:
        cluster = start_nats_cluster(Path(folder), 3)
        nc = await nats.connect(server_urls(cluster.url), reconnect_time_wait=0.2)
        try:

            async def opened() -> SessionLeases | None:
                try:
                    js = nc.jetstream(timeout=2)
                    return await open_leases(
                        await provisioned_leases(js, 30, replicas=3), "replica-a"
                    )
                except (nats.errors.Error, TimeoutError):
                    return None  # the cluster is still electing its leaders

            leases = await wait_for(opened, timeout=60, what="the R3 lease bucket")
            with capture_logs() as logged:

                def said(event: str) -> bool:  # or gave the lease up
                    return any(e["event"] in (event, "lease_lost") for e in logged)

                async with leases.hold(uuid.uuid4()):
                    cluster.kill_node(1)
                    cluster.kill_node(2)
                    await wait_for(lambda: said("lease_renewal_unavailable"), timeout=30)
                    cluster.start_node(1)
                    cluster.start_node(2)
                    await wait_for(lambda: said("lease_renewed"), timeout=60)
            failed = [e for e in logged if e["event"] in ("lease_lost", "lease_release_failed")]
            assert not failed, failed  # with their errors, to tell why
        finally:
            await nc.close()
            cluster.stop()


def test_an_input_stays_with_its_replica_no_longer_than_a_dead_holders_lease_would_keep_it() -> (
    None
):
    # An input whose replica died mid-turn can run nowhere else before the lease it left
    # expires: JetStream hands it over within that TTL, not within the first retry step,
    # so a turn of a few seconds is reported in progress once or not at all.
    settings = CriativoSettings()
    spec = inputs_spec(settings)
    assert settings.retry_backoff_seconds[0] < spec.redelivery[0] <= streams.LEASES.ttl_seconds
    assert 3.0 / spec.keep_alive_interval < 2
    assert spec.delay_after(1) == settings.retry_backoff_seconds[0]  # naks follow the retries
