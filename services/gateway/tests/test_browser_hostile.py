"""Hostile model output in a real Chromium: an answer, a business rule and a brief full of
markup that would make the browser fetch from elsewhere, or draw over the page. Nothing
leaves the gateway's origin (Playwright's request log, and an "attacker" server of the
test's own that counts its hits), nothing covers the page, no CSP violation is even
provoked (the sanitizer removed it all before the policy had to refuse it), and links
say where they go."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import pytest
import pytest_asyncio
from nats.aio.client import Client
from playwright.async_api import Page, Request

from contracts.events import EventType
from metering.providers.scripted import DEFAULT_SCRIPT, Script, ScriptStep

from .browsing import Browsing, append, event_id, open_session_page, responses, say, shot
from .conftest import Gateway


@dataclass
class Attacker:
    """A local HTTP server on a free port: where hostile markup points. It answers every
    request (an empty 200) and keeps the path of each."""

    origin: str
    hits: list[str] = field(default_factory=list)


@pytest_asyncio.fixture(loop_scope="session")
async def attacker() -> AsyncIterator[Attacker]:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await reader.readuntil(b"\r\n\r\n")
            found.hits.append(request.split(b" ", 2)[1].decode())
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    found = Attacker(f"http://127.0.0.1:{port}")
    async with server:
        yield found


COVER = (
    "position:fixed;inset:0;width:100vw;height:100vh;max-width:none;max-height:none;"
    "margin:0;z-index:9999;background:white"
)


def hostile(at: str) -> str:
    """Markdown whose HTML, rendered as written, fetches from `at` or covers the page."""
    return f"""**Here** is the plan, with a [link]({at}/link-target).

<p style="background:url({at}/p-style-background)">a styled paragraph</p>

<video poster="{at}/video-poster" src="{at}/video-src" autoplay muted></video>

<audio src="{at}/audio-src" autoplay></audio>

<img src="{at}/img-src"> <img srcset="{at}/img-srcset 1x">

<picture><source srcset="{at}/picture-source"><img src="{at}/picture-img"></picture>

<svg><image href="{at}/svg-image"></image></svg>

<link rel="stylesheet" href="{at}/link-stylesheet"> <link rel="prefetch" href="{at}/link-prefetch">

<iframe src="{at}/iframe"></iframe> <object data="{at}/object"></object> <embed src="{at}/embed">

<input type="image" src="{at}/input-image">

<table background="{at}/table-background"><tr>
<td background="{at}/td-background">a cell</td></tr></table>

<dialog open style="{COVER}">a box over the page</dialog>

<div style="{COVER}">a cover</div>

<form action="{at}/form"><button formaction="{at}/formaction">go</button></form>

<base href="{at}/base/">

<style>@import url("{at}/style-import"); body {{ background: url("{at}/style-body"); }}</style>

![an image]({at}/markdown-image)

See [https://bank.example/login]({at}/phish), [the docs]({at}/docs) or https://plain.example/x.
"""


@pytest.fixture
def script(attacker: Attacker) -> Script:
    """Criativo's answer to a message containing HOSTILE, and the brief it writes, are
    the hostile markup."""
    brief = {"title": "A brief", "summary": hostile(attacker.origin), "details": "**done**"}
    steps = [
        ScriptStep(contains="product_brief", text=json.dumps(brief)),
        ScriptStep(contains="HOSTILE", text=hostile(attacker.origin)),
        *DEFAULT_SCRIPT.steps,
    ]
    return Script(steps=steps, token_delay_ms=1.0)


# The page laid out (two frames) after everything rendered: whatever the rendered markup
# fetches has been asked for by then.
FRAMES = "new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r)))"
MODEL_OUTPUT = "#chat .msg.agent .text, .rule-card .statement, .brief .summary, .brief .details"


async def fetched_elsewhere(page: Page, gateway: Gateway, requested: list[str]) -> list[str]:
    """Every request the page made outside the gateway's origin, once what is rendered is
    laid out (two frames) and a request made after that is in the log: the browser reports
    requests in the order they are made."""
    await page.evaluate(FRAMES)
    await page.evaluate("fetch('/healthz').then(() => true)")
    assert f"{gateway.url}/healthz" in requested
    return [url for url in requested if not url.startswith((f"{gateway.url}/", "data:"))]


async def covered(page: Page) -> list[str]:
    """The controls a click at their centre does not reach: something covers them."""
    found: list[str] = await page.evaluate(
        """() => ['#text', '#ready', '#close', 'header nav a'].map((sel) => {
             const target = document.querySelector(sel);
             target.scrollIntoView({ block: "center" });
             const box = target.getBoundingClientRect();
             const hit = document.elementFromPoint(box.x + box.width / 2, box.y + box.height / 2);
             return target.contains(hit) ? null : `${sel} is under ${hit?.outerHTML.slice(0, 80)}`;
           }).filter(Boolean)"""
    )
    return found


@pytest.mark.timeout(120)
async def test_hostile_answers_rules_and_briefs_fetch_nothing_and_cover_nothing(
    gateway: Gateway, browser: Browsing, nc: Client, attacker: Attacker
) -> None:
    page = await browser.new_page()
    requested: list[str] = []

    def sent(request: Request) -> None:
        requested.append(request.url)

    page.context.on("request", sent)  # a popup's requests too
    await open_session_page(gateway, page)
    session = page.url.split("id=")[1]

    # the answer: Criativo's turn, streamed by the model
    await say(page, "HOSTILE: tell me the plan")
    await responses(page, 1)
    said = await event_id(page, EventType.CHAT_MESSAGE.value)
    # a business rule carrying it, resting on that message
    rule: dict[str, object] = {
        "title": "A rule",
        "statement": hostile(attacker.origin),
        "origin": [said],
    }
    await append(nc, session, EventType.ARTIFACT_BUSINESS_RULE.value, rule, said)
    await page.locator(".rule-card .statement").wait_for()
    assert await fetched_elsewhere(page, gateway, requested) == []
    assert await covered(page) == []
    # the brief, written by the model's consolidation turn
    await page.click("#ready")
    await page.locator(".brief .details").wait_for(timeout=30_000)
    assert await fetched_elsewhere(page, gateway, requested) == []
    assert await covered(page) == []
    await shot(page, "hostile-output")
    assert attacker.hits == []
    assert browser.violations == []  # the sanitizer left nothing for the policy to refuse

    rendered = page.locator(MODEL_OUTPUT)
    assert await rendered.count() == 4
    assert await page.locator("#chat .msg.agent strong").first.text_content() == "Here"
    gone = "img, video, audio, picture, source, svg, iframe, object, embed, input, form, "
    gone += "button, dialog, link, style, base, [background], [style], [id], [srcset], [src], "
    gone += "[class]:not(.link-host)"
    for n in range(4):
        found = await rendered.nth(n).evaluate(f"(n) => n.querySelectorAll('{gone}').length")
        assert found == 0, await rendered.nth(n).inner_html()
    placed = await page.evaluate(
        f"""() => [...document.querySelectorAll('{MODEL_OUTPUT}')].flatMap(
             (root) => [...root.querySelectorAll('*')]).map((n) => getComputedStyle(n).position)
             .filter((p) => p !== 'static')"""
    )
    assert placed == [], placed

    # Links say where they go; a text that names another address shows the real one.
    answer = page.locator("#chat .msg.agent .text").first
    host = urlsplit(attacker.origin).netloc
    phish = answer.locator(f'a[href="{attacker.origin}/phish"]')
    assert await phish.text_content() == f"{attacker.origin}/phish"
    docs = answer.locator(f'a[href="{attacker.origin}/docs"]')
    assert await docs.text_content() == "the docs"
    assert await docs.get_attribute("title") == f"{attacker.origin}/docs"
    assert await docs.evaluate("(a) => a.nextSibling.textContent") == f" ({host})"
    plain = answer.locator('a[href="https://plain.example/x"]')
    assert await plain.text_content() == "https://plain.example/x"  # says where it goes
    assert await plain.evaluate("(a) => a.nextSibling.textContent") == "."
