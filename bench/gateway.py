"""The gateway under many streaming clients: per-token latency and memory per connection.

At each level (100 and 500 clients) every WebSocket client joins a session of its own,
starts Criativo there (`start_agent`) and sends one `chat`, the sends spread over one
stream's duration (a steady number of streams in flight, as in bench/metering.py):

- per-token delivery: delta frame received − the provider's emit time. A delta frame
  carries no emit time, so the bench also follows the deltas on NATS and takes the same
  (turn, seq)'s `TurnDelta.emitted_at`; the gateway leg is frame received − that delta
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

Goals, checked at every level; the exit status is 1 when one is missed:
per-token p99 ≤ 50 ms; ≤ 0.15 ms CPU per token on the gateway path (the processes a token
crosses after metering published it: NATS and the gateway; the table shows every
process); ≤ 40 KiB RSS per joined connection. With an embedded NATS server it also prints
the server's CPU, read and write system calls and context switches per delta of the raw
hop and per token of the turns: its CPU per token is mostly those wake-ups, one small
message at a time, not its work on a message.
`--profile DIR` records the gateway with py-spy during the turns (DIR/gateway-<clients>.txt,
collapsed stacks) and prints its top frames; the sampler takes CPU of its own, so the
figures of such a run are not the goal's.

    .venv/bin/python bench/gateway.py [--clients 100,500] [--tokens 50] [--delay-ms 20]
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
from pathlib import Path
from typing import Any

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
from servicekit.client import call

PROJECT = "gwbench"
SECRET = "bench-secret-" + "x" * 40
SERVICES = ["session_events", "handoff", "metering", "criativo"]
GOAL_P99_MS = 50.0
GOAL_CPU_MS = 0.15
GOAL_RSS_KIB = 40.0
GATEWAY_PATH = ("gateway", "nats")
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
                groups: dict[str, list[int]], n: int, tokens: int, delay_s: float,
                profile: Path | None) -> dict[str, Any]:  # fmt: skip
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

    async def on_delta(msg: Msg) -> None:
        now = time.time()
        d = json.loads(msg.data)
        emitted[(d["turn_id"], d["seq"])] = (d["emitted_at"], now)

    sub = await nc.subscribe(subjects.delta_subject(PROJECT, "*"), cb=on_delta)
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

    meter = bk.CpuMeter(groups | {"gateway": [gw.pid], "bench": [os.getpid()]})
    async with contextlib.AsyncExitStack() as spying:
        if profile is not None:
            spying.enter_context(bk.py_spy(gw.pid, profile / f"gateway-{n}.txt"))
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
    return {"clients": n, "hop_ms": base.samples.per_token_ms, "per_token_ms": per_token,
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
    for at, (emitted_at, bus) in got:
        by[int((bus - start) / WINDOW_S)].append(((at - emitted_at) * 1000, (at - bus) * 1000))
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


def missed(r: dict[str, Any]) -> list[str]:
    """The goals this level missed, as printable lines."""
    p99, cpu, rss = bk.percentile(r["per_token_ms"], 0.99), path_cpu_ms(r), rss_per_connection(r)
    out = [f"per-token p99 {p99:.1f} ms > {GOAL_P99_MS} ms"] if not p99 <= GOAL_P99_MS else []
    out += [f"turns without their done: {r['unfinished']}"] if r["unfinished"] else []
    out += [f"{len(r['refused'])} chats refused, e.g. {r['refused'][0]}"] if r["refused"] else []
    out += [f"gateway-path CPU {cpu:.3f} ms per token > {GOAL_CPU_MS}"] if cpu > GOAL_CPU_MS else []
    out += [f"RSS {rss:.1f} KiB per connection > {GOAL_RSS_KIB}"] if rss > GOAL_RSS_KIB else []
    return [f"{r['clients']} clients: {m}" for m in out]


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
                  "nats_per_token": r["nats_per_token"], "missed": missed(r)}  # fmt: skip


async def run(levels: list[int], tokens: int, delay_ms: float, profile: Path | None,
              as_json: bool) -> bool:  # fmt: skip
    """Every level measured and printed; whether every goal was met."""
    delay_s = delay_ms / 1000
    async with contextlib.AsyncExitStack() as stack:
        srv = stack.enter_context(bk.servers(prefix="bench-gateway-"))
        database_url = await stack.enter_async_context(bk.fresh_database(srv.admin_url))
        script = {"steps": [{"text": " ".join(f"w{i}" for i in range(tokens)),
                             "input_tokens": 100, "token_delay_ms": delay_ms}]}  # fmt: skip
        (srv.state / "script.json").write_text(json.dumps(script))
        env = bk.service_env(srv.nats_url, database_url, AGENTBUS_PROVIDER="scripted",
                             AGENTBUS_SCRIPT_PATH=str(srv.state / "script.json"),
                             AGENTBUS_LOG_FORMAT="json", AGENTBUS_OUTBOX_POLL_SECONDS="0.2",
                             AGENTBUS_SESSION_BUDGET_MICROS="100000000",
                             AGENTBUS_GATEWAY_SECRET=SECRET)  # fmt: skip
        nc = await nats.connect(srv.nats_url)
        stack.push_async_callback(nc.close)
        procs = await bk.start_services(stack, nc, env, srv.state, SERVICES)
        groups = {p.module: [p.pid] for p in procs}
        groups |= {"nats": [srv.nats_pid]} if srv.nats_pid else {}
        results = []
        if not as_json:
            print(f"gateway bench: {tokens} tokens per turn, one every {delay_ms} ms; "
                  f"{os.cpu_count()} cores", flush=True)  # fmt: skip
        for n in levels:
            async with contextlib.AsyncExitStack() as gw_stack:  # a fresh gateway per level
                r = await level(nc, gw_stack, env, srv.state, groups, n, tokens, delay_s,
                                profile)  # fmt: skip
            results.append(r)
            if as_json:
                continue
            hop = r["hop_ms"]
            print(f"{r['clients']} WebSocket clients, one session and one turn each "
                  f"({r['unmatched']} frames without a matching bus delta):")  # fmt: skip
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
        misses = [m for r in results for m in missed(r)]
        if as_json:
            print(json.dumps([summary(r) for r in results], indent=2))
            return not misses
        roles = ["gateway", *SERVICES, "nats", "bench"]
        cpu = [("per token", r["clients"], r["cpu"]) for r in results]
        print("\n".join(bk.cpu_table(roles, cpu)))
        for r in results:
            print("\n".join([f"{r['clients']} clients, CPU saturation:", *saturation(r)]))
            print(f"  gateway path ({' + '.join(GATEWAY_PATH)}) at {r['clients']} clients: "
                  f"{path_cpu_ms(r):.3f} ms CPU per token")  # fmt: skip
            if r["nats_per_token"]:  # an embedded server: its /proc is ours to read
                for what, work in [("per delta of the raw hop", r["nats_per_delta_of_hop"]),
                                   ("per token of the turns", r["nats_per_token"])]:  # fmt: skip
                    tally = ", ".join(f"{v:.3f} {k}" for k, v in work.items())
                    print(f"  the NATS server {what}: {tally}")
        if profile is not None:
            for n in levels:
                print(f"py-spy, the gateway at {n} clients ({profile / f'gateway-{n}.txt'}):")
                print("\n".join(bk.top_frames(profile / f"gateway-{n}.txt")))
        print(bk.load_average())
        print("\n".join(["goals missed:", *misses] if misses else ["every goal met"]))
        return not misses


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--clients", default="100,500")
    parser.add_argument("--tokens", type=int, default=50)
    parser.add_argument("--delay-ms", type=float, default=20.0)
    parser.add_argument("--profile", type=Path, help="record the gateway with py-spy here")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    levels = [int(x) for x in args.clients.split(",")]
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    met = uvloop.run(run(levels, args.tokens, args.delay_ms, args.profile, args.json))
    sys.exit(0 if met else 1)


if __name__ == "__main__":
    main()
