"""The session lease against a real NATS: taken again in one round trip by the replica
that released it, and never on the word of a revision someone wrote past."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import BadRequestError, KeyNotFoundError, KeyWrongLastSequenceError
from structlog.testing import capture_logs

from contracts import streams, subjects
from criativo.app import inputs_spec
from criativo.lease import BUCKET, SessionLeases, open_leases
from criativo.presence import Presence
from criativo.settings import CriativoSettings
from servicekit.bus import Bucket, server_urls
from servicekit.embedded import start_nats_cluster
from testkit.probes import wait_for

from .conftest import provisioned_leases


async def holder(nc: Client, session: uuid.UUID) -> bytes:
    """The instance the session's lease names (beside the id of its process)."""
    kv = await nc.jetstream().key_value(BUCKET)
    return ((await kv.get(str(session))).value or b"").partition(b"/")[0]


async def test_a_replica_takes_a_session_it_released_again_without_reading_the_key(
    nc: Client,
) -> None:
    leases = await open_leases(nc, await provisioned_leases(nc.jetstream(), 30), "replica-a")
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
    a = await open_leases(nc, await provisioned_leases(nc.jetstream(), 30), "replica-a")
    b = await open_leases(nc, await provisioned_leases(nc.jetstream(), 30), "replica-b")
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
    leases = await open_leases(nc, await provisioned_leases(nc.jetstream(), 3), "replica-a")
    session = uuid.uuid4()
    kv = await nc.jetstream().key_value(BUCKET)
    with capture_logs() as logged:
        async with leases.hold(session):
            await kv.put(str(session), leases.holder)  # the write whose answer was lost
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
    leases = await open_leases(nc, await provisioned_leases(nc.jetstream(), 30), "replica-a")
    kv = await nc.jetstream().key_value(BUCKET)
    renewed, released = uuid.uuid4(), uuid.uuid4()
    with capture_logs() as logged:
        async with leases.hold(renewed):
            await kv.put(str(renewed), leases.holder)  # a renewal whose answer was lost
        async with leases.hold(released):
            await kv.delete(str(released))  # the release, landed before its retry
    for session in (renewed, released):
        with pytest.raises(KeyNotFoundError):
            await kv.get(str(session))
    assert not [e for e in logged if e["event"] == "lease_release_failed"]


async def test_a_restarted_replica_takes_the_lease_its_killed_predecessor_left_at_once(
    nc: Client, connect_as: Callable[[str], Awaitable[Client]]
) -> None:
    """A replica SIGKILLed mid-turn leaves its lease behind, and its input comes back (to
    its own restart, under the same instance name, or to another replica): the process
    the lease names is asked, nobody answers, and the session is taken at once, where it
    waited out the TTL before (15 s in production; an hour here, longer than the test's
    timeout, so only a take-over lets it pass)."""
    await provisioned_leases(nc.jetstream(), 3600)
    killed_nc, restarted_nc = await connect_as("criativo"), await connect_as("criativo")
    killed = await open_leases(killed_nc, killed_nc.jetstream(), "criativo-1")
    restarted = await open_leases(restarted_nc, restarted_nc.jetstream(), "criativo-1")
    session = uuid.uuid4()
    holding = asyncio.Event()

    async def turn_cut_short() -> None:
        async with killed.hold(session):
            holding.set()
            await asyncio.Event().wait()  # its process dies first

    turn = asyncio.create_task(turn_cut_short())
    await holding.wait()
    await killed_nc.close()  # what SIGKILL does to its connection
    try:
        with capture_logs() as logged:
            async with restarted.hold(session) as resumed:
                kv = await nc.jetstream().key_value(BUCKET)
                assert (await kv.get(str(session))).value == restarted.holder
        assert not resumed
        [taken] = [e for e in logged if e["event"] == "lease_taken_over"]
        assert taken["holder"] == killed.holder.decode()
    finally:
        turn.cancel()
        with contextlib.suppress(BaseException):
            await turn


@pytest.mark.parametrize("answers", ["at once", "never: stalled"])
async def test_a_live_holder_keeps_its_lease_however_slow_it_answers(
    nc: Client,
    connect_as: Callable[[str], Awaitable[Client]],
    monkeypatch: pytest.MonkeyPatch,
    answers: str,
) -> None:
    """A replica waiting for a session asks its holder whether it lives, again and again,
    and never takes it from a live one: neither one that answers nor one too stalled to
    answer in time (its connection stays open, so NATS still finds it listening). The
    session passes on the holder's release, never while its turn runs."""
    if answers != "at once":
        never = asyncio.Event()

        async def stalled(msg: Msg) -> None:
            await never.wait()

        # the answer each process subscribes as it starts: every later question queues
        # behind the first, as in a process that stopped running
        monkeypatch.setattr("criativo.presence._answer", stalled)
    await provisioned_leases(nc.jetstream(), 3600)
    a_nc, b_nc = await connect_as("criativo"), await connect_as("criativo")
    a = await open_leases(a_nc, a_nc.jetstream(), "criativo-1")
    b = await open_leases(b_nc, b_nc.jetstream(), "criativo-2")
    session = uuid.uuid4()
    asked: list[str] = []

    async def on_question(msg: Msg) -> None:
        asked.append(msg.subject)

    listening = await nc.subscribe(subjects.holder_subject("*"), cb=on_question)
    turns: list[str] = []
    a_holds, a_done = asyncio.Event(), asyncio.Event()

    async def a_turn() -> None:
        async with a.hold(session):
            turns.append("a begins")
            a_holds.set()
            await a_done.wait()
            turns.append("a ends")

    async def b_turn() -> None:
        async with b.hold(session):
            turns.append("b begins")

    first = asyncio.create_task(a_turn())
    await a_holds.wait()
    with capture_logs() as logged:
        second = asyncio.create_task(b_turn())
        await wait_for(lambda: len(asked) >= 2, timeout=30, what="b asking a twice")
        assert not second.done()
        a_done.set()
        await asyncio.gather(first, second)
    await listening.unsubscribe()
    assert turns == ["a begins", "a ends", "b begins"]
    assert not [e for e in logged if e["event"] == "lease_taken_over"]


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
        await Presence.started(nc, "replica-a"),
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
    other = await open_leases(nc, await provisioned_leases(nc.jetstream(), 30), "replica-b")
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
        await Presence.started(nc, "replica-a"),
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
        await open_leases(nc, await provisioned_leases(nc.jetstream(), 30), "replica-a")


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
                        nc, await provisioned_leases(js, 30, replicas=3), "replica-a"
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
    # An input whose replica died mid-turn is handed to another within the lease's TTL (the
    # lease it left is taken at once then), yet not within the first retry step: a turn
    # of a few seconds is reported in progress once or not at all.
    settings = CriativoSettings()
    spec = inputs_spec(settings)
    assert settings.retry_backoff_seconds[0] < spec.redelivery[0] <= streams.LEASES.ttl_seconds
    assert 3.0 / spec.keep_alive_interval < 2
    assert spec.delay_after(1) == settings.retry_backoff_seconds[0]  # naks follow the retries
