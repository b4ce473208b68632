"""What the 3-node JetStream cluster costs a write: acknowledged publishes per second
into an R3 stream on three clustered nodes with `sync_interval: always` (the production
shape), against the same load into an R1 stream on one node with the default
lazy fsync, measured in the same run; and each with one node's CPU per message.

    .venv/bin/python bench/cluster.py [--publishers 1,32] [--seconds 5] [--size 512]

`deploy/SCALING.md` quotes it: the cluster is the bus's ceiling on event appends.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import nats
from nats.js.api import StorageType, StreamConfig
from nats.js.errors import ServiceUnavailableError

import benchkit as bk
from servicekit.bus import server_urls
from servicekit.embedded import start_nats, start_nats_cluster


async def measure(
    url: str, replicas: int, publishers: int, seconds: float, size: int, pids: list[int]
) -> tuple[bk.LoopResult, float]:
    """A closed loop of `publishers` clients publishing with ack; CPU ms per message of the
    nats-server processes."""
    nc = await nats.connect(server_urls(url))
    try:
        js = nc.jetstream(timeout=10)
        name = f"BENCH{replicas}X{publishers}"
        config = StreamConfig(
            name=name, subjects=[f"{name}.>"], num_replicas=replicas, storage=StorageType.FILE
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                await js.add_stream(config)
                break
            except (ServiceUnavailableError, nats.errors.TimeoutError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
        body = b"x" * size

        async def publish(i: int) -> bool:
            await js.publish(f"{name}.{i}", body)
            return True

        meter = bk.CpuMeter({"nats": pids})
        await meter.start()
        result = await bk.closed_loop(publish, publishers, seconds)
        usage = await meter.stop(len(result.latencies), result.seconds)
        return result, usage.ms_per_op.get("nats", 0.0)
    finally:
        await nc.close()


def row(name: str, r: bk.LoopResult, cpu: float, base: bk.LoopResult | None) -> str:
    text = (
        f"  {name:<34} {r.rate:8.0f} msg/s  p50 {r.p_ms(0.5):6.2f} ms  "
        f"p99 {r.p_ms(0.99):6.2f} ms  nats CPU {cpu:.3f} ms/msg"
    )
    if base is not None:
        text += f"  ratio {bk.ratio(r.rate, base.rate):.2f}"
    return text


async def run(levels: list[int], seconds: float, size: int) -> None:
    print(
        f"JetStream acked publishes, {size} B messages, {seconds:.0f} s per level; "
        f"{bk.load_average()}"
    )
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as folder:
        state = Path(folder)
        single = start_nats(state / "single")
        cluster = start_nats_cluster(state / "cluster", 3)
        cluster_pids: Callable[[], list[int]] = lambda: [  # noqa: E731
            pid for i in range(3) if (pid := cluster.pid(i)) is not None
        ]
        try:
            for n in levels:
                base, base_cpu = await measure(
                    single.url, 1, n, seconds, size, [single.process.pid]
                )
                r3, r3_cpu = await measure(cluster.url, 3, n, seconds, size, cluster_pids())
                print(f"{n} publishers:")
                print(row("1 node, R1, lazy fsync (baseline)", base, base_cpu, None))
                print(row("3 nodes, R3, sync_interval always", r3, r3_cpu, base))
        finally:
            cluster.stop()
            single.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--publishers", default="1,32")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--size", type=int, default=512)
    args = parser.parse_args()
    levels = [int(x) for x in args.publishers.split(",")]
    asyncio.run(run(levels, args.seconds, args.size))


if __name__ == "__main__":
    main()
