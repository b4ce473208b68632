"""The whole story in a real headless Chromium (Debian's, driven by Playwright), on the
scripted model: chat streaming, a rule card, readiness, the brief and the handoff
divider, closing, Insights, and an evidence chip landing on the highlighted event.
Then the page under real use (issue 10): a socket dropped mid-answer, a reload
mid-answer, two messages typed back to back, a message typed while disconnected."""

from __future__ import annotations

import pytest
from nats.aio.client import Client
from playwright.async_api import WebSocketRoute

from contracts.events import EventType
from metering.providers.scripted import Script
from testkit.probes import wait_for

from .browsing import (
    Browsing,
    answered_across_a_drop_and_a_reload,
    append,
    chat_texts,
    criativo_page,
    event_id,
    open_session_page,
    play_deltas,
    responses,
    say,
    session_on_page,
    shot,
    slow_script,
    streamed_words,
    watch_errors,
)
from .conftest import Gateway

# Every length the streaming bubble had: the reply must arrive in several steps.
WATCH_STREAMING = """
window.__lengths = [];
new MutationObserver(() => {
  const live = document.querySelector('.msg.agent.streaming');
  if (live) window.__lengths.push(live.textContent.length);
}).observe(document.getElementById('chat'), {subtree: true, childList: true, characterData: true});
"""


# A message containing SLOW is answered with these words, 25 ms apart (about a second):
# time enough to drop the socket or reload the page in the middle of the answer.
SLOW_ANSWER = " ".join(f"palavra{i}" for i in range(40))


@pytest.fixture
def script() -> Script:
    return slow_script(SLOW_ANSWER)


@pytest.mark.timeout(180)
async def test_the_whole_story_in_a_browser(gateway: Gateway, browser: Browsing) -> None:
    page = await browser.new_page()
    problems = watch_errors(page)
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

    await page.evaluate(
        """window.__writing = false;
        new MutationObserver(() => {
          if (document.querySelector('.brief-writing')) window.__writing = true;
        }).observe(document.getElementById('chat'), {subtree: true, childList: true});"""
    )
    await page.click("#ready")
    await page.locator(".brief").wait_for(timeout=30_000)
    assert await page.evaluate("window.__writing"), "the brief was not shown being written"
    assert await page.locator(".brief-writing").count() == 0  # replaced by the card
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


@pytest.mark.timeout(120)
async def test_an_answer_survives_a_dropped_socket_and_a_reload_whole_and_once(
    gateway: Gateway, browser: Browsing
) -> None:
    page, problems = await criativo_page(gateway, browser)
    await answered_across_a_drop_and_a_reload(
        page, SLOW_ANSWER, ("5-after-reconnect", "6-after-reload")
    )
    assert problems == []


@pytest.mark.timeout(120)
async def test_two_messages_typed_back_to_back_are_each_answered_once_in_order(
    gateway: Gateway, browser: Browsing
) -> None:
    page, _ = await criativo_page(gateway, browser)
    await say(page, "primeiro pedido: entregas na segunda")
    await say(page, "segundo pedido: pagamentos na sexta")
    await responses(page, 2)
    await page.locator(".msg.streaming").first.wait_for(state="detached")
    bubbles = await chat_texts(page)
    # Both were said before the first answer came: the chat shows the log's order.
    said = [text for kind, text in bubbles if kind == "user"]
    assert said == ["primeiro pedido: entregas na segunda", "segundo pedido: pagamentos na sexta"]
    answered = [text for kind, text in bubbles if kind == "agent"]
    async with gateway.http() as http:
        session = page.url.split("id=")[1]
        r = await http.get(f"/api/projects/{gateway.project}/sessions/{session}/events")
        events = r.json()["events"]
    messages = [e["id"] for e in events if e["type"] == EventType.CHAT_MESSAGE.value]
    answers = [e for e in events if e["type"] == EventType.AGENT_RESPONSE.value]
    assert [a["causation_id"] for a in answers] == messages, "not answered in order, once each"
    assert answered == [a["payload"]["text"] for a in answers], "an answer shown twice or lost"
    await shot(page, "7-back-to-back")


@pytest.mark.timeout(120)
async def test_a_message_typed_while_disconnected_is_sent_on_reconnect(
    gateway: Gateway, browser: Browsing
) -> None:
    context = await browser.new_context()
    page = await context.new_page()
    await open_session_page(gateway, page)
    await context.set_offline(True)
    await page.evaluate("window.agentbusConnection.drop()")
    await page.locator('#connection[data-state="reconnecting"]').wait_for(state="attached")
    await say(page, "escrito sem rede")
    pending = page.locator(".msg.user.pending")
    await pending.wait_for()
    assert await pending.text_content() == "escrito sem rede"
    assert await page.input_value("#text") == ""  # in the pending bubble, not lost
    await shot(page, "8-pending-while-offline")
    await context.set_offline(False)
    await page.locator('#connection[data-state="live"]').wait_for(state="attached", timeout=30_000)
    await responses(page, 1)
    assert await pending.count() == 0
    bubbles = await chat_texts(page)
    assert [kind for kind, _ in bubbles] == ["user", "agent"], bubbles
    assert bubbles[0][1] == "escrito sem rede"
    await context.close()


# --- a turn played by the test itself: its deltas on the bus, its outcome in the log ----


@pytest.mark.timeout(60)
async def test_the_brief_is_shown_being_written_then_as_its_card(
    gateway: Gateway, browser: Browsing, nc: Client
) -> None:
    page = await browser.new_page()
    session = await session_on_page(gateway, page)
    await page.click("#ready")
    readiness = await event_id(page, EventType.CRIATIVO_READINESS_CONFIRMED.value)
    words = ['{"title": ', '"Receitas", ', '"summary": ', '"Um app"}']
    await play_deltas(nc, gateway, session, readiness, "criativo.consolidation.1", words)
    writing = page.locator(".brief-writing")
    await writing.filter(has_text="Um app").wait_for()
    assert "Writing the brief" in (await writing.text_content() or "")
    await shot(page, "9-brief-being-written")
    brief: dict[str, object] = {"title": "Receitas", "summary": "Um app de receitas"}
    await append(nc, session, EventType.ARTIFACT_PRODUCT_BRIEF.value, brief, readiness)
    await page.locator(".brief").wait_for()
    assert await writing.count() == 0, "the brief being written was not replaced by its card"
    assert await page.locator(".brief h3").text_content() == "Receitas"
    assert await page.locator(".brief .summary").text_content() == "Um app de receitas"
    assert await page.locator(".brief .brief-state").text_content() == "current"


@pytest.mark.timeout(60)
async def test_stop_in_the_browser_ends_the_answer_where_it_was(
    gateway: Gateway, browser: Browsing
) -> None:
    page, _ = await criativo_page(gateway, browser)
    assert await page.locator("#stop").is_hidden()  # nothing streams yet
    await say(page, "SLOW")
    await streamed_words(page, 5)
    await page.click("#stop")
    answer = page.locator(".msg.agent.stopped")
    await answer.wait_for(timeout=30_000)
    text = (await answer.locator(".text").text_content()) or ""
    assert text and SLOW_ANSWER.startswith(text) and text != SLOW_ANSWER, text
    assert (await answer.text_content()) == f"{text} (stopped)"
    assert await page.locator("#stop").is_hidden()
    assert await page.locator(".msg.streaming").count() == 0
    await shot(page, "10-stopped-answer")


@pytest.mark.timeout(120)
async def test_a_message_sent_into_a_dead_socket_survives_a_reload_and_is_sent_once(
    gateway: Gateway, browser: Browsing
) -> None:
    """The socket looks open but nothing answers (a half-dead network): the message waits
    as pending, is kept across a reload, and is sent again from the reloaded page."""
    page = await browser.new_page()
    blocked = True

    def route(ws: WebSocketRoute) -> None:
        if not blocked:
            ws.connect_to_server()  # forwarded both ways

    await open_session_page(gateway, page)
    await page.route_web_socket("**/ws?*", route)
    await page.evaluate("window.agentbusConnection.drop()")
    await page.locator('#connection[data-state="connecting"]').wait_for(state="attached")
    await say(page, "dito para o vazio")
    await page.locator(".msg.user.pending").wait_for()
    blocked = False
    await page.reload()
    await page.locator('#connection[data-state="live"]').wait_for(state="attached")
    await responses(page, 1)
    bubbles = await chat_texts(page)
    assert bubbles[0] == ("user", "dito para o vazio") and [k for k, _ in bubbles] == [
        "user",
        "agent",
    ], bubbles
    assert await page.locator(".msg.pending").count() == 0
    said = EventType.CHAT_MESSAGE.value
    assert await page.locator(f'#events li[data-type="{said}"]').count() == 1
