"""Retention of claims and dead letters (servicekit.retention), against real Postgres: rows
past the bound go, rows inside it stay, and a message still deliverable whose claim stayed
is still recognised as a duplicate when it is redelivered."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import asyncpg
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from prometheus_client import REGISTRY

from contracts import streams
from contracts.streams import StreamSpec
from servicekit.consumer import ConsumerSpec, DurableConsumer, claim_once
from servicekit.retention import (
    DAY_SECONDS,
    Retention,
    RetentionPolicy,
    claims_kept_seconds,
)
from servicekit.settings import ServiceSettings
from testkit.probes import wait_for

Background = Callable[[Coroutine[Any, Any, None]], Any]

HOUR = 3600.0
MARGIN = 24 * HOUR
# EVENTS' max_age plus the default margin: a claim must be older than this to go.
BOUND = streams.EVENTS.max_age_seconds + MARGIN


def spec(max_age_seconds: float) -> StreamSpec:
    return StreamSpec(name="S", subjects=["s.>"], description="", max_age_seconds=max_age_seconds)


@pytest.mark.parametrize(
    ("consumed", "kept"),
    [
        ([streams.EVENTS], streams.EVENTS.max_age_seconds + MARGIN),
        ([spec(HOUR), spec(2 * HOUR)], 2 * HOUR + MARGIN),  # the longest-lived stream rules
        ([spec(HOUR), spec(0)], None),  # a stream kept for ever: claims kept for ever
        ([spec(HOUR), None], None),  # a stream the contracts do not declare
        ([], None),  # consuming nothing: a claim could be of anything
    ],
)
def test_a_claim_is_kept_while_its_message_can_still_be_delivered(
    consumed: list[StreamSpec | None], kept: float | None
) -> None:
    assert claims_kept_seconds(consumed, MARGIN) == kept


def test_a_service_policy_comes_from_its_settings_and_the_streams_it_consumes() -> None:
    settings = ServiceSettings(dead_letter_retention_days=3, retention_batch=7)
    policy = RetentionPolicy.for_service(settings, [streams.EVENTS.name])
    assert policy.claims_seconds == streams.EVENTS.max_age_seconds + settings.claims_margin_seconds
    assert policy.dead_letters_seconds == 3 * DAY_SECONDS
    assert policy.batch == 7
    assert RetentionPolicy.for_service(settings, ["KIT_scratch"]).claims_seconds is None


def test_events_is_bounded_by_age_and_bytes() -> None:
    assert streams.EVENTS.max_age_seconds > 0 and streams.EVENTS.max_bytes > 0


@pytest_asyncio.fixture(loop_scope="session")
async def consumer() -> AsyncIterator[str]:
    """A consumer name of this test only: its claims are the rows this test looks at."""
    yield f"c-{uuid.uuid4().hex[:8]}"


async def claim_aged(pool: asyncpg.Pool, consumer: str, msg_id: str, age: float) -> None:
    await pool.execute(
        "INSERT INTO processed_messages (consumer, msg_id, processed_at) "
        "VALUES ($1, $2, now() - make_interval(secs => $3))",
        consumer,
        msg_id,
        age,
    )


async def dead_letter_aged(pool: asyncpg.Pool, consumer: str, seq: int, age: float) -> None:
    await pool.execute(
        "INSERT INTO dead_letters (consumer, stream, stream_seq, subject, deliveries, reason,"
        " body, recorded_at) VALUES ($1, 'S', $2, 's.a', 1, 'test', '', "
        " now() - make_interval(secs => $3))",
        consumer,
        seq,
        age,
    )


def pruned_claims() -> float:
    """`agentbus_retention_pruned_rows_total` of the kit schema's claims, as scraped."""
    labels = {"schema": "kit_test", "table": "processed_messages"}
    return REGISTRY.get_sample_value("agentbus_retention_pruned_rows_total", labels) or 0.0


async def claims(pool: asyncpg.Pool, consumer: str) -> set[str]:
    rows = await pool.fetch("SELECT msg_id FROM processed_messages WHERE consumer = $1", consumer)
    return {r["msg_id"] for r in rows}


async def test_rows_past_the_bound_go_and_rows_inside_it_stay(
    pool: asyncpg.Pool, consumer: str
) -> None:
    for i in range(5):  # more than one batch
        await claim_aged(pool, consumer, f"old-{i}", BOUND + HOUR)
    await claim_aged(pool, consumer, "inside", BOUND - HOUR)
    await claim_aged(pool, consumer, "fresh", 0)
    await dead_letter_aged(pool, consumer, 1, 15 * DAY_SECONDS)
    await dead_letter_aged(pool, consumer, 2, 13 * DAY_SECONDS)
    before = pruned_claims()

    policy = RetentionPolicy(claims_seconds=BOUND, dead_letters_seconds=14 * DAY_SECONDS, batch=2)
    pruned = await Retention(pool, "kit_test", policy).prune_once()

    assert await claims(pool, consumer) == {"inside", "fresh"}
    kept = await pool.fetch("SELECT stream_seq FROM dead_letters WHERE consumer = $1", consumer)
    assert [r["stream_seq"] for r in kept] == [2]
    # other tests' rows of the schema are fresh: only this test's old rows went
    assert pruned == {"processed_messages": 5, "dead_letters": 1}
    assert pruned_claims() == before + 5


async def test_claims_kept_for_ever_are_never_pruned(pool: asyncpg.Pool, consumer: str) -> None:
    await claim_aged(pool, consumer, "ancient", 400 * DAY_SECONDS)
    policy = RetentionPolicy(claims_seconds=None, dead_letters_seconds=14 * DAY_SECONDS)

    await Retention(pool, "kit_test", policy).prune_once()

    assert await claims(pool, consumer) == {"ancient"}


async def test_a_redelivered_message_whose_claim_was_retained_is_still_a_duplicate(
    nc: Client,
    js: JetStreamContext,
    pool: asyncpg.Pool,
    stream: tuple[str, str],
    consumer: str,
    background: Background,
) -> None:
    """A message still in its stream (so it can be redelivered) whose claim is just inside
    the bound: after pruning, the consumer's handler finds the claim and skips the effect."""
    name, prefix = stream
    await claim_aged(pool, consumer, "m-kept", BOUND - HOUR)
    await claim_aged(pool, consumer, "m-gone", BOUND + HOUR)
    policy = RetentionPolicy(claims_seconds=BOUND, dead_letters_seconds=14 * DAY_SECONDS)
    await Retention(pool, "kit_test", policy).prune_once()

    effects: list[str] = []

    async def handler(msg: Msg) -> None:  # an idempotent consumer, as the kit makes them
        msg_id = (msg.headers or {})["Nats-Msg-Id"]
        async with pool.acquire() as conn, conn.transaction():
            if await claim_once(conn, consumer, msg_id):
                effects.append(msg_id)

    for msg_id in ("m-kept", "m-gone"):  # delivered again
        last = await js.publish(f"{prefix}.a", b"{}", headers={"Nats-Msg-Id": msg_id})
    durable = ConsumerSpec(durable=consumer, stream=name, filter_subjects=[f"{prefix}.>"])
    background(DurableConsumer(nc, js, pool, durable, handler).run())

    await wait_for(
        lambda: acknowledged(js, name, consumer, last.seq), what="both messages acknowledged"
    )
    # The retained claim kept its message from acting twice. "m-gone" stands for a message
    # past its stream's max_age, which JetStream would no longer deliver: were it delivered
    # anyway, it would act again — why the bound is the max_age plus a margin.
    assert effects == ["m-gone"]


async def acknowledged(js: JetStreamContext, stream: str, durable: str, seq: int) -> bool:
    """Whether the durable has acknowledged every message up to stream `seq` (False until
    it exists): its ack floor says so. `num_pending == num_ack_pending == 0` only infers
    it, from a `num_pending` the server estimates between recounts (nats-server PR 7758);
    this test once failed as if its wait had ended before the messages were handled."""
    try:
        info = await js.consumer_info(stream, durable)
    except NotFoundError:
        return False
    return info.ack_floor is not None and (info.ack_floor.stream_seq or 0) >= seq
