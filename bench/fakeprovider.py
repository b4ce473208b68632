"""The model provider of a bench's real path: a stand-in of the provider's HTTP+SSE API in a
process of its own, which metering calls through the provider's official SDK.

`--provider anthropic` serves `testkit.fake_messages_api` (the Anthropic Messages API),
`--provider openai` `testkit.fake_chat_api` (OpenAI-compatible, as a local model is
served); `scripted` is metering's in-process provider and needs no stand-in. Every
request is answered with the same words, one event each, `delay` apart (the first one
too, as the scripted provider waits before its first token). Each word carries the time
the stand-in wrote it, and the first word also when the request arrived, so a bench
measures per-token latency from the provider's emit and the stand-in's own time to its
first word (what the provider itself takes, not the path to it):

    w0@<written>@<asked> w1@<written> w2@<written> …

A stream that ends leaves its connection open for metering's next call, as the providers'
APIs do (HTTP/1.1 keep-alive; the SDKs and metering's pool are built to reuse it): a
stand-in closing it after each stream would make every turn pay a connection that real
turns do not pay, and hide what keeping many connections costs metering's HTTP client
(decision 0024). Connections are plain TCP on loopback: a new one here costs no TLS
handshake, so a burst's first round, which opens its connections, is cheaper than
against the real API.

Every bench imports this (`from fakeprovider import …`); the stand-in's process runs
this file (`python bench/fakeprovider.py <provider> <tokens> <delay_s>`), prints its
base URL and serves until its stdin closes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import uvloop
from nats.aio.client import Client

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
from testkit import fake_chat_api as chat
from testkit import fake_messages_api as messages
from testkit.fake_sse import FakeSseServer, R

PROVIDERS = ("scripted", "anthropic", "openai")
# What a bench runs when no `--provider` is given: the scripted provider beside the real
# path, so each figure of the real path has its ratio to the scripted one.
DEFAULT_PROVIDERS = ("scripted", "anthropic")
# The placeholders a word carries until the stand-in writes it: then its write time, and
# (the first word) the time its request arrived.
STAMP = b"@EMITTED"
ASKED = b"@ASKED"
OPENAI_MODEL = "llama3.2"
# The agents the benches stream as: bench/metering.py's and `Provider.warm`'s, and Criativo.
BENCH_AGENTS = ("bench", "criativo")


def stamps(text: str) -> list[float]:
    """The times stamped on the first word of `text`: [written] or [written, asked]; none
    for a delta of the scripted provider."""
    word = text.split(maxsplit=1)[0] if text.strip() else ""
    return [float(t) for t in word.split("@")[1:]]


def emitted_at(text: str, emitted: float) -> float:
    """When the provider emitted a delta's first word: the write time the stand-in stamped
    on it, or, from the scripted provider, the delta's own `emitted_at`."""
    at = stamps(text)
    return at[0] if at else emitted


def emitted(delta: TurnDelta) -> float:
    return emitted_at(delta.text, delta.emitted_at)


def first_word_s(delta: TurnDelta) -> float | None:
    """The stand-in's own time from a request to its first word, from the turn's first
    delta; None for any other delta, or from the scripted provider."""
    at = stamps(delta.text)
    return at[0] - at[1] if delta.seq == 1 and len(at) == 2 else None


def bench_fake(base: type[FakeSseServer[R]], reply: R) -> FakeSseServer[R]:
    """A fake API of class `base` answering every request with `reply`, writing in place of
    `ASKED` the time the request arrived and in place of `STAMP` the time it writes the
    frame."""

    class BenchFake(base):  # type: ignore[valid-type,misc]
        asked = 0.0

        def _next_reply(self, body: dict[str, Any]) -> R:
            self.asked = time.time()  # `_frames` follows at once, before any other request
            return reply

        def _frames(self, reply: R) -> list[bytes] | None:
            frames: list[bytes] | None = super()._frames(reply)
            stamp = b"@%.6f" % self.asked
            return None if frames is None else [f.replace(ASKED, stamp) for f in frames]

        @staticmethod
        def _write_chunk(writer: asyncio.StreamWriter, frame: bytes) -> None:
            base._write_chunk(writer, frame.replace(STAMP, b"@%.6f" % time.time()))

    return cast(FakeSseServer[R], BenchFake())


def words(tokens: int) -> list[str]:
    """The answer's words, with their placeholders."""
    first = f"w0{STAMP.decode()}{ASKED.decode()} "
    return [first, *(f"w{i}{STAMP.decode()} " for i in range(1, tokens))]


def stand_in(provider: str, tokens: int, delay_s: float) -> FakeSseServer[Any]:
    """The fake API of `provider`, answering every request with `tokens` words."""
    answer = words(tokens)
    if provider == "anthropic":
        events = [messages.message_start(100), *messages.text_block(0, answer)]
        events += [messages.message_delta(tokens), messages.MESSAGE_STOP]
        # message_start, content_block_start and ping go at once, then one word per delay
        reply = messages.Reply(events=events, pace_after=3, pace_seconds=delay_s)
        return bench_fake(messages.FakeMessagesApi, reply)
    if provider == "openai":
        chunks = chat.text_reply(answer, prompt=100)
        chunks.pace_after, chunks.pace_seconds = 1, delay_s  # the role chunk goes at once
        return bench_fake(chat.FakeChatApi, chunks)
    raise ValueError(f"no stand-in for provider {provider!r}")


async def serve(provider: str, tokens: int, delay_s: float) -> None:
    """Serve the stand-in until stdin closes; its base URL is printed first."""
    fake = await stand_in(provider, tokens, delay_s).start()
    print(fake.base_url, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await fake.stop()


@dataclass
class Provider:
    """The provider metering is started with: its environment, and the stand-in's process
    (none for the scripted provider)."""

    name: str
    env: dict[str, str] = field(default_factory=dict)
    pid: int | None = None

    @property
    def group(self) -> dict[str, list[int]]:
        """The stand-in as a `CpuMeter` group: the provider's CPU, not the system's."""
        return {"provider": [self.pid]} if self.pid is not None else {}

    async def bind(self, nc: Client, project: str) -> None:
        """With the OpenAI-compatible stand-in, the benches' agents of `project` use its model
        (metering must be answering); the others need no binding. Bound per agent: an
        agent's binding (Criativo has one from metering's seed) outranks a project's."""
        if self.name != "openai":
            return
        for agent in BENCH_AGENTS:
            binding = SetBinding(scope="agent", agent_slug=agent, project_id=project,
                                 model=OPENAI_MODEL, provider="openai")  # fmt: skip
            await call(nc, subjects.BINDINGS_SET, binding, BindingSetReply, timeout=30)

    async def warm(self, nc: Client, project: str) -> None:
        """One stream of `project` through metering, not measured: metering's first call
        to a provider pays its first uses (the SDK's lazy imports, the connection), not
        what a turn costs."""
        stream = LlmStream(run_id="warm-up", turn_id="warm-up", agent_slug="bench",
                           project_id=project, max_tokens=200,
                           messages=[ChatMessage(role="user", content="Tell me about bread.")],
                           delta_subject=f"{subjects.DELTA_PREFIX}warm-up.{self.name}")  # fmt: skip
        await call(nc, subjects.LLM_STREAM, stream, TurnReply, timeout=120)


async def start_provider(
    stack: contextlib.AsyncExitStack, provider: str, tokens: int, delay_s: float
) -> Provider:
    """The stand-in of `provider` in its own process (stopped when `stack` unwinds), and what
    metering's environment needs to call it; the scripted provider needs neither."""
    if provider == "scripted":
        return Provider(provider, {"AGENTBUS_PROVIDER": "scripted"})
    child = await asyncio.create_subprocess_exec(
        sys.executable, __file__, provider, str(tokens), str(delay_s),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert child.stdin is not None and child.stdout is not None
    stack.push_async_callback(child.wait)
    stack.callback(child.stdin.close)
    url = (await child.stdout.readline()).decode().strip()
    if provider == "anthropic":
        env = {"AGENTBUS_PROVIDER": "anthropic", "ANTHROPIC_BASE_URL": url,
               "ANTHROPIC_API_KEY": "bench"}  # fmt: skip
    else:
        env = {"OPENAI_BASE_URL": url, "OPENAI_API_KEY": "bench"}
    return Provider(provider, env, child.pid)


def add_provider_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--provider", choices=PROVIDERS, action="append",
                        help="repeatable; default: scripted and anthropic")  # fmt: skip


def chosen(providers: Sequence[str] | None) -> list[str]:
    """The providers to run, the scripted one first whatever the order asked: it is the
    base of the side-by-side ratios."""
    wanted = providers or DEFAULT_PROVIDERS
    return [p for p in PROVIDERS if p in wanted]


def main() -> None:
    provider, tokens, delay_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    uvloop.run(serve(provider, tokens, delay_s))


if __name__ == "__main__":
    main()
