"""Deltas that each carry several words (metering gathers a stream's text over a window),
in a real Chromium: after a dropped socket and a reload in the middle of an answer, the
page shows the answer whole, no word twice, from the deltas replayed and received live."""

from __future__ import annotations

import json
from typing import Any

import pytest
from playwright.async_api import Page, WebSocket

from metering.providers.scripted import DEFAULT_SCRIPT, Script, ScriptStep

from .browsing import Browsing, chat_texts, criativo_page, responses, say, shot, streamed_words
from .conftest import Gateway

# 300 words 10 ms apart (about 3 s), gathered over 200 ms windows: deltas of many words,
# and time enough to drop the socket or reload the page between two of them.
ANSWER = " ".join(f"palavra{i}" for i in range(300))
WINDOW_MS = 200.0

# Every text the streaming bubble showed, so a repeated word shown even briefly is caught.
RECORD_STREAMING = """
window.__shown = window.__shown || [];
new MutationObserver(() => {
  for (const live of document.querySelectorAll('.msg.agent.streaming'))
    window.__shown.push(live.textContent);
}).observe(document.getElementById('chat'), {subtree: true, childList: true, characterData: true});
"""


@pytest.fixture
def script() -> Script:
    slow = ScriptStep(contains="SLOW", text=ANSWER, token_delay_ms=10)
    return DEFAULT_SCRIPT.model_copy(
        update={"token_delay_ms": 5.0, "steps": [slow, *DEFAULT_SCRIPT.steps]}
    )


@pytest.fixture
def metering_overrides() -> dict[str, Any]:
    return {"delta_window_ms": WINDOW_MS}


def delta_texts(page: Page) -> list[str]:
    """The text of every delta frame the page receives, on each of its sockets."""
    texts: list[str] = []

    def on_frame(payload: str | bytes) -> None:
        frame = json.loads(payload)
        if frame.get("type") == "delta":
            texts.append(frame["text"])

    def on_socket(socket: WebSocket) -> None:
        socket.on("framereceived", on_frame)

    page.on("websocket", on_socket)
    return texts


async def shown_whole_and_once(page: Page) -> None:
    shown: list[str] = await page.evaluate("window.__shown")
    assert shown, "the answer never streamed"
    assert all(ANSWER.startswith(text) for text in shown), "a word shown twice"


@pytest.mark.timeout(120)
async def test_coalesced_deltas_survive_a_dropped_socket_and_a_reload_whole_and_once(
    gateway: Gateway, browser: Browsing
) -> None:
    page, problems = await criativo_page(gateway, browser)
    received = delta_texts(page)
    await page.evaluate(RECORD_STREAMING)

    # 1. The socket drops in the middle of the answer; the page reconnects by itself.
    await say(page, "SLOW one")
    await streamed_words(page, 5)
    await page.evaluate("window.agentbusConnection.drop()")
    await page.locator('#connection[data-state="reconnecting"]').wait_for(state="attached")
    await page.locator('#connection[data-state="live"]').wait_for(state="attached")
    await responses(page, 1)
    await shown_whole_and_once(page)
    assert await chat_texts(page) == [("user", "SLOW one"), ("agent", ANSWER)]

    # 2. The page is reloaded in the middle of the next answer.
    await say(page, "SLOW two")
    await streamed_words(page, 5)
    await page.reload()
    await page.evaluate(RECORD_STREAMING)
    await responses(page, 2)
    await shown_whole_and_once(page)
    expected = [("user", "SLOW one"), ("agent", ANSWER), ("user", "SLOW two"), ("agent", ANSWER)]
    assert await chat_texts(page) == expected
    assert await page.locator(".msg.streaming").count() == 0, "a bubble never finished"
    await shot(page, "coalesced-after-reload")

    # What the page was sent were gathered deltas, not a word each: over both answers
    # (and what was replayed to it) fewer than one answer has words.
    assert len(received) < len(ANSWER.split()), received
    assert problems == []
