"""The outbox and its relay against real Postgres and a real JetStream."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

import asyncpg
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from servicekit import outbox
from servicekit.outbox import (
    DELIVERED,
    Delivery,
    JetStreamPublisher,
    Outbox,
    OutboxRelay,
    OutboxRow,
    notify_channel,
    publisher,
    retry_delay,
    with_outbox,
)
from testkit.probes import stream_messages, wait_for

# The conftest fixtures' shapes (conftest is not importable under --import-mode=importlib).
MakeStream = Callable[..., Awaitable[tuple[str, str]]]
MakePool = Callable[[], Awaitable[asyncpg.Pool]]
Background = Callable[[Coroutine[Any, Any, None]], "asyncio.Task[None]"]


class Rollback(Exception):
    pass


async def enqueue_committed(
    pool: asyncpg.Pool,
    subject: str,
    msg_id: str,
    body: bytes = b"{}",
    headers: dict[str, str] | None = None,
) -> None:
    async with pool.acquire() as conn, conn.transaction():
        await Outbox(conn).send(subject, msg_id, body, headers)


async def insert_without_notify(pool: asyncpg.Pool, subject: str, msg_id: str) -> None:
    """A committed outbox row that no NOTIFY announces: only polling can find it."""
    await pool.execute(
        "INSERT INTO outbox (subject, msg_id, body) VALUES ($1, $2, $3)", subject, msg_id, b"{}"
    )


async def _none_left(pool: asyncpg.Pool) -> bool:
    return not await pool.fetchval("SELECT count(*) FROM outbox")


async def outbox_rows(pool: asyncpg.Pool) -> list[dict[str, Any]]:
    rows = await pool.fetch(
        "SELECT msg_id, attempts, last_error, available_at FROM outbox ORDER BY id"
    )
    return [dict(r) for r in rows]


async def drain_postponing(relay: OutboxRelay, pool: asyncpg.Pool) -> tuple[float, float]:
    """Drain one failing row; return bounds (low, high) of the delay it was put off by.

    The relay postpones a row to `now() + retry_delay` of its own transaction, which
    begins between the two clock readings taken here: exact whatever the machine's load.
    """
    before = await pool.fetchval("SELECT clock_timestamp()")
    assert await relay.drain_once() == 1
    after = await pool.fetchval("SELECT clock_timestamp()")
    [row] = await outbox_rows(pool)
    return (row["available_at"] - after).total_seconds(), (
        row["available_at"] - before
    ).total_seconds()


async def published(nc: Client, stream: tuple[str, str]) -> list[Msg]:
    name, prefix = stream
    return await stream_messages(nc, name, f"{prefix}.>")


def msg_ids(msgs: list[Msg]) -> list[str]:
    return [(m.headers or {})["Nats-Msg-Id"] for m in msgs]


async def listening(pool: asyncpg.Pool) -> bool:
    """Whether some session of this database holds the relay's LISTEN."""
    count: int = await pool.fetchval(
        """SELECT count(*) FROM pg_stat_activity
            WHERE datname = current_database() AND query ILIKE $1""",
        f"LISTEN%{outbox.NOTIFY_CHANNEL_PREFIX}%",
    )
    return count > 0


async def test_a_row_enqueued_in_a_rolled_back_transaction_is_never_published(
    pool: asyncpg.Pool, js: JetStreamContext, nc: Client, stream: tuple[str, str]
) -> None:
    _, prefix = stream
    relay = OutboxRelay(pool, JetStreamPublisher(nc))
    with pytest.raises(Rollback):
        async with pool.acquire() as conn, conn.transaction():
            await Outbox(conn).send(f"{prefix}.a", "rolled-back", b"{}")
            raise Rollback
    await enqueue_committed(pool, f"{prefix}.a", "committed")

    assert await relay.drain_once() == 1

    assert msg_ids(await published(nc, stream)) == ["committed"]
    assert await outbox_rows(pool) == []


async def test_a_committed_row_is_published_once_with_its_msg_id_then_deleted(
    pool: asyncpg.Pool, js: JetStreamContext, nc: Client, stream: tuple[str, str]
) -> None:
    _, prefix = stream
    relay = OutboxRelay(pool, JetStreamPublisher(nc))
    await enqueue_committed(
        pool, f"{prefix}.created", "evt-1", b'{"n": 1}', headers={"Agentbus-Kind": "test"}
    )

    assert await relay.drain_once() == 1
    assert await relay.drain_once() == 0

    [msg] = await published(nc, stream)
    assert (msg.subject, msg.data) == (f"{prefix}.created", b'{"n": 1}')
    assert msg.headers is not None
    assert msg.headers["Nats-Msg-Id"] == "evt-1"
    assert msg.headers["Agentbus-Kind"] == "test"
    assert relay.delivered == 1
    assert await outbox_rows(pool) == []


async def test_a_republished_row_is_dropped_by_the_streams_duplicate_window(
    pool: asyncpg.Pool, js: JetStreamContext, nc: Client, stream: tuple[str, str]
) -> None:
    # A relay that crashed after publishing but before deleting publishes the row again.
    _, prefix = stream
    relay = OutboxRelay(pool, JetStreamPublisher(nc))
    for _ in range(2):
        await enqueue_committed(pool, f"{prefix}.created", "evt-1")
        assert await relay.drain_once() == 1

    assert msg_ids(await published(nc, stream)) == ["evt-1"]


async def test_the_rows_of_a_key_are_published_in_the_order_they_were_written(
    pool: asyncpg.Pool, js: JetStreamContext, nc: Client, stream: tuple[str, str]
) -> None:
    _, prefix = stream
    relay = OutboxRelay(pool, JetStreamPublisher(nc), batch=7)  # several batches
    ids = [f"evt-{i:02d}" for i in range(30)]
    async with pool.acquire() as conn, conn.transaction():
        for i, msg_id in enumerate(ids):
            # three sessions interleaved, each on a subject of its own
            session = f"s{i % 3}"
            await Outbox(conn).send(
                f"{prefix}.{session}", msg_id, msg_id.encode(), ordering_key=session
            )

    while await relay.drain_once():
        pass

    msgs = await published(nc, stream)
    assert sorted(msg_ids(msgs)) == ids
    for session in ("s0", "s1", "s2"):
        in_stream = [m.data for m in msgs if m.subject == f"{prefix}.{session}"]
        assert in_stream == [i.encode() for n, i in enumerate(ids) if n % 3 == int(session[1])]


async def test_a_row_committed_after_a_newer_one_is_still_published(
    pool: asyncpg.Pool, js: JetStreamContext, nc: Client, stream: tuple[str, str]
) -> None:
    # A BIGSERIAL is assigned at insert, not at commit: a "last id seen" cursor would
    # skip the slow transaction's row for ever.
    _, prefix = stream
    relay = OutboxRelay(pool, JetStreamPublisher(nc))
    async with pool.acquire() as slow, slow.transaction():
        await Outbox(slow).send(f"{prefix}.a", "slow", b"{}")  # the smaller id, not committed yet
        await enqueue_committed(pool, f"{prefix}.a", "fast")
        assert await relay.drain_once() == 1
    assert await relay.drain_once() == 1

    assert msg_ids(await published(nc, stream)) == ["fast", "slow"]


async def relay_polling_rarely(
    pool: asyncpg.Pool, nc: Client, background: Background
) -> OutboxRelay:
    """A running relay that polls every two minutes, listening: within a test, only a
    wake-up (a NOTIFY, or `OutboxRelay.wake`) makes it look at the outbox again."""
    relay = OutboxRelay(pool, JetStreamPublisher(nc), poll_seconds=120)
    background(relay.run())
    await wait_for(lambda: listening(pool), what="the relay's LISTEN")
    return relay


async def test_notify_wakes_the_relay_long_before_its_poll(
    pool: asyncpg.Pool,
    js: JetStreamContext,
    nc: Client,
    stream: tuple[str, str],
    background: Background,
) -> None:
    _, prefix = stream
    relay = await relay_polling_rarely(pool, nc, background)

    for n in (1, 2):
        # After the first row, the relay is past its last SELECT: only a NOTIFY makes it
        # look again before two minutes are up.
        await enqueue_committed(pool, f"{prefix}.a", f"evt-{n}")
        await wait_for(lambda n=n: relay.delivered == n, timeout=10, what=f"row {n} relayed")

    assert msg_ids(await published(nc, stream)) == ["evt-1", "evt-2"]


async def test_rows_of_a_process_with_its_relay_wake_it_without_a_notify(
    pool: asyncpg.Pool, nc: Client, stream: tuple[str, str], background: Background
) -> None:
    """`with_outbox` given the wake-up of its process's relay: the committed rows wake it
    directly (its poll is two minutes away) and no NOTIFY goes to the database's
    listeners."""
    _, prefix = stream
    relay = await relay_polling_rarely(pool, nc, background)
    heard: list[str] = []

    def hear(*args: Any) -> None:
        heard.append(args[1])

    async with pool.acquire() as listener:
        channel = notify_channel(await listener.fetchval("SELECT current_schema()"))
        await listener.add_listener(channel, hear)
        try:
            for n in (1, 2):
                async with with_outbox(pool, relay.wake) as (_, queue):
                    await queue.send(f"{prefix}.a", f"evt-{n}", b"{}")
                await wait_for(lambda n=n: relay.delivered == n, timeout=10, what=f"row {n}")

            await listener.fetchval("SELECT 1")  # a NOTIFY of the commits would be in by now
            assert heard == []
        finally:
            await listener.remove_listener(channel, hear)
    assert msg_ids(await published(nc, stream)) == ["evt-1", "evt-2"]


async def test_polling_delivers_rows_no_notify_announced(
    pool: asyncpg.Pool,
    js: JetStreamContext,
    nc: Client,
    stream: tuple[str, str],
    background: Background,
) -> None:
    _, prefix = stream
    relay = OutboxRelay(pool, JetStreamPublisher(nc), poll_seconds=0.1)
    background(relay.run())

    for n in (1, 2):
        await insert_without_notify(pool, f"{prefix}.a", f"evt-{n}")
        await wait_for(lambda n=n: relay.delivered == n, what=f"row {n} relayed")

    assert msg_ids(await published(nc, stream)) == ["evt-1", "evt-2"]


async def test_a_subject_no_stream_captures_keeps_the_row_with_backoff_until_one_does(
    pool: asyncpg.Pool,
    js: JetStreamContext,
    nc: Client,
    make_stream: MakeStream,
    background: Background,
) -> None:
    prefix = f"late{uuid.uuid4().hex[:10]}"
    relay = OutboxRelay(pool, JetStreamPublisher(nc), poll_seconds=0.1)
    await enqueue_committed(pool, f"{prefix}.a", "evt-1", b'{"n": 1}', {"traceparent": "t"})
    kept = "SELECT id, subject, msg_id, body, headers, ordering_key, created_at FROM outbox"
    written = dict(await pool.fetchrow(kept) or {})

    # claimed, but JetStream had no responder: put off by retry_delay(1)
    low, high = await drain_postponing(relay, pool)
    assert low <= retry_delay(1) <= high
    [row] = await outbox_rows(pool)
    assert row["attempts"] == 1
    assert "NoStreamResponse" in row["last_error"]
    # The claim deleted it and put it back: the same row (its place in order, its age).
    assert dict(await pool.fetchrow(kept) or {}) == written
    assert await relay.drain_once() == 0  # not due yet
    assert relay.delivered == 0

    await pool.execute("UPDATE outbox SET available_at = now()")  # due again
    low, high = await drain_postponing(relay, pool)
    assert low <= retry_delay(2) <= high
    assert retry_delay(2) > retry_delay(1)
    [row] = await outbox_rows(pool)
    assert row["attempts"] == 2

    name, _ = await make_stream(prefix=prefix)
    background(relay.run())
    await wait_for(lambda: relay.delivered == 1, what="the row relayed once a stream exists")
    assert msg_ids(await published(nc, (name, prefix))) == ["evt-1"]
    await wait_for(lambda: _none_left(pool), what="the delivered row to be deleted")


async def test_an_unanswered_publish_times_out_and_the_row_is_retried_later(
    pool: asyncpg.Pool, js: JetStreamContext, nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Something answers nothing on the subject (a stalled server, a misrouted subject).
    monkeypatch.setattr(publisher, "SEND_TIMEOUT_SECONDS", 0.2)
    subject = f"blackhole{uuid.uuid4().hex[:10]}.a"
    sink = await nc.subscribe(subject)
    relay = OutboxRelay(pool, JetStreamPublisher(nc))
    await enqueue_committed(pool, subject, "evt-1")

    low, high = await drain_postponing(relay, pool)

    assert low <= retry_delay(1) <= high
    [row] = await outbox_rows(pool)
    assert row["attempts"] == 1
    assert "Timeout" in row["last_error"]
    assert relay.delivered == 0
    await sink.unsubscribe()


async def test_unanswered_publishes_of_a_batch_time_out_together(
    pool: asyncpg.Pool, js: JetStreamContext, nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    timeout = 1.0
    monkeypatch.setattr(publisher, "SEND_TIMEOUT_SECONDS", timeout)
    subject = f"blackhole{uuid.uuid4().hex[:10]}.a"
    sink = await nc.subscribe(subject)
    relay = OutboxRelay(pool, JetStreamPublisher(nc))
    async with pool.acquire() as conn, conn.transaction():
        for n in range(10):
            await Outbox(conn).send(subject, f"evt-{n}", b"{}")

    started = time.monotonic()
    assert await relay.drain_once() == 10
    elapsed = time.monotonic() - started

    await sink.unsubscribe()
    assert [r["attempts"] for r in await outbox_rows(pool)] == [1] * 10
    # the publishes were all in flight at once: one timeout for the batch, not ten
    # (ten in a row would take 10 s; the margin absorbs a loaded machine)
    assert elapsed < 5 * timeout


async def test_a_failed_row_does_not_hold_back_the_rest_of_its_batch(
    pool: asyncpg.Pool, js: JetStreamContext, nc: Client, stream: tuple[str, str]
) -> None:
    _, prefix = stream
    relay = OutboxRelay(pool, JetStreamPublisher(nc))
    async with pool.acquire() as conn, conn.transaction():
        await Outbox(conn).send(f"{prefix}.a", "evt-1", b"{}")
        await Outbox(conn).send(f"nostream{uuid.uuid4().hex[:10]}.a", "evt-2", b"{}")
        await Outbox(conn).send(f"{prefix}.a", "evt-3", b"{}")

    assert await relay.drain_once() == 3

    assert msg_ids(await published(nc, stream)) == ["evt-1", "evt-3"]
    assert [(r["msg_id"], r["attempts"]) for r in await outbox_rows(pool)] == [("evt-2", 1)]
    assert relay.delivered == 2


async def test_two_relays_on_one_outbox_publish_every_row_exactly_once(
    pool: asyncpg.Pool,
    js: JetStreamContext,
    nc: Client,
    stream: tuple[str, str],
    make_pool: MakePool,
) -> None:
    _, prefix = stream
    # A core subscriber sees every publish, even those the stream's dedup would drop:
    # a row claimed by both relays would show here twice.
    publishes: Counter[str] = Counter()

    async def count(msg: Msg) -> None:
        publishes[(msg.headers or {})["Nats-Msg-Id"]] += 1

    spy = await nc.subscribe(f"{prefix}.>", cb=count)
    ids = [f"evt-{i:03d}" for i in range(300)]
    async with pool.acquire() as conn, conn.transaction():
        for msg_id in ids:
            await Outbox(conn).send(f"{prefix}.a", msg_id, b"{}")
    relays = [
        OutboxRelay(pool, JetStreamPublisher(nc), batch=10),
        OutboxRelay(await make_pool(), JetStreamPublisher(nc), batch=10),
    ]

    async def drain(relay: OutboxRelay) -> None:
        while await relay.drain_once():
            pass

    await asyncio.gather(*(drain(r) for r in relays))

    await wait_for(lambda: publishes.total() >= len(ids), what="every publish seen")
    await nc.flush()
    await spy.unsubscribe()
    assert sorted(publishes) == ids
    assert set(publishes.values()) == {1}
    assert sorted(msg_ids(await published(nc, stream))) == ids
    assert sum(r.delivered for r in relays) == len(ids)
    assert all(r.delivered > 0 for r in relays), "both relays should have taken a share"
    assert await outbox_rows(pool) == []


class AwaitingSender:
    """Delivers each batch after a reply the test gives, awaited as `asyncio.wait_for` does."""

    def __init__(self) -> None:
        self.reply: asyncio.Future[None] | None = None

    async def send(self, rows: Sequence[OutboxRow]) -> list[Delivery]:
        self.reply = asyncio.get_running_loop().create_future()
        # JetStreamPublisher awaits each ack so, and CommandSender's nc.request does inside.
        await asyncio.wait_for(self.reply, 30)
        return [DELIVERED for _ in rows]


async def test_a_relay_stops_when_cancelled_as_a_reply_arrives(
    pool: asyncpg.Pool, stream: tuple[str, str], background: Background
) -> None:
    _, prefix = stream
    sender = AwaitingSender()
    relay = OutboxRelay(pool, sender, poll_seconds=30)
    await enqueue_committed(pool, f"{prefix}.a", "evt-1")
    task = background(relay.run())
    await wait_for(lambda: sender.reply is not None, what="the relay sending")
    assert sender.reply is not None

    sender.reply.set_result(None)  # the ack lands...
    task.cancel()  # ...in the same loop iteration as the service's shutdown

    await asyncio.wait([task], timeout=1)
    assert task.cancelled(), "the relay ignored its cancellation"


def test_retry_delay_doubles_from_half_a_second_and_is_capped_at_a_minute() -> None:
    assert [retry_delay(n) for n in range(1, 9)] == [0.5, 1, 2, 4, 8, 16, 32, 60]
    assert retry_delay(50) == outbox.MAX_BACKOFF_SECONDS
    assert retry_delay(0) == 0.5
