"""OpenTelemetry tracing, its context carried in NATS headers.

Exporters come from the standard `OTEL_*` variables: `OTEL_TRACES_EXPORTER=console`
prints spans, `otlp` sends them (needs `opentelemetry-exporter-otlp`); unset or
`none` records nothing, so tracing costs nothing by default.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

from servicekit.logs import get_logger

log = get_logger(__name__)


def configure_tracing(service: str) -> None:
    """Install a tracer provider whose exporter the `OTEL_TRACES_EXPORTER` variable names."""
    choice = os.environ.get("OTEL_TRACES_EXPORTER", "none").strip().lower()
    if choice in ("", "none"):
        return
    exporter: SpanExporter
    if choice == "console":
        exporter = ConsoleSpanExporter()
    elif choice == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[import-not-found]
                OTLPSpanExporter,
            )
        except ImportError:
            log.warning(
                "otel_exporter_missing", exporter=choice, hint="install opentelemetry-exporter-otlp"
            )
            return
        exporter = OTLPSpanExporter()
    else:
        log.warning("otel_exporter_unknown", exporter=choice)
        return
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service)})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)


tracer = trace.get_tracer("agentbus")


def inject_headers(headers: dict[str, str] | None = None) -> dict[str, str]:
    """Headers carrying the current trace context (W3C `traceparent`)."""
    carrier = dict(headers or {})
    propagate.inject(carrier)
    return carrier


@contextmanager
def span_from_headers(
    name: str, headers: Mapping[str, str] | None, **attributes: str
) -> Iterator[trace.Span]:
    """A span that continues the trace whose context came in `headers`."""
    parent = propagate.extract(dict(headers or {}))
    token = context.attach(parent)
    try:
        with tracer.start_as_current_span(name, attributes=attributes) as span:
            yield span
    finally:
        context.detach(token)
