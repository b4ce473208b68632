"""Metering's streaming path: what it adds per token and before the first token.

The scripted provider emits tokens at a fixed rate, stamping each with its emit
time; a subscriber on each turn's `delta_subject` measures

- per-token added latency: receive time − emit time (serialisation, publish, the
  NATS hop, the subscriber's parse);
- time-to-first-token overhead: first delta received − request sent − the
  provider's own delay before its first token (the command hop, binding and price
  look-ups, the budget reservation in Postgres, the first delta's hop);

- CPU ms per token of each process (metering, NATS, Postgres; the turn's start and bill
  spread over its tokens) against the raw hop's (publisher and NATS);

at 1, 50 and 200 concurrent streams — the first wave's starts spread over one
stream's duration, so the level is a steady number of streams in flight rather
than one burst of simultaneous starts — against a baseline measured in the same run:
a raw NATS publish→subscribe hop, from another process, of the same delta messages
at the same rate and concurrency. Metering runs as its own process (`python -m
metering`, scripted provider), as under `make up`.

Goals: per token ≤ 0.15 ms CPU across the processes, p99 added latency
≤ 3 ms at 200 streams; the bench exits non-zero when one is missed. These measure
metering's own cost per token, so they run with its delta window off
(`AGENTBUS_DELTA_WINDOW_MS=0`: a delta per read of the provider's stream).

Coalescing: then metering runs with the window off and at 40 ms, 100 concurrent streams
of tokens 5 ms and 20 ms apart, and prints the bus messages per streamed token (deltas:
the command and reply are per turn), the per-token added latency (of each delta's oldest
token, which waited longest) and the CPU per token with the window off and on. Goals with
the window on: ≤ 0.2 messages per token at 5 ms, ≤ 0.5 at 20 ms, per-token added latency
p99 ≤ the window + 60 ms.

`--provider anthropic` / `--provider openai`: the same streams from a provider's HTTP+SSE
API through its official SDK, as a deployment runs metering: the stand-in of
`bench/fakeprovider.py` (Anthropic Messages API, or OpenAI-compatible as a local model
is served), in a process of its own, writing one event per word at the delay. Each word
carries the time the stand-in wrote it, so per-token latency there spans the whole real
path (the HTTP hop, the SDK's parsing, metering, the NATS hop); "after metering's read"
is the part from metering's read of the text on. What one read of a stream gives is
published as fewer deltas when metering falls behind: the bench prints deltas per token
and metering's CPU per delta. The SDK's parsing is
metering's CPU, so the goals are checked on the scripted provider only; the Anthropic
provider runs at 1 and 50 streams.

By default the scripted and the Anthropic providers run in the same run, one metering
process after the other, and a table sets them side by side with their ratios.

    .venv/bin/python bench/metering.py [--tokens 30] [--delay-ms 20]
                                       [--provider {scripted,anthropic,openai} ...]

Servers: NATS_URL / DATABASE_URL when set, otherwise embedded ones in a temp dir; metering
migrates a database of its own, created for the run and dropped after it.
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
from collections.abc import Callable
from dataclasses import dataclass, field

import asyncpg
import nats
import uvloop
from nats.aio.client import Client
from nats.aio.msg import Msg

from benchkit import (
    Col,
    CpuMeter,
    CpuUsage,
    Goals,
    Servers,
    cpu_table,
    fresh_database,
    latency_row,
    percentile,
    ratio,
    servers,
    service_env,
    side_by_side,
    start_services,
    table,
)
from contracts import subjects
from contracts.metering import (
    ChatMessage,
    LlmStream,
    TurnDelta,
    TurnReply,
)
from fakeprovider import add_provider_option, chosen, emitted, start_provider
from servicekit.client import call

LEVELS = (1, 50, 200)
# The Anthropic SDK parses every event in metering's process: 200 streams of it would take
# the default run (both providers) well past a few minutes on two cores.
ANTHROPIC_LEVELS = (1, 50)
# Streams measured per level (the single-stream level runs its streams one after another).
STREAMS_PER_LEVEL = {1: 20, 50: 100, 200: 200}
SUBJECT_ROOT = "agent.delta.bench"
# The goals, at 200 streams: CPU per token across the processes; p99 added latency.
CPU_PER_TOKEN_GOAL_MS = 0.15
PER_TOKEN_P99_GOAL_MS = 3.0
# Coalescing: concurrent streams; the windows compared (off, then the default); the
# tokens' spacing and the goal for bus messages per token with the window on at each; what
# a token may wait beyond the window (p99).
COALESCING_STREAMS = 100
WINDOWS_MS = (0.0, 40.0)
MESSAGES_PER_TOKEN_GOALS = {5.0: 0.2, 20.0: 0.5}
COALESCED_P99_BEYOND_WINDOW_MS = 60.0


@dataclass
class Samples:
    per_token_ms: list[float] = field(default_factory=list)  # from the provider's emit
    after_read_ms: list[float] = field(default_factory=list)  # from metering's read
    ttft_overhead_ms: list[float] = field(default_factory=list)


class Receiver:
    """One subscription on every bench delta subject; records each delta's latency (that
    of its first word: a delta may carry several) and counts the words each stream got."""

    def __init__(self) -> None:
        self.first: dict[str, asyncio.Future[float]] = {}
        self.done: dict[str, asyncio.Event] = {}
        self.words: Counter[str] = Counter()
        self.expected = 0
        self.samples = Samples()

    def expect(self, stream_id: str) -> None:
        self.first[stream_id] = asyncio.get_running_loop().create_future()
        self.done[stream_id] = asyncio.Event()

    async def on_msg(self, msg: Msg) -> None:
        now = time.time()
        delta = TurnDelta.model_validate_json(msg.data)
        stream_id = msg.subject.rsplit(".", 1)[1]
        self.samples.per_token_ms.append((now - emitted(delta)) * 1000)
        self.samples.after_read_ms.append((now - delta.emitted_at) * 1000)
        if delta.seq == 1 and not self.first[stream_id].done():
            self.first[stream_id].set_result(now)
        self.words[stream_id] += len(delta.text.split())
        if self.words[stream_id] == self.expected:
            self.done[stream_id].set()


def stagger(k: int, concurrency: int, duration_s: float) -> float:
    """When the k-th stream of the first wave starts: spread over one stream's duration."""
    return k / concurrency * duration_s if k < concurrency else 0.0


async def metering_streams(nc: Client, receiver: Receiver, streams: int, concurrency: int,
                           tokens: int, delay_s: float, agent: str = "bench") -> None:  # fmt: skip
    limit = asyncio.Semaphore(concurrency)

    async def one(k: int) -> None:
        async with limit:  # the first wave takes the slots, then waits for its start time
            await asyncio.sleep(stagger(k, concurrency, tokens * delay_s))
            stream_id = uuid.uuid4().hex
            receiver.expect(stream_id)
            cmd = LlmStream(
                run_id=f"bench-{stream_id}",
                turn_id=f"bench-{stream_id}",
                agent_slug=agent,
                project_id="bench",
                messages=[ChatMessage(role="user", content="Tell me about bread.")],
                max_tokens=200,
                delta_subject=f"{SUBJECT_ROOT}.{stream_id}",
            )
            sent = time.time()
            await call(nc, subjects.LLM_STREAM, cmd, TurnReply, timeout=120)
            first = await receiver.first[stream_id]
            receiver.samples.ttft_overhead_ms.append((first - sent - delay_s) * 1000)
            await asyncio.wait_for(receiver.done[stream_id].wait(), 30)

    await asyncio.gather(*(one(k) for k in range(streams)))


async def baseline_publisher(nats_url: str, streams: int, concurrency: int, tokens: int,
                             delay_s: float) -> None:  # fmt: skip
    """Another process publishing the same deltas at the same rate: the raw hop. Prints
    the CPU seconds the publishing took (its start-up and imports left out)."""
    nc = await nats.connect(nats_url)
    cpu = time.process_time()
    limit = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with limit:
            await asyncio.sleep(stagger(i, concurrency, tokens * delay_s))
            subject = f"{SUBJECT_ROOT}.base{i}"
            started = time.monotonic()
            for seq in range(1, tokens + 1):
                await asyncio.sleep(max(0.0, started + seq * delay_s - time.monotonic()))
                delta = TurnDelta(turn_id=f"base{i}", seq=seq, text="word ", emitted_at=time.time())
                await nc.publish(subject, delta.model_dump_json().encode())

    await asyncio.gather(*(one(i) for i in range(streams)))
    await nc.flush()
    print(time.process_time() - cpu, flush=True)
    await nc.drain()


async def baseline(nats_url: str, receiver: Receiver, streams: int, concurrency: int,
                   tokens: int, delay_s: float) -> float:  # fmt: skip
    """The raw hop; returns the CPU seconds its publisher used publishing."""
    for i in range(streams):
        receiver.expect(f"base{i}")
    child = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--publish-baseline", nats_url, str(streams), str(concurrency),
        str(tokens), str(delay_s),
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await child.communicate()
    await asyncio.wait_for(
        asyncio.gather(*(receiver.done[f"base{i}"].wait() for i in range(streams))), 30
    )
    return float(out.decode().split()[-1])


@dataclass
class Level:
    """What one provider gave at one level of concurrency."""

    streams: int
    hop: list[float]  # the raw NATS hop's latencies, ms
    samples: Samples
    cpu: CpuUsage
    base_cpu: CpuUsage  # the raw hop's
    tokens: int  # words sent over the level's streams

    def metering_ms_per_delta(self) -> float:
        deltas = len(self.samples.per_token_ms)
        return self.cpu.ms_per_op.get("metering", 0.0) * self.tokens / max(deltas, 1)


async def measure(
    stack: contextlib.AsyncExitStack,
    srv: Servers,
    nc: Client,
    provider: str,
    tokens: int,
    delay_ms: float,
) -> dict[int, Level]:
    """Start metering with `provider` (and the fake API it calls) and measure its streams at
    each level, beside the raw NATS hop of the same deltas."""
    delay_s = delay_ms / 1000
    env, database_url = await scripted_env(stack, srv, tokens, {"bench": delay_ms}, window_ms=0)
    model = await start_provider(stack, provider, tokens, delay_s)
    procs = await start_services(stack, nc, env | model.env, srv.state, ["metering"])
    await model.bind(nc, "bench")
    pool = await one_connection(stack, database_url)
    nats_group = {"nats": [srv.nats_pid]} if srv.nats_pid is not None else {}
    print(f"\n{provider} provider (metering pid {procs[0].pid}):", flush=True)
    levels: dict[int, Level] = {}
    for level in ANTHROPIC_LEVELS if provider == "anthropic" else LEVELS:
        streams = STREAMS_PER_LEVEL[level]
        base, measured = Receiver(), Receiver()
        base.expected = measured.expected = tokens
        sub = await nc.subscribe(f"{SUBJECT_ROOT}.*", cb=base.on_msg)
        await nc.flush()
        meter = CpuMeter(nats_group)
        await meter.start()
        started = time.perf_counter()
        publisher_s = await baseline(srv.nats_url, base, streams, level, tokens, delay_s)
        base_cpu = await meter.stop(streams * tokens, time.perf_counter() - started)
        base_cpu.ms_per_op["publisher"] = round(publisher_s * 1000 / (streams * tokens), 3)
        await sub.unsubscribe()
        sub = await nc.subscribe(f"{SUBJECT_ROOT}.*", cb=measured.on_msg)
        await nc.flush()
        meter = CpuMeter({"metering": [procs[0].pid], **model.group, **nats_group}, pool)
        await meter.start()
        started = time.perf_counter()
        await metering_streams(nc, measured, streams, level, tokens, delay_s)
        cpu = await meter.stop(streams * tokens, time.perf_counter() - started)
        await sub.unsubscribe()
        hop, got = base.samples.per_token_ms, measured.samples
        print(f"{level} concurrent stream(s), {streams} streams:")
        print(latency_row("baseline raw NATS hop", hop))
        print(latency_row("per-token added latency", got.per_token_ms, hop))
        if provider != "scripted":
            print(latency_row("  after metering's read", got.after_read_ms, hop))
        print(latency_row("TTFT overhead", got.ttft_overhead_ms, hop))
        print(f"  deltas per token {len(got.per_token_ms) / (streams * tokens):.3f}", flush=True)
        levels[level] = Level(streams, hop, got, cpu, base_cpu, streams * tokens)
    return levels


async def scripted_env(
    stack: contextlib.AsyncExitStack,
    srv: Servers,
    tokens: int,
    delays_ms: dict[str, float],
    window_ms: float,
) -> tuple[dict[str, str], str]:
    """Metering's environment with the scripted provider (each agent of `delays_ms` writing
    `tokens` words that far apart) and a database of its own; and that database's URL."""
    database_url = await stack.enter_async_context(fresh_database(srv.admin_url))
    text = " ".join(f"w{i}" for i in range(tokens))
    steps = [
        {"agent": agent, "text": text, "input_tokens": 100, "token_delay_ms": delay}
        for agent, delay in delays_ms.items()
    ]
    script_path = srv.state / f"script-{uuid.uuid4().hex}.json"
    script_path.write_text(json.dumps({"steps": steps}))
    env = service_env(
        srv.nats_url,
        database_url,
        AGENTBUS_PROVIDER="scripted",
        AGENTBUS_SCRIPT_PATH=str(script_path),
        AGENTBUS_LOG_FORMAT="json",
        AGENTBUS_DELTA_WINDOW_MS=f"{window_ms:g}",
    )
    return env, database_url


async def one_connection(stack: contextlib.AsyncExitStack, database_url: str) -> asyncpg.Pool:
    """A pool of one connection, for `CpuMeter` to find the Postgres backends."""
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=1)
    assert pool is not None
    stack.push_async_callback(pool.close)
    return pool


@dataclass
class Coalesced:
    """Metering's streams at one window and one spacing of tokens."""

    window_ms: float
    delay_ms: float
    samples: Samples
    cpu: CpuUsage
    tokens: int  # words sent over the streams

    def messages_per_token(self) -> float:
        return len(self.samples.per_token_ms) / self.tokens


async def coalescing(srv: Servers, nc: Client, tokens: int) -> list[Coalesced]:
    """Metering with each of `WINDOWS_MS`, `COALESCING_STREAMS` streams at once at each
    spacing of tokens (an agent each, in one script)."""
    agents = {f"bench-{delay:g}ms": delay for delay in MESSAGES_PER_TOKEN_GOALS}
    streams = COALESCING_STREAMS
    nats_group = {"nats": [srv.nats_pid]} if srv.nats_pid is not None else {}
    results: list[Coalesced] = []
    for window_ms in WINDOWS_MS:
        async with contextlib.AsyncExitStack() as stack:
            env, database_url = await scripted_env(stack, srv, tokens, agents, window_ms)
            [proc] = await start_services(stack, nc, env, srv.state, ["metering"])
            pool = await one_connection(stack, database_url)
            for agent, delay_ms in agents.items():
                receiver = Receiver()
                receiver.expected = tokens
                sub = await nc.subscribe(f"{SUBJECT_ROOT}.*", cb=receiver.on_msg)
                await nc.flush()
                meter = CpuMeter({"metering": [proc.pid], **nats_group}, pool)
                await meter.start()
                started = time.perf_counter()
                await metering_streams(nc, receiver, streams, streams, tokens, delay_ms / 1000,
                                       agent)  # fmt: skip
                cpu = await meter.stop(streams * tokens, time.perf_counter() - started)
                await sub.unsubscribe()
                results.append(Coalesced(window_ms, delay_ms, receiver.samples, cpu,
                                         streams * tokens))  # fmt: skip
    return results


def coalescing_report(results: list[Coalesced], goals: Goals) -> list[str]:
    """The windows side by side at each spacing, with the ratio of the last to the first;
    the goals checked on the last window (the default)."""
    windows = sorted({r.window_ms for r in results})
    by = {(r.window_ms, r.delay_ms): r for r in results}
    figures: list[tuple[str, Callable[[Coalesced], float]]] = [
        ("bus messages per token", Coalesced.messages_per_token),
        ("per-token latency p50 ms", lambda r: percentile(r.samples.per_token_ms, 0.5)),
        ("per-token latency p99 ms", lambda r: percentile(r.samples.per_token_ms, 0.99)),
        ("first delta − delay p99 ms", lambda r: percentile(r.samples.ttft_overhead_ms, 0.99)),
        ("CPU ms per token: metering", lambda r: r.cpu.ms_per_op.get("metering", 0.0)),
        ("CPU ms per token: nats", lambda r: r.cpu.ms_per_op.get("nats", 0.0)),
        ("CPU ms per token: all", lambda r: sum(r.cpu.ms_per_op.values())),
    ]  # fmt: skip
    cols = [Col("apart", 6), Col("", 36, left=True)]
    cols += [Col(f"window {w:g} ms", 14, ".3f") for w in windows]
    cols += [Col(f"{windows[-1]:g} ÷ {windows[0]:g}", 10, ".2f")]
    rows = []
    for delay in sorted({r.delay_ms for r in results}):
        for i, (figure, value) in enumerate(figures):
            values = [value(by[(w, delay)]) for w in windows]
            first = f"{delay:g} ms" if i == 0 else ""
            rows.append([[first, f"  {figure}", *values, ratio(values[-1], values[0])]])
        on = by[(windows[-1], delay)]
        goals.at_most(f"bus messages per token, tokens {delay:g} ms apart, window "
                      f"{windows[-1]:g} ms", on.messages_per_token(),
                      MESSAGES_PER_TOKEN_GOALS[delay])  # fmt: skip
        goals.at_most(f"per-token added latency p99 ms, tokens {delay:g} ms apart, window "
                      f"{windows[-1]:g} ms", percentile(on.samples.per_token_ms, 0.99),
                      windows[-1] + COALESCED_P99_BEYOND_WINDOW_MS)  # fmt: skip
    return table([cols], rows)


FIGURES: list[tuple[str, Callable[[Level], float]]] = [
    ("raw NATS hop p50 ms", lambda r: percentile(r.hop, 0.5)),
    ("per-token latency p50 ms", lambda r: percentile(r.samples.per_token_ms, 0.5)),
    ("per-token latency p99 ms", lambda r: percentile(r.samples.per_token_ms, 0.99)),
    ("  after metering's read p50", lambda r: percentile(r.samples.after_read_ms, 0.5)),
    ("  after metering's read p99", lambda r: percentile(r.samples.after_read_ms, 0.99)),
    ("request → first delta − delay p50", lambda r: percentile(r.samples.ttft_overhead_ms, 0.5)),
    ("request → first delta − delay p99", lambda r: percentile(r.samples.ttft_overhead_ms, 0.99)),
    ("metering CPU ms per delta", Level.metering_ms_per_delta),
    ("deltas per token", lambda r: len(r.samples.per_token_ms) / r.tokens),
]


async def run(tokens: int, delay_ms: float, providers: list[str]) -> int:
    async with contextlib.AsyncExitStack() as stack:
        srv = stack.enter_context(servers(prefix="bench-metering-"))
        nc = await nats.connect(srv.nats_url)
        stack.push_async_callback(nc.close)
        print(f"metering bench: {tokens} tokens per stream, one every {delay_ms} ms; "
              f"{os.cpu_count()} cores, shared: figures are noisy")  # fmt: skip
        results: dict[str, dict[int, Level]] = {}
        for provider in providers:  # one metering process at a time: they share the subject
            async with contextlib.AsyncExitStack() as each:
                results[provider] = await measure(each, srv, nc, provider, tokens, delay_ms)
        print(f"\ncoalescing: {COALESCING_STREAMS} concurrent streams (scripted provider)...",
              flush=True)  # fmt: skip
        coalesced = await coalescing(srv, nc, tokens)
        goals = Goals()
        level = max(LEVELS)
        if (top := results.get("scripted", {}).get(level)) is not None:
            cpu_ms, p99 = (
                sum(top.cpu.ms_per_op.values()),
                percentile(top.samples.per_token_ms, 0.99),
            )
            goals.at_most(f"CPU ms per token at {level} streams", cpu_ms, CPU_PER_TOKEN_GOAL_MS)
            goals.at_most(f"per-token added latency p99 ms at {level} streams", p99,
                          PER_TOKEN_P99_GOAL_MS)  # fmt: skip
        cpu_rows = [
            row
            for provider, levels in results.items()
            for level, r in levels.items()
            for row in [("raw hop", level, r.base_cpu), (provider, level, r.cpu)]
        ]
        real = ["provider"] if set(providers) - {"scripted"} else []
        nats_role = ["nats"] if srv.nats_pid is not None else []
        roles = ["metering", *real, "publisher", *nats_role, "postgres"]
        print()
        print("\n".join(cpu_table(roles, cpu_rows, name_width=9)).replace("per op", "per token"))
        if len(results) > 1:
            ratios = "; ratios to the scripted provider's" if "scripted" in results else ""
            print(f"\nside by side (latencies in ms{ratios}):")
            print("\n".join(side_by_side(results, FIGURES)))
        print(f"\ncoalescing, {COALESCING_STREAMS} concurrent streams of {tokens} tokens "
              "(latencies in ms; the ratio: window on ÷ off):")  # fmt: skip
        print("\n".join(coalescing_report(coalesced, goals)))
        print("goals:")
        print("\n".join(goals.report()))
        return goals.exit_code


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--publish-baseline":
        url, streams, concurrency, tokens, delay = sys.argv[2:7]
        uvloop.run(baseline_publisher(url, int(streams), int(concurrency), int(tokens),
                                      float(delay)))  # fmt: skip
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=30)
    parser.add_argument("--delay-ms", type=float, default=20.0)
    add_provider_option(parser)
    args = parser.parse_args()
    sys.exit(uvloop.run(run(args.tokens, args.delay_ms, chosen(args.provider))))


if __name__ == "__main__":
    main()
