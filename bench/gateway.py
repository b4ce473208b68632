"""The gateway under many streaming clients: per-token latency and memory per connection.

At each level (100 clients, 100 with tokens 5 ms apart, 500 clients) every WebSocket
client joins a session of its own, starts Criativo there (`start_agent`) and sends one
`chat`, the sends spread over one stream's duration (a steady number of streams in
flight, as in bench/metering.py):

- per-token delivery: delta frame received − the provider's emit time. A delta frame
  carries no emit time, so the bench also follows the deltas on NATS and takes the same
  (turn, seq)'s emit time (`TurnDelta.emitted_at`, or on a real provider's path the time
  the stand-in stamped on the word); the gateway leg is frame received − that delta
  received by the bench's own NATS subscriber (what gateway and WebSocket add to the bus);
- event leg: a turn's event frame (the message, the response) received − the same event
  received by the bench's own subscriber: the gateway shows an event only once the log
  confirmed it, and the session's deltas wait behind it;
- chat → first delta: first delta frame − `chat` sent − the provider's first-token delay;
- memory per connection: the gateway's VmRSS with the N clients joined minus before, / N
  (a fresh gateway process per level, warmed by one connection first);

against a raw NATS hop of the same deltas at the same rate and concurrency, in the same
run (bench/metering.py's baseline). Every service runs as its own process.

Whether a tail is CPU: the tokens/s offered with every turn streaming, and of the busiest
250 ms as the bench's subscriber saw them, × every process's CPU per token (the bench's
clients' too: they share the cores), against the machine's cores; the latencies of the
deltas in windows that needed more cores than there are, and of those that did not; and
the deltas that reached the bus before their turn's message reached the client (held
behind the message: the client gets the message first).

Providers (`--provider`, repeatable): `scripted`, metering's in-process provider, or a real
provider's path, `anthropic` / `openai`: the stand-in of `bench/fakeprovider.py`, its
HTTP+SSE API in a process of its own, called by metering through the official SDK. There
per-token latency is from the time the stand-in wrote the word. By default the scripted
and the Anthropic providers run one after the other, each with services and a database of
their own (metering and the stand-in again for each pace of tokens), and a table sets
them side by side with their ratios. The real path runs at the same levels (the goals are
set at them); the default run takes about a quarter of an hour on two busy cores.

Goals, checked at every level; the exit status is 1 when one is missed, and each goal is
printed met / MISSED. Every turn ends with its `done`, no chat is refused, ≤ 40 KiB RSS per
joined connection. On the scripted provider: per-token p99 ≤ the delta window + 50 ms;
≤ 0.15 ms CPU per token on the gateway path (the processes a token crosses after metering
published it: NATS and the gateway; the table shows every process). On a real provider's path:
≤ 0.08 ms CPU per token across every process but the bench's and the stand-in's (the
provider's servers are not the platform's; the table shows the stand-in's) at 100
clients, tokens 20 ms apart; per-token p99 ≤ metering's delta window + 60 ms at 500
clients (the window is AGENTBUS_DELTA_WINDOW_MS as the services get it, metering's
default when unset; the bench prints it); `agent.delta` messages on the bus per token the
provider wrote ≤ 0.2 at 100 clients with tokens 5 ms apart, ≤ 0.5 with tokens 20 ms apart
(the bench counts every message on `agent.delta.>` during the turns).

With an embedded NATS server it also prints the server's CPU, read and write system calls
and context switches per delta of the raw hop and per token of the turns: its CPU per
token is mostly those wake-ups, one small message at a time, not its work on a message.
`--profile DIR` records the gateway with py-spy during the turns
(DIR/gateway-<provider>-<clients>@<ms>ms.txt, collapsed stacks) and prints its top frames;
the sampler takes CPU of its own, so the figures of such a run are not the goal's.

    .venv/bin/python bench/gateway.py [--clients 100,100@5,500] [--tokens 50] [--delay-ms 20]
                                      [--provider {scripted,anthropic,openai} ...]
                                      [--profile DIR] [--json]

Servers: NATS_URL / DATABASE_URL when set, otherwise embedded ones in a temp dir.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import nats
import uvloop
from nats.aio.client import Client
from nats.aio.msg import Msg
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

import benchkit as bk
from contracts import subjects
from contracts.events import EventType
from contracts.session_events import OpenSession, SessionOpenedReply
from fakeprovider import add_provider_option, chosen, emitted_at, start_provider
from servicekit.client import call

PROJECT = "gwbench"
SECRET = "bench-secret-" + "x" * 40
# Started once per provider; metering (and a real provider's stand-in) once per pace of
# tokens, which the provider is started with.
SERVICES = ["session_events", "handoff", "criativo"]
# The scripted provider's goals, at every level; the per-token p99's is beyond metering's
# delta window, which a token may wait before it leaves metering.
GOAL_P99_MS = 50.0
GOAL_CPU_MS = 0.15
GOAL_RSS_KIB = 40.0
GATEWAY_PATH = ("gateway", "nats")
# A real provider's goals: CPU ms per token of every process but the bench's and the
# stand-in's (the provider's servers are not the platform's), at 100 clients, tokens
# 20 ms apart; per-token p99 at 500 clients within metering's delta window plus a margin;
# `agent.delta` messages on the bus per token the provider wrote, at 100 clients, by the
# milliseconds between tokens.
REAL_CPU_GOAL = (100, 20.0, 0.08)
REAL_P99_CLIENTS, REAL_P99_MARGIN_MS = 500, 60.0
BUS_GOAL = {5.0: 0.2, 20.0: 0.5}
BUS_GOAL_CLIENTS = 100
DEFAULT_LEVELS = "100,100@5,500"
# Services starting on a loaded 2-core machine can take minutes (as in bench/chat.py).
READY_TIMEOUT = 180.0
METERING = Path(__file__).with_name("metering.py")  # its raw-hop baseline, reused as chat.py does
_spec = importlib.util.spec_from_file_location("bench_metering", METERING)
assert _spec is not None and _spec.loader is not None
bench_metering = importlib.util.module_from_spec(_spec)
sys.modules["bench_metering"] = bench_metering  # its dataclasses look their module up
_spec.loader.exec_module(bench_metering)


def mint_token() -> str:
    """A token for PROJECT from the gateway's own `mint`, in a child process: this script,
    named gateway.py, shadows the `gateway` package on its own path."""
    code = "import sys; from gateway.auth import mint; print(mint(sys.argv[1], sys.argv[2], 'b'))"
    argv = [sys.executable, "-P", "-c", code, SECRET, PROJECT]
    return subprocess.check_output(argv, text=True).strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(ln for ln in status.splitlines() if ln.startswith("VmRSS:")).split()[1])


class WsClient:
    """One connection: answers matched by `ref`, delta frames stamped on arrival."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.answers: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self.activated = asyncio.Event()
        self.message: str | None = None  # the chat message whose reply is measured
        self.dones: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)  # by message
        self.arrivals: list[tuple[str, int, float, str | None]] = []  # turn, seq, at, message
        self.events: dict[str, float] = {}  # event id -> when its frame arrived
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for raw in self.ws:
                now = time.time()
                f = json.loads(raw)
                kind = f["type"]
                if kind == "delta":
                    self.arrivals.append((f["turn_id"], f["seq"], now, f["message_id"]))
                elif kind in ("ack", "error") and f.get("ref") in self.answers:
                    self.answers.pop(f["ref"]).set_result(f)
                elif kind == "event":
                    self.events[f["event"]["id"]] = now
                    if f["event"]["type"] == "agent.activated":
                        self.activated.set()
                elif kind == "done":
                    self.dones[f["message_id"]].set()

    async def request(self, frame: dict[str, Any]) -> dict[str, Any]:
        ref = uuid.uuid4().hex
        self.answers[ref] = asyncio.get_running_loop().create_future()
        await self.ws.send(json.dumps({**frame, "ref": ref}))
        reply = await asyncio.wait_for(self.answers[ref], 60)
        if reply["type"] != "ack":
            raise RuntimeError(f"{frame['type']} refused: {reply}")
        result: dict[str, Any] = reply["result"]
        return result


async def open_client(address: str, token: str, session: uuid.UUID) -> WsClient:
    """A socket opened as the page opens it: a single-use ticket traded for the token."""
    async with httpx.AsyncClient(timeout=60) as http:
        reply = await http.post(
            f"http://{address}/api/projects/{PROJECT}/ws-ticket",
            headers={"authorization": f"Bearer {token}"},
        )
    reply.raise_for_status()
    url = f"ws://{address}/ws?ticket={reply.json()['ticket']}"
    client = WsClient(await connect(url, max_size=None, open_timeout=60))
    await client.request({"type": "join", "session_id": str(session)})
    return client


async def level(nc: Client, stack: contextlib.AsyncExitStack, env: dict[str, str], logs: Path,
                groups: dict[str, list[int]], pool: asyncpg.Pool, n: int, tokens: int,
                delay_s: float, profile: Path | None) -> dict[str, Any]:  # fmt: skip
    """One level: raw-hop baseline, a fresh gateway, N clients streaming one turn each."""
    base = bench_metering.Receiver()
    base.expected = tokens
    sub = await nc.subscribe(f"{bench_metering.SUBJECT_ROOT}.*", cb=base.on_msg)
    await nc.flush()
    hop_before = nats_work(groups)
    await bench_metering.baseline(env["NATS_URL"], base, n, n, tokens, delay_s)
    nats_per_delta = per_op(hop_before, nats_work(groups), n * tokens)
    await sub.unsubscribe()

    port, token = free_port(), mint_token()
    gw_env = env | {"AGENTBUS_GATEWAY_PORT": str(port)}
    (gw,) = await bk.start_services(stack, nc, gw_env, logs, ["gateway"])
    address = f"127.0.0.1:{port}"
    opening = OpenSession(project_id=PROJECT, opened_by="user:bench")
    sessions = [(await call(nc, subjects.SESSIONS_OPEN, opening, SessionOpenedReply)).session_id
                for _ in range(n + 1)]  # fmt: skip
    await (await open_client(address, token, sessions.pop())).ws.close()  # warm-up: one-time costs
    await asyncio.sleep(1)
    rss_before = rss_kib(gw.pid)
    clients = await asyncio.gather(*(open_client(address, token, s) for s in sessions))
    rss_joined = rss_kib(gw.pid)
    for c in clients:  # start Criativo everywhere; the activation reaches the log via outbox
        for attempt in range(5):  # an overloaded platform answers `unavailable`: retry
            try:
                await c.request({"type": "start_agent", "agent": "criativo"})
                break
            except RuntimeError as exc:
                if "unavailable" not in str(exc) or attempt == 4:
                    raise
    await asyncio.wait_for(asyncio.gather(*(c.activated.wait() for c in clients)), 120)

    emitted: dict[tuple[str, int], tuple[float, float]] = {}
    bus_deltas = 0  # every `agent.delta` message the bus carried during the turns

    async def on_delta(msg: Msg) -> None:
        nonlocal bus_deltas
        now = time.time()
        d = json.loads(msg.data)
        bus_deltas += 1
        emitted[(d["turn_id"], d["seq"])] = (emitted_at(d["text"], d["emitted_at"]), now)

    sub = await nc.subscribe(f"{subjects.DELTA_PREFIX}>", cb=on_delta)
    # A turn's events as the bus has them: the event leg (bus → client) is where the
    # gateway's confirmation by the log shows, and the session's deltas wait behind it.
    published: dict[str, float] = {}

    async def on_event(msg: Msg) -> None:
        published[json.loads(msg.data)["id"]] = time.time()

    turn_events = [EventType.CHAT_MESSAGE, EventType.AGENT_RESPONSE]
    events = [await nc.subscribe(subjects.event_subject(t, PROJECT, "*"), cb=on_event)
              for t in turn_events]  # fmt: skip
    # The log's reads during the turns, by command: every caller's (Criativo's and the
    # gateway's), to see what a turn costs the log besides its appends.
    log_reads: Counter[str] = Counter()

    asked: set[str] = set()  # the event ids read by id (the gateway's confirmations)

    async def on_read(msg: Msg) -> None:
        log_reads[msg.subject] += 1
        if msg.subject == subjects.EVENTS_GET:
            asked.update(json.loads(msg.data)["event_ids"])

    reads = [await nc.subscribe(s, cb=on_read) for s in (subjects.EVENTS_LIST, subjects.EVENTS_GET)]
    await nc.flush()
    first_ms: list[float] = []
    unfinished: list[int] = []  # deltas received by each client whose turn never ended
    refused: list[str] = []  # chats the platform refused (a timeout under overload)

    async def chat(k: int, c: WsClient) -> None:
        await asyncio.sleep(k / n * tokens * delay_s)  # spread over one stream's duration
        sent = time.time()
        try:
            reply = await c.request({"type": "chat", "text": "Um app para padarias",
                                     "client_msg_id": f"m{k}"})  # fmt: skip
        except RuntimeError as exc:
            refused.append(str(exc))
            return
        c.message = reply["event_id"]
        ended = True
        try:
            await asyncio.wait_for(c.dones[c.message].wait(), 120)
        except TimeoutError:
            ended = False
        arrived = [a for a in c.arrivals if a[3] == c.message]
        if not ended:
            unfinished.append(len(arrived))
        if arrived:
            first_ms.append((min(a[2] for a in arrived) - sent - delay_s) * 1000)

    meter = bk.CpuMeter(groups | {"gateway": [gw.pid], "bench": [os.getpid()]}, pool)
    async with contextlib.AsyncExitStack() as spying:
        if profile is not None:
            spying.enter_context(bk.py_spy(gw.pid, profile))
        chat_before = nats_work(groups)
        await meter.start()
        started = time.perf_counter()
        await asyncio.gather(*(chat(k, c) for k, c in enumerate(clients)))
        usage = await meter.stop(n * tokens, time.perf_counter() - started)
        nats_per_token = per_op(chat_before, nats_work(groups), n * tokens)
    await sub.unsubscribe()
    for tapped in [*reads, *events]:
        await tapped.unsubscribe()
    rss_after = rss_kib(gw.pid)
    got = [(at, emitted.get((turn, seq))) for c in clients for turn, seq, at, m in c.arrivals
           if m == c.message]  # fmt: skip
    # Deltas that reached the bus before their turn's message reached the client: they
    # waited behind the log's confirmation of the message (the message comes first).
    behind = [(at - e[1]) * 1000 for c in clients for turn, seq, at, m in c.arrivals
              if m == c.message and (e := emitted.get((turn, seq)))
              and e[1] < c.events.get(m or "", 0.0)]  # fmt: skip
    per_token = [(at - e[0]) * 1000 for at, e in got if e]
    gw_leg = [(at - e[1]) * 1000 for at, e in got if e]
    lost = sum(e is None for _, e in got)
    event_leg = [(at - published[i]) * 1000 for c in clients for i, at in c.events.items()
                 if i in published]  # fmt: skip
    await asyncio.gather(*(c.ws.close() for c in clients))
    return {"clients": n, "delay_ms": delay_s * 1000, "hop_ms": base.samples.per_token_ms,
            "per_token_ms": per_token, "bus_deltas": bus_deltas,
            "tokens_written": (n - len(refused)) * tokens,
            "gateway_leg_ms": gw_leg, "event_leg_ms": event_leg, "first_delta_ms": first_ms,
            "behind_message_ms": behind, "windows": windows([(at, e) for at, e in got if e]),
            "offered_per_s": n / delay_s,  # every stream in flight at once, one token each
            "unmatched": lost,
            "unfinished": unfinished, "refused": refused,
            "rss_kib": [rss_before, rss_joined, rss_after], "cpu": usage,
            "log_reads_per_turn": {k: v / n for k, v in sorted(log_reads.items())},
            "nats_per_delta_of_hop": nats_per_delta, "nats_per_token": nats_per_token,
            "messages_read": sum(c.message in asked for c in clients)}  # fmt: skip


WINDOW_S = 0.25


def windows(got: list[tuple[float, tuple[float, float]]]) -> list[list[tuple[float, float]]]:
    """The deltas by `WINDOW_S` of their arrival on the bus, each as (emit → client,
    bus → client) in ms."""
    if not got:
        return []
    start = min(bus for _, (_, bus) in got)
    by: defaultdict[int, list[tuple[float, float]]] = defaultdict(list)
    for at, (emit, bus) in got:
        by[int((bus - start) / WINDOW_S)].append(((at - emit) * 1000, (at - bus) * 1000))
    return [by[k] for k in sorted(by)]


def saturation(r: dict[str, Any]) -> list[str]:
    """Is the tail CPU? Each window's tokens/s × every process's CPU per token (the
    bench's clients too: they share the cores) against the machine's cores."""
    if not r["windows"]:
        return []
    cores = os.cpu_count() or 1
    total_ms = sum(r["cpu"].ms_per_op.values())
    need = [len(w) / WINDOW_S * total_ms / 1000 for w in r["windows"]]
    over = [d for w, c in zip(r["windows"], need, strict=True) if c > cores for d in w]
    under = [d for w, c in zip(r["windows"], need, strict=True) if c <= cores for d in w]
    peak = max(len(w) for w in r["windows"]) / WINDOW_S
    offered, path_ms = r["offered_per_s"], path_cpu_ms(r)
    return [
        f"  offered at the peak (every turn streaming): {offered:,.0f} tokens/s × "
        f"{total_ms:.3f} ms = {offered * total_ms / 1000:.2f} cores needed of {cores} "
        f"(the gateway path's share: {offered * path_ms / 1000:.2f})",
        f"  busiest {WINDOW_S * 1000:.0f} ms on the bus: {peak:,.0f} tokens/s × {total_ms:.3f} ms "
        f"CPU per token (every process) = {max(need):.2f} cores needed of {cores}; "
        f"{len(over)} of {len(over) + len(under)} deltas in windows needing more than {cores}",
        bk.latency_row("per-token, windows > cores", [a for a, _ in over]),
        bk.latency_row("per-token, windows ≤ cores", [a for a, _ in under]),
        bk.latency_row("gw leg, windows > cores", [b for _, b in over]),
        bk.latency_row("gw leg, windows ≤ cores", [b for _, b in under]),
        bk.latency_row("gw leg, behind their message", r["behind_message_ms"]),
    ]


def nats_work(groups: dict[str, list[int]]) -> dict[str, float]:
    """The embedded NATS server's CPU ms and wake-ups so far; nothing for a server not ours."""
    pids = groups.get("nats", [])
    if not pids:
        return {}
    return {"ms CPU": sum(bk.cpu_seconds(pids).values()) * 1000, **bk.wakeups(pids)}


def per_op(before: dict[str, float], after: dict[str, float], ops: int) -> dict[str, float]:
    return {k: (after[k] - before[k]) / ops for k in before}


def path_cpu_ms(r: dict[str, Any]) -> float:
    """CPU ms per token of the processes on the gateway path."""
    return float(sum(r["cpu"].ms_per_op.get(k, 0.0) for k in GATEWAY_PATH))


def rss_per_connection(r: dict[str, Any]) -> float:
    before, joined, _ = r["rss_kib"]
    return float((joined - before) / r["clients"])


def nats_work_lines(r: dict[str, Any]) -> list[tuple[str, dict[str, float]]]:
    """The NATS server's work per delta of the raw hop and per token of the turns, when the
    server is embedded (its /proc is ours to read)."""
    if not r["nats_per_token"]:
        return []
    return [("per delta of the raw hop", r["nats_per_delta_of_hop"]),
            ("per token of the turns", r["nats_per_token"])]  # fmt: skip


def every_process_cpu_ms(r: dict[str, Any]) -> float:
    """CPU ms per token of every process but the bench's and the provider's stand-in."""
    return float(sum(v for k, v in r["cpu"].ms_per_op.items() if k not in ("bench", "provider")))


def bus_per_token(r: dict[str, Any]) -> float:
    """`agent.delta` messages on the bus per token the provider wrote."""
    return float(bk.ratio(r["bus_deltas"], r["tokens_written"]))


def label(r: dict[str, Any]) -> str:
    return f"{r['clients']}@{r['delay_ms']:g}ms"


def check(goals: bk.Goals, provider: str, r: dict[str, Any]) -> None:
    """The goals of one level: the scripted provider's, or a real provider's path's."""
    n, delay, at = r["clients"], r["delay_ms"], f"{provider}, {label(r)}"
    goals.at_most(f"{at}: turns without their done", len(r["unfinished"]), 0)
    goals.at_most(f"{at}: chats refused", len(r["refused"]), 0)
    goals.at_most(f"{at}: RSS KiB per joined connection", rss_per_connection(r), GOAL_RSS_KIB)
    p99 = bk.percentile(r["per_token_ms"], 0.99)
    window = bk.delta_window_ms()
    if provider == "scripted":
        goals.at_most(f"{at}: per-token p99 ms (delta window {window:g} ms + {GOAL_P99_MS:g})",
                      p99, window + GOAL_P99_MS)  # fmt: skip
        goals.at_most(f"{at}: gateway-path CPU ms per token", path_cpu_ms(r), GOAL_CPU_MS)
        return
    if (n, delay) == REAL_CPU_GOAL[:2]:
        goals.at_most(f"{at}: CPU ms per token, every process but bench and stand-in",
                      every_process_cpu_ms(r), REAL_CPU_GOAL[2])  # fmt: skip
    if n == REAL_P99_CLIENTS:
        goals.at_most(f"{at}: per-token p99 ms (delta window {window:g} ms + "
                      f"{REAL_P99_MARGIN_MS:g})", p99, window + REAL_P99_MARGIN_MS)  # fmt: skip
    if n == BUS_GOAL_CLIENTS and delay in BUS_GOAL:
        goals.at_most(f"{at}: agent.delta messages on the bus per token", bus_per_token(r),
                      BUS_GOAL[delay])  # fmt: skip


def summary(r: dict[str, Any]) -> dict[str, Any]:
    qs, rss = {"p50": 0.5, "p99": 0.99}, r["rss_kib"]
    out: dict[str, Any] = {k: {q: bk.percentile(r[k], v) for q, v in qs.items()} for k in r
                           if k.endswith("ms")}  # fmt: skip
    out |= {f"ratio_{q}": bk.ratio(out["per_token_ms"][q], out["hop_ms"][q]) for q in qs}
    return out | {"clients": r["clients"], "deltas": len(r["per_token_ms"]),
                  "unmatched": r["unmatched"], "rss_kib_before_joined_after": rss,
                  "rss_kib_per_connection": rss_per_connection(r),
                  "cpu_ms_per_token": r["cpu"].ms_per_op,
                  "gateway_path_cpu_ms_per_token": path_cpu_ms(r),
                  "log_reads_per_turn": r["log_reads_per_turn"],
                  "nats_per_delta_of_hop": r["nats_per_delta_of_hop"],
                  "nats_per_token": r["nats_per_token"], "delay_ms": r["delay_ms"],
                  "bus_deltas_per_token": bus_per_token(r),
                  "every_process_cpu_ms_per_token": every_process_cpu_ms(r)}  # fmt: skip


@dataclass(frozen=True)
class Load:
    """A level: this many clients, their provider writing a token every `delay_ms`."""

    clients: int
    delay_ms: float


def loads(spec: str, delay_ms: float) -> list[Load]:
    """`100,100@5,500`: clients, each at `delay_ms` unless `@<ms>` says otherwise."""
    out = []
    for part in spec.split(","):
        clients, _, ms = part.partition("@")
        out.append(Load(int(clients), float(ms) if ms else delay_ms))
    return out


FIGURES: list[tuple[str, Any]] = [
    ("per-token emit → client p50 ms", lambda r: bk.percentile(r["per_token_ms"], 0.5)),
    ("per-token emit → client p99 ms", lambda r: bk.percentile(r["per_token_ms"], 0.99)),
    ("gateway leg p99 ms", lambda r: bk.percentile(r["gateway_leg_ms"], 0.99)),
    ("chat → first delta p50 ms", lambda r: bk.percentile(r["first_delta_ms"], 0.5)),
    ("chat → first delta p99 ms", lambda r: bk.percentile(r["first_delta_ms"], 0.99)),
    ("CPU ms per token, every process", every_process_cpu_ms),
    ("CPU ms per token, the stand-in", lambda r: r["cpu"].ms_per_op.get("provider", 0.0)),
    ("agent.delta on the bus per token", bus_per_token),
]


async def measure(stack: contextlib.AsyncExitStack, srv: bk.Servers, nc: Client, provider: str,
                  levels: list[Load], tokens: int, profile: Path | None,
                  goals: bk.Goals) -> list[dict[str, Any]]:  # fmt: skip
    """The levels on `provider`: services and a database of their own; metering and the
    provider's stand-in started again for each pace of tokens (they are started with it)."""
    database_url = await stack.enter_async_context(bk.fresh_database(srv.admin_url))
    env = bk.service_env(srv.nats_url, database_url, AGENTBUS_PROVIDER="scripted",
                         AGENTBUS_LOG_FORMAT="json", AGENTBUS_OUTBOX_POLL_SECONDS="0.2",
                         AGENTBUS_SESSION_BUDGET_MICROS="100000000",
                         AGENTBUS_GATEWAY_SECRET=SECRET)  # fmt: skip
    procs = await bk.start_services(stack, nc, env, srv.state, SERVICES, READY_TIMEOUT)
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=1)
    assert pool is not None
    stack.push_async_callback(pool.close)
    results = []
    for delay_ms in dict.fromkeys(load.delay_ms for load in levels):  # in the order asked
        async with contextlib.AsyncExitStack() as paced:
            script = srv.state / f"script-{delay_ms:g}.json"
            script.write_text(json.dumps({"steps": [{
                "text": " ".join(f"w{i}" for i in range(tokens)), "input_tokens": 100,
                "token_delay_ms": delay_ms}]}))  # fmt: skip
            model = await start_provider(paced, provider, tokens, delay_ms / 1000)
            paced_logs = srv.state / f"{provider}-{delay_ms:g}ms"  # a log per metering started
            paced_logs.mkdir()
            env_paced = env | model.env | {"AGENTBUS_SCRIPT_PATH": str(script)}
            (metering,) = await bk.start_services(paced, nc, env_paced, paced_logs, ["metering"],
                                                  READY_TIMEOUT)  # fmt: skip
            await model.bind(nc, PROJECT)
            await model.warm(nc, PROJECT)
            groups = {p.module: [p.pid] for p in [*procs, metering]} | model.group
            groups |= {"nats": [srv.nats_pid]} if srv.nats_pid else {}
            for n in (load.clients for load in levels if load.delay_ms == delay_ms):
                async with contextlib.AsyncExitStack() as gw_stack:  # a fresh gateway per level
                    spied = profile and profile / f"gateway-{provider}-{n}@{delay_ms:g}ms.txt"
                    r = await level(nc, gw_stack, env_paced, srv.state, groups, pool, n, tokens,
                                    delay_ms / 1000, spied)  # fmt: skip
                check(goals, provider, r)
                results.append(r | {"profile": spied})
    return results


def print_level(r: dict[str, Any]) -> None:
    hop = r["hop_ms"]
    print(
        f"{r['clients']} WebSocket clients, one session and one turn each, a token every "
        f"{r['delay_ms']:g} ms ({r['unmatched']} frames without a matching bus delta):"
    )
    print(bk.latency_row("baseline raw NATS hop", hop))
    print(bk.latency_row("per-token emit → client", r["per_token_ms"], hop))
    print(bk.latency_row("gateway leg (bus → client)", r["gateway_leg_ms"], hop))
    print(bk.latency_row("event leg (bus → client)", r["event_leg_ms"], hop))
    print(bk.latency_row("chat → first delta", r["first_delta_ms"], hop))
    before, joined, after = (k / 1024 for k in r["rss_kib"])
    print(f"  gateway RSS {before:.1f} → {joined:.1f} MiB with {r['clients']} joined: "
          f"{(joined - before) * 1024 / r['clients']:.1f} KiB per connection; "
          f"{after:.1f} MiB after the turns", flush=True)  # fmt: skip
    reads = ", ".join(f"{k} {v:.2f}" for k, v in r["log_reads_per_turn"].items())
    print(f"  log reads per turn (every caller's): {reads or 'none'}; "
          f"{r['messages_read']} of {r['clients']} chat messages read by id")  # fmt: skip
    print(f"  agent.delta messages on the bus: {r['bus_deltas']} for {r['tokens_written']} "
          f"tokens written, {bus_per_token(r):.3f} per token")  # fmt: skip
    if r["unfinished"] or r["refused"]:
        print(f"  turns without their done (deltas each got): {r['unfinished']}; "
              f"refused: {r['refused'][:1]}")  # fmt: skip


async def run(levels: list[Load], tokens: int, profile: Path | None, as_json: bool,
              providers: list[str]) -> bool:  # fmt: skip
    """Every level of every provider measured and printed; whether every goal was met."""
    async with contextlib.AsyncExitStack() as stack:
        srv = stack.enter_context(bk.servers(prefix="bench-gateway-"))
        nc = await nats.connect(srv.nats_url)
        stack.push_async_callback(nc.close)
        if not as_json:
            print(f"gateway bench: {tokens} tokens per turn; metering's delta window "
                  f"{bk.delta_window_ms():g} ms (AGENTBUS_DELTA_WINDOW_MS); "
                  f"{os.cpu_count()} cores", flush=True)  # fmt: skip
        goals = bk.Goals()
        results: dict[str, list[dict[str, Any]]] = {}
        for provider in providers:  # one set of services at a time
            if not as_json:
                print(f"\n{provider} provider:", flush=True)
            async with contextlib.AsyncExitStack() as each:
                results[provider] = await measure(each, srv, nc, provider, levels, tokens,
                                                  profile, goals)  # fmt: skip
            if not as_json:
                for r in results[provider]:
                    print_level(r)
        if as_json:
            print(json.dumps({p: [summary(r) for r in rs] for p, rs in results.items()}, indent=2))
            return goals.exit_code == 0
        roles = ["gateway", "metering", *SERVICES, "nats", "postgres", "provider", "bench"]
        cpu = [(f"{p} {r['delay_ms']:g}ms", r["clients"], r["cpu"])
               for p, rs in results.items() for r in rs]  # fmt: skip
        print()
        print("\n".join(bk.cpu_table(roles, cpu, name_width=20)).replace("per op", "per token", 1))
        for provider, rs in results.items():
            for r in rs:
                print("\n".join([f"{provider}, {label(r)}, CPU saturation:", *saturation(r)]))
                print(f"  gateway path ({' + '.join(GATEWAY_PATH)}): {path_cpu_ms(r):.3f} ms CPU "
                      f"per token; every process but bench and stand-in: "
                      f"{every_process_cpu_ms(r):.3f}")  # fmt: skip
                for what, work in nats_work_lines(r):
                    tally = ", ".join(f"{v:.3f} {k}" for k, v in work.items())
                    print(f"  the NATS server {what}: {tally}")
        if len(results) > 1:
            ratios = "; ratios to the scripted provider's" if "scripted" in results else ""
            print(f"\nside by side (clients@ms between tokens{ratios}):")
            by_label = {p: {label(r): r for r in rs} for p, rs in results.items()}
            print("\n".join(bk.side_by_side(by_label, FIGURES)))
        for r in (r for rs in results.values() for r in rs if r["profile"] is not None):
            print(f"py-spy, the gateway ({r['profile']}):")
            print("\n".join(bk.top_frames(r["profile"])))
        print(bk.load_average())
        print("goals:")
        print("\n".join(goals.report()))
        return goals.exit_code == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--clients", default=DEFAULT_LEVELS,
                        help="levels: clients[@ms between tokens], e.g. 100,100@5,500")  # fmt: skip
    parser.add_argument("--tokens", type=int, default=50)
    parser.add_argument("--delay-ms", type=float, default=20.0)
    parser.add_argument("--profile", type=Path, help="record the gateway with py-spy here")
    parser.add_argument("--json", action="store_true")
    add_provider_option(parser)
    args = parser.parse_args()
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    levels = loads(args.clients, args.delay_ms)
    met = uvloop.run(run(levels, args.tokens, args.profile, args.json, chosen(args.provider)))
    sys.exit(0 if met else 1)


if __name__ == "__main__":
    main()
