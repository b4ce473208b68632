"""One provider call's CPU in metering's process: the SDK's door over the bare HTTP floor.

Metering's provider (`AnthropicProvider`, `OpenAICompatibleProvider`, as metering builds
them) calls the stand-in of `bench/fakeprovider.py`, in a process of its own, with a
conversation of `--messages` messages, a system prompt and two tools, each call a
streamed reply of `--tokens` words written at once: what is measured is mostly what it
costs to start a call and to end it, not the per-token path (`bench/metering.py`).
Calls go one after another, then in bursts of `--burst` started at once.

Baseline, in the same run against the same stand-in: the same request body's bytes
posted with a bare client on the providers' HTTP stack (the SDK's aiohttp client, the
provider's pool limits) and its SSE body split and parsed as the provider reads it — the
floor of a call on this HTTP stack. The stand-in keeps connections alive, so calls one by
one find the bursts' connections idle in the pool, as a replica's calls do after a burst.
Both are interleaved, round by round. Printed: CPU ms per call of this process (its CPU
÷ calls), the door's cost (provider − floor) and the ratio, and the burst's call → first
text p50 / p99 (wall clock, noisy on a loaded machine: read the CPU).

`--py-spy DIR` profiles this process during the provider's bursts and prints its top
frames.

    .venv/bin/python bench/provider_call.py [--provider {anthropic,openai} ...]
        [--calls 200] [--burst 50] [--rounds 3] [--tokens 5] [--messages 12] [--py-spy DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx2
import uvloop
from anthropic import DefaultAioHttpClient

# This folder's `metering.py` (a bench) would stand for metering's package: the folder is
# searched last, for `benchkit` and `fakeprovider` only.
sys.path.append(sys.path.pop(0))

from benchkit import load_average, percentile, py_spy, top_frames
from contracts.metering import ChatMessage, ToolSpec
from fakeprovider import OPENAI_MODEL, start_provider
from metering.providers import anthropic as anthropic_provider
from metering.providers import openai as openai_provider
from metering.providers.base import (
    DEFAULT_CONNECTIONS,
    Progress,
    Provider,
    ProviderRequest,
    http_limits,
    sse_data,
)

PROVIDERS = ("anthropic", "openai")
MODELS = {"anthropic": "claude-sonnet-4-6", "openai": OPENAI_MODEL}
# A turn of a conversation under way: a system prompt of some size, a history, two tools.
SYSTEM = "You are Criativo, who helps a person shape the app they want to build. " * 40


def conversation(model: str, messages: int) -> ProviderRequest:
    said = [
        ChatMessage(
            role="user" if i % 2 == 0 else "assistant",
            content=f"Message {i}: the orders close at 18h and the bakery opens at 7h. " * 6,
        )
        for i in range(messages - 1 + messages % 2)  # ends on the person's message
    ]
    schema = {"type": "object", "properties": {"title": {"type": "string"}}}
    tools = [
        ToolSpec(name="propose_plan", description="Propose the app's plan.", input_schema=schema),
        ToolSpec(name="ask_person", description="Ask the person a question.", input_schema=schema),
    ]
    return ProviderRequest(
        model=model,
        agent_slug="criativo",
        system=SYSTEM,
        messages=said,
        tools=tools,
        max_tokens=1024,
    )


@dataclass
class Floor:
    """The bare HTTP call: the provider's request bytes, posted and read without the SDK."""

    url: str
    body: bytes
    headers: dict[str, str]
    client: httpx2.AsyncClient = field(
        default_factory=lambda: DefaultAioHttpClient(limits=http_limits(DEFAULT_CONNECTIONS))
    )

    async def call(self, first: Callable[[], None]) -> None:
        request = self.client.build_request(
            "POST", self.url, content=self.body, headers=self.headers
        )
        response = await self.client.send(request, stream=True)
        try:
            response.raise_for_status()
            seen = False
            async for data in sse_data(response.aiter_bytes()):
                if data.startswith(b"[DONE]"):
                    continue
                json.loads(data)
                if not seen:
                    seen = True
                    first()
        finally:
            await response.aclose()


def floor_of(provider: str, url: str, request: ProviderRequest) -> Floor:
    if provider == "anthropic":
        params = anthropic_provider.build_params(request) | {"stream": True}
        headers = {"x-api-key": "bench", "anthropic-version": "2023-06-01"}
        target = f"{url.rstrip('/')}/v1/messages"
    else:
        params = openai_provider.build_params(request)
        headers = {"authorization": "Bearer bench"}
        target = f"{url.rstrip('/')}/chat/completions"
    body = json.dumps(params, ensure_ascii=False, separators=(",", ":")).encode()
    return Floor(target, body, headers | {"content-type": "application/json"})


def provider_of(provider: str, url: str) -> Provider:
    if provider == "anthropic":
        return anthropic_provider.AnthropicProvider(api_key="bench", base_url=url)
    return openai_provider.OpenAICompatibleProvider(api_key="bench", base_url=url)


Call = Callable[[Callable[[], None]], Awaitable[None]]


def provider_call(llm: Provider, request: ProviderRequest) -> Call:
    async def call(first: Callable[[], None]) -> None:
        seen: list[bool] = []

        async def on_text(text: str, emitted_at: float) -> None:
            if not seen:
                seen.append(True)
                first()

        await llm.complete(request, Progress(), on_text)

    return call


@dataclass
class Tally:
    """CPU ms per call, and call → first text ms, over the rounds."""

    one_by_one: list[float] = field(default_factory=list)
    burst: list[float] = field(default_factory=list)
    first_ms: list[float] = field(default_factory=list)


async def one_by_one(call: Call, calls: int) -> float:
    cpu = time.process_time()
    for _ in range(calls):
        await call(lambda: None)
    return (time.process_time() - cpu) * 1000 / calls


async def burst(call: Call, n: int, first_ms: list[float]) -> float:
    started = time.perf_counter()

    def first() -> None:
        first_ms.append((time.perf_counter() - started) * 1000)

    cpu = time.process_time()
    await asyncio.gather(*(call(first) for _ in range(n)))
    return (time.process_time() - cpu) * 1000 / n


async def measure(provider: str, args: argparse.Namespace) -> None:
    request = conversation(MODELS[provider], args.messages)
    async with contextlib.AsyncExitStack() as stack:
        model = await start_provider(stack, provider, args.tokens, 0.0)
        url = model.env.get("ANTHROPIC_BASE_URL") or model.env["OPENAI_BASE_URL"]
        llm = provider_of(provider, url)
        stack.push_async_callback(llm.close)
        floor = floor_of(provider, url, request)
        stack.push_async_callback(floor.client.aclose)
        ways = {"provider": provider_call(llm, request), "floor": floor.call}
        for call in ways.values():  # the first uses: lazy imports, connections
            await burst(call, args.burst, [])
        tallies = {name: Tally() for name in ways}
        spy = args.py_spy / f"provider-call-{provider}.txt" if args.py_spy else None
        for _ in range(args.rounds):
            for name, call in ways.items():
                tally = tallies[name]
                tally.one_by_one.append(await one_by_one(call, args.calls))
                with contextlib.ExitStack() as profiling:
                    if spy is not None and name == "provider":
                        profiling.enter_context(py_spy(os.getpid(), spy))
                    for _ in range(args.bursts):
                        tally.burst.append(await burst(call, args.burst, tally.first_ms))
        print(f"\n{provider}: {len(floor.body)} bytes of request, {args.tokens} words per "
              f"reply; CPU ms per call, median of {args.rounds} rounds")  # fmt: skip
        mine, base = tallies["provider"], tallies["floor"]
        for label, pick in (("one by one", "one_by_one"), (f"{args.burst} at once", "burst")):
            ours = statistics.median(getattr(mine, pick))
            floor_ms = statistics.median(getattr(base, pick))
            print(f"  {label:<12} provider {ours:6.3f}   floor {floor_ms:6.3f}   "
                  f"door {ours - floor_ms:6.3f}   ratio {ours / floor_ms:5.2f}")  # fmt: skip
        for name, tally in tallies.items():
            print(f"  {args.burst} at once, call → first text, {name:<8} "
                  f"p50 {percentile(tally.first_ms, 0.5):7.1f} ms   "
                  f"p99 {percentile(tally.first_ms, 0.99):7.1f} ms")  # fmt: skip
        print(f"  ({load_average()})")
        if spy is not None:
            print(f"py-spy, this process during the provider's bursts ({spy}):")
            print("\n".join(top_frames(spy, 30)))


async def run(args: argparse.Namespace) -> None:
    for provider in args.provider or PROVIDERS:
        await measure(provider, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--provider", choices=PROVIDERS, action="append")
    parser.add_argument("--calls", type=int, default=200, help="one by one, per round")
    parser.add_argument("--burst", type=int, default=50, help="calls started at once")
    parser.add_argument("--bursts", type=int, default=4, help="bursts per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=5, help="words per reply")
    parser.add_argument("--messages", type=int, default=12, help="of the conversation")
    parser.add_argument("--py-spy", metavar="DIR", type=Path)
    args = parser.parse_args()
    uvloop.run(run(args))


if __name__ == "__main__":
    main()
