"""Branches in Chromium: Edit on a message opens a branch with the edited text, which is
answered there; the switcher goes back to the parent, unchanged, which lists the
branch; Retry on an answer opens a branch that sends the same message again; a
branch shows its parent's handoff offer with nothing to decide there."""

from __future__ import annotations

import pytest

from .browsing import Browsing, chat_texts, criativo_page, responses, say, shot
from .conftest import Gateway


@pytest.mark.timeout(180)
async def test_edit_lands_in_a_branch_and_the_parent_is_unchanged(
    gateway: Gateway, browser: Browsing
) -> None:
    page, problems = await criativo_page(gateway, browser)
    parent = page.url.split("id=")[1]
    await say(page, "uma padaria de bairro")
    await responses(page, 1)
    before = await chat_texts(page)
    assert before[0] == ("user", "uma padaria de bairro")

    await page.locator(".msg-actions .edit").first.click()
    await page.fill(".edit-form textarea", "uma confeitaria")
    await page.click(".edit-form button[type=submit]")
    await page.wait_for_url(lambda url: "id=" in url and parent not in url)
    branch = page.url.split("id=")[1]
    await page.locator('#connection[data-state="live"]').wait_for(state="attached")
    await responses(page, 1)
    in_branch = await chat_texts(page)
    assert [kind for kind, _ in in_branch] == ["user", "agent"]
    assert in_branch[0] == ("user", "uma confeitaria")
    await page.locator("#branches .parent a").wait_for()
    await shot(page, "branch-after-edit")

    # Back to the parent through the switcher: as it was, and it lists the branch.
    await page.click("#branches .parent a")
    await page.wait_for_url(f"**/session.html?id={parent}")
    await responses(page, 1)
    assert await chat_texts(page) == before
    listed = page.locator(f'#branches .branch-list a[href="/session.html?id={branch}"]')
    await listed.wait_for()

    # Retry the parent's answer: a new branch asks the same message again.
    await page.locator(".msg-actions .retry").first.click()
    await page.wait_for_url(lambda url: parent not in url and branch not in url)
    await responses(page, 1)
    assert (await chat_texts(page))[0] == ("user", "uma padaria de bairro")
    assert problems == []


@pytest.mark.timeout(180)
async def test_a_branch_shows_the_parents_offer_without_deciding_it(
    gateway: Gateway, browser: Browsing
) -> None:
    page, problems = await criativo_page(gateway, browser)
    parent = page.url.split("id=")[1]
    await say(page, "uma padaria de bairro")
    await responses(page, 1)
    await page.click("#ready")
    offer = page.locator(".divider", has_text="Handoff: criativo")
    await offer.locator("button", has_text="Accept").wait_for(timeout=30_000)
    await say(page, "com entrega em casa")
    await responses(page, 2)

    # Edit the message after the offer: the branch's log holds a copy of the offer.
    await page.locator(".msg-actions .edit").nth(1).click()
    await page.fill(".edit-form textarea", "só retirada no balcão")
    await page.click(".edit-form button[type=submit]")
    await page.wait_for_url(lambda url: "id=" in url and parent not in url)
    copied = page.locator(".divider", has_text="(offered in the parent session)")
    await copied.wait_for(timeout=30_000)
    assert await copied.locator("button").count() == 0
    await shot(page, "branch-with-the-parents-offer")
    assert problems == []
