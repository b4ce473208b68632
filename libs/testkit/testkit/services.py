"""Services under test: started as real processes, or run in the test's own process, and
known to be up once they answer `$SRV.PING`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client

from testkit.probes import wait_for


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
