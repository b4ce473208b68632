"""Prometheus metrics and health, served by every service on a small HTTP port.

`/metrics` is the Prometheus text format of this process's series; `/livez` answers
from the event loop itself (a blocked loop fails it, which a thread-served endpoint
would hide); `/readyz` is 200 only while NATS is connected, Postgres answers and every
background task (consumers, relays) runs. Liveness never depends on NATS or Postgres:
an outage of either must make replicas unready, not restart them all.

The port is `AGENTBUS_METRICS_PORT`; 0, the default, takes a free one, which is logged
and announced in the service's NATS micro metadata (`metrics`), where `agentbus up`
reads it. Gauges that describe shared state (outbox depth and age, consumer lag) are
sampled when scraped, with a bound on the time they may take, so a scrape always
answers.

The series (names are the dashboard's and the alerts' in deploy/):
- commands: `agentbus_command_duration_seconds{subject}`,
  `agentbus_command_errors_total{subject,code}`;
- consumers: `agentbus_consumer_deliveries_total{consumer}`,
  `agentbus_consumer_redeliveries_total{consumer}`,
  `agentbus_consumer_handler_duration_seconds{consumer,outcome}`,
  `agentbus_consumer_pending_messages{consumer}` (JetStream `num_pending`),
  `agentbus_consumer_drift_total{consumer}` (found configured otherwise than declared,
  and put back: servicekit.drift);
- outbox and dead letters: `agentbus_outbox_rows{schema}`,
  `agentbus_outbox_oldest_row_age_seconds{schema}`,
  `agentbus_dead_letters_total{consumer,subject}`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from servicekit.logs import get_logger

# Services define their own series with these (no direct dependency on the client).
__all__ = ["SECONDS", "Counter", "Gauge", "Health", "Histogram", "MetricsServer", "value"]

log = get_logger(__name__)

# Latency buckets from a sub-millisecond NATS hop to a long LLM turn.
SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# How long a scrape may spend sampling the store and the bus.
SAMPLE_TIMEOUT_SECONDS = 2.0
CHECK_TIMEOUT_SECONDS = 2.0

COMMAND_SECONDS = Histogram(
    "agentbus_command_duration_seconds",
    "Time to answer a command, from parse to serialised reply.",
    ["subject"],
    buckets=SECONDS,
)
COMMAND_ERRORS = Counter(
    "agentbus_command_errors_total",
    "Commands answered with an error reply, by its code.",
    ["subject", "code"],
)
CONSUMER_DELIVERIES = Counter(
    "agentbus_consumer_deliveries_total",
    "Messages a durable consumer received (first deliveries and redeliveries).",
    ["consumer"],
)
CONSUMER_REDELIVERIES = Counter(
    "agentbus_consumer_redeliveries_total",
    "Messages a durable consumer received again (delivery count > 1).",
    ["consumer"],
)
CONSUMER_HANDLER_SECONDS = Histogram(
    "agentbus_consumer_handler_duration_seconds",
    "Time a consumer's handler took, by outcome (ack, retry, dead_letter).",
    ["consumer", "outcome"],
    buckets=SECONDS,
)
CONSUMER_PENDING = Gauge(
    "agentbus_consumer_pending_messages",
    "Messages of the stream not yet delivered to the consumer (num_pending), sampled.",
    ["consumer"],
)
CONSUMER_DRIFT = Counter(
    "agentbus_consumer_drift_total",
    "Times a durable consumer was found configured otherwise than declared, and put back.",
    ["consumer"],
)
OUTBOX_ROWS = Gauge(
    "agentbus_outbox_rows",
    "Outbox rows not yet delivered, sampled.",
    ["schema"],
)
OUTBOX_OLDEST_SECONDS = Gauge(
    "agentbus_outbox_oldest_row_age_seconds",
    "Age of the oldest undelivered outbox row (0 when empty), sampled.",
    ["schema"],
)
DEAD_LETTERS = Counter(
    "agentbus_dead_letters_total",
    "Messages dead-lettered by this process (consumer `outbox`: outbox rows).",
    ["consumer", "subject"],
)

Check = Callable[[], Awaitable[bool]]
Sampler = Callable[[], Awaitable[None]]


@dataclass
class Health:
    """What `/readyz` asks and what `/metrics` samples, filled in by the runtime."""

    checks: dict[str, Check] = field(default_factory=dict)
    samplers: list[Sampler] = field(default_factory=list)
    # Set once the service serves (consumers started, endpoints announced).
    serving: asyncio.Event = field(default_factory=asyncio.Event)

    async def ready(self) -> dict[str, bool]:
        """Each check's result (a check that fails or hangs is False)."""
        results = {"serving": self.serving.is_set()}
        for name, check in self.checks.items():
            try:
                async with asyncio.timeout(CHECK_TIMEOUT_SECONDS):
                    results[name] = bool(await check())
            except Exception:
                results[name] = False
        return results

    async def sample(self) -> None:
        """Refresh the sampled gauges; a sampler that fails leaves its last value."""
        for sampler in self.samplers:
            try:
                async with asyncio.timeout(SAMPLE_TIMEOUT_SECONDS):
                    await sampler()
            except Exception as exc:
                log.debug("metrics_sample_failed", error=repr(exc))


@dataclass
class MetricsServer:
    """The `/metrics`, `/livez`, `/readyz` HTTP server of one process, on its event loop."""

    health: Health
    host: str = "127.0.0.1"
    port: int = 0
    server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(10):
                request = await reader.readuntil(b"\r\n\r\n")
            parts = request.split(b" ", 2)
            method = parts[0]
            path = parts[1].split(b"?", 1)[0] if len(parts) > 1 else b""
            status, ctype, body = await self._answer(method, path)
            head = (
                f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(head.encode() + (body if method != b"HEAD" else b""))
            await writer.drain()
        except Exception:  # a client that went away or sent garbage: nothing to answer
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _answer(self, method: bytes, path: bytes) -> tuple[str, str, bytes]:
        if method not in (b"GET", b"HEAD"):
            return "405 Method Not Allowed", "text/plain", b"GET only\n"
        if path == b"/livez":
            return "200 OK", "text/plain", b"ok\n"
        if path == b"/readyz":
            results = await self.health.ready()
            lines = "".join(f"{name} {'ok' if ok else 'FAIL'}\n" for name, ok in results.items())
            status = "200 OK" if all(results.values()) else "503 Service Unavailable"
            return status, "text/plain", lines.encode()
        if path == b"/metrics":
            await self.health.sample()
            return "200 OK", CONTENT_TYPE_LATEST, generate_latest()
        return "404 Not Found", "text/plain", b"/metrics, /livez or /readyz\n"


def running(tasks: Iterable[asyncio.Task[object]]) -> bool:
    """Every task still runs (none crashed or ended)."""
    return all(not t.done() for t in tasks)


def value(name: str, **labels: str) -> float:
    """A series' current value in this process (0 when it was never touched): for tests
    and for code that reports on itself."""
    return REGISTRY.get_sample_value(name, labels) or 0.0
