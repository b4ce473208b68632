"""Command endpoints and `client.call` over a real NATS server, with a toy service."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.errors import MaxPayloadError, NoRespondersError
from nats.micro.service import Service
from pydantic import Field

from contracts.common import ErrorCode, Int64, JsonObject, Message, Text
from domain.errors import DomainError
from servicekit.client import CommandFailed, call, parse_reply
from servicekit.endpoint import MAX_REQUEST_BYTES, Endpoints
from servicekit.endpoint import Command as EndpointCommand
from testkit.probes import wait_for


class Add(Message):
    """Add two numbers."""

    a: int
    b: int


class Sum(Message):
    """The total."""

    total: int


@dataclass
class Toy:
    """A service of four commands, counting what its handlers do."""

    name: str
    handled: int = 0
    running: int = 0
    most_running: int = 0

    def subject(self, verb: str) -> str:
        return f"cmd.{self.name}.{verb}"

    def endpoints(self) -> Endpoints:
        endpoints = Endpoints(self.name, "1.2.3", "A toy service for servicekit's tests.")

        @endpoints.command(self.subject("add"), Add)
        async def add(request: Add) -> Sum:
            self.handled += 1
            return Sum(total=request.a + request.b)

        @endpoints.command(self.subject("refuse"), Add)
        async def refuse(request: Add) -> Sum:
            raise DomainError("too_big", f"{request.a} is more than a toy adds", limit=10)

        @endpoints.command(self.subject("crash"), Add)
        async def crash(request: Add) -> Sum:
            raise KeyError("secret-internal-detail")

        @endpoints.command(self.subject("store_down"), Add)
        async def store_down(request: Add) -> Sum:
            raise ConnectionRefusedError("the database is not there")

        @endpoints.command(self.subject("dependency_gone"), Add)
        async def dependency_gone(request: Add) -> Sum:
            raise NoRespondersError  # what asking a service nobody runs raises

        @endpoints.command(self.subject("dependency_unavailable"), Add)
        async def dependency_unavailable(request: Add) -> Sum:
            raise CommandFailed(ErrorCode.UNAVAILABLE, "its database is away")

        @endpoints.command(self.subject("slow"), Add)
        async def slow(request: Add) -> Sum:
            self.running += 1
            self.most_running = max(self.most_running, self.running)
            try:
                await asyncio.sleep(0.05)  # the handler's own I/O, not synchronisation
            finally:
                self.running -= 1
            return Sum(total=request.a + request.b)

        return endpoints


# Starts a Toy on a connection of its own: start(toy=None, concurrency=256, instance="").
StartToy = Callable[..., Awaitable[Toy]]


@pytest_asyncio.fixture(loop_scope="session")
async def start_toy(nats_url: str) -> AsyncIterator[StartToy]:
    running: list[tuple[Client, Service, Endpoints]] = []

    async def start(toy: Toy | None = None, concurrency: int = 256, instance: str = "") -> Toy:
        toy = toy or Toy(f"toy_{uuid.uuid4().hex[:8]}")
        server_nc = await nats.connect(nats_url)
        endpoints = toy.endpoints()
        service = await endpoints.start(server_nc, concurrency=concurrency, instance=instance)
        # Subscribed at the server before anyone calls: `flush()` is no barrier (nats-py
        # writes its PING ahead of the SUBs still queued), a request on this connection is.
        await server_nc.request(f"$SRV.PING.{toy.name}.{service.id}", b"", timeout=5)
        running.append((server_nc, service, endpoints))
        return toy

    yield start
    for server_nc, service, endpoints in running:
        await service.stop()
        await endpoints.drain()
        await server_nc.close()


async def refused(nc: Client, subject: str, data: bytes) -> CommandFailed:
    """The error reply to a raw request (which must be refused)."""
    msg = await nc.request(subject, data, timeout=5)
    with pytest.raises(CommandFailed) as refusal:
        parse_reply(msg.data, Sum)
    return refusal.value


async def test_a_valid_request_gets_the_reply_model(nc: Client, start_toy: StartToy) -> None:
    toy = await start_toy()

    assert await call(nc, toy.subject("add"), Add(a=2, b=3), Sum) == Sum(total=5)


@pytest.mark.parametrize("data", [b"{not json", b"", b'{"a": 1,', b"\xff\xfe"])
async def test_malformed_json_gets_malformed_json(
    nc: Client, start_toy: StartToy, data: bytes
) -> None:
    toy = await start_toy()

    refusal = await refused(nc, toy.subject("add"), data)

    assert refusal.code == ErrorCode.MALFORMED_JSON
    assert refusal.message.startswith("request is not valid JSON")
    assert toy.handled == 0


@pytest.mark.parametrize(
    ("request_", "problems"),
    [
        ({"a": "two"}, [(["a"], "int_parsing"), (["b"], "missing")]),
        ({"a": 1, "b": 2, "c": 3}, [(["c"], "extra_forbidden")]),
        ([1, 2], [([], "model_type")]),
    ],
    ids=["wrong-type-and-missing", "unknown-field", "not-an-object"],
)
async def test_a_request_of_the_wrong_shape_gets_invalid_request_with_every_error(
    nc: Client, start_toy: StartToy, request_: Any, problems: list[tuple[list[str], str]]
) -> None:
    toy = await start_toy()

    refusal = await refused(nc, toy.subject("add"), json.dumps(request_).encode())

    assert refusal.code == ErrorCode.INVALID_REQUEST
    assert [(e["loc"], e["type"]) for e in refusal.details["errors"]] == problems
    assert all(e["msg"] for e in refusal.details["errors"])
    # the message names each field, so a model reading it can correct its call
    for loc, _ in problems:
        assert ".".join(loc) in refusal.message
    assert toy.handled == 0


async def test_a_domain_refusal_keeps_its_code_message_and_details(
    nc: Client, start_toy: StartToy
) -> None:
    toy = await start_toy()

    with pytest.raises(CommandFailed) as refusal:
        await call(nc, toy.subject("refuse"), Add(a=11, b=0), Sum)

    assert refusal.value.code == "too_big"
    assert refusal.value.message == "11 is more than a toy adds"
    assert refusal.value.details == {"limit": 10}


async def test_an_unexpected_exception_is_internal_and_the_service_answers_on(
    nc: Client, start_toy: StartToy
) -> None:
    toy = await start_toy()

    with pytest.raises(CommandFailed) as refusal:
        await call(nc, toy.subject("crash"), Add(a=1, b=1), Sum)

    assert refusal.value.code == ErrorCode.INTERNAL
    assert refusal.value.message == "internal error: KeyError"
    assert "secret" not in str(refusal.value)  # internals stay in the log
    assert await call(nc, toy.subject("add"), Add(a=1, b=1), Sum) == Sum(total=2)


async def test_a_store_or_bus_failure_is_unavailable_so_the_caller_may_retry(
    nc: Client, start_toy: StartToy
) -> None:
    toy = await start_toy()

    with pytest.raises(CommandFailed) as refusal:
        await call(nc, toy.subject("store_down"), Add(a=1, b=1), Sum)

    assert refusal.value.code == ErrorCode.UNAVAILABLE
    assert refusal.value.message.startswith("temporarily unavailable, retry")


@pytest.mark.parametrize("verb", ["dependency_gone", "dependency_unavailable"])
async def test_a_service_the_handler_asked_being_away_is_unavailable_not_internal(
    nc: Client, start_toy: StartToy, verb: str
) -> None:
    """Its patience ran out (`servicekit.patience`): the same request may succeed once the
    dependency is back, so the caller is told to retry, not that its request failed."""
    toy = await start_toy()

    with pytest.raises(CommandFailed) as refusal:
        await call(nc, toy.subject(verb), Add(a=1, b=1), Sum)

    assert refusal.value.code == ErrorCode.UNAVAILABLE
    assert refusal.value.message.startswith("temporarily unavailable, retry")


async def test_a_request_over_the_size_limit_is_refused_before_parsing(
    nc: Client, start_toy: StartToy
) -> None:
    toy = await start_toy()
    too_big = b"{" + b" " * (MAX_REQUEST_BYTES - 1) + b"}"  # valid JSON, one byte too many

    if nc.max_payload < len(too_big):  # a server of smaller limits refuses it first
        with pytest.raises(MaxPayloadError):
            await nc.request(toy.subject("add"), too_big, timeout=5)
        return
    refusal = await refused(nc, toy.subject("add"), too_big)

    assert refusal.code == ErrorCode.PAYLOAD_TOO_LARGE
    assert refusal.details == {
        "size_bytes": MAX_REQUEST_BYTES + 1,
        "limit_bytes": MAX_REQUEST_BYTES,
    }
    # at the limit exactly, the request is parsed (and found wanting)
    at_limit = await refused(nc, toy.subject("add"), too_big[:1] + too_big[2:])
    assert at_limit.code == ErrorCode.INVALID_REQUEST


async def test_the_service_answers_the_micro_discovery_requests(
    nc: Client, start_toy: StartToy
) -> None:
    toy = await start_toy(instance="replica-a")
    for n in range(3):
        await call(nc, toy.subject("add"), Add(a=n, b=n), Sum)

    ping = json.loads((await nc.request(f"$SRV.PING.{toy.name}", b"", timeout=5)).data)
    info = json.loads((await nc.request(f"$SRV.INFO.{toy.name}", b"", timeout=5)).data)
    stats = json.loads((await nc.request(f"$SRV.STATS.{toy.name}", b"", timeout=5)).data)

    assert (ping["type"], ping["name"], ping["version"]) == (
        "io.nats.micro.v1.ping_response",
        toy.name,
        "1.2.3",
    )
    assert ping["metadata"]["instance"] == "replica-a"
    assert info["description"] == "A toy service for servicekit's tests."
    assert {e["subject"] for e in info["endpoints"]} == {
        toy.subject(verb)
        for verb in (
            "add",
            "refuse",
            "crash",
            "store_down",
            "dependency_gone",
            "dependency_unavailable",
            "slow",
        )
    }
    add_info = next(e for e in info["endpoints"] if e["subject"] == toy.subject("add"))
    assert add_info["queue_group"] == toy.name  # replicas share the load
    assert add_info["metadata"] == {"request": "Add"}
    add_stats = next(e for e in stats["endpoints"] if e["subject"] == toy.subject("add"))
    assert add_stats["num_requests"] == 3


async def test_requests_are_handled_concurrently(nc: Client, start_toy: StartToy) -> None:
    toy = await start_toy()

    replies = await asyncio.gather(
        *(call(nc, toy.subject("slow"), Add(a=n, b=1), Sum) for n in range(50))
    )

    assert [r.total for r in replies] == [n + 1 for n in range(50)]
    assert toy.most_running > 1, "each request waited for the one before it"


async def test_concurrency_is_bounded_by_the_limit_given(nc: Client, start_toy: StartToy) -> None:
    toy = await start_toy(concurrency=4)

    replies = await asyncio.gather(
        *(call(nc, toy.subject("slow"), Add(a=n, b=1), Sum) for n in range(30))
    )

    assert [r.total for r in replies] == [n + 1 for n in range(30)]
    assert 1 < toy.most_running <= 4


async def test_replicas_in_the_queue_group_answer_each_request_once(
    nc: Client, start_toy: StartToy
) -> None:
    first = await start_toy(instance="a")
    second = await start_toy(Toy(first.name), instance="b")

    replies = await asyncio.gather(
        *(call(nc, first.subject("add"), Add(a=n, b=0), Sum) for n in range(40))
    )

    assert [r.total for r in replies] == list(range(40))
    assert first.handled + second.handled == 40
    assert first.handled > 0 and second.handled > 0


async def test_a_request_without_a_reply_subject_is_handled_without_harm(
    nc: Client, start_toy: StartToy
) -> None:
    toy = await start_toy()

    await nc.publish(toy.subject("add"), Add(a=1, b=2).model_dump_json().encode())
    await wait_for(lambda: toy.handled == 1, what="the fire-and-forget request handled")

    assert await call(nc, toy.subject("add"), Add(a=1, b=2), Sum) == Sum(total=3)


class Note(Message):
    """A request with the storable types of `contracts.common`."""

    text: Text
    count: Int64 = 0
    extra: JsonObject = Field(default_factory=dict)


def _note_endpoints(handled: list[Note]) -> tuple[Endpoints, EndpointCommand]:
    endpoints = Endpoints("notes", "1.0.0", "A toy service of storable types.")

    @endpoints.command("cmd.notes.add", Note)
    async def add(request: Note) -> Sum:
        handled.append(request)
        return Sum(total=request.count)

    return endpoints, endpoints.commands[0]


@pytest.mark.parametrize(
    ("data", "field", "words"),
    [
        (b'{"text": "a\\u0000b"}', "text", "NUL"),
        (b'{"text": "ok", "count": 9223372036854775808}', "count", "64-bit"),
        (b'{"text": "ok", "count": -9223372036854775809}', "count", "64-bit"),
        (b'{"text": "ok", "extra": {"deep": ["x\\u0000"]}}', "extra", "deep[0]: must not contain"),
        (b'{"text": "ok", "extra": {"n": 18446744073709551616}}', "extra", "n: must be between"),
    ],
    ids=["nul", "int64-over", "int64-under", "nul-in-free-json", "int64-in-free-json"],
)
async def test_values_the_store_cannot_keep_are_invalid_requests_naming_the_field(
    data: bytes, field: str, words: str
) -> None:
    handled: list[Note] = []
    endpoints, command = _note_endpoints(handled)

    reply = json.loads(await endpoints.handle_raw(command, data))

    assert reply["error"]["code"] == ErrorCode.INVALID_REQUEST
    assert f"{field}:" in reply["error"]["message"]
    assert words in reply["error"]["message"]
    assert handled == []


@pytest.mark.parametrize(
    "data",
    [
        b'{"text": "a\\ud800b"}',
        b'{"text": "ok", "extra": ' + b'{"x": ' * 10_000 + b"1" + b"}" * 10_001,
        b'{"text": "ok", "extra": {"l": ' + b"[" * 10_000 + b"]" * 10_000 + b"}}",
        b'{"text": "ok", "count": ' + b"9" * 5000 + b"}",
    ],
    ids=["lone-surrogate", "10000-deep-objects", "10000-deep-arrays", "5000-digit-number"],
)
async def test_json_the_parser_cannot_take_is_malformed_json_not_a_crash(data: bytes) -> None:
    handled: list[Note] = []
    endpoints, command = _note_endpoints(handled)

    reply = json.loads(await endpoints.handle_raw(command, data))

    assert reply["error"]["code"] == ErrorCode.MALFORMED_JSON
    assert handled == []
