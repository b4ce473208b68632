"""The benches' provider stand-in (`bench/fakeprovider.py`) through the official Anthropic
SDK, as metering calls it: each word carries when the stand-in wrote it and the first
also when the request arrived, so a bench measures per-token latency from the provider's
emit and the stand-in's own time to its first word; a scripted delta keeps its own
`emitted_at`."""

from __future__ import annotations

import time
from types import ModuleType

from anthropic import AsyncAnthropic

from contracts.metering import TurnDelta

from .benches import bench_module

PACE_S = 0.05


def fakeprovider() -> ModuleType:
    return bench_module("fakeprovider")


async def test_each_word_carries_its_write_time_and_the_first_the_request_time() -> None:
    fp = fakeprovider()
    fake = await fp.stand_in("anthropic", 3, PACE_S).start()
    try:
        client = AsyncAnthropic(api_key="test", base_url=fake.base_url, max_retries=0)
        asked = time.time()
        got: list[tuple[str, float]] = []
        async with client.messages.stream(
            model="claude-sonnet-4-6",
            max_tokens=10,
            messages=[{"role": "user", "content": "Tell me about bread."}],
        ) as stream:
            async for text in stream.text_stream:
                got.append((text, time.time()))
        await client.close()
    finally:
        await fake.stop()

    assert [text.split("@")[0] for text, _ in got] == ["w0", "w1", "w2"]
    written = [fp.emitted_at(text, 0.0) for text, _ in got]
    assert all(asked <= at <= received for at, (_, received) in zip(written, got, strict=True))
    assert written == sorted(written)
    first = TurnDelta(turn_id="t", seq=1, text=got[0][0], emitted_at=0.0)
    # the stand-in paces its first word too, as a provider takes time before it
    assert fp.first_word_s(first) >= PACE_S
    later = TurnDelta(turn_id="t", seq=2, text=got[1][0], emitted_at=0.0)
    assert fp.first_word_s(later) is None


def test_a_scripted_delta_keeps_its_own_emit_time() -> None:
    fp = fakeprovider()
    delta = TurnDelta(turn_id="t", seq=1, text="w0 w1 ", emitted_at=12.5)
    assert fp.emitted(delta) == 12.5
    assert fp.first_word_s(delta) is None
