"""Group commit of appends: concurrent appends share a transaction and every rule holds.

The batching tests drive a `GroupCommit` of their own against the service's schema (a
second replica, in effect): appends gathered in one `asyncio.gather` all join its first
batch, so "in one batch" is certain, not a matter of timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
import pytest_asyncio
from nats.aio.client import Client

from contracts import streams, subjects
from contracts.events import EventType
from contracts.session_events import (
    AppendedReply,
    AppendEvent,
    AppendMany,
    AppendManyReply,
    OpenSession,
    SessionClosedReply,
    SessionOpenedReply,
    SessionRef,
)
from domain.errors import DomainError
from servicekit.client import call
from servicekit.db import KIT_MIGRATIONS, create_pool, migrate
from servicekit.outbox import JetStreamPublisher, OutboxRelay, notify_channel
from session_events.group_commit import GroupCommit, Pending
from session_events.repository import LogRepository
from testkit.probes import stream_messages, wait_for

CHAT = EventType.CHAT_MESSAGE


@pytest_asyncio.fixture(loop_scope="session")
async def pool(database_url: str, log_service: Any) -> AsyncIterator[asyncpg.Pool]:
    """A pool on the log's schema (migrated by the running service)."""
    pool = await create_pool(database_url, "session_events")
    yield pool
    await pool.close()


@pytest_asyncio.fixture(loop_scope="session")
async def appender(pool: asyncpg.Pool) -> GroupCommit:
    return GroupCommit(LogRepository(pool))


def chat(session_id: uuid.UUID, text: str, key: str | None = None, **fields: Any) -> Pending:
    return Pending(session_id, CHAT, "user:ana", {"text": text}, idempotency_key=key, **fields)


async def seqs_of(pool: asyncpg.Pool, session_id: uuid.UUID) -> list[int]:
    rows = await pool.fetch("SELECT seq FROM events WHERE session_id = $1 ORDER BY seq", session_id)
    return [r["seq"] for r in rows]


async def transactions_of(pool: asyncpg.Pool, session_ids: list[uuid.UUID]) -> int:
    """How many transactions wrote the sessions' events after `session.opened`: rows a
    transaction inserted share its id (`xmin`)."""
    count: int = await pool.fetchval(
        "SELECT count(DISTINCT xmin::text) FROM events WHERE session_id = ANY($1) AND seq > 1",
        session_ids,
    )
    return count


async def attempt(appender: GroupCommit, pending: Pending) -> AppendedReply | DomainError:
    try:
        return await appender.append(pending)
    except DomainError as refused:
        return refused


async def test_concurrent_appends_to_one_session_share_a_transaction_in_order(
    nc: Client, open_session: Any, pool: asyncpg.Pool, appender: GroupCommit
) -> None:
    opened = await open_session()
    sid = opened.session_id
    replies = await asyncio.gather(*(appender.append(chat(sid, f"m{i}")) for i in range(40)))

    assert appender.batches == 1
    assert await transactions_of(pool, [sid]) == 1
    assert [r.seq for r in replies] == list(range(2, 42))  # the order they came in
    assert await seqs_of(pool, sid) == list(range(1, 42))
    texts = await pool.fetch(
        "SELECT payload->>'text' AS t FROM events WHERE session_id = $1 AND seq > 1 ORDER BY seq",
        sid,
    )
    assert [r["t"] for r in texts] == [f"m{i}" for i in range(40)]
    # Published once each, in seq order (one outbox row per event, one key per session).
    subject = subjects.event_subject(CHAT, "proj-1", sid)
    published = await wait_for(
        lambda: _if_count(stream_messages(nc, streams.EVENTS.name, subject), 40),
        what="the batch to be published",
    )
    ids = [m.headers["Nats-Msg-Id"] for m in published]
    assert ids == [str(r.event_id) for r in replies]


async def _if_count(messages: Any, n: int) -> list[Any] | None:
    got: list[Any] = await messages
    return got if len(got) == n else None


async def test_concurrent_appends_to_many_sessions_are_gap_free_and_idempotent(
    open_session: Any, pool: asyncpg.Pool, appender: GroupCommit
) -> None:
    sids = [(await open_session()).session_id for _ in range(6)]
    work = [chat(s, f"{i}", key=f"k{i}") for i in range(8) for s in sids]
    first = await asyncio.gather(*(appender.append(p) for p in work))
    assert appender.batches == 1
    assert await transactions_of(pool, sids) == 1
    for s in sids:
        assert await seqs_of(pool, s) == list(range(1, 10))

    # The same keys again, concurrently: the original events come back, nothing is written.
    again = await asyncio.gather(*(appender.append(p) for p in work))
    assert [(r.event_id, r.seq, r.duplicate) for r in again] == [
        (r.event_id, r.seq, True) for r in first
    ]
    for s in sids:
        assert await seqs_of(pool, s) == list(range(1, 10))


async def test_a_key_repeated_inside_one_batch_is_written_once(
    open_session: Any, pool: asyncpg.Pool, appender: GroupCommit
) -> None:
    sid = (await open_session()).session_id
    one, two = await asyncio.gather(
        appender.append(chat(sid, "once", key="twice-sent")),
        appender.append(chat(sid, "once", key="twice-sent")),
    )
    assert appender.batches == 1
    assert (one.event_id, one.seq, one.duplicate) == (two.event_id, 2, False)
    assert (two.seq, two.duplicate) == (2, True)
    assert await seqs_of(pool, sid) == [1, 2]


async def test_a_refused_append_in_a_batch_writes_nothing_and_fails_no_other(
    nc: Client, open_session: Any, pool: asyncpg.Pool, appender: GroupCommit
) -> None:
    sid = (await open_session()).session_id
    closed = (await open_session()).session_id
    await call(nc, subjects.SESSIONS_CLOSE, SessionRef(session_id=closed), SessionClosedReply)
    brief = {"title": "Bakery app", "summary": "Pre-orders"}
    work = [
        chat(sid, "before"),
        chat(uuid.uuid4(), "nowhere"),  # no such session
        Pending(sid, EventType.ARTIFACT_PRODUCT_BRIEF, "agent:po", brief),  # wrong author
        chat(sid, "caused", causation_id=uuid.uuid4()),  # no such cause
        chat(closed, "too late"),  # conversation in a closed session
        chat(sid, "after"),
    ]
    outcomes = await asyncio.gather(*(attempt(appender, p) for p in work))

    assert appender.batches == 1
    codes = [o.code if isinstance(o, DomainError) else o.seq for o in outcomes]
    assert codes == [
        2,
        "session_not_found",
        "actor_not_allowed",
        "causation_not_found",
        "session_closed",
        3,
    ]
    assert all(isinstance(o, DomainError) and o.message for o in outcomes[1:5])
    assert await seqs_of(pool, sid) == [1, 2, 3]
    assert await seqs_of(pool, closed) == [1, 2]  # opened, closed: nothing after


async def test_a_value_postgres_refuses_fails_only_its_own_append(
    open_session: Any, pool: asyncpg.Pool, appender: GroupCommit
) -> None:
    """Had the contracts let it through, a NUL in jsonb fails the batch's insert: each
    append is then tried alone, so only that one fails."""
    sid = (await open_session()).session_id
    work = [chat(sid, "fine"), chat(sid, "bad\u0000"), chat(sid, "also fine")]
    outcomes = await asyncio.gather(*(appender.append(p) for p in work), return_exceptions=True)
    assert isinstance(outcomes[1], asyncpg.PostgresError)
    assert [o.seq for o in outcomes if isinstance(o, AppendedReply)] == [2, 3]
    assert await seqs_of(pool, sid) == [1, 2, 3]


async def test_a_crash_after_a_batch_is_written_loses_nothing_and_duplicates_nothing(
    nc: Client, spawn: Any, database_url: str
) -> None:
    """The process dies after its batch committed and before any caller heard: the events
    stay, and the callers' retries (same idempotency keys) to another replica are answered
    with the events already written, each written and published once."""
    doomed = spawn("session_events", AGENTBUS_FAULT_POINTS="append.batch_written")
    await doomed.wait_ready(nc, "session_events")
    opened = await call(
        nc,
        subjects.SESSIONS_OPEN,
        OpenSession(project_id="crash", opened_by="user:ana"),
        SessionOpenedReply,
    )
    requests = [
        AppendEvent(
            session_id=opened.session_id,
            type=CHAT.value,
            actor="user:ana",
            payload={"text": f"kept {i}"},
            idempotency_key=f"k-{i}",
        )
        for i in range(10)
    ]
    with contextlib.suppress(Exception):  # no reply comes: the process died after commit
        await asyncio.gather(
            *(call(nc, subjects.EVENTS_APPEND, r, AppendedReply, timeout=3) for r in requests)
        )
    assert doomed.wait_exit() != 0

    survivor = spawn("session_events")
    await survivor.wait_ready(nc, "session_events")
    retried = [await call(nc, subjects.EVENTS_APPEND, r, AppendedReply) for r in requests]

    assert any(r.duplicate for r in retried)  # the crashed batch was written
    assert sorted(r.seq for r in retried) == list(range(2, 12))
    conn = await asyncpg.connect(database_url)
    try:
        state = await conn.fetchrow(
            """SELECT (SELECT last_seq FROM session_events.sessions WHERE id = $1) AS last_seq,
                      (SELECT count(*) FROM session_events.events e
                        WHERE e.session_id = $1) AS events""",
            opened.session_id,
        )
    finally:
        await conn.close()
    assert state is not None
    assert dict(state) == {"last_seq": 11, "events": 11}
    # The crashed process's outbox rows are relayed by the survivor: each event once.
    subject = subjects.event_subject(CHAT, "crash", opened.session_id)
    published = await wait_for(
        lambda: _if_count(stream_messages(nc, streams.EVENTS.name, subject), 10),
        what="every event to be published",
    )
    assert sorted(m.headers["Nats-Msg-Id"] for m in published) == sorted(
        str(r.event_id) for r in retried
    )


async def test_a_batch_whose_session_moved_after_its_read_is_decided_again_under_lock(
    open_session: Any, pool: asyncpg.Pool, appender: GroupCommit
) -> None:
    """The batch reads its session unlocked; another writer appends to the session before
    the batch's write lands: the write finds `last_seq` moved, writes nothing, and the
    batch is decided again with the session locked, taking the seq after the other's."""
    sid = (await open_session()).session_id
    async with pool.acquire() as other, other.transaction():
        # Hold the session row as another replica's batch would while it writes.
        await other.execute("SELECT FROM sessions WHERE id = $1 FOR UPDATE", sid)
        mine = asyncio.ensure_future(appender.append(chat(sid, "mine")))
        await wait_for(
            lambda: _waiting_for_a_lock(pool), what="the batch's write to wait for the row"
        )
        await other.execute(
            """WITH moved AS (UPDATE sessions SET last_seq = 2 WHERE id = $1)
               INSERT INTO events (id, session_id, project_id, seq, type, actor, payload)
               VALUES ($2, $1, 'proj-1', 2, 'chat.message', 'user:ana', '{"text": "theirs"}')""",
            sid,
            uuid.uuid4(),
        )
    reply = await mine

    assert reply.seq == 3
    assert appender.decided_again == 1
    assert await seqs_of(pool, sid) == [1, 2, 3]
    texts = await pool.fetch(
        "SELECT payload->>'text' AS t FROM events WHERE session_id = $1 AND seq > 1 ORDER BY seq",
        sid,
    )
    assert [r["t"] for r in texts] == ["theirs", "mine"]


async def test_a_batch_waiting_on_its_write_holds_up_no_other_session(
    open_session: Any, pool: asyncpg.Pool, appender: GroupCommit
) -> None:
    """While one batch waits on its write (here for a row lock, as behind a slow commit),
    appends to other sessions go in a batch of their own and are answered; appends to its
    session wait for it and follow it in order, decided once (never beside it)."""
    held, free = (await open_session()).session_id, (await open_session()).session_id
    async with pool.acquire() as other, other.transaction():
        await other.execute("SELECT FROM sessions WHERE id = $1 FOR UPDATE", held)
        first = asyncio.ensure_future(appender.append(chat(held, "first")))
        await wait_for(
            lambda: _waiting_for_a_lock(pool), what="the first batch's write to wait for the row"
        )
        behind = asyncio.ensure_future(appender.append(chat(held, "behind")))
        meanwhile = asyncio.ensure_future(appender.append(chat(free, "meanwhile")))
        await wait_for(meanwhile.done, what="the other session's append, written meanwhile")
        assert not first.done() and not behind.done()
    assert (await meanwhile).seq == 2
    assert [(await first).seq, (await behind).seq] == [2, 3]
    assert appender.decided_again == 0
    assert await seqs_of(pool, held) == [1, 2, 3]


async def _waiting_for_a_lock(pool: asyncpg.Pool) -> bool:
    waiting: bool = await pool.fetchval(
        # The statement's start: `pg_stat_activity` keeps only its first 1 KiB.
        """SELECT EXISTS (SELECT 1 FROM pg_stat_activity
                          WHERE wait_event_type = 'Lock'
                            AND query LIKE '%bump AS (UPDATE sessions%')"""
    )
    return waiting


@pytest.mark.parametrize("replicas", [2])
async def test_replicas_batching_the_same_sessions_keep_seqs_gap_free(
    open_session: Any, pool: asyncpg.Pool, replicas: int
) -> None:
    sids = [(await open_session()).session_id for _ in range(3)]
    writers = [GroupCommit(LogRepository(pool)) for _ in range(replicas)]
    work = [
        w.append(chat(s, f"{w_i}-{i}", key=f"{w_i}-{i}"))
        for i in range(20)
        for w_i, w in enumerate(writers)
        for s in sids
    ]
    await asyncio.gather(*work)
    for s in sids:
        assert await seqs_of(pool, s) == list(range(1, 2 + 20 * replicas))


async def test_a_chain_holds_its_session_back_behind_an_append_postgres_could_not_write(
    open_session: Any, pool: asyncpg.Pool, appender: GroupCommit
) -> None:
    """Appends sent together (an outbox relay's) keep their session's order: after one
    that failed to be written, the session's later ones are answered `unavailable` and
    not written (a retry of the failed one would land after them); other sessions go on."""
    sid, other = (await open_session()).session_id, (await open_session()).session_id
    work = [chat(sid, "fine"), chat(sid, "bad\u0000"), chat(other, "other"), chat(sid, "after")]

    outcomes = await appender.append_chain(work)

    assert isinstance(outcomes[0], AppendedReply) and outcomes[0].seq == 2
    assert isinstance(outcomes[1], asyncpg.PostgresError)
    assert isinstance(outcomes[2], AppendedReply) and outcomes[2].seq == 2
    assert isinstance(outcomes[3], DomainError) and outcomes[3].code == "unavailable"
    assert await seqs_of(pool, sid) == [1, 2]
    assert await seqs_of(pool, other) == [1, 2]


async def test_append_many_answers_each_event_on_its_own_in_order(
    nc: Client, open_session: Any, pool: asyncpg.Pool
) -> None:
    sid = (await open_session()).session_id
    closed = (await open_session()).session_id
    await call(nc, subjects.SESSIONS_CLOSE, SessionRef(session_id=closed), SessionClosedReply)

    def event(session: uuid.UUID, **fields: Any) -> dict[str, Any]:
        return {"session_id": str(session), "type": CHAT.value, "actor": "user:ana"} | fields

    # Malformed (no actor): the request is refused whole, as any command's, and nothing
    # of it is written.
    malformed = [event(sid, payload={"text": "zero"}), event(sid, payload={}) | {"actor": None}]
    body = json.dumps({"events": malformed}).encode()
    refused = await nc.request(subjects.EVENTS_APPEND_MANY, body, timeout=5)
    assert json.loads(refused.data)["error"]["code"] == "invalid_request"

    request = AppendMany.model_validate(
        {
            "events": [
                event(sid, payload={"text": "one"}, idempotency_key="k-1"),
                event(sid, type="no.such_type", payload={}),  # refused by the rules
                event(closed, payload={"text": "too late"}),  # refused: conversation is over
                event(sid, payload={"text": "one"}, idempotency_key="k-1"),  # a repeat
                event(sid, payload={"text": "two"}),
            ]
        }
    )
    reply = await call(nc, subjects.EVENTS_APPEND_MANY, request, AppendManyReply)

    answers = [(r.seq, r.duplicate, r.error.code if r.error else None) for r in reply.results]
    assert answers == [
        (2, False, None),
        (None, False, "unknown_event_type"),
        (None, False, "session_closed"),
        (2, True, None),
        (3, False, None),
    ]
    assert await seqs_of(pool, sid) == [1, 2, 3]
    assert await seqs_of(pool, closed) == [1, 2]


async def test_a_batch_wakes_the_relay_of_its_process_instead_of_notifying(
    nc: Client, database_url: str
) -> None:
    """Given the relay of its process, a committed batch wakes it directly: no NOTIFY
    (each one signals every listening backend of the database), and its rows are
    delivered at once, not at the relay's next poll (an hour away here)."""
    schema = f"log_wake_{uuid.uuid4().hex[:8]}"
    pool = await create_pool(database_url, schema)
    listener = await asyncpg.connect(database_url)
    heard: list[str] = []
    relay = OutboxRelay(pool, JetStreamPublisher(nc), poll_seconds=3600)
    running: asyncio.Task[None] | None = None
    try:
        await migrate(pool, schema, [KIT_MIGRATIONS, "session_events.migrations"])
        await listener.add_listener(notify_channel(schema), lambda *args: heard.append(args[1]))
        running = asyncio.create_task(relay.run())
        await wait_for(lambda: _listening(pool, schema), what="the relay to listen")
        repo = LogRepository(pool, relay.wake)
        async with repo.transaction() as tx:
            session = await tx.create_session("wake", "user:ana")

        reply = await GroupCommit(repo).append(chat(session.id, "hi"))

        await wait_for(lambda: relay.delivered == 1, what="the relay, woken, to deliver")
        await listener.fetchval("SELECT 1")  # a NOTIFY of the commit would be in by now
        assert heard == []
        published = await stream_messages(
            nc, streams.EVENTS.name, subjects.event_subject(CHAT, "wake", session.id)
        )
        assert [m.headers["Nats-Msg-Id"] for m in published] == [str(reply.event_id)]
    finally:
        if running is not None:  # its connections go back to the pool before it closes
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running
        await listener.close()
        await pool.execute(f"DROP SCHEMA {schema} CASCADE")
        await pool.close()


async def _listening(pool: asyncpg.Pool, schema: str) -> bool:
    listening: bool = await pool.fetchval(
        """SELECT EXISTS (SELECT 1 FROM pg_stat_activity
                          WHERE application_name = $1 AND query LIKE 'LISTEN%')""",
        schema,
    )
    return listening
