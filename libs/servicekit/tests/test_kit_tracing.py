"""Trace context carried in NATS headers: commands, outbox messages, consumed messages;
the spans' kinds and messaging attributes; the trace ids on log lines."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any

import asyncpg
import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from contracts.common import Message
from servicekit.client import call
from servicekit.consumer import ConsumerSpec, DurableConsumer
from servicekit.endpoint import Endpoints
from servicekit.logs import add_trace_ids
from servicekit.outbox import JetStreamPublisher, Outbox, OutboxRelay
from servicekit.telemetry import current_trace, inject_headers, within
from testkit.probes import stream_messages, wait_for
from testkit.spans import recorded_spans

Background = Callable[[Coroutine[Any, Any, None]], "asyncio.Task[None]"]


class Echo(Message):
    """Say something back."""

    text: str


@pytest.fixture(scope="module")
def exporter() -> Iterator[InMemorySpanExporter]:
    yield from recorded_spans()


@pytest.fixture
def spans(exporter: InMemorySpanExporter) -> InMemorySpanExporter:
    exporter.clear()
    return exporter


def finished(spans: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in spans.get_finished_spans() if s.name == name]


def traceparent_of(context: trace.SpanContext) -> str:
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def span_id(span: trace.Span) -> int:
    return span.get_span_context().span_id


tracer = trace.get_tracer("servicekit-tests")


@pytest_asyncio.fixture(loop_scope="session")
async def echo_subject(nats_url: str) -> AsyncIterator[str]:
    """An echo service on a connection of its own; yields the command's subject."""
    name = f"echo_{uuid.uuid4().hex[:8]}"
    subject = f"cmd.{name}.say"
    endpoints = Endpoints(name, "0.0.1", "echo")

    @endpoints.command(subject, Echo)
    async def say(request: Echo) -> Echo:
        return request

    server_nc = await nats.connect(nats_url)
    service = await endpoints.start(server_nc)
    await server_nc.request(f"$SRV.PING.{name}.{service.id}", b"", timeout=5)  # subscribed
    yield subject
    await service.stop()
    await server_nc.close()


async def test_a_command_continues_the_trace_of_its_caller(
    nc: Client, echo_subject: str, spans: InMemorySpanExporter
) -> None:
    with tracer.start_as_current_span("caller") as caller:
        assert await call(nc, echo_subject, Echo(text="hi"), Echo) == Echo(text="hi")

    [server] = await wait_for(lambda: finished(spans, echo_subject), what="the server span")
    [client] = finished(spans, f"send {echo_subject}")
    assert client.kind is SpanKind.CLIENT and server.kind is SpanKind.SERVER
    assert client.parent is not None and client.parent.span_id == span_id(caller)
    assert server.context is not None and server.parent is not None
    assert server.context.trace_id == caller.get_span_context().trace_id
    assert server.parent.span_id == client.context.span_id
    assert server.parent.is_remote  # it came over the wire, in the headers
    for span, operation in ((client, "send"), (server, "process")):
        assert span.attributes is not None
        assert span.attributes["messaging.system"] == "nats"
        assert span.attributes["messaging.destination.name"] == echo_subject
        assert span.attributes["messaging.operation.type"] == operation


async def test_an_error_reply_marks_the_server_span(
    nc: Client, echo_subject: str, spans: InMemorySpanExporter
) -> None:
    reply = await nc.request(echo_subject, b"not json", timeout=5)
    assert reply.data.startswith(b'{"error":')

    [server] = await wait_for(lambda: finished(spans, echo_subject), what="the server span")
    assert server.status.status_code is StatusCode.ERROR
    assert server.attributes is not None
    assert server.attributes["error.type"] == "malformed_json"


async def test_a_command_called_outside_any_trace_starts_its_own(
    nc: Client, echo_subject: str, spans: InMemorySpanExporter
) -> None:
    await call(nc, echo_subject, Echo(text="hi"), Echo)

    [server] = await wait_for(lambda: finished(spans, echo_subject), what="the server span")
    [client] = finished(spans, f"send {echo_subject}")
    assert client.parent is None  # the request is the root of its trace
    assert server.parent is not None and client.context is not None
    assert server.parent.span_id == client.context.span_id


async def test_an_outbox_message_carries_the_trace_of_the_transaction_that_wrote_it(
    pool: asyncpg.Pool,
    js: JetStreamContext,
    nc: Client,
    stream: tuple[str, str],
    spans: InMemorySpanExporter,
) -> None:
    name, prefix = stream
    with tracer.start_as_current_span("append") as writer:
        async with pool.acquire() as conn, conn.transaction():
            await Outbox(conn).send(f"{prefix}.a", "traced", b"{}")
    async with pool.acquire() as conn, conn.transaction():
        await Outbox(conn).send(f"{prefix}.a", "untraced", b"{}")

    # published later, by a relay outside any span: the context travelled in the row
    await OutboxRelay(pool, JetStreamPublisher(nc)).drain_once()

    traced, untraced = await stream_messages(nc, name, f"{prefix}.>")
    assert traced.headers is not None and untraced.headers is not None
    [publish] = finished(spans, f"publish {prefix}.a")
    assert publish.kind is SpanKind.PRODUCER
    assert publish.parent is not None and publish.parent.span_id == span_id(writer)
    assert publish.context is not None
    assert publish.context.trace_id == writer.get_span_context().trace_id
    assert publish.attributes is not None
    assert publish.attributes["messaging.message.id"] == "traced"
    # the message carries the publish's context, in the writer's trace
    assert traced.headers["traceparent"] == traceparent_of(publish.context)
    # a row written outside any trace is published with none (no span, no new trace)
    assert "traceparent" not in untraced.headers


async def test_a_consumer_handles_a_message_inside_the_trace_that_published_it(
    nc: Client,
    js: JetStreamContext,
    pool: asyncpg.Pool,
    stream: tuple[str, str],
    background: Background,
    spans: InMemorySpanExporter,
) -> None:
    name, prefix = stream
    spec = ConsumerSpec(
        durable=f"c{uuid.uuid4().hex[:8]}", stream=name, filter_subjects=[f"{prefix}.>"]
    )
    seen: list[int] = []

    async def handler(msg: Msg) -> None:
        seen.append(trace.get_current_span().get_span_context().trace_id)

    background(DurableConsumer(nc, js, pool, spec, handler).run())
    with tracer.start_as_current_span("publisher") as publisher:
        await js.publish(f"{prefix}.a", b"{}", headers=inject_headers({"Nats-Msg-Id": "m-1"}))

    [consumed] = await wait_for(
        lambda: finished(spans, f"process {prefix}.a"), what="the consumer span"
    )
    assert seen == [publisher.get_span_context().trace_id]
    assert consumed.kind is SpanKind.CONSUMER
    assert consumed.parent is not None
    assert consumed.parent.span_id == span_id(publisher)
    assert consumed.attributes is not None
    assert consumed.attributes["messaging.destination.name"] == f"{prefix}.a"
    assert consumed.attributes["messaging.consumer.group.name"] == spec.durable
    assert consumed.attributes["messaging.message.id"] == "m-1"
    assert consumed.attributes["messaging.operation.type"] == "process"


def test_a_log_line_carries_the_current_trace_and_span(spans: InMemorySpanExporter) -> None:
    with tracer.start_as_current_span("work") as work:
        line = add_trace_ids(None, "info", {"event": "something_happened"})
    assert line["trace_id"] == f"{work.get_span_context().trace_id:032x}"
    assert line["span_id"] == f"{span_id(work):016x}"
    assert "trace_id" not in add_trace_ids(None, "info", {"event": "outside_any_trace"})


def test_a_task_continues_the_trace_of_the_work_handed_to_it(
    spans: InMemorySpanExporter,
) -> None:
    with tracer.start_as_current_span("poster") as poster:
        carried = current_trace()
    with tracer.start_as_current_span("the task's own"), within(carried):
        assert trace.get_current_span().get_span_context().span_id == span_id(poster)
