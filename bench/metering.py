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

Goals (issue 12): per token ≤ 0.15 ms CPU across the processes, p99 added latency
≤ 3 ms at 200 streams; the bench exits non-zero when one is missed.

`--provider openai`: the same streams from an OpenAI-compatible server over HTTP (the fake
of `testkit.fake_chat_api`, in a process of its own, writing one chunk per word at the
delay), through the real SDK, as a local model is served: what one read of a stream gives
is published as fewer deltas when metering falls behind, and the bench prints deltas per
token. Its latencies start when metering read the text (the provider's emit time is
unknown), and the SDK's parsing is metering's CPU, so the goals are not checked there.

    .venv/bin/python bench/metering.py [--tokens 30] [--delay-ms 20] [--provider openai]

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
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import nats
import uvloop
from nats.aio.client import Client
from nats.aio.msg import Msg

from benchkit import (
    CpuMeter,
    Goals,
    cpu_table,
    fresh_database,
    latency_row,
    percentile,
    servers,
    service_env,
    start_services,
)
from contracts import subjects
from contracts.metering import (
    BindingSetReply,
    ChatMessage,
    LlmStream,
    SetBinding,
    TurnDelta,
    TurnReply,
)
from servicekit.client import call

LEVELS = (1, 50, 200)
# Streams measured per level (the single-stream level runs its streams one after another).
STREAMS_PER_LEVEL = {1: 20, 50: 100, 200: 200}
SUBJECT_ROOT = "agent.delta.bench"
# Issue 12, at 200 streams: CPU per token across the processes; p99 added latency.
CPU_PER_TOKEN_GOAL_MS = 0.15
PER_TOKEN_P99_GOAL_MS = 3.0


@dataclass
class Samples:
    per_token_ms: list[float] = field(default_factory=list)
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
        self.samples.per_token_ms.append((now - delta.emitted_at) * 1000)
        if delta.seq == 1 and not self.first[stream_id].done():
            self.first[stream_id].set_result(now)
        self.words[stream_id] += len(delta.text.split())
        if self.words[stream_id] == self.expected:
            self.done[stream_id].set()


def stagger(k: int, concurrency: int, duration_s: float) -> float:
    """When the k-th stream of the first wave starts: spread over one stream's duration."""
    return k / concurrency * duration_s if k < concurrency else 0.0


async def metering_streams(
    nc: Client, receiver: Receiver, streams: int, concurrency: int, tokens: int, delay_s: float
) -> None:
    limit = asyncio.Semaphore(concurrency)

    async def one(k: int) -> None:
        async with limit:  # the first wave takes the slots, then waits for its start time
            await asyncio.sleep(stagger(k, concurrency, tokens * delay_s))
            stream_id = uuid.uuid4().hex
            receiver.expect(stream_id)
            cmd = LlmStream(
                run_id=f"bench-{stream_id}",
                turn_id=f"bench-{stream_id}",
                agent_slug="bench",
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


async def serve_openai(tokens: int, delay_s: float) -> None:
    """The fake OpenAI-compatible server of `--provider openai`: every request answered
    with `tokens` words, one chunk each, written `delay_s` apart; prints its base URL and
    serves until its stdin closes."""
    from testkit.fake_chat_api import FakeChatApi, Reply, text_reply

    def answer(_: dict[str, Any]) -> Reply:
        reply = text_reply([f"w{i} " for i in range(tokens)], prompt=100)
        reply.pace_after, reply.pace_seconds = 0, delay_s
        return reply

    fake = await FakeChatApi(answer).start()
    print(fake.base_url, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await fake.stop()


async def start_openai(
    stack: contextlib.AsyncExitStack, tokens: int, delay_s: float
) -> tuple[str, int]:
    """The fake server's process: its base URL and pid."""
    child = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--serve-openai", str(tokens), str(delay_s),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert child.stdin is not None and child.stdout is not None
    stack.push_async_callback(child.wait)
    stack.callback(child.stdin.close)
    return (await child.stdout.readline()).decode().strip(), child.pid


async def run(tokens: int, delay_ms: float, provider: str) -> int:
    delay_s = delay_ms / 1000
    async with contextlib.AsyncExitStack() as stack:
        srv = stack.enter_context(servers(prefix="bench-metering-"))
        nats_url = srv.nats_url
        database_url = await stack.enter_async_context(fresh_database(srv.admin_url))
        script = {
            "steps": [
                {
                    "agent": "bench",
                    "text": " ".join(f"w{i}" for i in range(tokens)),
                    "input_tokens": 100,
                    "token_delay_ms": delay_ms,
                }
            ]
        }
        script_path = srv.state / "script.json"
        script_path.write_text(json.dumps(script))
        env = service_env(
            nats_url,
            database_url,
            AGENTBUS_PROVIDER="scripted",
            AGENTBUS_SCRIPT_PATH=str(script_path),
            AGENTBUS_LOG_FORMAT="json",
        )
        provider_group: dict[str, list[int]] = {}
        if provider == "openai":
            url, pid = await start_openai(stack, tokens, delay_s)
            env.update(OPENAI_BASE_URL=url, OPENAI_API_KEY="bench")
            provider_group = {"provider": [pid]}
        nc = await nats.connect(nats_url)
        stack.push_async_callback(nc.close)
        procs = await start_services(stack, nc, env, srv.state, ["metering"])
        if provider == "openai":  # the bench agent's model, served by the OpenAI fake
            binding = SetBinding(scope="agent", agent_slug="bench", project_id="bench",
                                 model="llama3.2", provider="openai")  # fmt: skip
            await call(nc, subjects.BINDINGS_SET, binding, BindingSetReply)
        pool = await asyncpg.create_pool(database_url, min_size=1, max_size=1)
        assert pool is not None
        stack.push_async_callback(pool.close)
        nats_group = {"nats": [srv.nats_pid]} if srv.nats_pid is not None else {}
        print(f"metering bench: {tokens} tokens per stream, one every {delay_ms} ms, "
              f"{provider} provider; {os.cpu_count()} cores")  # fmt: skip
        goals, cpu_rows = Goals(), []
        for level in LEVELS:
            streams = STREAMS_PER_LEVEL[level]
            base, measured = Receiver(), Receiver()
            base.expected = measured.expected = tokens
            sub = await nc.subscribe(f"{SUBJECT_ROOT}.*", cb=base.on_msg)
            await nc.flush()
            meter = CpuMeter(nats_group)
            await meter.start()
            started = time.perf_counter()
            publisher_s = await baseline(nats_url, base, streams, level, tokens, delay_s)
            base_cpu = await meter.stop(streams * tokens, time.perf_counter() - started)
            base_cpu.ms_per_op["publisher"] = round(publisher_s * 1000 / (streams * tokens), 3)
            await sub.unsubscribe()
            sub = await nc.subscribe(f"{SUBJECT_ROOT}.*", cb=measured.on_msg)
            await nc.flush()
            meter = CpuMeter({"metering": [procs[0].pid], **provider_group, **nats_group}, pool)
            await meter.start()
            started = time.perf_counter()
            await metering_streams(nc, measured, streams, level, tokens, delay_s)
            cpu = await meter.stop(streams * tokens, time.perf_counter() - started)
            await sub.unsubscribe()
            hop, per_token = base.samples.per_token_ms, measured.samples.per_token_ms
            print(f"{level} concurrent stream(s), {streams} streams:")
            print(latency_row("baseline raw NATS hop", hop))
            print(latency_row("per-token added latency", per_token, hop))
            print(latency_row("TTFT overhead", measured.samples.ttft_overhead_ms, hop))
            print(f"  deltas per token {len(per_token) / (streams * tokens):.3f}", flush=True)
            cpu_rows += [("raw hop", level, base_cpu), ("metering", level, cpu)]
            if level == max(LEVELS) and provider == "scripted":
                goals.at_most(f"CPU ms per token at {level} streams",
                              sum(cpu.ms_per_op.values()), CPU_PER_TOKEN_GOAL_MS)  # fmt: skip
                goals.at_most(f"per-token added latency p99 ms at {level} streams",
                              percentile(per_token, 0.99), PER_TOKEN_P99_GOAL_MS)  # fmt: skip
        roles = ["metering", *provider_group, "publisher", *nats_group, "postgres"]
        print("\n".join(cpu_table(roles, cpu_rows, name_width=9)).replace("per op", "per token"))
        print("goals:")
        print("\n".join(goals.report()))
        return goals.exit_code


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--publish-baseline":
        url, streams, concurrency, tokens, delay = sys.argv[2:7]
        uvloop.run(baseline_publisher(url, int(streams), int(concurrency), int(tokens),
                                      float(delay)))  # fmt: skip
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-openai":
        # This file is `metering` too when run as a script (its folder comes first on the
        # path): the service's package is found once the folder is out of the way.
        sys.path.remove(os.path.dirname(os.path.abspath(__file__)))
        uvloop.run(serve_openai(int(sys.argv[2]), float(sys.argv[3])))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=30)
    parser.add_argument("--delay-ms", type=float, default=20.0)
    parser.add_argument("--provider", choices=["scripted", "openai"], default="scripted")
    args = parser.parse_args()
    sys.exit(uvloop.run(run(args.tokens, args.delay_ms, args.provider)))


if __name__ == "__main__":
    main()
