"""The rules panel in Chromium: the person removes one rule (after a confirm) and edits
another (the corrected text replaces it); after a reload the panel shows only the rules
that stand, as the log holds them."""

from __future__ import annotations

import pytest
from playwright.async_api import Page

from contracts.events import EventType

from .browsing import Browsing, axe_problems, criativo_page, say, shot
from .conftest import Gateway


async def rule_titles(page: Page) -> list[str]:
    return [t.strip() for t in await page.locator("#rules .rule-card h3").all_text_contents()]


@pytest.mark.timeout(180)
async def test_the_person_removes_one_rule_and_corrects_another_and_only_standing_rules_show(
    gateway: Gateway, browser: Browsing
) -> None:
    page, problems = await criativo_page(gateway, browser)
    cards = page.locator("#rules .rule-card")
    # The scripted model records a rule per message, titled with its first six words.
    await say(page, "Orders close at six in the evening")
    await cards.nth(0).wait_for(timeout=30_000)
    await say(page, "Pickup only at the shop counter please")
    await cards.nth(1).wait_for(timeout=30_000)
    assert await rule_titles(page) == [
        "Orders close at six in the",
        "Pickup only at the shop counter",
    ]
    closing, pickup = cards.nth(0), cards.nth(1)
    closing_id = await closing.get_attribute("data-id")

    # Remove asks first; Cancel leaves the rule as it was.
    await pickup.locator("button.remove").click()
    await pickup.locator("form.rule-form", has_text="Remove this rule?").wait_for()
    await pickup.locator("button.cancel").click()
    assert await pickup.locator("form.rule-form").count() == 0
    assert await cards.count() == 2
    await pickup.locator("button.remove").click()
    await pickup.locator("input.reason").fill("we deliver too")
    assert await axe_problems(page) == []
    await pickup.locator("button.confirm-remove").click()
    await page.locator("#rules .rule-card", has_text="Pickup only").wait_for(state="detached")

    # Edit: the corrected rule takes the card's place, under a new id.
    await closing.locator("button.edit").click()
    await closing.locator("input.title").fill("Closing time")
    await closing.locator("textarea.statement-text").fill("Orders close at **seven** on weekdays")
    await shot(page, "rule-being-corrected")
    await closing.locator("button.save").click()
    corrected = page.locator("#rules .rule-card", has_text="Closing time")
    await corrected.wait_for(timeout=30_000)
    assert await rule_titles(page) == ["Closing time"]
    assert await corrected.get_attribute("data-id") != closing_id
    assert await corrected.locator(".statement strong").text_content() == "seven"

    # The log holds the person's retraction and correction, each naming its rule.
    retracted = page.locator(
        f'#events li[data-type="{EventType.ARTIFACT_BUSINESS_RULE_RETRACTED.value}"]'
    )
    await retracted.wait_for(state="attached")
    assert "user:" in (await retracted.text_content() or "")

    # A reload rebuilds the panel from the log: only the standing rule.
    await page.reload()
    await page.locator('#connection[data-state="live"]').wait_for(state="attached")
    await page.locator("#rules .rule-card", has_text="Closing time").wait_for(timeout=30_000)
    await page.locator(
        f'#events li[data-type="{EventType.ARTIFACT_BUSINESS_RULE_RETRACTED.value}"]'
    ).wait_for(state="attached")
    assert await rule_titles(page) == ["Closing time"]
    await shot(page, "rules-after-reload")
    assert problems == []
