"""`Service`: typed commands and subscriptions with injected dependencies, against a real
NATS and a real Postgres — the claim, the transaction with its outbox, per-session
ordering with the keep-alive, and NATS micro discovery."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import asyncpg
import httpx
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.js import JetStreamContext
from pydantic import BaseModel

from contracts import catalog
from contracts.session_events import (
    AppendEvent,
    ListSessions,
    SessionRef,
    SessionsReply,
    SessionView,
)
from domain.errors import DomainError
from servicekit.cancellation import stop
from servicekit.consumer import ConsumerSpec
from servicekit.outbox import with_outbox
from servicekit.runtime import Runtime
from servicekit.service import Attempt, Service, session_of_subject
from servicekit.settings import ServiceSettings
from testkit.probes import wait_for

from .conftest import KIT_SCHEMA


class Add(BaseModel):
    a: int
    b: int


class Sum(BaseModel):
    total: int


class Note(BaseModel):
    session_id: uuid.UUID
    n: int


@dataclass
class Seen:
    """What a subscription's handler saw, in order."""

    started: list[int] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)


# Serves a Service on the test's connections until the end of the test.
Serve = Callable[..., Awaitable[Runtime]]


@pytest_asyncio.fixture(loop_scope="session")
async def serve(nc: Client, js: JetStreamContext, pool: asyncpg.Pool) -> AsyncIterator[Serve]:
    runtimes: list[tuple[Runtime, asyncio.Task[None]]] = []

    async def start(svc: Service, **deps: Any) -> Runtime:
        rt = Runtime(svc.name, KIT_SCHEMA, ServiceSettings(), nc, js, pool)
        task = asyncio.create_task(svc.serve(rt, **deps))
        runtimes.append((rt, task))
        # Answering discovery means every subscription and command is in place.
        await wait_for(lambda: _ping(nc, svc.name), what=f"{svc.name} answering $SRV.PING")
        return rt

    yield start
    for rt, task in runtimes:
        await stop(task)
        await asyncio.gather(*(stop(t) for t in rt.tasks))


async def _ping(nc: Client, name: str) -> bool:
    try:
        await nc.request(f"$SRV.PING.{name}", b"", timeout=0.5)
    except Exception:
        return False
    return True


def spec_for(stream: tuple[str, str], **overrides: object) -> ConsumerSpec:
    name, prefix = stream
    settings: dict[str, object] = {
        "durable": f"c{uuid.uuid4().hex[:10]}",
        "stream": name,
        "filter_subjects": [f"{prefix}.>"],
        "max_deliver": 4,
        "backoff": [0.2, 0.4],
        **overrides,
    }
    return ConsumerSpec(**settings)  # type: ignore[arg-type]


async def publish(js: JetStreamContext, subject: str, body: BaseModel, msg_id: str) -> None:
    await js.publish(subject, body.model_dump_json().encode(), headers={"Nats-Msg-Id": msg_id})


async def settled(js: JetStreamContext, spec: ConsumerSpec, delivered: int) -> bool:
    info = await js.consumer_info(spec.stream, spec.durable)
    done = info.delivered is not None and info.delivered.stream_seq == delivered
    return done and info.num_ack_pending == 0 and info.num_pending == 0


async def test_a_command_reads_its_request_model_off_the_signature_and_gets_its_dependencies(
    nc: Client, serve: Serve
) -> None:
    name = f"toy_{uuid.uuid4().hex[:8]}"
    svc = Service(name, "1.2.3", "A toy service.", schema=KIT_SCHEMA)

    @svc.command(f"cmd.{name}.add")
    async def add(cmd: Add, offset: int) -> Sum:
        if cmd.a < 0:
            raise DomainError("negative", "a toy adds naturals only")
        return Sum(total=cmd.a + cmd.b + offset)

    await serve(svc, offset=100, metadata={"flavour": "toy"})

    reply = await nc.request(f"cmd.{name}.add", Add(a=1, b=2).model_dump_json().encode())
    assert Sum.model_validate_json(reply.data).total == 103
    refused = await nc.request(f"cmd.{name}.add", Add(a=-1, b=2).model_dump_json().encode())
    assert json.loads(refused.data)["error"]["code"] == "negative"
    malformed = await nc.request(f"cmd.{name}.add", b'{"a": "x"}')
    assert json.loads(malformed.data)["error"]["code"] == "invalid_request"
    info = json.loads((await nc.request(f"$SRV.INFO.{name}", b"")).data)
    assert (info["name"], info["version"]) == (name, "1.2.3")
    # what the service announces, beside the kit's own (instance, pid, metrics)
    assert info["metadata"]["flavour"] == "toy"
    assert {"instance", "pid", "metrics"} <= set(info["metadata"])
    assert [(e["subject"], e["metadata"]["request"]) for e in info["endpoints"]] == [
        (f"cmd.{name}.add", "Add")
    ]


async def test_a_handler_asking_for_a_dependency_nobody_gave_fails_at_start(
    nc: Client, js: JetStreamContext, pool: asyncpg.Pool
) -> None:
    svc = Service("toy_missing", "1.0.0", "A toy service.", schema=KIT_SCHEMA)

    @svc.command("cmd.toy_missing.add")
    async def add(cmd: Add, repo: object) -> Sum:
        return Sum(total=0)

    rt = Runtime(svc.name, KIT_SCHEMA, ServiceSettings(), nc, js, pool)
    try:
        await svc.serve(rt)
    except TypeError as exc:
        assert "repo" in str(exc)
    else:
        raise AssertionError("served a handler without its dependency")


async def test_a_subscription_commits_its_outbox_row_once_then_acks(
    js: JetStreamContext, pool: asyncpg.Pool, stream: tuple[str, str], serve: Serve
) -> None:
    _, prefix = stream
    spec = spec_for(stream)
    svc = Service(f"toy_{uuid.uuid4().hex[:8]}", "1.0.0", "A toy service.", schema=KIT_SCHEMA)
    seen = Seen()

    @svc.subscribe(spec)
    async def noted(note: Note, attempt: Attempt) -> None:
        seen.attempts.append(attempt)
        async with with_outbox(pool, None) as (_, outbox):
            await outbox.append(
                AppendEvent(
                    session_id=note.session_id,
                    type="chat.message",
                    actor="system:kit-tests",
                    payload={"text": f"note {note.n}"},
                    idempotency_key=f"note:{note.n}",
                )
            )
            if attempt.number == 1:
                raise ConnectionError("the store blinked")  # rolls the row back: retried

    await serve(svc)
    session = uuid.uuid4()
    await publish(js, f"{prefix}.n.p.{session}", Note(session_id=session, n=1), "m-1")

    await wait_for(lambda: settled(js, spec, 1), what="the note acked after its retry")
    assert [(a.number, a.last) for a in seen.attempts] == [(1, False), (2, False)]
    rows = await pool.fetch("SELECT msg_id FROM outbox WHERE msg_id = 'note:1'")
    assert len(rows) == 1
    await pool.execute("DELETE FROM outbox WHERE msg_id = 'note:1'")


async def test_a_message_that_is_not_the_model_is_dead_lettered_at_once(
    js: JetStreamContext, pool: asyncpg.Pool, stream: tuple[str, str], serve: Serve
) -> None:
    _, prefix = stream
    spec = spec_for(stream)
    svc = Service(f"toy_{uuid.uuid4().hex[:8]}", "1.0.0", "A toy service.", schema=KIT_SCHEMA)

    @svc.subscribe(spec)
    async def noted(note: Note) -> None:
        raise AssertionError("a malformed note reached the handler")

    await serve(svc)
    await js.publish(f"{prefix}.n.p.s", b"{not json", headers={"Nats-Msg-Id": "bad-1"})

    await wait_for(lambda: settled(js, spec, 1), what="the malformed note terminated")
    reason = await pool.fetchval(
        "SELECT reason FROM dead_letters WHERE consumer = $1", spec.durable
    )
    assert reason.startswith("permanent: not an event")


async def test_per_session_ordering_runs_sessions_concurrently_and_keeps_waiting_ones_alive(
    js: JetStreamContext, stream: tuple[str, str], serve: Serve
) -> None:
    _, prefix = stream
    # backoff[0] is the server's redelivery time for a held message; the slow note
    # below outlasts it many times over.
    spec = spec_for(stream, backoff=[0.2, 0.4], max_deliver=3)
    svc = Service(f"toy_{uuid.uuid4().hex[:8]}", "1.0.0", "A toy service.", schema=KIT_SCHEMA)
    seen = Seen()
    other_session_done = asyncio.Event()
    slow, other = uuid.uuid4(), uuid.uuid4()

    @svc.subscribe(spec, per_session=True)
    async def noted(note: Note, attempt: Attempt) -> None:
        seen.started.append(note.n)
        seen.attempts.append(attempt)
        if note.n == 1:
            # Only finishes once another session's note was handled: concurrency.
            await other_session_done.wait()
            # The turn's own slow I/O, not synchronisation: 1.5 s, while note 2 waits.
            await asyncio.sleep(1.5)
        if note.session_id == other:
            other_session_done.set()
        seen.finished.append(note.n)

    await serve(svc)
    await publish(js, f"{prefix}.n.p.{slow}", Note(session_id=slow, n=1), "s-1")
    await publish(js, f"{prefix}.n.p.{slow}", Note(session_id=slow, n=2), "s-2")
    await publish(js, f"{prefix}.n.p.{other}", Note(session_id=other, n=3), "o-1")

    await wait_for(lambda: settled(js, spec, 3), what="every note acked", timeout=20)
    assert seen.finished == [3, 1, 2]
    assert seen.started == [1, 3, 2]
    assert [a.number for a in seen.attempts] == [1, 1, 1], "a held note was redelivered"
    info = await js.consumer_info(spec.stream, spec.durable)
    assert info.num_redelivered == 0


def test_the_session_of_an_event_is_the_last_token_of_its_subject() -> None:
    @dataclass
    class FakeMsg:
        subject: str

    msg = FakeMsg("chat.message.proj-1.6f1c")
    assert session_of_subject(msg) == "6f1c"  # type: ignore[arg-type]


def test_a_spec_made_from_settings_is_made_when_served() -> None:
    svc = Service("toy", "1.0.0", "A toy service.", schema=KIT_SCHEMA)

    def spec_of(settings: ServiceSettings) -> ConsumerSpec:
        return ConsumerSpec("toy-durable", "S", ["a.>"], batch=settings.outbox_batch)

    @svc.subscribe(spec_of)
    async def noted(note: Note) -> None:
        return None

    made = svc.subscriptions[0].spec_for(ServiceSettings(outbox_batch=7))
    assert (made.durable, made.batch) == ("toy-durable", 7)
    assert svc.subscriptions[0].model is Note


def test_a_handler_whose_message_is_not_a_model_is_refused_when_declared() -> None:
    svc = Service("toy", "1.0.0", "A toy service.", schema=KIT_SCHEMA)

    async def untyped(cmd: dict[str, int]) -> Sum:
        return Sum(total=0)

    try:
        svc.command("cmd.toy.untyped")(untyped)
    except TypeError as exc:
        assert "first parameter" in str(exc)
    else:
        raise AssertionError("declared a command without a request model")
    svc.command("cmd.toy.untyped", Add)(untyped)  # named in the decorator: fine
    assert [(c.subject, c.request) for c in svc.commands] == [("cmd.toy.untyped", Add)]


def test_a_handler_not_matching_its_catalog_command_is_refused_when_declared() -> None:
    svc = Service("session_events", "1.0.0", "A toy log.", schema=KIT_SCHEMA)

    async def get_session(cmd: SessionRef) -> SessionView:
        raise NotImplementedError

    async def list_sessions(cmd: ListSessions) -> SessionsReply:
        raise NotImplementedError

    async def unannotated(cmd, repo):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    with pytest.raises(TypeError) as wrong_request:
        svc.command(catalog.SESSIONS_LIST)(get_session)
    assert str(wrong_request.value).startswith("cmd.sessions.list: ")
    assert str(wrong_request.value).endswith(
        ".get_session does not match the catalog: "
        "request expected ListSessions, found SessionRef; "
        "reply expected SessionsReply, found SessionView"
    )
    with pytest.raises(TypeError) as wrong_reply:
        svc.command(catalog.SESSIONS_HEARTBEAT)(get_session)
    assert str(wrong_reply.value).endswith(
        ".get_session does not match the catalog: reply expected HeartbeatReply, found SessionView"
    )
    with pytest.raises(TypeError) as untyped:
        svc.command(catalog.SESSIONS_GET)(unannotated)
    assert "request expected SessionRef, found no annotation" in str(untyped.value)
    with pytest.raises(TypeError) as elsewhere:
        svc.command(catalog.HANDOFFS_LIST)(list_sessions)
    assert str(elsewhere.value) == (
        "cmd.handoffs.list is served by handoff in the catalog, not by session_events"
    )
    assert svc.commands == []

    svc.command(catalog.SESSIONS_GET)(get_session)
    svc.command(catalog.SESSIONS_LIST)(list_sessions)
    assert [(c.subject, c.request) for c in svc.commands] == [
        ("cmd.sessions.get", SessionRef),
        ("cmd.sessions.list", ListSessions),
    ]


def test_held_messages_are_reported_in_progress_well_within_backoff_and_ack_wait() -> None:
    spec = ConsumerSpec("d", "S", ["a.>"], backoff=[3.0, 10.0])
    assert spec.keep_alive_interval == 1.0
    # AckWait is what the server keeps: the first step of the BackOff, whatever is asked.
    assert spec.config().ack_wait == 3.0
    assert ConsumerSpec("d", "S", ["a.>"], backoff=[3.0], ack_wait=0.6).config().ack_wait == 3.0
    # Without a BackOff, the one asked for, or the server's default.
    assert ConsumerSpec("d", "S", ["a.>"], backoff=[], ack_wait=0.6).keep_alive_interval == (
        pytest.approx(0.2)
    )
    assert ConsumerSpec("d", "S", ["a.>"], backoff=[]).config().ack_wait is None
    assert ConsumerSpec("d", "S", ["a.>"], backoff=[]).keep_alive_interval == 10.0
    # Given a least redelivery time, the server's schedule and the reports follow it; a
    # nak's delay still follows the backoff.
    patient = replace(spec, redeliver_held_after=6.0)
    assert patient.config().backoff == [6.0, 10.0]
    assert patient.keep_alive_interval == 2.0
    assert patient.delay_after(1) == 3.0


async def test_workers_pull_the_same_durable_side_by_side(
    js: JetStreamContext, stream: tuple[str, str], serve: Serve
) -> None:
    _, prefix = stream
    spec = spec_for(stream, batch=1, workers=2)
    svc = Service(f"toy_{uuid.uuid4().hex[:8]}", "1.0.0", "A toy service.", schema=KIT_SCHEMA)
    holding: list[int] = []
    both = asyncio.Event()

    @svc.subscribe(spec)
    async def noted(note: Note) -> None:
        holding.append(note.n)
        if len(holding) == 2:
            both.set()
        await both.wait()  # only two pullers at once can get past this

    await serve(svc)
    for n in (1, 2):
        session = uuid.uuid4()
        await publish(js, f"{prefix}.n.p.{session}", Note(session_id=session, n=n), f"w-{n}")

    await wait_for(lambda: settled(js, spec, 2), what="both notes acked")
    assert sorted(holding) == [1, 2]


async def test_a_service_with_no_schema_runs_on_the_bus_alone(nats_url: str, nc: Client) -> None:
    """What the gateway is: no Postgres opened, nor needed; still found by `$SRV.PING`."""
    version = f"0.0.{uuid.uuid4().int % 10_000}"
    svc = Service("gateway", version, "Keeps nothing.", schema=None)
    # Nobody listens there: opening the service must not try it.
    nowhere = "postgresql://nobody@127.0.0.1:9/nothing"
    async with svc.open(ServiceSettings(nats_url=nats_url, database_url=nowhere)) as rt:
        with pytest.raises(RuntimeError, match="no database pool"):
            _ = rt.pool
        serving = asyncio.create_task(svc.serve(rt))

        async def announced() -> bool:
            try:
                reply = await nc.request("$SRV.PING.gateway", b"", timeout=0.5)
            except Exception:
                return False
            return bool(json.loads(reply.data).get("version") == version)

        await wait_for(announced, what="the store-less service answering $SRV.PING")
        # Ready without a database: there is none to wait for.
        assert rt.metrics is not None
        async with httpx.AsyncClient(timeout=5) as http:
            ready = await http.get(f"{rt.metrics.url}/readyz")
        assert ready.status_code == 200, ready.text
        assert "postgres" not in ready.text
        await stop(serving)
