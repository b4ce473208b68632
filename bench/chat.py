"""The person's path through Criativo: message appended → first delta, and per token.

For each level of concurrent sessions (1, 50, 200), every session appends a
`chat.message` (through `cmd.events.append`, as the gateway will) and a subscriber on
the session's `agent.delta.<project>.<session>` measures

- time to first delta: first delta received − append sent, minus the scripted
  provider's own delay before its first token (log → outbox → JetStream → criativo's
  consumer → actor → lease → catch-up → metering → provider → delta hop);
- per-token delivery: delta received − the provider's emit time;

against a baseline measured in the same run: a raw NATS publish→subscribe hop of the
same deltas, from another process, at the same rate and concurrency. Every service
runs as its own process (`python -m …`, metering on a scripted provider), as under
`make up`.

    .venv/bin/python bench/chat.py [--tokens 20] [--delay-ms 20]

Servers: NATS_URL / DATABASE_URL when set, otherwise embedded ones in a temp dir.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import nats
import uvloop
from nats.aio.client import Client
from nats.aio.msg import Msg

from benchkit import latency_row, servers
from contracts import subjects
from contracts.handoff import ActivateAgent, ActivationReply
from contracts.metering import TurnDelta
from contracts.session_events import (
    AppendedReply,
    AppendEvent,
    EventsReply,
    ListEvents,
    OpenSession,
    SessionOpenedReply,
)
from servicekit.client import call

LEVELS = (1, 50, 200)
PROJECT = "bench"
SERVICES = ("session_events", "handoff", "metering", "criativo")

# The raw-hop baseline is bench/metering.py's and the report rows benchkit's, so both
# benchmarks measure and print their baseline the same way.
_spec = importlib.util.spec_from_file_location(
    "bench_metering", Path(__file__).with_name("metering.py")
)
assert _spec is not None and _spec.loader is not None
bench_metering = importlib.util.module_from_spec(_spec)
sys.modules["bench_metering"] = bench_metering  # its dataclasses look their module up
_spec.loader.exec_module(bench_metering)
Receiver, baseline = bench_metering.Receiver, bench_metering.baseline
row = latency_row


async def wait_ready(nc: Client, service: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{service} exited during start-up")
        with contextlib.suppress(Exception):
            await nc.request(f"$SRV.PING.{service}", b"", timeout=0.5)
            return
        await asyncio.sleep(0.2)
    raise TimeoutError(f"{service} did not start")


async def open_with_criativo(nc: Client) -> uuid.UUID:
    opened = await call(
        nc,
        subjects.SESSIONS_OPEN,
        OpenSession(project_id=PROJECT, opened_by="user:bench"),
        SessionOpenedReply,
    )
    session = opened.session_id
    await call(
        nc,
        subjects.AGENTS_ACTIVATE,
        ActivateAgent(
            project_id=PROJECT, session_id=session, agent="criativo", via="user", actor="user:b"
        ),
        ActivationReply,
    )
    while True:  # the activation reaches the log through handoff's outbox
        events = await call(nc, subjects.EVENTS_LIST, ListEvents(session_id=session), EventsReply)
        if any(e.type.value == "agent.activated" for e in events.events):
            return session
        await asyncio.sleep(0.05)


class Chat:
    """First-delta and per-token latencies of the sessions' turns."""

    def __init__(self) -> None:
        self.first: dict[str, asyncio.Future[float]] = {}
        self.per_token_ms: list[float] = []
        self.first_delta_ms: list[float] = []
        self.done = 0
        self.all_done = asyncio.Event()
        self.expected_done = 0

    async def on_done(self, _: Msg) -> None:
        self.done += 1
        if self.done >= self.expected_done:
            self.all_done.set()

    async def on_delta(self, msg: Msg) -> None:
        now = time.time()
        delta = TurnDelta.model_validate_json(msg.data)
        self.per_token_ms.append((now - delta.emitted_at) * 1000)
        session = msg.subject.rsplit(".", 1)[1]
        future = self.first.get(session)
        if delta.seq == 1 and future is not None and not future.done():
            future.set_result(now)

    async def turn(self, nc: Client, session: uuid.UUID, delay_s: float) -> None:
        self.first[str(session)] = asyncio.get_running_loop().create_future()
        sent = time.time()
        await call(
            nc,
            subjects.EVENTS_APPEND,
            AppendEvent(
                session_id=session,
                type="chat.message",
                actor="user:bench",
                payload={"text": "Um app para padarias"},
            ),
            AppendedReply,
        )
        first = await asyncio.wait_for(self.first[str(session)], 60)
        self.first_delta_ms.append((first - sent - delay_s) * 1000)


async def run(tokens: int, delay_ms: float) -> None:
    delay_s = delay_ms / 1000
    with servers("bench-chat-") as srv, contextlib.ExitStack() as stack:
        nats_url, database_url, state = srv.nats_url, srv.admin_url, srv.state
        # Criativo's turns answer without tools, so one provider call is one turn.
        script = {"steps": [{"text": " ".join(f"w{i}" for i in range(tokens)),
                             "input_tokens": 100, "token_delay_ms": delay_ms}]}  # fmt: skip
        script_path = state / "script.json"
        script_path.write_text(json.dumps(script))
        env = {
            **os.environ,
            "NATS_URL": nats_url,
            "DATABASE_URL": database_url,
            "AGENTBUS_PROVIDER": "scripted",
            "AGENTBUS_SCRIPT_PATH": str(script_path),
            "AGENTBUS_LOG_LEVEL": "WARNING",
            "AGENTBUS_LOG_FORMAT": "json",
            "AGENTBUS_OUTBOX_POLL_SECONDS": "0.2",
            "AGENTBUS_SESSION_BUDGET_MICROS": "100000000",
        }
        nc = await nats.connect(nats_url)
        try:
            for service in SERVICES:
                proc = subprocess.Popen(
                    [sys.executable, "-m", service], env=env, stdout=subprocess.DEVNULL
                )
                stack.callback(lambda p=proc: (p.terminate(), p.wait(30)))
                await wait_ready(nc, service, proc)
            print(f"chat bench: {tokens} tokens per turn, one every {delay_ms} ms; "
                  f"{os.cpu_count()} cores")  # fmt: skip
            for level in LEVELS:
                base = Receiver()
                base.expected = tokens
                sub = await nc.subscribe(f"{subjects.delta_subject('bench', '*')}", cb=base.on_msg)
                await nc.flush()
                await baseline(nats_url, base, level, level, tokens, delay_s)
                await sub.unsubscribe()
                sessions = await asyncio.gather(*(open_with_criativo(nc) for _ in range(level)))
                chat = Chat()
                sub = await nc.subscribe(subjects.delta_subject(PROJECT, "*"), cb=chat.on_delta)
                ends = await nc.subscribe(subjects.done_subject(PROJECT, "*"), cb=chat.on_done)
                await nc.flush()
                # two turns per session, the second once the first ended (agent.done), so
                # each level also measures sessions whose actor is already alive
                for round_ in (1, 2):
                    chat.expected_done, chat.all_done = level * round_, asyncio.Event()
                    await asyncio.gather(*(chat.turn(nc, s, delay_s) for s in sessions))
                    await asyncio.wait_for(chat.all_done.wait(), 120)
                await sub.unsubscribe()
                await ends.unsubscribe()
                hop = base.samples.per_token_ms
                print(f"{level} concurrent session(s):")
                print(row("baseline raw NATS hop", hop))
                print(row("per-token delivery", chat.per_token_ms, hop))
                print(row("append → first delta", chat.first_delta_ms, hop))
        finally:
            await nc.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tokens", type=int, default=20)
    parser.add_argument("--delay-ms", type=float, default=20.0)
    args = parser.parse_args()
    uvloop.run(run(args.tokens, args.delay_ms))


if __name__ == "__main__":
    main()
