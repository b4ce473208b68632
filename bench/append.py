"""Append throughput and latency of session_events, with baselines measured in the same run.

Closed-loop producers (each sends its next operation after the previous reply), per level:
  append        `cmd.events.append` of a `chat.message` to `python -m session_events`
                subprocess(es), one session per producer, sent as pre-serialised bytes with
                raw `nc.request` (no client-side pydantic or trace headers);
  append-1sess  all producers on ONE session, whose row lock (FOR UPDATE) serialises them;
  pg            asyncpg BEGIN; INSERT (uuid, bigint, text, jsonb); COMMIT; pool as the service's;
  js            raw `js.publish` with ack of an Event-sized message to a throwaway file stream;
  hop           raw core NATS request/reply to an echo responder in its own uvloop process.
`÷pg ÷js ÷hop` = appends/s ÷ that baseline's ops/s at the same concurrency, `p50÷…` = append p50
÷ baseline p50, `lag` = reply received → event seen on the bus (what the outbox relay adds).
The CPU table: CPU ms per operation of each process group (/proc) and cores busy, ours and the
whole machine's, and `÷pg` the total CPU per append ÷ the CPU per `pg` insert. A machine near
`nproc` is CPU-bound and the split says where the time goes; a machine figure far above ours
means something else ran. Absolute figures drift: read ratios.

Goal: appends/s ≥ 1.0× `pg` at 32 producers (stretch 2×); the script exits 1 when
it is missed or the log's invariants do not hold. `--py-spy DIR` profiles the (first) service
process during the `append` run at the most producers and prints its top frames.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import nats
import uvloop
from nats.aio.client import Client
from nats.aio.msg import Msg

from benchkit import (
    Col,
    CpuMeter,
    CpuUsage,
    Op,
    Servers,
    closed_loop,
    cpu_table,
    fresh_database,
    percentile,
    py_spy,
    servers,
    service_env,
    start_services,
    table,
    top_frames,
    wire,
)
from contracts import subjects
from contracts.events import Event, EventType
from contracts.session_events import AppendEvent, OpenSession, SessionOpenedReply
from servicekit.client import call
from servicekit.settings import ServiceSettings

SERVICE, PROJECT, ACTOR, CHAT = "session_events", "bench", "user:bench", EventType.CHAT_MESSAGE
TEXT = "Could the onboarding flow remember where the person stopped last time? " * 2
TARGET_RATIO, STRETCH_RATIO, TARGET_PRODUCERS = 1.0, 2.0, 32
ROLES = ("client", "service", "echo", "postgres", "nats")


@dataclass
class Row:
    scenario: str
    producers: int
    ops: int
    errors: int
    seconds: float
    p50_ms: float
    p99_ms: float
    cpu_ms_per_op: dict[str, float] = field(default_factory=dict)
    cores_ours: float = 0.0
    cores_machine: float = 0.0
    lag_p50_ms: float | None = None
    lag_p99_ms: float | None = None

    @property
    def rate(self) -> float:
        return self.ops / self.seconds


@dataclass
class Bench:
    nc: Client
    pool: asyncpg.Pool
    pids: dict[str, list[int]]  # process groups whose CPU is sampled (postgres: per row)
    replied: dict[str, float] = field(default_factory=dict)  # event id -> reply received
    arrived: dict[str, float] = field(default_factory=dict)  # event id -> seen on the bus
    appended: int = 0

    async def seen(self, msg: Msg) -> None:
        if msg.headers:
            self.arrived[msg.headers["Nats-Msg-Id"]] = time.perf_counter()

    def append_op(self, bodies: list[bytes]) -> Op:
        async def op(i: int) -> bool:
            msg = await self.nc.request(subjects.EVENTS_APPEND, bodies[i], timeout=10)
            if msg.data.startswith(b'{"error"'):
                return False
            self.replied[json.loads(msg.data)["event_id"]] = time.perf_counter()
            self.appended += 1
            return True

        return op

    async def run(
        self, scenario: str, producers: int, op: Op, duration: float, profile: Path | None = None
    ) -> Row:
        await closed_loop(op, producers, min(1.0, duration / 5))  # warm-up, not counted
        self.replied.clear()
        self.arrived.clear()
        meter = CpuMeter(self.pids, self.pool)
        await meter.start()
        with py_spy(self.pids["service"][0], profile) if profile else contextlib.nullcontext():
            result = await closed_loop(op, producers, duration)
        cpu = await meter.stop(len(result.latencies), result.seconds)
        row = Row(scenario, producers, len(result.latencies), result.errors, result.seconds,
                  result.p_ms(0.5), result.p_ms(0.99), cpu.ms_per_op)  # fmt: skip
        row.cores_ours, row.cores_machine = cpu.cores_ours, cpu.cores_machine
        if self.replied:  # wait for the relay to publish what was acknowledged, then pair up
            deadline = time.monotonic() + 10
            while self.replied.keys() - self.arrived.keys() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            pairs = self.replied.items()
            lags = sorted(self.arrived[k] - t for k, t in pairs if k in self.arrived)
            row.lag_p50_ms = percentile(lags, 0.5, empty=0.0) * 1000
            row.lag_p99_ms = percentile(lags, 0.99, empty=0.0) * 1000
        return row


async def echo(url: str, subject: str) -> None:
    """The responder of the `hop` baseline (this script run again with `--echo`)."""
    nc = await nats.connect(url)

    async def answer(msg: Msg) -> None:
        await msg.respond(msg.data)

    await nc.subscribe(subject, queue="echo", cb=answer)
    await asyncio.Event().wait()


async def measure(args: argparse.Namespace, srv: Servers) -> tuple[list[Row], dict[str, int]]:
    tag = uuid.uuid4().hex[:8]
    echo_subject = f"bench.echo.{tag}"
    async with contextlib.AsyncExitStack() as stack:  # undone in reverse order
        db_url = await stack.enter_async_context(fresh_database(srv.admin_url))
        env = service_env(srv.nats_url, db_url)
        nc = await nats.connect(srv.nats_url)
        stack.push_async_callback(nc.close)
        js = nc.jetstream()
        await js.add_stream(name=f"BENCH_{tag}", subjects=[f"bench.{tag}.>"])
        stack.push_async_callback(js.delete_stream, f"BENCH_{tag}")
        size = ServiceSettings().db_pool_max
        pool = await asyncpg.create_pool(db_url, min_size=size, max_size=size)
        stack.push_async_callback(pool.close)
        # This script again, so its own folder (benchkit) must stay on the path.
        script_env = {k: v for k, v in env.items() if k != "PYTHONSAFEPATH"}
        echoer = subprocess.Popen(
            [sys.executable, __file__, "--echo", echo_subject], env=script_env
        )
        stack.callback(echoer.wait)
        stack.callback(echoer.terminate)
        services = await start_services(stack, nc, env, srv.state, [SERVICE] * args.replicas)
        for _ in range(400):  # until the echo responder answers
            with contextlib.suppress(Exception):
                await nc.request(echo_subject, b"ping", timeout=0.5)
                break
            await asyncio.sleep(0.05)
        await pool.execute(
            "CREATE TABLE bench_rows (id uuid PRIMARY KEY, seq bigint, type text, payload jsonb)"
        )
        pids = {"client": [os.getpid()], "service": [p.pid for p in services]}
        pids |= {"echo": [echoer.pid], "nats": [srv.nats_pid] if srv.nats_pid else []}
        bench = Bench(nc, pool, pids)
        await nc.subscribe(f"{CHAT.value}.{PROJECT}.*", cb=bench.seen)

        most = max(args.producers)
        opening = OpenSession(project_id=PROJECT, opened_by=ACTOR)
        sessions = [
            (await call(nc, subjects.SESSIONS_OPEN, opening, SessionOpenedReply)).session_id
            for _ in range(most)
        ]
        fields: dict[str, Any] = {"type": CHAT.value, "actor": ACTOR, "payload": {"text": TEXT}}
        bodies = [wire(AppendEvent.model_validate({**fields, "session_id": s})) for s in sessions]
        fields |= {"id": uuid.uuid4(), "session_id": sessions[0], "project_id": PROJECT, "seq": 1}
        event = wire(Event.model_validate({**fields, "created_at": datetime.now(UTC)}))
        row_json = json.dumps(fields["payload"])

        async def pg(i: int) -> bool:
            async with pool.acquire() as conn, conn.transaction():
                insert = "INSERT INTO bench_rows VALUES ($1, $2, $3, $4::jsonb)"
                await conn.execute(insert, uuid.uuid4(), i, CHAT.value, row_json)
            return True

        async def jetstream(i: int) -> bool:
            await js.publish(f"bench.{tag}.{i}", event)
            return True

        async def hop(i: int) -> bool:
            await nc.request(echo_subject, bodies[i], timeout=10)
            return True

        rows: list[Row] = []
        for n in args.producers:
            ops = {"append": bench.append_op(bodies), "pg": pg, "js": jetstream, "hop": hop}
            for label, op in ops.items():
                spied = args.py_spy and label == "append" and n == most
                profile = Path(args.py_spy) / "append-service.txt" if spied else None
                rows.append(await bench.run(label, n, op, args.duration, profile))
        one_session = bench.append_op(bodies[:1] * most)
        rows.append(await bench.run("append-1sess", most, one_session, args.duration))

        for _ in range(200):  # let the relays drain before checking
            if not await pool.fetchval("SELECT count(*) FROM session_events.outbox"):
                break
            await asyncio.sleep(0.05)
        check = await pool.fetchrow(
            """SELECT (SELECT count(*) FROM session_events.events) AS events,
                      (SELECT count(*) FROM session_events.outbox) AS outbox_left,
                      (SELECT count(*) FROM (SELECT FROM session_events.events GROUP BY session_id
                         HAVING min(seq) <> 1 OR max(seq) <> count(*)) g) AS sessions_with_gaps"""
        )
        assert check is not None
        return rows, {**dict(check), "expected": bench.appended + len(sessions)}


def report(rows: list[Row], check: dict[str, int]) -> tuple[str, bool]:
    """The tables and the verdict; True when the goal is met and the log checks out."""
    base = {(r.scenario, r.producers): r for r in rows if not r.scenario.startswith("append")}
    groups = [
        [Col("scenario", 13, left=True), Col("prod", 5), Col("ops/s", 8, ".0f"),
         Col("p50 ms", 8, ".2f"), Col("p99 ms", 8, ".2f"), Col("err", 5)],
        [Col("÷pg", 6, ".2f"), Col("÷js", 6, ".2f"), Col("÷hop", 6, ".2f")],
        [Col("p50÷pg", 7, ".2f"), Col("p50÷js", 7, ".2f"), Col("p50÷hop", 8, ".2f")],
        [Col("lag p50", 8, ".2f"), Col("p99", 7, ".2f")],
    ]  # fmt: skip
    cells: list[list[list[object]]] = []
    for r in rows:
        cells.append([[r.scenario, r.producers, r.rate, r.p50_ms, r.p99_ms, r.errors]])
        if r.scenario.startswith("append"):
            b = [base[(s, r.producers)] for s in ("pg", "js", "hop")]
            cells[-1] += [[r.rate / x.rate for x in b], [r.p50_ms / x.p50_ms for x in b]]
            cells[-1].append([r.lag_p50_ms or 0, r.lag_p99_ms or 0])
    lines = table(groups, cells)
    roles = [k for k in ROLES if any(k in r.cpu_ms_per_op for r in rows)]
    usage = [
        (r.scenario, r.producers, CpuUsage(r.cpu_ms_per_op, r.cores_ours, r.cores_machine))
        for r in rows
    ]
    lines += ["", *cpu_table(roles, usage)]
    cpu_ratios = [
        f"{r.scenario} {r.producers}: {sum(r.cpu_ms_per_op.values()) / pg_cpu:.2f}"
        for r in rows
        if r.scenario.startswith("append")
        and (pg_cpu := sum(base[("pg", r.producers)].cpu_ms_per_op.values()))
    ]
    lines.append("CPU per append ÷ CPU per pg insert: " + ", ".join(cpu_ratios))
    good = check["events"] == check["expected"] and not check["sessions_with_gaps"]
    lines += [
        "",
        f"check: {check['events']} events in the log, {check['expected']} expected (successful "
        f"appends + opens), {check['sessions_with_gaps']} sessions with seq gaps, "
        f"{check['outbox_left']} outbox rows left: {'OK' if good else 'MISMATCH'}",
    ]
    at = next((r for r in rows if (r.scenario, r.producers) == ("append", TARGET_PRODUCERS)), None)
    ratio = at.rate / base[("pg", TARGET_PRODUCERS)].rate if at else 0.0
    met = at is not None and ratio >= TARGET_RATIO
    verdict = "not measured" if at is None else "MET" if met else "NOT MET"
    stretch = " (stretch 2× met)" if ratio >= STRETCH_RATIO else ""
    lines.append(
        f"goal: appends ≥ {TARGET_RATIO:.1f}× pg at {TARGET_PRODUCERS} producers: "
        f"{verdict}, {ratio:.2f}×{stretch}"
    )
    return "\n".join(lines), met and good


def main() -> None:
    parser = argparse.ArgumentParser(description="Append throughput of session_events.")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    levels = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    parser.add_argument("--producers", type=levels, default=[1, 8, 32], help="e.g. 1,8,32")
    parser.add_argument("--replicas", type=int, default=1, help="service processes")
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")
    parser.add_argument("--py-spy", metavar="DIR", help="profile the service into DIR")
    parser.add_argument("--echo", help=argparse.SUPPRESS)  # internal: be the echo responder
    args = parser.parse_args()
    if args.echo:
        uvloop.run(echo(os.environ["NATS_URL"], args.echo))
        return
    with servers() as srv:
        rows, check = uvloop.run(measure(args, srv))
    text, ok = report(rows, check)
    print(text)
    if args.py_spy:
        print("\npy-spy, the service during `append` at the most producers:")
        print("\n".join(top_frames(Path(args.py_spy) / "append-service.txt")))
    if args.json:
        results = [asdict(r) | {"ops_per_s": r.rate} for r in rows]
        target = {"ratio_to_pg": TARGET_RATIO, "producers": TARGET_PRODUCERS}
        print(json.dumps({"rows": results, "check": check, "target": target}))
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
