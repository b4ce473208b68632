"""Handoff offers per second and their latency, with a baseline measured in the same run.

`python -m session_events` and `python -m handoff` run as their own processes; closed-loop
clients (each sends its next offer after the previous reply) send `cmd.handoffs.offer` as
pre-serialised bytes with raw `nc.request`. Every scenario has a project of its own:
  offer-1t        all clients offer to ONE target (`criativo` → `po`); each client alternates
                  between two sessions of its own, so every offer creates a row and supersedes
                  the pending one (ADR 0182 decision 2): the worst case, every offer serialised
                  on the target's advisory lock and writing two rows and two outbox entries;
  offer-1t-same   all clients offer to one target from ONE session with no artifact: after the
                  first, every offer is `ja_oferecido` (lock and reads, nothing written);
  offer-<T>t      client i offers to target i mod T (`dev-lead` → `dev-mNN`), alternating its
                  two sessions as in offer-1t: the lock is contended T ways instead of one;
  pg-lock-1t      the baseline: an asyncpg pool as large as the service's, BEGIN; SELECT
  pg-lock-<T>t    pg_advisory_xact_lock(hashtextextended('handoff:<project>:<target>', 0));
                  INSERT one row into a scratch table; COMMIT — for one target and for T.
`÷base` = offers/s ÷ the baseline's at the same number of targets, `p50÷`, `p99÷` the latency
ratios. `created`/`superseded`/`ja_oferecido` count the replies' outcomes; `backlog` is the
handoff outbox left when the clients stopped and `drain s` how long its relay took to append
it to the log. The CPU table splits each operation's CPU between the processes, and puts our
cores next to the whole machine's (2 cores, shared: read the ratios, not the absolutes).
At the end the handoff schema is checked: no (project, target) has more than one `offered`
row, the outbox drained, and the log holds one `handoff.offered` event per handoff row and one
`handoff.superseded` event per superseded row.

Goal: offer-1t and offer-<T>t ≥ 0.5× their baseline; the script exits 1 when a
goal is missed or a check fails. `--py-spy DIR` profiles the handoff and session_events
processes during one scenario (`--profile`, offer-1t by default) and prints their top frames.

    .venv/bin/python bench/handoff.py [--duration 5] [--clients 64] [--targets 50] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import nats
import uvloop
from nats.aio.client import Client

from benchkit import (
    Col,
    CpuMeter,
    CpuUsage,
    Op,
    Servers,
    closed_loop,
    cpu_table,
    fresh_database,
    load_average,
    py_spy,
    ratio,
    servers,
    service_env,
    start_services,
    table,
    top_frames,
    wire,
)
from contracts import subjects
from contracts.handoff import OfferHandoff
from contracts.session_events import OpenSession, SessionOpenedReply
from servicekit.client import call
from servicekit.settings import ServiceSettings

SERVICES = ("session_events", "handoff")
ROLES = ("client", "session_events", "handoff", "postgres", "nats")
OPENER = "user:bench"
DRAIN_TIMEOUT = 180.0
GOAL_RATIO = 0.5  # offers/s ÷ the bare lock transaction's, at 1 and at T targets
SCRATCH = """CREATE TABLE bench_offers (
    id uuid PRIMARY KEY, project_id text NOT NULL, to_agent text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now())"""
LOCK = "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))"
INSERT = "INSERT INTO bench_offers (id, project_id, to_agent) VALUES ($1, $2, $3)"


@dataclass
class Row:
    scenario: str
    clients: int
    targets: int
    ops: int
    errors: int
    seconds: float
    p50_ms: float
    p99_ms: float
    baseline: str | None = None  # the row this one is divided by
    outcomes: dict[str, int] = field(default_factory=dict)
    error_codes: dict[str, int] = field(default_factory=dict)
    backlog: int | None = None  # handoff outbox rows when the clients stopped
    drain_s: float | None = None  # until the relay had appended them all
    cpu_ms_per_op: dict[str, float] = field(default_factory=dict)
    cores_ours: float = 0.0
    cores_machine: float = 0.0

    @property
    def rate(self) -> float:
        return self.ops / self.seconds


def targets_of(n: int) -> tuple[str, list[str]]:
    """Who offers, and to whom: Criativo to the PO for one target; for several, the
    development lead to its sub-agents (ADR 0038 lets a lead hand off inside its area)."""
    return ("criativo", ["po"]) if n == 1 else ("dev-lead", [f"dev-m{k:02d}" for k in range(n)])


@dataclass
class Bench:
    nc: Client
    pool: asyncpg.Pool
    pids: dict[str, list[int]]
    clients: int
    duration: float
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    outcomes: Counter[str] = field(default_factory=Counter)
    error_codes: Counter[str] = field(default_factory=Counter)
    replied: Counter[str] = field(default_factory=Counter)  # every outcome, warm-ups included

    async def open_sessions(self, project: str, n: int) -> list[uuid.UUID]:
        opening = OpenSession(project_id=project, opened_by=OPENER)
        replies = await asyncio.gather(
            *(call(self.nc, subjects.SESSIONS_OPEN, opening, SessionOpenedReply) for _ in range(n))
        )
        return [r.session_id for r in replies]

    async def offer_bodies(
        self, project: str, targets: int, sessions_per_client: int
    ) -> list[list[bytes]]:
        """Each client's offers, taken in turn: with two sessions per client, every offer
        finds its target's pending offer in another session and supersedes it; with none,
        every client shares one session and finds its own offer pending."""
        source, names = targets_of(targets)
        shared = sessions_per_client == 0
        count = 1 if shared else self.clients * sessions_per_client
        sessions = await self.open_sessions(project, count)

        def body(session: uuid.UUID, target: str) -> bytes:
            cmd = OfferHandoff(
                project_id=project, session_id=session, from_agent=source, to_agent=target
            )
            return wire(cmd)

        if shared:
            return [[body(sessions[0], names[0])] for _ in range(self.clients)]
        k = sessions_per_client
        return [
            [body(s, names[i % targets]) for s in sessions[i * k : (i + 1) * k]]
            for i in range(self.clients)
        ]

    def offer_op(self, bodies: list[list[bytes]]) -> Op:
        turns = [0] * len(bodies)

        async def op(i: int) -> bool:
            mine = bodies[i]
            turns[i] += 1
            msg = await self.nc.request(
                subjects.HANDOFFS_OFFER, mine[turns[i] % len(mine)], timeout=10
            )
            data = msg.data
            if data.startswith(b'{"error"'):
                self.error_codes[json.loads(data)["error"]["code"]] += 1
                return False
            at = data.rfind(b'"outcome":"') + len(b'"outcome":"')
            outcome = data[at : data.index(b'"', at)].decode()
            self.outcomes[outcome] += 1
            self.replied[outcome] += 1
            return True

        return op

    def lock_op(self, project: str, targets: int) -> Op:
        _, names = targets_of(targets)

        async def op(i: int) -> bool:
            target = names[i % targets]
            async with self.pool.acquire() as conn, conn.transaction():
                await conn.execute(LOCK, f"handoff:{project}:{target}")
                await conn.execute(INSERT, uuid.uuid4(), project, target)
            return True

        return op

    async def run(
        self, scenario: str, targets: int, op: Op, offers: bool, profile: Path | None = None
    ) -> Row:
        await closed_loop(op, self.clients, min(1.0, self.duration / 5))  # warm-up, not counted
        if offers:
            await self.drained()
        self.outcomes.clear()
        self.error_codes.clear()
        meter = CpuMeter(self.pids, self.pool)
        await meter.start()
        async with contextlib.AsyncExitStack() as spies:
            for module in SERVICES if profile else ():
                assert profile is not None
                spies.enter_context(py_spy(self.pids[module][0], profile / f"{module}.txt"))
            result = await closed_loop(op, self.clients, self.duration)
        cpu = await meter.stop(len(result.latencies), result.seconds)
        row = Row(
            scenario, self.clients, targets, len(result.latencies), result.errors,
            result.seconds, result.p_ms(0.5), result.p_ms(0.99),
            outcomes=dict(self.outcomes), error_codes=dict(self.error_codes),
            cpu_ms_per_op=cpu.ms_per_op, cores_ours=cpu.cores_ours,
            cores_machine=cpu.cores_machine,
        )  # fmt: skip
        if offers:
            stopped = time.perf_counter()
            row.backlog = await self.outbox_rows()
            await self.drained()
            row.drain_s = time.perf_counter() - stopped
        return row

    async def outbox_rows(self) -> int:
        return int(await self.pool.fetchval("SELECT count(*) FROM handoff.outbox"))

    async def drained(self) -> None:
        """Wait until the relay appended every committed offer's events to the log."""
        deadline = time.monotonic() + DRAIN_TIMEOUT
        while await self.outbox_rows() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


async def check(pool: asyncpg.Pool) -> dict[str, int]:
    """The one-pending invariant and the outbox's delivery, from the stores themselves."""
    row = await pool.fetchrow(
        """SELECT
             (SELECT count(*) FROM (SELECT FROM handoff.handoffs WHERE status = 'offered'
                 GROUP BY project_id, to_agent HAVING count(*) > 1) g) AS targets_over_one,
             (SELECT count(DISTINCT (project_id, to_agent)) FROM handoff.handoffs) AS targets,
             (SELECT count(*) FROM handoff.handoffs WHERE status = 'offered') AS offered_rows,
             (SELECT count(*) FROM handoff.handoffs) AS handoffs,
             (SELECT count(*) FROM handoff.handoffs WHERE status = 'superseded') AS superseded,
             (SELECT count(*) FROM session_events.events
               WHERE type = 'handoff.offered') AS offered_events,
             (SELECT count(*) FROM session_events.events
               WHERE type = 'handoff.superseded') AS superseded_events,
             (SELECT count(*) FROM handoff.outbox) AS outbox_left,
             (SELECT count(*) FROM handoff.dead_letters) AS dead_letters"""
    )
    assert row is not None
    return dict(row)


async def measure(args: argparse.Namespace, srv: Servers) -> tuple[list[Row], dict[str, Any]]:
    async with contextlib.AsyncExitStack() as stack:  # undone in reverse order
        db_url = await stack.enter_async_context(fresh_database(srv.admin_url))
        env = service_env(srv.nats_url, db_url)
        nc = await nats.connect(srv.nats_url)
        stack.push_async_callback(nc.close)
        size = ServiceSettings().db_pool_max  # the baseline's pool is as large as the service's
        pool = await asyncpg.create_pool(db_url, min_size=size, max_size=size)
        stack.push_async_callback(pool.close)
        procs = await start_services(stack, nc, env, srv.state, SERVICES)
        await pool.execute(SCRATCH)
        pids = {"client": [os.getpid()], **{p.module: [p.pid] for p in procs}}
        pids["nats"] = [srv.nats_pid] if srv.nats_pid else []
        bench = Bench(nc, pool, pids, args.clients, args.duration)
        many = args.targets
        tag = bench.tag

        one_base, many_base = "pg-lock-1t", f"pg-lock-{many}t"
        bodies_1t = await bench.offer_bodies(f"bench-1t-{tag}", 1, 2)
        bodies_same = await bench.offer_bodies(f"bench-same-{tag}", 1, 0)
        bodies_many = await bench.offer_bodies(f"bench-{many}t-{tag}", many, 2)
        # Each offer scenario right after its baseline, so drift on a shared machine
        # touches both alike.
        plan: list[tuple[str, int, Op, str | None]] = [
            (one_base, 1, bench.lock_op(f"base-1t-{tag}", 1), None),
            ("offer-1t", 1, bench.offer_op(bodies_1t), one_base),
            ("offer-1t-same", 1, bench.offer_op(bodies_same), one_base),
            (many_base, many, bench.lock_op(f"base-{many}t-{tag}", many), None),
            (f"offer-{many}t", many, bench.offer_op(bodies_many), many_base),
        ]
        rows: list[Row] = []
        for scenario, targets, op, baseline in plan:
            spied = Path(args.py_spy) if args.py_spy and scenario == args.profile else None
            rows.append(await bench.run(scenario, targets, op, baseline is not None, spied))
            rows[-1].baseline = baseline
        await bench.drained()
        result = await check(pool)
        replied = sum(bench.replied[k] for k in ("created", "substituiu_oferta"))
        return rows, {**result, "offers_writing_a_row": replied}


def results_table(rows: list[Row]) -> list[str]:
    by_name = {r.scenario: r for r in rows}
    groups = [
        [Col("scenario", 14, left=True), Col("clients", 8), Col("ops/s", 8, ".0f"),
         Col("p50 ms", 8, ".2f"), Col("p99 ms", 8, ".2f"), Col("err", 5)],
        [Col("÷base", 6, ".2f"), Col("p50÷", 6, ".2f"), Col("p99÷", 6, ".2f")],
        [Col("created", 8), Col("supersd", 8), Col("ja_ofer", 8)],
        [Col("backlog", 8), Col("drain s", 8, ".2f")],
    ]  # fmt: skip
    cells: list[list[list[object]]] = []
    for r in rows:
        cells.append([[r.scenario, r.clients, r.rate, r.p50_ms, r.p99_ms, r.errors]])
        if r.baseline is not None:
            b, o = by_name[r.baseline], r.outcomes
            cells[-1] += [
                [ratio(r.rate, b.rate), ratio(r.p50_ms, b.p50_ms), ratio(r.p99_ms, b.p99_ms)],
                [o.get("created", 0), o.get("substituiu_oferta", 0), o.get("ja_oferecido", 0)],
                [r.backlog or 0, r.drain_s or 0.0],
            ]
    lines = table(groups, cells)
    errors = [f"{r.scenario}: {r.error_codes}" for r in rows if r.error_codes]
    if errors:
        lines.append("error replies by code: " + "; ".join(errors))
    usage = [
        (r.scenario, r.clients, CpuUsage(r.cpu_ms_per_op, r.cores_ours, r.cores_machine))
        for r in rows
    ]
    return [*lines, "", *cpu_table(ROLES, usage, name_width=14)]


def check_lines(result: dict[str, Any]) -> tuple[list[str], bool]:
    """The end-of-run checks, and whether they all passed."""
    one_pending = result["targets_over_one"] == 0 and result["offered_rows"] == result["targets"]
    drained = result["outbox_left"] == 0 and result["dead_letters"] == 0
    logged = (
        result["offered_events"] == result["handoffs"]
        and result["superseded_events"] == result["superseded"]
    )
    return [
        f"check: {result['targets_over_one']} of {result['targets']} (project, target) with more "
        f"than one `offered` row ({result['offered_rows']} offered rows): "
        f"{'OK' if one_pending else 'VIOLATED'}",
        f"check: outbox {result['outbox_left']} rows left, {result['dead_letters']} dead letters; "
        f"log {result['offered_events']} handoff.offered events for {result['handoffs']} handoff "
        f"rows ({result['offers_writing_a_row']} replies created one), "
        f"{result['superseded_events']} handoff.superseded for {result['superseded']} superseded "
        f"rows: {'OK' if drained and logged else 'MISMATCH'}",
    ], one_pending and drained and logged


def report(rows: list[Row], result: dict[str, Any], load: tuple[str, str]) -> tuple[str, bool]:
    """The tables and the verdict; True when the checks pass and the goals are met."""
    by_name = {r.scenario: r for r in rows}
    checks, ok = check_lines(result)
    goal_rows = [r for r in rows if r.baseline is not None and r.scenario != "offer-1t-same"]
    cpu_ratios = [
        f"{r.scenario}: {ratio(sum(r.cpu_ms_per_op.values()), base_cpu):.2f}"
        for r in rows
        if r.baseline is not None and (base_cpu := sum(by_name[r.baseline].cpu_ms_per_op.values()))
    ]
    met = all(ratio(r.rate, by_name[r.baseline or ""].rate) >= GOAL_RATIO for r in goal_rows)
    summary = [
        f"{r.scenario} {r.rate:.0f}/s = {ratio(r.rate, by_name[r.baseline].rate):.3f}× "
        f"{r.baseline} (p99 {r.p99_ms:.1f} ms)"
        for r in rows
        if r.baseline is not None
    ]
    verdict = f"verdict: checks {'OK' if ok else 'FAILED'}; " + "; ".join(summary)
    machine = f"machine: before {load[0]}; after {load[1]}"
    goal = (
        f"goal: {', '.join(r.scenario for r in goal_rows)} ≥ {GOAL_RATIO}× the bare lock "
        f"transaction: {'MET' if met else 'NOT MET'}"
    )
    cpu = "CPU per offer ÷ CPU per lock transaction: " + ", ".join(cpu_ratios)
    lines = [*results_table(rows), cpu, "", machine, "", *checks, verdict, goal]
    return "\n".join(lines), ok and met


def main() -> None:
    parser = argparse.ArgumentParser(description="Offer throughput of the handoff service.")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients")
    parser.add_argument("--targets", type=int, default=50, help="targets of the spread case")
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")
    parser.add_argument("--py-spy", metavar="DIR", help="profile the services into DIR")
    parser.add_argument(
        "--profile", default="offer-1t", metavar="SCENARIO", help="the scenario --py-spy profiles"
    )
    args = parser.parse_args()
    before = load_average()
    with servers() as srv:
        rows, result = uvloop.run(measure(args, srv))
    load = (before, load_average())
    text, ok = report(rows, result, load)
    print(text)
    for module in SERVICES if args.py_spy else ():
        print(f"\npy-spy, {module} during {args.profile}:")
        print("\n".join(top_frames(Path(args.py_spy) / f"{module}.txt")))
    if args.json:
        results = [asdict(r) | {"ops_per_s": r.rate} for r in rows]
        print(json.dumps({"rows": results, "check": result, "load": load}))
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
