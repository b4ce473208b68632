"""The service entry point: one place that connects, migrates, provisions and shuts down."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import asyncpg
import uvloop
from nats.aio.client import Client
from nats.js import JetStreamContext

from contracts import streams
from servicekit.bus import BucketNotProvisioned, check_streams, connect_service
from servicekit.cancellation import stop
from servicekit.db import KIT_MIGRATIONS, create_pool, migrate, pending_migrations
from servicekit.logs import configure_logging, get_logger
from servicekit.metrics import (
    OUTBOX_OLDEST_SECONDS,
    OUTBOX_ROWS,
    Health,
    MetricsServer,
    running,
)
from servicekit.outbox import OutboxRelay, Sender
from servicekit.patience import FIRST_BACKOFF_SECONDS, MAX_BACKOFF_SECONDS, is_unavailable
from servicekit.settings import ServiceSettings
from servicekit.telemetry import configure_tracing

log = get_logger(__name__)
T = TypeVar("T")


# EX_CONFIG (sysexits.h): the service cannot start until the operator provisions.
EXIT_NOT_PROVISIONED = 78


class StreamsNotReady(RuntimeError):
    """The streams are missing or not as declared: `agentbus provision` has not run."""


async def require_streams(js: JetStreamContext, service: str, replicas: int) -> None:
    """Refuse to start, with one clear log line, unless the streams exist as declared.

    A service never creates a stream: re-creating a deleted EVENTS empty would hide the
    loss. Provisioning is the `provision` user's job.
    """
    problems = await _when_jetstream_answers(lambda: check_streams(js, streams.ALL, replicas))
    if problems:
        log.error(
            "streams_not_provisioned",
            service=service,
            problems=problems,
            fix="run `agentbus provision` (make up does), then start the service again",
        )
        raise StreamsNotReady("; ".join(problems))


async def _when_jetstream_answers(ask: Callable[[], Awaitable[T]]) -> T:
    """`ask()`'s answer, asked again (with backoff) for as long as JetStream does not
    answer: a service restarting while a cluster node is down or electing its leaders
    waits for the cluster, rather than exiting for the supervisor to start it again."""
    delay = FIRST_BACKOFF_SECONDS
    while True:
        try:
            return await ask()
        except Exception as exc:
            if not is_unavailable(exc):
                raise
            log.warning("jetstream_not_answering", error=repr(exc), retry_in=delay)
        await asyncio.sleep(delay)
        delay = min(delay * 2, MAX_BACKOFF_SECONDS)


@dataclass
class Runtime:
    """What a running service holds: its settings, bus, store and background tasks."""

    name: str
    schema: str | None
    settings: ServiceSettings
    nc: Client
    js: JetStreamContext
    # None for a service that keeps nothing durable (the gateway): it has no schema.
    db: asyncpg.Pool | None
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    health: Health = field(default_factory=Health)
    metrics: MetricsServer | None = None

    @property
    def pool(self) -> asyncpg.Pool:
        """The service's Postgres pool, on its own schema."""
        if self.db is None:
            raise RuntimeError(f"{self.name} keeps nothing durable: it has no database pool")
        return self.db

    def background(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run `coro` for the life of the service; its crash stops the service (and the
        supervisor restarts it) rather than leaving a half-working process."""
        task = asyncio.create_task(coro, name=name)

        def crashed(t: asyncio.Task[Any]) -> None:
            if not t.cancelled() and t.exception() is not None:
                log.error("background_task_crashed", task=name, error=repr(t.exception()))
                self.stopping.set()

        task.add_done_callback(crashed)
        self.tasks.append(task)
        return task

    def relay(self, sender: Sender, name: str = "outbox-relay") -> OutboxRelay:
        """Drain this schema's outbox through `sender` for the life of the service; the
        relay is returned for `deliver_now`."""
        relay = OutboxRelay(
            self.pool,
            sender,
            self.settings.outbox_batch,
            self.settings.outbox_poll_seconds,
            self.settings.outbox_lease_seconds,
        )
        self.background(relay.run(), name)
        return relay


@asynccontextmanager
async def open_runtime(
    name: str, schema: str | None, migrations: list[str], settings: ServiceSettings | None = None
) -> AsyncIterator[Runtime]:
    """Connect to NATS (as `name`'s user) and Postgres, check the streams and apply
    migrations; undo on exit. With no `schema`, the service gets no Postgres at all."""
    settings = settings or ServiceSettings()
    nc = await connect_service(settings, name)
    js = nc.jetstream()
    try:
        await require_streams(js, name, settings.stream_replicas)
    except BaseException:
        await nc.close()
        raise
    pool = None
    if schema is not None:
        pool = await create_pool(
            settings.database_url, schema, settings.db_pool_min, settings.db_pool_max
        )
    runtime = Runtime(name, schema, settings, nc, js, pool)
    await _serve_metrics(runtime)
    try:
        if pool is not None and schema is not None:
            packages = [KIT_MIGRATIONS, *migrations]
            if settings.migrate:
                await migrate(pool, schema, packages)
            else:
                await _wait_for_schema(runtime, schema, packages)
        yield runtime
    finally:
        if runtime.metrics is not None:
            await runtime.metrics.stop()
        await asyncio.gather(*(stop(task) for task in runtime.tasks))
        with contextlib.suppress(Exception):
            await nc.drain()
        if pool is not None:
            await pool.close()


async def _wait_for_schema(rt: Runtime, schema: str, packages: list[str]) -> None:
    """With AGENTBUS_MIGRATE=false: wait until the migration Job has brought `schema` to
    the version this code expects; `/readyz` says `schema: false` meanwhile."""

    async def current() -> bool:
        return not await pending_migrations(rt.pool, schema, packages)

    rt.health.checks["schema"] = current
    pending = await pending_migrations(rt.pool, schema, packages)
    if pending:
        log.warning("schema_not_migrated", schema=schema, pending=pending)
    while pending:
        await asyncio.sleep(rt.settings.schema_poll_seconds)
        pending = await pending_migrations(rt.pool, schema, packages)
    log.info("schema_current", schema=schema)


async def _serve_metrics(rt: Runtime) -> None:
    """Start `/metrics`, `/livez`, `/readyz` (servicekit.metrics) with this runtime's
    checks: NATS connected, Postgres answering (when it has one), every background task
    running."""

    async def postgres() -> bool:
        answer: int = await rt.pool.fetchval("SELECT 1")
        return answer == 1

    async def nats_connected() -> bool:
        return bool(rt.nc.is_connected)

    async def tasks() -> bool:
        return running(rt.tasks)

    async def outbox() -> None:
        row = await rt.pool.fetchrow(
            "SELECT count(*), coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8 "
            "FROM outbox"
        )
        assert row is not None
        OUTBOX_ROWS.labels(rt.schema).set(row[0])
        OUTBOX_OLDEST_SECONDS.labels(rt.schema).set(row[1])

    rt.health.checks.update(nats=nats_connected, tasks=tasks)
    # A service that keeps nothing durable (the gateway) has no Postgres to check.
    if rt.db is not None:
        rt.health.checks.update(postgres=postgres)
        rt.health.samplers.append(outbox)
    rt.metrics = MetricsServer(rt.health, rt.settings.metrics_host, rt.settings.metrics_port)
    await rt.metrics.start()
    log.info("metrics_serving", service=rt.name, url=rt.metrics.url)


def run_service(name: str, main: Awaitable[None] | Coroutine[Any, Any, None]) -> None:
    """Run a service's main coroutine with logging and tracing set up; exit on SIGTERM/SIGINT."""
    settings = ServiceSettings()
    configure_logging(name, settings.log_level, settings.log_format)
    configure_tracing(name)

    async def guarded() -> None:
        task = asyncio.ensure_future(main)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            try:
                await task
            except StreamsNotReady:
                sys.exit(EXIT_NOT_PROVISIONED)  # already said in one log line
            except BucketNotProvisioned as exc:
                log.error(
                    exc.code,
                    service=name,
                    bucket=exc.bucket,
                    fix="run `agentbus provision` (make up does), then start the service again",
                )
                sys.exit(EXIT_NOT_PROVISIONED)
        log.info("service_stopped", service=name)

    # uvloop takes about a third off a NATS hop (a Python hop costs 0.4-0.6 ms at the
    # median on the machines the benches ran on), and every command is at least one hop.
    uvloop.run(guarded())


async def wait_until_stopped(runtime: Runtime) -> None:
    """Block until cancelled (SIGTERM) or until a background task crashed."""
    await runtime.stopping.wait()
    raise RuntimeError("a background task crashed; exiting so the supervisor restarts us")
