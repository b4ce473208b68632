"""A service outlives its NATS server restarting (issue 13: the psychologist sometimes
exited when NATS dropped instead of reconnecting).

The services run as real processes against a NATS server of this test's own, which is
killed (SIGKILL, as a crashed node) and started again on the same port with the same
JetStream store. Each service must still be the same process, answer `$SRV.PING`
again, and its durable consumer must resume: an event published after the restart is
handled and acknowledged.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit

import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client

from contracts import streams
from contracts.events import Event, EventType
from contracts.subjects import event_subject
from servicekit.bus import provision_declared
from servicekit.embedded import EmbeddedNats, start_nats
from servicekit.natsconf import accounts_block, load_or_create_secrets
from servicekit.permissions import ADMIN
from testkit.probes import wait_for
from testkit.servers import with_credentials
from testkit.services import ServiceProcess

# The durable consumers that take closings: the psychologist's
# (`psychologist.handlers.CONSUMER`, several pullers) and Criativo's (`criativo.handlers.CONSUMER`).
CONSUMERS = ("psychologist-session-closings", "criativo-inputs")
SERVICES = ("session_events", "psychologist", "criativo")


class OwnNats:
    """A secured nats-server that the test can kill and start again on the same port."""

    def __init__(self, state: Path) -> None:
        self.state = state
        self.secrets = load_or_create_secrets(state / "nats-secrets.json")
        self.server: EmbeddedNats = start_nats(state, auth=accounts_block(self.secrets))
        self.url = self.server.url
        self.port = urlsplit(self.url).port

    def crash(self) -> None:
        self.server.process.send_signal(signal.SIGKILL)
        self.server.process.wait(10)

    def start_again(self, jetstream: bool = True) -> None:
        self.server = start_nats(
            self.state,
            auth=accounts_block(self.secrets),
            listen=f"127.0.0.1:{self.port}",
            jetstream=jetstream,
        )

    def env_for(self, service: str, database_url: str) -> dict[str, str]:
        return {
            "NATS_URL": self.url,
            "DATABASE_URL": database_url,
            "NATS_USER": service,
            "NATS_PASSWORD": self.secrets[service],
            "AGENTBUS_LOG_FORMAT": "json",
            "AGENTBUS_OUTBOX_POLL_SECONDS": "0.2",
        }


@pytest.fixture
def own_nats(tmp_path: Path) -> Iterator[OwnNats]:
    server = OwnNats(tmp_path / "nats-state")
    yield server
    server.server.stop()


@pytest_asyncio.fixture(loop_scope="session")
async def admin(own_nats: OwnNats) -> AsyncIterator[Client]:
    """The test's own connection (it reconnects too, for ever)."""
    url = with_credentials(own_nats.url, ADMIN, own_nats.secrets[ADMIN])
    nc = await nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    await provision_declared(nc.jetstream())
    yield nc
    await nc.close()


def start(service: str, own_nats: OwnNats, database_url: str, tmp_path: Path) -> ServiceProcess:
    env = {**os.environ, **own_nats.env_for(service, database_url)}
    return ServiceProcess(service, env, tmp_path / f"{service}.log").start()


def forged_closing() -> Event:
    """A closing the log never held: the psychologist must ask the log, then ack it."""
    return Event(
        id=uuid.uuid4(),
        session_id=uuid.uuid4(),
        project_id="p-restart",
        seq=2,
        type=EventType.SESSION_CLOSED,
        actor="user:ana",
        payload={},
        created_at=datetime.now(UTC),
    )


async def handled(nc: Client, stream_seq: int) -> bool:
    """Every consumer of closings has acknowledged the stream up to `stream_seq`."""
    for durable in CONSUMERS:
        info = await nc.jetstream().consumer_info(streams.EVENTS.name, durable)
        if info.ack_floor.stream_seq < stream_seq or info.num_ack_pending:
            return False
    return True


async def publish(nc: Client, event: Event) -> int:
    ack = await nc.jetstream().publish(
        event_subject(event.type, event.project_id, event.session_id),
        event.model_dump_json().encode(),
        headers={"Nats-Msg-Id": str(event.id)},
    )
    return ack.seq


@pytest.mark.parametrize(
    "outage",
    ["instant", "down", "jetstream_late"],
)
async def test_services_reconnect_and_resume_after_nats_restarts(
    own_nats: OwnNats, admin: Client, database_url: str, tmp_path: Path, outage: str
) -> None:
    """`instant`: the server is back at once; `down`: it stays away a few seconds;
    `jetstream_late`: it comes back serving core NATS before JetStream (as a node still
    recovering its store, or a cluster electing leaders): pulls get 503 meanwhile."""
    procs = {name: start(name, own_nats, database_url, tmp_path) for name in SERVICES}
    try:
        for name, proc in procs.items():
            await proc.wait_ready(admin, name)
        before = await publish(admin, forged_closing())
        await wait_for(lambda: handled(admin, before), what="the first closing handled")

        own_nats.crash()
        if outage == "down":
            await wait_for(lambda: not admin.is_connected, what="the test's client to notice")
            await asyncio.sleep(3)  # an outage that lasts, not a synchronisation
        elif outage == "jetstream_late":
            own_nats.start_again(jetstream=False)
            for name, proc in procs.items():
                await proc.wait_ready(admin, name)  # reconnected, pulling against no JetStream
            await asyncio.sleep(3)  # the length of the JetStream outage
            own_nats.crash()
        own_nats.start_again()

        for name, proc in procs.items():
            await proc.wait_ready(admin, name)  # the same process answers again
        after = await publish(admin, forged_closing())
        await wait_for(lambda: handled(admin, after), timeout=30, what="the consumer resumed")
        for proc in procs.values():
            assert proc.process is not None and proc.process.poll() is None
    finally:
        for proc in procs.values():
            proc.kill(signal.SIGTERM)
        for name in procs:
            sys.stderr.write(f"--- {name}\n{(tmp_path / f'{name}.log').read_text()[-3000:]}\n")
