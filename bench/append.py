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
whole machine's. A machine near `nproc` is CPU-bound and the split says where the time goes; a
machine figure far above ours means something else ran. Absolute figures drift: read ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import nats
import uvloop
from nats.aio.client import Client
from nats.aio.msg import Msg
from pydantic import BaseModel

from contracts import subjects
from contracts.events import Event, EventType
from contracts.session_events import AppendEvent, OpenSession, SessionOpenedReply
from servicekit.client import call
from servicekit.embedded import start_nats, start_postgres
from servicekit.settings import ServiceSettings
from servicekit.testing import ServiceProcess

SERVICE, PROJECT, ACTOR, CHAT = "session_events", "bench", "user:bench", EventType.CHAT_MESSAGE
TEXT = "Could the onboarding flow remember where the person stopped last time? " * 2
TARGET_RATE, TARGET_PRODUCERS = 2000, 32
TICK = os.sysconf("SC_CLK_TCK")
ROLES = ("client", "service", "echo", "postgres", "nats")
Op = Callable[[int], Awaitable[bool]]  # one operation of producer i; False = an error reply


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


def percentile_ms(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000 if ordered else 0.0


def proc_stat(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name: state, ppid, …"""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pids: list[int]) -> dict[int, float]:
    """CPU seconds each live process has run (all its threads), plus those of the children it
    reaped: the postmaster reaps the backends asyncpg recycles every 50,000 queries."""
    seconds: dict[int, float] = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            tasks = Path(f"/proc/{pid}/task").iterdir()
            ran = sum(int((t / "schedstat").read_text().split()[0]) for t in tasks) / 1e9
            reaped = proc_stat(pid)[13:15]
            seconds[pid] = ran + (int(reaped[0]) + int(reaped[1])) / TICK
    return seconds


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent not idle (nor waiting on I/O) since boot."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / TICK


def wire(model: BaseModel) -> bytes:
    return model.model_dump_json().encode()


def is_postgres(pid: int) -> bool:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/comm").read_text().startswith("postgres")
    return False


@dataclass
class Bench:
    nc: Client
    pool: asyncpg.Pool
    pids: dict[str, list[int]]  # process groups whose CPU is sampled (postgres: per row)
    replied: dict[str, float] = field(default_factory=dict)  # event id -> reply received
    arrived: dict[str, float] = field(default_factory=dict)  # event id -> seen on the bus
    appended: int = 0

    async def postgres_pids(self) -> list[int]:
        """The backends, when on this machine, and their postmaster."""
        rows = await self.pool.fetch("SELECT pid FROM pg_stat_activity")
        backends = [r["pid"] for r in rows if is_postgres(r["pid"])]
        return [*backends, int(proc_stat(backends[0])[1])] if backends else []

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

    async def run(self, scenario: str, producers: int, op: Op, duration: float) -> Row:
        await self.loop(op, producers, min(1.0, duration / 5))  # warm-up, not counted
        self.replied.clear()
        self.arrived.clear()
        pids = {**self.pids, "postgres": await self.postgres_pids()}
        before, machine = {k: cpu_seconds(v) for k, v in pids.items()}, machine_busy_seconds()
        latencies, errors, seconds = await self.loop(op, producers, duration)
        machine = machine_busy_seconds() - machine
        after = {k: cpu_seconds(v) for k, v in pids.items()}
        # backends started meanwhile count whole; those that ended are in the postmaster's sum
        new = [p for p in await self.postgres_pids() if p not in before["postgres"]]
        before["postgres"] |= dict.fromkeys(new, 0.0)
        after["postgres"] |= cpu_seconds(new)
        cpu = {k: sum(after[k].get(p, 0.0) - t for p, t in before[k].items()) for k in pids}
        per_op = {k: round(c * 1000 / max(len(latencies), 1), 3) for k, c in cpu.items() if c}
        p50, p99 = percentile_ms(latencies, 0.5), percentile_ms(latencies, 0.99)
        row = Row(scenario, producers, len(latencies), errors, seconds, p50, p99, per_op)
        row.cores_ours, row.cores_machine = sum(cpu.values()) / seconds, machine / seconds
        if self.replied:  # wait for the relay to publish what was acknowledged, then pair up
            deadline = time.monotonic() + 10
            while self.replied.keys() - self.arrived.keys() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            pairs = self.replied.items()
            lags = sorted(self.arrived[k] - t for k, t in pairs if k in self.arrived)
            row.lag_p50_ms, row.lag_p99_ms = percentile_ms(lags, 0.5), percentile_ms(lags, 0.99)
        return row

    @staticmethod
    async def loop(op: Op, producers: int, seconds: float) -> tuple[list[float], int, float]:
        ok: list[float] = []
        failed: list[float] = []  # error replies, timeouts, no responders: counted, not fatal
        deadline = time.perf_counter() + seconds

        async def producer(i: int) -> None:
            while (start := time.perf_counter()) < deadline:
                try:
                    done = await op(i)
                except Exception:
                    done = False
                (ok if done else failed).append(time.perf_counter() - start)

        begin = time.perf_counter()
        await asyncio.gather(*(producer(i) for i in range(producers)))
        return sorted(ok), len(failed), time.perf_counter() - begin


async def echo(url: str, subject: str) -> None:
    """The responder of the `hop` baseline (this script run again with `--echo`)."""
    nc = await nats.connect(url)

    async def answer(msg: Msg) -> None:
        await msg.respond(msg.data)

    await nc.subscribe(subject, queue="echo", cb=answer)
    await asyncio.Event().wait()


async def measure(
    args: argparse.Namespace, nats_url: str, admin_url: str, nats_pid: int | None, logs: Path
) -> tuple[list[Row], dict[str, int]]:
    name, tag = f"bench_{uuid.uuid4().hex[:10]}", uuid.uuid4().hex[:8]
    echo_subject = f"bench.echo.{tag}"
    db_url = urlunsplit(urlsplit(admin_url)._replace(path=f"/{name}"))
    env = {**os.environ, "NATS_URL": nats_url, "DATABASE_URL": db_url}
    env["AGENTBUS_LOG_LEVEL"] = "WARNING"
    async with contextlib.AsyncExitStack() as stack:  # undone in reverse order
        admin = await asyncpg.connect(admin_url)
        stack.push_async_callback(admin.close)
        await admin.execute(f'CREATE DATABASE "{name}"')
        stack.push_async_callback(admin.execute, f'DROP DATABASE "{name}" WITH (FORCE)')
        nc = await nats.connect(nats_url)
        stack.push_async_callback(nc.close)
        js = nc.jetstream()
        await js.add_stream(name=f"BENCH_{tag}", subjects=[f"bench.{tag}.>"])
        stack.push_async_callback(js.delete_stream, f"BENCH_{tag}")
        size = ServiceSettings().db_pool_max
        pool = await asyncpg.create_pool(db_url, min_size=size, max_size=size)
        stack.push_async_callback(pool.close)
        services = [
            ServiceProcess(SERVICE, env, logs / f"service-{i}.log") for i in range(args.replicas)
        ]
        for proc in services:
            stack.callback(proc.start().kill, signal.SIGTERM)
        echoer = subprocess.Popen([sys.executable, __file__, "--echo", echo_subject], env=env)
        stack.callback(echoer.wait)
        stack.callback(echoer.terminate)
        for proc in services:
            await proc.wait_ready(nc, SERVICE)
        for _ in range(400):  # until the echo responder answers
            with contextlib.suppress(Exception):
                await nc.request(echo_subject, b"ping", timeout=0.5)
                break
            await asyncio.sleep(0.05)
        await pool.execute(
            "CREATE TABLE bench_rows (id uuid PRIMARY KEY, seq bigint, type text, payload jsonb)"
        )
        pids = {"client": [os.getpid()], "service": [p.pid for p in services]}
        pids |= {"echo": [echoer.pid], "nats": [nats_pid] if nats_pid else []}
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
            rows += [await bench.run(label, n, op, args.duration) for label, op in ops.items()]
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


def report(rows: list[Row], check: dict[str, int]) -> str:
    base = {(r.scenario, r.producers): r for r in rows if not r.scenario.startswith("append")}
    lines = [
        f"{'scenario':<13}{'prod':>5}{'ops/s':>8}{'p50 ms':>8}{'p99 ms':>8}{'err':>5} |"
        f"{'÷pg':>6}{'÷js':>6}{'÷hop':>6} |{'p50÷pg':>7}{'p50÷js':>7}{'p50÷hop':>8} |"
        f"{'lag p50':>8}{'p99':>7}"
    ]
    for r in rows:
        line = f"{r.scenario:<13}{r.producers:>5}{r.rate:>8.0f}{r.p50_ms:>8.2f}{r.p99_ms:>8.2f}"
        line += f"{r.errors:>5} |"
        if r.scenario.startswith("append"):
            b = [base[(s, r.producers)] for s in ("pg", "js", "hop")]
            line += "".join(f"{r.rate / x.rate:6.2f}" for x in b) + " |"
            line += "".join(f"{r.p50_ms / x.p50_ms:7.2f}" for x in b) + " |"
            line += f"{r.lag_p50_ms or 0:>8.2f}{r.lag_p99_ms or 0:>7.2f}"
        lines.append(line)
    roles = [k for k in ROLES if any(k in r.cpu_ms_per_op for r in rows)]
    lines += ["", f"{'CPU ms per op':<18}" + "".join(f"{k:>9}" for k in [*roles, "total"])]
    lines[-1] += f"   cores busy: ours / machine ({os.cpu_count()})"
    for r in rows:
        cpu = [r.cpu_ms_per_op.get(k, 0) for k in roles]
        line = f"{r.scenario:<13}{r.producers:>5}" + "".join(f"{c:>9.3f}" for c in cpu)
        lines.append(line + f"{sum(cpu):>9.3f}{r.cores_ours:>15.2f} /{r.cores_machine:>5.2f}")
    good = check["events"] == check["expected"] and not check["sessions_with_gaps"]
    lines += [
        "",
        f"check: {check['events']} events in the log, {check['expected']} expected (successful "
        f"appends + opens), {check['sessions_with_gaps']} sessions with seq gaps, "
        f"{check['outbox_left']} outbox rows left: {'OK' if good else 'MISMATCH'}",
    ]
    at = next((r for r in rows if (r.scenario, r.producers) == ("append", TARGET_PRODUCERS)), None)
    verdict = "not measured" if at is None else "MET" if at.rate >= TARGET_RATE else "NOT MET"
    reached = f" ({at.rate:.0f} appends/s, {at.rate / TARGET_RATE:.0%})" if at else ""
    target = f"target {TARGET_RATE} appends/s at {TARGET_PRODUCERS} producers"
    lines.append(f"{target}: {verdict}{reached}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description="Append throughput of session_events.")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    levels = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    parser.add_argument("--producers", type=levels, default=[1, 8, 32], help="e.g. 1,8,32")
    parser.add_argument("--replicas", type=int, default=1, help="service processes")
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")
    parser.add_argument("--echo", help=argparse.SUPPRESS)  # internal: be the echo responder
    args = parser.parse_args()
    if args.echo:
        uvloop.run(echo(os.environ["NATS_URL"], args.echo))
        return
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="agentbus-bench-")))
        nats_url, pg_url = os.environ.get("NATS_URL"), os.environ.get("DATABASE_URL")
        nats_pid = None
        if not nats_url:
            nats_server = start_nats(tmp)
            stack.callback(nats_server.stop)
            nats_url, nats_pid = nats_server.url, nats_server.process.pid
        if not pg_url:
            pg_server = start_postgres(tmp)
            stack.callback(pg_server.stop)
            pg_url = pg_server.url
        rows, check = uvloop.run(measure(args, nats_url, pg_url, nats_pid, tmp))
    print(report(rows, check))
    if args.json:
        results = [asdict(r) | {"ops_per_s": r.rate} for r in rows]
        target = {"appends_per_s": TARGET_RATE, "producers": TARGET_PRODUCERS}
        print(json.dumps({"rows": results, "check": check, "target": target}))


if __name__ == "__main__":
    main()
