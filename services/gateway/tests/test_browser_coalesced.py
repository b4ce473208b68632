"""Deltas that each carry several words (metering gathers a stream's text over a window),
in a real Chromium: after a dropped socket and a reload in the middle of an answer, the
page shows the answer whole, no word twice, from the deltas replayed and received live."""

from __future__ import annotations

import json
from typing import Any

import pytest
from playwright.async_api import Page, WebSocket

from metering.providers.scripted import DEFAULT_SCRIPT, Script, ScriptStep

from .browsing import Browsing, answered_across_a_drop_and_a_reload, criativo_page
from .conftest import Gateway

# 300 words 10 ms apart (about 3 s), gathered over 200 ms windows: deltas of many words,
# and time enough to drop the socket or reload the page between two of them.
ANSWER = " ".join(f"palavra{i}" for i in range(300))
WINDOW_MS = 200.0


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


@pytest.mark.timeout(120)
async def test_coalesced_deltas_survive_a_dropped_socket_and_a_reload_whole_and_once(
    gateway: Gateway, browser: Browsing
) -> None:
    page, problems = await criativo_page(gateway, browser)
    received = delta_texts(page)
    await answered_across_a_drop_and_a_reload(
        page, ANSWER, ("coalesced-after-reconnect", "coalesced-after-reload")
    )

    # What the page was sent were gathered deltas, not a word each: over both answers
    # (and what was replayed to it) fewer than one answer has words.
    assert len(received) < len(ANSWER.split()), received
    assert problems == []
