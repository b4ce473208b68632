"""`make up` secures its embedded NATS: no anonymous client, each service process
connected as its own user, secrets kept to the owner, and `agentbus creds` working."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import nats
import nats.errors
import pytest

from servicekit.permissions import SERVICES
from testkit.probes import wait_for


def agentbus(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "devstack", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def stack_env(tmp_path: Path) -> dict[str, str]:
    unset: tuple[str, ...] = ("NATS_URL", "DATABASE_URL", "ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL")
    unset += ("NATS_USER", "NATS_PASSWORD", "AGENTBUS_NATS_SECRETS_FILE")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return {
        **env,
        "AGENTBUS_STATE_DIR": str(tmp_path / "state"),
        "AGENTBUS_LOG_FORMAT": "json",
        "AGENTBUS_GATEWAY_PORT": str(port),
    }


@pytest.fixture
def stack(stack_env: dict[str, str], tmp_path: Path) -> Iterator[dict[str, str]]:
    log = (tmp_path / "up.log").open("w")
    up = subprocess.Popen(
        [sys.executable, "-m", "devstack", "up"],
        env=stack_env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield stack_env
    finally:
        agentbus("down", env=stack_env)
        if up.poll() is None:
            up.terminate()
        up.wait(60)
        log.close()


async def anonymous_answer(url: str) -> bytes:
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        await reader.readline()  # INFO
        # verbose, and nothing after CONNECT: the server's close after -ERR resets no write
        writer.write(b'CONNECT {"verbose": true}\r\n')
        await writer.drain()
        return await asyncio.wait_for(reader.readline(), 10)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def test_make_up_accepts_only_its_users_each_service_as_itself(
    stack: dict[str, str], tmp_path: Path
) -> None:
    state = Path(stack["AGENTBUS_STATE_DIR"])
    await wait_for(
        lambda: "agentbus is up" in (tmp_path / "up.log").read_text(),
        timeout=90,
        what="the stack to report it is up",
    )
    url = json.loads((state / "stack.json").read_text())["nats_url"]
    secrets = json.loads((state / "nats-secrets.json").read_text())

    # secrets and the config holding them are readable by their owner only
    for name in ("nats-secrets.json", "nats.conf"):
        assert stat.S_IMODE((state / name).stat().st_mode) == 0o600, name
    assert (await anonymous_answer(url)).startswith(b"-ERR 'Authorization Violation'")

    # `agentbus creds ops` prints what the NATS CLI needs, and it works
    creds = agentbus("creds", "ops", env=stack)
    assert creds.returncode == 0, creds.stderr
    password = re.search(r"--password (\S+)", creds.stdout)
    assert password is not None and password.group(1) == secrets["ops"]
    assert f"--server {url}" in creds.stdout and "--inbox-prefix _INBOX_ops" in creds.stdout
    ops = await nats.connect(url, user="ops", password=password.group(1), inbox_prefix="_INBOX_ops")
    try:
        inbox = ops.new_inbox()
        sub = await ops.subscribe(inbox)
        await ops.publish("$SRV.PING", b"", reply=inbox)
        names: set[str] = set()
        while len(names) < len(SERVICES):
            msg = await sub.next_msg(timeout=10)
            names.add(json.loads(msg.data)["name"])
        assert names == set(SERVICES)
        with pytest.raises(nats.errors.TimeoutError):
            await ops.jetstream(timeout=1).delete_stream("EVENTS")
    finally:
        await ops.close()

    # the system account sees every service process connected as its own user
    system = await nats.connect(url, user="sys", password=secrets["sys"])
    try:
        reply = await system.request(
            "$SYS.REQ.SERVER.PING.CONNZ",
            json.dumps({"account": "AGENTBUS", "auth": True, "limit": 1024}).encode(),
            timeout=10,
        )
    finally:
        await system.close()
    connections = json.loads(reply.data)["data"]["connections"]
    users_by_service = {
        c["name"].split(":")[0]: c["authorized_user"]
        for c in connections
        if c.get("name", "").split(":")[0] in SERVICES
    }
    assert users_by_service == {s: s for s in SERVICES}
    assert (await asyncio.to_thread(agentbus, "ping", "handoff", env=stack)).returncode == 0
