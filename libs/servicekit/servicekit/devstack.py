"""`make up`: the whole system on one machine, supervised.

Starts the embedded NATS and PostgreSQL unless `NATS_URL` / `DATABASE_URL` name
servers to use, then every service as its own process. A service that dies is
restarted with a growing delay (reset after a minute of good health) and the
restart is logged. Ctrl-C, SIGTERM or `make down` stop the services first, then
the servers. Where everything listens is printed and kept in
`<state>/stack.json`, which `agentbus call` and `agentbus down` read.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import psutil

from servicekit.embedded import EmbeddedNats, EmbeddedPostgres, start_nats, start_postgres
from servicekit.logs import get_logger

log = get_logger("devstack")


@dataclass(frozen=True)
class ServiceSpec:
    """A service the stack runs: its micro name and the module `python -m` starts."""

    name: str
    module: str


# Each service issue adds its line here.
SERVICES = [
    ServiceSpec("session_events", "session_events"),
    ServiceSpec("handoff", "handoff"),
    ServiceSpec("metering", "metering"),
    ServiceSpec("psychologist", "psychologist"),
    ServiceSpec("criativo", "criativo"),
    ServiceSpec("gateway", "gateway"),
]

RESTART_MAX_DELAY = 30.0
HEALTHY_AFTER = 60.0
STOP_GRACE = 10.0


def state_dir() -> Path:
    """Where the embedded servers keep their data (`AGENTBUS_STATE_DIR`, default `.agentbus`)."""
    return Path(os.environ.get("AGENTBUS_STATE_DIR", ".agentbus")).resolve()


def stack_file() -> Path:
    return state_dir() / "stack.json"


def read_stack() -> dict[str, Any] | None:
    """The running stack's description, if one is running."""
    try:
        stack: dict[str, Any] = json.loads(stack_file().read_text())
    except (OSError, ValueError):
        return None
    return stack if _alive(stack.get("pid")) else None


def _alive(pid: object) -> bool:
    """A process that runs (a zombie waiting for its parent to reap it has stopped)."""
    try:
        return isinstance(pid, int) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class Supervised:
    """One service process, restarted whenever it dies until the stack stops."""

    def __init__(self, spec: ServiceSpec, env: dict[str, str]) -> None:
        self.spec = spec
        self._env = env
        self._process: asyncio.subprocess.Process | None = None
        self._stopping = False
        self.restarts = 0

    async def run(self) -> None:
        delay = 1.0
        while not self._stopping:
            started = time.monotonic()
            self._process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                self.spec.module,
                env=self._env,
                start_new_session=True,  # Ctrl-C reaches the supervisor, which stops us in order
            )
            code = await self._process.wait()
            if self._stopping:
                return
            if time.monotonic() - started > HEALTHY_AFTER:
                delay = 1.0
            self.restarts += 1
            log.error(
                "service_died_restarting",
                service=self.spec.name,
                exit_code=code,
                restart=self.restarts,
                restart_in=delay,
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, RESTART_MAX_DELAY)

    async def stop(self) -> None:
        self._stopping = True
        process = self._process
        if process is None or process.returncode is not None:
            return
        process.terminate()
        try:
            await asyncio.wait_for(process.wait(), STOP_GRACE)
        except TimeoutError:
            log.warning("service_killed", service=self.spec.name)
            process.kill()
            await process.wait()


async def _describe(nats_url: str, specs: list[ServiceSpec], timeout: float = 30.0) -> list[str]:
    """Wait for every service to answer `$SRV.INFO`, and list its endpoints."""
    nc = await nats.connect(nats_url)
    lines = []
    try:
        for spec in specs:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    msg = await nc.request(f"$SRV.INFO.{spec.name}", b"", timeout=0.5)
                    if msg.data:
                        break
                except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{spec.name} did not start in {timeout}s")
                await asyncio.sleep(0.2)
            info = json.loads(msg.data)
            commands = ", ".join(sorted(e["subject"] for e in info["endpoints"]))
            lines.append(f"  {spec.name:<16} {commands}")
    finally:
        await nc.close()
    return lines


async def run_stack(specs: list[ServiceSpec] | None = None) -> None:
    """Run servers and services until SIGINT/SIGTERM."""
    specs = specs or SERVICES
    if read_stack() is not None:
        raise SystemExit(f"a stack is already running ({stack_file()}); `make down` first")
    state = state_dir()
    state.mkdir(parents=True, exist_ok=True)
    embedded_nats: EmbeddedNats | None = None
    embedded_pg: EmbeddedPostgres | None = None
    nats_url = os.environ.get("NATS_URL")
    database_url = os.environ.get("DATABASE_URL")
    if not nats_url:
        embedded_nats = start_nats(state)
        nats_url = embedded_nats.url
    if not database_url:
        embedded_pg = start_postgres(state)
        database_url = embedded_pg.url
    env = {**os.environ, "NATS_URL": nats_url, "DATABASE_URL": database_url}
    supervised = [Supervised(spec, env) for spec in specs]
    tasks = [asyncio.create_task(s.run(), name=s.spec.name) for s in supervised]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        stack_file().write_text(
            json.dumps(
                {
                    "pid": os.getpid(),
                    "nats_url": nats_url,
                    "database_url": database_url,
                    "services": [s.name for s in specs],
                },
                indent=2,
            )
        )
        lines = await _describe(nats_url, specs)
        print(
            "\nagentbus is up\n"
            f"  NATS      {nats_url}{_embedded(embedded_nats)}\n"
            f"  Postgres  {database_url}{_embedded(embedded_pg)}\n"
            "services (NATS micro; `nats micro ls` lists them too):\n" + "\n".join(lines) + "\n"
            "try, from another terminal:\n"
            "  .tools/bin/uv run agentbus call cmd.sessions.open "
            '\'{"project_id": "demo", "opened_by": "user:me"}\'\n'
            "Ctrl-C or `make down` stops everything.\n" + _web_link(specs),
            flush=True,
        )
        await stop.wait()
    finally:
        log.info("stack_stopping")
        await asyncio.gather(*(s.stop() for s in supervised))
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if embedded_nats is not None:
            embedded_nats.stop()
        if embedded_pg is not None:
            embedded_pg.stop()
        with contextlib.suppress(OSError):
            stack_file().unlink()
        log.info("stack_stopped")


def _web_link(specs: list[ServiceSpec]) -> str:
    """The web client's link for the local `demo` project, when the gateway runs."""
    if not any(spec.name == "gateway" for spec in specs):
        return ""
    # Imported here: the gateway is a service built on servicekit, not part of it.
    from gateway.auth import dev_link

    return f"open the web client (project demo):\n  {dev_link('demo')}\n"


def _embedded(server: object) -> str:
    return " (embedded)" if server is not None else ""


def stop_stack(timeout: float = 60.0) -> bool:
    """Ask a running stack to stop and wait until it has; False when none was running."""
    stack = read_stack()
    if stack is None:
        return False
    os.kill(stack["pid"], signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(stack["pid"]):
            return True
        time.sleep(0.2)
    raise TimeoutError(f"stack {stack['pid']} still running after {timeout}s")
