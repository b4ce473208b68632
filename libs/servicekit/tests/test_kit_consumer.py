"""Durable consumers against a real JetStream: ack, retry, dead letters, idempotency."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import asyncpg
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerInfo
from nats.js.errors import NotFoundError

from contracts import streams, subjects
from servicekit.consumer import ConsumerSpec, DurableConsumer, Permanent, claim_once
from testkit.probes import stream_messages, wait_for

from .conftest import Background, RunConsumer, stop

# Starts a DurableConsumer in the background (stopped at the end of the test).


@dataclass
class Calls:
    """What the handler saw: one entry per delivery that reached it."""

    deliveries: list[tuple[str, int, float]] = field(default_factory=list)

    def record(self, msg: Msg) -> None:
        self.deliveries.append((msg.subject, msg.metadata.num_delivered, time.monotonic()))

    def of(self, subject: str) -> list[int]:
        return [n for s, n, _ in self.deliveries if s == subject]


def spec_for(
    stream: tuple[str, str], max_deliver: int = 4, backoff: tuple[float, ...] = (0.1, 0.2)
) -> ConsumerSpec:
    """A consumer of its own on the test's stream, with delays short enough for a test."""
    name, prefix = stream
    return ConsumerSpec(
        durable=f"c{uuid.uuid4().hex[:10]}",
        stream=name,
        filter_subjects=[f"{prefix}.>"],
        max_deliver=max_deliver,
        backoff=list(backoff),
    )


async def publish(js: JetStreamContext, subject: str, msg_id: str, body: bytes = b"{}") -> None:
    await js.publish(subject, body, headers={"Nats-Msg-Id": msg_id})


async def consumer_info(js: JetStreamContext, spec: ConsumerSpec) -> ConsumerInfo | None:
    """The consumer's info, None until `DurableConsumer.run` created it."""
    try:
        info: ConsumerInfo = await js.consumer_info(spec.stream, spec.durable)
    except NotFoundError:
        return None
    return info


async def settled(js: JetStreamContext, spec: ConsumerSpec, delivered: int) -> ConsumerInfo | None:
    """The consumer's info once `delivered` messages went out and none awaits an ack."""
    info = await consumer_info(js, spec)
    if info is None:
        return None
    done = info.delivered is not None and info.delivered.stream_seq == delivered
    return info if done and info.num_ack_pending == 0 and info.num_pending == 0 else None


async def dead_letters(pool: asyncpg.Pool) -> list[dict[str, Any]]:
    rows = await pool.fetch(
        """SELECT consumer, stream, stream_seq, subject, msg_id, deliveries, reason, body
             FROM dead_letters ORDER BY id"""
    )
    return [dict(r) for r in rows]


async def dead_letter_messages(nc: Client, spec: ConsumerSpec) -> list[Msg]:
    subject = f"{subjects.DEAD_LETTER_PREFIX}.{spec.durable}"
    return await stream_messages(nc, streams.DEAD_LETTERS.name, subject)


async def test_a_message_is_acked_only_after_its_handler_succeeded(
    js: JetStreamContext, stream: tuple[str, str], run_consumer: RunConsumer
) -> None:
    _, prefix = stream
    spec = spec_for(stream)
    unacked_while_handling: list[int] = []

    async def handler(msg: Msg) -> None:
        info = await js.consumer_info(spec.stream, spec.durable)
        unacked_while_handling.append(info.num_ack_pending)

    run_consumer(spec, handler)
    await publish(js, f"{prefix}.a", "m-1")

    info = await wait_for(lambda: settled(js, spec, 1), what="the message acked")
    assert unacked_while_handling == [1]
    assert info.num_redelivered == 0


async def test_a_transient_failure_is_retried_after_the_backoff_then_acked(
    js: JetStreamContext, pool: asyncpg.Pool, stream: tuple[str, str], run_consumer: RunConsumer
) -> None:
    _, prefix = stream
    spec = spec_for(stream, backoff=(0.1, 0.2))
    calls = Calls()

    async def handler(msg: Msg) -> None:
        calls.record(msg)
        if msg.metadata.num_delivered < 3:
            raise ConnectionError("the database blinked")

    run_consumer(spec, handler)
    await publish(js, f"{prefix}.a", "m-1")

    await wait_for(lambda: settled(js, spec, 1), what="the message acked")
    assert calls.of(f"{prefix}.a") == [1, 2, 3]
    times = [t for _, _, t in calls.deliveries]
    # nak'ed with the spec's delay: never redelivered sooner (a lower bound, not a race)
    assert times[1] - times[0] >= 0.09
    assert times[2] - times[1] >= 0.19
    assert await dead_letters(pool) == []


async def test_permanent_is_dead_lettered_at_once_and_terminated(
    nc: Client,
    js: JetStreamContext,
    pool: asyncpg.Pool,
    stream: tuple[str, str],
    run_consumer: RunConsumer,
) -> None:
    name, prefix = stream
    spec = spec_for(stream)
    calls = Calls()

    async def handler(msg: Msg) -> None:
        calls.record(msg)
        if msg.data == b"poison":
            raise Permanent("payload has no session_id")

    run_consumer(spec, handler)
    await publish(js, f"{prefix}.a", "m-1", b"poison")
    await publish(js, f"{prefix}.b", "m-2", b"fine")

    info = await wait_for(lambda: settled(js, spec, 2), what="both messages settled")
    # terminated, not nak'ed: nothing pending, nothing redelivered
    assert info.num_redelivered == 0
    assert calls.of(f"{prefix}.a") == [1]
    assert await dead_letters(pool) == [
        {
            "consumer": spec.durable,
            "stream": name,
            "stream_seq": 1,
            "subject": f"{prefix}.a",
            "msg_id": "m-1",
            "deliveries": 1,
            "reason": "permanent: payload has no session_id",
            "body": b"poison",
        }
    ]
    [announced] = await dead_letter_messages(nc, spec)
    assert announced.data == b"poison"
    assert announced.headers is not None
    assert announced.headers["Agentbus-Dead-Letter-Reason"] == (
        "permanent: payload has no session_id"
    )
    assert announced.headers["Agentbus-Original-Subject"] == f"{prefix}.a"


async def test_a_message_failing_every_time_is_dead_lettered_once_after_max_deliver(
    nc: Client,
    js: JetStreamContext,
    pool: asyncpg.Pool,
    stream: tuple[str, str],
    run_consumer: RunConsumer,
) -> None:
    _, prefix = stream
    spec = spec_for(stream, max_deliver=3, backoff=(0.05, 0.1))
    calls = Calls()

    async def handler(msg: Msg) -> None:
        calls.record(msg)
        if msg.subject.endswith(".bad"):
            raise RuntimeError("always")

    run_consumer(spec, handler)
    await publish(js, f"{prefix}.bad", "m-1")

    await wait_for(lambda: dead_letters(pool), what="the dead letter")
    # a later message goes through: the consumer is not stuck on the dead one
    await publish(js, f"{prefix}.good", "m-2")
    await wait_for(lambda: settled(js, spec, 2), what="both messages settled")

    assert calls.of(f"{prefix}.bad") == [1, 2, 3]
    [row] = await dead_letters(pool)
    assert (row["msg_id"], row["deliveries"]) == ("m-1", 3)
    assert row["reason"].startswith("exhausted 3 deliveries: RuntimeError('always')")
    assert len(await dead_letter_messages(nc, spec)) == 1


async def test_a_message_out_of_deliveries_before_reaching_the_handler_is_dead_lettered(
    nc: Client,
    js: JetStreamContext,
    pool: asyncpg.Pool,
    stream: tuple[str, str],
    run_consumer: RunConsumer,
) -> None:
    # A process that crashes while holding the message never gets to dead-letter it;
    # the server's MAX_DELIVERIES advisory is what records it.
    _, prefix = stream
    spec = spec_for(stream, max_deliver=2, backoff=(0.1,))
    await js.add_consumer(spec.stream, spec.config())
    await publish(js, f"{prefix}.a", "m-1", b"crash loop")
    crashing = await js.pull_subscribe_bind(durable=spec.durable, stream=spec.stream)
    for delivery in (1, 2):  # taken, never acked: the process "died" each time
        [msg] = await crashing.fetch(1, timeout=5)
        assert msg.metadata.num_delivered == delivery
    await crashing.unsubscribe()
    calls = Calls()

    async def handler(msg: Msg) -> None:
        calls.record(msg)

    run_consumer(spec, handler)

    [row] = await wait_for(lambda: dead_letters(pool), what="the dead letter from the advisory")
    assert (row["msg_id"], row["reason"], row["body"]) == (
        "m-1",
        "max deliveries reached",
        b"crash loop",
    )
    assert row["deliveries"] == spec.max_deliver
    [announced] = await wait_for(lambda: dead_letter_messages(nc, spec), what="the announcement")
    assert announced.headers is not None
    assert announced.headers["Agentbus-Dead-Letter-Reason"] == "max deliveries reached"
    assert calls.deliveries == []


async def test_claim_once_is_true_then_false_for_the_same_consumer_and_message(
    pool: asyncpg.Pool,
) -> None:
    async with pool.acquire() as conn:
        assert await claim_once(conn, "projector", "m-1") is True
        assert await claim_once(conn, "projector", "m-1") is False
        assert await claim_once(conn, "notifier", "m-1") is True  # another consumer's own record
        assert await claim_once(conn, "projector", "m-2") is True

        # claimed in a transaction that rolled back: not processed, so claimable again
        with contextlib.suppress(RuntimeError):
            async with conn.transaction():
                assert await claim_once(conn, "projector", "m-3") is True
                raise RuntimeError("the effect failed")
        assert await claim_once(conn, "projector", "m-3") is True


async def test_an_idempotent_handler_redelivered_after_its_commit_has_its_effect_once(
    js: JetStreamContext, pool: asyncpg.Pool, stream: tuple[str, str], run_consumer: RunConsumer
) -> None:
    # The effect committed but the ack was lost (AckWait passed, the process died…):
    # the message comes again, and the claim recorded with the effect skips it.
    _, prefix = stream
    spec = spec_for(stream)
    await pool.execute("CREATE TABLE effects (msg_id text NOT NULL, n int NOT NULL)")
    calls = Calls()

    async def handler(msg: Msg) -> None:
        calls.record(msg)
        msg_id = (msg.headers or {})["Nats-Msg-Id"]
        async with pool.acquire() as conn, conn.transaction():
            if await claim_once(conn, spec.durable, msg_id):
                await conn.execute("INSERT INTO effects VALUES ($1, 1)", msg_id)
        if msg.metadata.num_delivered == 1:
            raise ConnectionError("lost before the ack")

    run_consumer(spec, handler)
    await publish(js, f"{prefix}.a", "m-1")

    await wait_for(lambda: settled(js, spec, 1), what="the message acked")
    assert calls.of(f"{prefix}.a") == [1, 2]
    assert [tuple(r) for r in await pool.fetch("SELECT msg_id, n FROM effects")] == [("m-1", 1)]


async def test_the_consumer_is_created_with_explicit_acks_and_bounded_redelivery(
    js: JetStreamContext, stream: tuple[str, str], run_consumer: RunConsumer
) -> None:
    spec = spec_for(stream, max_deliver=3, backoff=(0.1, 0.2, 0.4, 0.8))

    async def handler(msg: Msg) -> None:
        pass

    run_consumer(spec, handler)

    info = await wait_for(lambda: consumer_info(js, spec), what="the consumer created")
    assert info.config.ack_policy == AckPolicy.EXPLICIT
    assert info.config.max_deliver == 3
    # the server refuses more backoff steps than redeliveries: the spec trims them
    assert info.config.backoff == [0.1, 0.2]
    assert spec.delay_after(1) == 0.1
    assert spec.delay_after(9) == 0.8


async def test_a_consumer_stops_when_cancelled_as_a_reply_arrives(
    js: JetStreamContext,
    stream: tuple[str, str],
    nc: Client,
    pool: asyncpg.Pool,
    background: Background,
) -> None:
    _, prefix = stream
    spec = spec_for(stream)
    replies: asyncio.Queue[asyncio.Future[None]] = asyncio.Queue()

    async def handler(msg: Msg) -> None:
        reply = asyncio.get_running_loop().create_future()
        replies.put_nowait(reply)
        await asyncio.wait_for(reply, 30)  # as nc.request awaits a reply inside

    task = background(DurableConsumer(nc, js, pool, spec, handler).run())
    await publish(js, f"{prefix}.a", "m-1")
    reply = await asyncio.wait_for(replies.get(), 15)

    reply.set_result(None)  # the reply lands...
    task.cancel()  # ...in the same loop iteration as the service's shutdown

    await asyncio.wait([task], timeout=1)
    assert task.cancelled(), "the consumer ignored its cancellation"


async def test_a_message_whose_handler_outlasts_the_first_backoff_step_is_handled_once(
    js: JetStreamContext, pool: asyncpg.Pool, stream: tuple[str, str], run_consumer: RunConsumer
) -> None:
    # In production backoff[0] is 1 s, and an LLM turn or an analysis takes many.
    _, prefix = stream
    spec = spec_for(stream, max_deliver=3, backoff=(0.2, 0.4))
    calls = Calls()

    async def handler(msg: Msg) -> None:
        calls.record(msg)
        # The handler's own slow I/O, not synchronisation: long enough for the other
        # replica's next pull (DurableConsumer fetches with a 1 s timeout) to come by.
        await asyncio.sleep(2.0)

    for _ in range(2):  # two replicas of the service share the durable consumer
        run_consumer(spec, handler)
    await publish(js, f"{prefix}.a", "m-1")

    await wait_for(lambda: settled(js, spec, 1), what="the message settled")
    assert calls.of(f"{prefix}.a") == [1]
    assert await dead_letters(pool) == []


async def test_a_message_settled_within_the_keep_alive_interval_is_never_reported_in_progress(
    nc: Client, js: JetStreamContext, stream: tuple[str, str], run_consumer: RunConsumer
) -> None:
    # Reports are kept for what is held long (the test above): a report on a message about
    # to be acked carries nothing. Each message here is held 0.3 s of the 1 s interval:
    # 0.7 s of slack for a loaded machine's stalls, while a tick every interval for every
    # held message (the old way) falls in some of the ten holds (all but 0.7^10 = 3 %).
    _, prefix = stream
    spec = spec_for(stream, backoff=(3.0,))
    assert spec.keep_alive_interval == 1.0
    acks: list[bytes] = []

    async def on_ack(msg: Msg) -> None:
        acks.append(msg.data)

    await nc.subscribe(f"$JS.ACK.{spec.stream}.{spec.durable}.>", cb=on_ack)
    await nc.flush()

    async def handler(msg: Msg) -> None:
        await asyncio.sleep(0.3)  # the handler's own work, shorter than the interval

    run_consumer(spec, handler)
    # One at a time, so that each is held only while handled: reporting every held message
    # at every tick reported some of them, a tick falling in their half-second.
    for n in range(1, 11):
        await publish(js, f"{prefix}.a", f"m-{n}")
        await wait_for(lambda n=n: settled(js, spec, n), what=f"message {n} settled")

    assert b"+WPI" not in acks
    assert len(acks) == 10  # the acks (nats-py's is an empty body)


async def test_a_message_held_within_the_least_redelivery_time_is_neither_reported_nor_redelivered(
    nc: Client,
    js: JetStreamContext,
    pool: asyncpg.Pool,
    stream: tuple[str, str],
    run_consumer: RunConsumer,
) -> None:
    # A handler that takes several backoff steps by design (an LLM turn): given a least
    # redelivery time beyond its hold, the server waits for it, so the holder sends no
    # progress report, while a failure is still retried after the backoff step.
    _, prefix = stream
    spec = replace(spec_for(stream, backoff=(0.1, 0.2)), redeliver_held_after=5.0)
    assert spec.delay_after(1) == 0.1
    acks: list[bytes] = []

    async def on_ack(msg: Msg) -> None:
        acks.append(msg.data)

    await nc.subscribe(f"$JS.ACK.{spec.stream}.{spec.durable}.>", cb=on_ack)
    await nc.flush()
    calls = Calls()

    async def handler(msg: Msg) -> None:
        calls.record(msg)
        await asyncio.sleep(0.6)  # six first backoff steps, a tenth of the least redelivery

    for _ in range(2):  # two replicas of the service share the durable consumer
        run_consumer(spec, handler)
    await publish(js, f"{prefix}.a", "m-1")

    await wait_for(lambda: settled(js, spec, 1), what="the message settled")
    assert calls.of(f"{prefix}.a") == [1]
    assert b"+WPI" not in acks
    assert await dead_letters(pool) == []
    info = await consumer_info(js, spec)
    assert info is not None and info.config.backoff == [5.0, 5.0]


async def test_a_consumer_stopping_hands_what_it_holds_to_another_replica_at_once(
    js: JetStreamContext,
    nc: Client,
    pool: asyncpg.Pool,
    stream: tuple[str, str],
    background: Background,
) -> None:
    # A replica restarting (a deploy) with a message in hand: the replica that stays takes
    # it now, not after the server's least redelivery time (here far beyond the wait).
    _, prefix = stream
    spec = replace(spec_for(stream), redeliver_held_after=120.0)
    calls = Calls()
    taken = asyncio.Event()

    async def handler(msg: Msg) -> None:
        calls.record(msg)
        if msg.metadata.num_delivered == 1:
            taken.set()
            await asyncio.Event().wait()  # held until its replica stops

    first = background(DurableConsumer(nc, js, pool, spec, handler).run())
    await publish(js, f"{prefix}.a", "m-1")
    await asyncio.wait_for(taken.wait(), 15)
    await stop(first)
    background(DurableConsumer(nc, js, pool, spec, handler).run())

    await wait_for(lambda: settled(js, spec, 1), timeout=30, what="the message handed over")
    assert calls.of(f"{prefix}.a") == [1, 2]


async def test_a_handler_ended_by_a_cancelled_future_leaves_its_message_for_redelivery(
    js: JetStreamContext,
    nc: Client,
    pool: asyncpg.Pool,
    stream: tuple[str, str],
    background: Background,
) -> None:
    # Only a consumer that stops keeps what it holds, to hand it back: a handler that
    # ends on a cancelled future it awaited (an actor stopped under it) leaves the
    # message unreported, for the server to deliver again.
    _, prefix = stream
    spec = spec_for(stream)
    calls = Calls()

    async def handler(msg: Msg) -> None:
        calls.record(msg)
        if msg.metadata.num_delivered == 1:
            gone = asyncio.get_running_loop().create_future()
            gone.cancel()
            await gone

    consumer = DurableConsumer(nc, js, pool, spec, handler, ordering_key=lambda _: "one")
    background(consumer.run())
    await publish(js, f"{prefix}.a", "m-1")

    await wait_for(lambda: settled(js, spec, 1), what="the message delivered again and acked")
    assert calls.of(f"{prefix}.a") == [1, 2]
