"""`agentbus up --replicas 2`: two processes of every service, each with its own
instance id, both answering; the gateway on two ports; a chat turn still answered."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import nats
import pytest
from nats.aio.client import Client

from servicekit.bus import Credentials, identity_options
from servicekit.natsconf import read_secrets
from servicekit.permissions import ADMIN
from testkit.probes import wait_for

from .test_devstack import agentbus

SERVICES = ("session_events", "handoff", "metering", "criativo", "psychologist", "gateway")


def two_free_ports() -> int:
    """A port P with P and P + 1 both free (the gateway's two replicas)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port: int = probe.getsockname()[1]
        with socket.socket() as second:
            try:
                second.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports")


@pytest.fixture
def state(tmp_path: Path) -> Iterator[Path]:
    """The stack's state folder, outside pytest's private temp folder: run as root,
    pgserver's initdb runs as its own user, which must reach the data folder."""
    with tempfile.TemporaryDirectory(prefix="agentbus-replicas-") as folder:
        yield Path(folder) / "state"


@pytest.fixture
def replicated_env(state: Path) -> Iterator[dict[str, str]]:
    unset = ("NATS_URL", "DATABASE_URL", "ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    yield {
        **env,
        "AGENTBUS_STATE_DIR": str(state),
        "AGENTBUS_LOG_FORMAT": "json",
        "AGENTBUS_GATEWAY_PORT": str(two_free_ports()),
    }


async def instances(nc: Client, service: str) -> set[str]:
    """The instance ids that answer `$SRV.PING.<service>` within half a second."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    found: set[str] = set()
    await nc.publish(f"$SRV.PING.{service}", b"", reply=inbox)
    try:
        while True:
            msg = await sub.next_msg(timeout=0.5)
            if msg.data:
                found.add(json.loads(msg.data)["metadata"]["instance"])
    except nats.errors.TimeoutError:
        pass
    finally:
        await sub.unsubscribe()
    return found


async def test_up_with_two_replicas_runs_and_lists_two_of_every_service(
    replicated_env: dict[str, str], state: Path, tmp_path: Path
) -> None:
    log = (tmp_path / "up.log").open("w")
    up = subprocess.Popen(
        [sys.executable, "-m", "devstack", "up", "--replicas", "2"],
        env=replicated_env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        await wait_for(
            lambda: "agentbus is up" in (tmp_path / "up.log").read_text(),
            timeout=180,
            what="the stack with two replicas to report it is up",
        )
        stack = json.loads((state / "stack.json").read_text())
        assert stack["replicas"] == 2
        secrets = read_secrets(state / "nats-secrets.json")
        nc = await nats.connect(
            stack["nats_url"], **identity_options(Credentials(ADMIN, secrets[ADMIN]))
        )
        try:
            for service in SERVICES:
                assert await instances(nc, service) == {f"{service}-1", f"{service}-2"}
        finally:
            await nc.close()

        listed = agentbus("services", env=replicated_env)
        assert listed.returncode == 0, listed.stderr
        rows = [line.split()[:2] for line in listed.stdout.splitlines() if line.strip()]
        for service in SERVICES:
            assert sorted(i for name, i in rows if name == service) == [
                f"{service}-1",
                f"{service}-2",
            ]

        # A chat turn: a session without Criativo gets its plain answer through metering.
        opened = agentbus(
            "call",
            "cmd.sessions.open",
            '{"project_id": "demo", "opened_by": "user:me"}',
            env=replicated_env,
        )
        session_id = json.loads(opened.stdout)["session_id"]
        said = agentbus(
            "call",
            "cmd.events.append",
            json.dumps(
                {
                    "session_id": session_id,
                    "type": "chat.message",
                    "actor": "user:me",
                    "payload": {"text": "hello replicas"},
                }
            ),
            env=replicated_env,
        )
        message_id = json.loads(said.stdout)["event_id"]

        def answers() -> list[dict[str, object]]:
            found = agentbus(
                "call",
                "cmd.events.list",
                json.dumps({"session_id": session_id}),
                env=replicated_env,
            )
            events = json.loads(found.stdout)["events"]
            return [
                e
                for e in events
                if e["type"] == "agent.response" and e["causation_id"] == message_id
            ]

        [answer] = await wait_for(answers, timeout=60, what="the chat message answered")
        assert answer["payload"]["agent"] == "chat"

        # Both gateway replicas serve the web client, each on its own port.
        base = int(replicated_env["AGENTBUS_GATEWAY_PORT"])
        links = [
            line.strip()
            for line in (tmp_path / "up.log").read_text().splitlines()
            if line.strip().startswith("http://127.0.0.1:")
        ]
        assert [link.split("/")[2] for link in links] == [
            f"127.0.0.1:{base}",
            f"127.0.0.1:{base + 1}",
        ]
        async with httpx.AsyncClient(timeout=10) as http:
            for link in links:
                host, token = link.split("/#token=")
                me = await http.get(
                    f"{host}/api/projects/demo", headers={"authorization": f"Bearer {token}"}
                )
                assert me.status_code == 200

        # Every replica's metrics URL is printed, and answers.
        metrics = [
            line.split("metrics ", 1)[1].split()[0]
            for line in (tmp_path / "up.log").read_text().splitlines()
            if line.strip().startswith("metrics http://127.0.0.1:")
        ]
        assert len(set(metrics)) == len(metrics) == 2 * len(SERVICES), metrics
        async with httpx.AsyncClient(timeout=10) as http:
            for url in metrics:
                assert (await http.get(url)).status_code == 200, url

        down = agentbus("down", env=replicated_env)
        assert down.stdout.strip() == "stopped"
        assert up.wait(60) == 0
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGKILL)
        log.close()
