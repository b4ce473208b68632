"""A stream's deltas are gathered over a window: fewer messages for every hop after metering.

The provider here is fed by the test, piece by piece: a gap between two pieces is the
test not having fed the next one yet, so what falls within a window is decided by the
test, never by the machine's speed. The windows are either far longer than any test
(what is held goes out at the size bound, the stream's end, or never: a stop) or short,
waited for by the delta they publish. Each test sees the deltas and the reply in the
order metering published them.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest_asyncio
from nats.aio.client import Client
from nats.aio.msg import Msg

from contracts import subjects
from contracts.metering import (
    CancelReply,
    CancelTurn,
    ChatMessage,
    LlmStream,
    TextBlock,
    TurnDelta,
    TurnReply,
)
from metering.providers.base import OnText, Progress, ProviderReply, ProviderRequest
from servicekit.client import call
from testkit.metering import Starter
from testkit.probes import subscribed, wait_for

# Longer than any test: nothing is published at the end of such a window.
FOREVER_MS = 3_600_000.0


class Fed:
    """A provider whose pieces of text the test hands on (`feed`); `end` ends the stream."""

    name = "scripted"

    def __init__(self) -> None:
        self.pieces: asyncio.Queue[str | None] = asyncio.Queue()
        self.called = asyncio.Event()
        self.fed = 0
        self.handed = 0

    def feed(self, *pieces: str) -> None:
        for piece in pieces:
            self.pieces.put_nowait(piece)
        self.fed += len(pieces)

    async def taken(self) -> None:
        """Until every piece fed was handed on: the provider waits for the next one, which
        comes in a read of its own."""
        await wait_for(lambda: self.handed == self.fed, what="the pieces handed on")

    def end(self) -> None:
        self.pieces.put_nowait(None)

    async def complete(
        self, request: ProviderRequest, progress: Progress, on_text: OnText | None
    ) -> ProviderReply:
        assert on_text is not None
        self.called.set()
        written: list[str] = []
        while (piece := await self.pieces.get()) is not None:
            written.append(piece)
            await on_text(piece, progress.text())
            self.handed += 1
        return ProviderReply([TextBlock(text="".join(written))], "end_turn", request.model)

    async def close(self) -> None:
        pass


@dataclass
class Transcript:
    """What came back for one streamed turn, deltas and reply, in arrival order."""

    delta_subject: str
    reply_subject: str
    deltas: list[TurnDelta] = field(default_factory=list)
    order: list[str] = field(default_factory=list)
    reply: TurnReply | None = None

    async def collect(self, msg: Msg) -> None:
        if msg.subject == self.delta_subject:
            self.deltas.append(TurnDelta.model_validate_json(msg.data))
            self.order.append("delta")
        elif msg.subject == self.reply_subject:
            self.reply = TurnReply.model_validate_json(msg.data)
            self.order.append("reply")

    def texts(self) -> list[str]:
        return [d.text for d in self.deltas]

    def replied(self) -> TurnReply:
        assert self.reply is not None
        return self.reply


def streamed() -> LlmStream:
    session = uuid.uuid4()
    return LlmStream(
        run_id=f"run-{uuid.uuid4().hex[:8]}",
        turn_id=f"turn-{uuid.uuid4().hex}",
        agent_slug="writer",
        project_id="proj",
        session_id=session,
        messages=[ChatMessage(role="user", content="Bom dia?")],
        max_tokens=100,
        delta_subject=subjects.delta_subject("proj", session),
    )


Launch = Callable[..., Awaitable[Fed]]


@pytest_asyncio.fixture(loop_scope="session")
async def launch(start_metering: Starter) -> AsyncIterator[Launch]:
    """Start metering with a fed provider and these settings; its stream is ended before
    metering stops (a replica finishes the turns in flight first)."""
    fed: list[Fed] = []

    async def start(**settings: Any) -> Fed:
        provider = Fed()
        fed.append(provider)
        await start_metering(provider=provider, **settings)
        return provider

    yield start
    for provider in fed:
        provider.end()


async def start_turn(nc: Client, cmd: LlmStream, provider: Fed) -> Transcript:
    """Send `cmd.llm.stream`, its reply and its deltas watched on one subscription (of
    every subject: two would each deliver in order, but not in order with each other)."""
    seen = Transcript(cmd.delta_subject, nc.new_inbox())
    await nc.subscribe(">", cb=seen.collect)
    await subscribed(nc)
    await nc.publish(subjects.LLM_STREAM, cmd.model_dump_json().encode(), reply=seen.reply_subject)
    await wait_for(lambda: provider.called.is_set() or seen.order, what="the provider's call")
    assert provider.called.is_set(), seen.order
    return seen


async def deltas(seen: Transcript, count: int) -> None:
    await wait_for(lambda: len(seen.deltas) == count, what=f"{count} deltas")


async def finished(seen: Transcript) -> TurnReply:
    """The reply, after every delta: the joined deltas are its text, numbered from 1."""
    await wait_for(lambda: seen.reply is not None, what="the reply")
    reply = seen.replied()
    assert seen.order == ["delta"] * len(seen.deltas) + ["reply"]
    assert [d.seq for d in seen.deltas] == list(range(1, len(seen.deltas) + 1))
    text = "".join(b.text for b in reply.content if b.type == "text")
    assert "".join(seen.texts()) == text
    return reply


async def test_the_first_piece_goes_out_at_once_and_the_window_gathers_the_rest_into_one(
    nc: Client, launch: Launch
) -> None:
    provider = await launch(delta_window_ms=FOREVER_MS)
    seen = await start_turn(nc, streamed(), provider)

    provider.feed("Bom ")
    await deltas(seen, 1)  # not held, whatever the window: the time to the first token
    for piece in ("dia", ", ", "Ana"):  # each after a gap: the provider waits for it
        await provider.taken()
        provider.feed(piece)
    await provider.taken()
    provider.end()
    reply = await finished(seen)

    # Held until the stream's end (the window is longer), then out before the reply.
    assert seen.texts() == ["Bom ", "dia, Ana"]
    assert reply.stop_reason == "end_turn"


async def test_the_end_of_the_window_publishes_what_it_gathered_before_the_stream_ends(
    nc: Client, launch: Launch
) -> None:
    provider = await launch(delta_window_ms=20.0)
    seen = await start_turn(nc, streamed(), provider)

    provider.feed("Bom ", "dia, ", "Ana")  # one read: the first at once, the rest held
    await deltas(seen, 2)  # the window ended; the stream did not
    provider.feed(".")
    await deltas(seen, 3)
    provider.end()
    await finished(seen)

    assert seen.texts() == ["Bom ", "dia, Ana", "."]


async def test_the_size_bound_cuts_a_delta_without_waiting_for_the_window(
    nc: Client, launch: Launch
) -> None:
    provider = await launch(delta_window_ms=FOREVER_MS, delta_max_chars=10)
    seen = await start_turn(nc, streamed(), provider)

    provider.feed("Bom ")
    await deltas(seen, 1)
    provider.feed("dia, ")
    await provider.taken()
    provider.feed("Ana! ")  # ten characters held: out now
    await deltas(seen, 2)
    provider.feed("Tudo ", "bem?")
    provider.end()
    await finished(seen)

    assert seen.texts() == ["Bom ", "dia, Ana! ", "Tudo bem?"]


async def test_a_zero_window_publishes_every_piece_the_provider_waited_for(
    nc: Client, start_metering: Starter
) -> None:
    """Window 0: one delta per read of the provider's stream (the pieces it hands on
    without waiting), none held across a wait."""
    provider = Fed()
    await start_metering(provider=provider, delta_window_ms=0)
    seen = await start_turn(nc, streamed(), provider)

    provider.feed("Bom ", "dia")
    await deltas(seen, 2)
    provider.feed(", ")
    await deltas(seen, 3)
    provider.feed("Ana")
    await deltas(seen, 4)
    provider.end()
    await finished(seen)

    assert seen.texts() == ["Bom ", "dia", ", ", "Ana"]


async def test_a_stop_drops_what_is_held_and_nothing_more_is_published(
    nc: Client, launch: Launch
) -> None:
    provider = await launch(delta_window_ms=FOREVER_MS)
    cmd = streamed()
    seen = await start_turn(nc, cmd, provider)

    provider.feed("one ")
    await deltas(seen, 1)
    await provider.taken()
    provider.feed("two ")  # held for the window
    await provider.taken()
    assert cmd.session_id is not None
    stop = CancelTurn(turn_id=cmd.turn_id, project_id=cmd.project_id, session_id=cmd.session_id)
    assert (await call(nc, subjects.LLM_CANCEL, stop, CancelReply)).status == "cancelling"
    reply = await finished(seen)

    # The stopped reply holds what was published, and what was held never goes out.
    assert reply.stop_reason == "cancelled"
    assert seen.texts() == ["one "]
