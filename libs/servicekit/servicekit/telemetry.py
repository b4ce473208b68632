"""OpenTelemetry tracing, its context carried in NATS headers.

The exporter comes from `OTEL_TRACES_EXPORTER`:
- unset or `none`: nothing is recorded. The spans below are OpenTelemetry's no-op spans,
  which still pass on a `traceparent` that came in, and no library is instrumented, so
  tracing costs nothing by default;
- `otlp`: OTLP over HTTP/protobuf, configured by the standard `OTEL_EXPORTER_OTLP_*`
  variables (endpoint `http://localhost:4318` by default);
- `console`: spans printed to stdout;
- `jsonl`: one JSON object per finished span appended to the file `AGENTBUS_TRACES_FILE`
  names, written as each span ends — how tests read the spans of real processes.

Spans follow the messaging semantic conventions (`messaging.system=nats`,
`messaging.destination.name`, `messaging.operation.type`): a command's caller is a CLIENT
span, its handler a SERVER span; a publish into JetStream (the outbox relay) a PRODUCER
span, a consumer's handling of a delivery a CONSUMER span. With an exporter set, asyncpg
is instrumented too, so each statement is a CLIENT span under the span that ran it.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.semconv._incubating.attributes import messaging_attributes as messaging
from opentelemetry.trace import SpanKind
from opentelemetry.util.types import AttributeValue

from servicekit.logs import get_logger

log = get_logger(__name__)

MESSAGING_SYSTEM = "nats"
# Where the `jsonl` exporter writes.
TRACES_FILE_VARIABLE = "AGENTBUS_TRACES_FILE"


def exporter_choice() -> str:
    """The exporter `OTEL_TRACES_EXPORTER` names (`none` when unset)."""
    return os.environ.get("OTEL_TRACES_EXPORTER", "none").strip().lower() or "none"


# `tracing_on()`'s answer once `configure_tracing` settled it for the process (None: not
# settled, asked of OpenTelemetry at each call). A request asks it at least twice, and
# OpenTelemetry answers by looking up an environment variable each time.
_tracing_settled: bool | None = None


def configure_tracing(service: str) -> bool:
    """Install a tracer provider whose exporter `OTEL_TRACES_EXPORTER` names, and
    instrument asyncpg; returns whether tracing is on."""
    global _tracing_settled
    _tracing_settled = _install_tracing(service)
    return _tracing_settled


def _install_tracing(service: str) -> bool:
    choice = exporter_choice()
    processor: SpanProcessor
    if choice == "none":
        # OpenTelemetry may still install a provider of its own (OTEL_PYTHON_TRACER_PROVIDER)
        return _sdk_provider()
    if choice == "console":
        processor = BatchSpanProcessor(ConsoleSpanExporter())
    elif choice == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        processor = BatchSpanProcessor(OTLPSpanExporter())
    elif choice == "jsonl":
        path = os.environ.get(TRACES_FILE_VARIABLE)
        if not path:
            log.warning("otel_exporter_unconfigured", exporter=choice, missing=TRACES_FILE_VARIABLE)
            return _sdk_provider()
        # Written as each span ends: a reader waits on the file, never on a flush timer.
        processor = SimpleSpanProcessor(JsonLinesExporter(path))
    else:
        log.warning("otel_exporter_unknown", exporter=choice)
        return _sdk_provider()
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service)})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(processor)
    trace.set_tracer_provider(provider)
    from opentelemetry.instrumentation.asyncpg import AsyncPGInstrumentor

    AsyncPGInstrumentor().instrument(tracer_provider=provider)  # type: ignore[no-untyped-call]
    return True


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """A finished span as one JSON-able record (ids in W3C hex)."""
    ctx = span.context
    parent = span.parent
    return {
        "name": span.name,
        "kind": span.kind.name,
        "service": span.resource.attributes.get("service.name"),
        "trace_id": f"{ctx.trace_id:032x}" if ctx else None,
        "span_id": f"{ctx.span_id:016x}" if ctx else None,
        "parent_span_id": f"{parent.span_id:016x}" if parent else None,
        "remote_parent": bool(parent and parent.is_remote),
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
    }


class JsonLinesExporter(SpanExporter):
    """Appends each span to a file as a JSON line: processes share no memory, but they
    can share a file (each line is written whole under a lock, in append mode)."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(span_record(s), default=str) + "\n" for s in spans)
        with self._lock, open(self._path, "a", encoding="utf-8") as out:
            out.write(lines)
        return SpanExportResult.SUCCESS


tracer = trace.get_tracer("agentbus")


def destination(subject: str) -> str:
    """A subject's low-cardinality name for span names: a command's subject whole, any
    other subject by its first two tokens (an event's type, `agent.delta`) — the ids
    after them would make every span name unique."""
    if subject.startswith("cmd."):
        return subject
    return ".".join(subject.split(".")[:2])


def messaging_attributes(
    subject: str, operation_type: str, operation_name: str, **more: AttributeValue | None
) -> dict[str, AttributeValue]:
    """The messaging semantic conventions' attributes of an operation on `subject`."""
    attributes: dict[str, AttributeValue] = {
        messaging.MESSAGING_SYSTEM: MESSAGING_SYSTEM,
        messaging.MESSAGING_DESTINATION_NAME: subject,
        messaging.MESSAGING_OPERATION_TYPE: operation_type,
        messaging.MESSAGING_OPERATION_NAME: operation_name,
    }
    attributes.update({k: v for k, v in more.items() if v is not None})
    return attributes


def inject_headers(headers: dict[str, str] | None = None) -> dict[str, str]:
    """Headers carrying the current trace context (W3C `traceparent`)."""
    carrier = dict(headers or {})
    # An empty context holds no span and no baggage: the propagators (W3C trace context
    # and baggage) would add nothing, and asking them costs a request microseconds.
    if context.get_current():
        propagate.inject(carrier)
    return carrier


@contextmanager
def span_from_headers(
    name: str,
    headers: Mapping[str, str] | None,
    kind: SpanKind = SpanKind.INTERNAL,
    **attributes: AttributeValue,
) -> Iterator[trace.Span]:
    """A span that continues the trace whose context came in `headers`."""
    parent = propagate.extract(dict(headers or {}))
    token = context.attach(parent)
    try:
        with tracer.start_as_current_span(name, kind=kind, attributes=attributes) as span:
            yield span
    finally:
        context.detach(token)


@contextmanager
def handling_span(
    name: str,
    headers: Mapping[str, str] | None,
    kind: SpanKind,
    subject: str,
    **more: AttributeValue | None,
) -> Iterator[trace.Span]:
    """A SERVER or CONSUMER span around handling a message that came with `headers`.

    With tracing off, the context that came in is made current and nothing else is done
    (no span, no attributes): what the handler sends and logs still carries the trace.
    """
    if not tracing_on():
        # No headers carry no trace: what they would extract to is an empty context.
        came = propagate.extract(dict(headers)) if headers else context.Context()
        token = context.attach(came)
        try:
            yield trace.get_current_span()
        finally:
            context.detach(token)
        return
    attributes = messaging_attributes(subject, "process", "process", **more)
    with span_from_headers(name, headers, kind, **attributes) as span:
        yield span


@contextmanager
def request_span(
    subject: str, carried: Mapping[str, str] | None = None
) -> Iterator[dict[str, str]]:
    """A CLIENT span around a command request; yields the headers to send it with.

    With `carried` headers (an outbox row's), the span continues the trace they carry
    rather than the current one (see `publish_span`)."""
    if not tracing_on():
        yield _passed_on(carried)
        return
    attributes = messaging_attributes(subject, "send", "request")
    with _outgoing(f"send {subject}", SpanKind.CLIENT, attributes, carried) as headers:
        yield headers


@contextmanager
def publish_span(subject: str, carried: Mapping[str, str], msg_id: str) -> Iterator[dict[str, str]]:
    """A PRODUCER span around a JetStream publish that continues the trace `carried` holds
    (the trace an outbox row was written in); yields the headers to publish with."""
    if not tracing_on():
        yield _passed_on(carried)
        return
    attributes = messaging_attributes(
        subject, "send", "publish", **{messaging.MESSAGING_MESSAGE_ID: msg_id}
    )
    with _outgoing(
        f"publish {destination(subject)}", SpanKind.PRODUCER, attributes, carried
    ) as headers:
        yield headers


def _passed_on(carried: Mapping[str, str] | None) -> dict[str, str]:
    """With tracing off: the trace as it came (the row's, or the current one), no span."""
    return inject_headers() if carried is None else dict(carried)


@contextmanager
def _outgoing(
    name: str,
    kind: SpanKind,
    attributes: dict[str, AttributeValue],
    carried: Mapping[str, str] | None,
) -> Iterator[dict[str, str]]:
    if carried is None:  # sent now, in the current trace
        with tracer.start_as_current_span(name, kind=kind, attributes=attributes):
            yield inject_headers()
        return
    headers = dict(carried)
    if "traceparent" not in headers:
        # Written outside any trace (a timer, a sweeper): sent as it is, with no trace to
        # continue, rather than as the root of a trace of its own.
        yield headers
        return
    with span_from_headers(name, headers, kind, **attributes):
        yield inject_headers(headers)


def tracing_on() -> bool:
    """Whether spans are recorded in this process (`configure_tracing` installed an SDK
    provider): instrumentation that would cost time even unrecorded is added only then."""
    if _tracing_settled is not None:
        return _tracing_settled
    return _sdk_provider()


def _sdk_provider() -> bool:
    return isinstance(trace.get_tracer_provider(), TracerProvider)


@contextmanager
def new_trace(name: str, kind: SpanKind, **attributes: AttributeValue) -> Iterator[trace.Span]:
    """A span that starts a trace of its own, linked to the current span.

    For a unit of work inside a long-lived one — a WebSocket frame inside its
    connection — so each frame is its own trace rather than one trace per connection.
    """
    if not tracing_on():
        yield trace.get_current_span()
        return
    current = trace.get_current_span().get_span_context()
    links = [trace.Link(current)] if current.is_valid else []
    with tracer.start_as_current_span(
        name, context=context.Context(), kind=kind, attributes=attributes, links=links
    ) as span:
        yield span


def current_trace() -> context.Context:
    """The current trace context, to carry across a hand-over between tasks (`within`)."""
    return context.get_current()


@contextmanager
def within(carried: context.Context) -> Iterator[None]:
    """Run the block in a trace context captured elsewhere (`current_trace`): work queued
    to a long-lived task continues the trace of whoever queued it, not the task's."""
    token = context.attach(carried)
    try:
        yield
    finally:
        context.detach(token)
