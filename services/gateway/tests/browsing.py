"""What the browser tests share: Debian's Chromium, a page opened on a new session, the
steps a person takes there, and the turns a test plays itself."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nats.aio.client import Client
from playwright.async_api import Browser, BrowserContext, ConsoleMessage, Page, ViewportSize

from contracts import subjects
from contracts.events import EventType
from contracts.metering import TurnDelta
from contracts.session_events import AppendedReply, AppendEvent
from metering.providers.scripted import DEFAULT_SCRIPT, Script, ScriptStep
from servicekit.client import call

if TYPE_CHECKING:  # conftest imports this module for its browser fixture
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
AXE = Path(__file__).parent / "vendor" / "axe.min.js"
ARTIFACTS = Path(os.environ.get("AGENTBUS_ARTIFACTS", ".artifacts")) / "browser"


# Every Content-Security-Policy violation a page reports, as a console error: the page
# must need nothing its policy refuses, so an inline script or style added later, or a
# sanitizer that lets a fetch through, fails the test that meets it. (Playwright's
# `wait_for_function` evaluates its predicate with `eval`, which the policy refuses: the
# tests wait on locators instead.)
CSP_VIOLATION = "CSP violation:"
REPORT_CSP_VIOLATIONS = f"""
document.addEventListener("securitypolicyviolation", (e) => {{
  const what = {{
    directive: e.effectiveDirective, blocked: e.blockedURI,
    source: (e.sourceFile || "").split("?")[0], line: e.lineNumber, sample: e.sample,
    page: location.pathname,  // not the query: the first page's holds the token
  }};
  console.error("{CSP_VIOLATION} " + JSON.stringify(what));
}}, true);
"""
# DOMPurify works on untrusted HTML in an inert document (DOMParser), and Chromium checks
# that document's inline handlers, styles and <style> elements against the page's policy
# as DOMPurify parses and prunes it, and reports them, though they never apply or run.
# Those reports (their source is DOMPurify) are left out; what DOMPurify lets through
# to the page is checked in the rendered DOM by the hostile-output test.
SANITIZER = "/vendor/purify.es.mjs"


def counts(violation: dict[str, Any]) -> bool:
    """Whether a reported violation is the page's own (not DOMPurify's work on its input)."""
    return not str(violation["source"]).endswith(SANITIZER)


@dataclass
class Browsing:
    """Chromium, whose every page reports its CSP violations into `violations` (the
    `browser` fixture fails a test that leaves any)."""

    browser: Browser
    violations: list[str] = field(default_factory=list)

    def _console(self, message: ConsoleMessage) -> None:
        if message.type == "error" and message.text.startswith(CSP_VIOLATION):
            violation = json.loads(message.text.removeprefix(CSP_VIOLATION))
            if counts(violation):
                self.violations.append(message.text)

    async def new_context(self, viewport: ViewportSize | None = None) -> BrowserContext:
        context = await self.browser.new_context(viewport=viewport)
        await context.add_init_script(REPORT_CSP_VIOLATIONS)
        context.on("console", self._console)
        return context

    async def new_page(self, viewport: ViewportSize | None = None) -> Page:
        """A page in a context of its own, as `Browser.new_page` makes."""
        context = await self.new_context(viewport)
        return await context.new_page()


def slow_script(answer: str) -> Script:
    """The offline script, fast, but a message containing SLOW is answered with `answer`,
    a word every 25 ms: time enough to act in the middle of the answer."""
    slow = ScriptStep(contains="SLOW", text=answer, token_delay_ms=25)
    return DEFAULT_SCRIPT.model_copy(
        update={"token_delay_ms": 5.0, "steps": [slow, *DEFAULT_SCRIPT.steps]}
    )


async def shot(page: Page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    await page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def watch_errors(page: Page) -> list[str]:
    """The page's uncaught errors, as they happen."""
    problems: list[str] = []
    page.on("pageerror", lambda exc: problems.append(str(exc)))
    return problems


async def session_on_page(gateway: Gateway, page: Page) -> str:
    """A session without any agent started, open in the page; its id."""
    await page.goto(f"{gateway.url}/?token={gateway.token()}")
    await page.click("#new-session")
    await page.wait_for_url("**/session.html?id=*")
    await page.locator('#connection[data-state="live"]').wait_for(state="attached")
    return page.url.split("id=")[1]


async def open_session_page(gateway: Gateway, page: Page) -> None:
    """A new session open in the page, with Criativo started."""
    await session_on_page(gateway, page)
    await page.click("#start-criativo")
    await page.locator(f'#events li[data-type="{EventType.AGENT_ACTIVATED.value}"]').wait_for(
        state="attached"
    )


async def criativo_page(gateway: Gateway, browser: Browsing) -> tuple[Page, list[str]]:
    """A new page on a new session with Criativo started, and the page's errors."""
    page = await browser.new_page()
    problems = watch_errors(page)
    await open_session_page(gateway, page)
    return page, problems


async def say(page: Page, text: str) -> None:
    await page.fill("#text", text)
    await page.press("#text", "Enter")


async def streamed_words(page: Page, at_least: int) -> None:
    words = re.compile(rf"^\s*(?:\S+\s+){{{at_least - 1}}}\S")
    await page.locator(".msg.agent.streaming", has_text=words).wait_for()


async def responses(page: Page, n: int) -> None:
    response = EventType.AGENT_RESPONSE.value
    await (
        page.locator(f'#events li[data-type="{response}"]')
        .nth(n - 1)
        .wait_for(state="attached", timeout=30_000)
    )


async def chat_texts(page: Page) -> list[tuple[str, str]]:
    """(kind, text) of every bubble of the chat, top to bottom, as a reader sees it (an
    answer is rendered markdown: its paragraphs read as the blank lines that made them)."""
    got: list[list[str]] = await page.evaluate(
        """[...document.querySelectorAll('#chat .msg')].map(
             (n) => [n.classList.contains('user') ? 'user' : 'agent', n.innerText])"""
    )
    return [(kind, text) for kind, text in got]


# Every text the streaming bubble showed, so a repeated word shown even briefly is caught.
RECORD_STREAMING = """
window.__shown = window.__shown || [];
new MutationObserver(() => {
  for (const live of document.querySelectorAll('.msg.agent.streaming'))
    window.__shown.push(live.textContent);
}).observe(document.getElementById('chat'), {subtree: true, childList: true, characterData: true});
"""


async def answered_across_a_drop_and_a_reload(
    page: Page, answer: str, shots: tuple[str, str]
) -> None:
    """ "SLOW one" answered with the socket dropped in the middle, then "SLOW two" with the
    page reloaded in the middle (a script answers both with `answer`, slowly): each shown
    whole, no word shown twice, no bubble left streaming. `shots`: the screenshots' names
    after each."""
    await page.evaluate(RECORD_STREAMING)

    # 1. The socket drops in the middle of the answer; the page reconnects by itself.
    await say(page, "SLOW one")
    await streamed_words(page, 5)
    await page.evaluate("window.agentbusConnection.drop()")
    await page.locator('#connection[data-state="reconnecting"]').wait_for(state="attached")
    await page.locator('#connection[data-state="live"]').wait_for(state="attached")
    await responses(page, 1)
    assert await _no_word_shown_twice(page, answer), "the answer never streamed"
    assert await chat_texts(page) == [("user", "SLOW one"), ("agent", answer)]
    await shot(page, shots[0])

    # 2. The page is reloaded in the middle of the next answer.
    await say(page, "SLOW two")
    await streamed_words(page, 5)
    await page.reload()
    await page.evaluate(RECORD_STREAMING)
    await responses(page, 2)
    await _no_word_shown_twice(page, answer)  # the answer may have ended during the reload
    expected = [("user", "SLOW one"), ("agent", answer), ("user", "SLOW two"), ("agent", answer)]
    assert await chat_texts(page) == expected
    assert await page.locator(".msg.streaming").count() == 0, "a bubble never finished"
    await shot(page, shots[1])


async def _no_word_shown_twice(page: Page, answer: str) -> list[str]:
    """Every text the streaming bubble showed (each a beginning of `answer`)."""
    shown: list[str] = await page.evaluate("window.__shown")
    assert all(answer.startswith(text) for text in shown), "a word shown twice"
    return shown


async def event_id(page: Page, event_type: str) -> str:
    item = page.locator(f'#events li[data-type="{event_type}"]').first
    await item.wait_for(state="attached")
    return ((await item.get_attribute("id")) or "").removeprefix("event-")


# --- a turn played by the test itself: its deltas on the bus, its outcome in the log ----


async def play_deltas(
    nc: Client, gateway: Gateway, session: str, cause: str, turn: str, words: list[str]
) -> None:
    js = nc.jetstream()
    for seq, word in enumerate(words, start=1):
        delta = TurnDelta(turn_id=turn, seq=seq, text=word, emitted_at=0.0, causation_id=cause)
        await js.publish(
            subjects.delta_subject(gateway.project, session), delta.model_dump_json().encode()
        )


async def append(
    nc: Client, session: str, kind: str, payload: dict[str, object], cause: str
) -> None:
    await call(
        nc,
        subjects.EVENTS_APPEND,
        AppendEvent(
            session_id=session,
            type=kind,
            actor="agent:criativo",
            payload=payload,
            causation_id=cause,
        ),
        AppendedReply,
    )


async def axe_problems(page: Page) -> list[str]:
    """axe-core's serious and critical violations on the page as it is now."""
    # evaluated, not added as a <script>: the page's policy refuses inline script
    await page.evaluate(AXE.read_text(encoding="utf-8"))
    found: list[dict[str, Any]] = await page.evaluate(
        """async () => {
          const r = await axe.run(document, { resultTypes: ["violations"] });
          return r.violations
            .filter((v) => v.impact === "serious" || v.impact === "critical")
            .map((v) => ({
              id: v.id, impact: v.impact, nodes: v.nodes.map((n) => n.target.join(" ")),
            }));
        }"""
    )
    return [f"{v['impact']} {v['id']}: {v['nodes']}" for v in found]
