"""The web client as people use it (issue 16), in Debian's headless Chromium: markdown that
renders safely, the writing indicator, Enter / Shift+Enter, a reader who scrolled up left
alone, the token out of the address bar, the session list, rule cards linked to their
message, Insights filters, the usage chart, dark mode, a phone's width, a handoff decided once
(a double click, another tab first), and axe-core (vendored, injected into each page) finding
no serious or critical violation on any page."""

from __future__ import annotations

import json

import pytest
from nats.aio.client import Client
from playwright.async_api import Locator, Page, Request, WebSocketRoute

from contracts import subjects
from contracts.events import EventType
from contracts.handoff import AcceptReply, Handoff, HandoffDecision, OfferHandoff, OfferReply
from contracts.session_events import AppendedReply, AppendEvent
from metering.providers.scripted import Script
from servicekit.client import call
from testkit.probes import wait_for

from .browsing import (
    Browsing,
    append,
    axe_problems,
    criativo_page,
    event_id,
    responses,
    say,
    session_on_page,
    shot,
    slow_script,
    watch_errors,
)
from .conftest import Gateway

SLOW_ANSWER = " ".join(f"word{i}" for i in range(40))

# What a hostile message or answer would carry: none of it may run.
PAYLOAD = (
    '<img src="x" onerror="window.__pwned = 1"> <script>window.__pwned = 2</script> '
    '<a href="javascript:window.__pwned = 3">click</a> <svg onload="window.__pwned = 4"></svg>'
)
MARKDOWN_ANSWER = (
    "Here is **the plan**:\n\n"
    "- first item\n- second item\n\n"
    "```python\nprint('hello')\n```\n\n"
    f"And the odd part: {PAYLOAD} [a bad link](javascript:window.__pwned=5)"
)


@pytest.fixture
def script() -> Script:
    return slow_script(SLOW_ANSWER)


@pytest.mark.timeout(90)
async def test_markdown_renders_and_a_hostile_message_and_answer_stay_inert(
    gateway: Gateway, browser: Browsing, nc: Client
) -> None:
    page = await browser.new_page()
    problems = watch_errors(page)
    session = await session_on_page(gateway, page)
    await say(page, PAYLOAD)  # the plain chat answers it, echoing it back
    await responses(page, 1)
    said = await event_id(page, EventType.CHAT_MESSAGE.value)
    response: dict[str, object] = {"agent": "criativo", "text": MARKDOWN_ANSWER}
    await append(nc, session, EventType.AGENT_RESPONSE.value, response, said)
    await responses(page, 2)
    await page.locator("#chat pre code").wait_for()

    # The person's words are shown as they were typed: text, never markup.
    user = page.locator("#chat .msg.user").first
    assert await user.text_content() == PAYLOAD
    assert await user.locator("img, script, a, svg").count() == 0
    # The answer is markdown: bold, a list, a code block.
    answer = page.locator("#chat .msg.agent").nth(1)
    assert await answer.locator("strong").first.text_content() == "the plan"
    assert await answer.locator("ul li").count() == 2
    assert await answer.locator("pre code").text_content() == "print('hello')\n"
    # ...and nothing in either answer can run.
    inert = await page.evaluate(
        """() => ({
          pwned: window.__pwned ?? null,
          scripts: document.querySelectorAll('#chat script').length,
          handlers: [...document.querySelectorAll('#chat *')].filter(
            (n) => [...n.attributes].some((a) => a.name.startsWith('on'))).length,
          jsLinks: [...document.querySelectorAll('#chat a')].filter(
            (a) => /^\\s*javascript:/i.test(a.getAttribute('href') || '')).length,
        })"""
    )
    assert inert == {"pwned": None, "scripts": 0, "handlers": 0, "jsLinks": 0}, inert
    # nor fetch anything: no images, no SVG in what a model or a person wrote
    assert await page.locator("#chat img, #chat svg").count() == 0
    await shot(page, "11-markdown-and-inert-payload")
    assert problems == []


@pytest.mark.timeout(90)
async def test_the_writing_indicator_enter_and_shift_enter(
    gateway: Gateway, browser: Browsing
) -> None:
    page, problems = await criativo_page(gateway, browser)
    writing = page.locator("#writing")
    assert await writing.is_hidden()
    await page.fill("#text", "first line")
    await page.press("#text", "Shift+Enter")  # a new line, not a send
    await page.type("#text", "SLOW second line")
    assert await page.input_value("#text") == "first line\nSLOW second line"
    assert await page.locator("#chat .msg.user").count() == 0
    await page.press("#text", "Enter")
    await writing.wait_for(state="visible")
    assert await writing.text_content() == "Criativo is writing…"
    assert await writing.get_attribute("role") == "status"  # read out by screen readers
    await shot(page, "12-criativo-is-writing")
    await responses(page, 1)
    await writing.wait_for(state="hidden")
    assert await page.input_value("#text") == ""
    user = page.locator("#chat .msg.user")
    assert await user.text_content() == "first line\nSLOW second line"
    # the message is the session's title, and it carries the time it was said
    assert await page.locator("#title").text_content() == "first line\nSLOW second line"
    assert await user.get_attribute("data-time")
    assert await page.locator("#chat").get_attribute("aria-live") == "polite"

    # The keyboard: from the message box, Tab reaches Send; from the top, the skip link first.
    await page.focus("#text")
    await page.keyboard.press("Tab")
    assert await page.evaluate("document.activeElement.textContent") == "Send"
    await page.reload()
    await page.locator("header .skip").wait_for(state="attached")
    await page.keyboard.press("Tab")
    assert await page.evaluate("document.activeElement.className") == "skip"
    await page.keyboard.press("Enter")
    # the jump to the fragment lands after the key press returns (a CI run read it first)
    await page.wait_for_url(lambda url: url.endswith("#main"))
    assert problems == []


async def said_elsewhere(nc: Client, session: str, text: str) -> None:
    """A message of the person's that the page did not type (another tab, say)."""
    await call(
        nc,
        subjects.EVENTS_APPEND,
        AppendEvent(
            session_id=session,
            type=EventType.CHAT_MESSAGE.value,
            actor="user:dev",
            payload={"text": text},
        ),
        AppendedReply,
    )


AT_END = (
    "(c => c.scrollHeight - c.scrollTop - c.clientHeight < 48)(document.getElementById('chat'))"
)
# Two frames: the scroll event of a scroll just made has been handled.
FRAMES = "new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r)))"


@pytest.mark.timeout(90)
async def test_a_reader_who_scrolled_up_is_left_there_and_one_at_the_end_follows(
    gateway: Gateway, browser: Browsing, nc: Client
) -> None:
    page = await browser.new_page(viewport={"width": 400, "height": 500})
    session = await session_on_page(gateway, page)
    for n in range(3):
        await say(page, f"SLOW {n}")  # the plain chat answers each (no Criativo here)
        await responses(page, n + 1)
    overflowing = "(c => c.scrollHeight > c.clientHeight)(document.getElementById('chat'))"
    assert await page.evaluate(overflowing)
    assert await page.evaluate(AT_END), "the chat did not follow the answers"

    # The reader scrolls up to read; a message and its answer arrive below.
    await page.evaluate("document.getElementById('chat').scrollTop = 0")
    await page.evaluate(FRAMES)
    await said_elsewhere(nc, session, "SLOW from another tab")
    await page.locator(".msg.agent.streaming", has_text="word10").wait_for()
    assert await page.evaluate("document.getElementById('chat').scrollTop") == 0
    await responses(page, 4)
    assert await page.evaluate("document.getElementById('chat').scrollTop") == 0

    # Back at the end, the chat follows again.
    await page.evaluate("(c => { c.scrollTop = c.scrollHeight })(document.getElementById('chat'))")
    await page.evaluate(FRAMES)
    await said_elsewhere(nc, session, "SLOW once more")
    await responses(page, 5)
    await page.evaluate(FRAMES)
    assert await page.evaluate(AT_END), "the chat stopped following at the end"


@pytest.mark.timeout(60)
async def test_a_lost_socket_is_tried_again_in_the_upper_half_of_a_doubling_ceiling(
    gateway: Gateway, browser: Browsing
) -> None:
    """The page's reconnect waits in the upper half of a ceiling that doubles from half a
    second to ten: the people of a gateway that died come back spread out, the more so
    the longer it stays down. `bench/chaos.py` reads these numbers from the client and
    follows the same schedule (tests/test_chaos_person.py)."""
    page = await browser.new_page()
    await page.goto(f"{gateway.url}/?token={gateway.token()}")
    delay = "async ([n, r]) => (await import('/connection.js')).retryDelay(n, () => r)"
    ceilings = [await page.evaluate(delay, [n, 1.0]) for n in range(7)]
    assert ceilings == [500, 1000, 2000, 4000, 8000, 10000, 10000]
    assert [await page.evaluate(delay, [n, 0.0]) for n in range(6)] == [
        250,
        500,
        1000,
        2000,
        4000,
        5000,
    ]


async def test_a_refused_join_is_tried_again_on_the_back_off_not_after_the_join_timeout(
    gateway: Gateway, browser: Browsing
) -> None:
    """A join the gateway answers with an error (the log restarting: `unavailable`) left
    the socket open, not live, until the page's 10 s join timeout: a person waited that
    long once the log was back. It is a failed try now: the socket is closed at once and
    the next one opened on the back-off. The page's clock is frozen, so no timer can
    close the refused socket: only the refusal does."""
    page = await browser.new_page()
    await page.clock.install()  # before the pages load: their timers are the clock's
    await session_on_page(gateway, page)
    sockets: list[WebSocketRoute] = []
    closed: list[int] = []

    def route(ws: WebSocketRoute) -> None:
        index = len(sockets)
        sockets.append(ws)
        if index > 0:  # the gateway itself from the second socket on
            server = ws.connect_to_server()
            ws.on_message(server.send)
            server.on_message(ws.send)
            return

        def refuse(message: str | bytes) -> None:
            frame = json.loads(message)
            if frame["type"] == "join":
                error = {"type": "error", "code": "unavailable", "message": "restarting"}
                ws.send(json.dumps({**error, "ref": frame.get("ref")}))

        async def on_close(code: int | None, reason: str | None) -> None:
            closed.append(index)
            await ws.close(code=code, reason=reason)  # the close handshake, handled here

        ws.on_message(refuse)
        ws.on_close(on_close)

    await page.route_web_socket("**/ws?*", route)
    await page.clock.pause_at(await page.evaluate("Date.now() + 1000"))  # from now on, frozen
    await page.evaluate("window.agentbusConnection.drop()")
    await page.clock.run_for(1_000)  # the first try after a lost socket: within 0.5 s
    await wait_for(lambda: closed, timeout=30, what="the page to close the refused socket")
    assert len(sockets) == 1
    await page.clock.run_for(2_000)  # the next try: within 1 s
    await page.locator('#connection[data-state="live"]').wait_for(state="attached")
    assert len(sockets) == 2


async def test_the_token_moves_from_the_address_into_session_storage(
    gateway: Gateway, browser: Browsing
) -> None:
    page = await browser.new_page()
    token = gateway.token()
    await page.goto(f"{gateway.url}/?token={token}")
    await page.locator("#offline").wait_for()
    assert "token" not in page.url
    assert await page.evaluate("sessionStorage.getItem('agentbus.token')") == token
    await page.goto(f"{gateway.url}/usage.html")  # no token in the link: still signed in
    await page.locator("#usage[data-loaded]").wait_for()
    assert await page.locator("header .error").count() == 0


@pytest.mark.timeout(240)
async def test_session_list_rules_insights_usage_in_light_dark_and_on_a_phone(
    gateway: Gateway, browser: Browsing
) -> None:
    """One whole session, then every page checked by axe, light and dark, desk and phone."""
    page, problems = await criativo_page(gateway, browser)
    first = "A recipes app for the family, with a shopping list"
    await say(page, first)
    await responses(page, 1)
    session = page.url.split("id=")[1]

    # The rule card is linked to the message it came from.
    link = page.locator(".rule-card a.from").first
    await link.wait_for(timeout=30_000)
    said = await event_id(page, EventType.CHAT_MESSAGE.value)
    assert await link.get_attribute("href") == f"#msg-{said}"
    await link.click()
    await page.locator(f"#msg-{said}.flash").wait_for()
    assert problems == []
    session_problems = await axe_problems(page)
    assert session_problems == [], session_problems
    await page.click("#ready")
    brief = page.locator("article.brief")
    await brief.wait_for(timeout=30_000)
    assert await brief.locator("h3").text_content() == "Product brief"
    assert await brief.locator(".details").count() == 1  # the brief as a document
    await page.click("#close")
    await page.locator(f'#events li[data-type="{EventType.SESSION_CLOSED.value}"]').wait_for(
        state="attached"
    )

    # The session list: its title (the first message), its status, its last activity,
    # all from the list's one request, none per session.
    api_calls: list[str] = []

    def called(request: Request) -> None:
        if "/api/" in request.url:
            api_calls.append(request.url)

    page.on("request", called)
    await page.goto(f"{gateway.url}/")
    item = page.locator(f'#sessions li[data-id="{session}"]')
    await item.wait_for()
    await page.locator("#sessions[data-loaded]").wait_for(state="attached")
    project_api = f"{gateway.url}/api/projects/{gateway.project}"
    page.remove_listener("request", called)
    assert api_calls == [project_api, f"{project_api}/sessions"]
    assert await item.locator(".title").text_content() == first
    assert await item.locator(".status").text_content() == "closed"
    assert "last activity" in (await item.text_content() or "")
    assert await item.locator("time").count() == 2

    async def analysed() -> bool:
        async with gateway.http() as http:
            r = await http.get(f"/api/projects/{gateway.project}/insights")
            return bool(r.json()["groups"])

    await wait_for(analysed, timeout=60, what="the psychologist's hypotheses")

    # Insights: filters by status, tier and session; accept/dismiss inline.
    await page.goto(f"{gateway.url}/insights.html")
    await page.locator("#groups[data-loaded]").wait_for(state="attached")
    cards = page.locator(".hypothesis")
    total = await cards.count()
    assert total >= 1
    await page.select_option("#f-status", "accepted")
    assert await cards.count() == 0
    await page.select_option("#f-status", "proposed")
    assert await cards.count() == total
    await page.select_option("#f-tier", "pesada")  # a short session: a light analysis
    assert await cards.count() == 0
    await page.select_option("#f-tier", "leve")
    assert await cards.count() == total
    await page.select_option("#f-session", session)
    assert await cards.count() == total
    assert first[:50] in (await page.locator("#f-session option:checked").text_content() or "")
    await page.select_option("#f-status", "")
    await cards.first.locator("button", has_text="Dismiss").click()
    await page.locator('.hypothesis[data-status="dismissed"]').first.wait_for()
    await page.select_option("#f-status", "dismissed")
    assert await cards.count() == 1

    # Usage: cost per day as a chart, cache columns per agent and model.
    await page.goto(f"{gateway.url}/usage.html")
    await page.locator("#usage[data-loaded]").wait_for(state="attached")
    assert await page.locator("#chart svg rect.bar").count() >= 1
    headers = await page.locator("#usage th").all_text_contents()
    assert {"cache read", "cache write", "cache share"} <= set(headers), headers
    assert await page.locator("#usage tbody tr").count() >= 2  # criativo and the psychologist
    # Limits: the project's and the person's in force, with what today's calls used.
    day = page.locator('#limits tr[data-limit="project/micros/day"]')
    assert (await day.locator("td").first.text_content()) == f"project {gateway.project}"
    assert float(await day.locator("meter").get_attribute("value") or 0) > 0
    assert await page.locator('#limits tr[data-limit^="person/"]').count() == 4
    mine = page.locator('#limits tr[data-limit="person/micros/month"] td')
    assert await mine.first.text_content() == "you (ana)"

    pages = {
        "sessions": "/",
        "session": f"/session.html?id={session}",
        "insights": "/insights.html",
        "usage": "/usage.html",
    }
    ready = {
        "sessions": "#sessions[data-loaded]",
        "session": f'#events li[data-type="{EventType.SESSION_CLOSED.value}"]',
        "insights": "#groups[data-loaded]",
        "usage": "#usage[data-loaded]",
    }
    for scheme in ("light", "dark"):
        await page.emulate_media(color_scheme=scheme)
        for name, path in pages.items():
            await page.goto(f"{gateway.url}{path}")
            await page.locator(ready[name]).first.wait_for(state="attached")
            background = await page.evaluate("getComputedStyle(document.body).backgroundColor")
            assert (background == "rgb(21, 22, 26)") == (scheme == "dark"), background
            found = await axe_problems(page)
            assert found == [], f"{name} ({scheme}): {found}"
            await shot(page, f"a11y-{name}-{scheme}")

    # A phone's width: one column, nothing wider than the screen.
    phone = await browser.new_page(viewport={"width": 390, "height": 844})
    await phone.goto(f"{gateway.url}/?token={gateway.token()}")
    for name, path in pages.items():
        await phone.goto(f"{gateway.url}{path}")
        await phone.locator(ready[name]).first.wait_for(state="attached")
        wide = await phone.evaluate("document.documentElement.scrollWidth")
        assert wide <= 390, f"{name} is {wide}px wide on a 390px phone"
        found = await axe_problems(phone)
        assert found == [], f"{name} (phone): {found}"
        await shot(phone, f"phone-{name}")
    assert problems == []


async def offer_on_page(gateway: Gateway, page: Page, nc: Client) -> tuple[Handoff, Locator]:
    """A new session open in the page, an offer to the PO made in it, and the offer's
    divider."""
    session = await session_on_page(gateway, page)
    offer = OfferHandoff(
        project_id=gateway.project, session_id=session, from_agent="criativo", to_agent="po"
    )
    offered = await call(nc, subjects.HANDOFFS_OFFER, offer, OfferReply)
    assert offered.handoff is not None
    return offered.handoff, page.locator(f"#handoff-{offered.handoff.id}")


@pytest.mark.timeout(120)
async def test_a_handoff_decided_with_a_double_click_is_decided_once_without_an_error(
    gateway: Gateway, browser: Browsing, nc: Client
) -> None:
    """A double click on Accept decides the offer once: the buttons go with the first
    click, and the person sees the offer accepted, not an `invalid_transition` for a
    second decision of an offer already decided."""
    page = await browser.new_page()
    problems = watch_errors(page)
    _, divider = await offer_on_page(gateway, page, nc)
    await divider.locator("button", has_text="Accept").dblclick()

    accepted = EventType.HANDOFF_ACCEPTED.value
    await page.locator(f'#events li[data-type="{accepted}"]').wait_for(state="attached")
    await divider.filter(has_text="(accepted)").wait_for()
    assert await divider.locator("button").count() == 0
    assert await page.locator("#events li[data-type='handoff.accepted']").count() == 1
    assert (await page.locator("#problem").text_content()) == ""
    assert problems == []


@pytest.mark.timeout(120)
async def test_an_offer_decided_elsewhere_while_shown_here_is_no_error_here(
    gateway: Gateway, browser: Browsing, nc: Client
) -> None:
    """Another tab (or person) accepted the offer, and its event has not reached this page
    yet: Accept here is refused `invalid_transition`, which the page does not show as a
    problem; the event then shows the offer accepted."""
    page = await browser.new_page()
    problems = watch_errors(page)
    hold = True
    held: list[str | bytes] = []
    refused = False
    to_pages: list[WebSocketRoute] = []

    def route(ws: WebSocketRoute) -> None:
        to_pages.append(ws)
        server = ws.connect_to_server()
        ws.on_message(server.send)

        def to_page(message: str | bytes) -> None:
            nonlocal refused
            frame = json.loads(message)
            late = held or frame.get("event", {}).get("type") == "handoff.accepted"
            if hold and frame["type"] == "event" and late:
                held.append(message)  # this page has not heard of it (and what follows) yet
                return
            refused = refused or "invalid_transition" in str(message)
            ws.send(message)

        server.on_message(to_page)

    await page.route_web_socket("**/ws?*", route)
    handoff, divider = await offer_on_page(gateway, page, nc)
    await divider.locator("button", has_text="Accept").wait_for()
    decision = HandoffDecision(handoff_id=handoff.id, session_id=handoff.session_id)
    await call(nc, subjects.HANDOFFS_ACCEPT, decision, AcceptReply)  # the other tab
    await wait_for(lambda: held, what="the acceptance to reach the page's socket")

    await divider.locator("button", has_text="Accept").click()
    await wait_for(lambda: refused, what="the second acceptance to be refused")
    assert await divider.locator("button", has_text="Accept").is_disabled()  # still waiting
    hold = False
    for message in held:  # the acceptance reaches the page, after the refusal
        to_pages[-1].send(message)
    await divider.filter(has_text="(accepted)").wait_for()
    assert await divider.locator("button").count() == 0
    assert (await page.locator("#problem").text_content()) == ""
    assert problems == []
