"""The spans a test's own process records, in memory (tracing on)."""

from __future__ import annotations

from collections.abc import Iterator

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


def recorded_spans() -> Iterator[InMemorySpanExporter]:
    """Spans recorded in memory through the process's one tracer provider, for a fixture
    to yield from.

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
