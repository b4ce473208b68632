"""Per-key order of the outbox, across retries and relays, and the relay into the session log."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from importlib.resources import files
from typing import Any, cast

import asyncpg
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext

from contracts import subjects
from contracts.common import ErrorCode
from contracts.session_events import MAX_EVENT_PAYLOAD_BYTES, AppendedReply, AppendEvent
from domain.errors import DomainError
from servicekit import metrics, outbox
from servicekit.consumer import claim_once
from servicekit.db import KIT_MIGRATIONS, create_pool, migrate, migration_set
from servicekit.endpoint import error_reply
from servicekit.outbox import (
    DELIVERED,
    CommandSender,
    Delivery,
    JetStreamPublisher,
    Outbox,
    OutboxRelay,
    OutboxRow,
    Queued,
    publisher,
)
from testkit.probes import stream_messages, wait_for

MakeStream = Callable[..., Awaitable[tuple[str, str]]]
# The migration that gives the outbox its lease columns.
LEASE_MIGRATION = f"{KIT_MIGRATIONS}:0004_outbox_lease.sql"


def dead_letters(subject: str) -> float:
    return metrics.value("agentbus_dead_letters_total", consumer="outbox", subject=subject)


async def enqueue_committed(pool: asyncpg.Pool, *rows: tuple[str, str, str | None]) -> None:
    """Commit (subject, msg_id, ordering_key) rows, in this order, in one transaction."""
    async with pool.acquire() as conn, conn.transaction():
        for subject, msg_id, key in rows:
            await Outbox(conn).send(subject, msg_id, b"{}", ordering_key=key)


async def published_ids(nc: Client, stream: tuple[str, str]) -> list[str]:
    name, prefix = stream
    return [
        (m.headers or {})["Nats-Msg-Id"] for m in await stream_messages(nc, name, f"{prefix}.>")
    ]


async def waiting(pool: asyncpg.Pool) -> list[tuple[str, int]]:
    rows = await pool.fetch("SELECT msg_id, attempts FROM outbox ORDER BY id")
    return [(r["msg_id"], r["attempts"]) for r in rows]


async def test_a_key_waits_behind_its_older_row_that_waits_for_a_retry(
    pool: asyncpg.Pool, js: JetStreamContext, nc: Client, stream: tuple[str, str]
) -> None:
    _, prefix = stream
    await enqueue_committed(pool, (f"{prefix}.a", "k-1", "K"))
    await pool.execute("UPDATE outbox SET attempts = 1, available_at = now() + interval '1 hour'")
    await enqueue_committed(pool, (f"{prefix}.a", "k-2", "K"), (f"{prefix}.a", "l-1", "L"))

    assert await OutboxRelay(pool, JetStreamPublisher(nc)).drain_once() == 1

    assert await published_ids(nc, stream) == ["l-1"]
    assert await waiting(pool) == [("k-1", 1), ("k-2", 0)]


class AwaitingSender:
    """Delivers a batch once the test lets it: a relay caught in the middle of a send.
    The rows named in `failing` are not delivered (retried later)."""

    def __init__(self, failing: frozenset[str] = frozenset()) -> None:
        self.claimed: asyncio.Future[list[str]] = asyncio.get_running_loop().create_future()
        self.release = asyncio.Event()
        self._failing = failing

    async def send(self, rows: Sequence[OutboxRow]) -> list[Delivery]:
        self.claimed.set_result([r.msg_id for r in rows])
        await self.release.wait()
        return [Delivery("refused") if r.msg_id in self._failing else DELIVERED for r in rows]


@dataclass
class RecordingSender:
    """Delivers every row, and keeps their ids."""

    sent: list[str] = field(default_factory=list)

    async def send(self, rows: Sequence[OutboxRow]) -> list[Delivery]:
        self.sent += [r.msg_id for r in rows]
        return [DELIVERED for _ in rows]


async def test_a_key_another_relay_is_delivering_is_left_to_it(
    pool: asyncpg.Pool,
    js: JetStreamContext,
    nc: Client,
    stream: tuple[str, str],
    make_pool: Callable[[], Awaitable[asyncpg.Pool]],
) -> None:
    _, prefix = stream
    await enqueue_committed(
        pool, (f"{prefix}.a", "k-1", "K"), (f"{prefix}.a", "k-2", "K"), (f"{prefix}.a", "l-1", "L")
    )
    slow = AwaitingSender()
    busy = asyncio.create_task(OutboxRelay(pool, slow, batch=1).drain_once())
    assert await asyncio.wait_for(slow.claimed, 10) == ["k-1"]

    # k-2 is not row-locked, but delivering it now could overtake k-1
    other = OutboxRelay(await make_pool(), JetStreamPublisher(nc))
    assert await other.drain_once() == 1
    assert await published_ids(nc, stream) == ["l-1"]

    slow.release.set()
    assert await busy == 1
    assert await other.drain_once() == 1
    assert await published_ids(nc, stream) == ["l-1", "k-2"]
    assert await waiting(pool) == []


class StallingSender:
    """Publishes rows one after another through `inner`, and stalls before the row at
    `stall_at` until the test releases it: a relay caught mid-publish, slow or dead."""

    def __init__(self, inner: JetStreamPublisher, stall_at: int) -> None:
        self.stalled: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.release = asyncio.Event()
        self._inner = inner
        self._stall_at = stall_at
        self.claimed: list[str] = []

    async def send(self, rows: Sequence[OutboxRow]) -> list[Delivery]:
        self.claimed = [r.msg_id for r in rows]
        results: list[Delivery] = []
        for n, row in enumerate(rows):
            if n == self._stall_at:
                self.stalled.set_result(None)
                await self.release.wait()
            results += await self._inner.send([row])
        return results


async def stalled_after_one(
    pool: asyncpg.Pool, nc: Client, *rows: tuple[str, str, str | None]
) -> tuple[StallingSender, asyncio.Task[int]]:
    """Commit `rows`, and a relay that claims them (its lease lasting an hour), publishes
    the first and stalls: its sender, and its drain."""
    await enqueue_committed(pool, *rows)
    sender = StallingSender(JetStreamPublisher(nc), stall_at=1)
    drain = asyncio.create_task(OutboxRelay(pool, sender, lease_seconds=3600).drain_once())
    await asyncio.wait_for(sender.stalled, 10)
    return sender, drain


async def expire_leases(pool: asyncpg.Pool) -> None:
    """The clock passes the end of every lease held: what the relays see once it has."""
    await pool.execute("UPDATE outbox SET leased_until = now() WHERE lease IS NOT NULL")


async def publishes_seen(nc: Client, prefix: str) -> tuple[Counter[str], Subscription]:
    """Every publish on `<prefix>.>`, counted by msg id, even the copies the stream drops."""
    seen: Counter[str] = Counter()

    async def count(msg: Msg) -> None:
        seen[(msg.headers or {})["Nats-Msg-Id"]] += 1

    return seen, await nc.subscribe(f"{prefix}.>", cb=count)


async def test_the_rows_of_a_relay_that_died_holding_a_lease_go_in_order_once_it_expires(
    pool: asyncpg.Pool,
    js: JetStreamContext,
    nc: Client,
    stream: tuple[str, str],
    make_pool: Callable[[], Awaitable[asyncpg.Pool]],
) -> None:
    _, prefix = stream
    seen, spy = await publishes_seen(nc, prefix)
    # The relay publishes k-1 and dies: it never deletes, nor sends anything else.
    _, dying = await stalled_after_one(
        pool,
        nc,
        (f"{prefix}.a", "k-1", "K"),
        (f"{prefix}.b", "k-2", "K"),
        (f"{prefix}.a", "l-1", "L"),
    )
    await enqueue_committed(pool, (f"{prefix}.a", "k-3", "K"))  # after its claim
    other = OutboxRelay(await make_pool(), JetStreamPublisher(nc))

    assert await other.drain_once() == 0  # the lease holds every key it covers, k-3's too
    await expire_leases(pool)
    assert await other.drain_once() == 4

    ids = await published_ids(nc, stream)
    assert sorted(ids) == ["k-1", "k-2", "k-3", "l-1"]  # each once: k-1's copy was dropped
    assert [i for i in ids if i.startswith("k")] == ["k-1", "k-2", "k-3"]
    await nc.flush()
    assert seen["k-1"] == 2, "the second relay sent k-1 again, as it must not know it went"
    assert await waiting(pool) == []
    await spy.unsubscribe()
    dying.cancel()


Background = Callable[[Coroutine[Any, Any, None]], "asyncio.Task[None]"]


class CountingPool:
    """The pool a relay is given, counting the statements it runs on it."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool
        self.statements: list[str] = []

    async def fetch(self, query: str, *args: Any) -> list[asyncpg.Record]:
        self.statements.append(query)
        return await self._pool.fetch(query, *args)

    async def fetchval(self, query: str, *args: Any) -> Any:
        self.statements.append(query)
        return await self._pool.fetchval(query, *args)

    async def execute(self, query: str, *args: Any) -> str:
        self.statements.append(query)
        return await self._pool.execute(query, *args)

    def acquire(self) -> Any:
        return self._pool.acquire()  # the relay's LISTEN


async def test_a_running_relay_deletes_what_it_delivered_in_its_next_claim(
    pool: asyncpg.Pool, nc: Client, stream: tuple[str, str], background: Background
) -> None:
    """While rows keep coming, a batch costs the relay one statement: the claim of the
    next batch deletes the rows the last one delivered."""
    _, prefix = stream
    await enqueue_committed(pool, *((f"{prefix}.a", f"k-{n}", "K") for n in (1, 2, 3)))
    counting = CountingPool(pool)
    relay = OutboxRelay(
        cast(asyncpg.Pool, counting), JetStreamPublisher(nc), batch=1, poll_seconds=3600
    )
    background(relay.run())

    await wait_for(lambda: relay.delivered == 3, what="the three rows delivered")
    await wait_for(lambda: _none_waiting(pool), what="the last row deleted by the next claim")
    assert await published_ids(nc, stream) == ["k-1", "k-2", "k-3"]
    # three batches of one row, and the claim that found none left: no DELETE of its own
    assert len(counting.statements) == 4
    assert not [q for q in counting.statements if q.lstrip().startswith("DELETE")]


async def test_a_relay_with_nothing_more_to_claim_deletes_what_it_delivered_alone(
    pool: asyncpg.Pool, nc: Client, stream: tuple[str, str], background: Background
) -> None:
    _, prefix = stream
    relay = OutboxRelay(pool, JetStreamPublisher(nc), poll_seconds=3600)
    background(relay.run())
    await enqueue_committed(pool, (f"{prefix}.a", "k-1", "K"))
    relay.wake()

    await wait_for(lambda: _none_waiting(pool), what="the delivered row deleted")
    assert relay.delivered == 1
    assert await published_ids(nc, stream) == ["k-1"]


async def test_a_relay_that_died_before_deleting_what_it_delivered_leaves_it_resent_once_in_order(
    pool: asyncpg.Pool,
    nc: Client,
    stream: tuple[str, str],
    make_pool: Callable[[], Awaitable[asyncpg.Pool]],
    database_url: str,
) -> None:
    """The relay's process dies once its batch was acknowledged, before any statement
    deleted it: the rows keep their lease, and once it expires another relay sends them
    again (the stream drops the copy), ahead of the key's later rows, and deletes them."""
    _, prefix = stream
    seen, spy = await publishes_seen(nc, prefix)
    doomed_pool = await create_pool(database_url, await pool.fetchval("SELECT current_schema()"))

    class DyingAfterTheAck:
        async def send(self, rows: Sequence[OutboxRow]) -> list[Delivery]:
            delivered = await JetStreamPublisher(nc).send(rows)
            doomed_pool.terminate()  # every connection of the process is gone
            return delivered

    doomed = OutboxRelay(doomed_pool, DyingAfterTheAck(), batch=1, poll_seconds=3600)
    await enqueue_committed(pool, (f"{prefix}.a", "k-1", "K"), (f"{prefix}.a", "k-2", "K"))
    dying = asyncio.create_task(doomed.run())
    await wait_for(lambda: seen["k-1"] == 1, what="k-1 published")
    dying.cancel()
    await asyncio.gather(dying, return_exceptions=True)  # its pool is gone: it fails
    await enqueue_committed(pool, (f"{prefix}.a", "k-3", "K"))
    other = OutboxRelay(await make_pool(), JetStreamPublisher(nc))

    assert await other.drain_once() == 0  # k-1's lease holds its key
    await expire_leases(pool)
    assert await other.drain_once() == 3

    assert await published_ids(nc, stream) == ["k-1", "k-2", "k-3"]
    await nc.flush()
    assert seen == Counter({"k-1": 2, "k-2": 1, "k-3": 1})
    assert await waiting(pool) == []
    await spy.unsubscribe()


async def _none_waiting(pool: asyncpg.Pool) -> bool:
    return await waiting(pool) == []


async def test_a_relay_whose_lease_expired_mid_publish_reorders_nothing(
    pool: asyncpg.Pool,
    js: JetStreamContext,
    nc: Client,
    stream: tuple[str, str],
    make_pool: Callable[[], Awaitable[asyncpg.Pool]],
) -> None:
    # What holds: the stream stores a key's rows once each, in the order written. Each
    # relay sends a row only once the one before it was acknowledged (so stored, by
    # whichever relay), and a copy sent within the stream's duplicate window is dropped;
    # beyond that window, consumers drop it by msg id.
    _, prefix = stream
    seen, spy = await publishes_seen(nc, prefix)
    slow, late = await stalled_after_one(
        pool, nc, (f"{prefix}.a", "k-1", "K"), (f"{prefix}.b", "k-2", "K")
    )  # k-1 published, k-2 not yet
    await expire_leases(pool)
    await enqueue_committed(pool, (f"{prefix}.a", "k-3", "K"))
    taking_over = StallingSender(JetStreamPublisher(nc), stall_at=0)
    other = asyncio.create_task(OutboxRelay(await make_pool(), taking_over).drain_once())
    await asyncio.wait_for(taking_over.stalled, 10)
    assert taking_over.claimed == ["k-1", "k-2", "k-3"]

    taking_over.release.set()  # k-1 again, then k-2 and k-3, all before the slow k-2
    assert await other == 3
    slow.release.set()
    assert await late == 2

    assert await published_ids(nc, stream) == ["k-1", "k-2", "k-3"]
    await nc.flush()
    assert seen == Counter({"k-1": 2, "k-2": 2, "k-3": 1})
    assert await waiting(pool) == []
    await spy.unsubscribe()


async def test_a_relay_whose_lease_expired_leaves_the_rows_to_the_relay_that_took_them(
    pool: asyncpg.Pool, make_pool: Callable[[], Awaitable[asyncpg.Pool]]
) -> None:
    # The slow relay fails k-2: its retry would push the key back behind a backoff, and
    # free the row from the lease of the relay now delivering it.
    await enqueue_committed(pool, ("s.a", "k-1", "K"), ("s.a", "k-2", "K"))
    slow = AwaitingSender(failing=frozenset({"k-2"}))
    late = asyncio.create_task(OutboxRelay(pool, slow, lease_seconds=3600).drain_once())
    await asyncio.wait_for(slow.claimed, 10)
    await expire_leases(pool)
    taking_over = AwaitingSender()
    other = asyncio.create_task(OutboxRelay(await make_pool(), taking_over).drain_once())
    assert await asyncio.wait_for(taking_over.claimed, 10) == ["k-1", "k-2"]

    slow.release.set()
    assert await late == 2
    assert await waiting(pool) == [("k-1", 0), ("k-2", 0)]

    taking_over.release.set()
    assert await other == 2
    assert await waiting(pool) == []


async def test_a_claim_beside_another_relays_uncommitted_claim_does_not_overtake_its_rows(
    pool: asyncpg.Pool, make_pool: Callable[[], Awaitable[asyncpg.Pool]]
) -> None:
    # Relay A's claim has taken k-1 and k-2 and not yet committed their lease when relay
    # B's claim starts: B's snapshot shows them free, B passes over them (A's claim locks
    # them), and reaches k-3, the key's next row, which A's claim did not take.
    await enqueue_committed(pool, ("s.a", "k-1", "K"), ("s.a", "k-2", "K"))
    second = RecordingSender()
    other = OutboxRelay(await make_pool(), second)
    async with pool.acquire() as first, first.transaction():
        taken = await first.fetch(outbox.CLAIM, 10, 60, uuid.uuid4())
        assert sorted(r["msg_id"] for r in taken) == ["k-1", "k-2"]
        await enqueue_committed(pool, ("s.a", "k-3", "K"), ("s.a", "l-1", "L"))

        assert await other.drain_once() == 2  # k-3 claimed and given back, l-1 delivered

    assert second.sent == ["l-1"]
    assert await pool.fetchval("SELECT lease FROM outbox WHERE msg_id = 'k-3'") is None


def test_a_claimed_row_whose_predecessor_was_not_claimed_with_it_is_held_with_its_key() -> None:
    def row(id_: int, key: str | None, follows: int | None) -> dict[str, Any]:
        return {"id": id_, "ordering_key": key, "follows": follows}

    claimed = [
        row(30, "K", None),  # the key's oldest row, then the row after it: both go
        row(40, "K", 30),
        row(50, "L", 20),  # L's row 20 was not claimed with it: 50 and 70 wait
        row(60, None, None),  # a row without a key has no order
        row(70, "L", 50),
        row(80, "M", None),
        row(90, "M", 85),  # M's row 85 was not claimed: 90 waits, 80 goes
    ]
    assert outbox.overtaking(claimed) == {50, 70, 90}


async def test_a_later_row_of_a_key_does_not_overtake_one_that_failed(
    pool: asyncpg.Pool,
    js: JetStreamContext,
    nc: Client,
    make_stream: MakeStream,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The stream drops the first event (too large: its publish is never acked); the
    # next event of the session must not reach consumers before it.
    monkeypatch.setattr(publisher, "SEND_TIMEOUT_SECONDS", 0.3)
    stream = await make_stream(max_msg_size=1024)
    _, prefix = stream
    async with pool.acquire() as conn, conn.transaction():
        await Outbox(conn).send(f"{prefix}.a", "k-1", b"x" * 2048, ordering_key="K")
        await Outbox(conn).send(f"{prefix}.a", "k-2", b"{}", ordering_key="K")

    await OutboxRelay(pool, JetStreamPublisher(nc)).drain_once()

    assert await published_ids(nc, stream) == []
    assert [msg_id for msg_id, _ in await waiting(pool)] == ["k-1", "k-2"]


async def test_keys_published_side_by_side_each_stop_at_their_own_failure(
    pool: asyncpg.Pool, js: JetStreamContext, nc: Client, make_stream: MakeStream
) -> None:
    # Short runs of three keys go out together, a row of each key per round: the stream
    # refuses B's second row (too large), so B's third must not follow it, while A and C
    # go on to the end.
    stream = await make_stream(max_msg_size=1024)
    _, prefix = stream
    async with pool.acquire() as conn, conn.transaction():
        for n in range(1, 4):
            for key in "ABC":
                body = b"x" * 2048 if (key, n) == ("B", 2) else b"{}"
                await Outbox(conn).send(f"{prefix}.{key}", f"{key}-{n}", body, ordering_key=key)

    assert await OutboxRelay(pool, JetStreamPublisher(nc)).drain_once() == 9

    published = await published_ids(nc, stream)
    for key, expected in (
        ("A", ["A-1", "A-2", "A-3"]),
        ("B", ["B-1"]),
        ("C", ["C-1", "C-2", "C-3"]),
    ):
        assert [i for i in published if i.startswith(key)] == expected
    assert await waiting(pool) == [("B-2", 1), ("B-3", 1)]


async def enqueue_session(pool: asyncpg.Pool, prefix: str, key: str, count: int) -> list[str]:
    """Commit `count` rows of one key, on subjects that vary as a session's event types do;
    return their msg ids in the order written."""
    ids = [f"{key}-{n:03d}" for n in range(count)]
    await enqueue_committed(
        pool, *((f"{prefix}.{key}.t{n % 3}", i, key) for n, i in enumerate(ids))
    )
    return ids


async def test_a_keys_rows_land_in_order_as_one_atomic_batch(
    pool: asyncpg.Pool, nc: Client, stream: tuple[str, str]
) -> None:
    # One busy session: its rows go in one round trip, not one acknowledged publish each.
    _, prefix = stream
    ids = {key: await enqueue_session(pool, prefix, key, 120) for key in ("K", "L")}

    assert await OutboxRelay(pool, JetStreamPublisher(nc)).drain_once() == 240

    published = await stream_messages(nc, stream[0], f"{prefix}.>")
    for key, written in ids.items():
        mine = [m for m in published if m.subject.startswith(f"{prefix}.{key}.")]
        assert [m.headers["Nats-Msg-Id"] for m in mine] == written
        assert len({m.headers[outbox.BATCH_ID] for m in mine}) == 1
    assert await waiting(pool) == []


async def test_a_batch_that_fails_holds_the_whole_key_back_and_loses_nothing(
    pool: asyncpg.Pool, nc: Client, make_stream: MakeStream
) -> None:
    # JetStream has no stream for the subjects (down, or not provisioned yet): the
    # batch is refused whole, every row waits for its retry, then all land in order.
    prefix = f"late{uuid.uuid4().hex[:8]}"
    written = await enqueue_session(pool, prefix, "K", outbox.ATOMIC_BATCH_MIN)
    relay = OutboxRelay(pool, JetStreamPublisher(nc))

    assert await relay.drain_once() == len(written)
    assert await waiting(pool) == [(i, 1) for i in written]

    stream = await make_stream(prefix)
    await pool.execute("UPDATE outbox SET available_at = now()")  # their retry is due
    assert await relay.drain_once() == len(written)
    assert await published_ids(nc, stream) == written
    assert await waiting(pool) == []


async def test_rows_an_earlier_attempt_stored_are_published_one_by_one_without_duplicates(
    pool: asyncpg.Pool, nc: Client, js: JetStreamContext, stream: tuple[str, str]
) -> None:
    # An earlier attempt stored the first two (its ack was lost, the rows stayed): the
    # stream refuses a batch holding them, so the key goes one publish at a time, each
    # deduplicated by its Nats-Msg-Id.
    _, prefix = stream
    written = await enqueue_session(pool, prefix, "K", outbox.ATOMIC_BATCH_MIN)
    for msg_id in written[:2]:
        await js.publish(f"{prefix}.K.t0", b"{}", headers={"Nats-Msg-Id": msg_id})

    assert await OutboxRelay(pool, JetStreamPublisher(nc)).drain_once() == len(written)

    assert await published_ids(nc, stream) == written
    assert await waiting(pool) == []


async def test_a_stream_without_atomic_batches_gets_a_keys_rows_one_by_one_in_order(
    pool: asyncpg.Pool, nc: Client, make_stream: MakeStream
) -> None:
    stream = await make_stream(allow_atomic=False)
    written = await enqueue_session(pool, stream[1], "K", outbox.ATOMIC_BATCH_MIN)

    assert await OutboxRelay(pool, JetStreamPublisher(nc)).drain_once() == len(written)

    assert await published_ids(nc, stream) == written
    assert await waiting(pool) == []


@dataclass
class FakeLog:
    """Answers `cmd.events.append` and `cmd.events.append_many` as session_events would,
    refusing what it is told to (and, in a request of many, holding a session's later
    events back behind one refused `unavailable`, as the log does)."""

    appended: list[str] = field(default_factory=list)
    refuse: dict[str, str] = field(default_factory=dict)  # idempotency key -> error code
    requests: list[str] = field(default_factory=list)  # the subject of each request

    def outcome(self, data: dict[str, Any], failed: set[str]) -> dict[str, Any]:
        event = AppendEvent.model_validate(data)
        assert event.idempotency_key is not None
        code = self.refuse.get(event.idempotency_key)
        if str(event.session_id) in failed:
            code = "unavailable"
        if code is not None:
            if code in ("unavailable", "internal"):
                failed.add(str(event.session_id))
            return {"error": {"code": code, "message": f"refused {event.idempotency_key}"}}
        self.appended.append(event.idempotency_key)
        return AppendedReply(event_id=uuid.uuid4(), seq=len(self.appended)).model_dump(mode="json")

    async def answer(self, msg: Msg) -> None:
        self.requests.append(msg.subject)
        try:
            json.loads(msg.data)
        except ValueError:
            await msg.respond(error_reply(ErrorCode.MALFORMED_JSON, "request is not JSON"))
            return
        if msg.subject == subjects.EVENTS_APPEND_MANY:
            failed: set[str] = set()
            events = json.loads(msg.data)["events"]
            results = [self.outcome(e, failed) for e in events]
            await msg.respond(json.dumps({"results": results}).encode())
            return
        outcome = self.outcome(json.loads(msg.data), set())
        await msg.respond(json.dumps(outcome).encode())


@pytest_asyncio.fixture(loop_scope="session")
async def fake_log(nc: Client) -> AsyncIterator[FakeLog]:
    log = FakeLog()
    subs = [
        await nc.subscribe(subjects.EVENTS_APPEND, cb=log.answer),
        await nc.subscribe(subjects.EVENTS_APPEND_MANY, cb=log.answer),
    ]
    yield log
    for sub in subs:
        await sub.unsubscribe()


async def enqueue_appends(pool: asyncpg.Pool, *events: tuple[uuid.UUID, str]) -> None:
    """Commit one `chat.message` per (session, idempotency key), in this order."""
    async with pool.acquire() as conn, conn.transaction():
        for session_id, key in events:
            await Outbox(conn).append(
                AppendEvent(
                    session_id=session_id,
                    type="chat.message",
                    actor="system:kit-tests",
                    payload={"text": key},
                    idempotency_key=key,
                ),
            )


@pytest.mark.parametrize(
    ("events", "requests"),
    [(5, 1), (300, 2)],  # 300: more than one request holds (APPEND_MANY_MAX)
    ids=["one-request", "cut-in-two"],
)
async def test_the_log_appender_appends_a_sessions_events_in_order_in_few_requests(
    pool: asyncpg.Pool, nc: Client, fake_log: FakeLog, events: int, requests: int
) -> None:
    session = uuid.uuid4()
    keys = [f"e-{n:03d}" for n in range(events)]
    await enqueue_appends(pool, *((session, k) for k in keys))

    assert await OutboxRelay(pool, CommandSender(nc), batch=events).drain_once() == events

    assert fake_log.appended == keys
    assert fake_log.requests == [subjects.EVENTS_APPEND_MANY] * requests
    assert await waiting(pool) == []


async def test_a_session_held_back_in_one_request_sends_nothing_in_the_next(
    pool: asyncpg.Pool, nc: Client, fake_log: FakeLog
) -> None:
    held, other = uuid.uuid4(), uuid.uuid4()
    fake_log.refuse["h-000"] = "unavailable"
    keys = [f"h-{n:03d}" for n in range(300)]
    await enqueue_appends(pool, *((held, k) for k in keys), (other, "o-1"))

    assert await OutboxRelay(pool, CommandSender(nc), batch=301).drain_once() == 301

    assert fake_log.appended == ["o-1"]
    assert len(fake_log.requests) == 2  # the second carries only the other session's
    assert [key for key, _ in await waiting(pool)] == keys


async def test_a_row_that_gets_the_whole_request_refused_is_found_and_dead_lettered_alone(
    pool: asyncpg.Pool, nc: Client, fake_log: FakeLog
) -> None:
    # A row that is not even JSON makes the request of many malformed: the relay then
    # sends one request per row, so only that row is refused, and its session goes on.
    session = uuid.uuid4()
    await enqueue_appends(pool, (session, "e-1"))
    async with pool.acquire() as conn, conn.transaction():
        await Outbox(conn).send(subjects.EVENTS_APPEND, "poison", b"{no", ordering_key=str(session))
    await enqueue_appends(pool, (session, "e-2"))

    assert await OutboxRelay(pool, CommandSender(nc)).drain_once() == 3

    assert fake_log.appended == ["e-1", "e-2"]
    assert await waiting(pool) == []
    [dead] = await pool.fetch("SELECT msg_id, reason FROM dead_letters")
    assert dead["msg_id"] == "poison" and dead["reason"].startswith("malformed_json")


async def test_the_log_appender_sends_one_request_per_row_to_a_log_without_append_many(
    pool: asyncpg.Pool, nc: Client
) -> None:
    log = FakeLog()
    sub = await nc.subscribe(subjects.EVENTS_APPEND, cb=log.answer)  # an older log
    try:
        session = uuid.uuid4()
        await enqueue_appends(pool, (session, "e-1"), (session, "e-2"))
        assert await OutboxRelay(pool, CommandSender(nc)).drain_once() == 2
    finally:
        await sub.unsubscribe()
    assert log.appended == ["e-1", "e-2"]
    assert log.requests == [subjects.EVENTS_APPEND] * 2


async def test_a_transient_refusal_holds_back_its_session_only(
    pool: asyncpg.Pool, nc: Client, fake_log: FakeLog
) -> None:
    held, other = uuid.uuid4(), uuid.uuid4()
    fake_log.refuse["h-1"] = "unavailable"
    await enqueue_appends(pool, (held, "h-1"), (other, "o-1"), (held, "h-2"))
    relay = OutboxRelay(pool, CommandSender(nc))

    assert await relay.drain_once() == 3

    assert fake_log.appended == ["o-1"]
    assert await waiting(pool) == [("h-1", 1), ("h-2", 1)]

    del fake_log.refuse["h-1"]
    await pool.execute("UPDATE outbox SET available_at = now()")  # their retry is due
    assert await relay.drain_once() == 2
    assert fake_log.appended == ["o-1", "h-1", "h-2"]


async def test_a_permanent_refusal_is_dead_lettered_and_its_session_goes_on(
    pool: asyncpg.Pool, nc: Client, fake_log: FakeLog
) -> None:
    session = uuid.uuid4()
    fake_log.refuse["e-1"] = "invalid_payload"
    await enqueue_appends(pool, (session, "e-1"), (session, "e-2"))

    assert await OutboxRelay(pool, CommandSender(nc)).drain_once() == 2

    assert fake_log.appended == ["e-2"]
    assert await waiting(pool) == []
    [dead] = await pool.fetch("SELECT consumer, msg_id, reason, body FROM dead_letters")
    assert (dead["consumer"], dead["msg_id"]) == ("outbox", "e-1")
    assert dead["reason"] == "invalid_payload: refused e-1"
    assert json.loads(dead["body"])["idempotency_key"] == "e-1"


async def test_a_permanent_refusal_is_counted(
    pool: asyncpg.Pool, nc: Client, fake_log: FakeLog
) -> None:
    fake_log.refuse["e-1"] = "invalid_request"
    await enqueue_appends(pool, (uuid.uuid4(), "e-1"))
    before = dead_letters(subjects.EVENTS_APPEND)
    relay = OutboxRelay(pool, CommandSender(nc))

    await relay.drain_once()

    assert relay.dead_lettered == 1
    assert dead_letters(subjects.EVENTS_APPEND) == before + 1


async def test_an_internal_error_is_retried_a_bounded_number_of_times_then_dead_lettered(
    pool: asyncpg.Pool, nc: Client, fake_log: FakeLog
) -> None:
    session = uuid.uuid4()
    fake_log.refuse["e-1"] = "internal"
    await enqueue_appends(pool, (session, "e-1"), (session, "e-2"))
    relay = OutboxRelay(pool, CommandSender(nc))

    await relay.drain_once()
    assert await waiting(pool) == [("e-1", 1), ("e-2", 1)]  # retried, its session waits
    assert fake_log.appended == []

    # the last allowed attempt is due
    await pool.execute(
        "UPDATE outbox SET available_at = now(), attempts = CASE msg_id WHEN 'e-1' THEN $1"
        " ELSE attempts END",
        outbox.MAX_INTERNAL_ATTEMPTS - 1,
    )
    await relay.drain_once()
    # The log held e-2 back behind e-1 in that request (it cannot know e-1 was given up):
    # e-2 goes at its retry.
    assert fake_log.appended == []
    await pool.execute("UPDATE outbox SET available_at = now()")
    await relay.drain_once()

    assert fake_log.appended == ["e-2"]
    assert await waiting(pool) == []
    [dead] = await pool.fetch("SELECT msg_id, deliveries, reason FROM dead_letters")
    assert (dead["msg_id"], dead["deliveries"]) == ("e-1", outbox.MAX_INTERNAL_ATTEMPTS)
    assert dead["reason"].startswith("internal:")


async def test_an_event_for_the_log_needs_an_idempotency_key(pool: asyncpg.Pool) -> None:
    event = AppendEvent(
        session_id=uuid.uuid4(), type="chat.message", actor="system:kit-tests", payload={}
    )
    async with pool.acquire() as conn:
        with pytest.raises(ValueError, match="idempotency_key"):
            await Outbox(conn).append(event)
    assert await waiting(pool) == []


@pytest.mark.parametrize(
    ("type_", "payload", "code"),
    [
        ("chat.message", {"text": "a\x00b"}, ErrorCode.INVALID_PAYLOAD),
        (
            "handoff.rejected",
            {"handoff_id": "not-a-uuid", "to_agent": "po"},
            ErrorCode.INVALID_PAYLOAD,
        ),
        ("no.such_type", {}, ErrorCode.UNKNOWN_EVENT_TYPE),
        (
            "agent.response",
            {"agent": "criativo", "text": "x" * (MAX_EVENT_PAYLOAD_BYTES + 1)},
            ErrorCode.PAYLOAD_TOO_LARGE,
        ),
    ],
    ids=["nul-in-text", "wrong-shape", "unknown-type", "oversized"],
)
async def test_an_event_the_log_would_refuse_is_refused_before_anything_commits(
    pool: asyncpg.Pool, type_: str, payload: dict[str, Any], code: str
) -> None:
    # Built without validation: what a service's code could assemble by mistake.
    event = AppendEvent.model_construct(
        session_id=uuid.uuid4(),
        type=type_,
        actor="system:kit-tests",
        payload=payload,
        causation_id=None,
        idempotency_key="k-1",
    )

    with pytest.raises(DomainError) as refusal:
        async with pool.acquire() as conn, conn.transaction():
            await claim_once(conn, "kit-tests", "the-effect")
            await Outbox(conn).append(event)

    assert refusal.value.code == code
    assert await waiting(pool) == []
    assert await pool.fetchval("SELECT count(*) FROM processed_messages") == 0  # rolled back


async def test_outboxes_of_two_services_in_one_database_do_not_hold_each_other_back(
    database_url: str, js: JetStreamContext, nc: Client, make_stream: MakeStream
) -> None:
    # Under `make up` every service shares one Postgres; their outboxes use the same
    # session ids as keys. One service delivering a session's row must not make the
    # other's relay skip its own row of that session (it would wait for its next poll).
    stream = await make_stream()
    _, prefix = stream
    pools = {}
    for schema in ("svc_a", "svc_b"):
        pools[schema] = await create_pool(database_url, schema)
        await migrate(pools[schema], schema, [KIT_MIGRATIONS])
    try:
        for schema, p in pools.items():
            async with p.acquire() as conn, conn.transaction():
                await Outbox(conn).send(
                    f"{prefix}.{schema}", f"{schema}-1", b"{}", ordering_key="S"
                )
        async with pools["svc_a"].acquire() as holder, holder.transaction():
            # svc_a's relay is in the middle of delivering session S (its claim holds
            # the key's rows) ...
            assert len(await holder.fetch(outbox.CLAIM, 10, 60, uuid.uuid4())) == 1
            # ... and svc_b's relay still claims and delivers its own row of S at once.
            assert await OutboxRelay(pools["svc_b"], JetStreamPublisher(nc)).drain_once() == 1
        assert await published_ids(nc, stream) == ["svc_b-1"]
    finally:
        for p in pools.values():
            await p.close()


async def test_each_schema_notifies_its_own_channel(database_url: str) -> None:
    # Every append of the log used to wake every service's relay (one shared channel).
    # A row written in svc_a's outbox must wake svc_a's relay only.
    pools = {}
    heard: list[str] = []
    listener = await asyncpg.connect(database_url)
    try:
        for schema in ("svc_a", "svc_b"):
            pools[schema] = await create_pool(database_url, schema)
            await migrate(pools[schema], schema, [KIT_MIGRATIONS])
            await listener.add_listener(
                outbox.notify_channel(schema), lambda _c, _p, channel, _m: heard.append(channel)
            )
        for schema in ("svc_a", "svc_b"):
            async with pools[schema].acquire() as conn, conn.transaction():
                await Outbox(conn).send(f"x.{schema}", f"{schema}-1", b"{}")
            # Notifications reach a listener in commit order: had svc_a's row also
            # notified svc_b's channel, that would be heard before svc_b's own.
            await wait_for(lambda s=schema: outbox.notify_channel(s) in heard, what=schema)
        assert heard == [outbox.notify_channel("svc_a"), outbox.notify_channel("svc_b")]
    finally:
        await listener.close()
        for p in pools.values():
            await p.close()


async def test_many_rows_go_in_one_statement_in_the_order_given(
    pool: asyncpg.Pool, js: JetStreamContext, nc: Client, stream: tuple[str, str]
) -> None:
    _, prefix = stream
    rows = [
        Queued(f"{prefix}.{key}", f"{key}-{n}", b"{}", ordering_key=key, headers={"n": str(n)})
        for n in range(5)
        for key in ("S1", "S2")
    ]
    async with pool.acquire() as conn, conn.transaction():
        await Outbox(conn).send_many_with("effect AS (SELECT $1::int AS n)", [1], rows)
    stored = await pool.fetch("SELECT msg_id, headers FROM outbox ORDER BY id")
    assert [r["msg_id"] for r in stored] == [r.msg_id for r in rows]
    assert [r["headers"] for r in stored] == [dict(r.headers or {}) for r in rows]
    assert await OutboxRelay(pool, JetStreamPublisher(nc)).drain_once() == len(rows)
    published = await stream_messages(nc, stream[0], f"{prefix}.>")
    for key in ("S1", "S2"):
        ids = [m.headers["Nats-Msg-Id"] for m in published if m.subject.endswith(key)]
        assert ids == [f"{key}-{n}" for n in range(5)]


async def test_deliver_now_delivers_one_keys_rows_in_order_and_leaves_the_rest(
    pool: asyncpg.Pool, js: JetStreamContext, nc: Client, stream: tuple[str, str]
) -> None:
    _, prefix = stream
    await enqueue_committed(
        pool, (f"{prefix}.a", "k-1", "K"), (f"{prefix}.a", "l-1", "L"), (f"{prefix}.a", "k-2", "K")
    )
    relay = OutboxRelay(pool, JetStreamPublisher(nc))
    assert await relay.deliver_now("K", timeout=10)
    assert await published_ids(nc, stream) == ["k-1", "k-2"]
    assert await waiting(pool) == [("l-1", 0)]


async def test_deliver_now_waits_for_another_relay_delivering_the_key(
    pool: asyncpg.Pool,
    js: JetStreamContext,
    nc: Client,
    stream: tuple[str, str],
    make_pool: Callable[[], Awaitable[asyncpg.Pool]],
) -> None:
    _, prefix = stream
    await enqueue_committed(pool, (f"{prefix}.a", "k-1", "K"))
    slow = AwaitingSender()
    busy = asyncio.create_task(OutboxRelay(pool, slow, batch=1).drain_once())
    assert await asyncio.wait_for(slow.claimed, 10) == ["k-1"]

    now = asyncio.create_task(
        OutboxRelay(await make_pool(), JetStreamPublisher(nc)).deliver_now("K", 30)
    )
    # It cannot claim k-1 (held): it answers True only once the other relay deleted it.
    slow.release.set()
    assert await busy == 1
    assert await now
    assert await waiting(pool) == []


async def test_deliver_now_gives_up_after_its_timeout_and_leaves_the_row_to_the_relay(
    pool: asyncpg.Pool, js: JetStreamContext, nc: Client, make_stream: MakeStream
) -> None:
    prefix = f"none{uuid.uuid4().hex[:8]}"  # no stream captures it: every publish fails
    await enqueue_committed(pool, (f"{prefix}.a", "k-1", "K"))
    assert not await OutboxRelay(pool, JetStreamPublisher(nc)).deliver_now("K", timeout=1)
    [(msg_id, attempts)] = await waiting(pool)
    assert msg_id == "k-1" and attempts >= 1


async def test_an_outbox_from_before_leases_is_upgraded_at_start_and_its_rows_still_go(
    database_url: str,
) -> None:
    # A service's schema as the last release left it: every kit migration before the
    # lease, and a committed row its relay had not delivered yet.
    schema = f"before_lease_{uuid.uuid4().hex[:8]}"
    checksums = migration_set([KIT_MIGRATIONS])
    pool = await create_pool(database_url, schema)
    try:
        async with pool.acquire() as conn, conn.transaction():
            await conn.execute(f'CREATE SCHEMA "{schema}"')
            await conn.execute(
                f"""CREATE TABLE "{schema}".schema_migrations (
                        name text PRIMARY KEY, checksum text NOT NULL,
                        applied_at timestamptz NOT NULL DEFAULT now())"""
            )
            for name in (n for n in checksums if n < LEASE_MIGRATION):
                await conn.execute((files(KIT_MIGRATIONS) / name.split(":")[1]).read_text())
                await conn.execute(
                    "INSERT INTO schema_migrations (name, checksum) VALUES ($1, $2)",
                    name,
                    checksums[name],
                )
        await pool.execute(
            """INSERT INTO outbox (subject, msg_id, body, ordering_key)
               VALUES ('s.a', 'old', '{}', 'K')"""
        )

        assert LEASE_MIGRATION in await migrate(pool, schema, [KIT_MIGRATIONS])

        sender = RecordingSender()
        assert await OutboxRelay(pool, sender).drain_once() == 1
        assert sender.sent == ["old"]
        assert await waiting(pool) == []
    finally:
        await pool.execute(f'DROP SCHEMA "{schema}" CASCADE')
        await pool.close()
