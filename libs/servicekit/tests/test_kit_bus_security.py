"""The secured NATS server refuses what the contracts do not grant (issue 11, item 1).

Each denial is shown twice: the server reports a permissions violation to the client,
and the effect did not happen (nothing stored, nobody received the request, the stream
is still there). Each user's real job is shown to work on the same server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import nats
import nats.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from contracts import streams, subjects
from contracts.events import EventType
from servicekit.bus import check_streams, provision_streams
from testkit.probes import subscribed, wait_for

ConnectAs = Callable[..., Awaitable[Client]]


class Violations:
    """The asynchronous errors the server sent one client."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    async def record(self, exc: Exception) -> None:
        self.errors.append(str(exc))

    async def reported(self, subject: str) -> None:
        await wait_for(
            lambda: any(
                "permissions violation" in e.lower() and subject.lower() in e.lower()
                for e in self.errors
            ),
            timeout=10,
            what=f"a permissions violation for {subject} (got {self.errors})",
        )


async def as_user(connect_as: ConnectAs, user: str) -> tuple[Client, Violations]:
    violations = Violations()
    return await connect_as(user, error_cb=violations.record), violations


async def received(nc: Client, subject: str) -> list[Msg]:
    """Messages `nc` (admin) receives on `subject` from now on."""
    got: list[Msg] = []

    async def keep(msg: Msg) -> None:
        got.append(msg)

    await nc.subscribe(subject, cb=keep)
    await subscribed(nc)
    return got


async def handshake(nats_url: str, connect: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    """The server's INFO, and its answer to a verbose CONNECT (`+OK` or `-ERR`), at the
    protocol level (nats-py leaves a refused connection's socket open). Nothing is sent
    after CONNECT, so the server's close after `-ERR` cannot reset the socket first."""
    parts = urlsplit(nats_url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        info = json.loads((await reader.readline()).removeprefix(b"INFO "))
        writer.write(b"CONNECT " + json.dumps({"verbose": True, **connect}).encode() + b"\r\n")
        await writer.drain()
        answer = await asyncio.wait_for(reader.readline(), 10)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    return info, answer


async def test_an_anonymous_client_is_refused(nats_url: str, servers: Any) -> None:
    if not servers.nats_secrets:
        pytest.skip("the NATS server of this run is not the secured embedded one")
    info, answer = await handshake(nats_url, {})

    assert info["auth_required"] is True
    assert answer.startswith(b"-ERR 'Authorization Violation'")


async def test_a_wrong_password_is_refused_and_the_right_one_accepted(
    nats_url: str, servers: Any
) -> None:
    if not servers.nats_secrets:
        pytest.skip("the NATS server of this run is not the secured embedded one")
    _, wrong = await handshake(nats_url, {"user": "gateway", "pass": "guess"})
    _, right = await handshake(
        nats_url, {"user": "gateway", "pass": servers.nats_secrets["gateway"]}
    )

    assert wrong.startswith(b"-ERR 'Authorization Violation'")
    assert right == b"+OK\r\n"


async def test_the_gateway_cannot_publish_a_session_closing(
    connect_as: ConnectAs, nc: Client
) -> None:
    gateway, violations = await as_user(connect_as, "gateway")
    closing = subjects.event_subject(EventType.SESSION_CLOSED, "bakery", uuid.uuid4())
    seen = await received(nc, closing)

    await gateway.publish(closing, b"{}")
    await gateway.flush()

    await violations.reported(closing)
    info = await nc.jetstream().stream_info(streams.EVENTS.name, subjects_filter=closing)
    assert info.state.messages == 0
    assert seen == []


async def test_the_gateway_cannot_start_a_paid_turn(connect_as: ConnectAs, nc: Client) -> None:
    gateway, violations = await as_user(connect_as, "gateway")
    # a stand-in metering, to show the request never reaches it
    requests = await received(nc, subjects.LLM_STREAM)

    with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
        await gateway.request(subjects.LLM_STREAM, b"{}", timeout=1)

    await violations.reported(subjects.LLM_STREAM)
    assert requests == []


async def test_the_gateway_may_cancel_a_turn(connect_as: ConnectAs, nc: Client) -> None:
    gateway, violations = await as_user(connect_as, "gateway")

    async def answer(msg: Msg) -> None:
        await msg.respond(b'{"cancelled": true}')

    await nc.subscribe(subjects.LLM_CANCEL, cb=answer)
    await subscribed(nc)

    reply = await gateway.request(subjects.LLM_CANCEL, b"{}", timeout=5)

    assert reply.data == b'{"cancelled": true}'
    assert violations.errors == []


async def test_a_service_cannot_call_a_command_outside_its_list(
    connect_as: ConnectAs, nc: Client
) -> None:
    criativo, violations = await as_user(connect_as, "criativo")
    requests = await received(nc, subjects.BINDINGS_SET)

    with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
        await criativo.request(subjects.BINDINGS_SET, b"{}", timeout=1)

    await violations.reported(subjects.BINDINGS_SET)
    assert requests == []


async def test_a_service_cannot_serve_another_services_command(connect_as: ConnectAs) -> None:
    gateway, violations = await as_user(connect_as, "gateway")

    await gateway.subscribe(subjects.LLM_TURN, queue="metering")
    await gateway.flush()

    await violations.reported(subjects.LLM_TURN)


# nats-server's own grant for `allow_responses: true` ends 2 minutes after the request.
SERVERS_DEFAULT_GRANT_SECONDS = 120


async def test_a_model_turn_longer_than_the_servers_default_grant_is_answered(
    connect_as: ConnectAs,
) -> None:
    """A turn whose model writes for more than 2 minutes: metering's reply reaches the
    caller. Under the server's default grant it was refused as a permissions violation,
    and the caller waited on for an answer metering had billed and stored."""
    metering, metering_violations = await as_user(connect_as, "metering")
    criativo, _ = await as_user(connect_as, "criativo")

    async def answer_late(msg: Msg) -> None:
        await asyncio.sleep(SERVERS_DEFAULT_GRANT_SECONDS + 2)
        await msg.respond(b'{"stop_reason": "end_turn"}')

    await metering.subscribe(subjects.LLM_STREAM, queue="metering", cb=answer_late)
    await subscribed(metering)

    reply = await criativo.request(
        subjects.LLM_STREAM, b"{}", timeout=SERVERS_DEFAULT_GRANT_SECONDS + 30
    )

    assert reply.data == b'{"stop_reason": "end_turn"}'
    assert metering_violations.errors == []


async def test_a_request_still_gets_one_reply_only(connect_as: ConnectAs) -> None:
    """The longer grant is to answer, once: a second reply to the same request, or a
    message to the caller's inbox no request asked for, is refused."""
    metering, violations = await as_user(connect_as, "metering")
    criativo, _ = await as_user(connect_as, "criativo")
    inbox = criativo.new_inbox()
    got = await received(criativo, inbox)

    async def answer_twice(msg: Msg) -> None:
        await msg.respond(b"first")
        await msg.respond(b"second")

    await metering.subscribe(subjects.LLM_STREAM, queue="metering", cb=answer_twice)
    await subscribed(metering)
    await criativo.publish(subjects.LLM_STREAM, b"{}", reply=inbox)
    await wait_for(lambda: got, timeout=10, what="the first reply")
    await metering.publish(f"{inbox}.unasked", b"forged")
    await metering.flush()

    await violations.reported(f"{inbox}.unasked")
    assert [m.data for m in got] == [b"first"]
    assert sum("permissions violation" in e.lower() for e in violations.errors) == 2


async def test_a_service_cannot_read_another_users_replies(connect_as: ConnectAs) -> None:
    gateway, violations = await as_user(connect_as, "gateway")

    await gateway.subscribe("_INBOX_metering.>")
    await gateway.flush()

    await violations.reported("_INBOX_metering.>")


async def test_ops_cannot_delete_or_purge_a_stream(connect_as: ConnectAs, nc: Client) -> None:
    ops, violations = await as_user(connect_as, "ops")
    js = ops.jetstream(timeout=1)

    with pytest.raises(nats.errors.TimeoutError):  # the request is dropped: no reply
        await js.delete_stream(streams.EVENTS.name)
    await violations.reported(f"$JS.API.STREAM.DELETE.{streams.EVENTS.name}")
    with pytest.raises(nats.errors.TimeoutError):
        await js.purge_stream(streams.EVENTS.name)
    await violations.reported(f"$JS.API.STREAM.PURGE.{streams.EVENTS.name}")

    assert await check_streams(nc.jetstream(), streams.ALL) == []


async def test_ops_reads_streams_consumers_and_follows_events(
    connect_as: ConnectAs, nc: Client
) -> None:
    ops, violations = await as_user(connect_as, "ops")
    closing = subjects.event_subject(EventType.SESSION_CLOSED, "bakery", uuid.uuid4())
    followed: list[Msg] = []

    async def keep(msg: Msg) -> None:
        followed.append(msg)

    await ops.subscribe("session.>", cb=keep)
    await subscribed(ops)
    await nc.jetstream().publish(closing, b"{}")

    info = await ops.jetstream().stream_info(streams.EVENTS.name)
    assert info.state.messages >= 1
    names = await ops.jetstream().streams_info()
    assert {s.config.name for s in names} >= {s.name for s in streams.ALL}
    await wait_for(lambda: followed, what="ops to follow the closing")
    assert violations.errors == []


async def test_only_provision_creates_and_deletes_streams(
    connect_as: ConnectAs, nc: Client
) -> None:
    provision, _ = await as_user(connect_as, "provision")
    session_log, violations = await as_user(connect_as, "session_events")

    with pytest.raises(nats.errors.TimeoutError):
        await session_log.jetstream(timeout=1).delete_stream(streams.DELTAS.name)
    await violations.reported(f"$JS.API.STREAM.DELETE.{streams.DELTAS.name}")

    assert await provision.jetstream().delete_stream(streams.DELTAS.name)
    assert await check_streams(nc.jetstream(), [streams.DELTAS]) == ["DELTAS: missing"]
    await provision_streams(provision.jetstream(), streams.ALL)
    assert await check_streams(nc.jetstream(), streams.ALL) == []


async def test_the_log_publishes_events_and_metering_deltas(
    connect_as: ConnectAs, nc: Client
) -> None:
    session_log, log_violations = await as_user(connect_as, "session_events")
    metering, metering_violations = await as_user(connect_as, "metering")
    session = uuid.uuid4()
    event = subjects.event_subject(EventType.CHAT_MESSAGE, "bakery", session)

    ack = await session_log.jetstream().publish(event, b"{}", headers={"Nats-Msg-Id": "e1"})
    await metering.publish(subjects.delta_subject("bakery", session), b"{}")
    await metering.flush()

    assert ack.stream == streams.EVENTS.name

    async def deltas_stored() -> int:
        delta = subjects.delta_subject("bakery", session)
        info = await nc.jetstream().stream_info(streams.DELTAS.name, subjects_filter=delta)
        return sum((info.state.subjects or {}).values())

    await wait_for(deltas_stored, what="the delta stored")
    assert log_violations.errors == [] and metering_violations.errors == []


async def test_the_system_account_sees_the_servers(servers: Any) -> None:
    if not servers.nats_secrets:
        pytest.skip("the NATS server of this run is not the secured embedded one")
    host = servers.nats_url.rsplit("@", 1)[-1]
    sys_nc = await nats.connect(
        f"nats://{host}", user="sys", password=servers.nats_secrets["sys"], allow_reconnect=False
    )
    try:
        reply = await sys_nc.request("$SYS.REQ.SERVER.PING", b"", timeout=5)
        assert b"server" in reply.data
    finally:
        await sys_nc.close()
