"""The person's path through Criativo: message appended → first delta, and per token.

For each level of concurrent sessions (1, 50, 200), every session appends a
`chat.message` (through `cmd.events.append`, as the gateway will) and a subscriber on
the session's `agent.delta.<project>.<session>` measures

- time to first delta: first delta received − append sent, minus the scripted
  provider's own delay before its first token (log → outbox → JetStream → criativo's
  consumer → actor → lease → catch-up → metering → provider → delta hop), and where it
  goes, from what the bench sees pass on the bus: the append's reply (the log), the
  event on JetStream (log → bus, the log's outbox relay), Criativo's `cmd.llm.stream`
  request (bus → Criativo → request: consumer fetch, lease, catch-up, prompt) and the
  first delta (metering: binding, budget reservation, provider, delta hop);
- per-token delivery: delta received − the provider's emit time;
- CPU ms per turn of each process (services, NATS, Postgres);

against a baseline measured in the same run: a raw NATS publish→subscribe hop of the
same deltas, from another process, at the same rate and concurrency. Every service
runs as its own process (`python -m …`, metering on a scripted provider), as under
`make up`. Goals (issue 12): first delta p99 ≤ 10 ms at 50 sessions, ≤ 25 ms at 200;
the bench exits non-zero when one is missed.

    .venv/bin/python bench/chat.py [--tokens 20] [--delay-ms 20] [--levels 1,50,200]

Servers: NATS_URL / DATABASE_URL when set, otherwise embedded ones in a temp dir.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import sys
import time
import uuid
from pathlib import Path

import asyncpg
import nats
import uvloop
from nats.aio.client import Client
from nats.aio.msg import Msg

from benchkit import (
    CpuMeter,
    CpuUsage,
    Goals,
    cpu_table,
    latency_row,
    percentile,
    servers,
    service_env,
    start_services,
)
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
# Issue 12: append → first delta overhead, p99 ms, by concurrent sessions.
FIRST_DELTA_GOAL_MS = {50: 10.0, 200: 25.0}
PROJECT = "bench"
SERVICES = ("session_events", "handoff", "metering", "criativo")
# Sessions opened at once while setting a level up (not measured).
OPENING = 16
SETUP_TIMEOUT = 60.0
# Four services starting at once on a loaded 2-core machine can take minutes.
READY_TIMEOUT = 180.0

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


async def open_with_criativo(nc: Client, opening: asyncio.Semaphore) -> uuid.UUID:
    async with opening:
        opened = await call(
            nc,
            subjects.SESSIONS_OPEN,
            OpenSession(project_id=PROJECT, opened_by="user:bench"),
            SessionOpenedReply,
            timeout=SETUP_TIMEOUT,
        )
        session = opened.session_id
        await call(
            nc,
            subjects.AGENTS_ACTIVATE,
            ActivateAgent(
                project_id=PROJECT,
                session_id=session,
                agent="criativo",
                via="user",
                actor="user:b",
            ),
            ActivationReply,
            timeout=SETUP_TIMEOUT,
        )
    while True:  # the activation reaches the log through handoff's outbox
        events = await call(
            nc, subjects.EVENTS_LIST, ListEvents(session_id=session), EventsReply,
            timeout=SETUP_TIMEOUT,
        )  # fmt: skip
        if any(e.type.value == "agent.activated" for e in events.events):
            return session
        await asyncio.sleep(0.05)


# The stages of the turn start, in the order they happen: (name, from mark, to mark).
STAGES = (
    ("append (the log)", "sent", "appended"),
    ("log → bus (outbox relay)", "appended", "on_bus"),
    ("bus → llm.stream (Criativo)", "on_bus", "requested"),
    ("llm.stream → 1st delta (meter.)", "requested", "first"),
)


class Chat:
    """First-delta and per-token latencies of the sessions' turns, and when each turn
    passed the marks of `STAGES` (seconds, time.time(), by session)."""

    def __init__(self) -> None:
        self.first: dict[str, asyncio.Future[float]] = {}
        self.marks: dict[str, dict[str, float]] = {}
        self.stages_ms: dict[str, list[float]] = {name: [] for name, _, _ in STAGES}
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

    async def on_event(self, msg: Msg) -> None:
        """The `chat.message` on JetStream (`<type>.<project>.<session>`)."""
        self.marks.setdefault(msg.subject.rsplit(".", 1)[1], {}).setdefault("on_bus", time.time())

    async def on_stream_request(self, msg: Msg) -> None:
        """Criativo's `cmd.llm.stream` (run id `criativo.<session>`); a core subscriber
        outside the queue group sees a copy."""
        now = time.time()
        session = json.loads(msg.data)["run_id"].rsplit(".", 1)[1]
        self.marks.setdefault(session, {}).setdefault("requested", now)

    async def turn(self, nc: Client, session: uuid.UUID, delay_s: float) -> None:
        key = str(session)
        self.first[key] = asyncio.get_running_loop().create_future()
        marks = self.marks[key] = {}
        marks["sent"] = sent = time.time()
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
            timeout=SETUP_TIMEOUT,
        )
        marks["appended"] = time.time()
        first = await asyncio.wait_for(self.first[key], 120)
        marks["first"] = first - delay_s  # as if the provider answered at once
        self.first_delta_ms.append((first - sent - delay_s) * 1000)

    def count_stages(self) -> None:
        """Add each session's stage times of the round that ended."""
        for marks in self.marks.values():
            for name, start, end in STAGES:
                if start in marks and end in marks:
                    self.stages_ms[name].append((marks[end] - marks[start]) * 1000)
        self.marks.clear()


async def warm_up(nc: Client, delay_s: float) -> None:
    """One turn, not measured: each process's first turn pays its first uses (lazy
    imports, pool connections, pydantic's first serialisations), not what a turn costs."""
    session = await open_with_criativo(nc, asyncio.Semaphore(1))
    chat = Chat()
    chat.expected_done = 1
    subs = [
        await nc.subscribe(subjects.delta_subject(PROJECT, str(session)), cb=chat.on_delta),
        await nc.subscribe(subjects.done_subject(PROJECT, str(session)), cb=chat.on_done),
    ]
    await nc.flush()
    await chat.turn(nc, session, delay_s)
    await asyncio.wait_for(chat.all_done.wait(), 120)
    for s in subs:
        await s.unsubscribe()


async def measure_level(
    nc: Client, nats_url: str, level: int, tokens: int, delay_s: float, meter: CpuMeter
) -> tuple[list[str], float, CpuUsage]:
    """One level: the baseline, then two turns per session; the report lines, the first
    delta's p99 and the CPU per turn."""
    base = Receiver()
    base.expected = tokens
    sub = await nc.subscribe(f"{subjects.delta_subject('bench', '*')}", cb=base.on_msg)
    await nc.flush()
    await baseline(nats_url, base, level, level, tokens, delay_s)
    await sub.unsubscribe()
    opening = asyncio.Semaphore(OPENING)
    sessions = await asyncio.gather(*(open_with_criativo(nc, opening) for _ in range(level)))
    chat = Chat()
    subs = [
        await nc.subscribe(subjects.delta_subject(PROJECT, "*"), cb=chat.on_delta),
        await nc.subscribe(subjects.done_subject(PROJECT, "*"), cb=chat.on_done),
        await nc.subscribe(f"chat.message.{PROJECT}.*", cb=chat.on_event),
        await nc.subscribe(subjects.LLM_STREAM, cb=chat.on_stream_request),
    ]
    await nc.flush()
    await meter.start()
    started = time.perf_counter()
    # two turns per session, the second once the first ended (agent.done), so each level
    # also measures sessions whose actor is already alive
    for round_ in (1, 2):
        chat.expected_done, chat.all_done = level * round_, asyncio.Event()
        await asyncio.gather(*(chat.turn(nc, s, delay_s) for s in sessions))
        await asyncio.wait_for(chat.all_done.wait(), 120)
        chat.count_stages()
    cpu = await meter.stop(2 * level, time.perf_counter() - started)
    for s in subs:
        await s.unsubscribe()
    hop = base.samples.per_token_ms
    lines = [
        f"{level} concurrent session(s), {2 * level} turns:",
        row("baseline raw NATS hop", hop),
        row("per-token delivery", chat.per_token_ms, hop),
        row("append → first delta", chat.first_delta_ms, hop),
        *(row(f" {name}", values) for name, values in chat.stages_ms.items()),
    ]
    return lines, percentile(chat.first_delta_ms, 0.99), cpu


async def run(tokens: int, delay_ms: float, levels: list[int]) -> int:
    delay_s = delay_ms / 1000
    async with contextlib.AsyncExitStack() as stack:
        srv = stack.enter_context(servers("bench-chat-"))
        # Criativo's turns answer without tools, so one provider call is one turn.
        script = {"steps": [{"text": " ".join(f"w{i}" for i in range(tokens)),
                             "input_tokens": 100, "token_delay_ms": delay_ms}]}  # fmt: skip
        script_path = srv.state / "script.json"
        script_path.write_text(json.dumps(script))
        env = service_env(
            srv.nats_url,
            srv.admin_url,
            AGENTBUS_PROVIDER="scripted",
            AGENTBUS_SCRIPT_PATH=str(script_path),
            AGENTBUS_LOG_FORMAT="json",
            AGENTBUS_OUTBOX_POLL_SECONDS="0.2",
            AGENTBUS_SESSION_BUDGET_MICROS="100000000",
        )
        nc = await nats.connect(srv.nats_url)
        stack.push_async_callback(nc.close)
        procs = await start_services(stack, nc, env, srv.state, SERVICES, READY_TIMEOUT)
        pool = await asyncpg.create_pool(srv.admin_url, min_size=1, max_size=1)
        assert pool is not None
        stack.push_async_callback(pool.close)
        groups = {p.module: [p.pid] for p in procs}
        if srv.nats_pid is not None:
            groups["nats"] = [srv.nats_pid]
        roles = [*groups, "postgres"]
        print(f"chat bench: {tokens} tokens per turn, one every {delay_ms} ms; "
              f"{os.cpu_count()} cores")  # fmt: skip
        await warm_up(nc, delay_s)
        goals, cpu_rows = Goals(), []
        for level in levels:
            meter = CpuMeter(groups, pool)
            lines, p99, cpu = await measure_level(nc, srv.nats_url, level, tokens, delay_s, meter)
            print("\n".join(lines), flush=True)
            cpu_rows.append(("per turn", level, cpu))
            if level in FIRST_DELTA_GOAL_MS:
                goals.at_most(f"append → first delta p99 ms at {level} sessions", p99,
                              FIRST_DELTA_GOAL_MS[level])  # fmt: skip
        print("\n".join(cpu_table(roles, cpu_rows, name_width=9)))
        print("goals:")
        print("\n".join(goals.report()))
        return goals.exit_code


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tokens", type=int, default=20)
    parser.add_argument("--delay-ms", type=float, default=20.0)
    parser.add_argument("--levels", default=",".join(map(str, LEVELS)), help="e.g. 1,50")
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    sys.exit(uvloop.run(run(args.tokens, args.delay_ms, levels)))


if __name__ == "__main__":
    main()
