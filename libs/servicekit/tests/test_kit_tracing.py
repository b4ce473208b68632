"""Trace context carried in NATS headers: commands, outbox messages, consumed messages."""

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
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from contracts.common import Message
from servicekit.client import call
from servicekit.consumer import ConsumerSpec, DurableConsumer
from servicekit.endpoint import Endpoints
from servicekit.outbox import JetStreamPublisher, Outbox, OutboxRelay
from servicekit.telemetry import inject_headers
from servicekit.testing import stream_messages, wait_for

Background = Callable[[Coroutine[Any, Any, None]], "asyncio.Task[None]"]


class Echo(Message):
    """Say something back."""

    text: str


@pytest.fixture(scope="module")
def exporter() -> Iterator[InMemorySpanExporter]:
    """Spans recorded in memory, through the process's one tracer provider.

    OpenTelemetry lets the global provider be set once per process, so it is set here
    only if nothing set an SDK provider before; the processor is shut down afterwards,
    which leaves later tests' spans unrecorded.
    """
    memory = InMemorySpanExporter()
    processor = SimpleSpanProcessor(memory)
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(processor)
    yield memory
    processor.shutdown()


@pytest.fixture
def spans(exporter: InMemorySpanExporter) -> InMemorySpanExporter:
    exporter.clear()
    return exporter


def finished(spans: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in spans.get_finished_spans() if s.name == name]


def traceparent(span: trace.Span) -> str:
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


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
    assert server.context is not None and server.parent is not None
    assert server.context.trace_id == caller.get_span_context().trace_id
    assert server.parent.span_id == caller.get_span_context().span_id
    assert server.parent.is_remote  # it came over the wire, in the headers


async def test_a_command_called_outside_any_trace_starts_its_own(
    nc: Client, echo_subject: str, spans: InMemorySpanExporter
) -> None:
    await call(nc, echo_subject, Echo(text="hi"), Echo)

    [server] = await wait_for(lambda: finished(spans, echo_subject), what="the server span")
    assert server.parent is None


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
    await OutboxRelay(pool, JetStreamPublisher(js)).drain_once()

    traced, untraced = await stream_messages(nc, name, f"{prefix}.>")
    assert traced.headers is not None and untraced.headers is not None
    assert traced.headers["traceparent"] == traceparent(writer)
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
        lambda: finished(spans, f"consume {spec.durable}"), what="the consumer span"
    )
    assert seen == [publisher.get_span_context().trace_id]
    assert consumed.parent is not None
    assert consumed.parent.span_id == publisher.get_span_context().span_id
    assert consumed.attributes is not None
    assert consumed.attributes["subject"] == f"{prefix}.a"
