"""The whole story in a real headless Chromium (Debian's, driven by Playwright), on the
scripted model: chat streaming, a rule card, readiness, the brief and the handoff
divider, closing, Insights, and an evidence chip landing on the highlighted event."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from playwright.async_api import Browser, Page, async_playwright

from contracts.events import EventType
from servicekit.testing import wait_for

from .conftest import Gateway

CHROMIUM = "/usr/bin/chromium"  # installed by .ci/run (apt-get); never `playwright install`
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
INSTALLED = Path(CHROMIUM).exists()
ARTIFACTS = Path(os.environ.get("AGENTBUS_ARTIFACTS", ".artifacts")) / "browser"

# Every length the streaming bubble had: the reply must arrive in several steps.
WATCH_STREAMING = """
window.__lengths = [];
new MutationObserver(() => {
  const live = document.querySelector('.msg.agent.streaming');
  if (live) window.__lengths.push(live.textContent.length);
}).observe(document.getElementById('chat'), {subtree: true, childList: true, characterData: true});
"""


@pytest_asyncio.fixture(loop_scope="session")
async def browser() -> AsyncIterator[Browser]:
    assert INSTALLED, "Debian's chromium is missing: .ci/run installs it"
    async with async_playwright() as pw:
        chromium = await pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        yield chromium
        await chromium.close()


async def shot(page: Page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    await page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


@pytest.mark.timeout(180)
async def test_the_whole_story_in_a_browser(gateway: Gateway, browser: Browser) -> None:
    page = await browser.new_page()
    problems: list[str] = []
    page.on("pageerror", lambda exc: problems.append(str(exc)))
    await page.goto(f"{gateway.url}/?token={gateway.token()}")
    await page.locator("#offline").wait_for()
    await page.click("#new-session")
    await page.wait_for_url("**/session.html?id=*")
    await page.locator('#events li[data-type="session.opened"]').wait_for(state="attached")

    await page.click("#start-criativo")
    await page.locator('#events li[data-type="agent.activated"]').wait_for(state="attached")
    await page.evaluate(WATCH_STREAMING)
    await page.fill("#text", "Quero um app de receitas para a família, com lista de compras")
    await page.click("#say button")
    await page.locator('#events li[data-type="agent.response"]').wait_for(
        state="attached", timeout=30_000
    )
    lengths = await page.evaluate("window.__lengths")
    assert len(set(lengths)) > 2, f"the reply arrived in one piece: {lengths}"
    await page.locator(".rule-card").first.wait_for(timeout=30_000)
    await shot(page, "1-chat-and-rule")

    await page.click("#ready")
    await page.locator(".brief").wait_for(timeout=30_000)
    await page.locator(".divider").wait_for(timeout=30_000)
    assert await page.locator(".divider button").count() == 2  # the person can act on it
    await shot(page, "2-brief-and-handoff")

    await page.click("#close")
    closed = EventType.SESSION_CLOSED.value
    await page.locator(f'#events li[data-type="{closed}"]').wait_for(state="attached")
    # a closed session's offer can no longer be accepted (RN-581): no buttons left
    await page.locator(".divider button").first.wait_for(state="detached", timeout=10_000)

    async def analysed() -> bool:
        async with gateway.http() as http:
            r = await http.get(f"/api/projects/{gateway.project}/insights")
            return bool(r.json()["groups"])

    await wait_for(analysed, timeout=60, what="the psychologist's hypotheses")
    await page.goto(f"{gateway.url}/insights.html")
    chip = page.locator(".evidence").first
    await chip.wait_for(timeout=60_000)
    await shot(page, "3-insights")
    target = (await chip.get_attribute("href")) or ""
    event_id = target.split("highlightEvent=")[1]
    await chip.click()
    highlighted = page.locator(f"#event-{event_id}.highlight")
    await highlighted.wait_for()
    assert await page.locator("#log").get_attribute("open") is not None
    assert await highlighted.is_visible()
    await shot(page, "4-highlighted-event")
    assert problems == []
