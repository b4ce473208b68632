"""The session page in Chromium: a revised brief after a second readiness is the current
one and the first is superseded, each brief copied and downloaded as markdown; Start
Criativo once Criativo is there; a rule's title as markdown; no page asking for what is
not there."""

from __future__ import annotations

from typing import Any

import pytest
from playwright.async_api import ConsoleMessage, Page, Request, Response

from contracts.events import EventType

from .browsing import (
    Browsing,
    axe_problems,
    criativo_page,
    open_session_page,
    say,
    session_on_page,
    shot,
    watch_errors,
)
from .conftest import Gateway


async def briefs_in_log(gateway: Gateway, session: str) -> list[dict[str, Any]]:
    """The session's product brief events, in the order the log holds them."""
    async with gateway.http() as http:
        r = await http.get(f"/api/projects/{gateway.project}/sessions/{session}/events")
        assert r.status_code == 200, r.text
    kind = EventType.ARTIFACT_PRODUCT_BRIEF.value
    return [e for e in r.json()["events"] if e["type"] == kind]


def as_markdown(brief: dict[str, Any]) -> str:
    """The brief as the document a person takes away: title, summary, details."""
    p = brief["payload"]
    return (
        "\n\n".join(part for part in (f"# {p['title']}", p["summary"], p["details"]) if part) + "\n"
    )


async def answered(page: Page, words: str) -> None:
    """Criativo's answer to a message of `words` is in the chat (it repeats them)."""
    await page.locator("#chat .msg.agent", has_text=words).wait_for(timeout=30_000)


@pytest.mark.timeout(180)
async def test_a_revised_brief_is_current_the_first_superseded_each_copied_and_downloaded(
    gateway: Gateway, browser: Browsing
) -> None:
    context = await browser.new_context()
    await context.grant_permissions(["clipboard-read", "clipboard-write"], origin=gateway.url)
    page = await context.new_page()
    problems = watch_errors(page)
    await open_session_page(gateway, page)
    session = page.url.split("id=")[1]
    cards = page.locator("article.brief")

    await say(page, "A recipes app for the family")
    await answered(page, "recipes app for the family")
    await page.click("#ready")
    await cards.first.wait_for(timeout=30_000)
    # More talk, then ready again: a revised brief, and the first offer to the PO superseded.
    await say(page, "It also plans the meals of the week")
    await answered(page, "plans the meals of the week")
    await page.click("#ready")
    await cards.nth(1).wait_for(timeout=30_000)
    await page.locator(".divider", has_text="(superseded)").wait_for(timeout=30_000)
    await shot(page, "brief-v1-superseded-v2-current")

    logged = await briefs_in_log(gateway, session)
    assert len(logged) == 2
    assert await cards.count() == 2
    first, second = cards.nth(0), cards.nth(1)
    for card, brief, version, state in [
        (first, logged[0], 1, "superseded"),
        (second, logged[1], 2, "current"),
    ]:
        meta = card.locator(".brief-meta")
        shown = await meta.locator("time").text_content()
        assert await meta.text_content() == f"Brief v{version} · {state} · {shown}"
        assert await meta.locator("time").get_attribute("datetime") == brief["created_at"]
        assert await card.get_attribute("data-id") == brief["id"]
        label = f"Brief v{version} ({state}): Product brief"
        assert await card.get_attribute("aria-label") == label
    assert as_markdown(logged[0]) != as_markdown(logged[1])  # the revision says more
    for scheme in ("light", "dark"):  # both states and their buttons readable, named
        await page.emulate_media(color_scheme=scheme)
        found = await axe_problems(page)
        assert found == [], f"{scheme}: {found}"

    # Copy: each card its own brief, as markdown, on the clipboard.
    for card, brief in [(first, logged[0]), (second, logged[1])]:
        await card.locator("button", has_text="Copy").click()
        await card.locator(".brief-said", has_text="Copied").wait_for()
        assert await page.evaluate("navigator.clipboard.readText()") == as_markdown(brief)

    # Download as Markdown: a file named for the session and version, holding the brief.
    for card, brief, version in [(first, logged[0], 1), (second, logged[1], 2)]:
        async with page.expect_download() as started:
            await card.locator("button", has_text="Download as Markdown").click()
        download = await started.value
        assert download.suggested_filename == f"brief-{session}-v{version}.md"
        path = await download.path()
        assert path.read_text(encoding="utf-8") == as_markdown(brief)

    # A reload shows the same: the log decides which brief is current.
    await page.reload()
    await cards.nth(1).wait_for(timeout=30_000)
    assert await cards.nth(0).locator(".brief-state").text_content() == "superseded"
    assert await cards.nth(1).locator(".brief-state").text_content() == "current"
    assert problems == []


@pytest.mark.timeout(90)
async def test_start_criativo_is_offered_until_criativo_started_also_after_a_reload(
    gateway: Gateway, browser: Browsing
) -> None:
    page = await browser.new_page()
    problems = watch_errors(page)
    await session_on_page(gateway, page)
    opened = EventType.SESSION_OPENED.value
    await page.locator(f'#events li[data-type="{opened}"]').wait_for(state="attached")
    start = page.locator("#start-criativo")
    assert await start.is_enabled()

    await page.click("#start-criativo")
    activated = f'#events li[data-type="{EventType.AGENT_ACTIVATED.value}"]'
    await page.locator(activated).wait_for(state="attached")
    assert await start.is_disabled()
    assert await start.text_content() == "Criativo started"

    await page.reload()
    await page.locator(activated).wait_for(state="attached")
    assert await start.is_disabled()
    assert problems == []


@pytest.mark.timeout(90)
async def test_a_rule_title_renders_its_markdown(gateway: Gateway, browser: Browsing) -> None:
    page, problems = await criativo_page(gateway, browser)
    # The scripted model titles the rule with the message's first six words.
    await say(page, "Pay by **cards** only at checkout, never cash on delivery")
    title = page.locator(".rule-card h3").first
    await title.wait_for(timeout=30_000)
    assert await title.locator("strong").text_content() == "cards"
    assert await title.text_content() == "Pay by cards only at checkout,"
    assert await title.locator("p").count() == 0  # a heading, not a paragraph in one
    assert problems == []


@pytest.mark.timeout(120)
async def test_no_page_asks_for_what_is_not_there(gateway: Gateway, browser: Browsing) -> None:
    """Every page loads without a console error, a failed request or an error status,
    its icon included."""
    page = await browser.new_page()
    errors: list[str] = []

    def console(message: ConsoleMessage) -> None:
        if message.type == "error":
            errors.append(f"console: {message.text} at {message.location.get('url')}")

    def failed(request: Request) -> None:
        errors.append(f"failed: {request.url} ({request.failure})")

    def status(response: Response) -> None:
        if response.status >= 400:
            errors.append(f"HTTP {response.status}: {response.url}")

    page.on("console", console)
    page.on("requestfailed", failed)
    page.on("response", status)
    session = await session_on_page(gateway, page)
    await page.locator('#events li[data-type="session.opened"]').wait_for(state="attached")
    pages = {
        "/": "#sessions[data-loaded]",
        f"/session.html?id={session}": '#events li[data-type="session.opened"]',
        "/insights.html": "#groups[data-loaded]",
        "/usage.html": "#usage[data-loaded]",
    }
    icons: dict[str, list[str]] = {}
    for path, ready in pages.items():
        await page.goto(f"{gateway.url}{path}")
        await page.locator(ready).wait_for(state="attached")
        icons[path] = [
            href or ""
            for href in await page.locator('link[rel="icon"]').evaluate_all(
                "(links) => links.map((l) => l.getAttribute('href'))"
            )
        ]
    assert errors == []
    # Without an icon named, a browser asks for /favicon.ico, which is not there: each
    # page names one, and it is there, an image.
    for path, named in icons.items():
        assert named == ["/favicon.svg"], (path, named)
    async with gateway.http() as http:
        r = await http.get("/favicon.svg")
    assert r.status_code == 200
    assert r.headers["content-type"] == "image/svg+xml"
