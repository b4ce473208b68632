"""What every benchmark in `bench/` shares, so none carries its own copy.

- `servers`: NATS_URL / DATABASE_URL when set, otherwise embedded servers in a temp dir;
- `fresh_database`: a database of its own per run, created and dropped;
- `start_services`: services as real processes (`python -m <module>`), ready when this very
  process answers `$SRV.PING.<service>`;
- `closed_loop`: N clients, each sending its next operation after the previous reply;
- `CpuMeter`: CPU time per process group (Postgres backends included) and machine load;
- `percentile`, `Col` / `table` / `latency_row`: the figures and the way they are printed;
- `side_by_side`: the same figures of several providers' runs, with their ratios;
- `delta_window_ms`: metering's delta coalescing window the services run with;
- `py_spy` / `top_frames`: a py-spy profile of a process over a measurement, and its summary.

A benchmark imports this as `benchkit` (Python puts the script's folder first on the path);
mypy needs the folder on its path too: `MYPYPATH=bench .venv/bin/mypy bench`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import asyncpg
from nats.aio.client import Client
from pydantic import BaseModel

from contracts import catalog
from contracts.metering import DEFAULT_LIMITS, SetLimits, SpendLimits
from servicekit.client import call
from servicekit.embedded import start_nats, start_postgres
from testkit.services import ServiceProcess

TICK = os.sysconf("SC_CLK_TCK")
T = TypeVar("T")
Op = Callable[[int], Awaitable[bool]]  # one operation of client i; False = an error reply


# -- servers, database, services ------------------------------------------------------------


@dataclass(frozen=True)
class Servers:
    """Where the benchmark's servers listen, and a scratch folder for logs and files."""

    nats_url: str
    admin_url: str  # a database to create and drop others from
    nats_pid: int | None  # when the server is ours (embedded), so its CPU can be sampled
    state: Path


@contextlib.contextmanager
def servers(prefix: str = "agentbus-bench-") -> Iterator[Servers]:
    """The servers named by NATS_URL / DATABASE_URL, or embedded ones in a temp dir."""
    with contextlib.ExitStack() as stack:
        state = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=prefix)))
        nats_url, pg_url = os.environ.get("NATS_URL"), os.environ.get("DATABASE_URL")
        nats_pid = None
        if not nats_url:
            nats_server = start_nats(state)
            stack.callback(nats_server.stop)
            nats_url, nats_pid = nats_server.url, nats_server.process.pid
        if not pg_url:
            pg_server = start_postgres(state)
            stack.callback(pg_server.stop)
            pg_url = pg_server.url
        # Services only check the streams: provision them as `make up` does.
        subprocess.run(
            [sys.executable, "-m", "devstack", "provision"],
            env={**os.environ, "NATS_URL": nats_url},
            check=True,
            capture_output=True,
        )
        yield Servers(nats_url, pg_url, nats_pid, state)


@contextlib.asynccontextmanager
async def fresh_database(admin_url: str) -> AsyncIterator[str]:
    """The URL of a new empty database, dropped (connections and all) on exit."""
    name = f"bench_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(admin_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        try:
            yield urlunsplit(urlsplit(admin_url)._replace(path=f"/{name}"))
        finally:
            await admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
    finally:
        await admin.close()


def service_env(nats_url: str, database_url: str, **extra: str) -> dict[str, str]:
    """The environment of a service process: the servers, quiet logs, and `extra`.

    PYTHONSAFEPATH keeps the working folder off `python -m`'s path, so a benchmark named
    like its service (bench/handoff.py) is never started in the service's place."""
    env = {**os.environ, "NATS_URL": nats_url, "DATABASE_URL": database_url}
    return env | {"AGENTBUS_LOG_LEVEL": "WARNING", "PYTHONSAFEPATH": "1", **extra}


async def start_services(
    stack: contextlib.AsyncExitStack,
    nc: Client,
    env: dict[str, str],
    logs: Path,
    modules: Sequence[str],
    ready_timeout: float = 30.0,
) -> list[ServiceProcess]:
    """Start `python -m <module>` for each module (a module may repeat: replicas), all at
    once, then wait (up to `ready_timeout` seconds each) until each process answers
    `$SRV.PING.<module>`; each is stopped with SIGTERM when `stack` unwinds."""
    procs = [ServiceProcess(m, env, logs / f"{m}-{i}.log") for i, m in enumerate(modules)]
    for proc in procs:
        stack.callback(proc.start().kill, signal.SIGTERM)
    for proc in procs:
        await proc.wait_ready(nc, proc.module, ready_timeout)
    if "metering" in modules:
        await lift_limits(nc)
    return procs


def delta_window_ms() -> float:
    """Metering's delta coalescing window, ms, as the services get it (their environment is
    this process's): AGENTBUS_DELTA_WINDOW_MS, else metering's default."""
    window = os.environ.get("AGENTBUS_DELTA_WINDOW_MS")
    if window:
        return float(window)
    # Metering's default (`MeteringSettings.delta_window_ms`), written here: a bench
    # script's folder comes first on the path, where bench/metering.py shadows the package.
    return 40.0


async def lift_limits(nc: Client) -> None:
    """No spend or rate limit by default (an operator's `cmd.limits.set`): a bench measures
    how fast the system goes, and its load is far beyond what one person may spend."""
    for scope in ("project", "person"):
        request = SetLimits(scope=scope, name=DEFAULT_LIMITS, limits=SpendLimits())
        await call(nc, catalog.LIMITS_SET, request, timeout=30)


def wire(model: BaseModel) -> bytes:
    """A request pre-serialised once, so the client's own pydantic work is not measured."""
    return model.model_dump_json().encode()


# -- the closed loop and its figures --------------------------------------------------------


@dataclass
class LoopResult:
    """What one closed-loop measurement saw."""

    latencies: list[float]  # seconds, of the successful operations, sorted
    errors: int  # error replies, timeouts, no responders
    seconds: float  # wall time from the first request to the last reply

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.seconds

    def p_ms(self, q: float) -> float:
        return percentile(self.latencies, q, empty=0.0) * 1000


async def closed_loop(op: Op, clients: int, seconds: float) -> LoopResult:
    """`clients` concurrent clients, each sending its next operation only after the reply to
    the previous one, until `seconds` have passed; a failure is counted, never fatal."""
    ok: list[float] = []
    failed = 0
    deadline = time.perf_counter() + seconds

    async def client(i: int) -> None:
        nonlocal failed
        while (start := time.perf_counter()) < deadline:
            try:
                done = await op(i)
            except Exception:
                done = False
            if done:
                ok.append(time.perf_counter() - start)
            else:
                failed += 1

    begin = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    return LoopResult(sorted(ok), failed, time.perf_counter() - begin)


def percentile(values: Sequence[float], q: float, empty: float = math.nan) -> float:
    """The value below which a fraction `q` of `values` lies (nearest rank); `empty` if none."""
    if not values:
        return empty
    ordered = sorted(values)  # linear when already sorted
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ratio(value: float, base: float) -> float:
    """`value ÷ base`, NaN rather than an exception when the baseline measured nothing."""
    return value / base if base else math.nan


# -- CPU and machine load -------------------------------------------------------------------


def proc_stat(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name: state, ppid, …"""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pids: Iterable[int]) -> dict[int, float]:
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


def wakeups(pids: Iterable[int]) -> Counter[str]:
    """The read and write system calls the processes made so far, and their threads'
    context switches: on a stream that comes one small message at a time, a server's CPU
    per message is mostly these (a wake-up to read it, one to write it on), not its work on
    the message (the NATS server's Go profile under bench/gateway.py: 60 % syscalls,
    futexes and the scheduler)."""
    counts: Counter[str] = Counter()
    for pid in pids:
        with contextlib.suppress(OSError):
            io = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
            counts["reads"] += int(io["syscr"])
            counts["writes"] += int(io["syscw"])
            for status in Path(f"/proc/{pid}/task").glob("*/status"):
                for line in status.read_text().splitlines():
                    key, _, value = line.partition(":")
                    if key.endswith("ctxt_switches"):  # voluntary and not
                        counts["context switches"] += int(value)
    return counts


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent not idle (nor waiting on I/O) since boot."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / TICK


def is_postgres(pid: int) -> bool:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/comm").read_text().startswith("postgres")
    return False


async def postgres_pids(pool: asyncpg.Pool) -> list[int]:
    """The backends, when on this machine, and their postmaster."""
    rows = await pool.fetch("SELECT pid FROM pg_stat_activity")
    backends = [r["pid"] for r in rows if is_postgres(r["pid"])]
    return [*backends, int(proc_stat(backends[0])[1])] if backends else []


def load_average() -> str:
    """The machine's 1/5/15-minute load averages and its core count, for the report."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} cores"


@dataclass
class CpuUsage:
    """CPU milliseconds per operation of each process group, and cores kept busy."""

    ms_per_op: dict[str, float]
    cores_ours: float
    cores_machine: float


class CpuMeter:
    """CPU time of process groups over one measurement: `start()`, run, `stop(ops, seconds)`.

    With `pool`, the group `postgres` is added: the backends (on this machine) and their
    postmaster, including backends that start or end during the measurement.
    """

    def __init__(self, groups: dict[str, list[int]], pool: asyncpg.Pool | None = None) -> None:
        self._groups = groups
        self._pool = pool
        self._pids: dict[str, list[int]] = {}
        self._before: dict[str, dict[int, float]] = {}
        self._machine = 0.0

    async def start(self) -> None:
        self._pids = dict(self._groups)
        if self._pool is not None:
            self._pids["postgres"] = await postgres_pids(self._pool)
        self._before = {k: cpu_seconds(v) for k, v in self._pids.items()}
        self._machine = machine_busy_seconds()

    async def stop(self, ops: int, seconds: float) -> CpuUsage:
        machine = machine_busy_seconds() - self._machine
        before, after = self._before, {k: cpu_seconds(v) for k, v in self._pids.items()}
        if self._pool is not None:
            # backends started meanwhile count whole; those that ended are in the postmaster's
            new = [p for p in await postgres_pids(self._pool) if p not in before["postgres"]]
            before["postgres"] |= dict.fromkeys(new, 0.0)
            after["postgres"] |= cpu_seconds(new)
        cpu = {k: sum(after[k].get(p, 0.0) - t for p, t in before[k].items()) for k in self._pids}
        per_op = {k: round(c * 1000 / max(ops, 1), 3) for k, c in cpu.items() if c}
        return CpuUsage(per_op, sum(cpu.values()) / seconds, machine / seconds)


# -- printing -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Col:
    """A table column: its title, width and the format of its values (e.g. `.2f`)."""

    title: str
    width: int
    spec: str = ""
    left: bool = False

    def fmt(self, value: object) -> str:
        return f"{value:{'<' if self.left else '>'}{self.width}{self.spec}}"

    @property
    def head(self) -> str:
        return f"{self.title:{'<' if self.left else '>'}{self.width}}"


Cells = Sequence[object]


def table(
    groups: Sequence[Sequence[Col]],
    rows: Iterable[Sequence[Cells]],
    sep: str = " |",
    header: str | None = None,
) -> list[str]:
    """The lines of a table of column groups separated by `sep`. A row gives the cells of
    each group in order and may stop early (a baseline row has no ratios to itself)."""
    last = len(groups) - 1
    head = "".join(
        "".join(c.head for c in g) + (sep if i < last else "") for i, g in enumerate(groups)
    )
    lines = [head if header is None else header]
    for row in rows:
        line = ""
        for i, (cols, cells) in enumerate(zip(groups, row, strict=False)):
            line += "".join(c.fmt(v) for c, v in zip(cols, cells, strict=True))
            line += sep if i < last else ""
        lines.append(line)
    return lines


def latency_row(name: str, values: list[float], base: list[float] | None = None) -> str:
    """One latency distribution (ms) on one line, with its ratios to a baseline's."""
    p50, p99 = percentile(values, 0.5), percentile(values, 0.99)
    text = f"  {name:<28} p50 {p50:7.3f} ms   p99 {p99:7.3f} ms   n={len(values)}"
    if base:
        r50, r99 = ratio(p50, percentile(base, 0.5)), ratio(p99, percentile(base, 0.99))
        text += f"   ratio p50 {r50:5.2f}  p99 {r99:5.2f}"
    return text


def side_by_side(
    results: Mapping[str, Mapping[Any, T]], figures: Sequence[tuple[str, Callable[[T], float]]]
) -> list[str]:
    """Each figure of each provider (`results`: provider → level → measurement) at each
    level they share, in the first provider's order, and its ratio to the scripted
    provider's (the first column) when that ran."""
    names = list(results)
    ratios = [n for n in names[1:] if names[0] == "scripted"]
    levels = [lvl for lvl in results[names[0]] if all(lvl in r for r in results.values())]
    lvl_width = max([3, *(len(str(lvl)) for lvl in levels)]) + 1
    width = max(len(f) for f, _ in figures) + 2
    cols = [Col("lvl", lvl_width), Col("", width, left=True)]
    cols += [Col(n, 11, ".3f") for n in names]
    cols += [Col(f"{n} ÷ {names[0]}", len(n) + len(names[0]) + 5, ".2f") for n in ratios]
    rows = []
    for level in levels:
        for i, (figure, value) in enumerate(figures):
            values = [value(results[n][level]) for n in names]
            cells = [level if i == 0 else "", f"  {figure}", *values]
            rows.append([[*cells, *(ratio(v, values[0]) for v in values[1 : len(ratios) + 1])]])
    return table([cols], rows)


def cpu_table(
    roles: Sequence[str], rows: Iterable[tuple[str, int, CpuUsage]], name_width: int = 13
) -> list[str]:
    """CPU ms per operation of each process group (`roles`, in order) for each measurement
    (scenario, clients, usage), and the cores kept busy: ours, and the whole machine's."""
    roles_cols = (Col(k, max(9, len(k) + 1), ".3f") for k in roles)
    cols = [Col("", name_width, left=True), Col("", 5), *roles_cols]
    cols += [Col("total", 9, ".3f"), Col("", 15, ".2f")]
    header = f"{'CPU ms per op':<{name_width + 5}}" + "".join(c.head for c in cols[2:-1])
    header += f"   cores busy: ours / machine ({os.cpu_count()})"
    cells: list[list[list[object]]] = []
    for name, clients, usage in rows:
        cpu = [usage.ms_per_op.get(k, 0) for k in roles]
        cells.append([[name, clients, *cpu, sum(cpu), usage.cores_ours], [usage.cores_machine]])
    return table([cols, [Col("", 5, ".2f")]], cells, sep=" /", header=header)


# -- profiles -------------------------------------------------------------------------------


@contextlib.contextmanager
def py_spy(pid: int, path: Path, rate: int = 250) -> Iterator[None]:
    """Sample `pid` with py-spy (the dev group's) while the block runs, into `path` as
    collapsed stacks (`frame;frame;… count` lines, what `top_frames` reads)."""
    spy = Path(sys.executable).with_name("py-spy")
    path.parent.mkdir(parents=True, exist_ok=True)  # py-spy writes nothing into a missing dir
    command = [
        str(spy),
        "record",
        "--pid",
        str(pid),
        "--rate",
        str(rate),
        "--format",
        "raw",
        "--function",
    ]
    recorder = subprocess.Popen(
        [*command, "--output", str(path), "--nonblocking"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        yield
    finally:
        recorder.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        try:
            recorder.wait(timeout=60)
        except subprocess.TimeoutExpired:
            recorder.kill()


def top_frames(path: Path, n: int = 15) -> list[str]:
    """The functions holding most samples of a `py_spy` profile: own (the frame on top of
    the stack) and inclusive (anywhere on it), as a share of all samples."""
    own: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines() if path.exists() else []:
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = [
            f.split(" (")[0] + " " + f.rsplit("/", 1)[-1].rstrip(")") for f in stack.split(";")
        ]
        own[frames[-1]] = own.get(frames[-1], 0) + count
        for frame in set(frames):
            inclusive[frame] = inclusive.get(frame, 0) + count
    if not total:
        return [f"  (no samples in {path})"]
    lines = [f"  {total} samples; own time:"]
    lines += [f"    {c / total:6.1%}  {f}" for f, c in sorted(own.items(), key=lambda x: -x[1])[:n]]
    lines.append("  inclusive:")
    ranked = sorted(inclusive.items(), key=lambda x: -x[1])[:n]
    lines += [f"    {c / total:6.1%}  {f}" for f, c in ranked]
    return lines


# -- goals ----------------------------------------------------------------------------------


@dataclass
class Goals:
    """The goals a benchmark is held to: each checked figure is printed met / MISSED, and
    the benchmark exits non-zero when one is missed (`make bench` then says which)."""

    checked: list[tuple[str, float, float, bool]] = field(default_factory=list)

    def at_most(self, name: str, value: float, limit: float) -> None:
        """Goal: `value` ≤ `limit` (NaN, nothing measured, is a miss)."""
        self.checked.append((name, value, limit, value <= limit))

    def report(self) -> list[str]:
        """One line per goal."""
        return [
            f"  {'met   ' if ok else 'MISSED'} {name}: {value:.3f} (goal ≤ {limit:g})"
            for name, value, limit, ok in self.checked
        ]

    @property
    def exit_code(self) -> int:
        return 0 if all(ok for *_, ok in self.checked) else 1
