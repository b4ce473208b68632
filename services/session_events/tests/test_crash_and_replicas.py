"""The log as real processes: killed mid-publish, and run as two replicas."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.aio.msg import Msg

from contracts import streams, subjects
from contracts.events import EventType
from contracts.session_events import (
    AppendedReply,
    AppendEvent,
    HeartbeatReply,
    OpenSession,
    SessionOpenedReply,
    SessionRef,
)
from servicekit.client import call
from servicekit.consumer import ConsumerSpec, DurableConsumer, claim_once
from servicekit.db import KIT_MIGRATIONS, create_pool, migrate
from testkit.probes import stream_messages, wait_for


@pytest_asyncio.fixture(loop_scope="session")
async def db(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(database_url)
    yield conn
    await conn.close()


class CountingConsumer:
    """A durable consumer of chat messages whose effect is counting, made idempotent."""

    def __init__(self) -> None:
        self.effects: list[str] = []
        self.deliveries = 0

    async def run(self, nc: Client, database_url: str) -> None:
        pool = await create_pool(database_url, "consumer_probe")
        await migrate(pool, "consumer_probe", [KIT_MIGRATIONS])

        async def handle(msg: Msg) -> None:
            self.deliveries += 1
            event_id = msg.headers["Nats-Msg-Id"] if msg.headers else ""
            async with pool.acquire() as conn, conn.transaction():
                if await claim_once(conn, "probe", event_id):
                    self.effects.append(event_id)

        spec = ConsumerSpec("probe", streams.EVENTS.name, ["chat.message.*.*"])
        try:
            await DurableConsumer(nc, nc.jetstream(), pool, spec, handle).run()
        finally:
            await pool.close()


async def open_with(nc: Client, project: str = "crash") -> SessionOpenedReply:
    return await call(
        nc,
        subjects.SESSIONS_OPEN,
        OpenSession(project_id=project, opened_by="user:ana"),
        SessionOpenedReply,
    )


@pytest.mark.parametrize("crash_point", ["outbox.before_publish", "outbox.after_publish"])
async def test_a_kill_between_commit_and_publish_loses_and_duplicates_nothing(
    nc: Client, spawn: Any, database_url: str, db: asyncpg.Connection, crash_point: str
) -> None:
    healthy = spawn("session_events")
    await healthy.wait_ready(nc, "session_events")
    opened = await open_with(nc)
    await wait_for(
        lambda: db.fetchval("SELECT count(*) = 0 FROM session_events.outbox"),
        what="session.opened to be relayed",
    )
    healthy.kill()

    probe = CountingConsumer()
    consumer = asyncio.create_task(probe.run(nc, database_url))
    # It dies holding the lease of its claim: the restarted relay takes the row once the
    # lease has expired, so a short one keeps the wait short.
    doomed = spawn(
        "session_events", AGENTBUS_FAULT_POINTS=crash_point, AGENTBUS_OUTBOX_LEASE_SECONDS="1"
    )
    await doomed.wait_ready(nc, "session_events")
    request = AppendEvent(
        session_id=opened.session_id,
        type="chat.message",
        actor="user:ana",
        payload={"text": "will it survive?"},
        idempotency_key="survivor",
    )
    # The reply races the crash; the commit does not, and that is what is checked.
    with contextlib.suppress(Exception):
        await call(nc, subjects.EVENTS_APPEND, request, AppendedReply, timeout=2)
    assert doomed.wait_exit() != 0

    event_id = await db.fetchval(
        "SELECT id FROM session_events.events WHERE idempotency_key = 'survivor'"
    )
    assert event_id is not None, "the committed event is in the log"
    assert await db.fetchval("SELECT count(*) FROM session_events.outbox") == 1
    subject = subjects.event_subject(EventType.CHAT_MESSAGE, "crash", opened.session_id)
    published_before_restart = len(await stream_messages(nc, streams.EVENTS.name, subject))
    assert published_before_restart == (1 if crash_point == "outbox.after_publish" else 0)

    restarted = spawn("session_events")
    await restarted.wait_ready(nc, "session_events")
    await wait_for(
        lambda: db.fetchval("SELECT count(*) = 0 FROM session_events.outbox"),
        what="the outbox to drain after restart",
    )
    [msg] = await stream_messages(nc, streams.EVENTS.name, subject)
    assert msg.headers["Nats-Msg-Id"] == str(event_id)
    await wait_for(lambda: probe.effects, what="the consumer to see the event")
    assert probe.effects == [str(event_id)]
    # A retried request with the same key is still the same single event.
    again = await call(nc, subjects.EVENTS_APPEND, request, AppendedReply)
    assert (again.event_id, again.duplicate) == (event_id, True)
    consumer.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await consumer


async def test_two_replicas_append_and_reap_exactly_as_one(
    nc: Client, spawn: Any, db: asyncpg.Connection
) -> None:
    knobs = {"AGENTBUS_HEARTBEAT_TIMEOUT_SECONDS": "1", "AGENTBUS_REAPER_INTERVAL_SECONDS": "0.1"}
    replicas = [spawn("session_events", **knobs) for _ in range(2)]
    for replica in replicas:
        await replica.wait_ready(nc, "session_events")

    sessions = [await open_with(nc, "replicas") for _ in range(4)]
    appends = [
        call(
            nc,
            subjects.EVENTS_APPEND,
            AppendEvent(
                session_id=s.session_id,
                type="chat.message",
                actor="user:ana",
                payload={"text": f"message {i}"},
            ),
            AppendedReply,
        )
        for i in range(25)
        for s in sessions
    ]
    await asyncio.gather(*appends)
    for s in sessions:
        seqs = await db.fetch(
            "SELECT seq FROM session_events.events WHERE session_id = $1 ORDER BY seq", s.session_id
        )
        assert [r["seq"] for r in seqs] == list(range(1, 27))

    stats = await _stats_by_pid(nc)
    assert len(stats) == 2
    assert all(n > 0 for n in stats.values()), f"both replicas served appends: {stats}"

    for s in sessions:
        await call(
            nc, subjects.SESSIONS_HEARTBEAT, SessionRef(session_id=s.session_id), HeartbeatReply
        )
    await wait_for(
        lambda: db.fetchval(
            "SELECT count(*) = 4 FROM session_events.sessions WHERE status = 'closed_abnormally'"
        ),
        what="both reapers to close the silent sessions",
    )
    closings = await db.fetch(
        "SELECT session_id, count(*) AS n FROM session_events.events WHERE type = $1 "
        "GROUP BY session_id",
        EventType.SESSION_CLOSED_ABNORMALLY.value,
    )
    assert {r["session_id"]: r["n"] for r in closings} == {s.session_id: 1 for s in sessions}

    await wait_for(
        lambda: db.fetchval("SELECT count(*) = 0 FROM session_events.outbox"),
        what="both relays to drain",
    )
    published = await stream_messages(nc, streams.EVENTS.name, "*.*.replicas.*")
    ids = [m.headers["Nats-Msg-Id"] for m in published]
    stored = await db.fetchval("SELECT count(*) FROM session_events.events")
    assert len(ids) == len(set(ids)) == stored == 4 * 27


async def _stats_by_pid(nc: Client) -> dict[str, int]:
    """Requests served per replica, from `$SRV.STATS` (every replica answers)."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish("$SRV.STATS.session_events", b"", reply=inbox)
    served: dict[str, int] = {}
    with contextlib.suppress(Exception):
        while True:
            reply = json.loads((await sub.next_msg(timeout=0.5)).data)
            appends = [e for e in reply["endpoints"] if e["subject"] == subjects.EVENTS_APPEND]
            served[reply["metadata"]["pid"]] = appends[0]["num_requests"]
    await sub.unsubscribe()
    return served
